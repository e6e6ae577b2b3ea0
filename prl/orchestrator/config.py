"""The orchestrator's settings, read from the `environment`, `training`, `trainer` and `model` sections of RUN/plan.json.

The planner writes plan.json; the orchestrator only picks what it needs.
Keys the schema does not have yet are read with `.get` and the defaults
below, so an older plan still runs. A missing required key is a ConfigError
that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from prl.errors import ConfigError
from prl.orchestrator.advantages import AdvantageConfig


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0
    """Evaluate every N steps on the eval split (0: never)."""
    examples: int = 64
    """Eval-split examples per evaluation (one rollout each)."""


@dataclass(frozen=True)
class OrchestratorConfig:
    env_id: str
    """verifiers taskset id: an installed top-level module (a dotted path is aliased)."""
    model_path: str
    """Model directory; its tokenizer renders prompts client-side (`model.tokenizer` wins)."""
    env_args: dict = field(default_factory=dict)
    """Extra taskset config fields (`environment.args`)."""
    harness: str = "prl"
    """'prl' (the in-process harness) or any verifiers harness id."""
    eval: EvalConfig = field(default_factory=EvalConfig)

    batch_size: int = 16
    """Rollouts per step (a multiple of rollouts_per_example)."""
    rollouts_per_example: int = 8
    max_off_policy_steps: int = 2
    """Step N is generated with weights of version >= N - 1 - this (0: synchronous, version N - 1)."""
    max_steps: int = 10
    max_tokens: int = 1024
    temperature: float = 1.0
    micro_batch_tokens: int = 8192
    seed: int = 0
    dp_size: int = 1
    """Trainer data-parallel ranks (dp_replicate * dp_shard): the batch is packed for them."""
    served_model_name: str | None = None
    """Model name the servers answer to (`--served-model-name`); None: ask GET /v1/models."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    max_concurrent_rollouts: int = 256
    """Rollouts in flight at once, over all servers."""
    rollout_retries: int = 3
    """Extra attempts for a rollout that failed (transient HTTP errors), on another server if there is one."""
    weight_update_retries: int = 5
    """Attempts to make a server load a weights step before the orchestrator fails."""
    weights_timeout_s: float = 3600.0
    """Longest wait for the weights a step needs (the trainer's next step) before failing."""
    endpoint_timeout_s: float = 600.0
    """Longest wait for the inference servers' endpoint files at start."""

    @property
    def examples_per_step(self) -> int:
        return self.batch_size // self.rollouts_per_example

    def min_version(self, step: int) -> int:
        """Oldest weights version allowed to generate rollouts for `step`."""
        return max(0, step - 1 - self.max_off_policy_steps)

    @classmethod
    def from_plan(cls, plan: dict[str, Any], cwd: Path | None = None) -> OrchestratorConfig:
        env = plan.get("environment") or {}
        training = plan.get("training") or {}
        model = plan.get("model") or {}
        mesh = (plan.get("trainer") or {}).get("mesh") or {}
        if not env.get("id"):
            raise ConfigError("plan.json has no environment.id: the orchestrator needs a verifiers taskset id")
        if not model.get("path"):
            raise ConfigError("plan.json has no model.path: the orchestrator needs the tokenizer directory")
        kwargs: dict[str, Any] = {k: training[k] for k in TRAINING_KEYS if training.get(k) is not None}
        ev = env.get("eval") or {}
        cfg = cls(
            **kwargs,
            env_id=env["id"],
            env_args=dict(env.get("args") or {}),
            harness=env.get("harness") or "prl",
            eval=EvalConfig(every=int(ev.get("every", 0)), examples=int(ev.get("examples", 64))),
            model_path=str(model.get("tokenizer") or model["path"]),
            served_model_name=_served_name(plan),
            dp_size=int(mesh.get("dp_replicate", 1)) * int(mesh.get("dp_shard", 1)),
            advantage=AdvantageConfig.from_dict(training.get("advantage") or {}),
        )
        if cfg.batch_size % cfg.rollouts_per_example:
            raise ConfigError(
                f"training.batch_size({cfg.batch_size}) must be a multiple of "
                f"training.rollouts_per_example({cfg.rollouts_per_example})"
            )
        return cfg


TRAINING_KEYS = tuple(
    f.name
    for f in fields(OrchestratorConfig)
    if f.name not in {"env_id", "model_path", "env_args", "harness", "eval", "dp_size", "served_model_name", "advantage"}
)
"""The `training` keys the orchestrator reads (besides `advantage`)."""


def _served_name(plan: dict) -> str | None:
    for server in plan.get("servers") or []:
        args = list(server.get("args") or [])
        for i, a in enumerate(args):
            if a == "--served-model-name" and i + 1 < len(args):
                return args[i + 1]
            if a.startswith("--served-model-name="):
                return a.split("=", 1)[1]
    return None
