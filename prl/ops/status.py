"""`prl status`: one row per role, from Slurm and the run directory together.

Slurm says where each het component is (state, nodes, elapsed, pending reason, exit);
the run directory says what the roles did (launcher.json: start, exit, first failure;
state/<role>.json: heartbeat, step; weights/rollouts: progress; metrics.jsonl: reward).
One status call runs at most two Slurm commands (squeue, then sacct for what the
controller has forgotten; `scontrol show job` once when accounting is off), however
many roles there are. If Slurm cannot be asked the state is UNKNOWN with a note,
never FAILED; without accounting, once the controller forgets the job, the launcher's
own record decides.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prl.errors import ConfigError, SlurmError
from prl.run.rundir import RunDir, pid_alive, read_json
from prl.ops.registry import entries, read_job, registry_path

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "STOPPED",
            "BOOT_FAIL", "DEADLINE")
LOG_TAIL_LINES = 15


@dataclass
class RoleRow:
    role: str
    component: str
    slurm_state: str
    nodes: str = ""
    elapsed: int | None = None
    reason: str = ""
    exit_code: int | None = None
    status: str = ""
    """What the role's own state file and the launcher say (running, exited, failed...)."""
    heartbeat_age: float | None = None
    step: int | None = None


@dataclass
class Status:
    run_dir: str
    name: str
    job_id: str | None
    backend: str
    state: str
    attempt: int | None
    mode: str | None
    roles: list[RoleRow]
    progress: dict[str, Any]
    failure: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)
    slurm_commands: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def resolve_run(arg: str | None) -> RunDir:
    """A run directory, a job id from the registry, or (None) the most recent run."""
    if arg and not arg.isdigit():
        run = RunDir(Path(arg).expanduser())
        if not run.plan_json.exists():
            raise ConfigError(f"{arg}: not a prl run directory (no plan.json)")
        return run
    known = entries()
    if arg:
        matches = [e for e in known if str(e.get("job_id")) == arg]
        if not matches:
            raise ConfigError(f"job {arg} is not in the run registry ({registry_path()}); pass its run directory")
        return RunDir(matches[-1]["run_dir"])
    for entry in reversed(known):
        if Path(entry["run_dir"], "plan.json").exists():
            return RunDir(entry["run_dir"])
    raise ConfigError(f"no runs submitted yet (registry {registry_path()}); pass a run directory")


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=lines)]
    except FileNotFoundError:
        return []


def role_logs(run: RunDir, attempt: int, role: str) -> list[Path]:
    folder = run.attempt_logs(attempt) / role
    return sorted(folder.glob("rank_*.log"), key=lambda p: int(p.stem.split("_")[1])) if folder.is_dir() else []


def _failed_log(run: RunDir, attempt: int, role: str) -> Path | None:
    """The log of the task that failed: one whose preflight failed, else the newest."""
    logs = role_logs(run, attempt, role)
    for log in logs:
        report = read_json(run.preflight_report(role, int(log.stem.split("_")[1])))
        if report and not report.get("ok"):
            return log
    return max(logs, key=lambda p: p.stat().st_mtime) if logs else None


def _launcher_state(status: str | None, cancelled: bool) -> str:
    return {"completed": "COMPLETED", "failed": "FAILED", "requeued": "REQUEUED", "running": "RUNNING",
            "starting": "RUNNING", "stopping": "CANCELLED" if cancelled else "STOPPED"}.get(status or "", "CANCELLED" if cancelled else "STOPPED" if status else "PENDING")


def _role_status(launched: dict[str, Any], role_state: dict[str, Any], submitted: bool, ended: bool) -> str:
    """The launcher's view of a role, else the role's own; a role still 'running' in a job that ended was killed."""
    status = launched.get("status") or role_state.get("status") or ""
    if not launched and submitted:
        return "not started" if ended else "waiting"
    if ended and status == "running":
        return "killed"
    return status


