"""Every closed vocabulary, listed once: the job's, the launcher's and a role's states, where a job runs, the roles.

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
    launch (launcher.json `launches`), and in `prl status`, which adds the last three."""

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


class Role(_Str):
    """A role of a run: a launch of the job (plan.json `launches[].name`), its files under the run (state/<role>.json,
    logs/attempt_N/<role>/) and `PRL_ROLE` in its environment."""

    INFERENCE = "inference"
    """vLLM servers that generate the rollouts (unified: prefill and decode in one server)."""
    PREFILL = "prefill"
    """vLLM servers that only prefill, handing the KV cache to decode (prefill/decode disaggregation)."""
    DECODE = "decode"
    """vLLM servers that decode from the KV cache prefill handed over."""
    TEACHER = "teacher"
    """vLLM servers of the teacher model that score every sample (on-policy distillation)."""
    REFERENCE = "reference"
    """vLLM servers of a frozen reference model that score every sample (a KL term to it)."""
    ROUTER = "router"
    """The prefill/decode router in front of the disaggregated servers."""
    ORCHESTRATOR = "orchestrator"
    """Runs the environment: rollouts on the servers, scored, batched into rollouts/step_N."""
    TRAINER = "trainer"
    """Trains on each step's rollouts (or an SFT job's data) and publishes weights/step_N."""


SERVER_ROLES = (Role.INFERENCE, Role.PREFILL, Role.DECODE, Role.TEACHER, Role.REFERENCE)
"""Roles that run vLLM servers (`python -m prl.inference`), one task per server process."""

WEIGHT_ROLES = (Role.INFERENCE, Role.PREFILL, Role.DECODE)
"""Servers of the policy: they load each new weights step (the orchestrator's weight watcher updates them)."""

SCORER_ROLES = (Role.TEACHER, Role.REFERENCE)
"""Servers that score samples with a model that never changes; also their topology sections, in het-group order."""

KV_ROLES = (Role.PREFILL, Role.DECODE)
"""The two sides of prefill/decode disaggregation, in het-group order (the router waits for both)."""

HEARTBEAT_ROLES = (Role.TRAINER, Role.ORCHESTRATOR)
"""Roles whose main loop heartbeats in state/<role>.json; the launcher stops the job when a beat is too old."""

MODEL_ROLES = (Role.TRAINER, *WEIGHT_ROLES)
"""Roles that load the student's model (`model.path`); a scorer loads its own."""
