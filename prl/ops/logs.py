"""`prl logs`: the right log file from the run directory's layout, tailed or followed.

    prl logs [RUN] [--role R] [--rank K] [--attempt N] [-n N] [-f]

Default role: the one that failed first, else the last role of the plan (the trainer).
`--role launcher` shows the launcher's own output (the batch log on Slurm). `-f`
follows the file like `tail -f`, moves on to the next attempt's file when the job is
requeued, and stops once the job has ended and the file stopped growing.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, TextIO

from prl.errors import ConfigError
from prl.planner.model import Plan
from prl.run.rundir import RunDir
from prl.ops.status import log_tail
from prl.states import LAUNCHER_ENDED, Backend

FOLLOW_POLL = 0.5
QUIET_AFTER_END = 2.0


def default_role(run: RunDir, plan: Plan) -> str:
    launcher = run.read_launcher()
    failure = launcher.first_failure if launcher else None
    return failure.role if failure else plan.launches[-1].name


def log_path(run: RunDir, role: str, rank: int, attempt: int | None) -> Path:
    if role == "launcher":
        job = run.read_job()
        return run.launcher_log(job.backend, job.job_id) if job else run.launcher_log(Backend.LOCAL)
    names = Plan.read(run).role_names
    if role not in names:
        raise ConfigError(f"no role {role!r} in this run; roles: {', '.join(names)}, launcher")
    if attempt is None:
        attempt = run.latest_attempt()
        if attempt is None:
            raise ConfigError(f"{run.root} has no logs yet (the job has not started); see `prl status`")
    path = run.role_log(attempt, role, rank)
    if not path.exists():
        ranks = [path.stem for _, path in run.rank_logs(attempt, role)]
        have = f"; it has {', '.join(ranks)}" if ranks else "; that role has not started in this attempt"
        raise ConfigError(f"no log {path}{have}")
    return path


def _ended(run: RunDir) -> bool:
    launcher = run.read_launcher()
    return launcher is not None and launcher.status in LAUNCHER_ENDED


def follow(run: RunDir, role: str, rank: int, start_lines: int, out: TextIO = sys.stdout,
           should_stop: Callable[[], bool] = lambda: False) -> None:
    """Print the last lines, then new data as it comes; switch files when a new attempt starts."""
    attempt = run.latest_attempt() if role != "launcher" else None
    path = log_path(run, role, rank, attempt)
    for line in log_tail(path, start_lines):
        out.write(line + "\n")
    out.flush()
    handle = open(path, errors="replace")
    handle.seek(0, 2)
    quiet_since: float | None = None
    while not should_stop():
        chunk = handle.read()
        if chunk:
            out.write(chunk)
            out.flush()
            quiet_since = None
            continue
        if role != "launcher":
            newest = run.latest_attempt()
            if newest is not None and newest != attempt:
                candidate = run.role_log(newest, role, rank)
                if candidate.exists():
                    handle.close()
                    attempt, path = newest, candidate
                    out.write(f"--- attempt {attempt}: {path} ---\n")
                    handle = open(path, errors="replace")
                    continue
        if _ended(run):
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > QUIET_AFTER_END:
                break
        time.sleep(FOLLOW_POLL)
    handle.close()
