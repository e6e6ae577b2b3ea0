"""Each named step of `make_plan`, on its own (tests/test_topology.py covers whole topologies)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from prl.config.cluster import ClusterProfile
from prl.config.loader import Source
from prl.config.topology import Topology
from prl.errors import PlanError
from prl.planner import plan as P
from prl.planner.model import Mesh, MeshError, Plan, derive_mesh

TOPO: dict[str, Any] = {
    "name": "t", "cluster": "c", "model": {"path": "/m"},
    "inference": {"nodes": 2, "tp": 2, "dp": 2},
    "trainer": {"nodes": 2}, "environment": {"id": "e"},
    "training": {"batch_size": 64, "rollouts_per_example": 8, "max_steps": 3, "max_tokens": 512},
}
CLUSTER: dict[str, Any] = {
    "name": "c", "gpu_node": {"gpus": 8, "cpus": 64, "memory_gb": 1000}, "shared_root": "/shared",
    "max_nodes": 16, "port_base": 8000, "partitions": {"inference": "gpu", "trainer": "gpu", "orchestrator": "cpu"},
    "cpu_node": {"gpus": 0, "cpus": 32, "memory_gb": 256},
}


def as_topology(data: dict) -> Topology:
    return msgspec.convert(data, Topology, strict=True)


def as_profile(data: dict) -> ClusterProfile:
    return msgspec.convert(data, ClusterProfile, strict=True)


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def topo(**update: Any) -> Topology:
    return as_topology(_merge(TOPO, update))


def topo_pd(**router: Any) -> Topology:
    """Prefill/decode: one node each (the unified fields must go)."""
    data = {**TOPO, "inference": {"prefill": {"nodes": 1}, "decode": {"nodes": 1}, "router": router}}
    return as_topology(data)


def checker(**cluster_update: Any) -> P.Checker:
    cluster = as_profile(_merge(CLUSTER, cluster_update))
    return P.Checker(Source(Path("topo.yaml"), {}, {}), cluster, Source(Path("prof.yaml"), {}, {}))


def plan(t: Topology | None = None, **cluster_update: Any) -> Plan:
    c = checker(**cluster_update)
    return P.make_plan(t or topo(), c.topo, c.cluster, c.cluster_source, "/shared/runs/t")


# ------------------------------------------------------------------ run dir and node budget

@pytest.mark.parametrize("bad", ["relative/dir", "/with space", "/a;b", "/$HOME/x", "/"])
def test_check_run_dir_refuses(bad):
    with pytest.raises(PlanError, match=r"topo.yaml \(run_dir\)"):
        P.check_run_dir(checker(), bad)


def test_check_run_dir_accepts_a_plain_absolute_path():
    P.check_run_dir(checker(), "/shared/runs/t")


def test_node_budget_fails_before_any_server_is_expanded():
    # 10**6 nodes would take minutes to expand server by server; the budget check names the sum first.
    with pytest.raises(PlanError, match=r"inference 100000 \+ trainer 2 = 100002 nodes, over cluster 'c' "
                                         r"max_nodes\(16\)"):
        plan(topo(inference={"nodes": 100_000}, orchestrator={"placement": "trainer"}))


def test_node_budget_counts_an_own_orchestrator_node():
    P.check_node_budget(checker(max_nodes=4), topo(orchestrator={"placement": "trainer"}))  # 2 + 2 = 4
    with pytest.raises(PlanError, match=r"inference 2 \+ orchestrator 1 \+ trainer 2 = 5 nodes"):
        P.check_node_budget(checker(max_nodes=4), topo(orchestrator={"placement": "own"}))


# ------------------------------------------------------------------ inference

@pytest.mark.parametrize("tp, dp, nodes, expected", [
    (1, 1, 1, (1, 1, 8)),      # eight single-GPU servers per node
    (2, 2, 1, (4, 1, 2)),      # two tp2 x dp2 replicas per node
    (8, 1, 1, (8, 1, 1)),
    (8, 4, 4, (32, 4, 1)),     # one replica over four nodes
])
def test_inference_layout(tp, dp, nodes, expected):
    group = topo(inference={"nodes": nodes, "tp": tp, "dp": dp}).inference.groups()["inference"]
    assert P.inference_layout(checker(), "inference", ("inference",), group, 8) == expected


@pytest.mark.parametrize("tp, dp, nodes, field", [(16, 1, 1, "tp"), (3, 1, 1, "tp"), (2, 3, 1, "dp"),
                                                  (4, 3, 3, "dp"), (8, 2, 3, "nodes")])
def test_inference_layout_refuses(tp, dp, nodes, field):
    group = topo(inference={"nodes": nodes, "tp": tp, "dp": dp}).inference.groups()["inference"]
    with pytest.raises(PlanError, match=rf"\(inference\.{field}\)"):
        P.inference_layout(checker(), "inference", ("inference",), group, 8)


def test_place_inference_gives_each_server_its_ports_and_gpus():
    c, layout = checker(), P.Layout()
    roles, servers = P.place_inference(c, topo(), layout, {}, "/shared/runs/t")
    assert [(r.name, r.replicas, r.servers_per_node) for r in roles] == [("inference", 4, 2)]
    assert [(s.node, s.task, s.port, s.gpus) for s in servers] == [
        (0, 0, 8000, (0, 1, 2, 3)), (0, 1, 8001, (4, 5, 6, 7)), (1, 2, 8000, (0, 1, 2, 3)), (1, 3, 8001, (4, 5, 6, 7))]
    rpc = [s.args[s.args.index("--data-parallel-rpc-port") + 1] for s in servers]
    assert rpc == ["8200", "8201", "8200", "8201"]
    assert layout.launches[0].ntasks_per_node == 2 and layout.groups[0].nodes == 2


def test_multi_node_replica_followers_are_headless():
    layout = P.Layout()
    _, servers = P.place_inference(checker(), topo(inference={"nodes": 2, "tp": 8, "dp": 2}), layout, {},
                                     "/shared/runs/t")
    head, follower = servers
    assert head.head and head.port == 8000 and "--headless" not in head.args
    assert not follower.head and follower.port is None and "--headless" in follower.args
    assert follower.address_from_head and follower.args[follower.args.index("--data-parallel-start-rank") + 1] == "1"


def test_disaggregated_roles_get_their_kv_side_and_a_router():
    p = plan(topo_pd())
    assert {r.name: r.kv_role for r in p.inference} == {"prefill": "kv_producer", "decode": "kv_consumer"}
    assert p.router_port == 8090 and p.launch("router").start_after == ("prefill", "decode")
    assert p.launch("orchestrator").start_after == ("prefill", "decode", "router")


def kv_config(server) -> dict:
    return json.loads(server.args[server.args.index("--kv-transfer-config") + 1])


def test_nixl_servers_get_side_channel_ports_dp_apart_per_node():
    """vLLM listens on VLLM_NIXL_SIDE_CHANNEL_PORT + each dp rank: servers sharing a node get ranges dp apart."""
    t = as_topology({**TOPO, "inference": {"prefill": {"nodes": 1, "tp": 2, "dp": 2},
                                                       "decode": {"nodes": 2, "tp": 1, "dp": 8}}})
    p = plan(t)
    assert [(s.role, s.node, s.side_channel_port) for s in p.servers] == [
        ("prefill", 0, 8300), ("prefill", 0, 8302), ("decode", 0, 8300), ("decode", 1, 8300)]
    assert p.task_ports("prefill", 1) == (8001, 8302, 8303)
    assert p.task_ports("decode", 1) == (8000, *range(8300, 8308))


def test_side_channel_ports_differ_job_wide_on_one_host():
    t = as_topology({**TOPO, "inference": {"prefill": {"nodes": 1, "dp": 2}, "decode": {"nodes": 1}}})
    for cluster in ({"slurm": False}, {"single_host": True}):
        p = plan(t, gpu_node={"gpus": 0, "cpus": 2, "memory_gb": 8}, **cluster)
        assert [(s.role, s.port, s.side_channel_port) for s in p.servers] == [
            ("prefill", 8000, 8300), ("decode", 8001, 8302)], cluster


def test_a_router_port_on_the_side_channels_moves_them():
    """The user's router port where the planner would put its side channels is the user's: they move past it."""
    p = plan(topo_pd(port=8300))
    sides = {port for s in p.servers for port in p.side_channel_ports(s)}
    assert p.router_port == 8300 and 8300 not in sides and min(sides) == 8301


def test_example_connector_stores_kv_in_the_run_directory_and_needs_no_side_channel():
    t = as_topology({**TOPO, "inference": {"prefill": {"nodes": 1}, "decode": {"nodes": 1},
                                                       "kv_connector": {"name": "ExampleConnector"}}})
    p = plan(t)
    assert {s.side_channel_port for s in p.servers} == {None}
    assert {kv_config(s)["kv_connector_extra_config"]["shared_storage_path"] for s in p.servers} == {
        "/shared/runs/t/kv"}
    mine = as_topology({**TOPO, "inference": {
        "prefill": {"nodes": 1}, "decode": {"nodes": 1},
        "kv_connector": {"name": "ExampleConnector", "extra_config": {"shared_storage_path": "/fast/kv"}}}})
    paths = {kv_config(s)["kv_connector_extra_config"]["shared_storage_path"] for s in plan(mine).servers}
    assert paths == {"/fast/kv"}


@pytest.mark.parametrize("backend, offload", [
    ("native", {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": 3 << 29}}),
    ("lmcache", {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}),
])
def test_offload_with_disaggregation_is_a_multiconnector(backend, offload):
    """Next to a connector, vLLM's --kv-offloading-* flags would replace it: P/D renders both connectors."""
    t = as_topology({**TOPO, "inference": {"prefill": {"nodes": 1}, "decode": {"nodes": 1},
                                                       "kv_offload": {"backend": backend, "cpu_gb": 1.5}}})
    for s in plan(t).servers:
        assert not any(a.startswith("--kv-offloading") for a in s.args), s.args
        role = {"prefill": "kv_producer", "decode": "kv_consumer"}[s.role]
        assert kv_config(s) == {"kv_connector": "MultiConnector", "kv_role": role, "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": {}},
                           offload]}, "kv_load_failure_policy": "recompute"}
    unified = plan(topo(inference={"kv_offload": {"backend": backend, "cpu_gb": 1.5}}))
    assert all("--kv-transfer-config" not in s.args and s.args[s.args.index("--kv-offloading-size") + 1] == "1.5"
               for s in unified.servers)


