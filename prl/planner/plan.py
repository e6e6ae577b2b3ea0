"""Topology + cluster profile -> Plan: who runs where, with every number derived and checked.

Pure: no I/O, no clock, no environment. `make_plan` either returns a frozen
Plan or raises PlanError with the numbers and the fix, located at the YAML
line of the field to change. The renderer and the launcher only read a Plan.

Layout of a job (one het group per role kind, in start order):

    inference (or prefill + decode)   vLLM servers, one per replica and node
    orchestrator                      when `orchestrator.placement: own`
    trainer                           torchrun, one task per node

Start order: every inference server healthy (router after prefill + decode)
-> orchestrator healthy -> trainer.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from prl.config.cluster import ClusterProfile
from prl.errors import PlanError
from prl.config.loader import Source
from prl.config.topology import InferenceGroup, Topology

# Port layout on one node, as offsets from the profile's port_base.
ROUTER_PORT_OFFSET = 90
DP_RPC_PORT_OFFSET = 200
RDZV_PORT_OFFSET = 500
SHARED_ORCHESTRATOR_CPUS = 4
KV_OFFLOAD_MEMORY_FRACTION = 0.8


@dataclass(frozen=True)
class Group:
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


@dataclass(frozen=True)
class Server:
    """One vLLM server process: a whole replica, or one node's share of a multi-node replica."""

    role: str
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
    head: bool
    """True for the process that serves HTTP for its replica."""
    args: tuple[str, ...]
    """`vllm serve` arguments; the launcher adds --host and, for multi-node replicas, the head's address."""


@dataclass(frozen=True)
class Mesh:
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


@dataclass(frozen=True)
class TrainerPlan:
    group: int
    nodes: int
    gpus_per_node: int
    """Ranks per node (GPUs on GPU clusters; processes on CPU clusters)."""
    world_size: int
    device: str
    """`cuda` or `cpu`."""
    mesh: Mesh
    master_port: int
    """torchrun rendezvous port on the trainer's first node."""
    activation_checkpointing: bool
    precision: str


@dataclass(frozen=True)
class Step:
    """One `srun` of the job: a role on some nodes of a group."""

    name: str
    group: int
    nodes: int
    ntasks_per_node: int
    cpus_per_task: int
    gpus_per_node: int
    overlap: bool
    """Shares nodes with another step (`srun --overlap`)."""
    start_after: tuple[str, ...]
    health: str
    """`http`: every head server answers /health; `heartbeat`: the role's state file says ready."""
    script: str
    """Step script, relative to the run directory."""
    env: tuple[tuple[str, str], ...]
    srun_args: tuple[str, ...] = ()
    """`srun` options that place this step (empty for local runs)."""


@dataclass(frozen=True)
class Plan:
    name: str
    job_name: str
    cluster: str
    slurm: bool
    hetjob: bool
    run_dir: str
    python: str
    model: dict[str, Any]
    groups: tuple[Group, ...]
    servers: tuple[Server, ...]
    router_port: Optional[int]
    trainer: TrainerPlan
    orchestrator: dict[str, Any]
    steps: tuple[Step, ...]
    batch_directives: tuple[str, ...]
    """`#SBATCH` options for the whole job (name, output, time, signal, requeue)."""
    setup: tuple[str, ...]
    """Shell lines from the cluster profile (modules, venv, setup)."""
    container: Optional[dict[str, Any]]
    environment: dict[str, Any]
    training: dict[str, Any]
    kv_offload: dict[str, Any]
    kv_connector: Optional[dict[str, Any]]
    grace_seconds: int
    requeue: bool
    """The job may requeue itself at the time-limit warning (and Slurm may requeue it)."""
    totals: dict[str, int]
    warnings: tuple[str, ...] = field(default=())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    def step(self, name: str) -> Step:
        return next(s for s in self.steps if s.name == name)


