"""The run directory: the one place that knows its layout.

Every role (inference, orchestrator, trainer) and the control plane share a
run only through this directory, on a shared filesystem. This module owns
the paths, the atomic hand-off protocol and the cleanup policy; nothing else
joins path pieces under a run. It imports no torch: login nodes import it.

    RUN/
      topology.yaml  plan.json  job.json      asked / planned / submitted
      api_key                                 the run's API key (0600; never in scripts, plans or logs)
      scripts/                                rendered sbatch + step scripts
      logs/attempt_N/<role>/<role>.log        one dir per attempt (requeue = new attempt)
      logs/attempt_N/<role>/rank_K.log        per-rank logs of multi-rank roles
      logs/latest -> attempt_N
      logs/launcher.log | logs/slurm-JOBID.out the launcher's own output (local | Slurm)
      rollouts/step_N/   + STABLE             orchestrator -> trainer
      weights/step_N/    + STABLE             trainer -> inference (HF layout)
      checkpoints/step_N/<role>/ + STABLE     per-role resumable state
      state/launcher.json                     the launcher's record of the current attempt
      state/<role>.json                       start / heartbeat / exit of each role (its rank 0)
      state/beats/<role>.<rank>.json          heartbeats of a multi-rank role's other ranks
      state/exits/<role>.<task>.json          how each task ended
      state/stop.json  state/stop/<role>.<replica>.json   the launcher's stop of the job / of one replica
      state/reserve                           4 MiB the launcher frees on a full disk to record the failure
      metrics.jsonl                           one JSON object per line
      plots/progress.png  wandb/              `prl plot` and `prl wandb` output
      evals/                                  `prl eval --run` sweeps: results, server logs, submitit files
      kv/                                     KV of a storage-based P/D connector (ExampleConnector)

Hand-off protocol (`publish_dir`): write into a hidden temporary sibling
(`.step_N.tmp-a<attempt>-<tag>`), write the marker (every file and its size)
into it as `.STABLE.pending`, fsync every file and directory, rename the
directory to its final name, then rename the pending marker to `STABLE` and
fsync both directories. A temporary dir never holds a `STABLE` marker (a
reader handed its path must not take it for a step), and the marker can only
become `STABLE` inside the directory it describes. A reader accepts a step
only when the marker exists and every file it lists is there with its size
(`is_stable`), so a writer killed (or out of disk) at any point leaves a
hidden temp dir or an unmarked step dir, both ignored by readers and removed
by the next publish of that step by a writer of the same or a later job
attempt (never an earlier one: a stale writer is fenced off), or by `cleanup`.

The JSON records (job.json, state/launcher.json, state/<role>.json, beats, exits) are the typed
records of `prl.run.records`: written and read here as those types, never as dicts.

Steps are numbered from 1: the trainer's step N consumes `rollouts/step_N`
and publishes `weights/step_N` (policy version N; the base model is version 0).
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from prl.errors import RunDirError, StepTimeout, disk_full
from prl.run import records
from prl.run.records import (Endpoint, FeedRecord, JobRecord, LauncherRecord, PreflightReport, RankBeat, ReadyMarker,
                             RoleStateRecord, StableMarker, StepPin, StopRequest, TaskExit, WandbCursor)
from prl.states import Backend, Role, RoleState

ROLES = tuple(Role)
"""Roles that may write state, logs and checkpoints under a run."""

HEARTBEAT_S = 10.0
"""How often a role's main loop heartbeats (state/<role>.json) while it waits for another role's step (and
the orchestrator at most this often as rollouts finish): a role silent for several beats is hung."""

KINDS = ("rollouts", "weights", "checkpoints")
"""Per-step directories under a run."""

API_KEY_VAR = "PRL_INFERENCE_API_KEY"
"""Variable through which the role runner hands the run's API key to the servers, router and orchestrator."""

MARKER = "STABLE"
"""Name of the marker file that makes a published directory visible to readers."""
PENDING_MARKER = ".STABLE.pending"
"""The marker's name inside a directory being published, until the directory has its final name."""

