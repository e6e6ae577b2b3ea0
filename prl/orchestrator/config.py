"""The orchestrator's view of the plan: environment, tokenizer, served model name, training settings.

Every value comes from RUN/plan.json (the typed `Plan`); nothing here has a default of its
own. The settings are the topology's schemas themselves (`Training`, `Environment`), so a
value means one thing in the planner, the orchestrator and the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prl.config.topology import Advantage, Environment, EvalSettings, Training
from prl.planner.model import Plan


@dataclass(frozen=True)
class OrchestratorConfig:
    training: Training
    environment: Environment
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

    @classmethod
    def from_plan(cls, plan: Plan) -> OrchestratorConfig:
        settings = plan.settings()
        return cls(training=settings.training, environment=settings.environment,
                   model_path=settings.model.tokenizer or settings.model.path, dp_size=plan.trainer.mesh.dp,
                   served_model_name=plan.served_model_name, renderer=settings.model.renderer,
                   env_workers=plan.orchestrator.env_workers if plan.orchestrator else 0)

    # The environment, by name.
    env_id = property(lambda self: self.environment.id)
    harness = property(lambda self: self.environment.harness)

    @property
    def env_args(self) -> dict[str, Any]:
        return dict(self.environment.args)

    @property
    def eval(self) -> EvalSettings:
        return self.environment.eval

    # The training settings the orchestrator reads, by name.
    batch_size = property(lambda self: self.training.batch_size)
    rollouts_per_example = property(lambda self: self.training.rollouts_per_example)
    max_off_policy_steps = property(lambda self: self.training.max_off_policy_steps)
    max_steps = property(lambda self: self.training.max_steps)
    max_tokens = property(lambda self: self.training.max_tokens)
    temperature = property(lambda self: self.training.temperature)
    micro_batch_tokens = property(lambda self: self.training.micro_batch_tokens)
    seed = property(lambda self: self.training.seed)
    max_concurrent_rollouts = property(lambda self: self.training.max_concurrent_rollouts)
    rollout_mode = property(lambda self: self.training.rollout_mode)
    rollout_retries = property(lambda self: self.training.rollout_retries)
    weight_update_retries = property(lambda self: self.training.weight_update_retries)
    weights_timeout_s = property(lambda self: self.training.weights_timeout_s)
    endpoint_timeout_s = property(lambda self: self.training.endpoint_timeout_s)

    @property
    def advantage(self) -> Advantage:
        return self.training.advantage

    @property
    def examples_per_step(self) -> int:
        return self.batch_size // self.rollouts_per_example

    def min_version(self, step: int) -> int:
        """Oldest weights version allowed to generate rollouts for `step`."""
        return max(0, step - 1 - self.max_off_policy_steps)
