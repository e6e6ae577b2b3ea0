"""Imports flow one way, the control plane imports nothing heavy (login nodes are slow), functions stay short and
role names are written only as `prl.states.Role` members.

Layers, lowest first; a module may import its own package and lower layers only:

    0  prl.errors prl.log prl.states            shared by everything
    1  prl.config                               schemas, loader
    2  prl.run                                  run directory, its records, the HTTP bodies, batch format
    3  prl.weights                              the weight transports (every side of each)
    4  prl.planner                              the typed Plan, make_plan, render, show
    5  prl.ops  prl.job                         login-node commands / inside the job (job may use ops.slurm)
    5  prl.inference prl.orchestrator prl.trainer   the roles: never ops, job or each other
    6  prl.cli                                  the `prl` command
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "vllm", "transformers", "verifiers", "safetensors", "numpy", "matplotlib", "wandb")
LAYER = {
    "prl.errors": 0, "prl.log": 0, "prl.states": 0, "prl": 0,
    "prl.config": 1, "prl.plugins": 1, "prl.run": 2, "prl.weights": 3, "prl.planner": 4,
    "prl.ops": 5, "prl.job": 5, "prl.inference": 5, "prl.orchestrator": 5, "prl.trainer": 5,
    "prl.cli": 6,
}
ROLES = {"prl.inference", "prl.orchestrator", "prl.trainer"}
ALLOWED_ACROSS = {("prl.job", "prl.ops.slurm"), ("prl.orchestrator", "prl.inference.routing")}
"""Same-layer imports that are fine: the launcher requeues through the one module that runs Slurm; the
orchestrator picks servers by the router's own rule (a pure module, so one rollout stays on one server
whether or not a router is in front)."""


def package_of(module: str) -> str:
    parts = module.split(".")
    name = ".".join(parts[:2])
    return name if name in LAYER else "prl"


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def prl_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `prl...` import in a file, including those inside functions."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "prl"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "prl" and not node.level:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def violations(files: dict[Path, str] | None = None) -> list[str]:
    """Imports against the layer order in `files` (path -> module name; default: every module of prl/)."""
    files = files or {p: module_name(p) for p in sorted((REPO / "prl").rglob("*.py"))}
    out = []
    for path, me in files.items():
        mine = package_of(me)
        for line, target in prl_imports(path):
            theirs = package_of(target)
            if theirs == mine or (mine, ".".join(target.split(".")[:3])) in ALLOWED_ACROSS:
                continue
            crossing_roles = mine in ROLES and theirs in LAYER and LAYER[theirs] >= LAYER[mine]
            if LAYER[theirs] >= LAYER[mine] or crossing_roles:
                out.append(f"{path}:{line}: {me} ({mine}, layer {LAYER[mine]}) imports "
                           f"{target} ({theirs}, layer {LAYER[theirs]})")
    return out


def test_every_package_has_a_layer():
    packages = {package_of(module_name(p)) for p in (REPO / "prl").rglob("*.py")}
    assert packages <= set(LAYER), f"packages without a layer in tests/test_imports.py: {packages - set(LAYER)}"


def test_imports_flow_one_way():
    bad = violations()
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_checker_sees_violations(tmp_path):
    """A planner module importing ops, and a role importing another role, are reported (the check can fail)."""
    probe = tmp_path / "probe.py"
    probe.write_text("from prl.ops import status\nimport prl.trainer.train\n")
    assert len(violations({probe: "prl.planner.probe"})) == 2
    assert len(violations({probe: "prl.orchestrator.probe"})) == 2
    assert violations({probe: "prl.cli"}) == []


def module_graph(files: dict[Path, str] | None = None) -> dict[str, set[str]]:
    """Module -> the prl modules it imports (at module level or inside functions), for `files`
    (path -> module name; default: every module of prl/). `from pkg import name` counts as importing
    `pkg.name` when that is a module, else `pkg`."""
    files = files or {p: module_name(p) for p in sorted((REPO / "prl").rglob("*.py"))}
    known = set(files.values())
    graph: dict[str, set[str]] = {}
    for path, me in files.items():
        edges = set()
        for _line, target in prl_imports(path):
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != me:
                edges.add(target)
        graph[me] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: each strongly connected set of two or more modules, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circles_between_modules():
    cycles = import_cycles(module_graph())
    assert not cycles, "modules that import each other (directly or through others):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_circle_check_sees_a_circle(tmp_path):
    """Two probe modules importing each other, one of them only inside a function, are one circle."""
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("from prl.probe.b import x\n")
    b.write_text("def f():\n    import prl.probe.a\n")
    c.write_text("import prl.probe.a\n")
    graph = module_graph({a: "prl.probe.a", b: "prl.probe.b", c: "prl.probe.c"})
    assert import_cycles(graph) == [["prl.probe.a", "prl.probe.b"]]


def test_the_architecture_doc_shows_the_layers_checked_here():
    """docs/architecture.md's layer picture is LAYER: a change to either without the other fails here."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("<!-- layers")[1].split("<!-- /layers -->")[0].splitlines()[1:]
    shown = {}
    for line in block:
        words = line.split()
        if words[:1] == ["layer"]:
            shown.update({name: int(words[1]) for name in words[2:]})
    assert shown == LAYER, f"docs/architecture.md shows {shown}, tests/test_imports.py checks {LAYER}"


