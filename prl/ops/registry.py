"""Which runs this user submitted: `$PRL_HOME/runs.jsonl` (default ~/.local/state/prl), one line per
submission. Light: `prl status` and `prl logs` import this, not the planner. A run's own job handle
(`RUN/job.json`) is `RunDir.read_job`.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from prl.run.records import JobRecord
from prl.run.rundir import RunDir
from prl.states import Backend


class Entry(msgspec.Struct, kw_only=True):
    """One line of the registry: a submission."""

    run_dir: str
    job_id: str
    name: str
    submitted: float
    backend: Backend


def registry_path() -> Path:
    home = os.environ.get("PRL_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state", "prl")
    return Path(home) / "runs.jsonl"


def register(run: RunDir, job: JobRecord) -> None:
    """Append one submission (a single O_APPEND write, so concurrent submits never interleave).

    The registry lists every run directory and job of this user: private (0600 in a 0700 folder), and a
    registry left readable by an older prl is made private on the next write."""
    path = registry_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    entry = Entry(run_dir=str(run.root), job_id=job.job_id, name=job.name, submitted=job.submitted,
                  backend=job.backend)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, msgspec.json.encode(entry) + b"\n")
    finally:
        os.close(fd)


def entries() -> list[Entry]:
    """Every registered submission, oldest first; torn (or foreign) lines skipped."""
    if not registry_path().exists():
        return []
    out = []
    for line in registry_path().read_bytes().splitlines():
        try:
            out.append(msgspec.json.decode(line, type=Entry))
        except msgspec.DecodeError:
            continue
    return out
