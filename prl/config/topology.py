"""The topology schema (`configs/*.yaml`): what the user asks for, checked, nothing derived.

`prl.planner.plan.make_plan` turns a Topology and a ClusterProfile into a Plan. Every
field is documented right under it; docs/reference.md lists them all. Counts carry upper
bounds so that a typo (10**12 nodes) stops here, at its line, rather than in the planner.
"""

from __future__ import annotations

from pathlib import Path
import re
from typing import Annotated, Any, Literal, Optional, Sequence, Union

import msgspec
from msgspec import UNSET, Meta, UnsetType

from prl.config.types import (MAX_CPUS, MAX_GB, MAX_GPUS_PER_NODE, MAX_ITEMS, MAX_NODES, Env, Ident, Name,
                              PathText, SlurmTime, Strict, Text, Token, checked_time)
from prl.config.fields import FieldValueError, shown
from prl.config.loader import Source, explained, load
from prl.states import KV_ROLES, SCORER_ROLES, Role

MAX_DEGREE = 4096
"""Largest tp, dp, cp, ep or dp_replicate."""
MAX_TOKENS = 1 << 24
MAX_COUNT = 1_000_000_000
"""Largest step, example or rollout count."""
MAX_SECONDS = 10_000_000.0
_DIRECTIVE = re.compile(r"\A--[A-Za-z][A-Za-z0-9-]*(=[A-Za-z0-9_.,:/@%+=\[\]-]+)?\Z")

Args = Annotated[list[Text], Meta(max_length=MAX_ITEMS)]
"""Command-line arguments, one per item."""


def _class_name(value: str) -> str:
    return "must be a class name: letters, digits, '_' and '.' only"


def _transport_name(value: str) -> str:
    return "must name a weight transport: lowercase letters, digits and '_' (docs/weights.md lists them)"


