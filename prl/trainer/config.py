"""The trainer's view of the plan: which model, which mesh, which training settings.

Every value comes from RUN/plan.json (the typed `Plan`); nothing here has a default of its
own. The training settings are the topology's `Training` schema itself (prl/config/topology.py),
so `lr` or `checkpoint_interval` mean one thing everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Optional

from prl.config.topology import SFT, Loss, Training
from prl.planner.model import Mesh, Plan


@dataclass(frozen=True)
class TrainerConfig:
    model_path: str
    """Local directory of the Hugging Face model (config, safetensors, tokenizer)."""
    model_dtype: str
    """dtype of the published weights (and of the model the inference engine serves)."""
    mesh: Mesh
    activation_checkpointing: bool
    precision: str
    """'bf16' (bf16 compute, fp32 master weights and gradient reduction) or 'fp32'.
    On CPU, bf16 is run as fp32: CPU bf16 matmuls are slow and FSDP's CPU path is tested in fp32."""
    master_port: int
    training: Training
    tokenizer_path: str
    """The model's tokenizer (`model.tokenizer`, else `model.path`): SFT renders and tokenizes with it."""
    max_model_len: int
    """Longest sequence; SFT cuts conversations there."""
    sft: Optional[SFT]
    """The SFT data settings (None: an RL run)."""

    @classmethod
    def from_plan(cls, plan: Plan) -> TrainerConfig:
        tr, settings = plan.trainer, plan.settings()
        # "auto" keeps the checkpoint's own dtype for serving; published weights are then bf16.
        dtype = "bfloat16" if settings.model.dtype == "auto" else settings.model.dtype
        return cls(model_path=settings.model.path, model_dtype=dtype, mesh=tr.mesh,
                   activation_checkpointing=tr.activation_checkpointing, precision=tr.precision,
                   master_port=tr.master_port, training=settings.training,
                   tokenizer_path=settings.model.tokenizer or settings.model.path,
                   max_model_len=settings.model.max_model_len, sft=settings.sft)

    # The mesh, by name.
    world_size = property(lambda self: self.mesh.world_size)
    dp_replicate = property(lambda self: self.mesh.dp_replicate)
    dp_shard = property(lambda self: self.mesh.dp_shard)
    cp = property(lambda self: self.mesh.cp)
    ep = property(lambda self: self.mesh.ep)
    dp_size = property(lambda self: self.mesh.dp)

    # The training settings the trainer reads, by name.
    micro_batch_tokens = property(lambda self: self.training.micro_batch_tokens)
    max_off_policy_steps = property(lambda self: self.training.max_off_policy_steps)
    lr = property(lambda self: self.training.lr)
    weight_decay = property(lambda self: self.training.weight_decay)
    max_grad_norm = property(lambda self: self.training.max_grad_norm)
    max_steps = property(lambda self: self.training.max_steps)
    seed = property(lambda self: self.training.seed)
    checkpoint_interval = property(lambda self: self.training.checkpoint_interval)
    checkpoint_keep = property(lambda self: self.training.checkpoint_keep)
    rollout_timeout_s = property(lambda self: self.training.rollout_timeout_s)
    router_aux_loss_coef = property(lambda self: self.training.router_aux_loss_coef)

    @property
    def loss(self) -> Loss:
        return self.training.loss