# ------------------------------------------------------------------ trainer mesh

def test_derive_mesh_fills_dp_shard_and_carves_ep():
    m = derive_mesh(32, 1, -1, 2, 8)
    assert m == Mesh(dp_replicate=1, dp_shard=16, cp=2, ep=8, world_size=32)
    assert (m.dp, m.expert_shard) == (16, 4)


@pytest.mark.parametrize("args, field, text", [
    ((16, 3, -1, 1, 1), "dp_replicate", "dp_replicate(3) * cp(1) = 3 to divide its 16 ranks"),
    ((16, 1, -1, 3, 1), "cp", "dp_replicate(1) * cp(3) = 3 to divide"),
    ((16, 1, 4, 1, 1), "dp_shard", "dp_replicate(1) * dp_shard(4) * cp(1) = 4 != world size 16"),
    ((16, 1, -1, 1, 3), "ep", "ep(3) to divide dp_shard(16) * cp(1) = 16"),
])
def test_derive_mesh_names_every_factor(args, field, text):
    with pytest.raises(MeshError) as err:
        derive_mesh(*args)
    assert err.value.field == field and text in str(err.value)


def test_place_trainer_uses_the_derived_mesh():
    p = plan(topo(trainer={"nodes": 2, "ep": 4, "cp": 2}))
    assert p.trainer.world_size == 16 and p.trainer.mesh.dp_shard == 8 and p.trainer.master_port == 8500
    assert p.launch("trainer").gpus_per_node == 8 and p.launch("trainer").start_after == ()


