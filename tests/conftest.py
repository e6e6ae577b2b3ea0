"""Shared fixtures. Real-component fixtures (Slurm cluster, vLLM server) live beside their tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHIPPED = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))


def prl_cli(env: dict, *args, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """`prl ARGS` as a user runs it, from the repository root; with `check`, it must exit 0."""
    result = subprocess.run([sys.executable, "-m", "prl.cli", *map(str, args)], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=timeout)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def env(tmp_path) -> dict:
    """The environment for `prl` subprocesses, with a run registry of the test's own."""
    import os

    return {**os.environ, "PRL_HOME": str(tmp_path / "home")}


@pytest.fixture
def model(tmp_path) -> Path:
    """What a preflight checks of a model directory: a config.json on the shared filesystem."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path
