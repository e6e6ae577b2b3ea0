"""Topology + cluster profile -> Plan: who runs where, with every number derived and checked.

Pure: no I/O, no clock, no environment. `make_plan` either returns a frozen
Plan (prl/planner/model.py) or raises PlanError with the numbers and the fix,
located at the YAML line of the field to change. The renderer, the launcher
and the roles only read a Plan.

Layout of a job (one het group per role kind, in start order):

    inference (or prefill + decode)   vLLM servers, one per replica and node
    teacher, reference                scoring servers (on-policy distillation, a frozen reference), when written
    orchestrator                      when `orchestrator.placement: own`
    trainer                           torchrun, one task per node

Start order: every inference and scoring server healthy (router after prefill + decode)
-> orchestrator healthy -> trainer. An SFT topology (`sft:`) plans the trainer alone:
one group, one step, the same launcher, heartbeats and state files.

`make_plan` is a short sequence of named steps; each is a function of its own,
unit-tested in tests/test_plan_steps.py.
"""

from __future__ import annotations

import json
import shlex

import msgspec
from dataclasses import dataclass, field
from typing import Any, Optional

from prl.config.cluster import ClusterProfile
from prl.config.loader import Source
from prl import weights
from prl.config.topology import InferenceGroup, Lora, Pool, Scorer, Topology, Training, Weights
from prl.errors import PlanError
from prl.planner.capabilities import (VLLM_NO_LORA_ARCHITECTURES, ModelConfig, aux_loss_refusals, compile_refusals,
                                     cpu_lora_refusal, lora_refusals, precision_refusals, quantization_refusals, replay_refusals,
                                     served_lora_rank, trainer_refusals, update_warnings, vision_refusals)
from prl.planner.settings import RunSettings
from prl.run.rundir import RunDir
from prl.states import KV_ROLES, WEIGHT_ROLES, Role
from prl.planner.model import (
    ContainerPlan,
    FailurePolicy,
    Group,
    InferenceRole,
    Mesh,
    MeshError,
    OrchestratorPlan,
    Plan,
    PoolPlan,
    Server,
    Launch,
    Totals,
    TrainerPlan,
    derive_mesh,
    side_channel_ports,
)

# Port layout on one node, as offsets from the profile's port_base.
ROUTER_PORT_OFFSET = 90
DP_RPC_PORT_OFFSET = 200
NIXL_SIDE_CHANNEL_PORT_OFFSET = 300
RDZV_PORT_OFFSET = 500
WEIGHT_PORT_OFFSET = 600
"""First port of a weight transport that sends from memory (prl/weights): one per trainer rank on its node (per
host, locally)."""
MAX_PORT = 65535
MAX_SERVERS = 100_000
"""Most inference server processes (and srun tasks) one plan places: each is a process, ports and a record."""
MAX_JOB_GPUS = 262_144
"""Most GPUs one job may use: more than any cluster has, and few enough that the plan's per-GPU records stay small."""
SHARED_ORCHESTRATOR_CPUS = 4
"""The orchestrator's cores on a node it shares with the trainer or inference, when `orchestrator.cpus` is unset:
this many, or the whole node where it has fewer (a 2-core workstation), so the default never refuses itself."""
ROUTER_CPUS = 2
"""Cores of the P/D router's step (on the first prefill node, beside its server), or the node's when it has fewer."""
KV_OFFLOAD_MEMORY_FRACTION = 0.8
VLLM_KV_ROLE = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}
"""vLLM's `kv_role` of each side of prefill/decode disaggregation."""

_UNSAFE_PATH = set(" \t\n\r'\"`$;\\")
KERNEL_FILESYSTEMS = ("/proc", "/sys")
"""The kernel's virtual filesystems: a run directory under one is refused (/dev/shm, a tmpfs, is not)."""
PLANNED_SERVER_OPTIONS = frozenset({
    "--model", "--served-model-name", "--dtype", "--max-model-len", "--tensor-parallel-size", "-tp", "--tokenizer",
    "--port", "--host", "--api-key", "--data-parallel-size", "-dp", "--data-parallel-rpc-port",
    "--data-parallel-size-local", "-dpl", "--data-parallel-start-rank", "-dpr", "--data-parallel-address", "-dpa",
    "--headless", "--enable-expert-parallel", "--gpu-memory-utilization", "--kv-transfer-config",
    "--kv-offloading-backend", "--kv-offloading-size", "--enable-lora", "--max-lora-rank", "--max-loras",
    "--max-cpu-loras", "--logprobs-mode"})
"""`vllm serve` options the plan (or the role runner) sets: an `extra_args` item naming one would contradict it."""
QUANTIZATION_OPTIONS = frozenset({"--quantization", "-q"})
"""Set by the plan on the policy servers when `inference.quantization` is."""
LAYOUT_DIRECTIVES = frozenset({
    "--job-name", "--output", "--error", "--open-mode", "--signal", "--requeue", "--no-requeue", "--time",
    "--partition", "--nodes", "--ntasks", "--ntasks-per-node", "--cpus-per-task", "--array", "--het-group",
    "--chdir", "--wrap", "--export"})
"""`#SBATCH` options that would change the job's layout, logs or environment: refused in `extra_directives`
always, besides any other option the plan renders (`--gres`, `--exclusive`, `--account`, ... when it does)."""


class Checker:
    """Turns violated placement facts into located PlanErrors; collects warnings."""

    def __init__(self, topo_source: Source, cluster: ClusterProfile, cluster_source: Source):
        self.topo = topo_source
        self.cluster = cluster
        self.cluster_source = cluster_source
        self.warnings: list[str] = []

    def fail(self, field: tuple[Any, ...], message: str) -> PlanError:
        return PlanError(f"{self.topo.locate(field)}: {message}")

    def fail_cluster(self, field: tuple[Any, ...], message: str) -> PlanError:
        return PlanError(f"{self.cluster_source.locate(field)}: {message}")


@dataclass
class Layout:
    """What the placement steps build up, in het-group order."""

    groups: list[Group] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    node_offset: int = 0

    def add_group(self, cluster: ClusterProfile, name: str, partition: Optional[str], nodes: int, ntasks: int,
                  cpus: int, gpus: int) -> Group:
        group = Group(index=len(self.groups), name=name, partition=partition, nodes=nodes, gpus_per_node=gpus,
                      ntasks_per_node=ntasks, cpus_per_task=cpus, node_offset=self.node_offset,
                      directives=group_directives(cluster, partition, nodes, ntasks, cpus, gpus))
        self.groups.append(group)
        self.node_offset += nodes
        return group


# ----------------------------------------------------------------------------- the steps


def check_run_dir(check: Checker, run_dir: str) -> None:
    if _UNSAFE_PATH & set(run_dir) or not run_dir.startswith("/"):
        raise check.fail(("run_dir",), (
            f"run directory {run_dir!r} must be an absolute path without spaces, quotes, '$', ';' or backslashes "
            f"(it appears in #SBATCH lines and on every node's command line)"))
    if run_dir.rstrip("/") == "":
        raise check.fail(("run_dir",), "run directory '/' would make prl write into the filesystem root; "
                                       "use a directory of its own, e.g. /scratch/$USER/prl-runs/NAME")
    kernel = next((root for root in KERNEL_FILESYSTEMS if (run_dir.rstrip("/") + "/").startswith(root + "/")), None)
    if kernel is not None:
        raise check.fail(("run_dir",), f"run directory {run_dir!r} is under {kernel}, the kernel's view of this "
                                       f"machine (no files of a run can live there, and no other node sees it); use a "
                                       f"directory on the shared filesystem, under {check.cluster.shared_root}")
    if "%" in run_dir:
        # Slurm reads %j, %t, %x ... in --output as patterns; '%%' would be right there and wrong everywhere else.
        raise check.fail(("run_dir",), f"run directory {run_dir!r} must not contain '%': Slurm reads %j, %x, ... in "
                                       f"the job's --output path as patterns and would write the logs elsewhere")
    mount_separators = sorted(set(",:") & set(run_dir)) if check.cluster.container is not None else []
    if mount_separators:
        raise check.fail(("run_dir",), f"run directory {run_dir!r} must not contain {mount_separators[0]!r} on "
                                       f"cluster '{check.cluster.name}': it is mounted into the container, and pyxis "
                                       f"reads ',' as another mount and ':' as a separator")