# ------------------------------------------------------------------ ports, training, directives

def test_check_ports_refuses_a_port_above_65535():
    p = plan(topo(), port_base=65000)  # the highest base: rendezvous at 65500 still fits
    high = [msgspec.structs.replace(s, port=65536) if s.task == 3 else s for s in p.servers]
    with pytest.raises(PlanError, match=r"prof.yaml \(port_base\): inference server 3 would listen on port 65536"):
        P.check_ports(checker(port_base=65000), topo(), high, None, p.trainer)


def test_weights_in_memory_give_each_trainer_rank_a_weights_port():
    assert plan(topo()).trainer.weight_ports == ()
    p = plan(topo(weights={"transport": "memory"}))
    assert p.trainer.weight_ports == tuple(range(8600, 8608)) * 2  # ranks of one node differ, nodes may repeat
    assert p.task_ports("trainer", 1) == tuple(range(8600, 8608))
    assert p.task_ports("trainer", 0) == (8500, *range(8600, 8608))
    t = topo(weights={"transport": "memory"}, inference={"nodes": 1, "tp": 1, "dp": 1},
             trainer={"nodes": 2, "gpus_per_node": 2})
    assert plan(t, **LOCAL).trainer.weight_ports == (8600, 8601, 8602, 8603)  # one host: every rank its own
    assert plan(topo(weights={"transport": "broadcast"})).trainer.weight_ports == p.trainer.weight_ports  # the same feeds


