"""The Plan: what `make_plan` derives, frozen and typed, from the planner to every role.

`prl plan` writes it as RUN/plan.json (`Plan.to_json`); the launcher, the role runners,
`prl status`/`logs` and the three roles read it back as the same model (`Plan.read`), never as
a dict. The user's own settings travel inside it as the topology's own schemas (`RunSettings`:
`Model`, `Environment`, `Training`, KV settings): one definition per concept, no role restates a
default. They are decoded on first use (`plan.settings()`), so the commands that only need the
placement (`prl status`, `prl logs`, the launcher) never import the schemas: msgspec decodes and
type-checks the rest in a few milliseconds, and login nodes feel every 100 ms.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Literal, Optional

import msgspec

from prl.errors import ConfigError, RunDirError
from prl.run.rundir import RunDir
from prl.states import SCORER_ROLES, Role

if TYPE_CHECKING:
    from prl.planner.settings import RunSettings

PLAN_FORMAT = "prl.plan/4"
"""Bumped whenever a field changes meaning: a role refuses a plan.json of another format."""

def node_address(plan: Plan) -> str:
    """This node's address as other nodes reach it (the profile's interface when it names one)."""
    iface = plan.network_interface
    if iface:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface[:15].encode()))  # SIOCGIFADDR
            return socket.inet_ntoa(packed[20:24])
    if not plan.slurm:
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


class Frozen(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of the plan's records: immutable, typed on decode, unknown fields refused."""


class Group(Frozen, kw_only=True):
    """One het component (or, without hetjobs, one node range of the single allocation)."""

    index: int
    name: str
    partition: Optional[str]
    nodes: int
    gpus_per_node: int
    """GPUs requested per node (0: none)."""
    ntasks_per_node: int
    cpus_per_task: int
    node_offset: int
    """First node of this group in the single allocation (hetjob: always 0)."""
    directives: tuple[str, ...]
    """`#SBATCH` options of this component."""


class Server(Frozen, kw_only=True):
    """One vLLM server process: a whole replica, or one node's share of a multi-node replica."""

    role: Role
    """One of SERVER_ROLES."""
    replica: int
    group: int
    node: int
    """Node index within the group."""
    task: int
    """Index of this process in its step (SLURM_PROCID)."""
    gpus: tuple[int, ...]
    """GPU indices on the node (empty on CPU clusters)."""
    port: Optional[int]
    """HTTP port; None for headless data-parallel followers."""
    rpc_port: Optional[int]
    """vLLM's data-parallel RPC port (`--data-parallel-rpc-port`); None when dp is 1."""
    side_channel_port: Optional[int]
    """`VLLM_NIXL_SIDE_CHANNEL_PORT` of a NIXL prefill/decode server (None without NIXL): vLLM listens
    on it plus each data-parallel rank's index, so servers sharing a node get ranges `dp` apart."""
    head: bool
    """True for the process that serves HTTP for its replica."""
    address_from_head: bool
    """A follower of a multi-node replica: the launcher adds the head's address."""
    model: str
    """The weights it starts from (`--model`): the run's model, or a scoring role's own."""
    served_name: str
    """The model name it answers to (`--served-model-name`)."""
    adapters: bool
    """It serves LoRA adapters (`--enable-lora`): its updates are adapters, it restarts on the base model."""
    args: tuple[str, ...]
    """The rest of its `vllm serve` arguments; `argv` adds the model and its name, the launcher --host (and the
    head's address for followers)."""

    def argv(self, model: Optional[str] = None) -> tuple[str, ...]:
        """Its `vllm serve` arguments, serving `model` instead of its own when given (a restart's newest step)."""
        return ("--model", model or self.model, "--served-model-name", self.served_name, *self.args)


