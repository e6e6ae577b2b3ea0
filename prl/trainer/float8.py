"""`trainer.precision: fp8`: the transformer blocks' linear layers compute their matmuls in float8.

torchao's `Float8Linear` (the `fp8` extra, `torchao==0.18.0`) replaces each chosen `nn.Linear` in place: its
weight stays a plain parameter under the same name (fp32 master copy, bf16 as FSDP2 gathers it on a GPU), and
each forward casts input and weight to e4m3 with one dynamic scale per tensor, the backward the output's
gradient to e5m2, and the three matmuls run as `torch._scaled_mm` (FP8 tensor cores on Hopper/Ada/Blackwell;
on CPU torch runs the same casts and products in software: for checking numerics, not for speed).

Which layers: every `nn.Linear` inside a transformer block (attention projections, dense MLPs, shared experts)
whose two dimensions are multiples of 16 (`_scaled_mm` needs it). Not the embeddings and `lm_head` (the logprobs
the RL loss compares with vLLM's), not MoE routers (a rounded router logit changes which experts a token
gets), not the routed experts (transformers 5 keeps them as 3-D grouped weights, not linear layers). The
number of tokens, the matmul's inner dimension in the weight gradient, is padded to a multiple of 16
(`pad_inner_dim`): a packed micro-batch has any number of tokens. With FSDP2 over more than one shard, the
weights are also all-gathered in float8 (half of bf16's bytes), each rank's shard scaled by the whole weight's
amax: at the first step an all-reduce per layer finds it as the layer gathers, after every optimizer step one
all-reduce for all layers computes the next step's (`after_optimizer_step`).

Refused by the planner where it was not measured (prl/planner/capabilities.py): LoRA, vision-language models,
and GPU clusters whose profile does not say `gpu_node.fp8: true`.
"""

from __future__ import annotations

import torch

from prl.errors import ConfigError

ROUTER_NAMES = frozenset({"gate", "router"})
"""Last name of a router's linear layer in the MoE families (`mlp.gate`, GPT-OSS's `mlp.router`)."""
_ALIGNMENT = 16


def converts(module: torch.nn.Module, name: str) -> bool:
    """Whether a linear layer inside a transformer block computes in float8."""
    return (type(module) is torch.nn.Linear and name.rpartition(".")[2] not in ROUTER_NAMES
            and module.in_features % _ALIGNMENT == 0 and module.out_features % _ALIGNMENT == 0)


def gathers_float8(mesh) -> bool:
    """Whether FSDP2 all-gathers the float8 layers' weights in float8: when a weight has more than one shard
    (the dense FSDP mesh's last dimension, dp_shard * cp ranks; dp_replicate holds whole copies)."""
    return mesh.size(mesh.ndim - 1) > 1


def convert_blocks(blocks: list[torch.nn.Module], gather_float8: bool) -> int:
    """Swap the chosen linear layers of each block for torchao's Float8Linear, in place (works on a meta-device
    model); return how many. `gather_float8`: FSDP2 all-gathers their weights in float8 (`gathers_float8`)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ConfigError(f"trainer.precision: fp8 needs torchao on the trainer's nodes "
                          f"(pip install 'prl[fp8]'): {e}") from None
    config = Float8LinearConfig(pad_inner_dim=True, enable_fsdp_float8_all_gather=gather_float8)
    before = sum(isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear for b in blocks for m in b.modules())
    for block in blocks:
        convert_to_float8_training(block, module_filter_fn=converts, config=config)
    return sum(isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear
               for b in blocks for m in b.modules()) - before


def after_optimizer_step(model: torch.nn.Module) -> None:
    """With float8 all-gather: compute every sharded float8 weight's scale for the next forward (one all-reduce
    of the amaxes for the whole model instead of one per layer inside the forward)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