class _Checker:
    """Collects placement facts and turns violated ones into located PlanErrors."""

    def __init__(self, topo_source: Source, cluster: ClusterProfile, cluster_source: Source):
        self.topo = topo_source
        self.cluster = cluster
        self.cluster_source = cluster_source
        self.warnings: list[str] = []

    def fail(self, field: tuple[Any, ...], message: str) -> PlanError:
        return PlanError(f"{self.topo.locate(field)}: {message}")

    def fail_cluster(self, field: tuple[Any, ...], message: str) -> PlanError:
        return PlanError(f"{self.cluster_source.locate(field)}: {message}")


def _gpu_directive(cluster: ClusterProfile, gpus: int) -> tuple[str, ...]:
    if gpus == 0 or cluster.gpu_directive == "none":
        return ()
    if cluster.gpu_directive == "gres":
        return (f"--gres={cluster.gres_name}:{gpus}",)
    return (f"--gpus-per-node={gpus}",)


def _group_directives(cluster: ClusterProfile, partition: Optional[str], nodes: int, ntasks: int, cpus: int,
                      gpus: int) -> tuple[str, ...]:
    out = []
    if partition:
        out.append(f"--partition={partition}")
    out += [f"--nodes={nodes}", f"--ntasks-per-node={ntasks}", f"--cpus-per-task={cpus}"]
    out += _gpu_directive(cluster, gpus)
    if cluster.exclusive:
        out += ["--exclusive", "--mem=0"]
    if cluster.constraint:
        out.append(f"--constraint={cluster.constraint}")
    if cluster.segment:
        out.append(f"--segment={cluster.segment}")
    return tuple(out)


def _inference_layout(check: _Checker, role: str, field: tuple[str, ...], group: InferenceGroup,
                      gpus_per_node: int) -> tuple[int, int, int]:
    """(GPUs per replica, nodes per replica, servers per node) for one inference group, checked."""
    cluster = check.cluster
    if gpus_per_node == 0:
        # CPU cluster: one server per node (vLLM's CPU backend), tp/dp are engine threads.
        if group.tp * group.dp > 1 and group.tp > 1:
            check.warnings.append(f"{role}: tp({group.tp}) on a CPU cluster runs {group.tp} CPU workers per server")
        return 0, 1, 1
    if group.tp > gpus_per_node:
        raise check.fail(field + ("tp",), (
            f"{role} tp({group.tp}) is larger than a node's {gpus_per_node} GPUs on cluster '{cluster.name}'; "
            f"tensor parallelism stays inside a node: use tp<={gpus_per_node} and dp for more GPUs per replica"))
    if gpus_per_node % group.tp:
        raise check.fail(field + ("tp",), (
            f"{role} tp({group.tp}) must divide the {gpus_per_node} GPUs of a node on cluster '{cluster.name}'"))
    per_replica = group.tp * group.dp
    if per_replica <= gpus_per_node:
        if gpus_per_node % per_replica:
            raise check.fail(field + ("dp",), (
                f"{role} needs tp({group.tp}) * dp({group.dp}) = {per_replica} GPUs per replica to divide "
                f"the {gpus_per_node} GPUs of a node; use dp={gpus_per_node // group.tp}"))
        return per_replica, 1, gpus_per_node // per_replica
    if per_replica % gpus_per_node:
        raise check.fail(field + ("dp",), (
            f"{role} replica of tp({group.tp}) * dp({group.dp}) = {per_replica} GPUs spans nodes, so it must be "
            f"a multiple of a node's {gpus_per_node} GPUs"))
    nodes_per_replica = per_replica // gpus_per_node
    if group.nodes % nodes_per_replica:
        raise check.fail(field + ("nodes",), (
            f"{role} has {group.nodes} nodes but each replica of tp({group.tp}) * dp({group.dp}) = "
            f"{per_replica} GPUs takes {nodes_per_replica} nodes; use a multiple of {nodes_per_replica} nodes"))
    return per_replica, nodes_per_replica, 1