def side_channel_ports(peers: Sequence[Server], server: Server, dp: int) -> tuple[int, ...]:
    """The NIXL side-channel ports `server` listens on: its `side_channel_port` plus the index of each
    data-parallel rank it runs (of `dp` per replica, split evenly over `peers`, the servers of its replica)."""
    if server.side_channel_port is None:
        return ()
    per_node = dp // len(peers)
    first = server.side_channel_port + peers.index(server) * per_node
    return tuple(range(first, first + per_node))


class InferenceRole(Frozen, kw_only=True):
    """One group of identical vLLM replicas (the unified group, or prefill, or decode)."""

    name: Role
    """One of SERVER_ROLES."""
    group: int
    nodes: int
    tp: int
    dp: int
    expert_parallel: bool
    replicas: int
    nodes_per_replica: int
    servers_per_node: int
    kv_role: Optional[Literal["kv_producer", "kv_consumer"]]
    """The role's side of the KV connector under prefill/decode disaggregation."""
    lone_args: tuple[str, ...] = ()
    """What one server of this role's model takes on its own, wherever it runs (an evaluation server of the run's
    weights): the model's flags, tp, memory, the user's extra arguments, without its place in the fleet."""


class Mesh(Frozen, kw_only=True):
    """The trainer's device mesh: data-parallel replicate x shard x context parallel, EP carved out."""

    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    world_size: int

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def expert_shard(self) -> int:
        """FSDP degree of expert weights: (dp_shard * cp) / ep, as torchtitan carves EP."""
        return self.dp_shard * self.cp // self.ep

    def describe(self) -> str:
        return (f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) = "
                f"{self.world_size}, ep({self.ep})")


class MeshError(ValueError):
    """The parallel degrees do not multiply out; `field` is the topology field to change."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def derive_mesh(world_size: int, dp_replicate: int, dp_shard: int, cp: int, ep: int, where: str = "",
                unit: str = "ranks") -> Mesh:
    """The mesh for `world_size` ranks (dp_shard -1 fills what the others leave), or MeshError with every factor.

    The planner calls it with the topology's degrees; the trainer checks torchrun's world against it.
    """
    units = f" ({where})" if where else ""
    fixed = dp_replicate * cp
    if dp_shard == -1:
        if world_size % fixed:
            raise MeshError("dp_replicate" if cp == 1 else "cp", (
                f"trainer needs dp_replicate({dp_replicate}) * cp({cp}) = {fixed} to divide its {world_size} {unit}"
                f"{units}"))
        dp_shard = world_size // fixed
    elif fixed * dp_shard != world_size:
        raise MeshError("dp_shard", (
            f"Invalid trainer mesh: dp_replicate({dp_replicate}) * dp_shard({dp_shard}) * cp({cp}) = "
            f"{fixed * dp_shard} != world size {world_size}{units}; use dp_shard: -1 to fill"))
    if (dp_shard * cp) % ep:
        raise MeshError("ep", (
            f"trainer needs ep({ep}) to divide dp_shard({dp_shard}) * cp({cp}) = {dp_shard * cp}{units}; "
            f"experts are sharded over the dp_shard x cp ranks"))
    return Mesh(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, ep=ep, world_size=world_size)


RENDEZVOUS_BACKEND = "prl-static"
"""torchrun's `--rdzv-backend` for the trainer: registered by prl.trainer.torchrun, named by the job's trainer task
(prl/job/runtimes.py); its store listens at `TrainerPlan.master_port` on the trainer's first node."""


class TrainerPlan(Frozen, kw_only=True):
    group: int
    nodes: int
    gpus_per_node: int
    """Ranks per node (GPUs on GPU clusters; processes on CPU clusters)."""
    world_size: int
    device: Literal["cuda", "cpu"]
    mesh: Mesh
    master_port: int
    """torchrun rendezvous port on the trainer's first node."""
    weight_ports: tuple[int, ...] = ()
    """Each rank's port for a weight transport that sends from memory (prl/weights), by global rank (empty when
    every step goes through the run directory)."""
    weight_backend: Literal["gloo", "nccl"] = "gloo"
    """The broadcast groups' torch.distributed backend (`weights.backend` resolved for where the roles run)."""
    activation_checkpointing: bool
    precision: Literal["bf16", "fp32", "fp8"]
    compile: bool = False
    """`trainer.compile`: each transformer block goes through torch.compile."""