def check_node_budget(check: Checker, topo: Topology) -> None:
    """Node totals against max_nodes before anything is expanded per node (a typo of 10**9 fails at once)."""
    cluster = check.cluster
    counts = {role: g.nodes for role, g in server_groups(topo).items()}
    if topo.inference and topo.orchestrator.placement == "own":
        counts[Role.ORCHESTRATOR] = 1
    if topo.trainer is not None:
        counts[Role.TRAINER] = topo.trainer.nodes
    total = sum(counts.values())
    if total <= cluster.max_nodes:
        return
    parts = " + ".join(f"{role} {n}" for role, n in counts.items())
    raise check.fail_cluster(("max_nodes",), (
        f"the job needs {parts} = {total} nodes, over cluster '{cluster.name}' max_nodes({cluster.max_nodes}); "
        f"shrink a group or raise max_nodes"))


def check_derived_totals(check: Checker, topo: Topology) -> None:
    """Bound what the counts multiply into (servers, tasks, GPUs) before any of it is expanded: every count may be
    legal and their product still millions of records."""
    gpn = check.cluster.gpu_node.gpus
    groups = server_groups(topo)
    servers = {role: (g.nodes, max(1, gpn // (g.tp * g.dp)) if gpn else 1) for role, g in groups.items()}
    total = sum(nodes * per_node for nodes, per_node in servers.values())
    if total > MAX_SERVERS:
        role = max(servers, key=lambda r: servers[r][0] * servers[r][1])
        nodes, per_node = servers[role]
        g = groups[role]
        raise check.fail(group_field(topo, role) + ("nodes",), (
            f"{role} would start nodes({nodes}) x {per_node} servers per node ({gpn} GPUs / tp({g.tp}) * dp({g.dp})) "
            f"= {nodes * per_node} servers ({total} in all), over the {MAX_SERVERS} one job may start (each is a "
            f"process with its ports, and a record the planner builds whether or not it writes the plan); "
            f"use fewer nodes or a larger tp or dp"))
    tr = topo.trainer
    fields = {group_field(topo, role) + ("nodes",): (role, g.nodes, gpn) for role, g in groups.items()}
    if tr is not None:
        fields[(Role.TRAINER, "nodes")] = (Role.TRAINER, tr.nodes, tr.gpus_per_node or gpn)
    gpus = sum(nodes * per_node for _, nodes, per_node in fields.values())
    if gpus > MAX_JOB_GPUS:
        parts = " + ".join(f"{role} nodes({nodes}) x {per_node}" for role, nodes, per_node in fields.values())
        blamed = max(fields, key=lambda field: fields[field][1] * fields[field][2])
        raise check.fail(blamed, f"the job would use {parts} = {gpus} GPUs, over the {MAX_JOB_GPUS} one job may "
                                 f"use; use fewer nodes")


def inference_layout(check: Checker, role: str, field: tuple[str, ...], group: InferenceGroup,
                     gpus_per_node: int) -> tuple[int, int, int]:
    """(GPUs per replica, nodes per replica, servers per node) for one inference group, checked."""
    cluster = check.cluster
    if gpus_per_node == 0:
        # CPU cluster: one server per node (vLLM's CPU backend), tp/dp are engine threads.
        workers, cpus = group.tp * group.dp, cluster.gpu_node.cpus
        if workers > cpus:
            raise check.fail(field + ("tp",), (
                f"{role} tp({group.tp}) * dp({group.dp}) = {workers} CPU workers per server over-commit the {cpus} "
                f"CPUs of a node on CPU cluster '{cluster.name}'; use tp * dp <= {cpus}"))
        if group.tp > 1:
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


def check_extra_args(check: Checker, field: tuple[str, ...], group: InferenceGroup,
                     planned: frozenset[str] = PLANNED_SERVER_OPTIONS) -> None:
    """An `extra_args` item may not name an option the plan sets: vLLM would take the last of the two."""
    for index, item in enumerate(group.extra_args):
        if item.partition("=")[0] in planned:
            raise check.fail(field + ("extra_args", index), (
                f"{item.partition('=')[0]} is set by the plan from the topology (model, tp, dp, ports, ...); "
                f"change that field instead of passing it in extra_args"))


@dataclass(frozen=True)
class Served:
    """What a role's servers serve: the model they start from, the name they answer to, whether they take LoRA
    adapters, and the model's own vLLM flags (whatever the server's place in the fleet)."""

    model: str
    name: str
    adapters: bool
    args: tuple[str, ...]


def served_model(topo: Topology, role: str) -> Served:
    """The model of a role's servers: the student's model (served as the topology's name), or a scoring group's own
    (served as `teacher` / `reference`; a reference without a path serves the student's model)."""
    m = topo.model
    scorer = topo.scorers().get(role)
    if scorer is None:
        # The sampled tokens' logprobs under the distribution sampled from (after temperature), as the trainer's
        # (`training.temperature`); at temperature 1 the same as vLLM's default raw logprobs.
        model, name = m.path, topo.name
        args = ["--dtype", m.dtype, "--max-model-len", str(m.max_model_len), "--logprobs-mode", "processed_logprobs",
                ] + lora_args(m.lora) + pool_args(topo.pool)
        assert topo.inference is not None
        if topo.inference.quantization is not None:
            args += ["--quantization", topo.inference.quantization]
        if topo.training is not None and topo.training.router_replay:
            args += ["--routed-experts", "--no-enable-prefix-caching"]
        tokenizer = m.tokenizer
    else:
        model, name = scorer.path or m.path, role
        args = ["--dtype", scorer.dtype, "--max-model-len", str(scorer_max_len(topo, scorer))]
        tokenizer = scorer.tokenizer or (None if scorer.path else m.tokenizer)
    args += ["--tokenizer", tokenizer] if tokenizer else []
    return Served(model, name, "--enable-lora" in args, tuple(args))


LORA_SLOTS = 2
"""Adapters a server holds at once (`--max-loras`): the version serving and the one replacing it, so requests
still on the old one finish on it while the new one loads."""


def lora_args(lora: Optional[Lora]) -> list[str]:
    """The policy servers' LoRA arguments: adapters on, room for the run's rank (none without `model.lora`)."""
    if lora is None:
        return []
    return ["--enable-lora", "--max-lora-rank", str(served_lora_rank(lora.rank)), "--max-loras", str(LORA_SLOTS),
            "--max-cpu-loras", str(LORA_SLOTS)]


def pool_args(pool: Optional[Pool]) -> list[str]:
    """An inference pool's server arguments: attached runs' adapters served under their names and keys."""
    if pool is None:
        return []
    return ["--tenants", "--enable-lora", "--max-lora-rank", str(pool.max_lora_rank), "--max-loras",
            str(pool.max_loras), "--max-cpu-loras", str(pool.max_cpu_loras or 4 * pool.max_loras)]


def scorer_max_len(topo: Topology, scorer: Scorer) -> int:
    """A scoring server's context: as written, else the student's + 1 (vLLM completes at least one token)."""
    return scorer.max_model_len or topo.model.max_model_len + 1


def lone_server_args(served: Served, group: InferenceGroup) -> tuple[str, ...]:
    """What one server of the group's model takes wherever it runs (an evaluation server of the run's weights):
    the model's flags, its tensor parallelism and memory, the user's extra arguments."""
    memory = ["--gpu-memory-utilization", str(group.gpu_memory_utilization)] if group.gpu_memory_utilization else []
    return (*served.args, "--tensor-parallel-size", str(group.tp), *memory, *group.extra_args)


def server_args(topo: Topology, group: InferenceGroup, port: Optional[int], dp_local: int, dp_start: int,
                nodes_per_replica: int, rpc_port: Optional[int], kv_role: Optional[str],
                run_dir: str, role: str = Role.INFERENCE) -> tuple[str, ...]:
    """`vllm serve` arguments of one server process of `role`, but its model and name (`Server.argv` adds them)."""
    args = list(served_model(topo, role).args) + ["--tensor-parallel-size", str(group.tp)]
    if port is not None:
        args += ["--port", str(port)]
    if group.dp > 1:
        # An explicit RPC port per server: two dp servers on one node would otherwise share vLLM's default.
        args += ["--data-parallel-size", str(group.dp), "--data-parallel-rpc-port", str(rpc_port)]
        if nodes_per_replica > 1:
            args += ["--data-parallel-size-local", str(dp_local), "--data-parallel-start-rank", str(dp_start)]
            if port is None:
                args.append("--headless")
    if group.expert_parallel:
        args.append("--enable-expert-parallel")
    if group.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(group.gpu_memory_utilization)]
    off = topo.inference.kv_offload
    if kv_role is not None:
        config = kv_transfer_config(topo, kv_role, run_dir)
        args += ["--kv-transfer-config", json.dumps(config, sort_keys=True, separators=(",", ":"))]
    elif off.backend != "none" and role not in topo.scorers():  # scoring reads each prompt once
        args += ["--kv-offloading-backend", off.backend, "--kv-offloading-size", f"{off.cpu_gb:g}"]
    args += group.extra_args
    return tuple(args)


def kv_transfer_config(topo: Topology, kv_role: str, run_dir: str) -> dict[str, Any]:
    """`--kv-transfer-config` of a prefill/decode server: the topology's connector, with KV offload a
    `MultiConnector` of it and the offload connector.

    Offload is not rendered as `--kv-offloading-*` here: given next to a connector, vLLM
    (`VllmConfig._post_init_kv_transfer_config`) replaces that connector by the offload one
    (kv_both), and prefill/decode would silently lose its KV transfer. A MultiConnector loads from
    the first connector that has a request's KV (the transfer one, listed first) and saves to all.
    """
    conn = topo.inference.kv_connector
    extra = dict(conn.extra_config)
    if conn.name == "ExampleConnector":
        # vLLM's default is /tmp, on each node's own disk; the run directory is shared and per run.
        extra.setdefault("shared_storage_path", str(RunDir(run_dir).kv_storage))
    own = {"kv_connector": conn.name, "kv_role": kv_role, "kv_connector_extra_config": extra}
    off = topo.inference.kv_offload
    if off.backend == "none":
        return {**own, "kv_load_failure_policy": conn.load_failure}
    return {"kv_connector": "MultiConnector", "kv_role": kv_role, "kv_load_failure_policy": conn.load_failure,
            "kv_connector_extra_config": {"connectors": [own, offload_connector(topo)]}}


def offload_connector(topo: Topology) -> dict[str, Any]:
    """The connector vLLM's `--kv-offloading-backend`/`--kv-offloading-size` select, as a config of its own."""
    off = topo.inference.kv_offload
    if off.backend == "native":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": int(off.cpu_gb * (1 << 30))}}
    # lmcache: a client of a separate LMCache server, which owns the capacity (vLLM passes no size).
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}


def side_channel_base(check: Checker, topo: Topology) -> int:
    """First NIXL side-channel port: the cluster's port base + 300, or just past a router port the user chose
    inside the side channels' range (the planner picks around the user's port, rather than blame it)."""
    cluster = check.cluster
    base = cluster.port_base + NIXL_SIDE_CHANNEL_PORT_OFFSET
    chosen = topo.inference.router.port
    gpn = cluster.gpu_node.gpus
    # Data-parallel ranks on one node (on one host, all of them): each listens on base + its index.
    ranks = [max(1, gpn // g.tp) if gpn else g.dp for g in topo.inference.groups().values()]
    nodes = [g.nodes for g in topo.inference.groups().values()]
    span = sum(n * r for n, r in zip(nodes, ranks)) if shared_host(cluster) else max(ranks)
    return chosen + 1 if chosen is not None and base <= chosen < base + span else base


def place_inference(check: Checker, topo: Topology, layout: Layout, common_env: dict[str, str], run_dir: str
                    ) -> tuple[list[InferenceRole], list[Server]]:
    """One het group per inference role (then per scoring role), one server per replica and node, ports per node."""
    cluster = check.cluster
    gpn = cluster.gpu_node.gpus
    roles: list[InferenceRole] = []
    servers: list[Server] = []
    disagg = topo.inference.disaggregated
    nixl = disagg and topo.inference.kv_connector.name == "NixlConnector"
    side_ranks = 0  # data-parallel ranks given a side channel so far (job-wide ports: every node is one host)
    side_base = side_channel_base(check, topo) if nixl else 0
    for role, group in server_groups(topo).items():
        task = 0
        field = group_field(topo, role)
        per_replica, nodes_per_replica, per_node = inference_layout(check, role, field, group, gpn)
        quantized = topo.inference.quantization is not None and role not in topo.scorers()
        check_extra_args(check, field, group, PLANNED_SERVER_OPTIONS | (QUANTIZATION_OPTIONS if quantized else set()))
        cpus = max(1, cluster.gpu_node.cpus // per_node)
        g = layout.add_group(cluster, role, cluster.partitions.inference, group.nodes, per_node, cpus, gpn)
        kv_role = VLLM_KV_ROLE.get(role) if disagg else None
        side_channel = nixl and kv_role is not None
        dp_local = per_replica // group.tp if nodes_per_replica == 1 else gpn // group.tp
        served = served_model(topo, role)
        replicas = group.nodes // nodes_per_replica * per_node
        for replica in range(replicas):
            first_node, slot = replica // per_node * nodes_per_replica, replica % per_node
            # vLLM adds each data-parallel rank's index to the side-channel port: replicas are dp ports apart.
            side = side_base + (side_ranks if shared_host(cluster) else slot * group.dp) if side_channel else None
            side_ranks += group.dp if side_channel else 0
            for k in range(nodes_per_replica):
                head = k == 0
                # Slurm: each node has its own ports. Local runs (and single_host profiles) put every "node" on
                # one host: ports differ job-wide.
                offset = len(servers) if shared_host(cluster) else slot
                port = cluster.port_base + offset if head else None
                rpc_port = cluster.port_base + DP_RPC_PORT_OFFSET + offset if group.dp > 1 else None
                gpus = (tuple(range(slot * per_replica, (slot + 1) * per_replica)) if per_replica and nodes_per_replica == 1
                        else tuple(range(gpn)))
                args = server_args(topo, group, port, dp_local, k * dp_local, nodes_per_replica, rpc_port, kv_role,
                                   run_dir, role)
                servers.append(Server(role=role, replica=replica, group=g.index, node=first_node + k, task=task,
                                      gpus=gpus, port=port, rpc_port=rpc_port, side_channel_port=side, head=head,
                                      address_from_head=nodes_per_replica > 1, model=served.model,
                                      served_name=served.name, adapters=served.adapters, args=args))
                task += 1
        layout.launches.append(Launch(name=role, group=g.index, nodes=group.nodes, ntasks_per_node=per_node,
                                 cpus_per_task=cpus, gpus_per_node=gpn, overlap=False, start_after=(),
                                 health="http", script=f"scripts/{role}.sh",
                                 env=merged_env(common_env, group.env, {"PRL_ROLE": role})))
        roles.append(InferenceRole(name=role, group=g.index, nodes=group.nodes, tp=group.tp, dp=group.dp,
                                   expert_parallel=group.expert_parallel, replicas=replicas,
                                   nodes_per_replica=nodes_per_replica, servers_per_node=per_node, kv_role=kv_role,
                                   lone_args=lone_server_args(served, group)))
        if group.expert_parallel and group.tp * group.dp == 1:
            check.warnings.append(f"{role}: expert_parallel with tp*dp = 1 has nothing to spread experts over")
    return roles, servers


def place_router(check: Checker, topo: Topology, layout: Layout, common_env: dict[str, str]) -> Optional[int]:
    """The P/D router on the first prefill node, started after every prefill and decode server."""
    if not topo.inference.disaggregated:
        return None
    port = topo.inference.router.port or check.cluster.port_base + ROUTER_PORT_OFFSET
    cpus = min(ROUTER_CPUS, check.cluster.gpu_node.cpus)  # srun refuses a step asking more cores than the node has
    layout.launches.append(Launch(name=Role.ROUTER, group=0, nodes=1, ntasks_per_node=1, cpus_per_task=cpus,
                             gpus_per_node=0, overlap=True, start_after=KV_ROLES, health="http",
                             script="scripts/router.sh", env=merged_env(common_env, {"PRL_ROLE": Role.ROUTER})))
    if check.cluster.gpu_node.gpus and topo.inference.kv_connector.name == "ExampleConnector":
        check.warnings.append("kv_connector ExampleConnector moves KV through shared storage: a CPU test "
                              "connector, slow on GPU clusters (use NixlConnector)")
    return port


def check_kv_offload(check: Checker, topo: Topology, roles: list[InferenceRole]) -> None:
    off = topo.inference.kv_offload
    if off.backend == "none":
        return
    cluster = check.cluster
    if cluster.gpu_node.gpus == 0:
        check.warnings.append("kv_offload: vLLM's CPU backend refuses KV offload; only the rendering can be tested")
    per_node = max(r.servers_per_node for r in roles)
    need = off.cpu_gb * per_node
    have = cluster.gpu_node.memory_gb * KV_OFFLOAD_MEMORY_FRACTION
    if need > have:
        raise check.fail((Role.INFERENCE, "kv_offload", "cpu_gb"), (
            f"KV offload needs cpu_gb({off.cpu_gb:g}) * {per_node} servers per node = {need:g} GiB, "
            f"over {KV_OFFLOAD_MEMORY_FRACTION:.0%} of a node's {cluster.gpu_node.memory_gb:g} GiB on cluster "
            f"'{cluster.name}'; use cpu_gb <= {have / per_node:g}"))


def place_orchestrator(check: Checker, topo: Topology, layout: Layout, common_env: dict[str, str],
                       after: tuple[str, ...]) -> OrchestratorPlan:
    """A CPU node of its own, or a few cores on the first node of the trainer or of inference."""
    orch = topo.orchestrator
    cluster = check.cluster
    env = merged_env(common_env, orch.env, {"PRL_ROLE": Role.ORCHESTRATOR})
    if orch.placement == "own":
        node = cluster.orchestrator_node
        cpus = orch.cpus or node.cpus
        if cpus > node.cpus:
            raise check.fail((Role.ORCHESTRATOR, "cpus"), (
                f"orchestrator asks for {cpus} CPUs but a node of its partition has {node.cpus}"))
        group = layout.add_group(cluster, Role.ORCHESTRATOR, cluster.partitions.orchestrator, 1, 1, cpus, 0).index
    else:
        # The trainer's group comes right after the inference groups when the orchestrator has none.
        group = len(layout.groups) if orch.placement == Role.TRAINER else 0
        cpus = orch.cpus or min(SHARED_ORCHESTRATOR_CPUS, cluster.gpu_node.cpus)
        if cpus > cluster.gpu_node.cpus:
            raise check.fail((Role.ORCHESTRATOR, "cpus"), (
                f"orchestrator asks for {cpus} CPUs on a {orch.placement} node, which has {cluster.gpu_node.cpus} "
                f"on cluster '{cluster.name}'"))
    layout.launches.append(Launch(name=Role.ORCHESTRATOR, group=group, nodes=1, ntasks_per_node=1, cpus_per_task=cpus,
                             gpus_per_node=0, overlap=orch.placement != "own", start_after=after,
                             waits_itself=True, health="heartbeat", script="scripts/orchestrator.sh", env=env))
    if orch.env_workers + 1 > cpus:
        check.warnings.append(
            f"orchestrator.env_workers ({orch.env_workers}) and the orchestrator itself want {orch.env_workers + 1} "
            f"cores but orchestrator.cpus is {cpus}: the workers will share them")
    return OrchestratorPlan(placement=orch.placement, group=group, cpus=cpus, env_workers=orch.env_workers)


def trainer_mesh(check: Checker, topo: Topology) -> tuple[int, int, Mesh]:
    """(nodes, ranks per node, mesh) of the trainer, checked."""
    tr = topo.trainer
    gpn = check.cluster.gpu_node.gpus
    procs = tr.gpus_per_node or (gpn or 1)
    if gpn and procs > gpn:
        raise check.fail((Role.TRAINER, "gpus_per_node"), (
            f"trainer.gpus_per_node({procs}) is more than the {gpn} GPUs of a node on cluster '{check.cluster.name}'"))
    cpus = check.cluster.gpu_node.cpus
    if not gpn and procs > cpus:
        raise check.fail((Role.TRAINER, "gpus_per_node"), (
            f"trainer.gpus_per_node({procs}) ranks per node on CPU cluster '{check.cluster.name}' over-commit its "
            f"{cpus} CPUs; use gpus_per_node <= {cpus}"))
    world = tr.nodes * procs
    where = f"{tr.nodes} nodes x {procs} {'GPUs' if gpn else 'ranks'} on cluster '{check.cluster.name}'"
    try:
        return tr.nodes, procs, derive_mesh(world, tr.dp_replicate, tr.dp_shard, tr.cp, tr.ep, where,
                                            unit='GPUs' if gpn else 'ranks')
    except MeshError as exc:
        raise check.fail((Role.TRAINER, exc.field), str(exc)) from None


def check_weights(check: Checker, topo: Topology) -> weights.Transport:
    """The run's weight transport (prl/weights), and what it cannot carry refused at its line."""
    if topo.weights.transport not in weights.names():
        raise check.fail(("weights", "transport"), f"no weight transport {topo.weights.transport!r}: use one of "
                                                   f"{', '.join(weights.names())} (docs/weights.md)")
    transport = weights.get(topo.weights.transport)
    for field in ("backend", "group_timeout_s"):
        if getattr(topo.weights, field) != getattr(Weights(), field) and not transport.groups:
            raise check.fail(("weights", field), f"weights.{field} is a setting of the broadcast groups, and "
                                                 f"weights.transport {transport.name} sends none: remove weights."
                                                 f"{field}, or use a transport that broadcasts "
                                                 f"({', '.join(n for n in weights.names() if weights.get(n).groups)})")
    transport.check(topo, check.fail, gpus=roles_on_gpus(check.cluster))
    return transport


def roles_on_gpus(cluster: ClusterProfile) -> bool:
    """The roles run on GPUs: the nodes have some, and the profile does not run them on the CPU (`PRL_DEVICE: cpu`,
    the lab cluster's count-only GPUs)."""
    return bool(cluster.gpu_node.gpus) and cluster.env.get("PRL_DEVICE") != "cpu"


def place_trainer(check: Checker, topo: Topology, layout: Layout, common_env: dict[str, str],
                  orchestrator: Optional[OrchestratorPlan], transport: weights.Transport) -> TrainerPlan:
    """The trainer's group and step. It starts with the first roles, not after the servers: it waits for rollouts
    itself (heartbeating), so its model load overlaps the servers' start-up instead of following it."""
    tr = topo.trainer
    cluster = check.cluster
    nodes, procs, mesh = trainer_mesh(check, topo)
    gpus = procs if cluster.gpu_node.gpus else 0
    group = layout.add_group(cluster, Role.TRAINER, cluster.partitions.trainer, nodes, 1, cluster.gpu_node.cpus, gpus)
    layout.launches.append(Launch(name=Role.TRAINER, group=group.index, nodes=nodes, ntasks_per_node=1,
                             cpus_per_task=cluster.gpu_node.cpus, gpus_per_node=gpus,
                             overlap=orchestrator is not None and orchestrator.placement == Role.TRAINER,
                             start_after=(), health="heartbeat", script="scripts/trainer.sh",
                             env=merged_env(common_env, tr.env, {"PRL_ROLE": Role.TRAINER})))
    return TrainerPlan(group=group.index, nodes=nodes, gpus_per_node=procs, world_size=mesh.world_size,
                       device="cuda" if cluster.gpu_node.gpus else "cpu", mesh=mesh,
                       master_port=cluster.port_base + RDZV_PORT_OFFSET,
                       weight_ports=weight_ports(cluster, nodes, procs) if transport.feeds else (),
                       weight_backend=transport.group_backend(topo.weights, roles_on_gpus(cluster)),
                       activation_checkpointing=tr.activation_checkpointing, precision=tr.precision,
                       compile=tr.compile)


def weight_ports(cluster, nodes: int, procs: int) -> tuple[int, ...]:
    """Each trainer rank's port for a transport that sends from memory, by global rank: ranks of one node differ;
    on a shared host all do."""
    base = cluster.port_base + WEIGHT_PORT_OFFSET
    return tuple(base + (rank if shared_host(cluster) else rank % procs) for rank in range(nodes * procs))


def check_trainer_can_run(check: Checker, topo: Topology, model_config: Optional[ModelConfig], mesh: Mesh) -> None:
    """Refuse, before any allocation, what the trainer cannot execute on this model (prl/planner/capabilities.py)."""
    refusals = trainer_refusals(model_config, mesh.dp_replicate, mesh.dp_shard, mesh.cp, mesh.ep)
    if topo.model.lora is not None:
        refusals += lora_refusals(model_config, topo.model.lora.rank, topo.model.lora.target_modules,
                                  served_on_cpu=topo.sft is None and not check.cluster.gpu_node.gpus)
    refusals += vision_refusals(model_config, mesh.cp, topo.model.train_vision, topo.model.lora is not None)
    refusals += aux_loss_refusals(model_config, topo.training.router_aux_loss_coef)
    gpus, fp8_gpus = bool(check.cluster.gpu_node.gpus), check.cluster.gpu_node.fp8
    if topo.trainer.compile:
        refusals += compile_refusals(model_config, gpus, mesh.cp, mesh.ep, topo.model.lora is not None)
    if topo.trainer.precision == "fp8":
        refusals += precision_refusals(model_config, gpus, fp8_gpus, topo.model.lora is not None)
    if refusals:
        field, message = refusals[0]
        raise check.fail(field, message)


def check_serving(check: Checker, topo: Topology, model_config: Optional[ModelConfig]) -> None:
    """What the policy servers of an RL job must do with this model: load every update, and
    `inference.quantization` where they can (prl/planner/capabilities.py)."""
    if topo.inference is None:
        return
    check.warnings.extend(update_warnings(model_config))
    node = check.cluster.gpu_node
    refusals = quantization_refusals(model_config, bool(node.gpus), node.fp8) if topo.inference.quantization else []
    if topo.training is not None and topo.training.router_replay:
        inf = topo.inference
        refusals += replay_refusals(
            model_config, disaggregated=inf.disaggregated, kv_offload=inf.kv_offload.backend != "none",
            compile=topo.trainer.compile, data_parallel=any(g.dp > 1 for g in inf.groups().values()),
            prefix_cache=any(a.partition("=")[0] == "--enable-prefix-caching"
                             for g in inf.groups().values() for a in g.extra_args))
    if refusals:
        raise check.fail(*refusals[0])


def check_single_allocation(check: Checker, layout: Layout) -> None:
    cluster = check.cluster
    if cluster.hetjob or not cluster.slurm:
        return
    used = {g.partition for g in layout.groups}
    if len(used) > 1:
        raise check.fail_cluster(("hetjob",), (
            f"cluster '{cluster.name}' allows no hetjobs, so all roles share one allocation, but the roles use "
            f"partitions {sorted(p or '(default)' for p in used)}; use one partition or allow hetjobs"))


def check_training(check: Checker, topo: Topology, mesh: Mesh) -> None:
    t = topo.training
    if topo.sft is not None and t.router_replay:
        raise check.fail(("training", "router_replay"), (
            "router_replay replays the routes inference servers chose for rollouts, and an SFT job (sft:) has no "
            "rollouts; set router_replay: false"))
    if topo.sft is not None:
        if t.batch_size < mesh.dp:
            raise check.fail(("training", "batch_size"), (
                f"batch_size({t.batch_size}) conversations per step give some of the trainer's {mesh.dp} "
                f"data-parallel ranks (dp_replicate({mesh.dp_replicate}) * dp_shard({mesh.dp_shard})) no sample; "
                f"use at least {mesh.dp}"))
        return
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
    every = topo.environment.eval.every
    if every > t.max_steps:
        raise check.fail(("environment", "eval", "every"), (
            f"eval.every({every}) is past training.max_steps({t.max_steps}): the run would never evaluate; use "
            f"every <= {t.max_steps}, or 0 for no evaluation"))
    if t.loss.kind == "gspo" and mesh.cp > 1:
        raise check.fail(("training", "loss", "kind"), (
            f"kind gspo takes one ratio per sample, but trainer.cp({mesh.cp}) splits samples over ranks; "
            f"use cp: 1 or another loss kind"))
    check_advantage(check, t)


def check_advantage(check: Checker, t: Training) -> None:
    """Advantage settings that cannot do what they say with this batch shape."""
    a = t.advantage
    if a.baseline == "leave_one_out" and t.rollouts_per_example < 2:
        raise check.fail(("training", "advantage", "baseline"), (
            f"leave_one_out compares each rollout with the others of its group, but rollouts_per_example"
            f"({t.rollouts_per_example}) leaves none; use at least 2"))
    if a.dynamic_sampling and t.rollouts_per_example < 2:
        raise check.fail(("training", "advantage", "dynamic_sampling"), (
            f"dynamic sampling replaces groups whose rollouts all scored the same, and with rollouts_per_example"
            f"({t.rollouts_per_example}) every group does; use at least 2 rollouts per example"))
    if a.overlong_buffer >= t.max_tokens:
        raise check.fail(("training", "advantage", "overlong_buffer"), (
            f"overlong_buffer({a.overlong_buffer}) must be below max_tokens({t.max_tokens}): the punishment "
            f"ramps up over the last overlong_buffer tokens"))
    if not a.overlong_buffer and check.topo.given(("training", "advantage", "overlong_penalty")):
        raise check.fail(("training", "advantage", "overlong_penalty"), (
            f"overlong_penalty({a.overlong_penalty:g}) is the most reward the soft overlong punishment takes, and "
            f"it is off without overlong_buffer (the tokens before max_tokens it ramps up over): set "
            f"overlong_buffer, e.g. {max(1, t.max_tokens // 4)}, or remove overlong_penalty"))


SCORED_LOSSES = {"distill_coef": Role.TEACHER, "kl_ref_coef": Role.REFERENCE}
"""Loss settings that need a scoring section: a setting above 0 without its section is refused at its line."""


def check_scorers(check: Checker, topo: Topology) -> None:
    """A loss that reads a teacher's or reference's logprobs has its servers, which can score whole sequences."""
    loss = topo.training.loss
    for setting, role in SCORED_LOSSES.items():
        if getattr(loss, setting) > 0 and role not in topo.scorers():
            raise check.fail(("training", "loss", setting), (
                f"{setting}({getattr(loss, setting):g}) needs the {role}'s logprobs of the sampled tokens, but the "
                f"topology has no {role}: section; add one (its model and nodes) or set {setting}: 0"))
    for role, scorer in topo.scorers().items():
        if scorer.max_model_len is not None and scorer.max_model_len <= topo.model.max_model_len:
            raise check.fail((role, "max_model_len"), (
                f"{role}.max_model_len({scorer.max_model_len}) must exceed the student's model.max_model_len"
                f"({topo.model.max_model_len}): it scores whole student sequences and vLLM completes at least one "
                f"token after them; use {topo.model.max_model_len + 1} or more"))
        setting = next(k for k, v in SCORED_LOSSES.items() if v == role)
        if getattr(loss, setting) == 0 and loss.import_path is None:
            check.warnings.append(f"{role}: its servers score every rollout but training.loss.{setting} is 0 and no "
                                  f"loss of your own reads them")


def check_ports(check: Checker, topo: Topology, servers: list[Server], router_port: Optional[int],
                trainer: Optional[TrainerPlan]) -> None:
    """Every port a process listens on is <= 65535 and used once per node (once per host, locally)."""
    cluster = check.cluster
    taken: dict[tuple[Any, int], str] = {}

    def claim(node: Any, port: Optional[int], what: str, field: tuple[Any, ...], in_topology: bool) -> None:
        if port is None:
            return
        fail = check.fail if in_topology else check.fail_cluster
        if port > MAX_PORT:
            raise fail(field, f"{what} would listen on port {port}, above {MAX_PORT}; lower the cluster's "
                              f"port_base({cluster.port_base}) or the port")
        key = ("localhost" if shared_host(cluster) else node, port)
        if key in taken:
            raise fail(field, f"port {port} is used twice on one node: by {taken[key]} and by {what}")
        taken[key] = what

    replicas: dict[tuple[str, int], list[Server]] = {}
    dps = {role: group.dp for role, group in server_groups(topo).items()}
    for s in servers:
        replicas.setdefault((s.role, s.replica), []).append(s)
    for s in servers:
        claim((s.group, s.node), s.port, f"{s.role} server {s.replica}", ("port_base",), False)
        if s.head:
            claim((s.group, s.node), s.rpc_port, f"{s.role} server {s.replica}'s data-parallel RPC", ("port_base",),
                  False)
        for side in side_channel_ports(replicas[s.role, s.replica], s, dps[s.role]):
            claim((s.group, s.node), side, f"{s.role} server {s.replica}'s NIXL side channel", ("port_base",), False)
    if router_port is not None:
        # Last: when the user's router port collides, the error points at it.
        claim((0, 0), router_port, "the router", (Role.INFERENCE, Role.ROUTER, "port"), topo.inference.router.port is not None)
    if trainer is None:
        return
    claim((trainer.group, 0), trainer.master_port, "the trainer rendezvous", ("port_base",), False)
    for rank, port in enumerate(trainer.weight_ports):
        claim((trainer.group, rank // trainer.gpus_per_node), port,
              f"trainer rank {rank}'s {topo.weights.transport} weights port", ("port_base",), False)


def job_directives(check: Checker, topo: Topology, run_dir: str) -> tuple[list[str], list[str]]:
    """(`#SBATCH` options of the whole job, options every het component needs for itself)."""
    cluster = check.cluster
    time_limit = topo.slurm.time or cluster.default_time
    batch = [f"--job-name={topo.slurm.job_name or topo.name}", f"--output={RunDir(run_dir).batch_log_pattern}",
             "--open-mode=append"]
    if cluster.requeue.signal_seconds:
        # B: signals the batch shell only; USR1 is avoided because NCCL installs a handler for it.
        batch.append(f"--signal=B:TERM@{cluster.requeue.signal_seconds}")
    batch.append("--requeue" if cluster.requeue.enabled else "--no-requeue")
    common: list[str] = []
    if time_limit:
        common.append(f"--time={time_limit}")
        minutes = parse_minutes(time_limit)
        if cluster.requeue.signal_seconds and minutes * 60 <= cluster.requeue.signal_seconds:
            check.warnings.append(f"time {time_limit} is shorter than the checkpoint signal lead "
                                  f"({cluster.requeue.signal_seconds} s): the signal comes at the start")
    elif cluster.slurm:
        check.warnings.append("no time limit (slurm.time or the profile's default_time): the partition default applies")
    for flag, value in (("account", topo.slurm.account or cluster.account), ("qos", topo.slurm.qos or cluster.qos),
                        ("reservation", topo.slurm.reservation)):
        if value:
            common.append(f"--{flag}={value}")
    return batch, common + list(topo.slurm.extra_directives)


def check_extra_directives(check: Checker, topo: Topology, rendered: list[str]) -> None:
    """An `extra_directives` item may not name an option the plan renders (`rendered`) or one that changes the
    job's layout: Slurm would take one of the two, and the plan would no longer describe the job."""
    planned = LAYOUT_DIRECTIVES | {item.partition("=")[0] for item in rendered}
    for index, item in enumerate(topo.slurm.extra_directives):
        if item.partition("=")[0] in planned:
            raise check.fail(("slurm", "extra_directives", index), (
                f"{item.partition('=')[0]} is set by the plan (from the topology and the cluster profile); set it "
                f"there instead of in extra_directives"))


def check_segment(check: Checker, groups: list[Group]) -> None:
    """Slurm refuses a `--segment` that does not divide the node count it is given with (each het component, or
    the one allocation): an allocation larger than a segment must be a multiple of it. A smaller one fits in one
    block and is asked for without `--segment`."""
    segment = check.cluster.segment
    for g in groups if segment else ():
        nodes = next((int(d.partition("=")[2]) for d in g.directives if d.startswith("--nodes=")), None)
        if nodes is not None and nodes > segment and nodes % segment:
            raise check.fail_cluster(("segment",), (
                f"segment({segment}) must divide the node count of an allocation larger than it, but {g.name} "
                f"asks for {nodes} nodes; use {nodes // segment * segment} or {(nodes // segment + 1) * segment} "
                f"nodes, or a segment that divides {nodes}"))


def finish_groups(check: Checker, layout: Layout, common: list[str], orchestrator: Optional[OrchestratorPlan],
                  hetjob: bool) -> list[Group]:
    """Hetjob: every component gets the common options. Otherwise one allocation of whole nodes of one kind."""
    cluster = check.cluster
    groups = layout.groups
    if hetjob:
        return [msgspec.structs.replace(g, directives=g.directives + tuple(common)) for g in groups]
    gpus = max(g.gpus_per_node for g in groups)
    ntasks = max(g.ntasks_per_node for g in groups)
    total = sum(g.nodes for g in groups)
    single = group_directives(cluster, groups[0].partition, total, ntasks, max(1, cluster.gpu_node.cpus // ntasks),
                              gpus) + tuple(common)
    if orchestrator is not None and orchestrator.placement == "own" and gpus:
        check.warnings.append("without hetjobs the orchestrator's node is a GPU node too: its GPUs stay idle")
    return [msgspec.structs.replace(g, directives=single if g.index == 0 else ()) for g in groups]


def place_launches(cluster: ClusterProfile, hetjob: bool, steps: list[Launch], groups: list[Group], run_dir: str
                ) -> list[Launch]:
    """Each step's srun placement (Slurm clusters only)."""
    if not cluster.slurm:
        return steps
    container = container_args(cluster, run_dir)
    return [msgspec.structs.replace(s, srun_args=srun_args(s, groups[s.group], cluster, hetjob, container))
            for s in steps]


def setup_lines(cluster: ClusterProfile) -> tuple[str, ...]:
    lines = [f"module load {shlex.quote(m)}" for m in cluster.modules]
    if cluster.venv:
        lines.append(f"source {shlex.quote(cluster.venv + '/bin/activate')}")
    return tuple(lines + list(cluster.setup))


def container_plan(cluster: ClusterProfile, run_dir: str) -> Optional[ContainerPlan]:
    c = cluster.container
    if c is None:
        return None
    return ContainerPlan(image=c.image, mounts=tuple(c.mounts) + (f"{run_dir}:{run_dir}",), workdir=c.workdir)


def check_shared_root(check: Checker, run_dir: str) -> None:
    shared_root = check.cluster.shared_root.rstrip("/") + "/"
    if not (run_dir.rstrip("/") + "/").startswith(shared_root):
        check.warnings.append(f"run_dir {run_dir} is outside the cluster's shared_root {check.cluster.shared_root}: "
                              f"every node must see it")


# ----------------------------------------------------------------------------- make_plan


def make_plan(topo: Topology, topo_source: Source, cluster: ClusterProfile, cluster_source: Source,
              run_dir: str, model_config: Optional[ModelConfig] = None) -> Plan:
    """Place every role of `topo` on `cluster`; `run_dir` is the resolved absolute run directory.

    `model_config` is the model's config.json when the planner can read it (model-dependent checks).
    """
    check = Checker(topo_source, cluster, cluster_source)
    check_run_dir(check, run_dir)
    check_node_budget(check, topo)
    check_derived_totals(check, topo)
    transport = check_weights(check, topo)
    if topo.pool is not None:
        return make_pool_plan(check, topo, run_dir, model_config)
    common_env = role_env(cluster, run_dir)
    layout = Layout()
    roles, servers, router_port, orchestrator = place_rl_roles(check, topo, layout, common_env, run_dir)
    trainer = place_trainer(check, topo, layout, common_env, orchestrator, transport)
    check_trainer_can_run(check, topo, model_config, trainer.mesh)
    check_serving(check, topo, model_config)
    check_single_allocation(check, layout)
    check_training(check, topo, trainer.mesh)
    check_scorers(check, topo)
    check_failure_policies(check, topo)
    check_ports(check, topo, servers, router_port, trainer)
    # One group (an SFT job) is a plain job: srun refuses --het-group outside a heterogeneous one.
    hetjob = cluster.hetjob and len(layout.groups) > 1
    batch, groups = job_groups(check, topo, layout, run_dir, orchestrator, hetjob)
    check_segment(check, groups)
    return Plan(
        name=topo.name, job_name=topo.slurm.job_name or topo.name, cluster=cluster.name, slurm=cluster.slurm,
        hetjob=hetjob, run_dir=run_dir, python=cluster.python,
        served_model_name=topo.name, network_interface=cluster.network.interface,
        groups=tuple(groups), inference=tuple(roles), servers=tuple(servers), router_port=router_port,
        trainer=trainer, orchestrator=orchestrator,
        launches=tuple(place_launches(cluster, hetjob, layout.launches, groups, run_dir)),
        batch_directives=tuple(batch), setup=setup_lines(cluster), container=container_plan(cluster, run_dir),
        settings_json=msgspec.Raw(RunSettings.of(topo).to_json()),
        grace_seconds=cluster.requeue.grace_seconds, requeue=cluster.requeue.enabled,
        totals=totals(groups, servers, roles, trainer), warnings=tuple(check.warnings),
        on_failure=failure_policies(topo, layout.launches), hang_timeout_s=topo.training.hang_timeout_s,
        attach=topo.inference.attach if topo.inference is not None else None,
    )


def job_groups(check: Checker, topo: Topology, layout: Layout, run_dir: str,
               orchestrator: Optional[OrchestratorPlan], hetjob: bool) -> tuple[list[str], list[Group]]:
    """The job's `#SBATCH` options and its groups with theirs, checked (shared root, the user's directives)."""
    check_shared_root(check, run_dir)
    batch, common = job_directives(check, topo, run_dir)
    check_extra_directives(check, topo, batch + common[:len(common) - len(topo.slurm.extra_directives)]
                           + [d for g in layout.groups for d in g.directives])
    return batch, finish_groups(check, layout, common, orchestrator, hetjob)


def make_pool_plan(check: Checker, topo: Topology, run_dir: str, model_config: Optional[ModelConfig]) -> Plan:
    """An inference pool (`pool:`): its servers alone, one group, serving until stopped (`make_plan`'s checks
    that concern servers; there is no trainer, orchestrator or training)."""
    cluster = check.cluster
    layout = Layout()
    roles, servers = place_inference(check, topo, layout, role_env(cluster, run_dir), run_dir)
    check.warnings.extend(update_warnings(model_config))
    if model_config is not None and model_config.architecture in VLLM_NO_LORA_ARCHITECTURES:
        raise check.fail(("pool",), f"vLLM cannot serve {model_config.architecture} with LoRA adapters (its model "
                                    f"class has no LoRA support): it cannot be an inference pool's model")
    if not cluster.gpu_node.gpus and (why := cpu_lora_refusal(model_config)):
        raise check.fail(("pool",), f"{why}: it cannot be an inference pool's model on CPU cluster '{cluster.name}'")
    check_single_allocation(check, layout)
    check_failure_policies(check, topo)
    check_ports(check, topo, servers, None, None)
    batch, groups = job_groups(check, topo, layout, run_dir, None, False)
    pool = topo.pool
    return Plan(
        name=topo.name, job_name=topo.slurm.job_name or topo.name, cluster=cluster.name, slurm=cluster.slurm,
        hetjob=False, run_dir=run_dir, python=cluster.python, served_model_name=topo.name,
        network_interface=cluster.network.interface, groups=tuple(groups), inference=tuple(roles),
        servers=tuple(servers), router_port=None, trainer=None, orchestrator=None,
        launches=tuple(place_launches(cluster, False, layout.launches, groups, run_dir)),
        batch_directives=tuple(batch), setup=setup_lines(cluster), container=container_plan(cluster, run_dir),
        settings_json=msgspec.Raw(RunSettings.of(topo).to_json()),
        grace_seconds=cluster.requeue.grace_seconds, requeue=cluster.requeue.enabled,
        totals=totals(groups, servers, roles, None), warnings=tuple(check.warnings),
        on_failure=failure_policies(topo, layout.launches),
        pool=PoolPlan(model=topo.model.path, max_loras=pool.max_loras, max_lora_rank=pool.max_lora_rank),
    )


def place_rl_roles(check: Checker, topo: Topology, layout: Layout, common_env: dict[str, str], run_dir: str
                   ) -> tuple[list[InferenceRole], list[Server], Optional[int], Optional[OrchestratorPlan]]:
    """Inference servers, the P/D router and the orchestrator of an RL job; an SFT job has none of them."""
    if topo.inference is None:
        return [], [], None, None
    roles, servers = place_inference(check, topo, layout, common_env, run_dir)
    router_port = place_router(check, topo, layout, common_env)
    check_kv_offload(check, topo, roles)
    orchestrator = place_orchestrator(check, topo, layout, common_env, tuple(s.name for s in layout.launches))
    return roles, servers, router_port, orchestrator


def check_failure_policies(check: Checker, topo: Topology) -> None:
    """`on_failure.policy: fail` ends the job at a server's first failure: a `max_restarts` written beside it
    would never be used, so the two contradict each other (and the policy would silently win)."""
    owners = {Role.INFERENCE: topo.inference, **topo.scorers()} if topo.inference is not None else {}
    for owner, group in owners.items():
        field = (owner, "on_failure", "max_restarts")
        if group.on_failure.policy == "fail" and group.on_failure.max_restarts and check.topo.given(field):
            raise check.fail(field, (
                f"{owner}.on_failure: policy fail ends the job at a server's first failure, so max_restarts"
                f"({group.on_failure.max_restarts}) would never be used: use policy: restart to restart a server "
                f"up to {group.on_failure.max_restarts} times, or remove max_restarts"))


def failure_policies(topo: Topology, steps: list[Launch]) -> tuple[FailurePolicy, ...]:
    """Each role's `on_failure`: the inference one for every server role; the router and the rest fail."""
    out = []
    for step in steps:
        if step.name in topo.scorers():
            p = topo.scorers()[step.name].on_failure
            out.append(FailurePolicy(role=step.name, policy=p.policy, max_restarts=p.max_restarts))
        elif step.name in WEIGHT_ROLES and topo.inference is not None:
            p = topo.inference.on_failure
            out.append(FailurePolicy(role=step.name, policy=p.policy, max_restarts=p.max_restarts))
        else:
            out.append(FailurePolicy(role=step.name, policy="fail", max_restarts=0))
    return tuple(out)


# ----------------------------------------------------------------------------- small pieces


def server_groups(topo: Topology) -> dict[str, InferenceGroup]:
    """Every vLLM server group by role, in het-group order: inference (or prefill, decode), then the scorers."""
    return {**(topo.inference.groups() if topo.inference else {}), **topo.scorers()}


def group_field(topo: Topology, role: str) -> tuple[str, ...]:
    """Where a server group's fields are written: `inference`, `inference.prefill`, `teacher`, ..."""
    if role in topo.scorers():
        return (role,)
    return (Role.INFERENCE, role) if topo.inference.disaggregated else (Role.INFERENCE,)


def role_env(cluster: ClusterProfile, run_dir: str) -> dict[str, str]:
    env = {**cluster.env, **cluster.network.env, "PRL_RUN_DIR": run_dir}
    if cluster.network.interface:
        env.setdefault("NCCL_SOCKET_IFNAME", cluster.network.interface)
        env.setdefault("GLOO_SOCKET_IFNAME", cluster.network.interface)
    return env


def shared_host(cluster: ClusterProfile) -> bool:
    """Every node of a job is one host (local runs, a test cluster): ports must differ job-wide, not per node."""
    return not cluster.slurm or cluster.single_host


def merged_env(*parts: dict[str, str]) -> tuple[tuple[str, str], ...]:
    merged: dict[str, str] = {}
    for part in parts:
        merged.update(part)
    return tuple(sorted(merged.items()))


def totals(groups: list[Group], servers: list[Server], roles: list[InferenceRole], trainer: Optional[TrainerPlan]
           ) -> Totals:
    inference_groups = {r.group for r in roles}
    return Totals(nodes=sum(g.nodes for g in groups), gpus=sum(g.nodes * g.gpus_per_node for g in groups),
                  inference_servers=sum(1 for s in servers if s.head),
                  inference_gpus=sum(g.nodes * g.gpus_per_node for g in groups if g.index in inference_groups),
                  trainer_world_size=trainer.world_size if trainer is not None else 0)


def gpu_directive(cluster: ClusterProfile, gpus: int) -> tuple[str, ...]:
    if gpus == 0 or cluster.gpu_directive == "none":
        return ()
    if cluster.gpu_directive == "gres":
        return (f"--gres={cluster.gres_name}:{gpus}",)
    return (f"--gpus-per-node={gpus}",)


def group_directives(cluster: ClusterProfile, partition: Optional[str], nodes: int, ntasks: int, cpus: int,
                     gpus: int) -> tuple[str, ...]:
    out = [f"--partition={partition}"] if partition else []
    out += [f"--nodes={nodes}", f"--ntasks-per-node={ntasks}", f"--cpus-per-task={cpus}"]
    out += gpu_directive(cluster, gpus)
    if cluster.exclusive:
        out += ["--exclusive", "--mem=0"]
    if cluster.constraint:
        out.append(f"--constraint={cluster.constraint}")
    if cluster.segment and nodes % cluster.segment == 0:
        # Slurm refuses a segment that does not divide the node count; fewer nodes fit in one block anyway.
        out.append(f"--segment={cluster.segment}")
    return tuple(out)


def parse_minutes(value: str) -> float:
    """Slurm time string -> minutes (MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]])."""
    if "-" in value:
        head, value = value.split("-", 1)
        parts = [int(p) for p in value.split(":")] + [0, 0]
        return int(head) * 1440 + parts[0] * 60 + parts[1] + parts[2] / 60
    parts = [int(p) for p in value.split(":")]
    if len(parts) == 1:
        return float(parts[0])
    if len(parts) == 2:
        return parts[0] + parts[1] / 60
    return parts[0] * 60 + parts[1] + parts[2] / 60


def container_args(cluster: ClusterProfile, run_dir: str) -> tuple[str, ...]:
    c = container_plan(cluster, run_dir)
    return c.srun_args() if c is not None else ()


def srun_args(step: Launch, group: Group, cluster: ClusterProfile, hetjob: bool, container: tuple[str, ...]
              ) -> tuple[str, ...]:
    """Where one step runs: its het group (or node range) and its tasks. Passed to srun as argv, never a shell."""
    args = [f"--het-group={step.group}"] if hetjob else [f"--relative={group.node_offset}"]
    args += [f"--nodes={step.nodes}", f"--ntasks-per-node={step.ntasks_per_node}",
             f"--cpus-per-task={step.cpus_per_task}", f"--job-name={step.name}", "--kill-on-bad-exit=1"]
    args += gpu_directive(cluster, step.gpus_per_node)
    if step.overlap:
        # --mem=0: the node's whole job memory, shared. Without it the step asks for its CPUs' share
        # (DefMemPerCPU), which the node's first step already holds: "Memory required by task is not available".
        args += ["--overlap", "--mem=0"]
    return tuple(args) + container