LOCAL = {"slurm": False, "gpu_node": {"gpus": 0, "cpus": 2, "memory_gb": 8}}


def test_check_ports_refuses_a_router_port_on_a_weights_port():
    t = msgspec.structs.replace(topo_pd(port=8601), weights=topo(weights={"transport": "memory"}).weights,
                                trainer=topo(trainer={"nodes": 1, "gpus_per_node": 2}).trainer)
    with pytest.raises(PlanError, match=r"prof.yaml \(port_base\): port 8601 is used twice on one node: by the "
                                        r"router and by trainer rank 1's memory weights port"):
        plan(t, **LOCAL)


def test_check_ports_refuses_a_router_port_on_a_server_port():
    t = topo_pd(port=8003)
    with pytest.raises(PlanError, match=r"topo.yaml \(inference.router.port\): port 8003 is used twice on one "
                                        r"node: by prefill server 3 and by the router"):
        plan(t)


def test_check_ports_refuses_a_server_on_another_servers_rpc_port():
    # Locally every server shares one host: 8 dp servers' RPC ports start at +200, the trainer's at +500 ...
    # with port_base so low that server ports reach the RPC range they collide.
    t = topo(inference={"nodes": 1, "tp": 1, "dp": 2})
    c = checker(slurm=False, gpu_node={"gpus": 0, "cpus": 2, "memory_gb": 8})
    P.check_ports(c, t, [], None, plan(t, slurm=False, gpu_node={"gpus": 0, "cpus": 2, "memory_gb": 8}).trainer)
    servers = [msgspec.structs.replace(s, port=8200 if s.head else None) for s in
               plan(t, slurm=False, gpu_node={"gpus": 0, "cpus": 2, "memory_gb": 8}).servers]
    with pytest.raises(PlanError, match="data-parallel RPC"):
        P.check_ports(c, t, servers, None, plan(t, slurm=False, gpu_node={"gpus": 0, "cpus": 2, "memory_gb": 8}).trainer)


@pytest.mark.parametrize("update, text", [
    ({"batch_size": 60}, r"batch_size\(60\) must be a multiple of rollouts_per_example\(8\); use 56"),
    ({"max_tokens": 4096}, r"max_tokens\(4096\) leaves no room"),
])
def test_check_training(update, text):
    with pytest.raises(PlanError, match=text):
        P.check_training(checker(), topo(training=update), derive_mesh(16, 1, -1, 1, 1))


def test_check_training_refuses_gspo_with_context_parallelism():
    with pytest.raises(PlanError, match=r"kind gspo takes one ratio per sample, but trainer.cp\(2\) splits samples"):
        P.check_training(checker(), topo(training={"loss": {"kind": "gspo"}}), derive_mesh(16, 1, -1, 2, 1))
    P.check_training(checker(), topo(training={"loss": {"kind": "gspo"}}), derive_mesh(16, 1, -1, 1, 1))


@pytest.mark.parametrize("update, text", [
    ({"rollouts_per_example": 1, "advantage": {"dynamic_sampling": 2}},
     r"rollouts_per_example\(1\) every group does; use at least 2 rollouts per example"),
    ({"max_tokens": 64, "advantage": {"overlong_buffer": 64}}, r"overlong_buffer\(64\) must be below max_tokens\(64\)"),
])
def test_check_training_refuses_dapo_settings_that_cannot_work(update, text):
    with pytest.raises(PlanError, match=text):
        P.check_training(checker(), topo(training=update), derive_mesh(16, 1, -1, 1, 1))
    ok = {**update, "rollouts_per_example": 2, "max_tokens": 65}
    P.check_training(checker(), topo(training=ok), derive_mesh(16, 1, -1, 1, 1))


def test_check_training_refuses_leave_one_out_without_a_group():
    with pytest.raises(PlanError, match=r"rollouts_per_example\(1\) leaves none; use at least 2"):
        P.check_training(checker(), topo(training={"rollouts_per_example": 1, "advantage": {"baseline": "leave_one_out"}}),
                         derive_mesh(16, 1, -1, 1, 1))


