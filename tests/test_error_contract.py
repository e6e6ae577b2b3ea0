"""The error contract (docs/architecture.md, "Entry points and errors"): an expected failure is a typed PrlError
that its entry point's `run_entry` turns into one line and an exit code, and every prl module logs through
`prl.log.get_logger(__name__)`. Source checks, each with a probe showing it can fail, and the entry points run."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

PRL = REPO / "prl"
KEPT_RUNTIME_ERRORS = {
    ("prl/inference/server.py", "PoolAuth.__init__"):
        "a bug if it fires: `serve` sets the key and the registry before vLLM builds its middleware",
    ("prl/inference/server.py", "ApiKeyAuth.__init__"):
        "a bug if it fires: `serve` sets the key before vLLM builds its middleware",
    ("prl/inference/generate.py", "_choice"):
        "vLLM broke its own contract (a sampled token without its logprob): a bug, reported with its traceback",
}
"""`raise RuntimeError` that stays, by (file, function): each is a bug's traceback, not a user's failure."""


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _scopes(tree: ast.AST):
    """(node, qualified name of the function or class it is in, '' at module level) for every node."""
    stack = [(tree, "")]
    while stack:
        node, scope = stack.pop()
        yield node, scope
        inner = scope
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            inner = f"{scope}.{node.name}" if scope else node.name
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def bare_runtime_errors(paths) -> dict[tuple[str, str], int]:
    """(file, function) -> line of each `raise RuntimeError(...)` (or bare `raise RuntimeError`)."""
    out = {}
    for path in paths:
        for node, scope in _scopes(ast.parse(path.read_text(), str(path))):
            exc = node.exc if isinstance(node, ast.Raise) else None
            exc = exc.func if isinstance(exc, ast.Call) else exc
            if isinstance(exc, ast.Name) and exc.id == "RuntimeError":
                out[(_rel(path), scope)] = node.lineno
    return out


def prl_modules(but: tuple[str, ...] = ()) -> list[Path]:
    return [p for p in sorted(PRL.rglob("*.py")) if _rel(p) not in but]


def test_no_module_raises_a_bare_runtime_error():
    """An expected failure has a PrlError kind (prl/errors.py), so its entry point says it in one line."""
    found = bare_runtime_errors(prl_modules())
    new = {where: line for where, line in found.items() if where not in KEPT_RUNTIME_ERRORS}
    assert not new, "raise RuntimeError: give the failure a PrlError kind, or keep it in KEPT_RUNTIME_ERRORS " \
                    "with the reason:\n" + "\n".join(f"{f}:{line} ({scope})" for (f, scope), line in new.items())
    gone = set(KEPT_RUNTIME_ERRORS) - set(found)
    assert not gone, f"KEPT_RUNTIME_ERRORS names raises that are no longer there: {sorted(gone)}"


def test_the_runtime_error_check_sees_one(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("class Auth:\n    def __init__(self):\n        raise RuntimeError('x')\n\n\n"
                     "def f():\n    raise RuntimeError\n\n\ndef g():\n    raise ValueError('fine')\n")
    assert bare_runtime_errors([probe]) == {(str(probe), "Auth.__init__"): 3, (str(probe), "f"): 7}


ENTRY_POINTS = {
    "launcher": (["prl.job.launch"], "prl launcher"),
    "role": (["prl.job.role", "trainer"], "prl trainer"),
    "orchestrator": (["prl.orchestrator"], "prl orchestrator"),
    "trainer": (["prl.trainer"], "prl trainer"),
}
BAD_RUNS = {
    "no plan": (None, 1, "no plan in {run}: {run}/plan.json is missing (run `prl plan` first)"),
    "another format": ('{"format": "prl.plan/1"}', 2, "{run}/plan.json: Invalid enum value 'prl.plan/1'"),
}


@pytest.mark.parametrize("bad", BAD_RUNS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_bad_run_directory_is_one_line_and_its_code(tmp_path, entry, bad):
    """A RunDirError (1) or ConfigError (2) ends an entry point with one `PROG: error: ...` line, no traceback."""
    module, prog = ENTRY_POINTS[entry]
    plan, code, message = BAD_RUNS[bad]
    run = tmp_path / "run"
    run.mkdir()
    if plan is not None:
        (run / "plan.json").write_text(plan)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRL_", "SLURM_"))}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-m", *module, "--run-dir", str(run)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120)
    lines = done.stderr.splitlines()
    assert done.returncode == code and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"{prog}: error: {message.format(run=run)}"), done.stderr[-3000:]


def _is_main_block(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == "__main__")


def _calls(node: ast.AST) -> set[str]:
    return {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def entry_modules(paths) -> dict[str, bool]:
    """Module (as `python -m` names it) -> whether its `__main__` block reaches `run_entry`, itself or through a
    function of the same module it calls, for every file with such a block."""
    out = {}
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        blocks = [node for node in tree.body if _is_main_block(node)]
        if not blocks:
            continue
        functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        called = set().union(*(_calls(b) for b in blocks))
        reached = called | set().union(*(_calls(functions[name]) for name in called if name in functions))
        parts = path.with_suffix("").parts
        parts = parts[len(parts) - 1 - parts[::-1].index("prl"):]  # from the package's top, prl/
        module = ".".join(parts[:-1] if parts[-1] == "__main__" else parts)
        out[module] = "run_entry" in reached
    return out


def test_every_entry_point_goes_through_run_entry_and_is_in_the_docs():
    found = entry_modules(prl_modules())
    assert {"prl.cli", "prl.job.launch", "prl.job.role", "prl.inference", "prl.inference.router",
            "prl.orchestrator", "prl.trainer", "prl.trainer.torchrun"} <= set(found), sorted(found)
    assert all(found.values()), f"__main__ blocks that bypass run_entry: {[m for m, ok in found.items() if not ok]}"
    doc = (REPO / "docs" / "architecture.md").read_text().split("## Entry points and errors")[1].split("\n## ")[0]
    missing = [m for m in found if f"python -m {m}`" not in doc and f"python -m {m} " not in doc]
    assert not missing, f"entry points missing from docs/architecture.md's 'Entry points and errors': {missing}"


def test_the_entry_point_check_sees_a_bypass(tmp_path):
    (tmp_path / "prl" / "tool").mkdir(parents=True)
    good, bad = tmp_path / "prl" / "tool" / "__main__.py", tmp_path / "prl" / "tool" / "raw.py"
    good.write_text("def cli():\n    return run_entry('prl tool', body)\n\n\nif __name__ == '__main__':\n    cli()\n")
    bad.write_text("def main():\n    return 0\n\n\nif __name__ == '__main__':\n    main()\n")
    assert entry_modules([good, bad]) == {"prl.tool": True, "prl.tool.raw": False}


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level `NAME = "text"` assignments: a logger name may be given through one."""
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for t in node.targets if isinstance(t, ast.Name)}


