"""The weight transport's package (prl/weights): the registry, the plan-time checks, and that nothing outside the
package names a transport (the planner, the engine, the orchestrator and the servers go through its interface)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from prl import weights
from prl.config.topology import Weights
from prl.errors import PlanError
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