def test_check_training_needs_a_sample_per_data_parallel_rank():
    with pytest.raises(PlanError, match=r"batch_size\(8\) gives some of the trainer's 16 data-parallel ranks"):
        P.check_training(checker(), topo(training={"batch_size": 8}), derive_mesh(16, 1, -1, 1, 1))


def test_job_directives_put_account_qos_and_time_on_every_component():
    batch, common = P.job_directives(checker(account="acct", qos="high", default_time="1:00:00"),
                                     topo(slurm={"extra_directives": ["--mail-type=END"]}), "/shared/runs/t")
    assert batch[:3] == ["--job-name=t", "--output=/shared/runs/t/logs/slurm-%j.out", "--open-mode=append"]
    assert common == ["--time=1:00:00", "--account=acct", "--qos=high", "--mail-type=END"]


def test_finish_groups_without_hetjobs_is_one_allocation():
    p = plan(hetjob=False, partitions={"orchestrator": "gpu"})
    first, *rest = p.groups
    assert "--nodes=5" in first.directives and all(g.directives == () for g in rest)
    assert [s.srun_args[0] for s in p.launches] == ["--relative=0", "--relative=2", "--relative=3"]


def test_parse_minutes():
    assert [P.parse_minutes(v) for v in ("30", "1:30", "2:00:00", "1-02", "1-00:30:30")] == \
        [30.0, 1.5, 120.0, 1560.0, 1440 + 30.5]


def test_plan_round_trips_through_json_as_the_same_model():
    p = plan()
    back = Plan.from_json(p.to_json())
    assert back.to_json() == p.to_json() and back.settings() == p.settings()
    assert (back.launches, back.servers, back.trainer) == (p.launches, p.servers, p.trainer)
    assert back.settings().training.batch_size == 64


# ------------------------------------------------------------------ what the trainer can execute, at plan time

DENSE = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 6, "num_key_value_heads": 2}
MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_attention_heads": 4,
       "num_key_value_heads": 2}


@pytest.mark.parametrize("config, overrides, field, text", [
    (DENSE, ["trainer.ep=2"], "trainer.ep", r"LlamaForCausalLM is dense: use ep: 1"),
    (MOE, ["trainer.ep=8", "trainer.gpus_per_node=8", "cluster.gpu_node.cpus=8"], "trainer.ep", r"must divide the model's num_experts\(4\)"),
    (DENSE, ["trainer.cp=4", "trainer.gpus_per_node=4", "cluster.gpu_node.cpus=4"], "trainer.cp",
     r"cp\(4\) must divide num_attention_heads\(6\)"),
])
def test_the_planner_refuses_what_the_trainer_cannot_run_at_the_yaml_line(tmp_path, config, overrides, field, text):
    import json

    from prl.planner.prepare import prepare

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    topo = tmp_path / "topo.yaml"
    repo = Path(__file__).resolve().parents[1]
    body = (repo / "configs" / "local-tiny.yaml").read_text().replace("cluster: local", f"cluster: {repo}/clusters/local.yaml")
    topo.write_text(body)
    line = next(i for i, t in enumerate(body.splitlines(), 1) if t.startswith("trainer:"))
    with pytest.raises(PlanError, match=rf"^override '{overrides[0]}' \({field}\): .*{text}"):
        prepare(topo, [f"model.path={model}", f"run_dir={tmp_path}/run", *overrides])
    # Written in the file instead of overridden, the error points at its line.
    key = field.split(".")[1]
    value = overrides[0].split("=")[1]
    topo.write_text(body.replace("trainer:\n", f"trainer:\n  {key}: {value}\n"))
    with pytest.raises(PlanError, match=rf"^{topo}:{line + 1} \({field}\): .*{text}"):
        prepare(topo, [f"model.path={model}", f"run_dir={tmp_path}/run", *overrides[1:]])


def test_a_model_the_planner_cannot_see_is_not_refused(tmp_path):
    from prl.planner.prepare import prepare

    repo = Path(__file__).resolve().parents[1]
    plan = prepare(repo / "configs" / "local-tiny.yaml", ["model.path=org/hub-id", "trainer.ep=2",
                                                         f"run_dir={tmp_path}/run"], cwd=tmp_path).plan
    assert plan.trainer.mesh.ep == 2