MAX_FUNCTION_LINES = 60


def long_functions(paths) -> list[str]:
    """`path:line name (N lines)` for every function or method longer than MAX_FUNCTION_LINES."""
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{node.lineno} "
                               f"{node.name} ({n} lines)")
    return out


def test_no_function_is_over_60_lines():
    """Short top-to-bottom functions (STYLE.md): a longer one is named steps waiting to be functions."""
    found = long_functions(sorted((REPO / "prl").rglob("*.py")))
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


def test_the_length_check_sees_a_long_function(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def short():\n    return 1\n\n\ndef long():\n" + "    x = 1\n" * 60 + "    return x\n")
    assert long_functions([probe]) == [f"{probe}:5 long (62 lines)"]


ROLE_NAMES = frozenset({"inference", "prefill", "decode", "teacher", "reference", "router", "orchestrator", "trainer"})
"""Written out here, not read from prl.states.Role: a member renamed or dropped there fails
`test_the_role_names_checked_are_the_roles`, not silently the check."""
NOT_ROLES = {
    ("prl/cli.py", '"trainer": (trainer, _trainer_args), "orchestrator": (orchestrator, _orchestrator_args),'):
        "`prl trainer` and `prl orchestrator` are command names (what a user types), which run those roles",
    ("prl/config/topology.py", 'placement: Literal["own", "trainer", "inference"] = "own"'):
        "`orchestrator.placement` values, a Literal of the user's schema (docs/reference.md lists its values)",
    ("prl/planner/model.py", 'placement: Literal["own", "trainer", "inference"]'):
        "the plan's copy of `orchestrator.placement` (the same Literal: plan.json keeps its values)",
    ("prl/trainer/float8.py", 'ROUTER_NAMES = frozenset({"gate", "router"})'):
        "the name of a MoE router's linear layer (GPT-OSS's `mlp.router`), not the P/D router role",
}
"""(file, line) -> why a string there that equals a role name is not a role."""


def role_literals(files: dict[Path, str]) -> list[str]:
    """`file:line 'name'` for each string constant equal to a role name in `files` (path -> name relative to the
    repository), docstrings excluded, outside prl/states.py (where `Role` lists them) and the lines of NOT_ROLES."""
    out = []
    for path, name in files.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text, str(path))
        docstrings = {id(n.value) for n in ast.walk(tree)
                      if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and node.value in ROLE_NAMES and id(node) not in docstrings
                    and name != "prl/states.py" and (name, lines[node.lineno - 1].strip()) not in NOT_ROLES):
                out.append(f"{name}:{node.lineno} {node.value!r}")
    return sorted(out)


def prl_sources() -> dict[Path, str]:
    return {p: p.relative_to(REPO).as_posix() for p in sorted((REPO / "prl").rglob("*.py"))}


def test_role_names_are_written_only_as_role_members():
    """Roles are one closed vocabulary (prl.states.Role and its kind sets): a bare "trainer" elsewhere is a second
    list waiting to drift. A string that only looks like a role goes in NOT_ROLES, with why."""
    found = role_literals(prl_sources())
    assert not found, ("role names written as strings (use prl.states.Role, or list the line in NOT_ROLES with "
                       "why it is not a role):\n" + "\n".join(found))


def test_every_not_a_role_line_is_still_there():
    """A NOT_ROLES entry whose line changed or went away no longer excuses anything: drop or update it."""
    lines = {(name, line.strip()) for path, name in prl_sources().items() for line in path.read_text().splitlines()}
    assert not set(NOT_ROLES) - lines, f"NOT_ROLES lines not found in prl/: {sorted(set(NOT_ROLES) - lines)}"


