"""Context parallelism (CP): one packed micro-batch's sequence split over the cp ranks, Ulysses style.

Why Ulysses and not ring attention: the only sequence-mixing op is attention, and Ulysses keeps
it whole. Each cp rank holds T/cp consecutive positions; inside every attention layer an
all-to-all turns [heads, T/cp] into [heads/cp, T] (all positions, a slice of the heads), the
rank runs the packed attention kernel (prl/trainer/attention.py) over the full sequence for its
heads, with the packed samples' boundaries (position ids restart at 0 per sample), and a second
all-to-all turns the result back. Ring attention would have to re-derive the samples' block-diagonal
causal pattern per block pair and skip blocks, and it needs its own kernel. The costs: cp must
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
trainer shifts labels on the whole sequence before splitting (`micro_batch_inputs` in prl/trainer/engine.py),
pads the sequence to a multiple of cp with masked positions, and counts loss tokens per position once,
so the loss normalisation N is unchanged.

Use: `install_ulysses(model, cp, group)` once (registers the attention function with transformers and
selects it), then pass the full row's boundaries (`prl.trainer.attention.boundary_kwargs` of the full position
ids) to every forward: after the all-to-all each rank attends over the whole sequence for its heads with the
packed kernel (prl/trainer/attention.py), so no [T, T] mask is built.
"""

from __future__ import annotations

import functools

import torch

from prl.trainer.attention import attn_choice, packed_attention
from prl.trainer.moe import all_to_all

ATTN_NAME = "prl_ulysses"


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


def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, group, cp: int,
                      **kwargs):
    """transformers attention interface: q/k/v [B, heads, T/cp, D] in, [B, T/cp, heads, D] out.

    The mask transformers would build for the local positions is not built (see `install_ulysses`); the
    boundaries are the full row's (`cu_seq_lens_k`, `max_length_k` in the forward's kwargs).
    """
    if kwargs.get("cu_seq_lens_k") is None:
        raise ValueError("ulysses attention needs the full row's cu_seq_lens_k/max_length_k in the forward's kwargs "
                         "(prl.trainer.attention.boundary_kwargs of the full position ids)")
    if dropout:
        raise ValueError("ulysses attention does not apply attention dropout; train with attention_dropout 0")
    r = kv_repeat(query.shape[1], key.shape[1], cp)
    key, value = _repeat_heads(key, r), _repeat_heads(value, r)
    q, k, v = (_seq_to_heads(t, group, cp) for t in (query, key, value))
    out = packed_attention(q, k, v, kwargs["cu_seq_lens_k"], int(kwargs["max_length_k"]), scaling)
    return _heads_to_seq(out, group, cp).transpose(1, 2).contiguous(), None


def install_ulysses(model: torch.nn.Module, cp: int, group) -> None:
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

    AttentionInterface.register(ATTN_NAME, functools.partial(ulysses_attention, group=group, cp=cp))
    # No per-rank mask: the full row's boundaries replace it.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, lambda *args, **kwargs: None)
    model.set_attn_implementation(attn_choice(model.config, ATTN_NAME))  # a VLM's image encoder keeps sdpa


def split_for_cp(t: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """This rank's consecutive 1/cp of a sequence whose length is a multiple of cp."""
    n = t.shape[0] // cp
    return t[cp_rank * n : (cp_rank + 1) * n]
