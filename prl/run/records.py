"""The run directory's records, typed: what each JSON file under a run holds.

    job.json                     JobRecord       `prl submit` (prl/ops/submit.py)
    state/launcher.json          LauncherRecord  the launcher (prl/job/launch.py); logs/attempt_N/launcher.json
                                                 keeps each attempt's last one
    state/<role>.json            RoleStateRecord the role's rank 0: claim, heartbeats, exit (`RunDir.write_state`)
    state/beats/<role>.<K>.json  RankBeat        rank K > 0 of a multi-rank role (`RunDir.rank_heartbeat`)
    state/exits/<role>.<K>.json  TaskExit        task K of a role, as it ends (prl/job/role.py)
    state/errors/<role>.<host>.<pid>.json  RoleError  the prl error line a role's process ended on (prl/errors.py)
    state/endpoints/<role>.<K>.json  Endpoint    how to reach task or replica K of a role (its runtime)
    state/ready/<role>.<K>.json  ReadyMarker     task K of a role is healthy (its runtime; the launcher reads it)
    state/preflight/<role>.<K>.json  PreflightReport  task K's preflight checks (prl status reads them)
    state/stop.json, state/stop/<role>.<R>.json  StopRequest  the launcher stops the job / one replica
    state/weights_feed.json      FeedRecord      the newest weights step the trainer's feeds serve
    state/pins/<owner>.json, state/holds/<owner>.json  StepPin  weights steps cleanup keeps
    state/wandb.json             WandbCursor     `prl wandb`'s W&B run and the last step it logged
    tenants/<name>.json          TenantRecord    a run attached to an inference pool (prl/run/tenants.py)
    */step_N/STABLE              StableMarker    a published step's files (RunDir.finish_publish)

Writers and readers go through `RunDir` (`write_state`, `read_state`, `read_launcher`, `read_job`, ...),
which writes these as indented JSON with the field names below, atomically. Every file carries `version`
(RECORD_VERSION when written). Reading is lenient towards older files: unknown fields are ignored and a
missing optional field takes its default, so a run directory written before `version` existed (read as
version 1) still reads. A file of a later version is refused (`RunDirError` naming the file and the
version): its fields may mean something this prl does not know.

Imports nothing of prl but the errors and the state vocabularies: login nodes and roles read these alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional, TypeVar

import msgspec
from msgspec import Meta

from prl.errors import RunDirError
from prl.run.api import GroupBackend
from prl.states import Backend, LauncherStatus, Role, RoleState, ServerAction

RECORD_VERSION = 2
"""The version of every record written now; bumped whenever a field changes meaning or name.
2: launcher.json's and job.json's `steps` (role -> its srun) are `launches`."""

Time = Annotated[float, Meta(ge=0)]
"""Seconds since the epoch (time.time())."""
Count = Annotated[int, Meta(ge=0)]
Pid = Annotated[int, Meta(ge=1)]
Attempt = Annotated[int, Meta(ge=0)]
"""A job attempt, from 1 (0 only in tests and hand-written files)."""
Signal = Annotated[int, Meta(ge=1, le=64)]


class Record(msgspec.Struct, kw_only=True):
    """Base of a file's record: its format version, then its fields."""

    version: Annotated[int, Meta(ge=1)] = RECORD_VERSION
    """The record format (RECORD_VERSION when written; a file without it is version 1)."""


class Failure(msgspec.Struct, kw_only=True):
    """The first role failure of an attempt (launcher.json `first_failure`): what ended the job."""

    role: str
    reason: str
    """What happened, in words: 'task 0 exited with code 3', 'hung: no progress for ...'."""
    time: Optional[Time] = None
    exit_code: Optional[int] = None
    """The failed task's exit code; None for a hung role (the launcher stopped it)."""
    hung: bool = False
    """The role's main loop stopped reporting progress within the hang bound."""


class ServerFailure(msgspec.Struct, kw_only=True):
    """One server task that ended while the job ran (launcher.json `launches.<role>.failures`)."""

    time: Time
    """When it ended."""
    task: Count
    replica: Count
    node: Optional[str] = None
    exit_code: int
    reason: str
    action: Optional[ServerAction] = None
    """What the launcher did about it; None only while it decides."""
    restarted: Optional[Time] = None
    """When the launcher started it again."""
    ready_after_s: Optional[Annotated[float, Meta(ge=0)]] = None
    """Seconds from its failure until it was ready again."""


