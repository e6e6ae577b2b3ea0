"""The trainer's settings, read from the `model`, `trainer` and `training` sections of RUN/plan.json.

The planner writes plan.json; the trainer only picks what it needs. Unknown
keys are ignored (the plan carries other roles' settings too) and optional
keys get the defaults below. A missing required key is a ConfigError that
names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from prl.errors import ConfigError
from prl.trainer.loss import LossConfig


@dataclass(frozen=True)
class TrainerConfig:
    model_path: str
    """Local directory of the Hugging Face model (config, safetensors, tokenizer)."""
    model_dtype: str = "bfloat16"
    """dtype of the published weights (and of the model the inference engine serves)."""
    max_model_len: int = 2048

    world_size: int = 1
    """Trainer processes (GPUs) in total; must equal the torchrun world size."""
    dp_replicate: int = 1
    """HSDP replica groups (>1: FSDP inside a group, all-reduce across groups)."""
    dp_shard: int = 1
    """Ranks each parameter is sharded across."""
    cp: int = 1
    """Context-parallel degree (only 1 is implemented)."""
    ep: int = 1
    """Expert-parallel degree (only 1 is implemented)."""
    activation_checkpointing: bool = False
    precision: str = "bf16"
    """'bf16' (bf16 compute, fp32 master weights and gradient reduction) or 'fp32'.
    On CPU, bf16 is run as fp32: CPU bf16 matmuls are slow and FSDP's CPU path is tested in fp32."""
    master_port: int = 29500

    micro_batch_tokens: int = 4096
    max_off_policy_steps: int = 2
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """0 disables gradient clipping (the norm is still reported)."""
    max_steps: int = 10
    seed: int = 0
    checkpoint_interval: int = 5
    """Save a checkpoint every this many steps (and after the last); 0 disables."""
    checkpoint_keep: int = 2
    """Newest checkpoints kept; 0 keeps all."""
    rollout_timeout_s: float = 3600.0
    """How long to wait for one step's rollouts before failing."""
    loss: LossConfig = field(default_factory=LossConfig)

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @classmethod
    def from_plan(cls, plan: dict[str, Any]) -> TrainerConfig:
        model = plan.get("model") or {}
        trainer = plan.get("trainer") or {}
        training = plan.get("training") or {}
        mesh = trainer.get("mesh") or {}
        if "path" not in model:
            raise ConfigError("plan.json has no model.path: the trainer needs the model directory")
        raw: dict[str, Any] = {
            "model_path": model["path"],
            "model_dtype": model.get("dtype"),
            "max_model_len": model.get("max_model_len"),
            **{k: trainer.get(k) for k in ("world_size", "activation_checkpointing", "precision", "master_port")},
            **{k: mesh.get(k) for k in ("dp_replicate", "dp_shard", "cp", "ep")},
            **{f.name: training.get(f.name) for f in fields(cls) if f.name in training and f.name != "loss"},
        }
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if v is not None and k in known}
        try:
            loss_raw = training.get("loss") or {}
            loss = LossConfig(
                **{k: loss_raw[k] for k in ("ratio_low", "ratio_high", "mode", "kl_coef") if k in loss_raw}
            )
            cfg = cls(**kwargs, loss=loss)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"plan.json trainer settings: {e}") from e
        if cfg.precision not in ("bf16", "fp32"):
            raise ConfigError(f"trainer.precision must be 'bf16' or 'fp32', got {cfg.precision!r}")
        return cfg
