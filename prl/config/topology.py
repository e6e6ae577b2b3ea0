"""The topology schema (`configs/*.yaml`): what the user asks for, checked, nothing derived.

`prl.planner.plan.make_plan` turns a Topology and a ClusterProfile into a Plan. Every
field is documented right under it; docs/reference.md lists them all. Counts carry upper
bounds so that a typo (10**12 nodes) stops here, at its line, rather than in the planner.
"""

from __future__ import annotations

from pathlib import Path
import re
from typing import Annotated, Any, Literal, Optional, Sequence

from pydantic import Field, field_validator, model_validator

from prl.config.cluster import (MAX_CPUS, MAX_GB, MAX_GPUS_PER_NODE, MAX_ITEMS, MAX_NODES, Env, Strict, Text,
                                Token, check_env_names, check_time, minutes_as_text)
from prl.config.loader import FieldValueError, Source, load, shown

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
MAX_DEGREE = 4096
"""Largest tp, dp, cp, ep or dp_replicate."""
MAX_TOKENS = 1 << 24
MAX_COUNT = 1_000_000_000
"""Largest step, example or rollout count."""
MAX_SECONDS = 10_000_000.0
_DIRECTIVE = re.compile(r"^--[A-Za-z][A-Za-z0-9-]*(=[A-Za-z0-9_.,:/@%+=\[\]-]+)?$")

Args = Annotated[list[Text], Field(max_length=MAX_ITEMS)]
"""Command-line arguments, one per item."""


class Model(Strict):
    path: Text = Field(min_length=1)
    """Local directory of a Hugging Face model, or a hub id the nodes have cached."""
    tokenizer: Optional[Text] = None
    """Tokenizer directory or id when it differs from `path`."""
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    """Weights dtype for inference and published weights."""
    max_model_len: int = Field(default=4096, ge=16, le=MAX_TOKENS)
    """Longest prompt + completion, in tokens."""


class InferenceGroup(Strict):
    """Nodes that run identical vLLM replicas."""

    nodes: int = Field(ge=1, le=MAX_NODES)
    """Nodes in this group."""
    tp: int = Field(default=1, ge=1, le=MAX_DEGREE)
    """Tensor-parallel size of one engine (GPUs of one node)."""
    dp: int = Field(default=1, ge=1, le=MAX_DEGREE)
    """Data-parallel ranks in one replica (one server); with `expert_parallel`, MoE experts spread over tp*dp GPUs."""
    expert_parallel: bool = False
    """vLLM `--enable-expert-parallel` for MoE models."""
    gpu_memory_utilization: Optional[float] = Field(default=None, gt=0, le=1)
    """vLLM `--gpu-memory-utilization` (None: vLLM's default)."""
    extra_args: Args = []
    """More `vllm serve` arguments, passed as given (each list item is one argument)."""
    env: Env = {}
    """Variables for this group's servers."""

    _names = field_validator("env")(check_env_names)


class KVConnector(Strict):
    name: str = Field(default="NixlConnector", max_length=256, pattern=r"^[A-Za-z0-9_.]+$")
    """vLLM KV connector class (`NixlConnector` on GPU clusters, `ExampleConnector` for the storage-based CPU test)."""
    extra_config: dict[str, Any] = Field(default={}, max_length=MAX_ITEMS)
    """`kv_connector_extra_config` passed to both sides."""
    load_failure: Literal["recompute", "fail"] = "recompute"
    """What a decode server does when the prompt's KV does not arrive (vLLM's `kv_load_failure_policy`):
    `recompute` the prompt (slower, still right), or `fail` the request, which ends with no tokens."""


class Router(Strict):
    port: Optional[int] = Field(default=None, ge=1024, le=65535)
    """Port of the router in front of prefill/decode servers (None: the cluster's port base)."""