_STEP_RE = re.compile(r"^step_(\d+)$")
_ATTEMPT_RE = re.compile(r"^attempt_(\d+)$")
_RANK_LOG_RE = re.compile(r"^rank_(\d+)\.log$")
_TMP_RE = re.compile(r"^\.step_\d+\.tmp-a(\d+)-")


# ---------------------------------------------------------------- atomic files


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


FILE_MODE = 0o600
"""Mode of every file prl writes under a run (the run directory itself is 0700)."""
RESERVE_BYTES = 4 << 20
"""The launcher's disk reserve (state/reserve): room to record a failure and stop the roles on a full disk."""
LOW_DISK_BYTES = 1 << 20
"""Less free than this under the run directory is a full disk (`RunDir.disk_low`)."""
DIR_MODE = 0o700
"""Mode of the run directory and the directories prl makes in it."""


def atomic_write_bytes(path: str | Path, data: bytes, mode: int = FILE_MODE) -> Path:
    """Write `data` to `path` so a reader sees the old file or the whole new one (created with `mode`)."""
    path = Path(path)
    path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        # 0600 from the first byte: run files may name hosts, ports and paths others should not read.
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str, mode: int = FILE_MODE) -> Path:
    """`atomic_write_bytes` for UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    """`atomic_write_bytes` for a JSON document (indented, trailing newline); a record (`prl.run.records`)
    is written with every field. The records a process hands another are read and written through RunDir's
    methods (`write_endpoint`, `mark_ready`, ...), never as dicts."""
    if isinstance(obj, msgspec.Struct):
        obj = records.encode(obj)
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under `path` (bottom-up), then `path`."""
    for dirpath, _dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def current_attempt(env: Mapping[str, str] | None = None) -> int:
    """This job's attempt number, from 1: one more per Slurm requeue and per `prl submit --resume`.

    $PRL_ATTEMPT when set: the launcher passes it to every task, and `prl submit --local` to
    the launcher. Else (the launcher of a Slurm job) the attempts before this submission
    ($PRL_ATTEMPT_BASE, set by `prl submit`) + Slurm's requeue count ($SLURM_RESTART_COUNT) + 1.
    """
    env = os.environ if env is None else env
    if env.get("PRL_ATTEMPT", "").isdigit():
        return int(env["PRL_ATTEMPT"])
    base, requeues = env.get("PRL_ATTEMPT_BASE", ""), env.get("SLURM_RESTART_COUNT", "")
    return (int(base) if base.isdigit() else 0) + (int(requeues) if requeues.isdigit() else 0) + 1