class Lora(Strict, kw_only=True):
    """Train a low-rank adapter instead of every weight (prl/trainer/lora.py): the base model stays frozen,
    each target linear layer W gets W + (alpha / rank) * B @ A, and only A and B are trained, checkpointed and
    sent to the inference servers (in PEFT's layout, hot-loaded by vLLM's LoRA support)."""

    rank: Annotated[int, Meta(ge=1, le=512)]
    """The adapter's rank r (A is r x in, B is out x r). vLLM serves ranks up to 512."""
    alpha: Optional[Annotated[float, Meta(gt=0, le=MAX_COUNT)]] = None
    """Scale numerator: the update is (alpha / rank) * B @ A (None: alpha = rank, a scale of 1)."""
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    """Dropout on the adapter's input while training (0: off; in RL it widens the trainer/inference mismatch)."""
    target_modules: Annotated[list[Name], Meta(min_length=1, max_length=MAX_ITEMS)] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Names of the linear layers that get an adapter (the last part of their module name, as in PEFT): the
    default is every attention and MLP projection of Llama/Qwen-style models. An MoE model's routed experts
    are adapted per expert by their checkpoint names (gate_proj, up_proj, down_proj; Mixtral's w1, w3, w2).
    Checked against the model's architecture when planned."""

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank


TINY_MOE_FAMILIES = ("mixtral", "deepseek_v3", "gpt_oss", "glm4_moe")
"""MoE families `model.build_tiny` builds besides `moe` (Qwen3-MoE), as written in its Literal: prl.trainer.tiny_model's,
less Qwen3.5-MoE (whose linear-attention layers the planner refuses)."""


class Model(Strict, kw_only=True):
    path: Optional[PathText] = None
    """Local directory of a Hugging Face model, or a hub id the nodes have cached. Or `from_run`."""
    from_run: Optional[PathText] = None
    """Start from another prl run's published weights (an SFT run, or an RL run to continue from): that run's
    directory. Resolved when planned to `RUN/weights/step_N` (`from_step`, else its newest published step),
    which becomes `path`."""
    from_step: Optional[Annotated[int, Meta(ge=1, le=MAX_COUNT)]] = None
    """With `from_run`: which published weights step (default: the newest when planned)."""
    tokenizer: Optional[PathText] = None
    """Tokenizer directory or id when it differs from `path`."""
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    """Weights dtype for inference and published weights."""
    max_model_len: Annotated[int, Meta(ge=16, le=MAX_TOKENS)] = 4096
    """Longest prompt + completion, in tokens."""
    build_tiny: Optional[Literal["dense", "moe", "dense-lora", "vlm", "mixtral", "deepseek_v3", "gpt_oss",
                                 "glm4_moe"]] = None
    """Demo and test topologies: when `path` holds no model yet, `prl submit` builds a tiny random one there
    first, with its tokenizer (`dense`: a Qwen3, `moe`: a Qwen3-MoE with 4 experts, `dense-lora`: the Qwen3 with
    8x embeddings, which a LoRA adapter can move: the default's logits stay near uniform; `vlm`: an Idefics3
    vision-language model with its processor, 56x56 pictures; `mixtral`, `deepseek_v3`, `gpt_oss`, `glm4_moe`:
    an MoE of that family (transformers' model_type), 4 experts, top-2; the models the tests use,
    prl.trainer.tiny_model; needs the `train` extra). It learns toy tasks in minutes on CPUs; not for real runs.
    Nothing is built for `from_run`."""
    renderer: Optional[Annotated[dict[str, Any], Meta(max_length=MAX_ITEMS)]] = None
    """How the orchestrator turns chats into token ids and replies back into messages: a config of the
    `renderers` package, e.g. `{name: qwen3, enable_thinking: false}`, or prl's ChatML renderer
    `{name: custom, import_path: prl.orchestrator.chatml.ChatMLRenderer}` (ChatML models such as
    SmolLM2; Hermes tool calls). A renderer that bridges turns keeps a multi-turn rollout one exact token
    sequence. None: chosen from the tokenizer's name; an unknown model gets the template-driven default,
    which re-renders every turn (a multi-turn rollout then trains as several sequences)."""
    lora: Optional[Lora] = None
    """Train a LoRA adapter on the frozen model instead of every weight (None: full fine-tuning)."""
    train_vision: bool = False
    """Vision-language models: train the image encoder (vision tower and connector) too; by default it is frozen
    and RL trains the language model and its output layer."""

    def __post_init__(self) -> None:
        if self.renderer is not None and not (isinstance(name := self.renderer.get("name"), str) and name):
            raise FieldValueError("renderer", "renderer needs a `name`: a renderers config name (qwen3, llama-3, ...), "
                                  "or `custom` with an `import_path`, e.g. prl.orchestrator.chatml.ChatMLRenderer")
        if (self.path is None) == (self.from_run is None):
            raise FieldValueError("path" if self.path else "from_run",
                                  "set one of model.path (a model) and model.from_run (a prl run's weights); to start "
                                  "a topology that names a model from a run instead, add model.path=null")
        if self.from_step is not None and self.from_run is None:
            raise FieldValueError("from_step", "from_step picks a step of model.from_run, which is not set")


class InferenceGroup(Strict, kw_only=True):
    """Nodes that run identical vLLM replicas."""

    nodes: Annotated[int, Meta(ge=1, le=MAX_NODES)]
    """Nodes in this group."""
    tp: Annotated[int, Meta(ge=1, le=MAX_DEGREE)] = 1
    """Tensor-parallel size of one engine (GPUs of one node)."""
    dp: Annotated[int, Meta(ge=1, le=MAX_DEGREE)] = 1
    """Data-parallel ranks in one replica (one server); with `expert_parallel`, MoE experts spread over tp*dp GPUs."""
    expert_parallel: bool = False
    """vLLM `--enable-expert-parallel` for MoE models."""
    gpu_memory_utilization: Optional[Annotated[float, Meta(gt=0, le=1)]] = None
    """vLLM `--gpu-memory-utilization` (None: vLLM's default)."""
    extra_args: Args = []
    """More `vllm serve` arguments, passed as given (each list item is one argument)."""
    env: Env = {}
    """Variables for this group's servers."""


class KVConnector(Strict, kw_only=True):
    name: Annotated[str, Meta(max_length=256), explained(r"\A[A-Za-z0-9_.]+\Z", _class_name)] = "NixlConnector"
    """vLLM KV connector class (`NixlConnector` on GPU clusters, `ExampleConnector` for the storage-based CPU test)."""
    extra_config: Annotated[dict[str, Any], Meta(max_length=MAX_ITEMS)] = {}
    """`kv_connector_extra_config` passed to both sides."""
    load_failure: Literal["recompute", "fail"] = "recompute"
    """What a decode server does when the prompt's KV does not arrive (vLLM's `kv_load_failure_policy`):
    `recompute` the prompt (slower, still right), or `fail` the request, which ends with no tokens."""


class Router(Strict, kw_only=True):
    port: Optional[Annotated[int, Meta(ge=1024, le=65535)]] = None
    """Port of the router in front of prefill/decode servers (None: the cluster's port base)."""


class Weights(Strict, kw_only=True):
    transport: Annotated[str, Meta(max_length=32), explained(r"\A[a-z][a-z0-9_]*\Z", _transport_name)] = "filesystem"
    """How each step's weights reach the inference servers, one of the transports of prl/weights (checked when
    planned, with what each cannot carry): `filesystem` (every step published to
    RUN/weights/step_N and read back), `memory` (each trainer rank serves its share over TCP to the
    servers' vLLM workers, each worker reading it; only checkpoint steps and the last step are published
    to disk), or `broadcast` (as `memory`, but the servers behind on a step get it together, each trainer
    rank broadcasting its share to their workers over torch.distributed groups, one per place (the workers
    that keep the same slices), gloo or NCCL (`backend`); a server the group fails for reads the feeds
    instead: docs/weights.md)."""
    delta: bool = False
    """With `memory` or `broadcast`: a server that loaded the previous step from memory gets only the elements
    that changed (int32 index + value each), a tensor whole where that is no smaller; any other server gets
    the whole step (under `broadcast` a group gets the delta only if every server in it kept that step).
    Costs an element-wise compare per step on the trainer and a model's worth of CPU memory per inference
    worker (the base the deltas apply to). Pays off in bf16, where most elements of a small update round to
    the same value (docs/weights.md)."""
    group_timeout_s: Annotated[float, Meta(ge=1, le=3600)] = 60.0
    """With `broadcast`: the longest a group's members wait at each stage (for every member to come, for
    each tensor), so a server or trainer rank that dies mid-update holds the others at most this long."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """With `broadcast`: the groups' torch.distributed backend. `nccl`: from the trainer ranks' GPUs to the
    workers' GPUs over the cluster's fabric (the profile's `network.env` sets NCCL's interfaces); `gloo`: TCP
    between host memory; `auto`: nccl where the roles run on GPUs (a profile with `gpu_node.gpus`) and
    `delta` is off, else gloo. `prl plan` shows which."""


class KVOffload(Strict, kw_only=True):
    backend: Literal["none", "native", "lmcache"] = "none"
    """KV-cache offload: off, vLLM's native CPU offload, or LMCache."""
    cpu_gb: Annotated[float, Meta(ge=0, le=MAX_GB)] = 0.0
    """CPU memory per replica for offloaded KV blocks, in GiB."""
    disk_path: Optional[PathText] = None
    """LMCache only: a local disk tier directory."""
    disk_gb: Annotated[float, Meta(ge=0, le=MAX_GB)] = 0.0
    """LMCache only: size of the disk tier, in GiB."""

    def __post_init__(self) -> None:
        if self.backend != "none" and self.cpu_gb <= 0:
            raise ValueError(f"kv_offload.backend={self.backend} needs cpu_gb > 0")
        if self.disk_path is not None and self.backend != "lmcache":
            raise ValueError("a disk tier (disk_path) needs backend: lmcache")
        if self.disk_path is not None and self.disk_gb <= 0:
            raise ValueError("disk_path needs disk_gb > 0")
        if self.disk_path is None and self.disk_gb > 0:
            raise FieldValueError("disk_gb", "disk_gb sizes a disk tier, which needs disk_path (and backend: lmcache); "
                                             "without one the disk tier would be dropped")


class OnFailure(Strict, kw_only=True):
    """What the launcher does when a role's process exits (at all, whatever its code) before the job stops."""

    policy: Literal["restart", "fail"] = "restart"
    """`restart`: start that server again inside the allocation (same node, latest published weights), the
    run goes on; `fail`: end the job (it requeues when the cluster profile allows)."""
    max_restarts: Annotated[int, Meta(ge=0, le=MAX_ITEMS)] = 3
    """Restarts of this role allowed in one attempt of the job; one more failure ends the job."""


class Scorer(InferenceGroup, kw_only=True):
    """vLLM servers that score the student's sampled tokens (a `teacher:` or a `reference:`): the orchestrator
    sends each finished rollout's token ids and reads back the logprob of every model token. They generate
    nothing and never load the trainer's weights. Same placement fields as an inference group."""

    path: Optional[PathText] = None
    """Model directory (or hub id the nodes have cached). `teacher:` needs one; `reference:` defaults to the
    student's initial model (`model.path`, or the weights `model.from_run` resolves to)."""
    tokenizer: Optional[PathText] = None
    """Tokenizer directory when it differs from `path`; it must be the student's tokenizer (checked when planned)."""
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    """Weights dtype of these servers."""
    max_model_len: Optional[Annotated[int, Meta(ge=17, le=MAX_TOKENS + 1)]] = None
    """Longest sequence scored; must exceed the student's `model.max_model_len` (vLLM scores a prompt with a
    completion of at least one token). None: the student's + 1."""
    on_failure: OnFailure = OnFailure()
    """Failure policy of these servers: restarted by default (on the same model)."""


class EndsTheJob(Strict, kw_only=True):
    """Failure policy of the trainer and the orchestrator: a failure ends the job (requeue resumes it)."""

    policy: Literal["fail"] = "fail"
    """Only `fail`: the trainer and orchestrator resume from their checkpoints through a requeue, not a restart."""


class Pool(Strict, kw_only=True):
    """This topology is an inference pool: its servers serve its model to the LoRA adapters of other RL runs,
    which attach to it (`inference: {attach: THIS RUN DIRECTORY}`) instead of starting servers of their own;
    each run loads, generates with and unloads only its own adapter, under its own key (docs/inference.md,
    Inference pools). A pool has no trainer, orchestrator or environment; it serves until stopped."""

    max_loras: Annotated[int, Meta(ge=1, le=MAX_ITEMS)] = 4
    """Adapters one batch may mix (vLLM `--max-loras`): runs beyond it generating at once take turns."""
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16
    """Largest adapter rank an attached run may train (vLLM `--max-lora-rank`, one of the ranks it accepts)."""
    max_cpu_loras: Optional[Annotated[int, Meta(ge=1, le=MAX_ITEMS)]] = None
    """Adapters kept loaded in CPU memory (vLLM `--max-cpu-loras`; None: 4 x max_loras); at least max_loras."""

    def __post_init__(self) -> None:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            # vLLM's LoRAConfig refuses it at server start, after the job has its nodes.
            raise FieldValueError("max_cpu_loras", f"max_cpu_loras({self.max_cpu_loras}) must be at least max_loras"
                                                   f"({self.max_loras}): the adapters of one batch are kept in CPU "
                                                   f"memory too; use max_cpu_loras >= {self.max_loras} or leave it unset")


class Inference(Strict, kw_only=True):
    """Either one unified group (`nodes`, `tp`, ...) or a `prefill` and a `decode` group, or `attach`: an
    inference pool's servers."""

    attach: Optional[PathText] = None
    """Generate on an inference pool's servers (a topology with `pool:`) instead of starting servers: that pool's
    run directory. Needs `model.lora` (the run's adapter is what it loads there) and the pool's model; the
    pool must be running for the run to start."""
    nodes: Optional[Annotated[int, Meta(ge=1, le=MAX_NODES)]] = None
    """Unified: nodes serving both prefill and decode."""
    # The unified fields stay UNSET unless written, so that one written beside prefill and decode is refused
    # (it would be ignored); left unset, they take InferenceGroup's defaults.
    tp: Union[Annotated[int, Meta(ge=1, le=MAX_DEGREE)], UnsetType] = UNSET
    """Unified: tensor-parallel size (unset: 1)."""
    dp: Union[Annotated[int, Meta(ge=1, le=MAX_DEGREE)], UnsetType] = UNSET
    """Unified: data-parallel ranks per replica (unset: 1)."""
    expert_parallel: Union[bool, UnsetType] = UNSET
    """Unified: vLLM expert parallelism (unset: False)."""
    gpu_memory_utilization: Union[Annotated[float, Meta(gt=0, le=1)], None, UnsetType] = UNSET
    """Unified: vLLM `--gpu-memory-utilization` (unset or None: vLLM's default)."""
    extra_args: Union[Args, UnsetType] = UNSET
    """Unified: more `vllm serve` arguments (unset: none)."""
    env: Union[Env, UnsetType] = UNSET
    """Unified: variables for the servers (unset: none)."""
    prefill: Optional[InferenceGroup] = None
    """Disaggregated: the prefill group."""
    decode: Optional[InferenceGroup] = None
    """Disaggregated: the decode group."""
    # Unset unless written, like the unified fields: one written beside unified inference is refused.
    kv_connector: Union[KVConnector, UnsetType] = UNSET
    """Disaggregated: how KV blocks move from prefill to decode (unset: NixlConnector)."""
    router: Union[Router, UnsetType] = UNSET
    """Disaggregated: the router in front (unset: on the cluster's port base + 90)."""
    kv_offload: KVOffload = KVOffload()
    """KV-cache offload for every server."""
    quantization: Optional[Literal["fp8"]] = None
    """`fp8`: every policy server (prefill and decode alike) serves the model in FP8, vLLM's `--quantization fp8`
    (weights quantized per tensor as they load, every update included; activations scaled dynamically): half
    the weights' memory of bf16; the trainer's logprobs then differ more from the servers' (the `mismatch_*`
    metrics show by how much). Needs `gpu_node.fp8: true` in the cluster profile. Teacher
    and reference servers keep their `dtype`."""
    on_failure: OnFailure = OnFailure()
    """Failure policy of every inference (prefill, decode) server: restarted by default."""

    def __post_init__(self) -> None:
        if self.attach is not None:
            written = [name for name in ("nodes", *KV_ROLES) if getattr(self, name) is not None]
            written += [name for name in _UNIFIED if getattr(self, name) is not UNSET]
            written += [name for name, default in _DISAGGREGATED.items()
                        if getattr(self, name) is not UNSET and getattr(self, name) is not default]
            written += [name for name in ("quantization",) if getattr(self, name) is not None]
            written += [name for name, default in (("kv_offload", KVOffload()), ("on_failure", OnFailure()))
                        if getattr(self, name) != default]
            if written:
                raise FieldValueError(written[0], f"{written[0]} places servers of this run, and inference.attach "
                                                  f"uses a pool's: remove one of them")
            for name, default in _DISAGGREGATED.items():
                msgspec.structs.force_setattr(self, name, default)
            return
        split = self.prefill is not None or self.decode is not None
        if split and self.nodes is not None:
            raise ValueError("give either nodes (unified) or prefill + decode (disaggregated), not both")
        if split and (self.prefill is None or self.decode is None):
            raise ValueError("disaggregated inference needs both prefill and decode groups")
        if not split and self.nodes is None:
            raise ValueError("give nodes (unified inference) or prefill + decode groups")
        stray = [name for name in _UNIFIED if getattr(self, name) is not UNSET] if split else []
        if stray:
            raise FieldValueError(stray[0], f"{stray[0]} is a field of unified inference and would be ignored "
                                            f"beside prefill and decode; set it inside each group")
        stray = [name for name, default in _DISAGGREGATED.items()
                 if getattr(self, name) is not UNSET and getattr(self, name) is not default] if not split else []
        if stray:
            raise FieldValueError(stray[0], f"{stray[0]} is a field of disaggregated inference (prefill + decode) "
                                            f"and would be ignored beside unified nodes; remove it")
        for name, default in _DISAGGREGATED.items():  # unset only to tell a written one from the default (frozen)
            if getattr(self, name) is UNSET:
                msgspec.structs.force_setattr(self, name, default)

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    def groups(self) -> dict[str, InferenceGroup]:
        """Role name -> group, in het-group order (none when attached to a pool)."""
        if self.attach is not None:
            return {}
        if self.prefill is not None and self.decode is not None:
            return {Role.PREFILL: self.prefill, Role.DECODE: self.decode}
        assert self.nodes is not None
        written = {name: getattr(self, name) for name in _UNIFIED if getattr(self, name) is not UNSET}
        return {Role.INFERENCE: InferenceGroup(nodes=self.nodes, **written)}


_UNIFIED = ("tp", "dp", "expert_parallel", "gpu_memory_utilization", "extra_args", "env")
_DISAGGREGATED = {"kv_connector": KVConnector(), Role.ROUTER: Router()}
"""Fields only prefill + decode read, with what an unwritten one becomes (compared by identity, as
DEFAULT_ORCHESTRATOR, so that `msgspec.structs.replace`, which re-runs `__post_init__`, keeps accepting it)."""


class Trainer(Strict, kw_only=True):
    nodes: Annotated[int, Meta(ge=1, le=MAX_NODES)]
    """Nodes of the trainer."""
    gpus_per_node: Optional[Annotated[int, Meta(ge=1, le=MAX_GPUS_PER_NODE)]] = None
    """GPUs used per node (None: all of the cluster's)."""
    dp_replicate: Annotated[int, Meta(ge=1, le=MAX_DEGREE)] = 1
    """HSDP replicas (full copies of the sharded model)."""
    dp_shard: Annotated[int, Meta(le=MAX_NODES * MAX_GPUS_PER_NODE)] = -1
    """FSDP shard degree; -1 fills what the other degrees leave."""
    cp: Annotated[int, Meta(ge=1, le=MAX_DEGREE)] = 1
    """Context-parallel degree."""
    ep: Annotated[int, Meta(ge=1, le=MAX_DEGREE)] = 1
    """Expert-parallel degree (MoE), carved out of dp_shard * cp as in torchtitan."""
    activation_checkpointing: bool = False
    """Keep only each transformer block's input and recompute the block in the backward pass: less activation
    memory for about one more forward per step (docs/trainer.md, Attention and memory)."""
    precision: Literal["bf16", "fp32", "fp8"] = "bf16"
    """Parameter/compute dtype of the FSDP mixed-precision policy (reduction in fp32). `fp8`: bf16, and the
    transformer blocks' linear layers multiply in float8 (torchao's Float8Linear, dynamic per-tensor scales;
    embeddings, `lm_head`, routers and MoE experts stay bf16); needs the `fp8` extra on the trainer's nodes and
    GPUs the cluster profile marks `gpu_node.fp8: true`; on CPU clusters it runs emulated, for checking
    numerics (docs/trainer.md, FP8)."""
    compile: bool = False
    """torch.compile each transformer block (GPU clusters; dense and MoE text models with cp 1, ep 1 and no
    LoRA): fuses the norms, rotary embedding and activations eager mode runs as separate kernels. Measured on
    an H200: 1.28x tokens/s and 0.75x memory for a Qwen3-0.6B shape, about 20 s of compiling at the first step
    (docs/trainer.md, Attention and memory). The logprob head's per-chunk arithmetic is compiled too."""
    env: Env = {}
    """Variables for the trainer."""
    on_failure: EndsTheJob = EndsTheJob()
    """Failure policy of the trainer: a failure ends the job."""

    def __post_init__(self) -> None:
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise FieldValueError("dp_shard", f"dp_shard must be >= 1, or -1 to fill the remaining GPUs "
                                              f"(got {self.dp_shard})")


class Orchestrator(Strict, kw_only=True):
    placement: Literal["own", "trainer", "inference"] = "own"
    """`own`: a CPU node group of its own; `trainer`/`inference`: share the first node of that group."""
    cpus: Optional[Annotated[int, Meta(ge=1, le=MAX_CPUS)]] = None
    """CPU cores for the orchestrator (None: a whole node when `own`; when shared, 4, or all of the node's cores
    where it has fewer)."""
    env_workers: Annotated[int, Meta(ge=0, le=MAX_CPUS)] = 0
    """Processes that run the environment's rollouts (verifiers' env server pool; the orchestrator routes,
    scores and batches): 0 runs them in the orchestrator's own process, on one core. Give the orchestrator
    `env_workers + 1` cpus. The environment must be an installed package (a top-level module id)."""
    env: Env = {}
    """Variables for the orchestrator."""
    on_failure: EndsTheJob = EndsTheJob()
    """Failure policy of the orchestrator: a failure ends the job."""


DEFAULT_ORCHESTRATOR = Orchestrator()
"""What an unwritten `orchestrator:` becomes; compared by identity, so that `msgspec.structs.replace` of a loaded
SFT topology (which re-runs `Topology.__post_init__`) does not take it for one the user wrote."""


class EvalSettings(Strict, kw_only=True):
    every: Annotated[int, Meta(ge=0, le=MAX_COUNT)] = 0
    """Evaluate every N steps on the eval split (0: never)."""
    examples: Annotated[int, Meta(ge=1, le=MAX_COUNT)] = 64
    """Examples per evaluation."""


class Environment(Strict, kw_only=True):
    id: Ident
    """verifiers taskset id (an installed module) or a module path."""
    args: Annotated[dict[str, Any], Meta(max_length=MAX_ITEMS)] = {}
    """Arguments for the taskset."""
    harness: Ident = "prl"
    """verifiers harness id."""
    max_turns: Optional[Annotated[int, Meta(ge=1, le=MAX_COUNT)]] = None
    """Model turns one rollout may take (None: as many as the environment asks for). A rollout stopped
    here is kept and counted in `truncated_fraction`."""
    max_total_tokens: Optional[Annotated[int, Meta(ge=1, le=MAX_TOKENS)]] = None
    """Prompt and completion tokens of one rollout, summed over its model turns, before it is stopped
    (None: no limit). Checked between turns: the turn that crosses it still completes. Counted in
    `truncated_fraction`."""
    eval: EvalSettings = EvalSettings()
    sample_rollouts: Annotated[int, Meta(ge=0, le=MAX_COUNT)] = 16
    """Rollouts of each step kept readable in RUN/samples/step_N.json (whole groups, trained and dropped alike:
    conversation, rewards, advantage, what became of each; `prl rollouts RUN` shows them): 0 keeps none."""


LOSS_BOUNDS = {"token": (0.0, 5.0), "gspo": (1 - 3e-4, 1 + 4e-4), "cispo": (0.0, 5.0)}
"""Each ratio-bounded loss kind's default [ratio_low, ratio_high] (GSPO's: the paper's clipping range)."""
DPPO_PROB_DELTA = 0.2
"""prime-rl's default DPPO thresholds on the probability change of a token."""
_IMPORT_PATH = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*\Z")


class Loss(Strict, kw_only=True):
    """The trainer's policy objective; formulas in docs/trainer.md (Loss) and prl/trainer/loss.py."""

    kind: Literal["token", "gspo", "cispo", "dppo"] = "token"
    """`token`: importance ratio per token, masked or clipped (`mode`); `gspo`: one ratio per sample, the
    geometric mean of its tokens' (GSPO); `cispo`: the clipped ratio as a stop-gradient weight on every token's
    logprob (CISPO); `dppo`: tokens masked by how much their probability moved (prime-rl's default loss)."""
    mode: Literal["mask", "clip"] = "mask"
    """kind `token`: tokens whose importance ratio leaves [ratio_low, ratio_high] are masked out, or their
    ratio clipped."""
    ratio_low: Optional[Annotated[float, Meta(ge=0)]] = None
    """Lowest importance ratio (`token`, `cispo`: a token's; `gspo`: a sample's). None: 0 (`token`, `cispo`),
    1 - 3e-4 (`gspo`)."""
    ratio_high: Optional[Annotated[float, Meta(gt=0)]] = None
    """Highest importance ratio. None: 5 (`token`, `cispo`), 1 + 4e-4 (`gspo`)."""
    prob_delta_low: Optional[Annotated[float, Meta(gt=0, le=1)]] = None
    """kind `dppo`: a token with advantage <= 0 is masked when its probability fell by more than this
    (trainer's minus the engine's). None: 0.2."""
    prob_delta_high: Optional[Annotated[float, Meta(gt=0, le=1)]] = None
    """kind `dppo`: a token with advantage > 0 is masked when its probability rose by more than this.
    None: 0.2."""
    kl_coef: Annotated[float, Meta(ge=0)] = 0.0
    """Weight of a KL term against the sampling policy (0: off): k3 per token, `dppo`: squared log ratio."""
    distill_coef: Annotated[float, Meta(ge=0)] = 0.0
    """On-policy distillation (0: off): add this times the per-token reverse KL reward (the `teacher:`'s
    logprob of each sampled token minus the sampler's) to the advantage. Needs a `teacher:` section."""
    reward_coef: Annotated[float, Meta(ge=0)] = 1.0
    """With `distill_coef`: weight of the environment reward's advantage (0: pure distillation)."""
    kl_ref_coef: Annotated[float, Meta(ge=0)] = 0.0
    """Weight of a k3 KL term against a frozen reference model (0: off), scored by the `reference:` servers."""
    import_path: Optional[Annotated[str, Meta(max_length=300)]] = None
    """A loss of your own instead of the built-ins: `package.module:function`, imported by the trainer at
    start (signature in docs/trainer.md, Loss)."""
    args: Annotated[dict[str, Any], Meta(max_length=MAX_ITEMS)] = {}
    """Keyword arguments for the `import_path` function."""

    def __post_init__(self) -> None:
        if self.import_path is not None:
            self._check_custom()
            return
        if self.args:
            raise FieldValueError("args", "args go to a loss of your own: set import_path too, or remove args")
        if self.reward_coef != 1.0 and self.distill_coef == 0:
            raise FieldValueError("reward_coef", "reward_coef weighs the reward against distillation: set "
                                                 "distill_coef too, or remove reward_coef")
        if self.mode != "mask" and self.kind != "token":
            raise FieldValueError("mode", f"mode applies to kind token; kind {self.kind} has its own clipping: "
                                          f"remove mode")
        if self.kind == "dppo":
            for name in ("ratio_low", "ratio_high"):
                if getattr(self, name) is not None:
                    raise FieldValueError(name, f"kind dppo bounds the probability change, not the ratio: use "
                                                f"prob_delta_low/prob_delta_high instead of {name}")
            return
        for name in ("prob_delta_low", "prob_delta_high"):
            if getattr(self, name) is not None:
                raise FieldValueError(name, f"{name} applies to kind dppo only: remove it or set kind: dppo")
        low, high = self.bounds()
        if low >= high:
            raise FieldValueError("ratio_low" if self.ratio_low is not None else "ratio_high",
                                  f"ratio_low ({low}) must be below ratio_high ({high}) (kind {self.kind})")

    def _check_custom(self) -> None:
        if not _IMPORT_PATH.search(self.import_path):
            raise FieldValueError("import_path", f"import_path must read package.module:function, not "
                                                 f"{shown(self.import_path)}")
        written = [name for name, default in (("kind", "token"), ("mode", "mask"), ("ratio_low", None),
                                              ("ratio_high", None), ("prob_delta_low", None),
                                              ("prob_delta_high", None), ("kl_coef", 0.0),
                                              ("distill_coef", 0.0), ("reward_coef", 1.0), ("kl_ref_coef", 0.0))
                   if getattr(self, name) != default]
        if written:
            raise FieldValueError(written[0], f"import_path replaces the built-in losses, which {written[0]} "
                                              f"tunes: remove {written[0]} (pass what your loss needs in args)")

    def bounds(self) -> tuple[float, float]:
        """[ratio_low, ratio_high] as written, else the kind's defaults (`LOSS_BOUNDS`)."""
        low, high = LOSS_BOUNDS.get(self.kind, (0.0, 5.0))
        return (low if self.ratio_low is None else self.ratio_low,
                high if self.ratio_high is None else self.ratio_high)

    def prob_deltas(self) -> tuple[float, float]:
        """kind dppo: [prob_delta_low, prob_delta_high] as written, else prime-rl's 0.2 each."""
        return (DPPO_PROB_DELTA if self.prob_delta_low is None else self.prob_delta_low,
                DPPO_PROB_DELTA if self.prob_delta_high is None else self.prob_delta_high)


class Shaping(Strict, kw_only=True):
    """A per-token advantage shaping function (docs/orchestrator.md, Advantages)."""

    import_path: Annotated[str, Meta(max_length=300)]
    """`package.module:function`, imported by the orchestrator at start, called for every trained sample as
    fn(inputs, advantage, **args): a per-token list of advantages, or one for the whole sample. Shipped:
    `prl.orchestrator.shaping:token_length_penalty`, `prl.orchestrator.shaping:metric_bonus`."""
    args: Annotated[dict[str, Any], Meta(max_length=MAX_ITEMS)] = {}
    """Keyword arguments for the function."""

    def __post_init__(self) -> None:
        if not _IMPORT_PATH.search(self.import_path):
            raise FieldValueError("import_path", f"import_path must read package.module:function, not "
                                                 f"{shown(self.import_path)}")


class Advantage(Strict, kw_only=True):
    baseline: Literal["group_mean", "leave_one_out"] = "group_mean"
    """What each rollout's reward is compared with: its group's mean reward (GRPO, Dr.GRPO), or the mean reward
    of the other rollouts of its group (`leave_one_out`, RLOO)."""
    std_normalize: bool = False
    """Divide by the group's reward std (GRPO); off: mean-centring only (Dr.GRPO)."""
    length_penalty: Annotated[float, Meta(ge=0)] = 0.0
    """Subtract length_penalty * completion_tokens / max_tokens from each reward before centring."""
    overlong_buffer: Annotated[int, Meta(ge=0, le=MAX_TOKENS)] = 0
    """DAPO's soft overlong punishment (Yu et al. 2025): a completion longer than max_tokens - overlong_buffer
    tokens loses overlong_penalty x (L - (max_tokens - overlong_buffer)) / overlong_buffer of its reward, the
    whole overlong_penalty at max_tokens (0: off; must be below max_tokens)."""
    overlong_penalty: Annotated[float, Meta(ge=0)] = 1.0
    """The most reward a completion loses to the soft overlong punishment."""
    drop_zero_groups: bool = False
    """Leave groups whose advantages are all zero out of the batch."""
    dynamic_sampling: Annotated[int, Meta(ge=0, le=64)] = 0
    """DAPO's dynamic sampling (Yu et al. 2025): a group whose advantages are all zero (every rollout scored the
    same: no learning signal) is replaced by a fresh task's group, at most `dynamic_sampling` x the step's
    groups replacements per step (0: off). Replaced groups count in the reward statistics (`resampled_groups`),
    never in the batch; a step still short of signal once the bound is spent trains on what it has."""
    eps: Annotated[float, Meta(gt=0)] = 1e-6
    """Added to the std before dividing."""
    shaping: Optional[Shaping] = None
    """Per-token shaping of each trained sample's advantage, after the group's (None: every sampled token of a
    sample gets its rollout's advantage)."""


class Training(Strict, kw_only=True):
    batch_size: Annotated[int, Meta(ge=1, le=MAX_COUNT)]
    """Rollouts per training step (all ranks together); SFT: conversations per step."""
    rollouts_per_example: Annotated[int, Meta(ge=1, le=MAX_COUNT)] = 8
    """Rollouts per prompt; advantages are relative within these groups."""
    micro_batch_tokens: Annotated[int, Meta(ge=16, le=MAX_COUNT)] = 8192
    """Most tokens in one packed micro-batch."""
    max_off_policy_steps: Annotated[int, Meta(ge=0, le=MAX_COUNT)] = 2
    """Rollouts for step N come from weights no older than step N-1-k (0: synchronous, on-policy)."""
    lr: Annotated[float, Meta(gt=0)] = 1e-6
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0
    max_grad_norm: Annotated[float, Meta(gt=0)] = 1.0
    max_steps: Annotated[int, Meta(ge=1, le=MAX_COUNT)]
    seed: Annotated[int, Meta(ge=0, le=2**32 - 1)] = 0
    """Seed of every random generator (NumPy takes at most 2**32 - 1)."""
    checkpoint_interval: Annotated[int, Meta(ge=0, le=MAX_COUNT)] = 50
    """Steps between checkpoints (0: never)."""
    checkpoint_keep: Annotated[int, Meta(ge=1, le=MAX_ITEMS)] = 2
    """Checkpoints kept on disk."""
    checkpoint_async: bool = False
    """Write trainer checkpoints in the background: each rank copies its shard of the trained parameters and
    their optimizer state to CPU memory (one more copy of that state per rank while a write is in flight, at
    most one in flight) and trains on while a thread writes it; STABLE follows once every rank's part is on
    disk (docs/trainer.md, Checkpoints). Off: every rank waits for the write. Off by default: the copy is host
    memory a large model's ranks may not have to spare."""
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS)] = 1024
    """Most tokens generated per rollout turn."""
    temperature: Annotated[float, Meta(gt=0)] = 1.0
    """Sampling temperature of the rollouts. The servers return the logprobs of the distribution they sample
    from (`--logprobs-mode processed_logprobs`) and the trainer divides its logits by the same temperature, so the
    importance ratio and the mismatch compare like with like (greedy, 0, cannot train: a group's rollouts would
    all be the same). Teacher and reference logprobs stay at temperature 1."""
    loss: Loss = Loss()
    advantage: Advantage = Advantage()
    router_aux_loss_coef: Annotated[float, Meta(ge=0)] = 0.0
    """MoE only: weight of the router's load-balancing loss (transformers' `load_balancing_loss_func`; 0: off,
    the RL or SFT loss alone trains the router)."""
    router_replay: bool = False
    """MoE RL only: the policy servers return the experts each token was routed to and the trainer routes every
    token to those same experts (its own routing weights at them), so routing flips between vLLM's numerics and
    the trainer's do not show up as train/inference mismatch (prl/trainer/replay.py). The servers then run
    without a prefix cache."""
    max_concurrent_rollouts: Annotated[int, Meta(ge=1, le=MAX_COUNT)] = 256
    """Rollouts in flight at once, over all inference servers."""
    rollout_mode: Literal["continuous", "step"] = "continuous"
    """How the orchestrator schedules rollouts. `continuous`: up to `max_concurrent_rollouts` stay in flight
    across step boundaries and a step takes the first groups to finish that are within
    `max_off_policy_steps` (a long rollout holds up only its own group; groups that finish too old are
    dropped, and running ones whose rollouts started too old cancelled, counted as `stale_groups`); which tasks a step gets then depends on timing. `step`: each
    step waits for its weights, then runs its own groups alone (the data order is a function of the step)."""
    rollout_retries: Annotated[int, Meta(ge=0, le=MAX_ITEMS)] = 3
    """Extra attempts for a rollout that failed on a transient HTTP error (on another server if any)."""
    weight_update_retries: Annotated[int, Meta(ge=1, le=MAX_ITEMS)] = 5
    """Attempts to make a server load a weights step before the orchestrator fails."""
    weights_timeout_s: Annotated[float, Meta(gt=0, le=MAX_SECONDS)] = 3600.0
    """Longest the orchestrator waits for the weights a step needs."""
    endpoint_timeout_s: Annotated[float, Meta(gt=0, le=MAX_SECONDS)] = 600.0
    """Longest the orchestrator waits for the inference servers at start. It starts with them, so it waits at
    least as long as the launcher lets a server take to start (PRL_START_TIMEOUT, 1800 s by default)."""
    rollout_timeout_s: Annotated[float, Meta(gt=0, le=MAX_SECONDS)] = 3600.0
    """Longest the trainer waits for a step's rollouts."""
    hang_timeout_s: Optional[Annotated[float, Meta(ge=30, le=MAX_SECONDS)]] = None
    """A trainer or orchestrator whose main loop has not reported progress (heartbeat) for this long is
    hung: the launcher stops the job (and requeues it when the profile allows). None: max(900 s,
    4 x the slowest step seen so far in this attempt), see docs/jobs.md. At least 30 s: a waiting role
    heartbeats every 10 s (`HEARTBEAT_S`, prl/run/handoffs.py). Servers: their task probes
    /prl/engine (the engine itself answers); one that does not answer for this long (None: 300 s) is failed and
    handled by `on_failure`."""