class LaunchRecord(msgspec.Struct, kw_only=True):
    """The launcher's record of one role's launch, its `srun` (launcher.json `launches.<role>`)."""

    status: Optional[RoleState] = None
    started: Optional[Time] = None
    ended: Optional[Time] = None
    tasks: Optional[Count] = None
    exit_code: Optional[int] = None
    restarts: Count = 0
    """Servers of this role restarted in this attempt."""
    failures: list[ServerFailure] = msgspec.field(default_factory=list)
    """Each server failure of this attempt, in order."""
    hung_at: Optional[Time] = None
    """When the launcher found the role hung (status HUNG); the fields below say where it stopped."""
    last_heartbeat: Optional[Time] = None
    hung_rank: Optional[Count] = None
    last_step: Optional[int] = None
    last_phase: Optional[str] = None
    hang_bound_s: Optional[float] = None
    error: Optional[str] = None
    """The prl error line the failed role ended on (state/errors, `RoleError`), where it ended on one."""


class DiskFull(msgspec.Struct, kw_only=True):
    """The launcher found the run directory's disk full (launcher.json `disk_full`)."""

    time: Time
    free_bytes: Optional[int] = None
    """Free bytes then (None: the filesystem could not be asked)."""
    released_bytes: Count = 0
    """What giving back the launcher's reserve (state/reserve) freed."""


class LauncherRecord(Record, kw_only=True):
    """state/launcher.json: one attempt of the job as the launcher sees it."""

    attempt: Attempt
    mode: str = "run"
    """run | preflight ($PRL_MODE)."""
    job_id: Optional[str] = None
    """$SLURM_JOB_ID; None for a local run."""
    pid: Optional[Pid] = None
    """The launcher's process (a local run's liveness)."""
    started: Optional[Time] = None
    status: Optional[LauncherStatus] = None
    launches: dict[str, LaunchRecord] = msgspec.field(default_factory=dict)
    """Role -> its launch, for every role started so far (`steps` in version 1)."""
    first_failure: Optional[Failure] = None
    ended: Optional[Time] = None
    exit_code: Optional[int] = None
    """The launcher's own exit code, once it finished."""
    stop_signal: Optional[Signal] = None
    """The signal that stopped the job (scancel, the time-limit warning, Ctrl-C)."""
    stop_time: Optional[Time] = None
    disk_full: Optional[DiskFull] = None

    def launch(self, role: str) -> LaunchRecord:
        """The role's launch record; an empty one before the role started."""
        return self.launches.get(role) or LaunchRecord()


class JobRecord(Record, kw_only=True):
    """job.json: the submitted job's handle, written by `prl submit` once the job exists."""

    job_id: str
    """Slurm's job id, or `local-<time>` for a local run."""
    name: str
    backend: Backend
    cluster: str
    mode: str = "run"
    """run | preflight."""
    hold: Annotated[float, Meta(ge=0)] = 0.0
    """Preflight: seconds to keep the allocation."""
    hetjob: bool = False
    attempt_base: Count = 0
    """Attempts of the run before this submission (the job's attempt N is attempt_base + its run N)."""
    components: dict[str, str] = msgspec.field(default_factory=dict)
    """Het component index -> its group's name."""
    launches: dict[str, int] = msgspec.field(default_factory=dict)
    """Role -> its het component (`steps` in version 1)."""
    submitted: Time
    topology: Optional[str] = None
    """The topology file, resolved."""
    overrides: list[str] = msgspec.field(default_factory=list)
    run_dir: str
    scripts: dict[str, str] = msgspec.field(default_factory=dict)
    """Rendered script (relative path) -> its sha256."""
    pid: Optional[Pid] = None
    """A local run's launcher process."""
    cancelled: Optional[Time] = None
    """When `prl cancel` cancelled it."""