class OrchestratorPlan(Frozen, kw_only=True):
    placement: Literal["own", "trainer", "inference"]
    group: int
    """Het group (or node range) it runs in."""
    cpus: int
    env_workers: int = 0
    """Environment worker processes (`orchestrator.env_workers`; 0: rollouts run in the orchestrator's process)."""


class Launch(Frozen, kw_only=True):
    """One `srun` of the job: a role on some nodes of a group."""

    name: Role
    group: int
    nodes: int
    ntasks_per_node: int
    cpus_per_task: int
    gpus_per_node: int
    overlap: bool
    """Shares nodes with another step (`srun --overlap`)."""
    start_after: tuple[Role, ...]
    """The roles whose tasks must all be ready (healthy) before this one works."""
    waits_itself: bool = False
    """The role waits for its `start_after` roles itself (their endpoints), so the launcher starts it with the
    roles that come after none and its start-up overlaps theirs; the launcher still bounds their readiness."""
    health: Literal["http", "heartbeat"]
    """`http`: every head server answers /health; `heartbeat`: the role's state file says ready."""
    script: str
    """Launch script, relative to the run directory."""
    env: tuple[tuple[str, str], ...]
    srun_args: tuple[str, ...] = ()
    """`srun` options that place this step (empty for local runs)."""

    @property
    def tasks(self) -> int:
        return self.nodes * self.ntasks_per_node


class FailurePolicy(Frozen, kw_only=True):
    """What the launcher does when one of a role's processes exits before the job is stopping."""

    role: Role
    policy: Literal["restart", "fail"]
    """`restart`: start that server's task(s) again in the allocation; `fail`: end the job."""
    max_restarts: int
    """Restarts of this role allowed in one attempt."""


HANG_FLOOR_S = 900.0
"""Default hang bound before any step was seen, and its floor after (`Plan.hang_bound`)."""
HANG_STEP_FACTOR = 4.0
"""Default hang bound: this many times the slowest step seen in the attempt (when above the floor)."""
SERVER_HANG_S = 300.0
"""Default time a server's /health may go unanswered before its task fails it."""
START_TIMEOUT_S = float(os.environ.get("PRL_START_TIMEOUT", "1800"))
"""Longest a role may take to start (a server to become healthy), PRL_START_TIMEOUT: the launcher's bound."""
KILL_AFTER_S = 10.0
"""How long a process the launcher or a role's task stops has after SIGTERM before SIGKILL (it may ignore SIGTERM)."""


class ContainerPlan(Frozen, kw_only=True):
    image: str
    mounts: tuple[str, ...]
    workdir: Optional[str]

    def srun_args(self) -> tuple[str, ...]:
        """pyxis's srun options that run a step in this container (the RL job's launches, eval array tasks)."""
        args = (f"--container-image={self.image}", f"--container-mounts={','.join(self.mounts)}")
        return args + ((f"--container-workdir={self.workdir}",) if self.workdir else ())


class PoolPlan(Frozen, kw_only=True):
    """An inference pool's limits on the runs that attach to it (prl/config/topology.py `Pool`)."""

    model: str
    """The base model its servers serve (an attached run's adapter must be trained on it)."""
    max_loras: int
    max_lora_rank: int


class Totals(Frozen, kw_only=True):
    nodes: int
    gpus: int
    inference_servers: int
    inference_gpus: int
    trainer_world_size: int


class EvalServer(Frozen, kw_only=True):
    """The shape of a server `prl eval --run` starts on a run's weights (`Plan.eval_server`)."""

    args: tuple[str, ...]
    """Its vLLM flags but the model, the name it answers to and where it listens (the sweep adds those)."""
    launch: Role
    """The role whose launch env the server runs with."""
    group: int
    """The hetjob group whose directives (partition, account, GPUs) the evaluation array takes."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment the server gets unless the launch's env or the caller's sets it."""


