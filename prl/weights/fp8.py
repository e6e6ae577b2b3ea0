"""FP8 on the wire: a step for servers of a block-FP8 checkpoint carries each weight vLLM keeps in FP8 as
float8_e4m3fn blocks and their float32 `weight_scale_inv`, as the checkpoint stores them (docs/weights.md, "FP8").

    blocks = Blocks.of(config)                 # None: the model is not stored block-FP8 (the step goes as it is)
    blocks = blocks_of(model_dir)              # the same from a model directory's config.json (ConfigError)
    blocks.quantised(name)                     # does vLLM keep this checkpoint tensor in FP8?
    q, scale_inv = quantise(weight, blocks)    # a 2-D weight -> its e4m3 blocks and one scale per block
    weight = dequantise(q, scale_inv, blocks)  # and back (what vLLM's kernels compute with)
    step_layout(layout, blocks)                # the names, shapes and dtypes a step carries

Which tensors: vLLM 0.32's Fp8 method (`model_executor/layers/quantization/fp8.py`, `Fp8Config.get_quant_method`)
quantises every linear layer (`LinearBase`) and every MoE expert (`RoutedExperts`) the checkpoint does not list in
`ignored_layers` (or `modules_to_not_convert`); the embedding, the LM head, norms, biases and the router score
bias stay in the model's dtype. The MoE router gate is a linear layer that only some families hand the quant
config (`qwen3_moe`'s `GateLinear` gets it; `deepseek_v3`'s, `mixtral`'s and `qwen2_moe`'s do not), so it is
quantised for those only. The arithmetic is vLLM's `per_block_cast_to_fp8` (`vllm/utils/deep_gemm.py`, what
its online block quantisation runs): a block's scale is its absolute maximum (at least 1e-4) over 448, a
partial block at an edge is padded with zeros, the scale tensor is `[ceil(rows / 128), ceil(cols / 128)]`.

Torch is imported inside the functions that touch tensors: the planner imports this module.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from prl.errors import ConfigError

SCALE_SUFFIX = "_scale_inv"
"""A quantised weight `X.weight` travels with `X.weight_scale_inv` (the name DeepSeek-V3's release and vLLM use)."""
FP8_MAX = 448.0
"""The largest float8_e4m3fn value (`torch.finfo(torch.float8_e4m3fn).max`, vLLM's fp8 max on CUDA and CPU)."""
MIN_AMAX = 1e-4
"""A block's absolute maximum is clamped to at least this (vLLM's `per_block_cast_to_fp8`): an all-zero block
gets a finite scale."""
FP8_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "kimi_k2"})
"""Families (config.json `model_type`) whose vLLM 0.32 models were read for which layers get the quant config
(the families prl/weights/slices.py slices)."""
QUANTISED_ROUTERS = frozenset({"qwen3_moe"})
"""Families whose MoE router gate vLLM builds with the quant config (so the checkpoint stores it in FP8 unless
it lists the gate in `modules_to_not_convert`, as Qwen's FP8 releases do)."""

