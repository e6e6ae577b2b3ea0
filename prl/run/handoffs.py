"""What one process hands another through the run directory, as typed records (`Handoffs`).

The JSON files of prl/run/records.py (job.json, state/launcher.json, state/<role>.json, beats, exits,
endpoints, ready markers, preflight reports, stop requests, the feed record, the W&B cursor) are written and
read here as those types, never as dicts; metrics.jsonl is one JSON object per line. Each role's state has one
writer (its rank 0), so read-merge-write is safe.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

from prl.errors import RunDirError, disk_full
from prl.run import records
from prl.run.files import FILE_MODE, atomic_write_json, atomic_write_text, current_attempt, pid_alive
from prl.run.layout import RunLayout, _check_role
from prl.run.records import (Endpoint, FeedRecord, JobRecord, LauncherRecord, PreflightReport, RankBeat, ReadyMarker,
                             RoleError, RoleStateRecord, RolloutSample, StopRequest, TaskExit, WandbCursor)
from prl.states import RoleState

HEARTBEAT_S = 10.0
"""How often a role's main loop heartbeats (state/<role>.json) while it waits for another role's step (and
the orchestrator at most this often as rollouts finish): a role silent for several beats is hung."""

SAMPLES_KEPT = 200
"""Steps whose rollout sample stays (samples/; each under MAX_SAMPLE_BYTES)."""
MAX_SAMPLE_BYTES = 16 << 20
"""Largest rollout sample read back (the orchestrator writes each under ROLLOUT_SAMPLE_BYTES)."""

API_KEY_VAR = "PRL_INFERENCE_API_KEY"
"""Variable through which the role runner hands the run's API key to the servers and router (never to the
orchestrator, whose children inherit its environment: it reads RUN/api_key)."""
GENERATION_KEY_VAR = "PRL_GENERATION_API_KEY"
"""Variable holding the run's generation-only key (`prl.run.api.generation_key`) in the orchestrator and every
process it starts (env workers, their tools), which never see the run's key."""
TRUNCATE_EVENT = "truncate"
"""The `event` of a metrics.jsonl line that drops its role's earlier records after its `after` step."""


def _step(record: dict, key: str = "step") -> int:
    value = record.get(key)
    return value if isinstance(value, int) else -1


def is_truncation(record: dict) -> bool:
    """A metrics.jsonl line that drops its role's earlier records after its `after` step."""
    return record.get("event") == TRUNCATE_EVENT


def dropped_by(truncation: dict, record: dict) -> bool:
    """Whether `truncation` (a line after `record` in metrics.jsonl) drops `record`: the same role, a later step."""
    return record.get("role") == truncation.get("role") and _step(record) > _step(truncation, "after")


