"""The weight transport's package (prl/weights): the registry, the plan-time checks, and that nothing outside the
package names a transport (the planner, the engine, the orchestrator and the servers go through its interface)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from prl import weights
from prl.config.topology import Weights
from prl.errors import ConfigError, PlanError
from prl.run.api import WeightsRequest
from prl.weights.layout import UpdateRefused
from testkit.plans import local_plan

REPO = Path(__file__).resolve().parents[1]
TRANSPORT_MODULES = {"prl.weights.filesystem", "prl.weights.memory", "prl.weights.broadcast", "prl.weights.feed",
                     "prl.weights.collective", "prl.weights.delta"}
"""A transport's own modules (prl.weights.layout, what a step holds, and the package's interface are for all)."""
ALLOWED = {
    ("prl/config/topology.py", "filesystem"): "the schema's default: `weights.transport` unset",
    ("prl/run/api.py", "filesystem"): "a request's default: a hand-written `{\"step\": N}` comes from the run directory",
    ("prl/inference/admin.py", "prl.weights.filesystem"): "a failed update rolls back to the directory the server "
                                                           "loaded last, as the filesystem transport loads one",
    ("prl/inference/worker.py", "prl.weights.filesystem"): "the filesystem transport's worker side (`read_step`) "
                                                            "runs in vLLM's worker extension, which loads a directory",
}
"""Where a module outside the package may name a transport, and why."""


def named_transports(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """(line, what) for every string constant that is a transport's name and every import of a transport's own
    module in `path` (docstrings are prose, not names)."""
    tree = ast.parse(path.read_text(), str(path))
    prose = {id(n.body[0].value) for n in ast.walk(tree)
             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
             and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    prose |= {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    found = [(n.lineno, n.value) for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and n.value in names and id(n) not in prose]
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            modules = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
        elif isinstance(n, ast.Import):
            modules = [a.name for a in n.names]
        else:
            continue
        found += [(n.lineno, m) for m in modules if m in TRANSPORT_MODULES]
    return found


def outside_the_package(files: dict[Path, str] | None = None) -> list[str]:
    files = files or {p: str(p.relative_to(REPO)) for p in sorted((REPO / "prl").rglob("*.py"))
                      if "prl/weights/" not in str(p.relative_to(REPO))}
    names = set(weights.names())
    return [f"{rel}:{line}: names {what!r}" for path, rel in files.items()
            for line, what in named_transports(path, names) if (rel, what) not in ALLOWED]


def test_no_module_outside_the_package_names_a_transport():
    found = outside_the_package()
    assert not found, "go through prl.weights (get(name) and the Transport's methods):\n" + "\n".join(found)


def test_the_check_sees_a_module_that_names_a_transport(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""memory is prose."""\nfrom prl.weights.feed import FeedServer\nif t == "broadcast":\n    pass\n')
    assert outside_the_package({probe: "prl/orchestrator/probe.py"}) == [
        "prl/orchestrator/probe.py:3: names 'broadcast'", "prl/orchestrator/probe.py:2: names 'prl.weights.feed'"]


def test_the_registry_knows_the_shipped_transports_in_order_and_refuses_another_of_a_name():
    assert weights.names() == ("filesystem", "memory", "broadcast")
    assert [weights.get(n).feeds for n in weights.names()] == [False, True, True]
    with pytest.raises(ValueError, match="registered already"):
        weights.register(weights.get("memory"))
    with pytest.raises(UpdateRefused, match="no weight transport 'nccl'; one of filesystem, memory, broadcast") as e:
        weights.get("nccl")
    assert e.value.status == 400


def test_every_transport_is_documented_where_the_setting_is():
    doc = Weights.__doc__ or ""
    source = (REPO / "prl/config/topology.py").read_text()
    field_doc = source[source.index("class Weights"):source.index("delta: bool")]
    table = (REPO / "docs/weights.md").read_text()
    for name in weights.names():
        assert f"`{name}`" in field_doc, f"weights.transport's docstring does not name {name}"
        assert f"| `{name}`" in table or f"`{name}` |" in table, f"docs/weights.md's table has no {name}"
    assert doc is not None


def test_the_default_request_is_the_durable_transport_s():
    assert WeightsRequest(step=3).transport == weights.names()[0] == Weights().transport
    assert WeightsRequest(step=3).durable and not WeightsRequest(transport="memory", step=3, feeds=["h:1"]).durable