class SFT(Strict, kw_only=True):
    """Supervised fine-tuning: the trainer alone learns from chat conversations (no inference, orchestrator or
    environment). Optimizer, batch (`training.batch_size` conversations per step), micro-batch, steps and
    checkpoints are `training:`'s; conversations longer than `model.max_model_len` tokens are cut there."""

    data: PathText
    """Chat data (`messages` lists): a `.jsonl` or `.parquet` file, or a local Hugging Face datasets directory.
    A relative path that exists where prl runs is made absolute."""
    split: Name = "train"
    """Split to read from a datasets directory."""
    epochs: Optional[Annotated[int, Meta(ge=1, le=MAX_COUNT)]] = None
    """Stop after this many passes over the data, or at `training.max_steps`, whichever comes first (None:
    `max_steps` alone). Every pass is shuffled anew from `training.seed`."""


class Slurm(Strict, kw_only=True):
    time: Optional[SlurmTime] = None
    """Time limit (`--time`, a bare number is minutes); None: the cluster's default."""
    qos: Optional[Token] = None
    reservation: Optional[Token] = None
    account: Optional[Token] = None
    """Overrides the profile's account."""
    job_name: Optional[Name] = None
    """Job name (None: the topology name)."""
    extra_directives: Annotated[list[Text], Meta(max_length=MAX_ITEMS)] = []
    """More `#SBATCH` options for every het component, e.g. `--mail-type=END` (one option per item)."""

    def __post_init__(self) -> None:
        checked_time(self, "time")
        for item in self.extra_directives:
            if not _DIRECTIVE.search(item):
                raise FieldValueError("extra_directives", f"each extra directive is one long option like "
                                      f"--mail-type=END: --name or --name=value of letters, digits and "
                                      f"_.,:/@%+=[]- only, not {shown(item)}")