def test_the_role_names_checked_are_the_roles():
    from prl.states import Role

    assert {r.value for r in Role} == ROLE_NAMES


def test_the_role_check_sees_role_strings(tmp_path):
    """A bare role name in code is reported with its line; the same name in a docstring, in prl/states.py, or on a
    NOT_ROLES line is not (the check can fail)."""
    probe = tmp_path / "probe.py"
    probe.write_text('"""The trainer."""\n'
                     'def f(role):\n'
                     '    """inference"""\n'
                     '    return role == "decode" or role in ("trainer", "training")\n'
                     'ROUTER_NAMES = frozenset({"gate", "router"})\n')
    assert role_literals({probe: "prl/probe.py"}) == [
        "prl/probe.py:4 'decode'", "prl/probe.py:4 'trainer'", "prl/probe.py:5 'router'"]
    assert role_literals({probe: "prl/trainer/float8.py"}) == [
        "prl/trainer/float8.py:4 'decode'", "prl/trainer/float8.py:4 'trainer'"]
    assert role_literals({probe: "prl/states.py"}) == []


@pytest.mark.parametrize("module", ["prl.cli", "prl.planner.prepare", "prl.planner.plan", "prl.planner.render",
                                    "prl.planner.show", "prl.planner.model", "prl.run.rundir", "prl.run.batch",
                                    "prl.ops.submit", "prl.ops.status", "prl.ops.logs", "prl.ops.registry",
                                    "prl.ops.slurm", "prl.ops.plot", "prl.ops.wandb_sync", "prl.ops.metrics",
                                    "prl.ops.doctor", "prl.ops.progress", "prl.job.launch", "prl.job.role",
                                    "prl.job.preflight",
                                    "prl.inference", "prl.orchestrator", "prl.trainer"])
def test_control_plane_imports_nothing_heavy(module):
    code = (f"import sys, {module}\n"
            f"print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "", f"{module} imported: {out.stdout}"


def test_plan_command_imports_nothing_heavy():
    """Run `prl plan` in-process and look at sys.modules afterwards."""
    code = (
        "import sys\n"
        "from prl.cli import main\n"
        "main(['plan', 'configs/moe-1t.yaml', '--no-write'])\n"
        f"print('HEAVY:' + ' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.rstrip().splitlines()[-1] == "HEAVY:", out.stdout[-500:]


def test_plan_command_imports_no_pydantic():
    """`prl plan` checks the schemas with msgspec: importing pydantic and building its models cost a
    login node about 0.4 s (bench/bench_startup.py). Only the runtime roles use pydantic (through vLLM)."""
    code = (
        "import sys\n"
        "from prl.cli import main\n"
        "main(['plan', 'configs/moe-1t.yaml', '--no-write'])\n"
        "print('PYDANTIC:' + ' '.join(sorted(m for m in sys.modules if m.split('.')[0] == 'pydantic')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.rstrip().splitlines()[-1] == "PYDANTIC:", out.stdout[-500:]


AFTER_INSTALL = ("bench", "testkit")
"""Run after the README's install, which has no pytest: they must not import the tests (which import pytest)."""


def imports_of_tests_or_pytest(path: Path) -> list[str]:
    """`module (line N)` for each import of `tests` or `pytest` in `path`, at any depth (a function's own too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        found += [f"{name} (line {node.lineno})" for name in names if name.split(".")[0] in ("tests", "pytest")]
    return found


def test_benches_import_neither_the_tests_nor_pytest():
    bad = {str(p.relative_to(REPO)): found for folder in AFTER_INSTALL for p in sorted((REPO / folder).glob("*.py"))
           if (found := imports_of_tests_or_pytest(p))}
    assert bad == {}, f"import what benches share with the tests from testkit/, not tests/: {bad}"


def test_the_bench_import_check_sees_a_test_import(tmp_path):
    path = tmp_path / "bench_x.py"
    path.write_text("import os\n\ndef main():\n    from tests.helpers import free_port\n    import pytest\n")
    assert imports_of_tests_or_pytest(path) == ["tests.helpers (line 4)", "pytest (line 5)"]


def test_a_bench_runs_without_pytest():
    """As after `./scripts/install.sh` (no pytest): bench_sft.py's imports, then its --help."""
    blocked = ("import runpy, sys; sys.modules['pytest'] = None; sys.argv = ['bench/bench_sft.py', '--help']; "
               "runpy.run_path('bench/bench_sft.py', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0 and "--micro-batch-tokens" in result.stdout, result.stderr[-2000:]