class KVOffload(Strict):
    backend: Literal["none", "native", "lmcache"] = "none"
    """KV-cache offload: off, vLLM's native CPU offload, or LMCache."""
    cpu_gb: float = Field(default=0, ge=0, le=MAX_GB)
    """CPU memory per replica for offloaded KV blocks, in GiB."""
    disk_path: Optional[Text] = None
    """LMCache only: a local disk tier directory."""
    disk_gb: float = Field(default=0, ge=0, le=MAX_GB)
    """LMCache only: size of the disk tier, in GiB."""

    @model_validator(mode="after")
    def _consistent(self) -> "KVOffload":
        if self.backend != "none" and self.cpu_gb <= 0:
            raise ValueError(f"kv_offload.backend={self.backend} needs cpu_gb > 0")
        if self.disk_path is not None and self.backend != "lmcache":
            raise ValueError("a disk tier (disk_path) needs backend: lmcache")
        if self.disk_path is not None and self.disk_gb <= 0:
            raise ValueError("disk_path needs disk_gb > 0")
        return self


class OnFailure(Strict):
    """What the launcher does when a role's process exits (at all, whatever its code) before the job stops."""

    policy: Literal["restart", "fail"] = "restart"
    """`restart`: start that server again inside the allocation (same node, latest published weights), the
    run goes on; `fail`: end the job (it requeues when the cluster profile allows)."""
    max_restarts: int = Field(default=3, ge=0, le=MAX_ITEMS)
    """Restarts of this role allowed in one attempt of the job; one more failure ends the job."""


class EndsTheJob(Strict):
    """Failure policy of the trainer and the orchestrator: a failure ends the job (requeue resumes it)."""

    policy: Literal["fail"] = "fail"
    """Only `fail`: the trainer and orchestrator resume from their checkpoints through a requeue, not a restart."""


class Inference(Strict):
    """Either one unified group (`nodes`, `tp`, ...) or a `prefill` and a `decode` group."""

    nodes: Optional[int] = Field(default=None, ge=1, le=MAX_NODES)
    """Unified: nodes serving both prefill and decode."""
    tp: int = Field(default=1, ge=1, le=MAX_DEGREE)
    """Unified: tensor-parallel size."""
    dp: int = Field(default=1, ge=1, le=MAX_DEGREE)
    """Unified: data-parallel ranks per replica."""
    expert_parallel: bool = False
    """Unified: vLLM expert parallelism."""
    gpu_memory_utilization: Optional[float] = Field(default=None, gt=0, le=1)
    """Unified: vLLM `--gpu-memory-utilization`."""
    extra_args: Args = []
    """Unified: more `vllm serve` arguments."""
    env: Env = {}
    """Unified: variables for the servers."""
    prefill: Optional[InferenceGroup] = None
    """Disaggregated: the prefill group."""
    decode: Optional[InferenceGroup] = None
    """Disaggregated: the decode group."""
    kv_connector: KVConnector = KVConnector()
    """Disaggregated: how KV blocks move from prefill to decode."""
    router: Router = Router()
    """Disaggregated: the router in front."""
    kv_offload: KVOffload = KVOffload()
    """KV-cache offload for every server."""
    on_failure: OnFailure = OnFailure()
    """Failure policy of every inference (prefill, decode) server: restarted by default."""

    _names = field_validator("env")(check_env_names)

    @model_validator(mode="after")
    def _one_form(self) -> "Inference":
        split = self.prefill is not None or self.decode is not None
        if split and self.nodes is not None:
            raise ValueError("give either nodes (unified) or prefill + decode (disaggregated), not both")
        if split and (self.prefill is None or self.decode is None):
            raise ValueError("disaggregated inference needs both prefill and decode groups")
        if not split and self.nodes is None:
            raise ValueError("give nodes (unified inference) or prefill + decode groups")
        stray = [name for name in _UNIFIED if name in self.model_fields_set] if split else []
        if stray:
            raise FieldValueError(stray[0], f"{stray[0]} is a field of unified inference and would be ignored "
                                            f"beside prefill and decode; set it inside each group")
        return self

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    def groups(self) -> dict[str, InferenceGroup]:
        """Role name -> group, in het-group order."""
        if self.prefill is not None and self.decode is not None:
            return {"prefill": self.prefill, "decode": self.decode}
        assert self.nodes is not None
        unified = InferenceGroup(
            nodes=self.nodes, tp=self.tp, dp=self.dp, expert_parallel=self.expert_parallel,
            gpu_memory_utilization=self.gpu_memory_utilization, extra_args=self.extra_args, env=self.env,
        )
        return {"inference": unified}


