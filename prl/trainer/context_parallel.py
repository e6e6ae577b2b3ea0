"""Context parallelism (CP): one packed micro-batch's sequence split over the cp ranks, Ulysses style.

Why Ulysses and not ring attention: the only sequence-mixing op is attention, and Ulysses keeps
it whole. Each cp rank holds T/cp consecutive positions; inside every attention layer an
all-to-all turns [heads, T/cp] into [heads/cp, T] (all positions, a slice of the heads), the
rank runs ordinary attention over the full sequence for its heads, and a second all-to-all
turns the result back. So any mask works unchanged, in particular the block-diagonal causal
mask of packed samples (position ids restart at 0 per sample): ring attention would have to
re-derive it per block pair and skip blocks, and it needs its own kernel. The costs: cp must
divide the number of attention heads (checked at plan time, prl/planner/capabilities.py), and
two all-to-alls of activations per layer.

Fewer key/value heads than cp (one KV head and cp=2; Qwen3-30B-A3B's 4 and cp=8): before the
all-to-all each KV head is repeated `kv_repeat` times, the fewest copies that make their count a
multiple of cp while every copy still serves whole groups of query heads (r divides
heads / kv_heads; r = heads / kv_heads, plain multi-head attention, always does). Copy j*r + i
of KV head j serves the i-th 1/r of its query group, so each rank's query heads find their KV
heads on that rank. The repeat is an autograd expand: the copies' gradients sum back into the
one KV head. It costs r times the KV all-to-all traffic, nothing else.

Everything outside attention is per-position (projections, RoPE with each rank's own position
ids, norms, MLP/MoE, logits, loss), so each rank computes it on its own positions only. The
trainer shifts labels on the whole sequence before splitting (`prepare` in prl/trainer/engine.py),
pads the sequence to a multiple of cp with masked positions, and counts loss tokens per position once,
so the loss normalisation N is unchanged.

Use: `install_ulysses(model, cp)` once (registers the attention function with transformers and
selects it), then run each micro-batch's forward and backward inside
`ulysses_context(group, full_position_ids)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from prl.trainer.moe import all_to_all

ATTN_NAME = "prl_ulysses"
_active: dict = {}


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[T, T] bool: i attends to j iff j <= i and both are in the same packed sample (positions restart at 0)."""
    sample = torch.cumsum((position_ids == 0).long(), dim=0)
    idx = torch.arange(position_ids.shape[0], device=position_ids.device)
    return (sample[:, None] == sample[None, :]) & (idx[None, :] <= idx[:, None])


def _seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[B, H, T/cp, D] (all heads, local positions) -> [B, H/cp, T, D] (local heads, all positions)."""
    b, h, t, d = x.shape
    send = x.reshape(b, cp, h // cp, t, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = all_to_all(send, [1] * cp, [1] * cp, group)  # [source = position chunk, B, H/cp, T/cp, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)


def _heads_to_seq(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[B, H/cp, T, D] -> [B, H, T/cp, D]: the inverse of `_seq_to_heads`."""
    b, h, t, d = x.shape
    send = x.reshape(b, h, cp, t // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = all_to_all(send, [1] * cp, [1] * cp, group)  # [source = head chunk, B, H/cp, T/cp, D]
    return recv.permute(1, 0, 2, 3, 4).reshape(b, h * cp, t // cp, d)


def kv_repeat(heads: int, kv_heads: int, cp: int) -> int:
    """Copies of each KV head so that cp divides their count and each copy serves whole query-head groups."""
    group = heads // kv_heads
    return next(r for r in range(1, group + 1) if group % r == 0 and (kv_heads * r) % cp == 0)


def _repeat_heads(x: torch.Tensor, r: int) -> torch.Tensor:
    """[B, H, T, D] -> [B, H*r, T, D], head j becoming heads j*r .. j*r + r - 1 (transformers' repeat_kv)."""
    if r == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, r, t, d).reshape(b, h * r, t, d)


def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface: q/k/v [B, heads, T/cp, D] in, [B, T/cp, heads, D] out.

    The mask transformers built for the local positions is ignored: the full sequence's
    block-causal mask comes from `ulysses_context`.
    """
    if not _active:
        raise RuntimeError("ulysses_attention called outside ulysses_context (the trainer sets it per micro-batch)")
    group, cp, mask = _active["group"], _active["cp"], _active["mask"]
    r = kv_repeat(query.shape[1], key.shape[1], cp)
    key, value = _repeat_heads(key, r), _repeat_heads(value, r)
    q, k, v = (_seq_to_heads(t, group, cp) for t in (query, key, value))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
    )
    return _heads_to_seq(out, group, cp).transpose(1, 2).contiguous(), None


def install_ulysses(model: torch.nn.Module, cp: int) -> None:
    """Register and select the Ulysses attention on `model` (all its attention layers).

    Refuses (ConfigError) a cp that does not divide the attention heads (KV heads are repeated, `kv_repeat`).
    """
    from transformers import AttentionInterface

    from prl.errors import ConfigError

    text = model.config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % cp or heads % kv_heads:
        raise ConfigError(
            f"trainer.cp({cp}) must divide num_attention_heads({heads}) (Ulysses splits the heads over the cp "
            f"ranks; num_key_value_heads({kv_heads}) must divide it too); use a cp that divides {heads}"
        )
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTN_NAME, ulysses_attention)
    # No per-rank mask: ulysses_attention builds the full sequence's own.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, lambda *args, **kwargs: None)
    model.set_attn_implementation(ATTN_NAME)


@contextlib.contextmanager
def ulysses_context(group, cp: int, full_position_ids: torch.Tensor) -> Iterator[None]:
    """Within: attention layers use the full sequence's mask (forward, and recomputation in backward)."""
    _active.update(group=group, cp=cp, mask=block_causal_mask(full_position_ids))
    try:
        yield
    finally:
        _active.clear()


def split_for_cp(t: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """This rank's consecutive 1/cp of a sequence whose length is a multiple of cp."""
    n = t.shape[0] // cp
    return t[cp_rank * n : (cp_rank + 1) * n]