def test_an_unknown_transport_is_refused_at_its_line_with_the_known_ones(tmp_path, tiny_model_dir):
    with pytest.raises(PlanError, match=r"\(weights\.transport\): no weight transport 'nccl': use one of "
                                        r"filesystem, memory, broadcast"):
        local_plan(tmp_path / "run", tiny_model_dir, ["weights.transport=nccl"])
    with pytest.raises(PlanError, match=r"\(weights\.delta\): deltas are sent by the weight feeds"):
        local_plan(tmp_path / "run", tiny_model_dir, ["weights.delta=true"])


@pytest.mark.parametrize("transport", ["memory", "broadcast"])
def test_a_transport_from_memory_gives_every_trainer_rank_a_port_and_the_filesystem_none(tmp_path, tiny_model_dir,
                                                                                       transport):
    plan = local_plan(tmp_path / "run", tiny_model_dir, [f"weights.transport={transport}"])
    assert len(plan.trainer.weight_ports) == plan.trainer.world_size
    assert local_plan(tmp_path / "run2", tiny_model_dir, []).trainer.weight_ports == ()


def test_broadcast_forms_one_group_per_place_across_the_servers_behind():
    """Servers whose workers keep different slices (tensor-parallel ranks) get a group per place: the workers of
    one place in every server share a token, a world of 1 + their count and consecutive ranks; a request names
    each worker's group in rank order. The ranks rotate from place to place, so no server is first in every tree.
    Servers whose workers all take the whole step share one group; a server whose worker count is unknown, or whose
    places do not match it, reads the feeds."""
    from prl.run.api import WeightsRequest, Worker
    from prl.weights.broadcast import GroupOffer
    from prl.weights.slices import server_places
    from prl.weights.transport import Behind

    offer = GroupOffer(3, WeightsRequest(transport="broadcast", step=3, feeds=["h:1", "h:2"]), timeout=9.0)
    tp2 = server_places(2, 1, False)
    out = weights.get("broadcast").requests(offer, [Behind("a", 2, tp2), Behind("b", 2, tp2), Behind("c", None),
                                                    Behind("d", 2, [Worker()])])
    a, b = out["a"].groups, out["b"].groups
    assert [g.token for g in a] == [g.token for g in b] and a[0].token != a[1].token
    assert [(g.world, g.rank, g.timeout) for g in a + b] == [(3, 1, 9.0), (3, 2, 9.0), (3, 2, 9.0), (3, 1, 9.0)]
    assert out["c"].groups is None and out["d"].groups is None and out["c"].feeds == ["h:1", "h:2"]
    assert out["a"].once and not out["c"].once

    whole = weights.get("broadcast").requests(offer, [Behind("a", 2), Behind("b", 1)])
    assert len({g.token for r in whole.values() for g in r.groups}) == 1
    assert [g.rank for r in whole.values() for g in r.groups] == [1, 2, 3] and whole["b"].groups[0].world == 4

    ep = server_places(2, 2, True)  # dp 2 x tp 2 with expert parallelism: four places, each a group of one
    four = weights.get("broadcast").requests(offer, [Behind("e", 4, ep)])["e"].groups
    assert len({g.token for g in four}) == 4 and {(g.world, g.rank) for g in four} == {(2, 1)}


def forwards(rank: int, world: int) -> int:
    """How many times the member of `rank` passes a broadcast on in gloo's binomial tree (gloo/broadcast.cc: rank r
    sends in each round i with 2**i > r, to r + 2**i where that is a member; the feed is rank 0)."""
    return sum(1 for i in range(max(world - 1, 1).bit_length()) if 2 ** i > rank and rank + 2 ** i < world)


