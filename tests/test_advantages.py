"""Group-relative advantages, by hand (prl/orchestrator/advantages.py)."""

from __future__ import annotations

import math

import pytest

from prl.config.topology import Advantage
from prl.errors import ConfigError
from prl.orchestrator.advantages import group_advantages, is_zero_group, reward_stats
from testkit.plans import local_plan


def approx(values, expected):
    assert len(values) == len(expected)
    for v, e in zip(values, expected):
        assert v == pytest.approx(e, abs=1e-9)


def test_mean_centring():
    # mean 0.5 -> each reward minus 0.5
    approx(group_advantages([1.0, 0.0, 0.5, 0.5]), [0.5, -0.5, 0.0, 0.0])
    approx(group_advantages([3.0, 1.0]), [1.0, -1.0])


def test_std_normalisation():
    # rewards 1, 0, 0, 0: mean 0.25, centred 0.75, -0.25 x3; population std sqrt(0.1875)
    std = math.sqrt((0.75**2 + 3 * 0.25**2) / 4)
    cfg = Advantage(std_normalize=True, eps=1e-6)
    approx(group_advantages([1.0, 0.0, 0.0, 0.0], cfg=cfg), [0.75 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 3)


def test_zero_std_group_is_all_zero_and_never_nan():
    for cfg in (Advantage(), Advantage(std_normalize=True)):
        adv = group_advantages([0.3, 0.3, 0.3], cfg=cfg)
        assert adv == [0.0, 0.0, 0.0]
        assert is_zero_group(adv)
    # float dust from a mean that does not round-trip is still an exact zero group
    assert is_zero_group(group_advantages([0.1] * 10))


def test_length_penalty():
    # penalty 0.5 per max_tokens(10): lengths 2 and 8 -> rewards 1 - 0.1 = 0.9 and 1 - 0.4 = 0.6
    cfg = Advantage(length_penalty=0.5)
    approx(group_advantages([1.0, 1.0], [2, 8], cfg, max_tokens=10), [0.15, -0.15])
    # equal rewards, equal lengths: still no signal
    assert group_advantages([1.0, 1.0], [5, 5], cfg, max_tokens=10) == [0.0, 0.0]
    with pytest.raises(ValueError, match="one length per reward"):
        group_advantages([1.0, 1.0], None, cfg, max_tokens=10)


def test_soft_overlong_punishment():
    # max_tokens 100, buffer 20: no loss up to 80 tokens, then linear to the whole penalty (0.5) at 100.
    cfg = Advantage(overlong_buffer=20, overlong_penalty=0.5)
    # lengths 50, 90, 100 -> rewards 1, 1 - 0.5 * 10/20 = 0.75, 1 - 0.5 = 0.5; mean 0.75
    approx(group_advantages([1.0, 1.0, 1.0], [50, 90, 100], cfg, max_tokens=100), [0.25, 0.0, -0.25])
    assert group_advantages([1.0, 1.0], [10, 80], cfg, max_tokens=100) == [0.0, 0.0]  # both below the buffer
    with pytest.raises(ValueError, match="one length per reward"):
        group_advantages([1.0, 1.0], None, cfg, max_tokens=100)


def test_leave_one_out_baseline_is_the_others_mean():
    cfg = Advantage(baseline="leave_one_out")
    # rewards 1, 0, 0, 0.5 (sum 1.5): 1 - 0.5/3, 0 - 1.5/3, 0 - 1.5/3, 0.5 - 1/3
    approx(group_advantages([1.0, 0.0, 0.0, 0.5], cfg=cfg), [5 / 6, -0.5, -0.5, 1 / 6])
    approx(group_advantages([3.0, 1.0], cfg=cfg), [2.0, -2.0])
    assert group_advantages([0.7], cfg=cfg) == [0.0], "a group of one has no other rollout"
    assert group_advantages([0.3, 0.3, 0.3], cfg=cfg) == [0.0, 0.0, 0.0]


def test_leave_one_out_with_length_penalty_and_std():
    # rewards 1, 1 with lengths 2, 8 of max 10, penalty 0.5: 0.9 and 0.6; others' means 0.6 and 0.9
    cfg = Advantage(baseline="leave_one_out", length_penalty=0.5)
    approx(group_advantages([1.0, 1.0], [2, 8], cfg, max_tokens=10), [0.3, -0.3])
    # std of the group's rewards 0.9, 0.6 is 0.15: 0.3 / (0.15 + eps)
    cfg = Advantage(baseline="leave_one_out", length_penalty=0.5, std_normalize=True, eps=1e-6)
    approx(group_advantages([1.0, 1.0], [2, 8], cfg, max_tokens=10), [0.3 / (0.15 + 1e-6), -0.3 / (0.15 + 1e-6)])


def test_groups_sum_to_zero():
    import random

    rng = random.Random(0)
    for cfg in (Advantage(), Advantage(std_normalize=True), Advantage(length_penalty=0.2),
                Advantage(baseline="leave_one_out")):
        for _ in range(50):
            n = rng.randint(1, 9)
            adv = group_advantages([rng.random() for _ in range(n)], [rng.randint(1, 50) for _ in range(n)], cfg, 50)
            assert abs(sum(adv)) < 1e-9


def test_single_rollout_group_has_no_signal():
    assert group_advantages([0.7]) == [0.0]
    assert group_advantages([]) == []


def test_advantage_settings_come_from_the_topology(tmp_path):
    plan = local_plan(tmp_path / "run", tmp_path / "model")
    assert plan.settings().training.advantage == Advantage(std_normalize=True), "local-tiny.yaml sets std_normalize"
    plan = local_plan(tmp_path / "run", tmp_path / "model",
                      ["training.advantage.drop_zero_groups=true", "training.advantage.length_penalty=0.1"])
    assert plan.settings().training.advantage == Advantage(std_normalize=True, drop_zero_groups=True, length_penalty=0.1)
    with pytest.raises(ConfigError, match=r"training\.advantage\.std_norm\): unknown field; did you mean 'std_normalize'"):
        local_plan(tmp_path / "run", tmp_path / "model", ["training.advantage.std_norm=true"])
    with pytest.raises(ConfigError, match=r"training\.advantage\.length_penalty\): .*greater than or equal to 0"):
        local_plan(tmp_path / "run", tmp_path / "model", ["training.advantage.length_penalty=-1"])


def test_reward_stats():
    s = reward_stats([1.0, 0.0, 0.5, 0.5])
    assert s == {"mean": 0.5, "std": pytest.approx(math.sqrt(0.125)), "min": 0.0, "max": 1.0}
    assert reward_stats([])["mean"] == 0.0
