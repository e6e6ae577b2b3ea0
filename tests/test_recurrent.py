"""Packed rows through the hybrids' recurrent layers (prl/trainer/recurrent.py): each sample from a zero state.

For every family of prl/trainer/tiny_model.py HYBRID_FAMILIES (Qwen3.5 dense and MoE and Qwen3-Next with Gated
DeltaNet, Nemotron-H with Mamba-2), a packed row of three samples through prl's install path (`install_packed`,
which the trainer's `load_model` calls) and the trainer's forward (`engine.forward_logprobs`, the row's boundaries
as transformers' packed-sequence kwargs) against plain transformers on each sample alone: logprobs, entropy, loss and
every parameter's gradient. The first sample spans two chunks of the torch gated-delta rule (64) and several of the
tiny Nemotron-H's Mamba-2 scan (16). Without the per-sample mixers the second and third samples start from the
state the first left behind (the logprobs differ by ~1e-1 here).
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from prl.trainer import recurrent
from prl.trainer.attention import install_packed
from prl.trainer.engine import forward_logprobs
from prl.trainer.loss import token_logprobs_and_entropy
from tests.tiny_model import HYBRID_FAMILIES, tiny_moe_config

LENGTHS = [70, 9, 45]


def _model(family: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_moe_config(family, vocab_size=128)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def _loss(logp: torch.Tensor, ent: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return -(logp * mask).sum() + 0.1 * (ent * mask).sum()


def _alone(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain transformers on each sample by itself: the row's logprobs, entropy and loss (a sample's last position
    predicts nothing of its own)."""
    logps, ents, masks = [], [], []
    for sample in ids.split(LENGTHS):
        logits = model(input_ids=sample[None], use_cache=False).logits[0]
        logp, ent = token_logprobs_and_entropy(logits, torch.roll(sample, -1))
        logps.append(logp)
        ents.append(ent)
        masks.append(torch.arange(sample.numel()) < sample.numel() - 1)
    logp, ent, mask = torch.cat(logps), torch.cat(ents), torch.cat(masks).float()
    return logp, ent, _loss(logp, ent, mask)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_packed_row_equals_each_sample_alone_logprobs_loss_and_gradients(family):
    reference = _model(family)
    packed = copy.deepcopy(reference)
    install_packed(packed)
    kinds = packed.config.get_text_config().layer_types
    wrapped = [m for m in packed.modules() if "forward" in vars(m)]  # recurrent.per_sample on the instance
    assert len(wrapped) == kinds.count("linear_attention") > 0

    pos = torch.cat([torch.arange(n) for n in LENGTHS])
    ids = torch.randint(0, 128, (pos.numel(),), generator=torch.Generator().manual_seed(1))
    # The row's targets: the next token; the sample's last position is masked out (it would predict the next one's).
    x = {"input_ids": ids, "position_ids": pos, "full_position_ids": pos, "targets": torch.roll(ids, -1)}
    mask = (pos != 0).roll(-1).float()
    _, logp, ent = forward_logprobs(packed, x, 0.0)
    ref_logp, ref_ent, ref_loss = _alone(reference, ids)
    keep = mask.bool()
    torch.testing.assert_close(logp[keep], ref_logp[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    loss = _loss(logp, ent, mask)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    loss.backward()
    ref_loss.backward()
    for (name, p), r in zip(packed.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and r.grad is not None, name
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_the_padded_layout_puts_each_sample_in_its_own_row():
    where, mask = recurrent.padded_layout(torch.tensor([0, 3, 5, 9], dtype=torch.int32), 4, 9)
    assert where.tolist() == [0, 1, 2, 4, 5, 8, 9, 10, 11]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


def test_linear_attention_of_a_kind_prl_does_not_know_is_refused():
    model = torch.nn.Linear(2, 2)
    text = types.SimpleNamespace(layer_types=["linear_attention", "full_attention"])
    model.config = types.SimpleNamespace(get_text_config=lambda: text)
    with pytest.raises(ValueError, match="linear_attention layers of a kind prl cannot pack"):
        recurrent.install(model)
    text.layer_types = ["full_attention"]
    assert recurrent.install(model) == 0