def test_no_server_forwards_more_than_its_share_of_the_places_broadcasts():
    """Eight tp8 servers (the shape of a moe-1t prefill node): each place's group is a tree of 1 + 8; in one order
    for every place the first server would forward 16 slices and the fourth to eighth none; rotated, every server
    forwards 4 (the 32 forwards of the 8 trees, shared)."""
    from prl.weights.broadcast import GroupOffer
    from prl.run.api import WeightsRequest
    from prl.weights.slices import server_places
    from prl.weights.transport import Behind

    offer = GroupOffer(3, WeightsRequest(transport="broadcast", step=3, feeds=["h:1"]), timeout=9.0)
    tp8 = server_places(8, 1, False)
    out = weights.get("broadcast").requests(offer, [Behind(f"s{i}", 8, tp8) for i in range(8)])
    load = {url: sum(forwards(g.rank, g.world) for g in r.groups) for url, r in out.items()}
    assert sum(load.values()) == 8 * sum(forwards(r, 9) for r in range(1, 9)) == 32
    assert set(load.values()) == {4}, load
    for token in {g.token for r in out.values() for g in r.groups}:
        assert sorted(g.rank for r in out.values() for g in r.groups if g.token == token) == list(range(1, 9))


def test_the_groups_backend_is_planned_for_where_the_roles_run_and_refused_where_it_cannot_work(tmp_path,
                                                                                                 tiny_model_dir):
    """`weights.backend`: auto plans nccl on a GPU cluster (no deltas), gloo on CPU ones (the lab cluster's
    count-only GPUs included); nccl is refused on CPUs and with deltas, a group setting without groups at its
    line; `prl plan`'s weights line says which."""
    from prl.planner.prepare import prepare
    from prl.planner.show import weights_line

    def gpu_plan(*items):
        return prepare(REPO / "configs" / "dense-8b.yaml", ["weights.transport=broadcast", *items], cwd=REPO).plan

    assert gpu_plan().trainer.weight_backend == "nccl"
    assert weights_line(gpu_plan(), (), "").startswith("weights: broadcast over nccl (")
    assert gpu_plan("weights.delta=true").trainer.weight_backend == "gloo"
    assert gpu_plan("weights.backend=gloo").trainer.weight_backend == "gloo"
    with pytest.raises(PlanError, match=r"\(weights\.backend\): weights\.backend: nccl receives each step into GPU "
                                        r"memory.*remove weights\.delta"):
        gpu_plan("weights.delta=true", "weights.backend=nccl")
    lab = prepare(REPO / "configs" / "lab.yaml", [], cwd=REPO).plan
    assert lab.trainer.weight_backend == "gloo" and "over gloo" in weights_line(lab, (), "")
    with pytest.raises(PlanError, match=r"\(weights\.backend\): weights\.backend: nccl broadcasts between GPUs.*"
                                        r"run on CPUs"):
        prepare(REPO / "configs" / "lab.yaml", ["weights.backend=nccl"], cwd=REPO)
    for item in ("weights.backend=gloo", "weights.group_timeout_s=5"):
        field = item.split("=")[0]
        with pytest.raises(PlanError, match=rf"\({field.replace('.', '[.]')}\): {field} is a setting of the broadcast "
                                            r"groups, and weights\.transport memory sends none"):
            local_plan(tmp_path / "run", tiny_model_dir, ["weights.transport=memory", item])


def test_nccl_plans_refuse_receive_buffers_the_gpu_cannot_hold_beside_vllm_s_share(tiny_model_dir):
    """Under nccl a worker receives the largest layer's slices into GPU memory beside vLLM's share: a GPU too small
    for it (the profile's gpu_node.gpu_memory_gb) is refused at the role's gpu_memory_utilization, with the value
    that fits; gloo receives into host memory and is not."""
    from prl.planner.prepare import prepare

    def plan(*items):
        return prepare(REPO / "configs" / "dense-8b.yaml", ["weights.transport=broadcast", f"model.path={tiny_model_dir}",
                                                           "model.tokenizer=null", *items], cwd=REPO)

    fits = plan()
    assert fits.plan.trainer.weight_backend == "nccl" and fits.shares and fits.shares[0].layer_most > 0
    layer = fits.shares[0].layer_most
    tight = f"cluster.gpu_node.gpu_memory_gb={3 * layer / 2**30:.9f}"  # 2 layers fit in 0.67 of it, not in 0.1
    with pytest.raises(ConfigError, match=r"\(inference\.gpu_memory_utilization\): under weights\.backend: nccl "
                                          r"each inference worker receives .* set gpu_memory_utilization <= 0\.33"):
        plan(tight)
    assert plan(tight, "inference.gpu_memory_utilization=0.3").plan.trainer.weight_backend == "nccl"
    assert plan(tight, "weights.backend=gloo").plan.trainer.weight_backend == "gloo"
