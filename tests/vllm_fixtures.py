"""Real vLLM servers for tests: the session fixture `tiny_server` and `server_fixture` (the servers themselves are
testkit/servers.py's `start_inference`, re-exported here for the tests that import it from this module).

    from tests.vllm_fixtures import start_inference, tiny_server  # noqa: F401 (fixture)

Tests share one `tiny_server` per session (a tiny Qwen3 in float32, its run dir and model dir in a session tmp
dir). A fixture that starts servers is declared with `@server_fixture(scope=...)`
instead of `@pytest.fixture`: every test that uses it, directly or through
another fixture, is then marked `vllm` and `slow` (tests/conftest.py), and
`start_inference` refuses to run for a test without the `vllm` marker, so the
inner loop `-m "not slow and not slurm and not vllm"` never starts vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.servers import (HTTPFailure, InferenceServer, http_json, metric_sum, prometheus,  # noqa: F401
                             start_inference, start_router, start_servers, stop_process)

SERVER_FIXTURES: set[str] = set()
"""Names of the fixtures declared with `server_fixture`."""


def server_fixture(**kwargs):
    """`pytest.fixture(**kwargs)` for a fixture that starts a real vLLM server (see the module docstring)."""

    def declare(function):
        SERVER_FIXTURES.add(function.__name__)
        return pytest.fixture(**kwargs)(function)

    return declare


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3 (float32, head_dim 32) + tokenizer, built once per session."""
    from prl.trainer.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vllm-model") / "model")


@server_fixture(scope="session")
def tiny_server(tmp_path_factory, tiny_model_dir) -> Iterator[InferenceServer]:
    """One `prl.inference` server on the tiny model, shared by the session; its run dir is empty."""
    from prl.run.rundir import RunDir

    run = RunDir(tmp_path_factory.mktemp("vllm-run") / "run").create()
    with start_inference(run.root, tiny_model_dir) as server:
        yield server
