"""Shared fixtures. The real components come as plugins: the Slurm cluster (tests/slurm_fixtures.py) and
vLLM servers (tests/vllm_fixtures.py); plain helpers (REPO, SHIPPED, prl_cli) are in tests/helpers.py."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

pytest_plugins = ["tests.slurm_fixtures", "tests.vllm_fixtures"]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    """A test is marked by the real components its fixtures bring, directly or through other fixtures: `slurm`
    with the Slurm cluster, `vllm` and `slow` with a vLLM server. So `-m "not slow and not slurm and not vllm"`
    (the inner loop, docs/testing.md) never starts either, whatever a test forgot to say."""
    from tests.slurm_fixtures import CLUSTER_FIXTURES
    from tests.vllm_fixtures import SERVER_FIXTURES

    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & CLUSTER_FIXTURES:
            item.add_marker(pytest.mark.slurm)
        if used & SERVER_FIXTURES:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)
        group = xdist_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


LOCAL_RUN = ('"--local"', "Launcher(")
"""A test module that holds one of these starts local runs (`prl submit ... --local`, or the launcher itself)."""


def xdist_group(item) -> str | None:
    """The suite runs on two pytest-xdist workers (`-n 2 --dist loadgroup`, scripts/test.sh); a group's tests
    run one after another on one worker. The Slurm tests share the four-node test cluster and the lab profile's
    ports, so they are one group ("slurm"); the modules that start local runs share the local profile's ports
    (and fixed `cluster.port_base` values), so they are another ("local-runs"). Everything else picks its ports
    free and runs beside them: most Slurm time is waiting on the scheduler, which leaves a core idle. The other
    tests with a vLLM server are a third group ("vllm"): their servers come from module- and session-scoped
    fixtures, which xdist would otherwise start once on each worker that runs one of their tests (the P/D
    fixture's four servers took 330 s and 240 s on the two workers)."""
    if item.get_closest_marker("slurm"):
        return "slurm"
    if starts_local_runs(str(item.fspath)):
        return "local-runs"
    return "vllm" if item.get_closest_marker("vllm") else None


@functools.lru_cache(maxsize=None)
def starts_local_runs(path: str) -> bool:
    return path.endswith(".py") and any(text in Path(path).read_text() for text in LOCAL_RUN)


def pytest_runtest_setup(item):
    """`start_inference` refuses to start a server for a test without the `vllm` marker (testkit/servers.py)."""
    from testkit import servers

    servers.SERVERS_ALLOWED = item.get_closest_marker("vllm") is not None


@pytest.fixture(autouse=True)
def _unbound_renderers_lock():
    """renderers.client serializes its first context-length lookup per engine with one module-level asyncio.Lock,
    which binds to the first event loop that waits on it. A job's process runs one loop; this test process runs
    one per orchestrator run, and a later run waiting on the lock would fail its model calls ("bound to a
    different event loop"). Each test starts with a fresh lock."""
    import asyncio

    client = sys.modules.get("renderers.client")
    if client is not None:
        client._max_prompt_len_lock = asyncio.Lock()


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def env(tmp_path) -> dict:
    """The environment for `prl` subprocesses, with a run registry of the test's own."""
    return {**os.environ, "PRL_HOME": str(tmp_path / "home")}


@pytest.fixture
def model(tmp_path) -> Path:
    """What a preflight checks of a model directory: a config.json on the shared filesystem."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The tiny test tokenizer (ChatML, byte-level BPE; tests/tiny_model.py) saved to a directory."""
    from tests.tiny_model import build_tokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tok(tokenizer_dir):
    """The tiny test tokenizer, loaded as the renderers load it."""
    from renderers.base import load_tokenizer

    return load_tokenizer(str(tokenizer_dir))


@pytest.fixture
def prl_caplog(caplog, monkeypatch):
    """`caplog` that sees the `prl` loggers' records even after a role ran in this process: `init_logging`
    stops them propagating to the root logger, where caplog listens (tests of what a component logs)."""
    import logging

    monkeypatch.setattr(logging.getLogger("prl"), "propagate", True)
    return caplog
