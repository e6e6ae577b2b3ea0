"""`prl status`: one row per role, from Slurm and the run directory together.

Slurm says where each het component is (state, nodes, elapsed, pending reason, exit);
the run directory says what the roles did (launcher.json: start, exit, first failure;
state/<role>.json: heartbeat, step; weights/rollouts: progress; metrics.jsonl: reward).
One status call runs at most two Slurm commands (squeue, then sacct for what the
controller has forgotten; `scontrol show job` once when accounting is off), however
many roles there are, and one more (`sacct --duplicates`) once the job has been requeued,
to say how each earlier attempt ended (a node failure, say: the launcher cannot record that). If Slurm cannot be asked the state is UNKNOWN with a note,
never FAILED; without accounting, once the controller forgets the job, the launcher's
own record decides.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from prl.errors import ConfigError, SlurmError
from prl.planner.model import Plan, Launch
from prl.run.records import Failure, JobRecord, LauncherRecord, RoleStateRecord, ServerFailure, LaunchRecord
from prl.run.rundir import RunDir, pid_alive
from prl.ops.registry import entries, registry_path
from prl.states import TERMINAL_STATES, Backend, JobState, LauncherStatus, Role, RoleState, ServerAction

LOG_TAIL_LINES = 15


@dataclass
class RoleRow:
    role: str
    component: str
    slurm_state: JobState | str
    """The component's Slurm state; '' for a local run or before submission."""
    nodes: str = ""
    elapsed: int | None = None
    reason: str = ""
    exit_code: int | None = None
    status: RoleState | str = ""
    """What the launcher, else the role's own state file, says; '' when neither has a word yet."""
    heartbeat_age: float | None = None
    step: int | None = None
    restarts: int = 0
    """Servers of this role restarted in this attempt (launcher.json `restarts`)."""
    failures: list[ServerFailure] = field(default_factory=list)
    """Each server failure of this attempt: task, replica, node, reason, action, ready_after_s."""


class ShownFailure(Failure, kw_only=True):
    """The first failure of the attempt, with the log of its failed task and that log's last lines."""

    log: str | None = None
    log_tail: list[str] = msgspec.field(default_factory=list)


@dataclass
class Earlier:
    """How one earlier attempt of the run ended."""

    attempt: int
    status: LauncherStatus | str
    """The launcher's last status of that attempt; 'killed' when it recorded none."""
    ended: float | None
    failure: Failure | None
    stop_signal: int | None
    slurm_state: str | None = None
    """Slurm's end state of that run of the job (e.g. NODE_FAIL: the launcher cannot record that)."""


@dataclass
class Status:
    run_dir: str
    name: str
    job_id: str | None
    backend: Backend | Literal["none"]
    """Where the job runs; 'none' before it was submitted."""
    state: JobState
    attempt: int | None
    mode: str | None
    roles: list[RoleRow]
    progress: dict[str, Any]
    failure: ShownFailure | None
    notes: list[str] = field(default_factory=list)
    slurm_commands: int = 0
    earlier: list[Earlier] = field(default_factory=list)
    """How each earlier attempt of the run ended: attempt, status, first failure, stop signal, and (Slurm) the
    job's state for that run, e.g. NODE_FAIL."""
    attached: list[dict[str, Any]] | None = None
    """An inference pool: the runs attached to it (name, run_dir, attached, state, adapter_step)."""
    pool: str | None = None
    """A run attached to an inference pool: the pool's run directory."""

    def to_json(self) -> str:
        return json.dumps(msgspec.to_builtins(self), indent=2, sort_keys=True)


def resolve_run(arg: str | None) -> RunDir:
    """A run directory, a job id from the registry, or (None) the most recent run."""
    if arg and not arg.isdigit():
        run = RunDir(Path(arg).expanduser())
        if not run.plan_json.exists():
            raise ConfigError(f"{arg}: not a prl run directory (no plan.json)")
        return run
    known = entries()
    if arg:
        matches = [e for e in known if e.job_id == arg]
        if not matches:
            raise ConfigError(f"job {arg} is not in the run registry ({registry_path()}); pass its run directory")
        return RunDir(matches[-1].run_dir)
    for entry in reversed(known):
        if Path(entry.run_dir, "plan.json").exists():
            return RunDir(entry.run_dir)
    raise ConfigError(f"no runs submitted yet (registry {registry_path()}); pass a run directory")


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=lines)]
    except FileNotFoundError:
        return []


def _failed_log(run: RunDir, attempt: int, role: str) -> Path | None:
    """The log of the task that failed: one whose preflight failed, else the newest."""
    logs = run.rank_logs(attempt, role)
    for rank, log in logs:
        report = run.read_preflight(role, rank)
        if report is not None and not report.ok:
            return log
    return max((log for _, log in logs), key=lambda p: p.stat().st_mtime) if logs else None


