"""The policy-gradient loss on hand-computed cases (see prl/trainer/loss.py for the formula)."""

import math

import msgspec
import pytest
import torch

from prl.config.topology import Loss
from prl.errors import ConfigError
from prl.trainer.loss import (LossInputs, custom_loss, load_custom_loss, merge_stats, policy_loss, sample_ids_of,
                              token_logprobs_and_entropy)


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
    with pytest.raises(msgspec.ValidationError, match="kind"):
        msgspec.convert({"kind": "ppo"}, Loss)
    with pytest.raises(msgspec.ValidationError, match=r"ratio_low \(2.0\) must be below ratio_high \(1.0\)"):
        msgspec.convert({"ratio_low": 2.0, "ratio_high": 1.0}, Loss)
    with pytest.raises(ValueError, match=r"ratio_low \(2.0\) must be below ratio_high \(1.0\)"):
        Loss(ratio_low=2.0, ratio_high=1.0)


@pytest.mark.parametrize("data, field, says", [
    ({"kind": "gspo", "mode": "clip"}, "mode", "mode applies to kind token; kind gspo has its own clipping"),
    ({"kind": "gspo", "ratio_low": 1.1}, "ratio_low", r"ratio_low \(1.1\) must be below ratio_high \(1.0004\)"),
    ({"kind": "dppo", "ratio_high": 2.0}, "ratio_high", "kind dppo bounds the probability change"),
    ({"prob_delta_high": 0.3}, "prob_delta_high", "applies to kind dppo only"),
    ({"kind": "dppo", "prob_delta_low": 1.5}, "prob_delta_low", "<= 1.0"),
    ({"args": {"scale": 2}}, "args", "set import_path too"),
    ({"import_path": "pkg.mod.fn"}, "import_path", "must read package.module:function"),
    ({"import_path": "pkg.mod:fn", "kind": "gspo"}, "kind", "import_path replaces the built-in losses"),
    ({"import_path": "pkg.mod:fn", "kl_coef": 0.1}, "kl_coef", "remove kl_coef"),
])
def test_loss_menu_settings_are_refused_naming_the_field(data, field, says):
    with pytest.raises(msgspec.ValidationError, match=says) as info:
        msgspec.convert(data, Loss)
    cause = info.value.__cause__  # a check of ours names its field; msgspec's own bounds say `$.field`
    assert (cause.field if cause is not None else str(info.value).rsplit("`$.", 1)[1].rstrip("`")) == field


def test_kind_defaults_for_the_ratio_bounds():
    assert Loss().bounds() == (0.0, 5.0)
    assert Loss(kind="cispo").bounds() == (0.0, 5.0)
    assert Loss(kind="gspo").bounds() == pytest.approx((1 - 3e-4, 1 + 4e-4))
    assert Loss(kind="gspo", ratio_high=1.2).bounds() == pytest.approx((1 - 3e-4, 1.2))
    assert Loss(kind="dppo").prob_deltas() == (0.2, 0.2)


def _two_samples():
    """Two packed samples, positions [0 1 2 | 0 1]; each sample's first token has no loss.

    Ratios r = p / q on the loss tokens: sample 0: 4 and 1 (geometric mean s_0 = 2), sample 1: 0.5 (s_1 = 0.5).
    Advantages: sample 0 +1, sample 1 -2. N = 3 loss tokens.
    """
    logp = torch.log(torch.tensor([0.9, 0.4, 0.3, 0.9, 0.25], dtype=torch.float64)).requires_grad_()
    q = torch.log(torch.tensor([0.9, 0.1, 0.3, 0.9, 0.5], dtype=torch.float64))
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([0, 1, 1, 0, 1])
    return logp, q, adv, mask, sample_ids_of(torch.tensor([0, 1, 2, 0, 1]))