class WandB(Strict, kw_only=True):
    """Log the run's metrics to Weights & Biases while it runs (`prl wandb RUN --follow`, kept going by the
    launcher beside the roles: a W&B failure is logged and never stops training)."""

    project: Ident
    """W&B project."""
    entity: Optional[Ident] = None
    """W&B entity (team or user; None: your default)."""


class Topology(Strict, kw_only=True):
    name: Name
    """Run name: letters, digits, '.', '_', '-'."""
    cluster: PathText
    """Cluster profile: a name in clusters/ or a path to a profile file."""
    run_dir: Optional[PathText] = None
    """Run directory on the shared filesystem (None: SHARED_ROOT/prl-runs/NAME)."""
    model: Model
    inference: Optional[Inference] = None
    """RL only: the vLLM servers."""
    teacher: Optional[Scorer] = None
    """RL only: on-policy distillation's teacher servers (`training.loss.distill_coef` uses their logprobs)."""
    reference: Optional[Scorer] = None
    """RL only: servers of a frozen reference model (`training.loss.kl_ref_coef` uses their logprobs)."""
    trainer: Optional[Trainer] = None
    """The trainer (every topology but a pool's)."""
    pool: Optional[Pool] = None
    """An inference pool: inference servers only, shared by the RL runs that attach to them."""
    orchestrator: Union[Orchestrator, UnsetType] = UNSET
    """RL only: where the orchestrator runs (unset: the defaults below). Always an Orchestrator once loaded."""
    environment: Optional[Environment] = None
    """RL only: the verifiers environment trained on."""
    sft: Optional[SFT] = None
    """Supervised fine-tuning instead of RL: a trainer-only job (then no inference, orchestrator, environment)."""
    training: Optional[Training] = None
    """How to train (every topology but a pool's)."""
    weights: Weights = Weights()
    """RL only: how new weights move from the trainer to the inference servers."""
    slurm: Slurm = Slurm()
    wandb: Optional[WandB] = None
    """Log metrics to W&B during the run (None: `prl wandb RUN` when you want). Nodes without internet:
    export WANDB_MODE=offline before submitting and `wandb sync RUN/wandb/offline-run-*` later."""

    @property
    def attached(self) -> bool:
        """This run generates on an inference pool's servers (`inference.attach`)."""
        return self.inference is not None and self.inference.attach is not None

    def _check_pool(self) -> None:
        stray = [name for name in (Role.TRAINER, "training", "sft", "environment", *SCORER_ROLES)
                 if getattr(self, name) is not None]
        written = not (self.orchestrator is UNSET or self.orchestrator is DEFAULT_ORCHESTRATOR)
        stray += [Role.ORCHESTRATOR] if written else []
        if stray:
            raise FieldValueError(stray[0], f"an inference pool (pool:) runs inference servers only: remove {stray[0]}")
        if self.inference is None:
            raise FieldValueError(Role.INFERENCE, "missing: an inference pool (pool:) needs inference: (its servers)")
        if self.inference.attach is not None or self.inference.disaggregated:
            raise FieldValueError("inference.attach" if self.inference.attach else "inference.prefill",
                                  "an inference pool serves from unified servers of its own (inference.nodes)")
        if self.model.lora is not None:
            raise FieldValueError("model.lora", "an inference pool serves its base model; the attached runs set model.lora")

    def scorers(self) -> dict[str, Scorer]:
        """The scoring server groups written (`teacher`, `reference`), by role, in het-group order."""
        return {name: group for name in SCORER_ROLES if (group := getattr(self, name)) is not None}

    def __post_init__(self) -> None:
        if self.pool is not None:
            self._check_pool()
        else:
            for name in (Role.TRAINER, "training"):
                if getattr(self, name) is None:
                    raise FieldValueError(name, f"required field is missing: {name} (every topology but an "
                                                f"inference pool's, `pool:`)")
        if self.sft is not None:
            given = {Role.INFERENCE: self.inference is not None, "environment": self.environment is not None,
                     Role.TEACHER: self.teacher is not None, Role.REFERENCE: self.reference is not None,
                     Role.ORCHESTRATOR: not (self.orchestrator is UNSET or self.orchestrator is DEFAULT_ORCHESTRATOR)}
            stray = [name for name in _RL_ONLY if given[name]]
            if stray:
                raise FieldValueError(stray[0], f"an SFT topology (sft:) runs the trainer alone: remove {stray[0]}")
        elif self.pool is None:
            for name in (Role.INFERENCE, "environment"):
                if getattr(self, name) is None:
                    raise FieldValueError(name, "missing: an RL topology needs inference: and environment: "
                                                "(or give sft: for supervised fine-tuning)")
        if self.attached and self.model.lora is None:
            raise FieldValueError("inference.attach", "a run on an inference pool's servers loads its LoRA adapter there: set "
                                            "model.lora (the pool's base model stays as it is)")
        if self.attached and self.orchestrator is not UNSET and self.orchestrator.placement == Role.INFERENCE:
            raise FieldValueError("orchestrator.placement", "a run on an inference pool's servers has no inference nodes of its "
                                               "own to place the orchestrator on: use own or trainer")
        if self.attached and self.training.router_replay:
            raise FieldValueError("training.router_replay", "router replay needs the run's own servers (a pool's serve "
                                                   "adapters, and LoRA adapts no router)")
        if self.attached and (self.teacher is not None or self.reference is not None):
            raise FieldValueError("inference.attach", "a run on an inference pool's servers has no servers of its own: a "
                                            "teacher: or reference: section needs them (not supported yet)")
        if self.teacher is not None and self.teacher.path is None:
            # A teacher of the student's own initial weights is a reference: say so rather than guess.
            raise FieldValueError("teacher.path", "teacher needs a model: set teacher.path (the student's own initial "
                                             "model is a reference: use a reference: section and kl_ref_coef)")
        if self.orchestrator is UNSET:  # unset only to tell a written one from the default (frozen: force)
            msgspec.structs.force_setattr(self, Role.ORCHESTRATOR, DEFAULT_ORCHESTRATOR)
        if self.run_dir is None:
            return
        parts = self.run_dir.split("/")
        if ".." in parts:
            raise FieldValueError("run_dir", f"run_dir must not contain '..' components (got {shown(self.run_dir)})")
        if all(part in ("", ".") for part in parts):
            raise FieldValueError("run_dir", f"run_dir must name a directory of its own, not {shown(self.run_dir)}")


_RL_ONLY = (Role.INFERENCE, Role.ORCHESTRATOR, "environment", *SCORER_ROLES)


def load_topology(path: Path, overrides: Sequence[str] = ()) -> tuple[Topology, Source]:
    """Load a topology; overrides whose first part is `cluster.` are left for the profile."""
    own = [item for item in overrides if not item.startswith("cluster.")]
    return load(Topology, path, own)


def cluster_overrides(overrides: Sequence[str]) -> list[str]:
    """`cluster.max_nodes=8` on the command line overrides the profile's `max_nodes`."""
    return [item[len("cluster."):] for item in overrides if item.startswith("cluster.")]