_LAUNCHER_TO_JOB = {
    LauncherStatus.STARTING: JobState.RUNNING, LauncherStatus.RUNNING: JobState.RUNNING,
    LauncherStatus.COMPLETED: JobState.COMPLETED, LauncherStatus.FAILED: JobState.FAILED,
    LauncherStatus.REQUEUED: JobState.REQUEUED,
}
_LAUNCHER_LIVE = (None, LauncherStatus.STARTING, LauncherStatus.RUNNING)


def _launcher_state(status: LauncherStatus | None, cancelled: bool) -> JobState:
    """The job's state from the launcher's record alone: no record yet is PENDING; a stop is CANCELLED
    when the user cancelled, else STOPPED."""
    if not status:
        return JobState.PENDING
    return _LAUNCHER_TO_JOB.get(status, JobState.CANCELLED if cancelled else JobState.STOPPED)


def _role_status(launched: LaunchRecord | None, role_state: RoleStateRecord | None, submitted: bool,
                 ended: bool) -> RoleState | str:
    """The launcher's view of a role, else the role's own; a role still 'running' in a job that ended was killed."""
    status = (launched and launched.status) or (role_state and role_state.status) or ""
    if launched is None and submitted:
        return RoleState.NOT_STARTED if ended else RoleState.WAITING
    if ended and status == RoleState.RUNNING:
        return RoleState.KILLED
    if status == RoleState.RUNNING and launched and any(f.action == ServerAction.RESTARTING for f in launched.failures):
        return RoleState.RESTARTING
    return status


def collect(run: RunDir) -> Status:
    plan = Plan.read(run)
    job = run.read_job()
    launcher = run.read_launcher()
    notes: list[str] = []
    backend = job.backend if job else "none"
    rows, commands = _slurm_rows(job, notes) if job and job.backend == Backend.SLURM else (None, 0)
    state = _job_state(job, launcher, rows, notes)
    roles = [_role_row(run, plan, launch, job, launcher, rows, state) for launch in plan.launches]
    _disk_note(run, launcher, notes)
    earlier = _earlier_attempts(run, job, launcher, state)
    if earlier and job and job.backend == Backend.SLURM:
        commands += _slurm_ends(job, earlier, notes)
    mode = launcher.mode if launcher else job.mode if job else None
    return Status(str(run.root), plan.name, job.job_id if job else None, backend, state,
                  launcher.attempt if launcher else None, mode, roles, _progress(run, plan),
                  _failure(run, launcher), notes, commands, earlier,
                  attached=_attached(run) if plan.pool is not None else None, pool=plan.attach)


def _attached(pool: RunDir) -> list[dict[str, Any]]:
    """The runs attached to an inference pool, each with its launcher's status and its newest adapter step."""
    from prl.run.tenants import attached_runs

    out = []
    for entry in attached_runs(pool):
        run = RunDir(entry["run_dir"])
        try:
            launcher = run.read_launcher()
        except (OSError, ValueError, ConfigError):
            launcher = None
        out.append({**entry, "state": str(launcher.status) if launcher else "-",
                    "adapter_step": run.latest_stable("weights")})
    return out


def _disk_note(run: RunDir, launcher: LauncherRecord | None, notes: list[str]) -> None:
    """A note when the run directory's disk is full now, or was when the launcher last looked."""
    full = launcher.disk_full if launcher else None
    if full or run.disk_low():
        when = time.strftime(" at %H:%M:%S", time.localtime(full.time)) if full else ""
        free = run.free_bytes()
        now = "?" if free is None else f"{free / (1 << 20):.1f}"
        notes.append(f"the run directory's disk is full{when} ({now} MiB free now): make room, "
                     f"then `prl submit --resume` continues from the last checkpoint")


def _earlier_attempts(run: RunDir, job: JobRecord | None, launcher: LauncherRecord | None,
                      state: JobState) -> list[Earlier]:
    """The attempts of this submission before the current one (and the current one, if it ended and the job
    waits to run again: requeued), from each attempt's own launcher record."""
    current = launcher.attempt if launcher else 0
    base = job.attempt_base if job else 0
    waiting = state in (JobState.PENDING, JobState.REQUEUED) and (launcher and launcher.status) not in _LAUNCHER_LIVE
    out = []
    for attempt in run.attempts():
        if attempt <= base or attempt > current or (attempt == current and not waiting):
            continue
        record = run.read_launcher(attempt)
        if record is None:
            out.append(Earlier(attempt, RoleState.KILLED, None, None, None))
        else:
            out.append(Earlier(attempt, record.status or RoleState.KILLED, record.ended, record.first_failure,
                               record.stop_signal))
    return out