def step_of(path: str | Path) -> int | None:
    """N for a step directory `.../step_N`; None for any other name."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def is_stable(path: str | Path) -> bool:
    """True when `path` was published completely: its STABLE marker exists and every file it lists is
    there with the size it lists (a reader never takes a step whose files went missing or shrank)."""
    path = Path(path)
    marker = records.read_marker(path / MARKER)
    try:
        return marker is not None and all((path / name).stat().st_size == size for name, size in marker.files.items())
    except OSError:
        return False


def _fence(tmp_name: str) -> int | None:
    """The attempt that owns a temporary publish dir (`.step_N.tmp-a<attempt>-<tag>`); None for another name."""
    m = _TMP_RE.match(tmp_name)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------- the run dir


class RunDir:
    """Paths and protocols of one run directory.

    Constructing it touches nothing on disk; `create()` makes the skeleton.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root).absolute()

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    def create(self) -> RunDir:
        """Make the top-level directories (idempotent); the run directory is private to its owner (0700)."""
        self.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        if self.root.stat().st_mode & 0o777 != DIR_MODE:
            self.root.chmod(DIR_MODE)
        for d in (self.scripts_dir, self.logs_dir, self.state_dir, *(self.root / k for k in KINDS)):
            d.mkdir(mode=DIR_MODE, exist_ok=True)
        return self

    # -- what was asked, planned, submitted
    @property
    def topology_yaml(self) -> Path:
        return self.root / "topology.yaml"

    @property
    def plan_json(self) -> Path:
        return self.root / "plan.json"

    @property
    def job_json(self) -> Path:
        return self.root / "job.json"

    def read_job(self) -> JobRecord | None:
        """The submitted job's handle (job.json), or None if nothing was submitted from this run."""
        return records.read(self.job_json, JobRecord)

    def write_job(self, job: JobRecord) -> Path:
        return atomic_write_json(self.job_json, job)

    @property
    def scripts_dir(self) -> Path:
        return self.root / "scripts"

    # -- the run's API key (every inference server and the router require it)
    @property
    def api_key_file(self) -> Path:
        """The run's API key (mode 0600): written by `prl submit`, read on the nodes by the role runner."""
        return self.root / "api_key"

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

    @property
    def metrics_jsonl(self) -> Path:
        return self.root / "metrics.jsonl"

    # -- logs
    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    def attempt_logs(self, attempt: int) -> Path:
        return self.logs_dir / f"attempt_{attempt}"

    def attempts(self) -> list[int]:
        """Every attempt that has a log dir (logs/attempt_N), ascending."""
        if not self.logs_dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.logs_dir.iterdir() if (m := _ATTEMPT_RE.match(p.name)))

    def latest_attempt(self) -> int | None:
        """The attempt logs/latest points at; else the highest with a log dir; None before the job started."""
        try:
            m = _ATTEMPT_RE.match(os.readlink(self.latest_logs))
        except OSError:
            m = None
        if m:
            return int(m.group(1))
        return max(self.attempts(), default=None)

    @property
    def latest_logs(self) -> Path:
        """Symlink to the newest attempt's log dir (see `link_latest_logs`)."""
        return self.logs_dir / "latest"

    def role_logs_dir(self, attempt: int, role: str) -> Path:
        """logs/attempt_N/<role>: the role's logs of one attempt."""
        _check_role(role)
        return self.attempt_logs(attempt) / role

    def role_log(self, attempt: int, role: str, rank: int | None = None) -> Path:
        name = f"{role}.log" if rank is None else f"rank_{rank}.log"
        return self.role_logs_dir(attempt, role) / name

    def rank_logs(self, attempt: int, role: str) -> list[tuple[int, Path]]:
        """(rank, path) of every per-rank log of `role` in `attempt`, by rank."""
        folder = self.role_logs_dir(attempt, role)
        if not folder.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _RANK_LOG_RE.match(p.name)))

    def launcher_log(self, backend: Backend, job_id: str | None = None) -> Path:
        """The launcher's own output: logs/slurm-JOBID.out on Slurm (the batch script's), else logs/launcher.log."""
        if backend == Backend.SLURM:
            return self.logs_dir / f"slurm-{job_id}.out"
        return self.logs_dir / "launcher.log"

    @property
    def batch_log_pattern(self) -> str:
        """`sbatch --output` pattern of the launcher's log on Slurm (`launcher_log(Backend.SLURM, JOBID)`)."""
        return str(self.logs_dir / "slurm-%j.out")

    def link_latest_logs(self, attempt: int) -> Path:
        """Point logs/latest at attempt_N (atomic replace of the link)."""
        self.attempt_logs(attempt).mkdir(parents=True, exist_ok=True)
        tmp = self.logs_dir / f".latest.tmp-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(f"attempt_{attempt}", tmp)
        os.replace(tmp, self.latest_logs)
        return self.latest_logs

    # -- per-role state
    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    def role_state(self, role: str) -> Path:
        _check_role(role)
        return self.state_dir / f"{role}.json"

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

    def rank_beat(self, role: str, rank: int) -> Path:
        """state/beats/<role>.<rank>.json: the heartbeat of one rank other than 0 (rank 0's is in the role's state)."""
        _check_role(role)
        return self.state_dir / "beats" / f"{role}.{rank}.json"

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

    # -- per-step directories
    def step_dir(self, kind: str, step: int) -> Path:
        if kind not in KINDS:
            raise RunDirError(f"unknown step kind {kind!r}; expected one of {', '.join(KINDS)}")
        if step < 0:
            raise RunDirError(f"step must be >= 0, got {step}")
        return self.root / kind / f"step_{step}"

    @property
    def kv_storage(self) -> Path:
        """kv/: where a storage-based KV connector (`ExampleConnector`) of prefill/decode servers shares KV."""
        return self.root / "kv"

    def weights_root(self) -> Path:
        """weights/, resolved (the run dir itself may sit behind a symlink): what a server may load from."""
        return Path(os.path.realpath(self.root / "weights"))

    def rollouts(self, step: int) -> Path:
        return self.step_dir("rollouts", step)

    def weights(self, step: int) -> Path:
        return self.step_dir("weights", step)

    def checkpoints(self, step: int, role: str | None = None) -> Path:
        """checkpoints/step_N, or checkpoints/step_N/<role> (what one role publishes)."""
        d = self.step_dir("checkpoints", step)
        if role is None:
            return d
        _check_role(role)
        return d / role

    def _published(self, kind: str, step: int, role: str | None) -> Path:
        return self.checkpoints(step, role or Role.TRAINER) if kind == "checkpoints" else self.step_dir(kind, step)

    def steps(self, kind: str) -> list[int]:
        """All step numbers that have a directory of `kind`, stable or not, ascending."""
        base = self.root / kind
        if kind not in KINDS:
            raise RunDirError(f"unknown step kind {kind!r}; expected one of {', '.join(KINDS)}")
        if not base.is_dir():
            return []
        return sorted(step for p in base.iterdir() if (step := step_of(p)) is not None)

    def stable_steps(self, kind: str, role: str | None = None) -> list[int]:
        """Published (STABLE) steps of `kind`, ascending. Checkpoints: of `role` (default trainer)."""
        return [s for s in self.steps(kind) if is_stable(self._published(kind, s, role))]

    def latest_stable(self, kind: str, role: str | None = None) -> int | None:
        steps = self.stable_steps(kind, role)
        return steps[-1] if steps else None

    # -- publishing
    def begin_publish(self, dest: Path, tag: str | None = None) -> Path:
        """Return a fresh, empty temporary dir to fill before `finish_publish(dest, tmp)`.

        Several ranks writing one directory (a sharded checkpoint) pass the same
        `tag` so they agree on the temp name; only one of them calls this, then
        the others wait on a barrier. The temp name carries this job attempt
        (`.step_N.tmp-a<attempt>-<tag>`): leftovers of earlier attempts (whose
        processes are gone) are removed, another writer's dir of this or a later
        attempt never is. Raises RunDirError if `dest` is already published
        (another run or attempt got there first) or a later attempt writes it
        (this writer is stale: fenced off).
        """
        dest = Path(dest)
        if is_stable(dest):
            raise RunDirError(
                f"{dest} is already published (has {MARKER}); another run or attempt wrote this step. "
                f"Resume from a checkpoint (which removes later steps) or use a new run directory."
            )
        attempt = current_attempt()
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.tmp-a{attempt}-{tag or f'{socket.gethostname()}-{os.getpid()}'}"
        for old in dest.parent.glob(f".{dest.name}.tmp-*"):
            owner = _fence(old.name)
            if owner is not None and owner > attempt:
                raise RunDirError(
                    f"{old} belongs to attempt {owner}, later than this writer's attempt {attempt}: this process "
                    f"outlived its job attempt and must not publish {dest}."
                )
            if owner is None or owner < attempt or old == tmp:
                shutil.rmtree(old, ignore_errors=True)  # a dead writer's leftovers: never visible to readers
        # An unmarked step dir is a removal cut short (marker first, then files) or a publish cut short between
        # its two renames: never anyone's work.
        if dest.exists():
            shutil.rmtree(dest)
        tmp.mkdir()
        return tmp

    def finish_publish(self, dest: Path, tmp: Path, *, step: int | None = None, samples: int | None = None) -> Path:
        """Write the marker (files and sizes) into `tmp` as PENDING_MARKER, fsync it all, rename `tmp` to
        `dest`, then the pending marker to STABLE (the module doc's protocol): only a directory under its
        final name ever holds STABLE, and only the marker written for it (a `StableMarker`, with the step it
        publishes and, for rollouts, its samples)."""
        dest = Path(dest)
        if (tmp / MARKER).exists():
            shutil.rmtree(tmp, ignore_errors=True)  # unpublishable, and no reader may find a marked temp dir
            raise RunDirError(f"{tmp / MARKER}: a directory being published holds a {MARKER} marker (copied "
                              f"from a published step?); the publish writes its own")
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        marker = StableMarker(files=files, time=time.time(), host=socket.gethostname(), pid=os.getpid(),
                              attempt=current_attempt(), step=step, samples=samples)
        with open(os.open(tmp / PENDING_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "w") as f:
            f.write(json.dumps(records.encode(marker), indent=2, sort_keys=True) + "\n")
        fsync_tree(tmp)
        try:
            os.rename(tmp, dest)
            os.rename(dest / PENDING_MARKER, dest / MARKER)
        except OSError as e:
            raise RunDirError(f"cannot publish {dest}: another writer created or removed it meanwhile ({e})") from e
        _fsync_dir(dest)
        _fsync_dir(dest.parent)
        return dest

    def publish_dir(self, dest: Path, write: Callable[[Path], Any], *, step: int | None = None,
                    samples: int | None = None) -> Path:
        """Publish a directory atomically: `write(tmp_dir)` fills it, then it becomes `dest` + STABLE.

        If `write` raises, the temp dir is removed and nothing is published.
        """
        tmp = self.begin_publish(dest)
        try:
            write(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self.finish_publish(dest, tmp, step=step, samples=samples)

    def wait_for_step(
        self,
        kind: str,
        step: int,
        timeout: float,
        heartbeat: Callable[[], Any] | None = None,
        *,
        poll: float = 0.5,
        heartbeat_every: float = HEARTBEAT_S,
        role: str | None = None,
    ) -> Path:
        """Block until step `step` of `kind` is published; return its directory.

        Calls `heartbeat()` at start and every `heartbeat_every` seconds while
        waiting, so the waiter never looks hung. Raises StepTimeout after `timeout` s.
        """
        dest = self._published(kind, step, role)
        start = last_beat = time.monotonic()
        if heartbeat is not None:
            heartbeat()
        while not is_stable(dest):
            now = time.monotonic()
            if now - start >= timeout:
                latest = self.latest_stable(kind, role)
                raise StepTimeout(
                    f"waited {timeout:.0f} s for {kind}/step_{step} in {self.root}; latest published "
                    f"{kind} step is {latest}. Is the producer running? See `prl status`."
                )
            if heartbeat is not None and now - last_beat >= heartbeat_every:
                heartbeat()
                last_beat = now
            time.sleep(min(poll, max(0.0, timeout - (now - start))))
        return dest

    # -- cleanup
    def remove_step(self, kind: str, step: int) -> None:
        """Delete a step: the marker first, so readers stop accepting it before files vanish."""
        d = self.step_dir(kind, step)
        for marker in [d / MARKER, *d.glob(f"*/{MARKER}")]:
            marker.unlink(missing_ok=True)
        shutil.rmtree(d, ignore_errors=True)
        for tmp in d.parent.glob(f".{d.name}.tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)

    def remove_steps_after(self, kind: str, step: int) -> list[int]:
        """Delete every step of `kind` later than `step` (a resume's leftovers); return them."""
        later = [s for s in self.steps(kind) if s > step]
        for s in later:
            self.remove_step(kind, s)
        return later

    def cleanup(self, step: int, *, max_off_policy_steps: int, checkpoint_keep: int) -> list[Path]:
        """Drop what neither the staleness bound nor the checkpoint policy needs; return what went.

        After trainer step `step`:
        - weights: keep the newest `max_off_policy_steps + 1` steps (inference
          servers and in-flight rollouts may still use any of them), and every
          step from the oldest one a server serves or may roll back to
          (`weight_pins`, kept by the orchestrator), and each step a live server
          was started from (`weight_holds`: vLLM reads its `--model` directory
          for as long as it runs);
        - checkpoints: keep the newest `checkpoint_keep` trainer checkpoints
          (0 keeps all); older step dirs go whole, every role's part;
        - rollouts: keep those after the newest kept checkpoint (a resume
          replays them; with no checkpoint at all, every one is kept), never
          the ones not yet consumed (> `step`), and always the newest one
          (where a requeued orchestrator resumes).
        Unfinished (unmarked) dirs older than what is kept go as well.
        """
        removed: list[Path] = []

        def drop(kind: str, keep_from: int) -> None:
            for s in self.steps(kind):
                if s < keep_from:
                    self.remove_step(kind, s)
                    removed.append(self.step_dir(kind, s))

        pinned = [v for v in self.weight_pins().values() if v > 0]
        held = set(self.weight_holds().values())
        for s in self.steps("weights"):
            if s < min([step - max_off_policy_steps, *pinned]) and s not in held:
                self.remove_step("weights", s)
                removed.append(self.step_dir("weights", s))
        ckpts = self.stable_steps("checkpoints")
        if checkpoint_keep > 0 and len(ckpts) > checkpoint_keep:
            drop("checkpoints", ckpts[-checkpoint_keep])
            ckpts = ckpts[-checkpoint_keep:]
        replay_from = (ckpts[-1] if ckpts else 0) + 1
        # The newest published rollouts step always stays: a requeued orchestrator resumes after it (and reads
        # its data order); with it gone, it would start again from step 1 and drop its metrics records.
        newest = self.latest_stable("rollouts")
        drop("rollouts", min(replay_from, step + 1, newest if newest is not None else step + 1))
        return removed

    # -- what the servers serve (cleanup keeps it)
    @property
    def pins_dir(self) -> Path:
        return self.state_dir / "pins"

    @property
    def weights_feed_file(self) -> Path:
        return self.state_dir / "weights_feed.json"

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

    def pin_weights(self, owner: str, step: int) -> None:
        """Record that weights step `step` (and later) must stay on disk for `owner` (0: none needed)."""
        path = self.pins_dir / f"{owner}.json"
        if self._steps_in(self.pins_dir).get(owner) != step:
            atomic_write_json(path, StepPin(step=step, time=time.time()))

    def weight_pins(self) -> dict[str, int]:
        """owner -> the oldest weights step it still needs."""
        return self._steps_in(self.pins_dir)

    @property
    def holds_dir(self) -> Path:
        return self.state_dir / "holds"

    def hold_weights(self, owner: str, step: int) -> None:
        """Keep weights step `step` itself (not the ones after it) on disk while `owner` lives: a server
        started with `--model RUN/weights/step_N` reads that directory as long as it runs."""
        atomic_write_json(self.holds_dir / f"{owner}.json", StepPin(step=step, time=time.time()))

    def release_weights(self, owner: str) -> None:
        (self.holds_dir / f"{owner}.json").unlink(missing_ok=True)

    def weight_holds(self) -> dict[str, int]:
        """owner -> the one weights step it holds."""
        return self._steps_in(self.holds_dir)

    @staticmethod
    def _steps_in(folder: Path) -> dict[str, int]:
        steps = {}
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                pin = records.read(path, StepPin)
            except (OSError, RunDirError):
                continue  # not a pin this prl reads (another version, a hand edit): the next cleanup looks again
            if pin is not None:
                steps[path.stem] = pin.step
        return steps

    # -- metrics
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
        """All metric records (optionally of one role), skipping a torn last line."""
        if not self.metrics_jsonl.exists():
            return []
        out = []
        for line in self.metrics_jsonl.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a writer killed mid-line; the rest of the file is fine
            if role is None or rec.get("role") == role:
                out.append(rec)
        return out

    @property
    def evals_dir(self) -> Path:
        """evals/: `prl eval --run` results (sweep-<time>.json), its servers' logs and submitit's files."""
        return self.root / "evals"

    def eval_log(self, step: int) -> Path:
        """The log of the server an evaluation sweep started for weights step `step`."""
        return self.evals_dir / "logs" / f"server_step_{step}.log"

    @property
    def progress_png(self) -> Path:
        """plots/progress.png: `prl plot`'s default output."""
        return self.root / "plots" / "progress.png"

    @property
    def wandb_dir(self) -> Path:
        """W&B's own files for this run (`prl wandb`; offline runs wait here for `wandb sync`)."""
        return self.root / "wandb"

    @property
    def wandb_cursor(self) -> Path:
        """state/wandb.json: the W&B run id and the last step `prl wandb` logged."""
        return self.state_dir / "wandb.json"

    def read_wandb_cursor(self) -> WandbCursor | None:
        try:
            return records.read(self.wandb_cursor, WandbCursor)
        except RunDirError:
            return None

    def write_wandb_cursor(self, cursor: WandbCursor) -> Path:
        return atomic_write_json(self.wandb_cursor, cursor)

    def drop_metrics_after(self, role: str, step: int) -> int:
        """Rewrite metrics.jsonl without `role`'s records for steps > `step` (resume); return how many."""
        if not self.metrics_jsonl.exists():
            return 0
        keep, dropped = [], 0
        for line in self.metrics_jsonl.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            if rec.get("role") == role and int(rec.get("step", -1)) > step:
                dropped += 1
            else:
                keep.append(line)
        if dropped:
            atomic_write_text(self.metrics_jsonl, "".join(line + "\n" for line in keep))
        return dropped

    # -- the launcher and its tasks (prl.job.launch, prl.job.role)
    @property
    def launcher_state(self) -> Path:
        """state/launcher.json: attempt, mode, per-step start/exit, first failure, final status."""
        return self.state_dir / "launcher.json"

    def attempt_launcher_state(self, attempt: int) -> Path:
        """logs/attempt_N/launcher.json: the launcher's final record of attempt N (launcher.json is the latest's)."""
        return self.attempt_logs(attempt) / "launcher.json"

    def read_launcher(self, attempt: int | None = None) -> LauncherRecord | None:
        """The launcher's record of the current attempt (state/launcher.json), or its final record of
        `attempt` (logs/attempt_N/launcher.json); None before the job (that attempt) started."""
        path = self.launcher_state if attempt is None else self.attempt_launcher_state(attempt)
        return records.read(path, LauncherRecord)

    def task_ready(self, role: str, task: int) -> Path:
        """Marker a role's task writes once it is healthy; the launcher starts the next role after all of them."""
        _check_role(role)
        return self.state_dir / "ready" / f"{role}.{task}.json"

    def mark_ready(self, role: str, task: int, host: str) -> ReadyMarker:
        """Say that task `task` of `role` is healthy (the launcher reads it: `read_ready`)."""
        marker = ReadyMarker(host=host, time=time.time())
        atomic_write_json(self.task_ready(role, task), marker)
        return marker

    def read_ready(self, role: str, task: int) -> ReadyMarker | None:
        """Task `task` of `role`'s readiness marker, or None while it is not ready (or withdrew it)."""
        return records.read(self.task_ready(role, task), ReadyMarker)

    def preflight_report(self, role: str, task: int) -> Path:
        _check_role(role)
        return self.state_dir / "preflight" / f"{role}.{task}.json"

    def write_preflight(self, role: str, task: int, report: PreflightReport) -> Path:
        return atomic_write_json(self.preflight_report(role, task), report)

    def read_preflight(self, role: str, task: int) -> PreflightReport | None:
        """Task `task` of `role`'s preflight report; None when it wrote none (or one this prl does not read)."""
        try:
            return records.read(self.preflight_report(role, task), PreflightReport)
        except RunDirError:
            return None

    def probe_file(self) -> Path:
        """A scratch file of this process under state/ (the preflight's check that the run dir is writable)."""
        return self.state_dir / "preflight" / f".probe-{socket.gethostname()}-{os.getpid()}"

    def task_exit(self, role: str, task: int) -> Path:
        """A task's own record of how it ended (exit code, time): srun reports only the step's worst."""
        _check_role(role)
        return self.state_dir / "exits" / f"{role}.{task}.json"

    def read_task_exit(self, role: str, task: int) -> TaskExit | None:
        """Task `task` of `role`'s exit record, or None while it runs (or when it could not write one)."""
        return records.read(self.task_exit(role, task), TaskExit)

    def write_task_exit(self, role: str, task: int, record: TaskExit) -> Path:
        return atomic_write_json(self.task_exit(role, task), record)

    @property
    def reserve(self) -> Path:
        """state/reserve: RESERVE_BYTES of real blocks the launcher gives back when the disk fills, so it can
        still record what failed and ask the roles to stop (`make_reserve`, `release_reserve`)."""
        return self.state_dir / "reserve"

    def make_reserve(self, size: int | None = None) -> bool:
        """Write the reserve (zeros, really allocated); False when the disk has no room for it."""
        size = RESERVE_BYTES if size is None else size
        try:
            with open(self.reserve, "wb") as f:
                for _ in range(size // (1 << 20)):
                    f.write(bytes(1 << 20))
                f.write(bytes(size % (1 << 20)))
                f.flush()
                os.fsync(f.fileno())
            return True
        except OSError:
            self.reserve.unlink(missing_ok=True)
            return False

    def release_reserve(self) -> int:
        """Delete the reserve; the bytes given back (0 when there was none)."""
        try:
            size = self.reserve.stat().st_size
            self.reserve.unlink()
            return size
        except FileNotFoundError:
            return 0

    def disk_low(self) -> bool:
        """Less than LOW_DISK_BYTES free under the run directory (False when the filesystem cannot be asked)."""
        free = self.free_bytes()
        return free is not None and free < LOW_DISK_BYTES

    def free_bytes(self) -> int | None:
        """Bytes free to this user on the run directory's filesystem (None if it cannot be asked)."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    @property
    def stop_request(self) -> Path:
        """Written by the launcher to ask every task of this attempt to stop (checkpoint, then exit)."""
        return self.state_dir / "stop.json"

    def replica_stop(self, role: str, replica: int) -> Path:
        """Written by the launcher to stop the live tasks of one multi-node server replica whose other task
        failed (a head without its followers, or followers without their head, cannot serve), so the replica
        restarts whole."""
        _check_role(role)
        return self.state_dir / "stop" / f"{role}.{replica}.json"

    def request_stop(self, path: Path, attempt: int, signum: int | None = None) -> Path:
        """Write a stop request (`stop_request`, or a `replica_stop`) of `attempt`; the tasks watch for it."""
        return atomic_write_json(path, StopRequest(attempt=attempt, time=time.time(), signal=signum))

    @property
    def endpoints_dir(self) -> Path:
        return self.state_dir / "endpoints"

    def endpoint(self, role: str, index: int) -> Path:
        """Where task/replica `index` of `role` says how to reach it (host, port)."""
        _check_role(role)
        return self.endpoints_dir / f"{role}.{index}.json"

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

    def task_log_pattern(self, attempt: int, role: str) -> str:
        """`srun --output` pattern for one log per task: role_log(attempt, role, rank=K) for task K."""
        return str(self.role_logs_dir(attempt, role) / "rank_%t.log")

    def path(self, relative: str | Path) -> Path:
        """A path the plan records relative to the run directory (a step's script), made absolute."""
        return self.root / relative

    def reset_attempt_state(self) -> None:
        """Forget an earlier attempt's readiness markers and endpoints before a new attempt starts."""
        for sub in ("ready", "endpoints", "preflight", "exits", "beats", "stop"):
            shutil.rmtree(self.state_dir / sub, ignore_errors=True)
        self.stop_request.unlink(missing_ok=True)
        for kind in KINDS:
            base = self.root / kind
            if base.is_dir():
                for tmp in base.glob(".step_*.tmp-*"):
                    shutil.rmtree(tmp, ignore_errors=True)


def pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise RunDirError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
