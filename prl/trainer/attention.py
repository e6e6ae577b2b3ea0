"""Packed attention: each sample of a packed micro-batch attends causally to itself only, with no [T, T] mask.

A packed row holds several samples back to back; their position ids restart at 0 (prl/run/batch.py), so the
boundaries are `cu_seqlens` = [0, end of sample 0, end of sample 1, ..., T]. transformers' own sdpa path turns
such a row into a dense block-diagonal [T, T] mask and attends over all T^2 pairs; here every kernel sees the
boundaries instead, and the work is the sum of the samples' squares.

Kernels (`choose_kernel` picks one per device and dtype, logged once):

| kernel | where | how |
|---|---|---|
| `flash` | CUDA, bf16/fp16, `flash_attn` installed | `flash_attn_varlen_func` on [T, heads, D] with `cu_seqlens` |
| `varlen` | CUDA, bf16/fp16, no `flash_attn` | torch's `torch.nn.attention.varlen.varlen_attn` (same layout) |
| `per_sample` | CPU; CUDA in fp32 | one causal `scaled_dot_product_attention` call per sample |
| `dense` | reference only (tests, benchmarks) | sdpa with the [T, T] block-causal mask: what transformers builds |

On CPU, `flex_attention` with a document block mask was the other candidate; torch 2.13 refuses its backward on
CPU ("FlexAttention does not support backward on CPU"), so it cannot train there. `per_sample` vs `dense` on
one CPU layer's attention (4 heads, 2 kv heads, head_dim 64, forward + backward): 4 x 1024-token samples in a
4096 row 0.47-0.91 s vs 1.09-1.26 s; 16 x 1024 in a 16384 row 0.47-0.73 s vs 9.8-12.7 s.

Seam: transformers' attention registry. `install_packed(model)` registers `packed_attention_forward` under
`ATTN_NAME` (and a mask function that builds no mask) and selects it; the trainer passes the row's boundaries
through the model's forward as transformers' own packed-sequence kwargs (`boundary_kwargs`: `cu_seq_lens_q`,
`cu_seq_lens_k`, `max_length_q`, `max_length_k`), which reach every attention layer. Context parallelism
(prl/trainer/context_parallel.py) calls `packed_attention` on the full sequence after its all-to-all, with the
full row's boundaries.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from prl.log import get_logger

ATTN_NAME = "prl_packed"
KERNELS = ("flash", "varlen", "per_sample", "dense")

log = get_logger(__name__)


def cu_seqlens_of(position_ids: torch.Tensor) -> torch.Tensor:
    """[samples + 1] int32 sample boundaries of a packed row whose position ids restart at 0 per sample.

    A row that does not start at position 0 (a context-parallel chunk) counts its first part as a sample.
    """
    starts = torch.nonzero(position_ids == 0).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    end = starts.new_full((1,), position_ids.shape[0])
    return torch.cat([starts, end]).to(torch.int32)


def boundary_kwargs(position_ids: torch.Tensor) -> dict:
    """transformers' packed-sequence kwargs of one packed row (the model's forward passes them to attention)."""
    cu = cu_seqlens_of(position_ids.cpu())
    longest = int((cu[1:] - cu[:-1]).max())
    cu = cu.to(position_ids.device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def block_causal_mask(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[T, T] bool: i attends to j iff j <= i and both are in the same sample (the `dense` reference)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().cpu()
    sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths).to(device)
    idx = torch.arange(sample.shape[0], device=device)
    return (sample[:, None] == sample[None, :]) & (idx[None, :] <= idx[:, None])


def _per_sample(q, k, v, cu_seqlens, max_len, scale):
    """[1, H, T, D] in and out: one causal sdpa call per sample."""
    bounds = cu_seqlens.tolist()
    gqa = q.shape[1] != k.shape[1]
    parts = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scale,
                                            enable_gqa=gqa)
             for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # one sample: no copy


def _dense(q, k, v, cu_seqlens, max_len, scale):
    mask = block_causal_mask(cu_seqlens, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def varlen_layout(kernel: Callable) -> Callable:
    """A [T, heads, D] varlen kernel `kernel(q, k, v, cu, max_len, scale)` as a [1, heads, T, D] one."""

    def run(q, k, v, cu_seqlens, max_len, scale):
        flat = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]  # [T, heads, D]
        out = kernel(*flat, cu_seqlens.to(device=q.device, dtype=torch.int32), int(max_len), scale)
        return out.transpose(0, 1).unsqueeze(0)

    return run


@functools.cache
def _varlen_takes_gqa() -> bool:
    """Whether this torch's `varlen_attn` groups query heads over KV heads itself (`enable_gqa`: torch 2.13; the
    2.11 of some GPU images has `window_size` but not it)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _torch_varlen(q, k, v, cu, max_len, scale):
    from torch.nn.attention.varlen import varlen_attn

    grouped = q.shape[1] != k.shape[1]
    if grouped and not _varlen_takes_gqa():
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        grouped = False
    gqa = {"enable_gqa": True} if grouped else {}
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0), **gqa)