def _server_args(topo: Topology, group: InferenceGroup, role: str, port: Optional[int], dp_local: int,
                 dp_start: int, nodes_per_replica: int, rpc_port: int, kv_role: Optional[str]) -> tuple[str, ...]:
    m = topo.model
    args = ["--model", m.path, "--served-model-name", topo.name, "--dtype", m.dtype,
            "--max-model-len", str(m.max_model_len), "--tensor-parallel-size", str(group.tp)]
    if m.tokenizer:
        args += ["--tokenizer", m.tokenizer]
    if port is not None:
        args += ["--port", str(port)]
    if group.dp > 1:
        args += ["--data-parallel-size", str(group.dp)]
        if nodes_per_replica > 1:
            args += ["--data-parallel-size-local", str(dp_local), "--data-parallel-start-rank", str(dp_start),
                     "--data-parallel-rpc-port", str(rpc_port)]
            if port is None:
                args.append("--headless")
    if group.expert_parallel:
        args.append("--enable-expert-parallel")
    if group.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(group.gpu_memory_utilization)]
    off = topo.inference.kv_offload
    if off.backend != "none":
        args += ["--kv-offloading-backend", off.backend, "--kv-offloading-size", f"{off.cpu_gb:g}"]
    if kv_role is not None:
        conn = topo.inference.kv_connector
        config = {"kv_connector": conn.name, "kv_role": kv_role, "kv_connector_extra_config": conn.extra_config}
        args += ["--kv-transfer-config", json.dumps(config, sort_keys=True, separators=(",", ":"))]
    args += group.extra_args
    return tuple(args)


def _env(*parts: dict[str, str]) -> tuple[tuple[str, str], ...]:
    merged: dict[str, str] = {}
    for part in parts:
        merged.update(part)
    return tuple(sorted(merged.items()))


def _parse_minutes(value: str) -> Optional[float]:
    """Slurm time string -> minutes (MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]])."""
    days = 0
    if "-" in value:
        head, value = value.split("-", 1)
        days = int(head)
        parts = [int(p) for p in value.split(":")] + [0, 0]
        return days * 1440 + parts[0] * 60 + parts[1] + parts[2] / 60
    parts = [int(p) for p in value.split(":")]
    if len(parts) == 1:
        return float(parts[0])
    if len(parts) == 2:
        return parts[0] + parts[1] / 60
    return parts[0] * 60 + parts[1] + parts[2] / 60


def container_args(cluster: ClusterProfile, run_dir: str) -> tuple[str, ...]:
    c = cluster.container
    if c is None:
        return ()
    args = [f"--container-image={c.image}", f"--container-mounts={','.join(list(c.mounts) + [f'{run_dir}:{run_dir}'])}"]
    if c.workdir:
        args.append(f"--container-workdir={c.workdir}")
    return tuple(args)


def _srun_args(step: Step, group: Group, cluster: ClusterProfile, container: tuple[str, ...]) -> tuple[str, ...]:
    """Where one step runs: its het group (or node range) and its tasks. Passed to srun as argv, never a shell."""
    args = [f"--het-group={step.group}"] if cluster.hetjob else [f"--relative={group.node_offset}"]
    args += [f"--nodes={step.nodes}", f"--ntasks-per-node={step.ntasks_per_node}",
             f"--cpus-per-task={step.cpus_per_task}", f"--job-name={step.name}", "--kill-on-bad-exit=1"]
    args += _gpu_directive(cluster, step.gpus_per_node)
    if step.overlap:
        args.append("--overlap")
    return tuple(args) + container


_UNSAFE_PATH = set(" \t\n\r'\"`$;\\")


