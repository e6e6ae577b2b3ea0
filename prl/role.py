"""One task of one role, started by a step script: preflight first, then the role's work.

    python -m prl.role ROLE --run-dir RUN

The task finds itself in the plan by SLURM_PROCID (or PRL_TASK in local runs).
Modes (PRL_MODE, set at submission):
- `preflight`: run the checks, report ready, keep the allocation for PRL_HOLD seconds
  (heartbeating; SIGTERM ends it early), exit 0. Checks the cluster and the plan
  before a real run, and keeps nodes for debugging.
- `run`: the checks, then the role's runtime. The trainer runs under torchrun; the
  inference, router and orchestrator runtimes are not in this version of prl, and
  such a task stops with that message.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from prl import doctor
from prl.rundir import RunDir, atomic_write_json

HEARTBEAT_SECONDS = 5.0
ENDPOINT_WAIT_SECONDS = 600.0


class _Stop:
    signum: int | None = None

    def __call__(self, signum: int, _frame: Any) -> None:
        self.signum = signum


def task_index() -> int:
    for var in ("SLURM_PROCID", "PRL_TASK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def node_address(plan: dict[str, Any]) -> str:
    """This node's address as other nodes reach it (the profile's interface when it names one)."""
    iface = plan["orchestrator"].get("interface")
    if iface:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface[:15].encode()))  # SIOCGIFADDR
            return socket.inet_ntoa(packed[20:24])
    return socket.gethostbyname(socket.gethostname())


def _say(role: str, task: int, message: str) -> None:
    print(f"[prl {role}.{task} {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _hold(run: RunDir, role: str, task: int, seconds: float, stop: _Stop) -> int:
    deadline = time.monotonic() + seconds
    next_beat = 0.0
    # Short sleeps: a SIGTERM must end the hold well within Slurm's KillWait.
    while time.monotonic() < deadline and stop.signum is None:
        if time.monotonic() >= next_beat:
            if task == 0:
                run.heartbeat(role)
            _say(role, task, f"holding the allocation, {deadline - time.monotonic():.0f} s left")
            next_beat = time.monotonic() + HEARTBEAT_SECONDS
        time.sleep(0.1)
    if stop.signum is not None:
        _say(role, task, f"stopped by signal {stop.signum}")
        return 128 + stop.signum
    return 0


def _wait_endpoint(run: RunDir, role: str, index: int, stop: _Stop) -> dict[str, Any]:
    path = run.endpoint(role, index)
    deadline = time.monotonic() + ENDPOINT_WAIT_SECONDS
    while not path.exists():
        if time.monotonic() > deadline or stop.signum is not None:
            raise SystemExit(f"{role}: no endpoint from task {index} after {ENDPOINT_WAIT_SECONDS:.0f} s ({path})")
        time.sleep(0.2)
    return json.loads(path.read_text())


def run_trainer(run: RunDir, plan: dict[str, Any], task: int, stop: _Stop) -> int:
    """torchrun on this node; node 0 publishes the rendezvous address for the others."""
    import subprocess

    tr = plan["trainer"]
    if task == 0:
        atomic_write_json(run.endpoint("trainer", 0), {"host": node_address(plan), "port": tr["master_port"]})
    head = _wait_endpoint(run, "trainer", 0, stop)
    attempt = os.environ.get("PRL_ATTEMPT", "1")
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={tr['nodes']}",
            f"--nproc-per-node={tr['gpus_per_node']}", f"--node-rank={task}",
            f"--master-addr={head['host']}", f"--master-port={head['port']}",
            "-m", "prl.trainer", "--run-dir", str(run.root)]
    _say("trainer", task, f"attempt {attempt}: {' '.join(argv)}")
    proc = subprocess.Popen(argv)
    while proc.poll() is None:
        if stop.signum is not None:
            proc.send_signal(stop.signum)
            stop.signum = None
        time.sleep(0.5)
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prl.role")
    parser.add_argument("role")
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    run = RunDir(args.run_dir)
    code = run_task(run, args.role)
    atomic_write_json(run.task_exit(args.role, task_index()), {"exit_code": code, "time": time.time(),
                                                                "host": socket.gethostname()})
    return code


def run_task(run: RunDir, role: str) -> int:
    plan = run.read_plan()
    task = task_index()
    mode = os.environ.get("PRL_MODE", "run")
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    _say(role, task, f"{mode} on {node} (attempt {os.environ.get('PRL_ATTEMPT', '1')}, pid {os.getpid()})")

    checks = doctor.preflight(run, plan, role, task, strict=mode == "run")
    atomic_write_json(run.preflight_report(role, task), doctor.report(checks))
    print(doctor.format_checks(checks), flush=True)
    bad = doctor.failed(checks)
    if task == 0 and (mode == "preflight" or bad):
        # In a real run the role's runtime claims the role itself (its pid holds it).
        run.claim(role, int(os.environ.get("PRL_ATTEMPT", "1")))
    if bad:
        message = "; ".join(c.detail for c in bad)
        _say(role, task, f"preflight failed: {message}")
        if task == 0:
            run.mark_exit(role, 1, error=f"preflight: {message}")
        return 1

    if mode == "preflight":
        atomic_write_json(run.task_ready(role, task), {"host": node, "time": time.time()})
        code = _hold(run, role, task, float(os.environ.get("PRL_HOLD", "0")), stop)
    elif role == "trainer":
        atomic_write_json(run.task_ready(role, task), {"host": node, "time": time.time()})
        code = run_trainer(run, plan, task, stop)
    else:
        _say(role, task, f"the {role} runtime is not part of this version of prl; "
                         f"`prl submit --preflight` checks this topology's allocation")
        code = 1
    if task == 0:
        run.mark_exit(role, code, error=None if code == 0 else f"exit {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
