"""Which runs this user submitted: `$PRL_HOME/runs.jsonl` (default ~/.local/state/prl), one line per
submission, and a run's job handle (`RUN/job.json`). Light: `prl status` and `prl logs` import this,
not the planner.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from prl.run.rundir import RunDir


def registry_path() -> Path:
    home = os.environ.get("PRL_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state", "prl")
    return Path(home) / "runs.jsonl"


def register(run: RunDir, job: dict[str, Any]) -> None:
    """Append one submission (a single O_APPEND write, so concurrent submits never interleave)."""
    path = registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"run_dir": str(run.root), "job_id": job["job_id"], "name": job["name"],
                       "submitted": job["submitted"], "backend": job["backend"]}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def entries() -> list[dict[str, Any]]:
    """Every registered submission, oldest first; torn lines skipped."""
    if not registry_path().exists():
        return []
    out = []
    for line in registry_path().read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_job(run: RunDir) -> dict[str, Any] | None:
    """The run's job handle, or None if nothing was submitted from it."""
    try:
        return json.loads(run.job_json.read_text())
    except FileNotFoundError:
        return None