def test_gspo_one_clipped_ratio_per_sample():
    logp, q, adv, mask, ids = _two_samples()
    assert ids.tolist() == [0, 0, 0, 1, 1]
    cfg = Loss(kind="gspo", ratio_low=0.8, ratio_high=3.0)
    loss, stats = policy_loss(logp, q, adv, mask, cfg, 3, sample_ids=ids)
    # s_0 = 2 in bounds: -A s_0 on each of its 2 tokens; s_1 = 0.5 < 0.8 with A < 0: clipped, -A * 0.8 = 1.6, no gradient
    assert loss.item() == pytest.approx((-2 - 2 + 1.6) / 3)
    loss.backward()
    # d/dlogp_t of sum_{t' in i} -A s_i = -A s_i (ds_i/dlogp_t = s_i / n_i, n_i terms): -1 * 2 / N on sample 0
    assert logp.grad.tolist() == pytest.approx([0.0, -2 / 3, -2 / 3, 0.0, 0.0])
    assert stats["masked_tokens"] == 1 and stats["loss_tokens"] == 3
    assert stats["ratio_min"] == pytest.approx(0.5) and stats["ratio_max"] == pytest.approx(2.0)


def test_gspo_unclipped_and_clipped_high():
    logp, q, adv, mask, ids = _two_samples()
    loss, _ = policy_loss(logp, q, adv, mask, Loss(kind="gspo", ratio_low=0.4, ratio_high=3.0), 3, sample_ids=ids)
    # s_1 = 0.5 now in bounds: -(-2)(0.5) = 1 on its token, gradient -A s_1 / N = 1/3
    assert loss.item() == pytest.approx((-4 + 1) / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.tolist() == pytest.approx([0.0, -2 / 3, -2 / 3, 0.0, 1 / 3])
    loss, _ = policy_loss(logp, q, adv, mask, Loss(kind="gspo", ratio_low=0.4, ratio_high=1.5), 3, sample_ids=ids)
    # s_0 = 2 > 1.5 with A > 0: clipped to 1.5 on both tokens, no gradient
    assert loss.item() == pytest.approx((-1.5 - 1.5 + 1) / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, 1 / 3])


def test_gspo_micro_batches_of_whole_samples_add_up():
    logp, q, adv, mask, ids = _two_samples()
    cfg = Loss(kind="gspo", ratio_low=0.4, ratio_high=3.0)
    whole, _ = policy_loss(logp, q, adv, mask, cfg, 3, sample_ids=ids)
    a, _ = policy_loss(logp[:3], q[:3], adv[:3], mask[:3], cfg, 3, sample_ids=sample_ids_of(torch.tensor([0, 1, 2])))
    b, _ = policy_loss(logp[3:], q[3:], adv[3:], mask[3:], cfg, 3, sample_ids=sample_ids_of(torch.tensor([0, 1])))
    assert (a + b).item() == pytest.approx(whole.item())
    with pytest.raises(ValueError, match="sample_ids"):
        policy_loss(logp, q, adv, mask, cfg, 3)


def test_cispo_weights_every_token_by_the_clipped_ratio():
    logp, q, adv, mask = _case()
    loss, stats = policy_loss(logp, q, adv, mask, Loss(kind="cispo"), 3)
    # c = clamp([1, 0.5, 10], 0, 5) = [1, 0.5, 5]; value -(1*1*log .5 + .5*2*log .25 + 5*3*log .5) / 3 = 6 log 2
    assert loss.item() == pytest.approx(6 * math.log(2))
    loss.backward()
    # gradient -c_t A_t / N: the clipped token keeps a gradient (5 * 3 / 3), unlike mode "mask"
    assert logp.grad.tolist() == pytest.approx([-1 / 3, -1 / 3, -5.0, 0.0])
    assert stats["masked_tokens"] == 1


def test_cispo_kl_covers_every_loss_token():
    logp, q, adv, mask = _case()
    loss, stats = policy_loss(logp, q, torch.zeros(4, dtype=torch.float64), mask, Loss(kind="cispo", kl_coef=1.0), 3)
    k3 = [0.0, 0.5 - 1 - math.log(0.5), 10 - 1 - math.log(10)]
    assert stats["kl_sum"] == pytest.approx(sum(k3))
    loss.backward()
    # d/dlogp (r - 1 - log r) = r - 1
    assert logp.grad.tolist() == pytest.approx([0.0, -0.5 / 3, 9 / 3, 0.0])