def _flash_varlen(q, k, v, cu, max_len, scale):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale, causal=True)


_KERNELS: dict[str, Callable] = {
    "flash": varlen_layout(_flash_varlen),
    "varlen": varlen_layout(_torch_varlen),
    "per_sample": _per_sample,
    "dense": _dense,
}


@functools.cache
def choose_kernel(device_type: str, dtype: torch.dtype) -> str:
    """The kernel for q/k/v on `device_type` in `dtype` (module doc); logged the first time."""
    kernel = "per_sample"
    if device_type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        try:
            import flash_attn  # noqa: F401

            kernel = "flash"
        except ImportError:
            from torch.nn.attention import varlen

            kernel = "varlen" if hasattr(varlen, "varlen_attn") else "per_sample"
    log.info("packed attention on %s/%s: %s kernel", device_type, str(dtype).removeprefix("torch."), kernel)
    return kernel


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                     scale: float | None = None, kernel: str | None = None) -> torch.Tensor:
    """Causal attention within each packed sample: q [1, H, T, D], k/v [1, H_kv, T, D] -> [1, H, T, D]."""
    if q.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row (batch 1), got batch {q.shape[0]}")
    name = kernel or choose_kernel(q.device.type, q.dtype)
    return _KERNELS[name](q, k, v, cu_seqlens, max_len, scale)


def boundaries_from(kwargs: dict, position_ids: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The row's (cu_seqlens, longest sample) from the forward's kwargs, else from its position ids."""
    if kwargs.get("cu_seq_lens_k") is not None:
        return kwargs["cu_seq_lens_k"], int(kwargs["max_length_k"])
    if position_ids is None:
        raise ValueError("packed attention needs cu_seq_lens_k/max_length_k or position_ids")
    b = boundary_kwargs(position_ids.reshape(-1))
    return b["cu_seq_lens_k"], b["max_length_k"]


def packed_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             sliding_window=None, **kwargs):
    """transformers attention interface: q/k/v [1, heads, T, D] in, [1, T, heads, D] out; no mask is read."""
    if sliding_window is not None:
        raise ValueError("packed attention has no sliding window; install_packed leaves such models on sdpa")
    if dropout:
        raise ValueError("packed attention does not apply attention dropout; train with attention_dropout 0")
    cu, longest = boundaries_from(kwargs, kwargs.get("position_ids"))
    out = packed_attention(query, key, value, cu, longest, scaling)
    return out.transpose(1, 2).contiguous(), None


def has_sliding_window(model: torch.nn.Module) -> bool:
    text = model.config.get_text_config()
    return "sliding_attention" in (getattr(text, "layer_types", None) or ())


def install_packed(model: torch.nn.Module) -> bool:
    """Register and select packed attention on `model`, and run its recurrent mixers per sample
    (prl/trainer/recurrent.py); False (transformers' sdpa kept) for sliding-window models."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from prl.trainer import recurrent

    recurrent.install(model)
    if has_sliding_window(model):
        log.info("%s has sliding-window layers: attention stays transformers' sdpa with a dense mask",
                 type(model).__name__)
        return False
    AttentionInterface.register(ATTN_NAME, packed_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, lambda *args, **kwargs: None)  # the boundaries replace it
    model.set_attn_implementation(attn_choice(model.config))
    return True


def attn_choice(config, name: str = ATTN_NAME) -> str | dict[str, str]:
    """Attention `name` (packed, or Ulysses under cp) for the language model; a vision-language model's other
    towers (an image encoder attends over all of an image's patches, with no causal order, no packed samples
    and no cp split) keep sdpa."""
    subs = list(getattr(config, "sub_configs", None) or {})
    if "vision_config" not in subs:
        return name
    return {key: name if key == "text_config" else "sdpa" for key in subs} | {"": name}