_UNIFIED = ("tp", "dp", "expert_parallel", "gpu_memory_utilization", "extra_args", "env")


class Trainer(Strict):
    nodes: int = Field(ge=1, le=MAX_NODES)
    """Nodes of the trainer."""
    gpus_per_node: Optional[int] = Field(default=None, ge=1, le=MAX_GPUS_PER_NODE)
    """GPUs used per node (None: all of the cluster's)."""
    dp_replicate: int = Field(default=1, ge=1, le=MAX_DEGREE)
    """HSDP replicas (full copies of the sharded model)."""
    dp_shard: int = Field(default=-1, le=MAX_NODES * MAX_GPUS_PER_NODE)
    """FSDP shard degree; -1 fills what the other degrees leave."""
    cp: int = Field(default=1, ge=1, le=MAX_DEGREE)
    """Context-parallel degree."""
    ep: int = Field(default=1, ge=1, le=MAX_DEGREE)
    """Expert-parallel degree (MoE), carved out of dp_shard * cp as in torchtitan."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    precision: Literal["bf16", "fp32"] = "bf16"
    """Parameter/compute dtype of the FSDP mixed-precision policy (reduction in fp32)."""
    env: Env = {}
    """Variables for the trainer."""
    on_failure: EndsTheJob = EndsTheJob()
    """Failure policy of the trainer: a failure ends the job."""

    _names = field_validator("env")(check_env_names)

    @field_validator("dp_shard")
    @classmethod
    def _shard(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("dp_shard must be >= 1, or -1 to fill the remaining GPUs")
        return value


class Orchestrator(Strict):
    placement: Literal["own", "trainer", "inference"] = "own"
    """`own`: a CPU node group of its own; `trainer`/`inference`: share the first node of that group."""
    cpus: Optional[int] = Field(default=None, ge=1, le=MAX_CPUS)
    """CPU cores for the orchestrator (None: a whole node when `own`, 4 when shared)."""
    env: Env = {}
    """Variables for the orchestrator."""
    on_failure: EndsTheJob = EndsTheJob()
    """Failure policy of the orchestrator: a failure ends the job."""

    _names = field_validator("env")(check_env_names)


class EvalSettings(Strict):
    every: int = Field(default=0, ge=0, le=MAX_COUNT)
    """Evaluate every N steps on the eval split (0: never)."""
    examples: int = Field(default=64, ge=1, le=MAX_COUNT)
    """Examples per evaluation."""


class Environment(Strict):
    id: Text = Field(min_length=1)
    """verifiers taskset id (an installed module) or a module path."""
    args: dict[str, Any] = Field(default={}, max_length=MAX_ITEMS)
    """Arguments for the taskset."""
    harness: Text = Field(default="prl", min_length=1)
    """verifiers harness id."""
    eval: EvalSettings = EvalSettings()


class Loss(Strict):
    mode: Literal["mask", "clip"] = "mask"
    """Tokens whose importance ratio leaves [ratio_low, ratio_high] are masked out, or their ratio clipped."""
    ratio_low: float = Field(default=0.0, ge=0)
    ratio_high: float = Field(default=5.0, gt=0)
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of a KL term against the sampling policy (0: off)."""

    @model_validator(mode="after")
    def _bounds(self) -> "Loss":
        if self.ratio_low >= self.ratio_high:
            raise ValueError(f"ratio_low ({self.ratio_low}) must be below ratio_high ({self.ratio_high})")
        return self