def test_dppo_masks_by_probability_change_in_the_advantages_direction():
    logp, q, _, mask = _case()
    # probability change p - mu = [0, -0.25, +0.45]; advantages negative on the first three tokens
    adv = torch.tensor([-1.0, -2.0, -3.0, 4.0], dtype=torch.float64)
    loss, stats = policy_loss(logp, q, adv, mask, Loss(kind="dppo", kl_coef=0.5), 3)
    # token 1 fell by 0.25 > 0.2 with A < 0: masked; token 2 rose by 0.45 but A < 0 checks only the fall: kept
    kl = math.log(0.5) ** 2 + math.log(10) ** 2
    assert loss.item() == pytest.approx((-(-1 * 1) - (-3 * 10) + 0.5 * kl) / 3)
    loss.backward()
    # pg gradient -keep r A / N; kl gradient 0.5 * 2 log r / N
    assert logp.grad.tolist() == pytest.approx([1 / 3, math.log(0.5) / 3, 10 + math.log(10) / 3, 0.0])
    assert stats["masked_tokens"] == 1 and stats["kl_sum"] == pytest.approx(kl)


def test_dppo_positive_advantages_check_the_rise():
    logp, q, adv, mask = _case()  # advantages all positive: token 2 rose by 0.45
    loss, stats = policy_loss(logp, q, adv, mask, Loss(kind="dppo"), 3)
    assert loss.item() == pytest.approx(-(1 * 1 + 0.5 * 2) / 3) and stats["masked_tokens"] == 1
    loss, stats = policy_loss(logp, q, adv, mask, Loss(kind="dppo", prob_delta_high=0.5), 3)
    assert loss.item() == pytest.approx(-(1 * 1 + 0.5 * 2 + 10 * 3) / 3) and stats["masked_tokens"] == 0


def test_custom_loss_is_called_with_the_documented_inputs_and_used():
    from tests.custom_loss import CALLS

    CALLS.clear()
    logp, q, adv, mask, ids = _two_samples()
    cfg = Loss(import_path="tests.custom_loss:scaled_pg", args={"scale": 2.0})
    fn = load_custom_loss(cfg)
    inputs = LossInputs(logp, q, adv, mask, ids, 3)
    loss, stats = custom_loss(fn, inputs, cfg)
    assert CALLS == [(inputs, {"scale": 2.0})]
    # -2 * (1 * log .4 + 1 * log .3 - 2 * log .25) / 3
    assert loss.item() == pytest.approx(-2 * (math.log(0.4) + math.log(0.3) - 2 * math.log(0.25)) / 3)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, -2 / 3, -2 / 3, 0.0, 4 / 3])
    assert stats["loss_tokens"] == 3 and stats["loss_sum"] == pytest.approx(loss.item() * 3)
    assert load_custom_loss(Loss()) is None


@pytest.mark.parametrize("path, args, says", [
    ("tests.no_such_module:fn", {}, r"training\.loss\.import_path \(tests\.no_such_module:fn\): cannot import"),
    ("tests.custom_loss:no_such_fn", {}, r"training\.loss\.import_path .*has no no_such_fn"),
    ("tests.custom_loss:NOT_A_FUNCTION", {}, r"training\.loss\.import_path .*NOT_A_FUNCTION is a int, not a function"),
    ("tests.custom_loss:scaled_pg", {"scael": 2}, r"training\.loss\.args: .*cannot be called as fn\(inputs, \*\*args\)"),
])
def test_custom_loss_that_does_not_load_is_refused_naming_the_setting(path, args, says):
    with pytest.raises(ConfigError, match=says):
        load_custom_loss(Loss(import_path=path, args=args))