class Handoffs(RunLayout):
    """The records of a run, read and written as their types."""

    def read_job(self) -> JobRecord | None:
        """The submitted job's handle (job.json), or None if nothing was submitted from this run."""
        return records.read(self.job_json, JobRecord)

    def write_job(self, job: JobRecord) -> Path:
        return atomic_write_json(self.job_json, job)

    def create_api_key(self) -> Path:
        """A new random key in `api_key_file`, 0600 from creation, replacing any older one atomically."""
        return atomic_write_text(self.api_key_file, secrets.token_urlsafe(32) + "\n")

    def read_api_key(self) -> str:
        """The run's API key; RunDirError when it is missing or empty (callers fail closed)."""
        try:
            key = self.api_key_file.read_text().strip()
        except FileNotFoundError:
            key = ""
        if not key:
            raise RunDirError(f"no API key in {self.api_key_file}: `prl submit` writes one; the servers refuse to "
                              f"start without it. Submit again (with --resume to continue this run).")
        return key

    def read_state(self, role: str) -> RoleStateRecord | None:
        """The role's state, or None if it never wrote one."""
        return records.read(self.role_state(role), RoleStateRecord)

    def write_state(self, role: str, **fields: Any) -> RoleStateRecord:
        """Merge `fields` (fields of `RoleStateRecord`) into the role's state file (atomic replace); return
        the new state.

        Each role has one writer (its rank 0), so read-merge-write is safe.
        """
        unknown = set(fields) - set(RoleStateRecord.__struct_fields__)
        if unknown:
            raise TypeError(f"write_state({role!r}): {', '.join(sorted(unknown))} not a field of RoleStateRecord")
        old = self.read_state(role)
        merged = {**(records.encode(old) if old else {}), **fields, "updated": time.time(),
                  "version": records.RECORD_VERSION}
        state = records.convert(merged, RoleStateRecord, self.role_state(role))
        atomic_write_json(self.role_state(role), state)
        return state

    def heartbeat(self, role: str, **fields: Any) -> RoleStateRecord:
        """Record that `role` is alive now, with optional progress fields (step=..., phase=...)."""
        return self.write_state(role, heartbeat=time.time(), **fields)

    def rank_heartbeat(self, role: str, rank: int, **fields: Any) -> RankBeat:
        """Record that rank `rank` of `role` is alive now (fields of `RankBeat`: step=..., phase=...): the
        launcher then sees a stopped rank that rank 0, still waiting for work of its own, would not show
        until it blocked on that rank."""
        beat = RankBeat(attempt=current_attempt(), heartbeat=time.time(), **fields)
        atomic_write_json(self.rank_beat(role, rank), beat)
        return beat

    def rank_heartbeats(self, role: str) -> dict[int, RankBeat]:
        """rank -> its last heartbeat, for every rank other than 0 that wrote one."""
        _check_role(role)
        out = {}
        for path in (self.state_dir / "beats").glob(f"{role}.*.json"):
            rank = path.stem.rpartition(".")[2]
            beat = records.read(path, RankBeat) if rank.isdigit() else None
            if beat is not None:
                out[int(rank)] = beat
        return out

    def claim(self, role: str, attempt: int | None = None, *, stale_after: float = 300.0) -> RoleStateRecord:
        """Mark `role` as running here for `attempt`, refusing a live clash.

        Another holder of the role blocks the claim when it looks alive: same
        attempt, heartbeat younger than `stale_after` seconds, and (if on this
        host) its pid still exists. That is two runs pointed at one directory,
        or a manual restart while the old job still runs. A later attempt may
        take over (Slurm kills the previous attempt before it requeues); an
        earlier attempt may not.
        """
        attempt = current_attempt() if attempt is None else attempt
        host, pid = socket.gethostname(), os.getpid()
        old = self.read_state(role) or RoleStateRecord()
        old_attempt = -1 if old.attempt is None else old.attempt
        if old_attempt > attempt:
            raise RunDirError(
                f"{role} in {self.root} was already started by attempt {old_attempt}, later than this "
                f"attempt {attempt}; refusing to write over a newer attempt's steps."
            )
        if old.status == RoleState.RUNNING and (old.host, old.pid) != (host, pid) and old_attempt == attempt:
            age = time.time() - (old.heartbeat or old.updated or 0.0)
            if age < stale_after and not (old.host == host and not pid_alive(old.pid)):
                raise RunDirError(
                    f"{role} is already running in {self.root} (attempt {old.attempt}, host {old.host}, "
                    f"pid {old.pid}, heartbeat {age:.0f} s ago); two writers would publish the same steps. "
                    f"Use a new run directory, or stop the other job and wait {stale_after:.0f} s."
                )
        now = time.time()
        return self.write_state(role, status=RoleState.RUNNING, started=now, heartbeat=now, exit_code=None,
                                host=host, pid=pid, attempt=attempt)

    def mark_exit(self, role: str, exit_code: int, error: str | None = None) -> RoleStateRecord | None:
        """Record the role's end (status 'exited' or 'failed'); None when a full disk leaves no room for it
        (the launcher still sees the exit code and names the disk)."""
        status = RoleState.EXITED if exit_code == 0 else RoleState.FAILED
        try:
            return self.write_state(role, status=status, exit_code=exit_code, error=error, ended=time.time())
        except OSError as exc:
            if not disk_full(exc):
                raise
            return None

    def write_weights_feed(self, record: FeedRecord) -> None:
        """Record the newest step the trainer's feeds serve from memory (atomic replace; prl/weights/memory.py)."""
        atomic_write_json(self.weights_feed_file, record)

    def clear_weights_feed(self) -> None:
        """A new trainer attempt's feeds are not the old one's: drop the record until it publishes."""
        self.weights_feed_file.unlink(missing_ok=True)

    def read_weights_feed(self) -> FeedRecord | None:
        """The newest step served from memory and by which feeds; None without a record or for one that does not
        read (being replaced, or written by another prl: the servers then load from disk)."""
        try:
            return records.read(self.weights_feed_file, FeedRecord)
        except RunDirError:
            return None

    def append_metrics(self, record: dict) -> None:
        """Append one JSON line to metrics.jsonl (one write call, O_APPEND). A line torn by a full disk stays
        a line of its own: the next record starts on a new line, so readers skip only the torn one."""
        line = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")
        fd = os.open(self.metrics_jsonl, os.O_RDWR | os.O_APPEND | os.O_CREAT, FILE_MODE)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line
            if os.write(fd, line) < len(line):
                raise OSError(errno.ENOSPC, f"short write of a metrics record ({os.strerror(errno.ENOSPC)})",
                              str(self.metrics_jsonl))
        finally:
            os.close(fd)

    def read_metrics(self, role: str | None = None) -> list[dict]:
        """All metric records (optionally of one role), skipping a torn line, with each truncation record
        (`drop_metrics_after`) applied to the lines before it; the truncation records themselves are not
        returned."""
        if not self.metrics_jsonl.exists():
            return []
        out = []
        for line in self.metrics_jsonl.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a writer killed mid-line; the rest of the file is fine
            if not isinstance(rec, dict):
                continue
            if is_truncation(rec):
                out = [r for r in out if not dropped_by(rec, r)]
            elif role is None or rec.get("role") == role:
                out.append(rec)
        return out

    def write_rollout_sample(self, sample: RolloutSample, keep: int = SAMPLES_KEPT) -> Path:
        """samples/step_N.json (atomic replace), then only the newest `keep` steps' samples stay."""
        self.samples_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = atomic_write_json(self.rollout_sample(sample.step), sample)
        for old in self.rollout_sample_steps()[:-keep]:
            self.rollout_sample(old).unlink(missing_ok=True)
        return path

    def read_rollout_sample(self, step: int) -> RolloutSample | None:
        """Step `step`'s sample of rollouts (None: none written); RunDirError for one too large or not one."""
        path = self.rollout_sample(step)
        try:
            if path.stat().st_size > MAX_SAMPLE_BYTES:
                raise RunDirError(f"{path}: {path.stat().st_size} bytes, more than a rollout sample holds "
                                  f"({MAX_SAMPLE_BYTES})")
        except FileNotFoundError:
            return None
        return records.read(path, RolloutSample)

    def read_wandb_cursor(self) -> WandbCursor | None:
        try:
            return records.read(self.wandb_cursor, WandbCursor)
        except RunDirError:
            return None

    def write_wandb_cursor(self, cursor: WandbCursor) -> Path:
        return atomic_write_json(self.wandb_cursor, cursor)

    def drop_metrics_after(self, role: str, step: int) -> int:
        """Drop `role`'s records of steps > `step` (a resume); return how many. Appends a truncation record
        (`{"role", "event": "truncate", "after": step}`) that readers apply to the lines before it: the file
        is never rewritten, since other roles append to it meanwhile (a rewrite loses their lines, and two
        rewrites at once bring back what the other dropped). Only `role` appends `role`'s records, so what
        it appends after this is never dropped by it."""
        dropped = sum(_step(r) > step for r in self.read_metrics(role))
        if dropped:
            self.append_metrics({"role": role, "event": TRUNCATE_EVENT, "after": step, "time": time.time()})
        return dropped

    def read_launcher(self, attempt: int | None = None) -> LauncherRecord | None:
        """The launcher's record of the current attempt (state/launcher.json), or its final record of
        `attempt` (logs/attempt_N/launcher.json); None before the job (that attempt) started."""
        path = self.launcher_state if attempt is None else self.attempt_launcher_state(attempt)
        return records.read(path, LauncherRecord)

    def mark_ready(self, role: str, task: int, host: str) -> ReadyMarker:
        """Say that task `task` of `role` is healthy (the launcher reads it: `read_ready`)."""
        marker = ReadyMarker(host=host, time=time.time())
        atomic_write_json(self.task_ready(role, task), marker)
        return marker

    def read_ready(self, role: str, task: int) -> ReadyMarker | None:
        """Task `task` of `role`'s readiness marker, or None while it is not ready (or withdrew it)."""
        return records.read(self.task_ready(role, task), ReadyMarker)

    def write_preflight(self, role: str, task: int, report: PreflightReport) -> Path:
        return atomic_write_json(self.preflight_report(role, task), report)

    def read_preflight(self, role: str, task: int) -> PreflightReport | None:
        """Task `task` of `role`'s preflight report; None when it wrote none (or one this prl does not read)."""
        try:
            return records.read(self.preflight_report(role, task), PreflightReport)
        except RunDirError:
            return None

    def read_task_exit(self, role: str, task: int) -> TaskExit | None:
        """Task `task` of `role`'s exit record, or None while it runs (or when it could not write one)."""
        return records.read(self.task_exit(role, task), TaskExit)

    def write_task_exit(self, role: str, task: int, record: TaskExit) -> Path:
        return atomic_write_json(self.task_exit(role, task), record)

    def write_role_error(self, role: str, line: str, rank: int | None = None) -> Path:
        """Record the error line this process of `role` ends on (`run_entry`'s `record`)."""
        return atomic_write_json(self.role_error(role, socket.gethostname(), os.getpid()),
                                 RoleError(line=line, time=time.time(), rank=rank))

    def first_role_error(self, role: str) -> RoleError | None:
        """The earliest error line a process of `role` ended on in this attempt: the cause (the others are often
        ranks stopped because of it); None when none ended on a prl error. A record that does not read is skipped."""
        found = []
        for path in self.role_errors(role):
            try:
                found.append(records.read(path, RoleError))
            except RunDirError:
                continue
        return min((r for r in found if r is not None), key=lambda r: r.time, default=None)

    def role_error_line(self, role: str) -> str | None:
        """`first_role_error`'s line as a failure's reason: 'rank K: LINE' where a trainer rank other than 0 raised it."""
        error = self.first_role_error(role)
        if error is None:
            return None
        return f"rank {error.rank}: {error.line}" if error.rank else error.line

    def request_stop(self, path: Path, attempt: int, signum: int | None = None) -> Path:
        """Write a stop request (`stop_request`, or a `replica_stop`) of `attempt`; the tasks watch for it."""
        return atomic_write_json(path, StopRequest(attempt=attempt, time=time.time(), signal=signum))

    def write_endpoint(self, endpoint: Endpoint) -> Path:
        return atomic_write_json(self.endpoint(endpoint.role, endpoint.index), endpoint)

    def read_endpoint(self, role: str, index: int) -> Endpoint | None:
        """Task/replica `index` of `role`'s endpoint, or None before it published one (or after it withdrew it)."""
        return records.read(self.endpoint(role, index), Endpoint)

    def endpoints(self) -> dict[str, dict[int, Endpoint]]:
        """Every endpoint published so far: role -> index -> its Endpoint (one that does not read is left out:
        being replaced, or another prl's)."""
        folder = self.endpoints_dir
        out: dict[str, dict[int, Endpoint]] = {}
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            role, _, index = path.stem.partition(".")
            try:
                found = records.read(path, Endpoint) if index.isdigit() else None
            except RunDirError:
                found = None
            if found is not None:
                out.setdefault(role, {})[int(index)] = found
        return out
