"""One task of one role, started by a launch script: preflight first, then the role's work.

    python -m prl.job.role ROLE --run-dir RUN

The task finds itself in the plan by SLURM_PROCID (or PRL_TASK in local runs).
Modes (PRL_MODE, set at submission):
- `preflight`: run the checks, report ready, keep the allocation for PRL_HOLD seconds
  (heartbeating; SIGTERM ends it early), exit 0. Checks the cluster and the plan
  before a real run, and keeps nodes for debugging.
- `run`: the checks, then the role's runtime (prl/job/runtimes.py): vLLM servers, the P/D
  router, the orchestrator, the trainer under torchrun.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from prl.errors import run_entry, signal_exit
from prl.job import preflight
from prl.job.runtimes import run_role
from prl.log import get_logger, init_logging
from prl.planner.model import Plan
from prl.run.records import TaskExit, server_exit_reason
from prl.run.rundir import RunDir, current_attempt
from prl.states import SERVER_ROLES

log = get_logger(__name__)

HOLD_BEAT_S = 5.0
"""How often a preflight's hold (`--hold S`) heartbeats and logs the time it has left: its own cadence, within
HEARTBEAT_S (what the hang bound counts on), so that a hold of a few seconds still shows its countdown."""


class _Stop:
    """Set by SIGTERM/SIGINT, or by the launcher's stop request in the run directory."""

    signum: int | None = None
    stopping: bool = False
    """True once a stop was asked (kept after `signum` is passed on to the child)."""
    failure: str | None = None
    """Why the runtime failed the child itself (a server that stopped answering /health)."""
    with_replica: bool = False
    """Stopped because another task of its multi-node replica failed (state/stop/<role>.<replica>.json)."""
    lasting: bool = False
    """Its failure will not go away by starting it again on the same node (a preflight check that failed)."""

    def __call__(self, signum: int, _frame: Any) -> None:
        self.signum = signum
        self.stopping = True

    def watch(self, run: RunDir, replica_stop: Path | None = None) -> None:
        """Poll state/stop.json (and this task's replica stop, if any) in the background: srun would kill a
        step rather than pass SIGTERM on, and cannot signal one task of a step."""
        import threading

        def poll() -> None:
            while self.signum is None:
                replica = replica_stop is not None and replica_stop.exists()
                if replica or run.stop_request.exists():
                    self.with_replica = replica
                    self.signum = signal.SIGTERM
                    self.stopping = True
                    return
                time.sleep(0.2)

        threading.Thread(target=poll, daemon=True, name="prl-stop-watch").start()


def task_index() -> int:
    """This task's index in its role: SLURM_PROCID (or PRL_TASK locally); in a restart step, which runs only
    some of the role's tasks, the PRL_TASKS entry at SLURM_PROCID."""
    restarted = os.environ.get("PRL_TASKS", "")
    if restarted:
        procid = os.environ.get("SLURM_PROCID", "0")
        return int(restarted.split(",")[int(procid) if procid.isdigit() else 0])
    for var in ("SLURM_PROCID", "PRL_TASK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def into_rank_log(role: str, run_dir: str) -> None:
    """In a restart step of several tasks (a multi-node replica), srun's %t numbers them from 0: append this
    task's output to its own rank_K.log instead, where `prl logs` finds it."""
    if "," not in os.environ.get("PRL_TASKS", ""):
        return
    path = RunDir(run_dir).role_log(current_attempt(), role, task_index())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _hold(run: RunDir, role: str, task: int, seconds: float, stop: _Stop) -> int:
    deadline = time.monotonic() + seconds
    next_beat = 0.0
    # Short sleeps: a SIGTERM must end the hold well within Slurm's KillWait.
    while time.monotonic() < deadline and stop.signum is None:
        if time.monotonic() >= next_beat:
            if task == 0:
                run.heartbeat(role)
            log.info(f"holding the allocation, {deadline - time.monotonic():.0f} s left")
            next_beat = time.monotonic() + HOLD_BEAT_S
        time.sleep(0.1)
    if stop.signum is not None:
        log.info(f"stopped by signal {stop.signum}")
        return signal_exit(stop.signum)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prl.job.role")
    parser.add_argument("role")
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    return run_entry(f"prl {args.role}", lambda: one_task(args.role, args.run_dir),
                     record=lambda line: RunDir(args.run_dir).write_role_error(args.role, line))


def one_task(role: str, run_dir: str) -> int:
    """This task of `role`, its output in its rank log, its exit recorded; its exit code."""
    into_rank_log(role, run_dir)
    init_logging(role, task_index())
    run = RunDir(run_dir)
    stop = _Stop()
    return record_exit(run, role, run_task(run, role, stop), stop)


def record_exit(run: RunDir, role: str, code: int, stop: _Stop) -> int:
    """Write this task's exit record (state/exits/<role>.<task>.json) and return the task's exit code."""
    record = TaskExit(exit_code=code, time=time.time(), host=socket.gethostname(),
                      node=os.environ.get("SLURMD_NODENAME", socket.gethostname()))
    watched = role in SERVER_ROLES and os.environ.get("PRL_MODE", "run") == "run"
    if watched and stop.with_replica:
        record.with_replica, record.reason = True, "stopped with its replica (another of its tasks failed)"
    elif watched and not stop.stopping:
        # A server has no reason to end before the job stops: whatever its code, that is a failure.
        record.failed, record.lasting = True, stop.lasting
        record.reason = stop.failure or server_exit_reason(code)
        log.error(record.reason)
    try:
        run.write_task_exit(role, task_index(), record)
    except OSError as exc:  # a full disk: the launcher still sees the exit code
        log.error(f"cannot record this task's exit: {exc.strerror} ({exc.filename})")
    if watched and Plan.read(run).failure_policy(role).policy == "restart":
        # The launcher reads the record and restarts this task; a non-zero exit would make srun
        # (--kill-on-bad-exit) kill the healthy servers of the same step too.
        return 0
    return code


def run_task(run: RunDir, role: str, stop: _Stop) -> int:
    plan = Plan.read(run)
    task = task_index()
    mode = os.environ.get("PRL_MODE", "run")
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    replica = plan.server(role, task).replica if role in SERVER_ROLES and mode == "run" else None
    stop.watch(run, None if replica is None else run.replica_stop(role, replica))
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    attempt = current_attempt()
    log.info(f"{mode} on {node} (attempt {attempt}, pid {os.getpid()})")

    checks = preflight.preflight(run, plan, role, task, strict=mode == "run")
    run.write_preflight(role, task, preflight.report(checks))
    for line in preflight.format_checks(checks).splitlines():
        log.info(line)
    bad = preflight.failed(checks)
    if task == 0 and (mode == "preflight" or bad):
        # In a real run the role's runtime claims the role itself (its pid holds it).
        run.claim(role, attempt)
    if bad:
        message = "; ".join(c.detail for c in bad)
        log.error(f"preflight failed: {message}")
        stop.failure = f"preflight failed: {message}"
        # A taken port may free itself (the server this one replaces, still exiting); a missing GPU or model will not.
        stop.lasting = any(c.name != "ports" for c in bad)
        run.write_role_error(role, f"preflight failed: {message}")
        if task == 0:
            run.mark_exit(role, 1, error=f"preflight: {message}")
        return 1

    if mode == "preflight":
        run.mark_ready(role, task, node)
        code = _hold(run, role, task, float(os.environ.get("PRL_HOLD", "0")), stop)
    else:
        code = run_role(run, plan, role, task, stop)
    if task == 0:
        run.mark_exit(role, code, error=None if code == 0 else run.role_error_line(role) or f"exit {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
