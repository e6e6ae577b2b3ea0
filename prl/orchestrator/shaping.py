"""Per-token advantage shaping (`training.advantage.shaping`): a function of the user's own, or one of the
two shipped here, called for every trained sample after the group's advantage is known:

    fn(inputs: ShapingInputs, advantage: float, **args) -> float | list[float]

It returns the sample's advantage (one number: every token) or one per token of `inputs.token_ids`
(tokens outside `inputs.loss_mask` are not trained on; their value is ignored). The batch carries
per-token advantages as it always did (`advantages` float32 [T]). Loaded when the orchestrator starts:
a path that does not import, or args the function does not take, stop the run at once naming the setting.

Shipped:
- `token_length_penalty(coef, free_tokens=0)`: every sampled token after the first `free_tokens` of the
  sample loses `coef` (a per-token length cost: long answers pay on their tail, not as a whole);
- `metric_bonus(metric, coef)`: adds `coef` x the rollout's metric `metric` (a format check the
  environment reports, say) to the whole sample.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from prl.config.topology import Shaping
from prl.errors import ConfigError
from prl.plugins import load_function
from prl.states import Role

SETTING = "training.advantage.shaping.import_path"


@dataclass(frozen=True)
class ShapingInputs:
    """What a shaping function sees of one trained sample (one branch of a rollout)."""

    token_ids: Sequence[int]
    """Prompt and completion tokens of the sample."""
    loss_mask: Sequence[int]
    """1 for the tokens the policy sampled (trained on)."""
    reward: float
    """The rollout's reward (before the group's baseline)."""
    completion_tokens: int
    """Tokens the policy sampled in the whole rollout."""
    truncated: bool
    metrics: Mapping[str, float]
    """The rollout's metrics, as the environment reported them."""
    max_tokens: int
    """`training.max_tokens`."""


Shaper = Callable[[ShapingInputs, float], "float | list[float]"]


def shaper(cfg: Shaping | None) -> Shaper | None:
    """The configured shaping function with its args bound (loaded once per setting), or None."""
    if cfg is None:
        return None
    return _load(cfg.import_path, json.dumps(cfg.args, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _load(import_path: str, args_json: str) -> Shaper:
    args = json.loads(args_json)
    fn = load_function(import_path, SETTING, args, ("inputs", "advantage"), Role.ORCHESTRATOR)
    return functools.partial(fn, **args)


def shape(fn: Shaper, inputs: ShapingInputs, advantage: float, cfg: Shaping) -> float | list[float]:
    """fn's advantage for the sample, checked: a finite number, or one per token."""
    out = fn(inputs, advantage)
    n = len(inputs.token_ids)
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        values = [float(out)]
    elif isinstance(out, Sequence) and len(out) == n and all(isinstance(v, (int, float)) for v in out):
        values = [float(v) for v in out]
    else:
        raise ConfigError(f"{SETTING} ({cfg.import_path}) returned {type(out).__name__}"
                          f"{f' of length {len(out)}' if isinstance(out, Sequence) else ''}: return a number or "
                          f"one per token ({n})")
    if not all(math.isfinite(v) for v in values):
        raise ConfigError(f"{SETTING} ({cfg.import_path}) returned a non-finite advantage")
    return values[0] if isinstance(out, (int, float)) else values


def token_length_penalty(inputs: ShapingInputs, advantage: float, *, coef: float, free_tokens: int = 0
                         ) -> list[float]:
    """Every sampled token after the sample's first `free_tokens` sampled tokens loses `coef`."""
    out, sampled = [], 0
    for m in inputs.loss_mask:
        out.append(advantage - coef if m and sampled >= free_tokens else advantage)
        sampled += int(bool(m))
    return out


def metric_bonus(inputs: ShapingInputs, advantage: float, *, metric: str, coef: float) -> float:
    """The sample's advantage plus `coef` x the rollout's metric `metric`."""
    if metric not in inputs.metrics:
        raise ConfigError(f"training.advantage.shaping.args.metric: the rollout has no metric {metric!r} (it has: "
                          f"{', '.join(sorted(inputs.metrics)) or 'none'})")
    return advantage + coef * inputs.metrics[metric]