def _slurm_ends(job: JobRecord, earlier: list[Earlier], notes: list[str]) -> int:
    """Fill in Slurm's end state of each earlier attempt (run k of the job is attempt base + k); one sacct."""
    from prl.ops import slurm

    before = slurm.commands_run()
    try:
        runs = slurm.sacct_runs(job.job_id)
    except SlurmError as exc:
        notes.append(f"Slurm's record of earlier attempts is unavailable ({str(exc).splitlines()[0]})")
        runs = None
    for entry in earlier:
        index = entry.attempt - job.attempt_base - 1
        if runs and 0 <= index < len(runs):
            entry.slurm_state = str(slurm.merge_state(runs[index].values()))
    return slurm.commands_run() - before


def _slurm_rows(job: JobRecord, notes: list[str]) -> tuple[dict[str, Any] | None, int]:
    """Slurm's rows of the job's components (None when Slurm could not be asked) and the commands it took."""
    from prl.ops import slurm

    before = slurm.commands_run()
    rows = None
    try:
        rows = slurm.query_jobs([job.job_id])
    except SlurmError as exc:
        notes.append(f"Slurm could not be asked ({str(exc).splitlines()[0]}); state may be stale")
    return rows, slurm.commands_run() - before


def _job_state(job: JobRecord | None, launcher: LauncherRecord | None, rows: dict[str, Any] | None,
               notes: list[str]) -> JobState:
    """The job's state: Slurm's (the worst component), else the launcher's record, else the local pid."""
    if job is None:
        return JobState.PLANNED
    cancelled = job.cancelled is not None
    status = launcher.status if launcher else None
    if job.backend == Backend.SLURM:
        from prl.ops import slurm

        if rows is None:
            return JobState.UNKNOWN
        if rows:
            return slurm.merge_state(rows.values())
        # Neither the controller nor accounting knows the job any more: the launcher's record decides.
        notes.append("Slurm no longer knows this job (no accounting?); state from the run directory")
        return _launcher_state(status, cancelled)
    alive = pid_alive(job.pid)
    if alive and status == LauncherStatus.STOPPING:
        return JobState.STOPPING
    if alive and status in _LAUNCHER_LIVE:
        return JobState.RUNNING
    if status in _LAUNCHER_LIVE:
        notes.append("the local launcher died without recording an end")
        return JobState.FAILED
    return _launcher_state(status, cancelled)


def _role_row(run: RunDir, plan: Plan, launch: Launch, job: JobRecord | None, launcher: LauncherRecord | None,
              rows: dict[str, Any] | None, state: JobState) -> RoleRow:
    slurm_job = job is not None and job.backend == Backend.SLURM
    component = (f"{job.job_id}+{launch.group}" if plan.hetjob else job.job_id) if slurm_job else ""
    slurm_row = (rows or {}).get(component) if slurm_job else None
    role_state = run.read_state(launch.name)
    launched = launcher.launches.get(launch.name) if launcher else None
    heartbeat = role_state.heartbeat if role_state else None
    return RoleRow(
        role=launch.name, component=component,
        slurm_state=slurm_row.state if slurm_row else (JobState.UNKNOWN if rows is None and slurm_job else ""),
        nodes=slurm_row.nodes if slurm_row else "",
        elapsed=slurm_row.elapsed if slurm_row else None,
        reason=slurm_row.reason if slurm_row and slurm_row.state == JobState.PENDING else "",
        exit_code=launched.exit_code if launched else None,
        status=_role_status(launched, role_state, job is not None, state in TERMINAL_STATES),
        heartbeat_age=round(time.time() - heartbeat, 1) if heartbeat else None,
        step=role_state.step if role_state else None,
        restarts=launched.restarts if launched else 0,
        failures=list(launched.failures) if launched else [],
    )


def _last_step(records: list[dict[str, Any]]) -> int | None:
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    return max(steps, default=None)


def _progress(run: RunDir, plan: Plan) -> dict[str, Any]:
    if plan.pool is not None:
        return {}  # an inference pool trains nothing: its attached runs show theirs
    if not any(launch.name == Role.ORCHESTRATOR for launch in plan.launches):
        # SFT: the trainer alone, weights only with checkpoints; its own records say where it is.
        last = next(iter(reversed(run.read_metrics(Role.TRAINER))), {})
        return {"trainer_step": last.get("step"), "last_loss": last.get("loss"), "epoch": last.get("epoch"),
                "checkpoint": run.latest_stable("checkpoints")}
    # Under `weights.transport: memory` only checkpoint steps reach weights/: the trainer's records say the rest.
    trained = [s for s in (run.latest_stable("weights"), _last_step(run.read_metrics(Role.TRAINER))) if s is not None]
    trainer_step = max(trained, default=None)
    rollout_step = run.latest_stable("rollouts")
    lag = rollout_step - trainer_step if None not in (rollout_step, trainer_step) else None
    progress: dict[str, Any] = {"trainer_step": trainer_step, "rollout_step": rollout_step, "lag": lag,
                                "last_reward": None}
    for record in reversed(run.read_metrics()):
        reward = record.get("reward_mean", record.get("reward"))
        if reward is not None:
            progress["last_reward"] = reward
            break
    return progress