class Plan(Frozen, kw_only=True):
    format: Literal["prl.plan/4"] = PLAN_FORMAT
    name: str
    job_name: str
    cluster: str
    slurm: bool
    hetjob: bool
    run_dir: str
    python: str
    served_model_name: str
    """Name the inference servers answer to (`--served-model-name`)."""
    network_interface: Optional[str]
    """Interface the roles bind to and talk over (None: the node's hostname address)."""
    groups: tuple[Group, ...]
    inference: tuple[InferenceRole, ...]
    servers: tuple[Server, ...]
    router_port: Optional[int]
    trainer: Optional[TrainerPlan]
    """None for an inference pool (`pool`)."""
    orchestrator: Optional[OrchestratorPlan]
    """None for an SFT job (the trainer alone)."""
    launches: tuple[Launch, ...]
    batch_directives: tuple[str, ...]
    """`#SBATCH` options for the whole job (name, output, time, signal, requeue)."""
    setup: tuple[str, ...]
    """Shell lines from the cluster profile (modules, venv, setup)."""
    container: Optional[ContainerPlan]
    settings_json: msgspec.Raw
    """The user's settings as `RunSettings` JSON: read them with `settings()`."""
    grace_seconds: int
    requeue: bool
    """The job may requeue itself at the time-limit warning (and Slurm may requeue it)."""
    totals: Totals
    warnings: tuple[str, ...] = ()
    on_failure: tuple[FailurePolicy, ...] = ()
    """Failure policy of each role (a role not listed: `fail`)."""
    hang_timeout_s: Optional[float] = None
    """The topology's `training.hang_timeout_s` (None: derived from step times, `hang_bound`)."""
    pool: Optional[PoolPlan] = None
    """An inference pool's plan: its servers only, for the runs that attach to it."""
    attach: Optional[str] = None
    """The inference pool this run generates on (its run directory): no servers of its own."""

    def to_json(self) -> str:
        return msgspec.json.format(msgspec.json.encode(self), indent=2).decode() + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "plan.json") -> Plan:
        try:
            return msgspec.json.decode(text, type=cls)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{where}: {exc}; it was written by another prl version or edited by hand: "
                              f"run `prl plan` again") from None

    def eval_server(self) -> EvalServer:
        """What an evaluation server of this run's weights takes: what one server of the first inference role's
        model takes on its own (`InferenceRole.lone_args`), its launch's env and its group; for a trainer-only (SFT)
        run, the model's own settings (dtype, context length, tokenizer) with the trainer's env, on a node of the
        trainer's group."""
        head = next((s for s in self.servers if s.head), None)
        if head is not None:
            role = next(r for r in self.inference if r.name == head.role)
            return EvalServer(args=role.lone_args, launch=head.role, group=head.group)
        model = self.settings().model
        args = ("--dtype", model.dtype, "--max-model-len", str(model.max_model_len))
        args += ("--tokenizer", model.tokenizer) if model.tokenizer else ()
        if self.trainer.device != "cpu":
            return EvalServer(args=args, launch=Role.TRAINER, group=self.trainer.group)
        # On CPU nodes as the shipped CPU topologies serve: no compile warm-up (half of a start there), and a
        # KV cache of its own size (vLLM's CPU default reserves 92% of the node's memory and refuses to start
        # when less is free).
        return EvalServer(args=args + ("--enforce-eager",), launch=Role.TRAINER, group=self.trainer.group,
                          env=(("VLLM_CPU_KVCACHE_SPACE", "2"),))

    def settings(self) -> RunSettings:
        """The model, environment, training and KV settings, as the topology's schemas (validated once)."""
        return _settings(bytes(self.settings_json))

    @classmethod
    def read(cls, run: RunDir) -> Plan:
        """RUN/plan.json as a Plan; a RunDirError says what is missing."""
        try:
            text = run.plan_json.read_text()
        except FileNotFoundError:
            raise RunDirError(f"no plan in {run.root}: {run.plan_json} is missing (run `prl plan` first)") from None
        return cls.from_json(text, str(run.plan_json))

    def launch(self, name: str) -> Launch:
        """The launch of role `name`; ConfigError naming the run's roles when it has none."""
        for s in self.launches:
            if s.name == name:
                return s
        raise ConfigError(f"no role {name!r} in this run; its roles are {', '.join(self.role_names)}")

    @property
    def role_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.launches)

    def scorer_roles(self) -> tuple[str, ...]:
        """The scoring server roles this run has (`teacher`, `reference`), in order."""
        return tuple(r.name for r in self.inference if r.name in SCORER_ROLES)

    def role_servers(self, role: str) -> tuple[Server, ...]:
        return tuple(s for s in self.servers if s.role == role)

    def server(self, role: str, task: int) -> Server:
        return next(s for s in self.servers if s.role == role and s.task == task)

    def task_ports(self, role: str, task: int) -> tuple[int, ...]:
        """Ports task `task` of `role` listens on (its preflight checks they are free)."""
        ports = [s.port for s in self.servers if s.role == role and s.task == task and s.port]
        for s in self.servers:
            if s.role == role and s.task == task:
                ports += self.side_channel_ports(s)
        if role == Role.ROUTER and self.router_port:
            ports.append(self.router_port)
        if role == Role.TRAINER and task == 0:
            ports.append(self.trainer.master_port)
        if role == Role.TRAINER:
            per_node = self.trainer.gpus_per_node
            ports += self.trainer.weight_ports[task * per_node:(task + 1) * per_node]
        return tuple(ports)

    def failure_policy(self, role: str) -> FailurePolicy:
        """The role's failure policy; `fail` for a role the plan lists none for."""
        for p in self.on_failure:
            if p.role == role:
                return p
        return FailurePolicy(role=role, policy="fail", max_restarts=0)  # type: ignore[arg-type]

    def hang_bound(self, slowest_step_s: float | None) -> float:
        """Seconds without progress after which the trainer or orchestrator counts as hung: the topology's
        `hang_timeout_s`, else max(HANG_FLOOR_S, HANG_STEP_FACTOR x the slowest step seen)."""
        if self.hang_timeout_s is not None:
            return self.hang_timeout_s
        return max(HANG_FLOOR_S, HANG_STEP_FACTOR * (slowest_step_s or 0.0))

    @property
    def server_hang_s(self) -> float:
        """Seconds a server's /health may go unanswered before its task fails it."""
        return self.hang_timeout_s if self.hang_timeout_s is not None else SERVER_HANG_S

    def side_channel_ports(self, server: Server) -> tuple[int, ...]:
        """The NIXL side-channel ports `server` listens on (none without NIXL)."""
        if server.side_channel_port is None:
            return ()
        peers = [s for s in self.servers if s.role == server.role and s.replica == server.replica]
        return side_channel_ports(peers, server, next(r.dp for r in self.inference if r.name == server.role))

    def role_side_channel_ports(self, role: str) -> tuple[int, ...]:
        """The NIXL side-channel ports of every server of `role`, in one pass over the servers."""
        replicas: dict[int, list[Server]] = {}
        for s in self.role_servers(role):
            replicas.setdefault(s.replica, []).append(s)
        dp = next((r.dp for r in self.inference if r.name == role), 1)
        return tuple(port for peers in replicas.values() for s in peers for port in side_channel_ports(peers, s, dp))

    def expected_endpoints(self) -> set[tuple[str, int]]:
        """(role, replica) of every server head, plus the router: what the orchestrator waits for."""
        want = {(s.role, s.replica) for s in self.servers if s.head}
        if self.router_port:
            want.add((Role.ROUTER, 0))
        return want


@lru_cache(maxsize=8)
def _settings(raw: bytes) -> RunSettings:
    from prl.planner.settings import RunSettings

    return RunSettings.from_json(raw)
