"""Every closed vocabulary of states, listed once: the job's, the launcher's, a role's; and where a job runs.

The members are `str`s whose value is what Slurm prints, what the JSON files under a
run hold and what `prl status` shows, so `json.dumps`, f-strings and `==` against a
string read from disk all see the plain value (`JobState.RUNNING == "RUNNING"`).
Imports nothing of prl: every layer may use it.
"""

from __future__ import annotations

from enum import Enum


class _Str(str, Enum):
    """A str-valued enum that prints as its value on every Python >= 3.10 (StrEnum is 3.11+)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class JobState(_Str):
    """A job's (or het component's) state: Slurm's, normalized by `prl.ops.slurm.normalize_state`,
    plus the states `prl status` derives from the run directory when Slurm has no say."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    PREEMPTED = "PREEMPTED"
    REQUEUED = "REQUEUED"
    SUSPENDED = "SUSPENDED"
    UNKNOWN = "UNKNOWN"
    """Slurm could not be asked, or printed a state we do not know."""
    PLANNED = "PLANNED"
    """Run directory only: planned, never submitted."""
    STOPPING = "STOPPING"
    """Run directory only: a local launcher is stopping its roles."""
    STOPPED = "STOPPED"
    """Run directory only: the launcher stopped on a signal (Slurm's own STOPPED means SUSPENDED)."""


TERMINAL_STATES = frozenset({
    JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT, JobState.NODE_FAIL,
    JobState.OUT_OF_MEMORY, JobState.PREEMPTED, JobState.STOPPED,
})
"""States a job does not leave (unless requeued, which makes a new PENDING): `prl status --watch` stops."""

FAILED_STATES = frozenset({
    JobState.FAILED, JobState.TIMEOUT, JobState.NODE_FAIL, JobState.OUT_OF_MEMORY, JobState.CANCELLED,
})
"""Terminal states that make `prl status` exit 1."""


class LauncherStatus(_Str):
    """The launcher's `status` in state/launcher.json (one attempt of the job)."""

    STARTING = "starting"
    """Starting the roles in order, waiting for each to be ready."""
    RUNNING = "running"
    """Every role started."""
    STOPPING = "stopping"
    """A signal came (scancel, time-limit warning); the roles are being stopped."""
    COMPLETED = "completed"
    FAILED = "failed"
    """A role failed; the others were stopped."""
    STOPPED = "stopped"
    REQUEUED = "requeued"
    """Stopped at the time-limit warning and requeued itself; the next attempt continues."""


LAUNCHER_ENDED = frozenset({LauncherStatus.COMPLETED, LauncherStatus.FAILED, LauncherStatus.STOPPED})
"""Launcher statuses after which nothing of this run runs any more (its pid may be reused)."""


class RoleState(_Str):
    """A role's state: in its own file (state/<role>.json), in the launcher's record of its
    step (launcher.json `steps`), and in `prl status`, which adds the last three."""

    RUNNING = "running"
    EXITED = "exited"
    """Ended with exit code 0."""
    FAILED = "failed"
    STOPPED = "stopped"
    """Launcher record: ended by the launcher (a signal, or another role's failure)."""
    INTERRUPTED = "interrupted"
    """State file: was running when a later attempt of the job started."""
    WAITING = "waiting"
    """Status only: the job runs, but the launcher has not started this role yet."""
    NOT_STARTED = "not started"
    """Status only: the job ended before the launcher started this role."""
    KILLED = "killed"
    """Status only: still 'running' in a job that ended (killed before it could record its end)."""
    HUNG = "HUNG"
    """Launcher record: its main loop reported no progress within the hang bound; the launcher stopped the job.
    Status also shows it for a live role whose heartbeat is older than the bound."""
    RESTARTING = "restarting"
    """Status only: a server of this role failed and is being restarted inside the allocation."""


class Backend(_Str):
    """Where a job runs (job.json `backend`): the launcher under Slurm, or a local process."""

    SLURM = "slurm"
    LOCAL = "local"


class ServerAction(_Str):
    """What the launcher did about a server that ended while the job ran (launcher.json `failures[].action`)."""

    FAILED = "failed"
    """It ended the job (no restart policy, max_restarts used up, or a failure that would recur)."""
    RESTARTING = "restarting"
    """Started again; not ready yet."""
    RESTARTED = "restarted"
    """Ready again (`ready_after_s` after it failed)."""
