"""Router replay (`training.router_replay`): each token goes to the experts the inference server chose for it.

An MoE router's top-k is discontinuous: where two experts' scores are nearly equal, the trainer's numerics (its
dtype, kernels, batch shapes) and vLLM's can pick different experts for the same token, and that token's
logprob then differs by far more than rounding. Replay removes that source of train/inference mismatch: the
server returns the experts of every token (prl/inference/worker.py `RouteCapture`), the batch carries them
(`routed_experts` [T, layers, k], prl/run/batch.py) and the trainer's routers take those ids instead of their
own top-k. The routing *weights* are still the trainer's own, read from its scores at the replayed experts, so
the router keeps learning (its gradient flows through them).

One mechanism for every family (no per-family code, as for expert parallelism in prl/trainer/moe.py): every
transformers 5 MoE router picks its experts with `torch.topk(scores, top_k)` over the expert dimension
(Qwen3-MoE, Qwen3.5-MoE, Mixtral, OLMoE, Qwen2-MoE: softmax probabilities; DeepSeek-V3 and GLM-4.5: sigmoid
scores plus the correction bias, after the group-limited mask; GPT-OSS: the logits) and then takes the weights
from the returned values or gathers them at the returned ids. `install` wraps the forward of each MoE block (the
parent of a fused experts module); while a block runs with routes set, `torch.topk` over [tokens, num_experts]
with k = top_k returns the replayed ids, and the scores at them as values. Tokens without routes (mask 0) keep
the router's own choice. Other top-k calls (DeepSeek's group selection, over [tokens, n_group]) pass through.

The routes stay set from one micro-batch's forward until the next one's, so activation checkpointing's
recomputation in the backward pass routes as the forward did.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from prl.errors import ConfigError
from prl.trainer.moe import is_fused_experts

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class Replay:
    """The routes of the micro-batch in flight: [tokens, layers, k] expert ids and [tokens] bool (None: own)."""

    routes: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    replayed: int = 0
    """Top-k calls answered with replayed ids since `install` (tests read it)."""


def install(model: nn.Module) -> Replay:
    """Make every MoE block of `model` route by the replayed experts when `set_routes` gave some; the state."""
    state = Replay()
    blocks = 0
    for name, module in list(model.named_modules()):
        if not is_fused_experts(module):
            continue
        parent_name = name.rpartition(".")[0]
        layer = _LAYER.search(name)
        if layer is None:
            raise ConfigError(f"training.router_replay: cannot tell the decoder layer of MoE experts {name}")
        block = model.get_submodule(parent_name)
        block.forward = _replaying(block.forward, int(layer.group(1)), int(module.num_experts), state)
        blocks += 1
    if not blocks:
        raise ConfigError(f"training.router_replay needs an MoE model; {type(model).__name__} has no experts module")
    model._prl_replay = state
    return state


def set_routes(model: nn.Module, routes: torch.Tensor | None, mask: torch.Tensor | None) -> None:
    """The routes the next forward (and its recomputation in backward) replays; no-op without `install`."""
    state = getattr(model, "_prl_replay", None)
    if state is not None:
        state.routes = None if routes is None else routes.long()
        # Every token replayed (the usual case): no mask, so the routers' own top-k is never computed.
        state.mask = None if mask is None or bool(mask.all()) else mask.bool()


def _replaying(forward, layer: int, num_experts: int, state: Replay):
    def block_forward(*args, **kwargs):
        if state.routes is None:
            return forward(*args, **kwargs)
        with forced_topk(state.routes[:, layer], state.mask, num_experts, state):
            return forward(*args, **kwargs)

    return block_forward


@contextmanager
def forced_topk(ids: torch.Tensor, mask: torch.Tensor | None, num_experts: int, state: Replay | None = None):
    """Within the block, `torch.topk(scores [T, num_experts], k=ids.shape[1])` answers `ids` where `mask` is
    set (the values: `scores` at those ids); every other call is torch's own."""
    own = torch.topk
    tokens, k = ids.shape

    def topk(input, k_arg=None, dim=-1, largest=True, sorted=True, *, k=None, out=None):
        k_value = k_arg if k_arg is not None else k
        if (out is None and input.dim() == 2 and dim in (-1, 1) and k_value == ids.shape[1] and largest
                and input.shape == (tokens, num_experts)):
            chosen = ids.to(input.device)
            if mask is not None:
                chosen = torch.where(mask.to(input.device)[:, None], chosen, own(input, k_value, dim=-1)[1])
            if state is not None:
                state.replayed += 1
            return torch.return_types.topk((input.gather(-1, chosen), chosen))
        kw = {} if out is None else {"out": out}
        return own(input, k_value, dim=dim, largest=largest, sorted=sorted, **kw)

    torch.topk = topk
    try:
        yield
    finally:
        torch.topk = own
