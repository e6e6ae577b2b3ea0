"""The error contract (docs/architecture.md, "Entry points and errors"): an expected failure is a typed PrlError
that its entry point's `run_entry` turns into one line and an exit code. Source checks, each with a probe
showing it can fail."""

from __future__ import annotations

import ast
from pathlib import Path

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