def _failure(run: RunDir, launcher: LauncherRecord | None) -> ShownFailure | None:
    """The first role that failed, with the log of its failed task and that log's last lines."""
    first = launcher.first_failure if launcher else None
    if first is None:
        return None
    log = _failed_log(run, launcher.attempt, first.role)
    return ShownFailure(**msgspec.structs.asdict(first), log=str(log) if log else None,
                        log_tail=log_tail(log) if log else [])


def _failure_line(f: Failure) -> str:
    """'<role> HUNG (<reason>)' or '<role> exited <code> (<reason>)'."""
    what = RoleState.HUNG if f.hung else f"exited {f.exit_code}"
    return f"{f.role} {what} ({f.reason})"


def _attempt_line(entry: Earlier) -> str:
    """'attempt 1 ended: <why>', the why from the launcher's record and Slurm's end state of that run."""
    if entry.failure:
        why = [_failure_line(entry.failure)]
    elif entry.stop_signal:
        why = [f"stopped by signal {entry.stop_signal}"]
    else:
        why = [str(entry.status)]
    if entry.slurm_state:
        why.append(f"Slurm: {entry.slurm_state}")
    when = time.strftime(" at %H:%M:%S", time.localtime(entry.ended)) if entry.ended else ""
    return f"attempt {entry.attempt} ended{when}: " + "; ".join(why)



def _or_dash(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def _elapsed(seconds: int | None) -> str:
    if seconds is None:
        return "-"
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def show(status: Status, console: Any = None) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    color = {JobState.COMPLETED: "green", JobState.RUNNING: "cyan", JobState.PENDING: "yellow"}.get(status.state, "red")
    console.print(f"[bold]{status.name}[/bold]  job {status.job_id or '-'} ({status.backend})  "
                  f"[{color}]{status.state}[/{color}]  attempt {status.attempt or '-'}  mode {status.mode or '-'}")
    console.print(f"run dir {status.run_dir}")
    table = Table(show_edge=False)
    for col in ("role", "component", "slurm", "nodes", "elapsed", "exit", "role state", "heartbeat", "step",
                "restarts", "reason"):
        table.add_column(col, no_wrap=True)
    for r in status.roles:
        table.add_row(r.role, r.component or "-", r.slurm_state or "-", r.nodes or "-", _elapsed(r.elapsed),
                      "-" if r.exit_code is None else str(r.exit_code), r.status or "-", _age(r.heartbeat_age),
                      "-" if r.step is None else str(r.step), str(r.restarts) if r.restarts else "-", r.reason or "")
    console.print(table)
    for r in status.roles:
        for f in r.failures:
            back = f" (serving again {f.ready_after_s} s after)" if f.ready_after_s is not None else ""
            console.print(f"[yellow]{r.role} replica {f.replica} (task {f.task}, node {f.node or '-'}): "
                          f"{f.reason}; {f.action or '-'}{back}[/yellow]", highlight=False)
    p = status.progress
    if status.pool:
        console.print(f"inference: the pool {status.pool}", markup=False, highlight=False)
    if status.attached is not None:
        console.print(f"attached runs: {len(status.attached)}" + ("" if status.attached else " (none)"))
        for a in status.attached:
            console.print(f"  {a['name']}: {a['state']}, adapter step {_or_dash(a['adapter_step'])}, {a['run_dir']}",
                          markup=False, highlight=False)
    elif "last_loss" in p:
        console.print(f"progress: trainer step {_or_dash(p['trainer_step'])}, loss {_or_dash(p['last_loss'], '.4f')}, "
                      f"epoch {_or_dash(p['epoch'], '.2f')}, last checkpoint {_or_dash(p['checkpoint'])}")
    else:
        console.print(f"progress: trainer step {_or_dash(p['trainer_step'])}, rollouts step {_or_dash(p['rollout_step'])}, "
                      f"lag {_or_dash(p['lag'])}, last reward {_or_dash(p['last_reward'])}")
    for entry in status.earlier:
        console.print(f"[yellow]{_attempt_line(entry)}[/yellow]", highlight=False)
    for note in status.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if status.failure:
        f = status.failure
        console.print(f"[red]first failure: {_failure_line(f)}[/red]")
        if f.log:
            console.print(f"last lines of {f.log}:")
            for line in f.log_tail:
                console.print(f"  {line}", markup=False, highlight=False)
