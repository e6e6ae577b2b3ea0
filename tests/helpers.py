"""Plain helpers the tests import (fixtures come through tests/conftest.py): paths and `prl` as a user runs it."""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import pytest

from testkit.ports import free_port  # noqa: F401 (the tests import it from here)

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent

SHIPPED = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
"""Names of the shipped topologies (configs/*.yaml)."""

STAND_IN_STEP = 1
"""The weights step a stand-in source run publishes (`stand_in_source_run`)."""


def stand_in_source_run(name: str, cwd: Path) -> Path | None:
    """For a shipped topology that starts from another run's weights (`model.from_run`, relative to where prl
    runs): a stand-in of that run under `cwd`, a plan.json and one published (empty) weights step, so the
    topology plans without the earlier run having been trained. For one attached to an inference pool
    (`inference.attach`): that pool's plan, as the shipped pool topology of the same name plans it there. None
    for a topology with neither."""
    import yaml

    from prl.run.rundir import RunDir

    topology = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    attach = (topology.get("inference") or {}).get("attach")
    if attach is not None:
        from prl.planner.prepare import prepare

        assert not Path(attach).is_absolute(), f"configs/{name}.yaml: a shipped inference.attach must be relative"
        pool = RunDir(cwd / attach)
        pool.root.mkdir(parents=True)
        planned = prepare(REPO / "configs" / f"{Path(attach).name}.yaml", [f"run_dir={pool.root}"], cwd=cwd).plan
        pool.plan_json.write_text(planned.to_json())
        return pool.root
    model = topology.get("model") or {}
    if model.get("from_run") is None:
        return None
    assert not Path(model["from_run"]).is_absolute(), f"configs/{name}.yaml: a shipped from_run must be relative"
    run = RunDir(cwd / model["from_run"])
    run.root.mkdir(parents=True)
    run.plan_json.write_text("{}")  # planning checks that it is a run directory, not what it planned
    run.publish_dir(run.weights(STAND_IN_STEP), lambda tmp: None, step=STAND_IN_STEP)
    return run.root


def prl_cli(env: dict, *args, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """`prl ARGS` as a user runs it, from the repository root; with `check`, it must exit 0."""
    result = subprocess.run([sys.executable, "-m", "prl.cli", *map(str, args)], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=timeout)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.3) -> T:
    """Poll `probe` until it returns something truthy; fail with `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


def run_to_the_end(env: dict, run: Path, timeout: float = 600) -> dict:
    """`prl status RUN --json` once the job ended (cancelled, whatever happens, when the wait fails)."""
    import json

    try:
        return wait_for("the job to end", lambda: (s := json.loads(prl_cli(env, "status", run, "--json").stdout))[
            "state"] in ENDED and s, timeout=timeout, interval=3)
    finally:
        prl_cli(env, "cancel", run, check=False)


@contextlib.contextmanager
def tmpfs(mount: Path, size: str):
    """A tmpfs of `size` (mount's -o size=) at `mount`: a disk that really fills (ENOSPC). Needs root."""
    mount.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs here (needs root): {proc.stderr}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)


def run_one_episode(env, task, ctx):
    """One episode of `task` through the in-process `prl` harness, as the orchestrator runs it: inside
    `env.serving()`, on ModelContext `ctx` (the harness's pooled HTTP session closes with the loop)."""
    import asyncio

    async def run():
        async with env.serving():
            return await env.run_slot(env.slots(task, 1)[0], ctx)

    return asyncio.run(run())


def processes() -> list[tuple[int, int, str]]:
    """(pid, ppid, command line) of every process."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.append((int(entry.name), ppid, cmd))
    return out


def descendants(pid: int, procs: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """The processes under `pid` among `procs` (`processes()`), children before grandchildren."""
    kids = [p for p in procs if p[1] == pid]
    return kids + [d for k in kids for d in descendants(k[0], procs)]


def engine_of(run: Path, port: int) -> int:
    """The vLLM engine-core process of the server of `run` listening on `port`."""
    procs = processes()
    api = [p for p in procs if "prl.inference" in p[2] and str(run) in p[2] and f"--port {port}" in p[2]]
    assert len(api) == 1, f"expected one API server on port {port}: {api}"
    engines = [p for p in descendants(api[0][0], procs) if "EngineCore" in p[2]]
    assert engines, f"no EngineCore under the API server {api[0]}: {descendants(api[0][0], procs)}"
    return engines[0][0]


def publish_endpoint(run, role: str, index: int, url: str, started: float | None = None) -> None:
    """What a server's task publishes once it answers /health (prl/job/runtimes.py): its Endpoint record."""
    from urllib.parse import urlsplit

    from prl.run.records import Endpoint

    where = urlsplit(url)
    run.write_endpoint(Endpoint(role=role, index=index, host=where.hostname or "127.0.0.1", port=where.port,
                                url=url, started=started))