def test_custom_loss_must_return_a_scalar():
    logp, q, adv, mask, ids = _two_samples()
    cfg = Loss(import_path="tests.custom_loss:per_token")
    with pytest.raises(ConfigError, match=r"training\.loss\.import_path \(tests\.custom_loss:per_token\) returned "
                                          r"Tensor, not a scalar tensor"):
        custom_loss(load_custom_loss(cfg), LossInputs(logp, q, adv, mask, ids, 3), cfg)


def test_the_rl_step_hands_a_custom_loss_its_inputs_and_uses_its_loss():
    """RLSpec.micro_loss (prl/trainer/rl.py): sample ids from the packed positions, N, and the returned loss."""
    import types

    from prl.trainer.rl import RLSpec
    from tests.custom_loss import CALLS

    CALLS.clear()
    cfg = types.SimpleNamespace(training=types.SimpleNamespace(
        loss=Loss(import_path="tests.custom_loss:scaled_pg", args={"scale": 0.5}), router_aux_loss_coef=0.0,
        router_replay=False, temperature=1.0),
        scorers=("teacher",), compile=False)
    bad = types.SimpleNamespace(training=types.SimpleNamespace(loss=Loss(import_path="tests.custom_loss:nothing")),
                                scorers=())
    with pytest.raises(ConfigError, match=r"training\.loss\.import_path .*has no nothing"):
        RLSpec(bad)  # the trainer refuses it at start, before any model is loaded
    spec = RLSpec(cfg)
    logits = torch.zeros(5, 4, requires_grad=True)  # uniform: every logprob is log(1/4)

    def model(input_ids, position_ids, use_cache, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k):
        assert cu_seq_lens_k.tolist() == [0, 3, 5] and max_length_k == 3  # the packed samples' boundaries
        return types.SimpleNamespace(logits=logits[None])

    x = {"input_ids": torch.tensor([1, 2, 3, 1, 2]), "position_ids": torch.tensor([0, 1, 2, 0, 1]),
         "full_position_ids": torch.tensor([0, 1, 2, 0, 1]),
         "targets": torch.tensor([2, 3, 0, 2, 0]), "inference_logprobs": torch.full((5,), math.log(0.25)),
         "advantages": torch.tensor([1.0, 1.0, 0.0, -1.0, 0.0]), "loss_mask": torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0]),
         "teacher_logprobs": torch.tensor([-1.0, -2.0, 0.0, -3.0, 0.0])}
    assert spec.labels[-1] == "teacher_logprobs"  # a run with a teacher: its logprobs are a label array
    loss, stats = spec.micro_loss(model, x, n_loss_tokens=6, aux_weight=0.0)
    ((inputs, args),) = CALLS
    assert args == {"scale": 0.5} and inputs.total_loss_tokens == 6
    assert inputs.teacher_logprobs.tolist() == [-1.0, -2.0, 0.0, -3.0, 0.0] and inputs.reference_logprobs is None
    assert inputs.sample_ids.tolist() == [0, 0, 0, 1, 1]
    assert inputs.logprobs.tolist() == pytest.approx([math.log(0.25)] * 5)
    # -0.5 * (1 + 1 - 1) * log(1/4) / 6
    assert loss.item() == pytest.approx(0.5 * math.log(4) / 6)
    assert stats["loss_tokens"] == 3 and stats["mismatch_ratio_sum"] == pytest.approx(3.0)


def _teacher_case():
    # the teacher's logprobs of the same tokens; the last (not a loss token) is never read
    return torch.log(torch.tensor([0.25, 0.5, 0.25, 0.9], dtype=torch.float64))


def test_distillation_trains_on_the_teachers_reverse_kl_reward():
    logp, q, adv, mask = _case()
    cfg = Loss(ratio_high=100.0, distill_coef=1.0, reward_coef=0.0)
    loss, stats = policy_loss(logp, q, adv, mask, cfg, 3, teacher_logprobs=_teacher_case())
    # A'_t = T_t - q_t = [log .5, log 1, log 5]; r = [1, .5, 10]; pg = -r A'
    assert loss.item() == pytest.approx(-(math.log(0.5) + 0.0 + 10 * math.log(5)) / 3)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-math.log(0.5) / 3, 0.0, -10 * math.log(5) / 3, 0.0])
    # sum of logp - T over loss tokens: log 2 + log .5 + log 2
    assert stats["teacher_kl_sum"] == pytest.approx(math.log(2))