def make_plan(topo: Topology, topo_source: Source, cluster: ClusterProfile, cluster_source: Source,
              run_dir: str) -> Plan:
    """Place every role of `topo` on `cluster`; `run_dir` is the resolved absolute run directory."""
    check = _Checker(topo_source, cluster, cluster_source)
    if _UNSAFE_PATH & set(run_dir) or not run_dir.startswith("/"):
        raise check.fail(("run_dir",), (
            f"run directory {run_dir!r} must be an absolute path without spaces, quotes, '$', ';' or backslashes "
            f"(it appears in #SBATCH lines and on every node's command line)"))
    gpn = cluster.gpu_node.gpus
    base = cluster.port_base

    groups: list[Group] = []
    servers: list[Server] = []
    steps: list[Step] = []
    node_offset = 0
    common_env = {**cluster.env, **cluster.network.env, "PRL_RUN_DIR": run_dir}
    if cluster.network.interface:
        common_env.setdefault("NCCL_SOCKET_IFNAME", cluster.network.interface)
        common_env.setdefault("GLOO_SOCKET_IFNAME", cluster.network.interface)

    # --- inference groups -------------------------------------------------------------------
    inference_groups = topo.inference.groups()
    disagg = topo.inference.disaggregated
    inference_steps: list[str] = []
    servers_per_node_max = 0
    for role, group in inference_groups.items():
        field = ("inference", role) if disagg else ("inference",)
        per_replica, nodes_per_replica, per_node = _inference_layout(check, role, field, group, gpn)
        servers_per_node_max = max(servers_per_node_max, per_node)
        index = len(groups)
        gpus_req = gpn
        cpus_per_task = max(1, (cluster.gpu_node.cpus // per_node))
        groups.append(Group(index, role, cluster.partitions.inference, group.nodes, gpus_req, per_node, cpus_per_task,
                            node_offset, _group_directives(cluster, cluster.partitions.inference, group.nodes,
                                                           per_node, cpus_per_task, gpus_req)))
        node_offset += group.nodes
        kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}.get(role)
        if kv_role and topo.inference.kv_connector.name == "NixlConnector":
            kv_role = "kv_both"  # NIXL pulls KV from the decode side; both ends use the same role
        dp_local = per_replica // group.tp if nodes_per_replica == 1 else gpn // group.tp
        replicas = group.nodes // nodes_per_replica * per_node
        task = 0
        for replica in range(replicas):
            first_node = replica // per_node * nodes_per_replica
            slot = replica % per_node
            for k in range(nodes_per_replica):
                node = first_node + k
                head = k == 0
                if cluster.slurm:
                    port = base + slot if head else None
                    rpc_port = base + DP_RPC_PORT_OFFSET + slot
                else:
                    # Local runs put every "node" on this one host: ports must differ job-wide.
                    port = base + len(servers) if head else None
                    rpc_port = base + DP_RPC_PORT_OFFSET + len(servers)
                gpus = tuple(range(slot * per_replica, (slot + 1) * per_replica)) if per_replica and nodes_per_replica == 1 \
                    else tuple(range(gpn)) if gpn else ()
                args = _server_args(topo, group, role, port, dp_local, k * dp_local, nodes_per_replica, rpc_port,
                                    kv_role)
                servers.append(Server(role, replica, index, node, task, gpus, port, head, args))
                task += 1
        steps.append(Step(role, index, group.nodes, per_node, cpus_per_task, gpus_req, False, (), "http",
                          f"scripts/{role}.sh", _env(common_env, group.env, {"PRL_ROLE": role})))
        inference_steps.append(role)
        if group.expert_parallel and group.tp * group.dp == 1:
            check.warnings.append(f"{role}: expert_parallel with tp*dp = 1 has nothing to spread experts over")

    router_port: Optional[int] = None
    if disagg:
        router_port = topo.inference.router.port or base + ROUTER_PORT_OFFSET
        steps.append(Step("router", 0, 1, 1, 2, 0, True, tuple(inference_steps), "http", "scripts/router.sh",
                          _env(common_env, {"PRL_ROLE": "router"})))
        inference_steps = inference_steps + ["router"]
        if gpn and topo.inference.kv_connector.name == "ExampleConnector":
            check.warnings.append("kv_connector ExampleConnector moves KV through shared storage: a CPU test "
                                  "connector, slow on GPU clusters (use NixlConnector)")

    # --- KV offload memory ------------------------------------------------------------------
    off = topo.inference.kv_offload
    if off.backend != "none":
        if gpn == 0:
            check.warnings.append("kv_offload: vLLM's CPU backend refuses KV offload; only the rendering can be tested")
        need = off.cpu_gb * servers_per_node_max
        have = cluster.gpu_node.memory_gb * KV_OFFLOAD_MEMORY_FRACTION
        if need > have:
            raise check.fail(("inference", "kv_offload", "cpu_gb"), (
                f"KV offload needs cpu_gb({off.cpu_gb:g}) * {servers_per_node_max} servers per node = {need:g} GiB, "
                f"over {KV_OFFLOAD_MEMORY_FRACTION:.0%} of a node's {cluster.gpu_node.memory_gb:g} GiB on cluster "
                f"'{cluster.name}'; use cpu_gb <= {have / servers_per_node_max:g}"))

    # --- orchestrator -----------------------------------------------------------------------
    orch = topo.orchestrator
    trainer_index = len(groups) + (1 if orch.placement == "own" else 0)
    orch_env = _env(common_env, orch.env, {"PRL_ROLE": "orchestrator"})
    orch_after = tuple(inference_steps)
    if orch.placement == "own":
        node = cluster.orchestrator_node
        cpus = orch.cpus or node.cpus
        if cpus > node.cpus:
            raise check.fail(("orchestrator", "cpus"), (
                f"orchestrator asks for {cpus} CPUs but a node of its partition has {node.cpus}"))
        index = len(groups)
        partition = cluster.partitions.orchestrator
        groups.append(Group(index, "orchestrator", partition, 1, 0, 1, cpus, node_offset,
                            _group_directives(cluster, partition, 1, 1, cpus, 0)))
        node_offset += 1
        steps.append(Step("orchestrator", index, 1, 1, cpus, 0, False, orch_after, "heartbeat",
                          "scripts/orchestrator.sh", orch_env))
        orch_group = index
    else:
        host_group = trainer_index if orch.placement == "trainer" else 0
        cpus = orch.cpus or SHARED_ORCHESTRATOR_CPUS
        steps.append(Step("orchestrator", host_group, 1, 1, cpus, 0, True, orch_after, "heartbeat",
                          "scripts/orchestrator.sh", orch_env))
        orch_group = host_group

    # --- trainer ----------------------------------------------------------------------------
    tr = topo.trainer
    if gpn == 0:
        procs = tr.gpus_per_node or 1
        device = "cpu"
    else:
        procs = tr.gpus_per_node or gpn
        device = "cuda"
        if procs > gpn:
            raise check.fail(("trainer", "gpus_per_node"), (
                f"trainer.gpus_per_node({procs}) is more than the {gpn} GPUs of a node on cluster '{cluster.name}'"))
    world = tr.nodes * procs
    where = f"{tr.nodes} nodes x {procs} {'GPUs' if gpn else 'ranks'} on cluster '{cluster.name}'"
    fixed = tr.dp_replicate * tr.cp
    if tr.dp_shard == -1:
        if world % fixed:
            raise check.fail(("trainer", "dp_replicate" if tr.cp == 1 else "cp"), (
                f"trainer needs dp_replicate({tr.dp_replicate}) * cp({tr.cp}) = {fixed} to divide its {world} "
                f"{'GPUs' if gpn else 'ranks'} ({where})"))
        dp_shard = world // fixed
    else:
        dp_shard = tr.dp_shard
        if fixed * dp_shard != world:
            raise check.fail(("trainer", "dp_shard"), (
                f"Invalid trainer mesh: dp_replicate({tr.dp_replicate}) * dp_shard({dp_shard}) * cp({tr.cp}) = "
                f"{fixed * dp_shard} != world size {world} ({where}); use dp_shard: -1 to fill"))
    if (dp_shard * tr.cp) % tr.ep:
        raise check.fail(("trainer", "ep"), (
            f"trainer needs ep({tr.ep}) to divide dp_shard({dp_shard}) * cp({tr.cp}) = {dp_shard * tr.cp} "
            f"({where}); experts are sharded over the dp_shard x cp ranks"))
    mesh = Mesh(tr.dp_replicate, dp_shard, tr.cp, tr.ep, world)
    trainer_gpus = procs if gpn else 0
    trainer_group = Group(trainer_index, "trainer", cluster.partitions.trainer, tr.nodes, trainer_gpus, 1,
                          cluster.gpu_node.cpus, node_offset,
                          _group_directives(cluster, cluster.partitions.trainer, tr.nodes, 1, cluster.gpu_node.cpus,
                                            trainer_gpus))
    groups.append(trainer_group)
    node_offset += tr.nodes
    rdzv_port = base + RDZV_PORT_OFFSET
    trainer_plan = TrainerPlan(trainer_index, tr.nodes, procs, world, device, mesh, rdzv_port,
                               tr.activation_checkpointing, tr.precision)
    steps.append(Step("trainer", trainer_index, tr.nodes, 1, cluster.gpu_node.cpus, trainer_gpus,
                      orch.placement == "trainer", ("orchestrator",), "heartbeat", "scripts/trainer.sh",
                      _env(common_env, tr.env, {"PRL_ROLE": "trainer"})))

    # --- cluster-wide checks ----------------------------------------------------------------
    total_nodes = sum(g.nodes for g in groups)
    if cluster.slurm and total_nodes > cluster.max_nodes:
        parts = " + ".join(f"{g.name} {g.nodes}" for g in groups)
        raise check.fail_cluster(("max_nodes",), (
            f"the job needs {parts} = {total_nodes} nodes, over cluster '{cluster.name}' max_nodes({cluster.max_nodes})"
            f"; shrink a group or raise max_nodes"))
    if not cluster.hetjob and cluster.slurm:
        used = {g.partition for g in groups}
        if len(used) > 1:
            raise check.fail_cluster(("hetjob",), (
                f"cluster '{cluster.name}' allows no hetjobs, so all roles share one allocation, but the roles use "
                f"partitions {sorted(p or '(default)' for p in used)}; use one partition or allow hetjobs"))
    # --- training settings ------------------------------------------------------------------
    t = topo.training
    if t.batch_size % t.rollouts_per_example:
        raise check.fail(("training", "batch_size"), (
            f"batch_size({t.batch_size}) must be a multiple of rollouts_per_example({t.rollouts_per_example}); "
            f"use {t.batch_size // t.rollouts_per_example * t.rollouts_per_example or t.rollouts_per_example}"))
    if t.batch_size < mesh.dp:
        raise check.fail(("training", "batch_size"), (
            f"batch_size({t.batch_size}) gives some of the trainer's {mesh.dp} data-parallel ranks "
            f"(dp_replicate({mesh.dp_replicate}) * dp_shard({mesh.dp_shard})) no sample; use at least {mesh.dp}"))
    if t.max_tokens >= topo.model.max_model_len:
        raise check.fail(("training", "max_tokens"), (
            f"max_tokens({t.max_tokens}) leaves no room for the prompt within model.max_model_len"
            f"({topo.model.max_model_len})"))

    ports: dict[tuple[Any, int], str] = {}

    def claim(host: Any, port: Optional[int], what: str) -> None:
        if port is None:
            return
        key = (host if cluster.slurm else "localhost", port)
        if key in ports:
            raise check.fail_cluster(("port_base",), f"port {port} is used twice on one node: {ports[key]} and {what}")
        ports[key] = what

    for s in servers:
        claim((s.group, s.node), s.port, f"{s.role} server {s.replica}")
    if router_port is not None:
        claim((0, 0), router_port, "router")
    claim((trainer_index, 0), rdzv_port, "trainer rendezvous")

    shared_root = cluster.shared_root.rstrip("/") + "/"
    if not (run_dir.rstrip("/") + "/").startswith(shared_root):
        check.warnings.append(f"run_dir {run_dir} is outside the cluster's shared_root {cluster.shared_root}: "
                              f"every node must see it")

    time_limit = topo.slurm.time or cluster.default_time
    batch: list[str] = [f"--job-name={topo.slurm.job_name or topo.name}",
                        f"--output={run_dir}/logs/slurm-%j.out", "--open-mode=append"]
    if cluster.requeue.signal_seconds:
        # B: signals the batch shell only; USR1 is avoided because NCCL installs a handler for it.
        batch.append(f"--signal=B:TERM@{cluster.requeue.signal_seconds}")
    batch.append("--requeue" if cluster.requeue.enabled else "--no-requeue")
    # Options every het component needs for itself (Slurm schedules components separately).
    common: list[str] = []
    if time_limit:
        common.append(f"--time={time_limit}")
        minutes = _parse_minutes(time_limit)
        if cluster.requeue.signal_seconds and minutes is not None and minutes * 60 <= cluster.requeue.signal_seconds:
            check.warnings.append(f"time {time_limit} is shorter than the checkpoint signal lead "
                                  f"({cluster.requeue.signal_seconds} s): the signal comes at the start")
    elif cluster.slurm:
        check.warnings.append("no time limit (slurm.time or the profile's default_time): the partition default applies")
    account = topo.slurm.account or cluster.account
    if account:
        common.append(f"--account={account}")
    qos = topo.slurm.qos or cluster.qos
    if qos:
        common.append(f"--qos={qos}")
    if topo.slurm.reservation:
        common.append(f"--reservation={topo.slurm.reservation}")
    common += topo.slurm.extra_directives

    if cluster.hetjob:
        groups = [replace(g, directives=g.directives + tuple(common)) for g in groups]
    else:
        # One allocation: whole nodes of one kind; each step picks its node range with --relative.
        gpus = max(g.gpus_per_node for g in groups)
        ntasks = max(g.ntasks_per_node for g in groups)
        single = _group_directives(cluster, groups[0].partition, total_nodes, ntasks,
                                   max(1, cluster.gpu_node.cpus // ntasks), gpus) + tuple(common)
        groups = [replace(g, directives=single if g.index == 0 else ()) for g in groups]
        if orch.placement == "own" and gpus:
            check.warnings.append("without hetjobs the orchestrator's node is a GPU node too: its GPUs stay idle")
    steps = [replace(s, srun_args=_srun_args(s, groups[s.group], cluster, container_args(cluster, run_dir)))
             if cluster.slurm else s for s in steps]

    setup = [f"module load {shlex.quote(m)}" for m in cluster.modules]
    if cluster.venv:
        setup.append(f"source {shlex.quote(cluster.venv + '/bin/activate')}")
    setup += cluster.setup

    container = None
    if cluster.container:
        c = cluster.container
        container = {"image": c.image, "mounts": list(c.mounts) + [f"{run_dir}:{run_dir}"], "workdir": c.workdir}

    totals = {
        "nodes": total_nodes,
        "gpus": sum(g.nodes * g.gpus_per_node for g in groups),
        "inference_servers": sum(1 for s in servers if s.head),
        "inference_gpus": sum(g.nodes * g.gpus_per_node for g in groups if g.name in inference_groups),
        "trainer_world_size": world,
    }
    return Plan(
        name=topo.name,
        job_name=topo.slurm.job_name or topo.name,
        cluster=cluster.name,
        slurm=cluster.slurm,
        hetjob=cluster.hetjob,
        run_dir=run_dir,
        python=cluster.python,
        model=topo.model.model_dump(),
        groups=tuple(groups),
        servers=tuple(servers),
        router_port=router_port,
        trainer=trainer_plan,
        orchestrator={"placement": orch.placement, "group": orch_group, "interface": cluster.network.interface},
        steps=tuple(steps),
        batch_directives=tuple(batch),
        setup=tuple(setup),
        container=container,
        environment=topo.environment.model_dump(),
        training=topo.training.model_dump(),
        kv_offload=off.model_dump(),
        kv_connector=topo.inference.kv_connector.model_dump() if disagg else None,
        grace_seconds=cluster.requeue.grace_seconds,
        requeue=cluster.requeue.enabled,
        totals=totals,
        warnings=tuple(check.warnings),
    )