_LINEAR = re.compile(r"(?:^|\.)layers\.\d+\..*\.(?:q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa"
                     r"|kv_b_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_ROUTER = re.compile(r"(?:^|\.)layers\.\d+\.(?:mlp|block_sparse_moe)\.gate\.weight$")
_EXPERTS = re.compile(r"^(.*\.experts)\.\d+\.")


@dataclass(frozen=True)
class Blocks:
    """A checkpoint stored block-FP8 (config.json `quantization_config`: `quant_method: fp8` with a
    `weight_block_size`), as vLLM 0.32 loads it."""

    rows: int
    cols: int
    """The block: `weight_block_size` [rows, cols] (DeepSeek-V3 and Kimi-K2: [128, 128])."""
    ignored: frozenset[str] = frozenset()
    """Modules kept in the model's dtype (`ignored_layers`, else `modules_to_not_convert`), by checkpoint prefix."""
    router: bool = False
    """The family quantises its MoE router gate (QUANTISED_ROUTERS)."""
    ue8m0: bool = False
    """`scale_fmt: ue8m0` (DeepSeek-V3.1): each scale rounded up to a power of two, still stored as float32."""

    @classmethod
    def of(cls, config: Mapping) -> Optional[Blocks]:
        """The blocks of a model's config.json; None when it is not stored block-FP8. ValueError naming the field
        for a block-FP8 config prl cannot quantise for (vLLM refuses it, or a family whose layers were not read)."""
        quant = config.get("quantization_config")
        if not isinstance(quant, Mapping) or quant.get("quant_method") != "fp8" or not quant.get("weight_block_size"):
            return None
        block = quant["weight_block_size"]
        if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size must be two positive integers, not {block!r}")
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("quantization_config.activation_scheme must be dynamic with weight_block_size "
                             "(vLLM refuses static activation scales for block FP8)")
        family = config.get("model_type")
        if family not in FP8_FAMILIES:
            raise ValueError(f"config.json model_type {family!r}: prl quantises block-FP8 steps for "
                             f"{', '.join(sorted(FP8_FAMILIES))} only (the layers vLLM quantises were read for those)")
        ignored = quant.get("ignored_layers") or quant.get("modules_to_not_convert") or []
        return cls(block[0], block[1], frozenset(ignored), family in QUANTISED_ROUTERS,
                   quant.get("scale_fmt") == "ue8m0")

    @property
    def block(self) -> tuple[int, int]:
        return self.rows, self.cols

    def quantised(self, name: str) -> bool:
        """vLLM keeps checkpoint tensor `name` in FP8 (a linear layer's or an expert's weight, not ignored)."""
        if not (_LINEAR.search(name) or (self.router and _ROUTER.search(name))):
            return False
        module = name.removesuffix(".weight")
        experts = _EXPERTS.match(module)  # vLLM asks about the experts' layer as a whole
        return module not in self.ignored and not (experts and experts.group(1) in self.ignored)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The scale tensor of a weight of `shape`: one float32 per block, partial edge blocks included."""
        return -(-shape[0] // self.rows), -(-shape[1] // self.cols)


def blocks_of(model_dir: str | Path) -> Optional[Blocks]:
    """The blocks of the model in `model_dir` (its config.json; None: not stored block-FP8); ConfigError naming
    the file where prl cannot quantise for it."""
    config = Path(model_dir) / "config.json"
    try:
        return Blocks.of(json.loads(config.read_text()))
    except ValueError as exc:
        raise ConfigError(f"{config}: {exc}") from None


def scale_name(name: str) -> str:
    """The scale tensor's name of quantised weight `name` (`X.weight` -> `X.weight_scale_inv`)."""
    return name + SCALE_SUFFIX


def weight_of(name: str) -> Optional[str]:
    """The weight a scale tensor `name` belongs to; None for a name that is no scale."""
    return name.removesuffix(SCALE_SUFFIX) if name.endswith(".weight" + SCALE_SUFFIX) else None


def step_layout(layout: Mapping[str, tuple[int, ...]], blocks: Blocks) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype, shape) of what a step carries for a model of `layout` (name -> shape: the trainer's names,
    or a block-FP8 checkpoint's with its scales): each quantised weight as float8_e4m3fn beside its float32 scale,
    the rest as "model" (the model's dtype)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape in layout.items():
        if weight_of(name) in layout:
            continue  # a checkpoint stored in FP8 lists its scales already: they are its weights'
        if blocks.quantised(name) and len(shape) == 2:
            out[name] = ("float8_e4m3fn", tuple(shape))
            out[scale_name(name)] = ("float32", blocks.scale_shape(tuple(shape)))
        else:
            out[name] = ("model", tuple(shape))
    return out


def step_bytes(layout: Mapping[str, tuple[str, tuple[int, ...]]], model_bytes: int) -> dict[str, int]:
    """Bytes of one element of each tensor of a `step_layout` (FP8 1, scales 4, the rest `model_bytes`)."""
    size = {"float8_e4m3fn": 1, "float32": 4, "model": model_bytes}
    return {name: size[dtype] for name, (dtype, _) in layout.items()}


def quantise(weight, blocks: Blocks):
    """(float8_e4m3fn weight, float32 scale_inv) of a 2-D `weight`, block by block, as vLLM's
    `per_block_cast_to_fp8` computes them: dequantised, `q * scale_inv` per block is the weight within FP8's
    rounding."""
    import torch

    rows, cols = weight.shape
    padded = torch.zeros((-(-rows // blocks.rows) * blocks.rows, -(-cols // blocks.cols) * blocks.cols),
                         dtype=weight.dtype, device=weight.device)
    padded[:rows, :cols] = weight
    view = padded.view(-1, blocks.rows, padded.size(1) // blocks.cols, blocks.cols)
    scale = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(MIN_AMAX) / FP8_MAX
    if blocks.ue8m0:
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale.abs())))
    q = (view * (1.0 / scale)).to(torch.float8_e4m3fn)
    return q.view_as(padded)[:rows, :cols].contiguous(), scale.view(view.size(0), view.size(2))


def dequantise(q, scale_inv, blocks: Blocks, dtype: Any = None):
    """The weight that `q` (float8_e4m3fn) and its per-block `scale_inv` stand for, in `dtype` (float32 default)."""
    import torch

    rows, cols = q.shape
    scale = scale_inv.float().repeat_interleave(blocks.rows, 0)[:rows].repeat_interleave(blocks.cols, 1)[:, :cols]
    return (q.float() * scale).to(dtype or torch.float32)


def quantise_step(tensors: Iterable[tuple[str, Any]], blocks: Blocks) -> list[tuple[str, Any]]:
    """A step's (name, tensor) pairs as the servers of a block-FP8 checkpoint load them: each quantised 2-D weight
    replaced by its FP8 blocks followed by its scale, the rest as they are."""
    out = []
    for name, tensor in tensors:
        if blocks.quantised(name) and tensor.dim() == 2:
            q, scale = quantise(tensor, blocks)
            out += [(name, q), (scale_name(name), scale)]
        else:
            out.append((name, tensor))
    return out


def scale_slice_bounds(start: int, end: int, size: int, block: int, what: str) -> tuple[int, int]:
    """The scale rows (or columns) `[start / block, ceil(end / block))` that go with a weight's `[start, end)` of
    `size` along one dimension; ValueError where a bound falls inside a block (vLLM refuses such a server:
    `validate_fp8_block_shape`), but a shard ending at the weight's own edge may end in a partial block."""
    if start % block or (end % block and end != size):
        raise ValueError(f"{what}: the shard [{start}, {end}) of {size} does not fall on {block}-wide FP8 blocks "
                         f"(vLLM refuses such a server)")
    return start // block, math.ceil(end / block)