def test_distillation_mixes_with_the_reward_advantage():
    logp, q, adv, mask = _case()
    cfg = Loss(ratio_high=100.0, distill_coef=0.5)  # reward_coef 1
    loss, _ = policy_loss(logp, q, adv, mask, cfg, 3, teacher_logprobs=_teacher_case())
    shaped = [1 + 0.5 * math.log(0.5), 2.0, 3 + 0.5 * math.log(5)]
    assert loss.item() == pytest.approx(-(1 * shaped[0] + 0.5 * shaped[1] + 10 * shaped[2]) / 3)


def test_distillation_gradient_is_the_reverse_kl_gradient_in_expectation():
    # Over a 5-token vocabulary, the pi-weighted sum of the per-token distillation losses (on-policy: q = logp)
    # has the gradient of KL(pi || teacher).
    torch.manual_seed(0)
    theta = torch.randn(5, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(5, dtype=torch.float64), -1)
    logp_all = torch.log_softmax(theta, -1)
    cfg = Loss(distill_coef=1.0, reward_coef=0.0)
    total = 0.0
    for x in range(5):
        lp = logp_all[x:x + 1]
        loss, _ = policy_loss(lp, lp.detach(), torch.zeros(1, dtype=torch.float64), torch.ones(1), cfg, 1,
                              teacher_logprobs=teacher[x:x + 1])
        total = total + logp_all[x].exp().detach() * loss
    (grad,) = torch.autograd.grad(total, theta, retain_graph=True)
    kl = (logp_all.exp() * (logp_all - teacher)).sum()
    (expected,) = torch.autograd.grad(kl, theta)
    assert grad.tolist() == pytest.approx(expected.tolist(), abs=1e-12)
    assert float(expected.abs().max()) > 0.01


def test_reference_kl_is_k3_with_its_gradient():
    logp, q, _, mask = _case()
    ref = torch.log(torch.tensor([0.25, 0.5, 0.5, 0.9], dtype=torch.float64))
    zero = torch.zeros(4, dtype=torch.float64)
    loss, stats = policy_loss(logp, q, zero, mask, Loss(ratio_high=100.0, kl_ref_coef=2.0), 3,
                              reference_logprobs=ref)
    # d = R - logp = [log .5, log 2, 0]: exp(d) - d - 1 = [log 2 - .5, 1 - log 2, 0], sum 0.5
    assert stats["ref_kl_sum"] == pytest.approx(0.5)
    assert loss.item() == pytest.approx(2.0 * 0.5 / 3)
    loss.backward()
    # d/dlogp of exp(d) - d - 1 = 1 - exp(d): [.5, -1, 0]
    assert logp.grad.tolist() == pytest.approx([2 * 0.5 / 3, -2 / 3, 0.0, 0.0])


def test_scored_losses_refuse_a_batch_without_the_scores():
    logp, q, adv, mask = _case()
    with pytest.raises(ValueError, match="distill_coef needs the teacher"):
        policy_loss(logp, q, adv, mask, Loss(distill_coef=1.0), 3)
    with pytest.raises(ValueError, match="kl_ref_coef needs the reference"):
        policy_loss(logp, q, adv, mask, Loss(kl_ref_coef=1.0), 3)


def test_reward_coef_without_distillation_is_refused():
    with pytest.raises(msgspec.ValidationError, match="reward_coef"):
        msgspec.convert({"reward_coef": 0.5}, Loss)
    with pytest.raises(msgspec.ValidationError, match="distill_coef"):
        msgspec.convert({"import_path": "a.b:c", "distill_coef": 1.0}, Loss)
