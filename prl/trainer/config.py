"""The trainer's view of the plan: which model, which mesh, which training settings.

Every value comes from RUN/plan.json (the typed `Plan`); nothing here has a default of its
own. The training settings are the topology's `Training` schema itself (prl/config/topology.py),
so `lr` or `checkpoint_interval` mean one thing everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Optional

from prl.config.topology import SFT, Lora, Training, Weights
from prl.planner.model import Mesh, Plan, node_address


@dataclass(frozen=True)
class TrainerConfig:
    model_path: str
    """Local directory of the Hugging Face model (config, safetensors, tokenizer)."""
    model_dtype: str
    """dtype of the published weights (and of the model the inference engine serves)."""
    mesh: Mesh
    """The trainer's mesh: `mesh.dp_replicate * mesh.dp_shard * mesh.cp` ranks, `mesh.ep` carved out of them."""
    activation_checkpointing: bool
    precision: str
    """'bf16' (bf16 compute, fp32 master weights and gradient reduction), 'fp32', or 'fp8' (bf16, with the
    blocks' linear layers in float8: prl/trainer/float8.py). On CPU, bf16 is run as fp32: CPU bf16 matmuls are
    slow and FSDP's CPU path is tested in fp32 (fp8's float8 matmuls still run, emulated)."""
    master_port: int
    training: Training
    """The topology's training settings themselves: read `cfg.training.lr`, `cfg.training.loss`, ..."""
    tokenizer_path: str
    """The model's tokenizer (`model.tokenizer`, else `model.path`): SFT renders and tokenizes with it."""
    max_model_len: int
    """Longest sequence; SFT cuts conversations there."""
    sft: Optional[SFT]
    """The SFT data settings (None: an RL run)."""
    weights: Weights = Weights()
    """The topology's weight settings themselves: which transport (prl/weights) moves each step to the servers."""
    weight_ports: tuple[int, ...] = ()
    """Each rank's port for a transport that sends from memory, by global rank (empty: every step goes to disk)."""
    node_address: str = ""
    """This node's address as the servers reach it (where such a transport listens)."""
    weight_backend: str = "gloo"
    """The broadcast groups' backend, as planned (`TrainerPlan.weight_backend`)."""
    scorers: tuple[str, ...] = ()
    """The scoring roles of the run (`teacher`, `reference`): their logprobs come in every batch."""
    lora: Optional[Lora] = None
    """`model.lora`: train and publish an adapter on the frozen model (None: every weight)."""
    train_vision: bool = False
    """`model.train_vision`: a vision-language model's image encoder trains too (default: frozen)."""
    compile: bool = False
    """`trainer.compile`: each transformer block goes through torch.compile before FSDP2 wraps it, and the logprob
    head's per-chunk arithmetic is compiled (prl/trainer/logprobs.py, `fused_arithmetic`)."""

    @classmethod
    def from_plan(cls, plan: Plan) -> TrainerConfig:
        tr, settings = plan.trainer, plan.settings()
        # "auto" keeps the checkpoint's own dtype for serving; published weights are then bf16.
        dtype = "bfloat16" if settings.model.dtype == "auto" else settings.model.dtype
        return cls(model_path=settings.model.path, model_dtype=dtype, mesh=tr.mesh,
                   activation_checkpointing=tr.activation_checkpointing, precision=tr.precision,
                   master_port=tr.master_port, training=settings.training,
                   tokenizer_path=settings.model.tokenizer or settings.model.path,
                   max_model_len=settings.model.max_model_len, sft=settings.sft,
                   weights=settings.weights, weight_ports=tr.weight_ports,
                   node_address=node_address(plan) if tr.weight_ports else "", weight_backend=tr.weight_backend,
                   scorers=plan.scorer_roles(), lora=settings.model.lora,
                   train_vision=settings.model.train_vision, compile=tr.compile)
