"""Group-relative advantages: each rollout's reward against its group's (same prompt) others.

For a group of n rollouts with rewards r_i and completion lengths L_i (sampled tokens):

    r'_i = r_i - length_penalty * L_i / max_tokens      (optional length penalty)
    r'_i -= overlong_penalty * clip((L_i - (max_tokens - B)) / B, 0, 1)
                                                        (optional soft overlong punishment, DAPO; B = overlong_buffer)
    baseline "group_mean" (GRPO, Dr.GRPO):
      a_i  = r'_i - mean(r')
    baseline "leave_one_out" (RLOO, Ahmadian et al. 2024): the mean of the group's other rollouts,
      a_i  = r'_i - (sum_j r'_j - r'_i) / (n - 1)  =  n / (n - 1) * (r'_i - mean(r'))
      (a group of one has no other rollout: its advantage is 0)
    a_i /= std(r') + eps                                 (optional; a zero-std group stays all zero)

Every group's advantages sum to zero (up to float error). A group whose
advantages are all zero (every rollout scored the same) carries no learning
signal; `drop_zero_groups` leaves such groups out of the batch.

Pure Python: no numpy, unit-tested by hand (tests/test_advantages.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prl.config.topology import Advantage


def group_advantages(
    rewards: Sequence[float],
    lengths: Sequence[int] | None = None,
    cfg: Advantage = Advantage(),
    max_tokens: int = 1,
) -> list[float]:
    """Advantages of one group of rollouts of the same prompt (see the module docstring)."""
    n = len(rewards)
    if n == 0:
        return []
    adjusted = [float(r) for r in rewards]
    if cfg.length_penalty:
        if lengths is None or len(lengths) != n:
            raise ValueError(f"length penalty needs one length per reward, got {lengths!r} for {n} rewards")
        adjusted = [r - cfg.length_penalty * L / max(1, max_tokens) for r, L in zip(adjusted, lengths)]
    if cfg.overlong_buffer:
        if lengths is None or len(lengths) != n:
            raise ValueError(f"overlong punishment needs one length per reward, got {lengths!r} for {n} rewards")
        start = max_tokens - cfg.overlong_buffer
        adjusted = [r - cfg.overlong_penalty * min(1.0, max(0.0, (L - start) / cfg.overlong_buffer))
                    for r, L in zip(adjusted, lengths)]
    mean = sum(adjusted) / n
    centred = [r - mean for r in adjusted]
    if cfg.baseline == "leave_one_out":
        total = sum(adjusted)
        adv = [r - (total - r) / (n - 1) for r in adjusted] if n > 1 else [0.0]
    else:
        adv = centred
    if cfg.std_normalize:
        std = math.sqrt(sum(c * c for c in centred) / n)
        if std < cfg.eps:
            return [0.0] * n
        adv = [a / (std + cfg.eps) for a in adv]
    # Identical rewards give exact zeros, not float dust that would keep a dead group alive.
    return [0.0 if abs(a) < 1e-12 else a for a in adv]


def is_zero_group(advantages: Sequence[float]) -> bool:
    return all(a == 0.0 for a in advantages)


def reward_stats(values: Sequence[float]) -> dict[str, float]:
    """mean, std (population), min, max of a list (zeros for an empty one)."""
    if not values:
        return {"mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0}
    n = len(values)
    mean = sum(values) / n
    return {
        "mean": mean,
        "std": math.sqrt(sum((v - mean) ** 2 for v in values) / n),
        "min": min(values),
        "max": max(values),
    }