class RoleStateRecord(Record, kw_only=True):
    """state/<role>.json: the role's start, heartbeats and end, written by its rank 0 (one writer)."""

    status: Optional[RoleState] = None
    host: Optional[str] = None
    pid: Optional[Pid] = None
    """The process that holds the role (`claim`): only it records the role's exit."""
    attempt: Optional[Attempt] = None
    started: Optional[Time] = None
    heartbeat: Optional[Time] = None
    """Last sign of life of the role's main loop (the launcher's hang detection reads it)."""
    updated: Optional[Time] = None
    """Last write of this file."""
    ended: Optional[Time] = None
    exit_code: Optional[int] = None
    error: Optional[str] = None
    """Why it failed, in one line."""
    step: Optional[int] = None
    """The step its main loop is at."""
    phase: Optional[str] = None
    """What its main loop does now (generating, waiting_for_weights, trained, ...)."""
    step_s: Optional[Annotated[float, Meta(ge=0)]] = None
    """Longest stretch between heartbeats of the last step: the hang bound grows with it."""
    published: Optional[int] = None
    """Orchestrator: the last rollouts step it published."""
    weights_version: Optional[int] = None
    """Orchestrator: the weights version every server serves."""
    server_errors: Optional[dict[str, Optional[str]]] = None
    """Orchestrator: server URL -> its last failed weights update."""
    weights_attempt: Optional[Attempt] = None
    """Trainer: the attempt whose resume has dropped the replaced attempt's weights steps; until it is this
    attempt, the orchestrator pushes no weights step."""


class RankBeat(Record, kw_only=True):
    """state/beats/<role>.<rank>.json: the heartbeat of one rank other than 0."""

    attempt: Attempt
    heartbeat: Time
    step: Optional[int] = None
    phase: Optional[str] = None
    step_s: Optional[Annotated[float, Meta(ge=0)]] = None


ENGINE_DIED_EXIT = 3
"""The exit code of `python -m prl.inference` when its vLLM engine died under it (a server that vLLM's watchdog
stops exits 0 otherwise, as if it had been asked to): the role runner names the engine as the cause."""


def server_exit_reason(code: int) -> str:
    """Why a server ended before the job stopped, from its exit code alone."""
    if code == ENGINE_DIED_EXIT:
        return f"its vLLM engine died (the server exited with code {code} while the job was running; its log says how)"
    return f"server exited with code {code} while the job was running"


class TaskExit(Record, kw_only=True):
    """state/exits/<role>.<task>.json: how one task ended, in its own words (srun reports only a step's worst)."""

    exit_code: int
    time: Time
    host: Optional[str] = None
    node: Optional[str] = None
    """The Slurm node ($SLURMD_NODENAME), else the host."""
    reason: Optional[str] = None
    """Why a server ended before the job stopped."""
    failed: bool = False
    """A server that ended while the job ran (whatever its code)."""
    lasting: bool = False
    """Its failure would recur on the same node (a failed preflight check): not restarted."""
    with_replica: bool = False
    """Stopped because another task of its multi-node replica failed (not a failure of its own)."""


class RoleError(Record, kw_only=True):
    """state/errors/<role>.<host>.<pid>.json: the one line of the prl error (PrlError) a process of a role ended
    on, as it printed it to its log. torchrun, srun and the role runner pass on only exit codes (torchrun makes a
    rank's 2 a 1): the launcher names the role's failure by this line, and `prl status` and `prl submit --local`
    show it."""

    line: str
    time: Time
    rank: Optional[Count] = None
    """The trainer rank that raised it ($RANK under torchrun); None for a process of its own."""


class FeedRecord(Record, kw_only=True):
    """state/weights_feed.json: the newest weights step the trainer's feeds serve from memory
    (`weights.transport: memory | broadcast`, prl/weights/memory.py), written by its rank 0 after every writer
    rank's feed holds the step."""

    step: Annotated[int, Meta(ge=1)]
    feeds: Annotated[list[str], Meta(min_length=1)]
    """host:port of each writer rank's feed, which together hold the step."""
    time: Time
    group_timeout: Optional[Annotated[float, Meta(gt=0)]] = None
    """The feeds also broadcast to groups, each stage bounded by this many seconds (None: they send to no
    groups)."""
    backend: GroupBackend = "gloo"
    """The groups' torch.distributed backend (`weights.backend`, resolved on the trainer's device)."""