def _is_prl_name(arg: ast.expr, constants: dict[str, str]) -> bool:
    """Whether a logger name names a prl logger: `__name__` in a prl module, or a text that is `prl`/`prl.*`
    (a name not known here counts as one: only prl/log.py may build prl names)."""
    if isinstance(arg, ast.Name):
        if arg.id == "__name__":
            return True
        if arg.id not in constants:
            return True
        text = constants[arg.id]
    elif isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        text = arg.value
    else:
        return True
    return text == "prl" or text.startswith("prl.")


def logger_violations(paths) -> list[str]:
    """`path:line` for each `logging.getLogger` of a prl logger and each `get_logger` not given `__name__`."""
    out = []
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        constants = _string_constants(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name == "getLogger" and node.args and _is_prl_name(node.args[0], constants):
                out.append(f"{_rel(path)}:{node.lineno}: getLogger of a prl logger; use log = get_logger(__name__)")
            elif name == "get_logger" and not (len(node.args) == 1 and isinstance(node.args[0], ast.Name)
                                                and node.args[0].id == "__name__"):
                out.append(f"{_rel(path)}:{node.lineno}: get_logger of another name than __name__")
    return out


def test_every_prl_module_gets_its_logger_one_way():
    """Only prl/log.py sets up prl's loggers; every other module takes `log = get_logger(__name__)`."""
    found = logger_violations(prl_modules(but=("prl/log.py",)))
    assert not found, "loggers obtained another way:\n" + "\n".join(found)


def test_the_logger_check_sees_a_violation(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('import logging\nfrom prl.log import get_logger\nVLLM = "vllm.reload"\nOURS = "prl.x"\n'
                     'a = logging.getLogger("prl.feed")\nb = logging.getLogger(__name__)\nc = get_logger("prl.x")\n'
                     'd = logging.getLogger(OURS)\n'
                     'ok = [logging.getLogger("submitit"), logging.getLogger(VLLM), get_logger(__name__)]\n')
    assert [v.split(":")[1] for v in logger_violations([probe])] == ["5", "6", "7", "8"]
