"""The orchestrator's view of the plan: environment, tokenizer, served model name, training settings.

Every value comes from RUN/plan.json (the typed `Plan`); nothing here has a default of its
own. The settings are the topology's schemas themselves (`Training`, `Environment`), read by
their one name (`cfg.training.max_steps`, `cfg.environment.eval.every`), so a value means one
thing in the planner, the orchestrator and the trainer. Derived here: `examples_per_step` and
the staleness bound `min_version`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prl.config.topology import Environment, Training, Weights
from prl.planner.model import Plan


@dataclass(frozen=True)
class OrchestratorConfig:
    training: Training
    """The `training` section (batch and group size, staleness bound, sampling, retries, timeouts, advantage):
    the very object the trainer reads."""
    environment: Environment
    """The `environment` section: taskset id, args, harness, limits and `eval` settings."""
    model_path: str
    """Tokenizer directory: it renders prompts client-side (`model.tokenizer` wins over `model.path`)."""
    dp_size: int
    """Trainer data-parallel ranks (dp_replicate * dp_shard): the batch is packed for them."""
    served_model_name: str | None
    """Model name the servers answer to (`--served-model-name`); None: ask GET /v1/models."""
    renderer: dict[str, Any] | None
    """`model.renderer`: the `renderers` config of the train client (None: chosen from the tokenizer)."""
    env_workers: int = 0
    """`orchestrator.env_workers`: processes that run the environment's rollouts (0: this process)."""
    scorers: tuple[str, ...] = ()
    """The scoring roles (`teacher`, `reference`) whose logprobs every sample gets (prl/orchestrator/scoring.py)."""
    weights: Weights = Weights()
    """The `weights` section: which transport (prl/weights) brings each step to the servers."""

    @classmethod
    def from_plan(cls, plan: Plan) -> OrchestratorConfig:
        settings = plan.settings()
        return cls(training=settings.training, environment=settings.environment,
                   model_path=settings.model.tokenizer or settings.model.path, dp_size=plan.trainer.mesh.dp,
                   served_model_name=plan.served_model_name, renderer=settings.model.renderer,
                   env_workers=plan.orchestrator.env_workers if plan.orchestrator else 0,
                   scorers=plan.scorer_roles(), weights=settings.weights)

    @property
    def examples_per_step(self) -> int:
        """Groups (tasks) a step trains on: batch_size / rollouts_per_example."""
        return self.training.batch_size // self.training.rollouts_per_example

    def min_version(self, step: int) -> int:
        """Oldest weights version allowed to generate rollouts for `step`."""
        return max(0, step - 1 - self.training.max_off_policy_steps)