class Endpoint(Record, kw_only=True):
    """state/endpoints/<role>.<index>.json: how to reach task or replica `index` of a role (written by its
    runtime, prl/job/runtimes.py): a server's or the router's URL once healthy, a multi-node server's head
    address for its followers, the trainer's rendezvous."""

    role: Role
    index: Count
    """The replica (servers, the router) or the task (the trainer's node 0)."""
    host: str
    """The node's address, as the other nodes reach it."""
    port: Optional[Annotated[int, Meta(ge=1, le=65535)]] = None
    url: Optional[str] = None
    """http://host:port of a server or the router, once it answers /health (None: a head's address alone)."""
    started: Optional[Time] = None
    """When this server process became healthy: a new value is a new process at the same URL (a restart)."""
    restart: Count = 0
    """Which restart of the task this is (0: the first start)."""


class ReadyMarker(Record, kw_only=True):
    """state/ready/<role>.<task>.json: the task is healthy; the launcher starts what waits for the role after all
    of its tasks wrote one."""

    host: str
    time: Time


class PreflightCheck(msgspec.Struct):
    """One check of a task's preflight (prl/job/preflight.py)."""

    name: str
    level: Literal["ok", "warn", "error"]
    detail: str


class PreflightReport(Record, kw_only=True):
    """state/preflight/<role>.<task>.json: what the task's preflight found (`prl status` names a failed one's log)."""

    host: str
    node: Optional[str] = None
    checks: list[PreflightCheck] = msgspec.field(default_factory=list)
    ok: bool


class StopRequest(Record, kw_only=True):
    """state/stop.json (every task of the attempt) or state/stop/<role>.<replica>.json (the live tasks of one
    multi-node replica whose other task failed): the launcher asks them to stop; they pass SIGTERM on."""

    attempt: Attempt
    time: Time
    signal: Optional[Signal] = None
    """The signal that stopped the job (None: a replica restarted whole)."""


class StepPin(Record, kw_only=True):
    """state/pins/<owner>.json (keep weights step `step` and later) or state/holds/<owner>.json (keep step `step`
    itself) for `owner` (the orchestrator, a restarted server's task, an evaluation task): cleanup reads them."""

    step: Annotated[int, Meta(ge=0)]
    time: Time
    """When its owner last wrote or renewed it: cleanup counts it until `retention.LEASE_S` after."""


class WandbCursor(Record, kw_only=True):
    """state/wandb.json: the W&B run `prl wandb` logs this run to, and the last step it logged."""

    id: str
    step: int = -1


class TenantRecord(Record, kw_only=True):
    """tenants/<name>.json in an inference pool's run directory: a run attached to it (prl/run/tenants.py)."""

    name: str
    run_dir: str
    key_sha256: Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]
    """SHA-256 of the run's API key (the key itself stays in the run's directory)."""
    attached: Optional[Time] = None
    generation_sha256: Optional[Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]] = None
    """SHA-256 of the run's generation-only key (prl.run.api.generation_key); absent in records written before."""


class ToolCallText(msgspec.Struct, kw_only=True):
    """A tool call the model made, as it wrote it."""

    name: str
    arguments: str


class Turn(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One message of a rollout's conversation, as text (pictures counted, not kept)."""

    role: Literal["system", "user", "assistant", "tool"]
    text: str = ""
    reasoning: str = ""
    """The model's reasoning, where the server returned it apart."""
    tool_calls: list[ToolCallText] = []
    tool_call_id: str = ""
    """A tool message: the call it answers."""
    pictures: int = 0
    """Pictures in the message (`image_url` parts)."""


ROLLOUT_FATES = ("trained", "zero_advantage", "failed", "resampled", "stale", "evaluated")
"""What became of a rollout: trained, or dropped (its group's advantages were all zero and
`drop_zero_groups` left it out; an episode of its group failed; dynamic sampling replaced its group; its group
became older than the staleness bound while queued, or was cancelled for it while running), or scored by an
evaluation (`prl eval --records`), which trains nothing."""


class RolloutRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One rollout as a person reads it: the conversation, what it scored and why, and what became of it."""

    group: Annotated[int, Meta(ge=0)]
    """Its group's index in the step (a group's rollouts share a task)."""
    index: Annotated[int, Meta(ge=0)]
    """Its index in its group."""
    env: str
    reward: float
    rewards: dict[str, float] = {}
    """Each reward function's score."""
    metrics: dict[str, float] = {}
    """The environment's metrics."""
    advantage: Optional[float] = None
    """Its group-relative advantage (None: not trained)."""
    fate: Literal["trained", "zero_advantage", "failed", "resampled", "stale", "evaluated"] = "trained"
    completion_tokens: int = 0
    turns: int = 0
    truncated: bool = False
    policy_version: int = 0
    """The weights version it started on; `lag` behind the step that trains it."""
    policy_version_end: int = 0
    lag: int = 0
    error: Optional[str] = None
    conversation: list[Turn] = []
    clipped: bool = False
    """Some text was cut to the record's bound (ROLLOUT_TEXT_CHARS a message)."""