def test_role_runner_exports_the_planned_side_channel(tmp_path, monkeypatch):
    """The server's process gets its own VLLM_NIXL_SIDE_CHANNEL_PORT and this node's address as the host."""
    from types import SimpleNamespace

    from prl.job import runtimes
    from prl.run.rundir import RunDir

    run = RunDir(tmp_path / "run").create()
    run.create_api_key()
    p = msgspec.structs.replace(plan(topo_pd()), run_dir=str(run.root))
    seen = {}
    monkeypatch.setattr(runtimes, "node_address", lambda _plan: "10.1.2.3")
    monkeypatch.setattr(runtimes, "supervise", lambda argv, env, *a, **k: seen.setdefault(argv[-1], env) and 0)
    monkeypatch.delenv("PRL_RESTART", raising=False)
    decode = p.server("decode", 0)
    runtimes.run_server(run, p, "decode", 0, SimpleNamespace(signum=None))
    assert decode.side_channel_port == 8300
    assert (seen["10.1.2.3"]["VLLM_NIXL_SIDE_CHANNEL_HOST"], seen["10.1.2.3"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == (
        "10.1.2.3", "8300")


def test_steps_sharing_a_node_share_its_memory():
    """The router overlaps the first prefill node, whose server step holds that node's job memory: without
    --mem=0 its own DefMemPerCPU request fails ("Memory required by task is not available")."""
    p = plan(topo_pd())
    assert p.launch("router").srun_args[-2:] == ("--overlap", "--mem=0")
    assert "--mem=0" not in p.launch("prefill").srun_args and "--overlap" not in p.launch("prefill").srun_args


def test_nixl_side_channels_pick_around_the_users_router_port():
    """A router port the user chose where the planner's own side channels would go moves the side channels, not
    the blame: the plan is made, the router keeps its port and no side channel takes it."""
    from prl.planner.prepare import prepare

    from tests.helpers import REPO

    topology = REPO / "configs" / "moe-30b-pd.yaml"
    default = prepare(topology, [], cwd=REPO).plan
    first = min(port for s in default.servers for port in default.side_channel_ports(s))
    plan = prepare(topology, [f"inference.router.port={first + 1}"], cwd=REPO).plan
    sides = {port for s in plan.servers for port in plan.side_channel_ports(s)}
    assert plan.router_port == first + 1
    assert plan.router_port not in sides and min(sides) == first + 2


def test_scoring_groups_are_placed_after_inference_and_serve_their_own_model():
    t = topo(teacher={"path": "/teacher", "nodes": 1, "tp": 4, "dp": 2}, reference={"nodes": 1, "tp": 8},
             training={"loss": {"distill_coef": 1.0, "kl_ref_coef": 0.1}})
    layout = P.Layout()
    roles, servers = P.place_inference(checker(), t, layout, {}, "/shared/run")
    assert [(r.name, r.group, r.replicas) for r in roles] == [("inference", 0, 4), ("teacher", 1, 1),
                                                               ("reference", 2, 1)]
    teacher = next(s for s in servers if s.role == "teacher")
    args = dict(zip(teacher.argv()[::2], teacher.argv()[1::2]))
    assert (args["--model"], args["--served-model-name"], args["--max-model-len"]) == ("/teacher", "teacher", "4097")
    assert args["--tensor-parallel-size"] == "4" and args["--data-parallel-size"] == "2"
    reference = next(s for s in servers if s.role == "reference")
    assert reference.model == "/m" and not reference.adapters  # the student's initial model
    assert teacher.argv("/elsewhere")[:2] == ("--model", "/elsewhere") and "--model" not in teacher.args
    orchestrator = P.place_orchestrator(checker(), t, layout, {}, tuple(s.name for s in layout.launches))
    assert layout.launches[-1].start_after == ("inference", "teacher", "reference") and orchestrator.group == 3
    P.check_scorers(checker(), t)


def test_check_scorers_warns_about_a_teacher_nothing_reads():
    check = checker()
    P.check_scorers(check, topo(teacher={"path": "/teacher", "nodes": 1}))
    assert check.warnings == ["teacher: its servers score every rollout but training.loss.distill_coef is 0 and "
                              "no loss of your own reads them"]


def test_scoring_sections_are_refused_in_an_sft_topology():
    data = {k: v for k, v in TOPO.items() if k not in ("inference", "environment")}
    with pytest.raises(msgspec.ValidationError, match="runs the trainer alone: remove teacher"):
        as_topology({**data, "sft": {"data": "/d.jsonl"}, "teacher": {"path": "/t", "nodes": 1}})