class Advantage(Strict):
    std_normalize: bool = False
    """Divide by the group's reward std (GRPO); off: mean-centring only (Dr.GRPO)."""
    length_penalty: float = Field(default=0.0, ge=0)
    """Subtract length_penalty * completion_tokens / max_tokens from each reward before centring."""
    drop_zero_groups: bool = False
    """Leave groups whose advantages are all zero out of the batch."""
    eps: float = Field(default=1e-6, gt=0)
    """Added to the std before dividing."""


class Training(Strict):
    batch_size: int = Field(ge=1, le=MAX_COUNT)
    """Rollouts per training step (all ranks together); SFT: conversations per step."""
    rollouts_per_example: int = Field(default=8, ge=1, le=MAX_COUNT)
    """Rollouts per prompt; advantages are relative within these groups."""
    micro_batch_tokens: int = Field(default=8192, ge=16, le=MAX_COUNT)
    """Most tokens in one packed micro-batch."""
    max_off_policy_steps: int = Field(default=2, ge=0, le=MAX_COUNT)
    """Rollouts for step N come from weights no older than step N-1-k (0: synchronous, on-policy)."""
    lr: float = Field(default=1e-6, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    max_steps: int = Field(ge=1, le=MAX_COUNT)
    seed: int = Field(default=0, ge=0, le=2**32 - 1)
    """Seed of every random generator (NumPy takes at most 2**32 - 1)."""
    checkpoint_interval: int = Field(default=50, ge=0, le=MAX_COUNT)
    """Steps between checkpoints (0: never)."""
    checkpoint_keep: int = Field(default=2, ge=1, le=MAX_ITEMS)
    """Checkpoints kept on disk."""
    max_tokens: int = Field(default=1024, ge=1, le=MAX_TOKENS)
    """Most tokens generated per rollout turn."""
    temperature: float = Field(default=1.0, ge=0)
    loss: Loss = Loss()
    advantage: Advantage = Advantage()
    router_aux_loss_coef: float = Field(default=0.0, ge=0)
    """MoE only: weight of the router's load-balancing loss (transformers' `load_balancing_loss_func`; 0: off,
    the RL loss alone trains the router)."""
    max_concurrent_rollouts: int = Field(default=256, ge=1, le=MAX_COUNT)
    """Rollouts in flight at once, over all inference servers."""
    rollout_retries: int = Field(default=3, ge=0, le=MAX_ITEMS)
    """Extra attempts for a rollout that failed on a transient HTTP error (on another server if any)."""
    weight_update_retries: int = Field(default=5, ge=1, le=MAX_ITEMS)
    """Attempts to make a server load a weights step before the orchestrator fails."""
    weights_timeout_s: float = Field(default=3600.0, gt=0, le=MAX_SECONDS)
    """Longest the orchestrator waits for the weights a step needs."""
    endpoint_timeout_s: float = Field(default=600.0, gt=0, le=MAX_SECONDS)
    """Longest the orchestrator waits for the inference servers at start."""
    rollout_timeout_s: float = Field(default=3600.0, gt=0, le=MAX_SECONDS)
    """Longest the trainer waits for a step's rollouts."""
    hang_timeout_s: Optional[float] = Field(default=None, ge=30, le=MAX_SECONDS)
    """A trainer or orchestrator whose main loop has not reported progress (heartbeat) for this long is
    hung: the launcher stops the job (and requeues it when the profile allows). None: max(900 s,
    4 x the slowest step seen so far in this attempt), see docs/jobs.md. At least 30 s: a waiting role
    beats every 10 s. Servers: their task probes
    /health; one that does not answer for this long (None: 300 s) is failed and handled by `on_failure`."""


class SFT(Strict):
    """Supervised fine-tuning: the trainer alone learns from chat conversations (no inference, orchestrator or
    environment). Optimizer, batch (`training.batch_size` conversations per step), micro-batch, steps and
    checkpoints are `training:`'s; conversations longer than `model.max_model_len` tokens are cut there."""

    data: Text = Field(min_length=1)
    """Chat data (`messages` lists): a `.jsonl` or `.parquet` file, or a local Hugging Face datasets directory.
    A relative path that exists where prl runs is made absolute."""
    split: str = Field(default="train", max_length=128, pattern=NAME)
    """Split to read from a datasets directory."""
    epochs: Optional[int] = Field(default=None, ge=1, le=MAX_COUNT)
    """Stop after this many passes over the data, or at `training.max_steps`, whichever comes first (None:
    `max_steps` alone). Every pass is shuffled anew from `training.seed`."""


class Slurm(Strict):
    time: Optional[str] = None
    """Time limit (`--time`); None: the cluster's default."""
    qos: Optional[Token] = None
    reservation: Optional[Token] = None
    account: Optional[Token] = None
    """Overrides the profile's account."""
    job_name: Optional[str] = Field(default=None, max_length=128, pattern=NAME)
    """Job name (None: the topology name)."""
    extra_directives: list[Text] = Field(default=[], max_length=MAX_ITEMS)
    """More `#SBATCH` options for every het component, e.g. `--mail-type=END` (one option per item)."""

    _time_in = field_validator("time", mode="before")(minutes_as_text)
    _time = field_validator("time")(check_time)

    @field_validator("extra_directives")
    @classmethod
    def _directives(cls, items: list[str]) -> list[str]:
        for item in items:
            if not _DIRECTIVE.match(item):
                raise ValueError(f"each extra directive is one long option like --mail-type=END: --name or "
                                 f"--name=value of letters, digits and _.,:/@%+=[]- only, not {shown(item)}")
        return items


class Topology(Strict):
    name: str = Field(max_length=128, pattern=NAME)
    """Run name: letters, digits, '.', '_', '-'."""
    cluster: Text = Field(min_length=1)
    """Cluster profile: a name in clusters/ or a path to a profile file."""
    run_dir: Optional[Text] = None
    """Run directory on the shared filesystem (None: SHARED_ROOT/prl-runs/NAME)."""
    model: Model
    inference: Optional[Inference] = None
    """RL only: the vLLM servers."""
    trainer: Trainer
    orchestrator: Orchestrator = Orchestrator()
    """RL only: where the orchestrator runs."""
    environment: Optional[Environment] = None
    """RL only: the verifiers environment trained on."""
    sft: Optional[SFT] = None
    """Supervised fine-tuning instead of RL: a trainer-only job (then no inference, orchestrator, environment)."""
    training: Training
    slurm: Slurm = Slurm()

    @model_validator(mode="after")
    def _rl_or_sft(self) -> "Topology":
        if self.sft is not None:
            stray = [name for name in _RL_ONLY if name in self.model_fields_set]
            if stray:
                raise FieldValueError(stray[0], f"an SFT topology (sft:) runs the trainer alone: remove {stray[0]}")
            return self
        for name in ("inference", "environment"):
            if getattr(self, name) is None:
                raise FieldValueError(name, f"missing: an RL topology needs inference: and environment: "
                                            f"(or give sft: for supervised fine-tuning)")
        return self

    @field_validator("run_dir")
    @classmethod
    def _run_dir(cls, value: Optional[str]) -> Optional[str]:
        if value is None:
            return value
        parts = value.split("/")
        if ".." in parts:
            raise ValueError(f"run_dir must not contain '..' components (got {shown(value)})")
        if all(part in ("", ".") for part in parts):
            raise ValueError(f"run_dir must name a directory of its own, not {shown(value)}")
        return value


_RL_ONLY = ("inference", "orchestrator", "environment")


def load_topology(path: Path, overrides: Sequence[str] = ()) -> tuple[Topology, Source]:
    """Load a topology; overrides whose first part is `cluster.` are left for the profile."""
    own = [item for item in overrides if not item.startswith("cluster.")]
    return load(Topology, path, own)


def cluster_overrides(overrides: Sequence[str]) -> list[str]:
    """`cluster.max_nodes=8` on the command line overrides the profile's `max_nodes`."""
    return [item[len("cluster."):] for item in overrides if item.startswith("cluster.")]