class RolloutSample(Record, kw_only=True):
    """samples/step_N.json: a bounded sample of step N's rollouts (whole groups), written by the orchestrator
    once the step is published (`orchestrator.rollout_records`), or by `prl eval` per rollout."""

    step: Annotated[int, Meta(ge=0)]
    """The rollouts step (0: an evaluation)."""
    rollouts: int = 0
    """Every rollout the step ran (the sample is a part of them)."""
    records: list[RolloutRecord] = []


class StableMarker(Record, kw_only=True):
    """A published step's STABLE marker: what it holds, so a reader can check every file is there whole, and
    who wrote it."""

    files: dict[str, Annotated[int, Meta(ge=0)]]
    """Each file under the step (relative path) and its size in bytes."""
    time: Optional[Time] = None
    host: Optional[str] = None
    pid: Optional[Pid] = None
    attempt: Optional[Attempt] = None
    step: Optional[int] = None
    """The step published (weights, checkpoints, rollouts)."""
    samples: Optional[Count] = None
    """Rollouts: how many samples the batch holds."""


MAX_MARKER_BYTES = 16 << 20
"""Largest STABLE marker read (a sharded checkpoint of thousands of files lists well under 1 MiB)."""


def read_marker(path: Path) -> StableMarker | None:
    """The marker at `path`; None for one that is missing, too large, not a marker, or hostile (nesting too
    deep, a file named outside its step): such a step is simply not published."""
    try:
        if path.stat().st_size > MAX_MARKER_BYTES:
            return None
        marker = msgspec.json.decode(path.read_bytes(), type=StableMarker)
    except (OSError, msgspec.DecodeError, RecursionError):
        return None
    inside = all(name and not name.startswith("/") and ".." not in name.split("/") and size >= 0
                 for name, size in marker.files.items())
    return marker if inside else None


R = TypeVar("R", bound=Record)


_RENAMED: dict[type, dict[str, str]] = {LauncherRecord: {"steps": "launches"}, JobRecord: {"steps": "launches"}}
"""Fields a record of version 1 names otherwise: old name -> this version's (read as if written now)."""


class _Version(msgspec.Struct):
    version: int = 1


def encode(record: msgspec.Struct) -> dict:
    """The record as JSON-ready builtins (enums as their values), every field included."""
    return msgspec.to_builtins(record)


def decode(data: bytes | str, kind: type[R], where: str | Path) -> R:
    """`data` (a file's text) as a `kind`: unknown fields ignored, missing optional ones defaulted; a
    RunDirError naming `where` for a later version or a field of the wrong type."""
    try:
        version = msgspec.json.decode(data, type=_Version).version
    except msgspec.DecodeError as exc:
        raise RunDirError(f"{where}: not a prl record ({exc})") from None
    if version > RECORD_VERSION:
        raise RunDirError(f"{where}: record version {version} is newer than this prl reads "
                          f"({RECORD_VERSION}); use the prl that wrote the run")
    renamed = _RENAMED.get(kind, {}) if version < RECORD_VERSION else {}
    try:
        if not renamed:
            return msgspec.json.decode(data, type=kind)
        fields = msgspec.json.decode(data)
        for old, new in renamed.items():
            if old in fields and new not in fields:
                fields[new] = fields.pop(old)
        return msgspec.convert({**fields, "version": RECORD_VERSION}, kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RunDirError(f"{where}: not a valid {kind.__name__} ({exc})") from None


def read(path: str | Path, kind: type[R]) -> R | None:
    """The record in `path`, or None if there is none (yet)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    return decode(data, kind, path)


def convert(fields: dict, kind: type[R], where: str | Path) -> R:
    """A record from fields in memory (a merge of old and new), checked as a reader would check the file."""
    try:
        return msgspec.convert(fields, type=kind)
    except msgspec.ValidationError as exc:
        raise RunDirError(f"{where}: not a valid {kind.__name__} ({exc})") from None
