"""Packed rows through recurrent token mixers (linear attention, state-space layers): each sample from a zero state.

A packed row holds several samples back to back (prl/trainer/attention.py). Attention layers take the row's
boundaries; a recurrent mixer (a Gated DeltaNet, a Mamba-2 mixer) carries a state along the sequence and a causal
convolution over its last few positions, so run over the whole row, the second sample starts from the state the
first left behind. transformers 5.19 passes the boundaries on (`cu_seqlens=kwargs.pop("cu_seq_lens_q")` in
Qwen3.5's and Qwen3-Next's GatedDeltaNet) but only the optional fla / causal-conv1d / mamba-ssm CUDA kernels would
read them: the torch implementations every install has (`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`,
`mamba2_chunk_scan`) swallow them in `**kwargs`, and mamba-ssm reads a `seq_idx`, not `cu_seqlens`.

So `install(model)` wraps the forward of every such mixer (`MIXERS`, by class name): a packed row [1, T, hidden]
becomes a right-padded batch [samples, longest, hidden] with its padding mask, the mixer runs once on it, and its
output goes back to the row's positions. Each sample starts from a zero state and zero convolution history, as it
would alone, with whichever kernel the mixer picks; right padding comes after a sample's tokens and a causal mixer
never lets it reach them. The re-layout is two index operations on the device (no host sync): their cost is the
padding, up to (samples x longest) / T of the mixer's work. A row of one sample runs as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

MIXERS = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet", "NemotronHMamba2Mixer")
"""Recurrent mixers whose packed rows run per sample (transformers class names; each family has a packed-vs-alone
test in tests/test_recurrent.py). prl/planner/capabilities.py `PACKED_RECURRENT_ARCHITECTURES` lists their models."""

BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""transformers' packed-sequence kwargs (prl/trainer/attention.py `boundary_kwargs`): a padded batch has none."""


def padded_layout(cu_seqlens: torch.Tensor, longest: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each of a packed row's `tokens` positions goes in a flat [samples * longest] right-padded batch, and
    that batch's [samples, longest] mask (1 on a sample's tokens)."""
    samples = cu_seqlens.numel() - 1
    cu = cu_seqlens.long()
    position = torch.arange(tokens, device=cu.device)
    sample = torch.searchsorted(cu[1:], position, right=True)
    where = sample * longest + (position - cu[sample])
    mask = torch.zeros(samples * longest, device=cu.device).index_fill_(0, where, 1.0)
    return where, mask.view(samples, longest)


def per_sample(forward: Callable) -> Callable:
    """`forward(hidden_states [1, T, hidden], ...)` of a mixer, run on the packed row's samples as a padded batch."""

    @functools.wraps(forward)
    def run(hidden_states: torch.Tensor, *args, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        plain = {k: v for k, v in kwargs.items() if k not in BOUNDARY_KEYS}
        if cu is None or cu.numel() <= 2:
            return forward(hidden_states, *args, **plain)
        if hidden_states.shape[0] != 1 or plain.get("cache_params") is not None:
            raise ValueError("a packed row through a recurrent mixer is one row (batch 1) without a cache, got "
                             f"batch {hidden_states.shape[0]}")
        if plain.get("attention_mask") is not None:
            raise ValueError("a packed row has no padding mask: its samples' boundaries are cu_seq_lens_q")
        tokens, width = hidden_states.shape[1], hidden_states.shape[2]
        longest = int(kwargs["max_length_q"])
        where, mask = padded_layout(cu.to(hidden_states.device), longest, tokens)
        flat = hidden_states.new_zeros(mask.numel(), width).index_put((where,), hidden_states[0])
        plain["attention_mask"] = mask.to(hidden_states.dtype)
        out = forward(flat.view(*mask.shape, width), *args, **plain)
        return out.reshape(mask.numel(), -1).index_select(0, where)[None]

    return run


def install(model: torch.nn.Module) -> int:
    """Run every recurrent mixer of `model` (MIXERS) per sample on packed rows; how many were wrapped. A model with
    `linear_attention` layers and none of them is refused: its packed samples would share their state."""
    wrapped = 0
    for module in model.modules():
        if type(module).__name__ in MIXERS:
            module.forward = per_sample(module.forward)
            wrapped += 1
    kinds = getattr(model.config.get_text_config(), "layer_types", None) or ()
    if not wrapped and "linear_attention" in kinds:
        raise ValueError(f"{type(model).__name__} has linear_attention layers of a kind prl cannot pack (it packs "
                         f"{', '.join(MIXERS)}): its packed samples would carry state into each other")
    return wrapped
