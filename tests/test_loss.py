"""The policy-gradient loss on hand-computed cases (see prl/trainer/loss.py for the formula)."""

import math

import msgspec
import pytest
import torch

from prl.config.topology import Loss
from prl.trainer.loss import merge_stats, policy_loss, token_logprobs_and_entropy


def _case():
    # ratios r = p / q = [1, 0.5, 10, 1]; the last token is not a loss token.
    logp = torch.log(torch.tensor([0.5, 0.25, 0.5, 0.1], dtype=torch.float64)).requires_grad_()
    q = torch.log(torch.tensor([0.5, 0.5, 0.05, 0.1], dtype=torch.float64))
    adv = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 0])
    return logp, q, adv, mask


def test_mask_mode_drops_out_of_bounds_tokens_but_keeps_them_in_the_count():
    logp, q, adv, mask = _case()
    loss, stats = policy_loss(logp, q, adv, mask, Loss(ratio_low=0.0, ratio_high=5.0, mode="mask"), 3)
    # -(1*1 + 0.5*2 + [10 masked]) / 3
    assert loss.item() == pytest.approx(-2 / 3)
    loss.backward()
    # d/dlogp_t = -keep_t * r_t * A_t / N
    assert logp.grad.tolist() == pytest.approx([-1 / 3, -1 / 3, 0.0, 0.0])
    assert stats["loss_tokens"] == 3 and stats["masked_tokens"] == 1
    assert stats["ratio_min"] == pytest.approx(0.5) and stats["ratio_max"] == pytest.approx(10.0)
    assert stats["ratio_sum"] == pytest.approx(11.5)


def test_mask_mode_low_bound():
    logp, q, adv, mask = _case()
    loss, stats = policy_loss(logp, q, adv, mask, Loss(ratio_low=0.9, ratio_high=20.0), 3)
    assert loss.item() == pytest.approx(-(1 * 1 + 10 * 3) / 3)
    assert stats["masked_tokens"] == 1


def test_clip_mode_clamps_the_weight_and_keeps_the_gradient():
    logp, q, adv, mask = _case()
    loss, stats = policy_loss(logp, q, adv, mask, Loss(ratio_low=0.0, ratio_high=5.0, mode="clip"), 3)
    assert loss.item() == pytest.approx(-(1 + 1 + 5 * 3) / 3)
    loss.backward()
    # gradient weight is the clamped ratio: -c_t * A_t / N
    assert logp.grad.tolist() == pytest.approx([-1 / 3, -1 / 3, -5.0, 0.0])
    assert stats["masked_tokens"] == 1


def test_normalised_by_the_global_token_count_across_micro_batches():
    logp, q, adv, mask = _case()
    cfg = Loss(ratio_high=100.0)
    whole, _ = policy_loss(logp, q, adv, mask, cfg, 3)
    (g_whole,) = torch.autograd.grad(whole, logp)
    a, sa = policy_loss(logp[:2], q[:2], adv[:2], mask[:2], cfg, 3)
    b, sb = policy_loss(logp[2:], q[2:], adv[2:], mask[2:], cfg, 3)
    (g_split,) = torch.autograd.grad(a + b, logp)
    assert (a + b).item() == pytest.approx(whole.item())
    assert torch.allclose(g_split, g_whole)
    merged = merge_stats([sa, sb])
    assert merged["loss_tokens"] == 3 and merged["ratio_max"] == pytest.approx(10.0)
    # Twice the global count halves the loss (another rank holds the other half of the tokens).
    half, _ = policy_loss(logp, q, adv, mask, cfg, 6)
    assert half.item() == pytest.approx(whole.item() / 2)


def test_kl_term_is_k3():
    logp = torch.log(torch.tensor([0.4], dtype=torch.float64))
    q = torch.log(torch.tensor([0.2], dtype=torch.float64))
    loss, stats = policy_loss(logp, q, torch.zeros(1, dtype=torch.float64), torch.ones(1), Loss(kl_coef=0.5), 1)
    k3 = 2 - 1 - math.log(2)
    assert loss.item() == pytest.approx(0.5 * k3)
    assert stats["kl_sum"] == pytest.approx(k3)


def test_no_loss_tokens_gives_zero_not_nan():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, stats = policy_loss(logp, torch.tensor([-50.0, 30.0]), torch.ones(2), torch.zeros(2), Loss(), 0)
    assert loss.item() == 0.0 and stats["loss_tokens"] == 0
    loss.backward()
    assert torch.all(logp.grad == 0)


def test_logprobs_and_entropy():
    logits = torch.zeros(2, 4)
    logits[1] = torch.tensor([math.log(1), math.log(1), math.log(2), math.log(4)])
    logp, ent = token_logprobs_and_entropy(logits, torch.tensor([1, 3]))
    assert logp.tolist() == pytest.approx([math.log(0.25), math.log(0.5)])
    p = [0.125, 0.125, 0.25, 0.5]
    assert ent.tolist() == pytest.approx([math.log(4), -sum(x * math.log(x) for x in p)], rel=1e-6)


def test_bad_settings_are_refused():
    with pytest.raises(msgspec.ValidationError, match="mode"):
        msgspec.convert({"mode": "ppo"}, Loss)
    with pytest.raises(msgspec.ValidationError, match=r"ratio_low \(2.0\) must be below ratio_high \(1.0\)"):
        msgspec.convert({"ratio_low": 2.0, "ratio_high": 1.0}, Loss)
    with pytest.raises(ValueError, match=r"ratio_low \(2.0\) must be below ratio_high \(1.0\)"):
        Loss(ratio_low=2.0, ratio_high=1.0)