def collect(run: RunDir) -> Status:
    plan = run.read_plan()
    job = read_job(run)
    launcher = run.read_launcher()
    notes: list[str] = []
    rows: dict[str, Any] | None = None
    commands = 0
    backend = job["backend"] if job else "none"
    cancelled = bool(job and job.get("cancelled"))

    if job is None:
        state = "PLANNED"
    elif backend == "slurm":
        from prl.ops import slurm

        before = slurm.commands_run()
        try:
            rows = slurm.query_jobs([job["job_id"]])
        except SlurmError as exc:
            notes.append(f"Slurm could not be asked ({str(exc).splitlines()[0]}); state may be stale")
        commands = slurm.commands_run() - before
        if rows is None:
            state = "UNKNOWN"
        elif rows:
            state = slurm.merge_state(rows.values())
        else:
            # Neither the controller nor accounting knows the job any more: the launcher's record decides.
            state = _launcher_state(launcher.get("status"), cancelled)
            notes.append("Slurm no longer knows this job (no accounting?); state from the run directory")
    else:
        alive = pid_alive(job.get("pid"))
        if alive and launcher.get("status") == "stopping":
            state = "STOPPING"
        elif alive and launcher.get("status") in (None, "starting", "running"):
            state = "RUNNING"
        else:
            state = _launcher_state(launcher.get("status"), cancelled)
        if not alive and launcher.get("status") in (None, "starting", "running"):
            state = "FAILED"
            notes.append("the local launcher died without recording an end")
    if state == "STOPPED" and launcher.get("status") == "stopped" and cancelled:
        state = "CANCELLED"

    roles: list[RoleRow] = []
    steps = launcher.get("steps", {})
    for step in plan["steps"]:
        name = step["name"]
        component = ""
        slurm_row = None
        if job and backend == "slurm":
            component = f"{job['job_id']}+{step['group']}" if plan["hetjob"] else job["job_id"]
            slurm_row = (rows or {}).get(component)
        role_state = run.read_state(name) or {}
        launched = steps.get(name, {})
        heartbeat = role_state.get("heartbeat")
        roles.append(RoleRow(
            role=name, component=component,
            slurm_state=slurm_row.state if slurm_row else ("UNKNOWN" if rows is None and backend == "slurm" else ""),
            nodes=slurm_row.nodes if slurm_row else "",
            elapsed=slurm_row.elapsed if slurm_row else None,
            reason=slurm_row.reason if slurm_row and slurm_row.state == "PENDING" else "",
            exit_code=launched.get("exit_code"),
            status=_role_status(launched, role_state, job is not None, state in TERMINAL),
            heartbeat_age=round(time.time() - heartbeat, 1) if heartbeat else None,
            step=role_state.get("step"),
        ))

    trainer_step = run.latest_stable("weights")
    rollout_step = run.latest_stable("rollouts")
    progress: dict[str, Any] = {"trainer_step": trainer_step, "rollout_step": rollout_step,
                                "lag": (rollout_step - trainer_step) if None not in (rollout_step, trainer_step)
                                else None, "last_reward": None}
    for record in reversed(run.read_metrics()):
        reward = record.get("reward_mean", record.get("reward"))
        if reward is not None:
            progress["last_reward"] = reward
            break

    failure = None
    first = launcher.get("first_failure")
    attempt = launcher.get("attempt")
    if first:
        log = _failed_log(run, int(attempt), first["role"])
        failure = {**first, "log": str(log) if log else None, "log_tail": log_tail(log) if log else []}
    return Status(str(run.root), plan["name"], job["job_id"] if job else None, backend, state, attempt,
                  launcher.get("mode") or (job or {}).get("mode"), roles, progress, failure, notes, commands)


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
    color = {"COMPLETED": "green", "RUNNING": "cyan", "PENDING": "yellow"}.get(status.state, "red")
    console.print(f"[bold]{status.name}[/bold]  job {status.job_id or '-'} ({status.backend})  "
                  f"[{color}]{status.state}[/{color}]  attempt {status.attempt or '-'}  mode {status.mode or '-'}")
    console.print(f"run dir {status.run_dir}")
    table = Table(show_edge=False)
    for col in ("role", "component", "slurm", "nodes", "elapsed", "exit", "role state", "heartbeat", "step",
                "reason"):
        table.add_column(col, no_wrap=True)
    for r in status.roles:
        table.add_row(r.role, r.component or "-", r.slurm_state or "-", r.nodes or "-", _elapsed(r.elapsed),
                      "-" if r.exit_code is None else str(r.exit_code), r.status or "-", _age(r.heartbeat_age),
                      "-" if r.step is None else str(r.step), r.reason or "")
    console.print(table)
    p = status.progress
    console.print(f"progress: trainer step {p['trainer_step'] if p['trainer_step'] is not None else '-'}, "
                  f"rollouts step {p['rollout_step'] if p['rollout_step'] is not None else '-'}, "
                  f"lag {p['lag'] if p['lag'] is not None else '-'}, "
                  f"last reward {p['last_reward'] if p['last_reward'] is not None else '-'}")
    for note in status.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if status.failure:
        f = status.failure
        console.print(f"[red]first failure: {f['role']} exited {f['exit_code']} ({f['reason']})[/red]")
        if f.get("log"):
            console.print(f"last lines of {f['log']}:")
            for line in f["log_tail"]:
                console.print(f"  {line}", markup=False, highlight=False)
