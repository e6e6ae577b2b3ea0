"""The launcher: starts a job's roles in order, watches them, ends the job when one fails.

    python -m prl.job.launch --run-dir RUN          (exec'd by scripts/job.sbatch, or by `prl submit --local`)

Inside Slurm each role is one `srun` step with the plan's placement; locally each task
is a process. A role starts once every role it comes after has all its tasks ready
(their `state/ready/` markers: real health, never a sleep); roles that come after none
(the servers, the trainer) start first, together. The first role to exit
non-zero ends the job: the others get SIGTERM, `grace_seconds` to finish a checkpoint,
then SIGKILL. The job completes when the last role (the trainer) exits 0.

An inference server that exits at all before the job stops is a failure of that server;
with `on_failure: restart` (the default) it is started again in the allocation (a new srun
step on its node, `restart_srun_args`; locally a new process), up to `max_restarts` times.
The trainer and orchestrator heartbeat from their main loops; one whose heartbeat is older
than the hang bound (`Plan.hang_bound`) is HUNG: the job stops, and requeues when allowed.

SIGTERM to the launcher (scancel, or the time-limit warning `--signal=B:TERM@N`) is
forwarded the same way; on a time-limit warning with requeue allowed the launcher
requeues the job itself so the next attempt resumes from the last checkpoint.
Everything it sees goes to state/launcher.json, which `prl status` reads.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prl.errors import ConfigError, RunDirError, SlurmError, child_exit, disk_full, run_entry, signal_exit
from prl.log import get_logger, init_logging
from prl.planner.model import KILL_AFTER_S, START_TIMEOUT_S, Plan, Launch
from prl.run.records import (DiskFull, Failure, LauncherRecord, ServerFailure, LaunchRecord, StopRequest, TaskExit,
                              server_exit_reason)
from prl.run.rundir import RunDir, atomic_write_json, current_attempt, pid_alive
from prl.states import (HEARTBEAT_ROLES, LAUNCHER_ENDED, SERVER_ROLES, TERMINAL_STATES, Backend, JobState,
                        LauncherStatus, RoleState, ServerAction)

log = get_logger(__name__)

POLL_SECONDS = 0.5
WANDB_FINAL_S = 60.0
"""How long the launcher waits at the end for its W&B follower to log the last steps."""
OWN_END_S = 30.0
"""After the trainer's last step, how long the roles that end by themselves (the orchestrator, whose steps are
all published by then) get to finish before the job stops them: their exit is then their own, not a stop."""
TENANTS_CHECK_S = 15.0
"""How often an inference pool's launcher looks for attached runs whose job ended without detaching."""


class RoleFailed(Exception):
    def __init__(self, role: str, code: int, reason: str):
        super().__init__(f"{role}: {reason}")
        self.role, self.code, self.reason = role, code, reason


class RoleHung(RoleFailed):
    """A trainer or orchestrator whose main loop reported no progress within the hang bound."""


class Stopped(Exception):
    pass


@dataclass
class Running:
    launch: Launch
    procs: list[subprocess.Popen] = field(default_factory=list)
    exit_code: int | None = None
    task_proc: dict[int, subprocess.Popen] = field(default_factory=dict)
    """The process that runs each task now (one srun for all tasks of a step, or a restart's)."""
    task_started: dict[int, float] = field(default_factory=dict)
    """When each task's current incarnation started (exit records older than that are its predecessor's)."""
    down: dict[int, ServerFailure] = field(default_factory=dict)
    """Tasks that ended and are not running again yet: task -> the failure event."""
    restarts: int = 0

    @property
    def name(self) -> str:
        return self.launch.name

    @property
    def tasks(self) -> int:
        return self.launch.tasks

    def poll(self) -> int | None:
        """None while any process runs; else the first non-zero exit code (or 0)."""
        codes = [p.poll() for p in self.procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return child_exit(failed[0])
        if any(c is None for c in codes):
            return None
        return 0


def ended_jobs(runs: list[RunDir], *, local_pids: bool) -> dict[Path, str]:
    """The runs whose job ended, each with how: Slurm's state for a Slurm job (one query for all of them), the
    launcher's record for a local one, or, with `local_pids` (the local runs' launchers ran on this host), a local
    launcher gone without recording an end. A run that cannot be judged now (Slurm not answering) is absent."""
    from prl.ops import slurm

    out: dict[Path, str] = {}
    on_slurm: dict[Path, str] = {}
    for run in runs:
        try:
            job, launcher = run.read_job(), run.read_launcher()
        except (OSError, ValueError, ConfigError, RunDirError):
            continue
        if job is None:
            continue
        if job.backend == Backend.SLURM:
            on_slurm[run.root] = job.job_id
        elif launcher is not None and launcher.status in LAUNCHER_ENDED:
            out[run.root] = str(launcher.status)
        elif local_pids and job.pid is not None and not pid_alive(job.pid):
            out[run.root] = "its launcher died without recording an end"
    if on_slurm:
        try:
            rows = slurm.query_jobs(on_slurm.values())
        except SlurmError:
            return out
        for root, job_id in on_slurm.items():
            own = [r for k, r in rows.items() if slurm.split_job_key(k)[0] == job_id]
            if own and (state := slurm.merge_state(own)) in TERMINAL_STATES:
                out[root] = str(state)
    return out


class Launcher:
    def __init__(self, run: RunDir, plan: Plan, attempt: int, slurm: bool, mode: str):
        self.run, self.plan, self.attempt, self.slurm, self.mode = run, plan, attempt, slurm, mode
        self.running: dict[str, Running] = {}
        self.signum: int | None = None
        self.slowest_step: dict[str, float] = {}
        self.wandb: subprocess.Popen | None = None
        self.tenants_checked = time.monotonic()
        self.reaper: threading.Thread | None = None
        self.state = LauncherRecord(attempt=attempt, mode=mode, job_id=os.environ.get("SLURM_JOB_ID"),
                                    pid=os.getpid(), started=time.time(), status=LauncherStatus.STARTING)

    # -- bookkeeping
    def save(self) -> None:
        self.write(self.run.launcher_state, self.state)

    def write(self, path: Path, obj: LauncherRecord | StopRequest) -> bool:
        """atomic_write_json that survives a full disk: the first ENOSPC gives back the run's reserve
        (state/reserve) and tries again; a write that still fails is logged and the job goes on (its
        state stays in memory). False when `path` could not be written."""
        for last in (False, True):
            try:
                atomic_write_json(path, obj)
                return True
            except OSError as exc:
                if disk_full(exc) and not last and self.give_back_reserve():
                    continue
                log.error(f"cannot write {path}: {exc.strerror or exc}")
                return False
        return False

    def give_back_reserve(self) -> bool:
        """Note the full disk (once) and give back the reserve; True when that freed something to retry with."""
        if self.state.disk_full is None:
            free = self.run.free_bytes()
            freed = self.run.release_reserve()
            self.state.disk_full = DiskFull(time=time.time(), free_bytes=free, released_bytes=freed)
            log.error(f"the run directory's disk is full ({_mib(free)} free): released the launcher's "
                      f"{_mib(freed)} reserve to record the failure and stop the roles")
            return freed > 0
        return False

    def disk_reason(self) -> str:
        """'; the run directory's disk is full (...)' when it is (or was, in this attempt), else ''."""
        if self.state.disk_full is None and not self.run.disk_low():
            return ""
        self.give_back_reserve()
        return f"; the run directory's disk is full ({_mib(self.state.disk_full.free_bytes)} free)"

    def note_launch(self, name: str, **fields: Any) -> None:
        """Set `fields` (of `LaunchRecord`) in the role's launch record and save."""
        launch = self.state.launches.setdefault(name, LaunchRecord())
        for key, value in fields.items():
            setattr(launch, key, value)
        self.save()

    # -- starting roles
    def start(self, launch: Launch) -> None:
        running = Running(launch)
        self.run.role_logs_dir(self.attempt, launch.name).mkdir(parents=True, exist_ok=True)
        self.spawn(running, list(range(running.tasks)))
        self.running[launch.name] = running
        log.info(f"started {launch.name} ({running.tasks} task(s))")
        self.note_launch(launch.name, started=time.time(), tasks=running.tasks, status=RoleState.RUNNING)

    def spawn(self, running: Running, tasks: list[int], restart: int = 0, nodes: list[str] | None = None) -> None:
        """Start `tasks` of a step: all of them (one srun, or one process each locally), or, on a restart,
        the tasks of one failed server (a new srun step on the nodes they ran on)."""
        launch = running.launch
        script = str(self.run.path(launch.script))
        env = {**os.environ, "PRL_ATTEMPT": str(self.attempt), "PRL_MODE": self.mode, "PRL_RESTART": str(restart)}
        now = time.time()
        if self.slurm:
            if restart:
                env["PRL_TASKS"] = ",".join(map(str, tasks))
                # srun numbers a restart step's tasks from 0: several tasks log to restart_N_%t.log until
                # the role runner moves its output to its own rank log (`into_rank_log`).
                output = str(self.run.role_log(self.attempt, launch.name, tasks[0]) if len(tasks) == 1
                             else self.run.role_logs_dir(self.attempt, launch.name) / f"restart_{restart}_%t.log")
                argv = ["srun", *restart_srun_args(launch.srun_args, nodes or []), f"--output={output}",
                        "--open-mode=append", "bash", script]
            else:
                argv = ["srun", *launch.srun_args, f"--output={self.run.task_log_pattern(self.attempt, launch.name)}",
                        "--open-mode=append", "bash", script]
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
            running.procs.append(proc)
            for t in tasks:
                running.task_proc[t], running.task_started[t] = proc, now
            return
        for task in tasks:
            output = open(self.run.role_log(self.attempt, launch.name, task), "ab")
            task_env = {**env, "PRL_TASK": str(task), "PRL_NODE": str(task // launch.ntasks_per_node)}
            proc = subprocess.Popen(["bash", script], env=task_env, stdout=output, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            output.close()
            running.procs.append(proc)
            running.task_proc[task], running.task_started[task] = proc, now

    def ready(self, name: str) -> bool:
        running = self.running[name]
        return all(self.run.task_ready(name, t).exists() for t in range(running.tasks))

    # -- watching
    def check(self) -> None:
        """Raise Stopped on a signal, RoleFailed on the first role that failed, RoleHung on one that stopped
        making progress; restart servers whose policy says so; record clean exits."""
        if self.signum is not None:
            raise Stopped()
        for name, running in self.running.items():
            if running.exit_code is not None:
                continue
            if name in SERVER_ROLES and self.mode == "run":
                self.check_servers(running)
                continue
            code = running.poll()
            if code is None:
                continue
            self.note_exit(name, running, code)
            if code != 0:
                code, task = self.first_task_failure(name, running.tasks, code)
                running.exit_code = code
                self.note_launch(name, exit_code=code)
                where = f"task {task} " if task is not None else ""
                line = self.state.launches[name].error
                raise RoleFailed(name, code, line or f"{where}exited with code {code}")
            log.info(f"{name} exited 0")
        if self.mode == "run":
            self.check_hangs()
            if self.plan.pool is not None:
                self.check_tenants()

    # -- servers: any exit before the job stops is a failure of that server
    def ended_tasks(self, running: Running) -> dict[int, TaskExit]:
        """Tasks of a server step whose current incarnation ended: task -> its exit record (made up from
        the process's code when the task could not write one)."""
        ended = {}
        for t, proc in running.task_proc.items():
            if t in running.down:
                continue
            record = self.run.read_task_exit(running.name, t)
            if record and record.time >= running.task_started[t]:
                ended[t] = record
            elif proc.poll() is not None:
                code = child_exit(proc.returncode)
                ended[t] = TaskExit(exit_code=code, time=time.time(),
                                    reason=f"task ended (exit {code}) without recording why")
        return ended

    def check_servers(self, running: Running) -> None:
        name = running.name
        policy = self.plan.failure_policy(name)
        for t, record in sorted(self.ended_tasks(running).items()):
            server = self.plan.server(name, t)
            code = record.exit_code
            reason = record.reason or server_exit_reason(code)
            event = ServerFailure(time=record.time, task=t, replica=server.replica, node=record.node, exit_code=code,
                                  reason=reason)
            running.down[t] = event
            if server.head:  # its task withdraws it too, unless it was killed outright
                self.run.endpoint(name, server.replica).unlink(missing_ok=True)
            self.run.task_ready(name, t).unlink(missing_ok=True)
            if record.with_replica:  # stopped by us (below): the replica's failure is already recorded
                log.info(f"{name} task {t} (replica {server.replica}) stopped with its replica")
                continue
            log.warning(f"{name} task {t} (replica {server.replica}, node {event.node}): {reason}")
            if policy.policy != "restart" or running.restarts >= policy.max_restarts or record.lasting:
                why = ("" if policy.policy != "restart" else "; not restarted: it would fail the same way on that node"
                       if record.lasting else f" after {running.restarts} restart(s) (max_restarts)")
                event.action = ServerAction.FAILED
                self._record_event(running, event)
                raise RoleFailed(name, code or 1, f"task {t} (replica {server.replica}): {reason}{why}")
            event.action = ServerAction.RESTARTING
            self._record_event(running, event)
        self.stop_replica_rest(running)
        self.restart_replicas(running)
        self.note_restarted_ready(running)

    def stop_replica_rest(self, running: Running) -> None:
        """Ask the live tasks of each multi-node replica with a failed task to stop: a head without its
        followers (or followers without their head) cannot serve, and the replica restarts only whole."""
        for replica in sorted({self.plan.server(running.name, t).replica for t in running.down}):
            tasks = [s.task for s in self.plan.role_servers(running.name) if s.replica == replica]
            marker = self.run.replica_stop(running.name, replica)
            if not all(t in running.down for t in tasks) and not marker.exists():
                log.warning(f"stopping the other tasks of {running.name} replica {replica} "
                            f"({[t for t in tasks if t not in running.down]}) to restart it whole")
                self.write(marker, StopRequest(attempt=self.attempt, time=time.time()))

    def restart_replicas(self, running: Running) -> None:
        """Start again every replica whose tasks have all ended (a multi-node replica restarts whole)."""
        replicas = {self.plan.server(running.name, t).replica for t in running.down}
        for replica in sorted(replicas):
            tasks = [s.task for s in self.plan.role_servers(running.name) if s.replica == replica]
            if not all(t in running.down for t in tasks):
                continue  # wait for the rest of the replica to go
            nodes = [running.down[t].node or "" for t in tasks]
            running.restarts += 1
            self.run.replica_stop(running.name, replica).unlink(missing_ok=True)
            for t in tasks:
                self.run.task_exit(running.name, t).unlink(missing_ok=True)
                running.down.pop(t).restarted = time.time()
            log.warning(f"restarting {running.name} replica {replica} (tasks {tasks}, restart "
                        f"{running.restarts}/{self.plan.failure_policy(running.name).max_restarts})")
            self.spawn(running, tasks, restart=running.restarts, nodes=nodes)
            self.note_launch(running.name, restarts=running.restarts)

    def _record_event(self, running: Running, event: ServerFailure) -> None:
        self.state.launches.setdefault(running.name, LaunchRecord()).failures.append(event)
        self.save()

    def note_restarted_ready(self, running: Running) -> None:
        """Time each restarted server until it is ready again (the orchestrator may then use it)."""
        changed = False
        for event in self.state.launch(running.name).failures:
            if event.action == ServerAction.RESTARTING and event.restarted is not None and event.ready_after_s is None:
                marker = self.run.read_ready(running.name, event.task)
                if marker is not None and marker.time >= event.restarted:
                    event.ready_after_s = round(marker.time - event.time, 1)
                    event.action = ServerAction.RESTARTED
                    log.info(f"{running.name} task {event.task} ready again, {event.ready_after_s} s "
                             f"after it failed")
                    changed = True
        if changed:
            self.save()

    # -- an inference pool: its attached runs
    def check_tenants(self) -> None:
        """An inference pool, every TENANTS_CHECK_S: detach the attached runs whose job ended without detaching
        (a launcher killed -9 cannot): their adapters are unloaded, their keys refused, `prl status` stops
        listing them. In a thread of its own, one check at a time: Slurm's answer and each server's (10 s for one
        that does not answer) must not hold up this loop's restarts and hang checks."""
        if time.monotonic() < self.tenants_checked + TENANTS_CHECK_S or (self.reaper and self.reaper.is_alive()):
            return
        self.tenants_checked = time.monotonic()
        self.reaper = threading.Thread(target=self.reap_tenants, name="prl-tenants", daemon=True)
        self.reaper.start()

    def reap_tenants(self) -> None:
        from prl.run.tenants import reap

        for name, why in reap(self.run, lambda runs: ended_jobs(runs, local_pids=not self.slurm)).items():
            log.warning(f"attached run {name!r} detached from this pool: {why}")

    # -- hangs: the trainer's and orchestrator's main loops heartbeat in state/<role>.json
    def check_hangs(self) -> None:
        now = time.time()
        for name in HEARTBEAT_ROLES:
            running = self.running.get(name)
            if running is None or running.exit_code is not None:
                continue
            state = self.run.read_state(name)
            if state is None or state.attempt != self.attempt:
                continue
            beat, started = state.heartbeat or 0.0, state.started or 0.0
            if beat <= started:
                continue  # still starting (loading a model): its loop has not reported yet
            slowest = max(self.slowest_step.get(name, 0.0), state.step_s or 0.0)
            self.slowest_step[name] = slowest
            bound = self.plan.hang_bound(slowest or None)
            # The stalest rank: rank 0 keeps beating while it waits for work, so a stopped rank 1 would
            # otherwise show only once rank 0 blocks on it, a whole wait later.
            ranks = [(beat, 0, state.step, state.phase)] + [
                (b.heartbeat, rank, b.step, b.phase) for rank, b in self.run.rank_heartbeats(name).items()
                if b.attempt == self.attempt and b.heartbeat > started]
            beat, rank, step, phase = min(ranks, key=lambda r: r[0])
            age = now - beat
            if age > bound:
                where = f" on rank {rank}" if rank else ""
                self.note_launch(name, status=RoleState.HUNG, hung_at=now, last_heartbeat=beat, hung_rank=rank,
                               last_step=step, last_phase=phase, hang_bound_s=bound)
                raise RoleHung(name, 1, f"hung: no progress{where} for {age:.0f} s (bound {bound:.0f} s); "
                                        f"last step {_or_dash(step)}, phase {_or_dash(phase)}")

    def first_task_failure(self, name: str, tasks: int, fallback: int) -> tuple[int, int | None]:
        """The exit code of the task that failed first: srun reports the step's worst, often a
        sibling killed by --kill-on-bad-exit (143) rather than the cause."""
        records = []
        for task in range(tasks):
            record = self.run.read_task_exit(name, task)
            if record and record.exit_code != 0:
                records.append((record.time, record.exit_code, task))
        if not records:
            return fallback, None
        _, code, task = min(records)
        return code, task

    def wait_ready(self, names: tuple[str, ...] | list[str]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = [n for n in names if n in self.running]
        while True:
            self.check()
            pending = [n for n in waiting if not self.ready(n)]
            for n in [n for n in pending if self.running[n].exit_code == 0]:
                if n not in HEARTBEAT_ROLES:
                    raise RoleFailed(n, 1, "exited 0 before it was ready")
                # Its work was already done (a requeued orchestrator finds every rollouts step published):
                # what waits on it (the trainer) has what it needs.
                log.info(f"{n} finished before it was ready: nothing was left for it to do")
                pending.remove(n)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise RoleFailed(pending[0], 1, f"not ready after {START_TIMEOUT_S:.0f} s")
            time.sleep(POLL_SECONDS)

    def wait_done(self) -> None:
        """Until the trainer (the last step) is done, or, in a preflight (every role only checks and holds, the
        trainer started with the first roles), until every role is."""
        last = self.plan.launches[-1].name
        while True:
            self.check()
            if self.running[last].exit_code == 0 and self.mode == "run":
                self.let_end()
                return
            if all(r.exit_code == 0 for r in self.running.values()):
                return
            time.sleep(POLL_SECONDS)

    def note_exit(self, name: str, running: Running, code: int) -> None:
        """Record a role's own exit (EXITED for 0, else FAILED)."""
        running.exit_code = code
        self.note_launch(name, exit_code=code, ended=time.time(), error=self.run.role_error_line(name) if code else None,
                       status=RoleState.EXITED if code == 0 else RoleState.FAILED)

    def let_end(self) -> None:
        """Give the roles that end by themselves up to OWN_END_S to do so, recording their exits; a failure
        there is recorded, not raised: the trainer's last step is done."""
        deadline = time.monotonic() + OWN_END_S
        while self.signum is None and time.monotonic() < deadline:
            waiting = [(n, r) for n, r in self.running.items() if n not in SERVER_ROLES and r.exit_code is None]
            for name, running in waiting:
                code = running.poll()
                if code is not None:
                    self.note_exit(name, running, code)
                    log.info(f"{name} exited {code}")
            if all(r.exit_code is not None for _, r in waiting):
                return
            time.sleep(POLL_SECONDS)

    # -- stopping
    def stop_all(self, signum: int = signal.SIGTERM) -> None:
        """Ask every task to stop through the run directory, give them the grace period, then kill.

        Not a signal to srun: srun turns SIGTERM into an immediate kill of the step, which would
        leave no time for a checkpoint. The tasks watch state/stop.json and pass SIGTERM on.
        """
        alive = [p for r in self.running.values() for p in r.procs if p.poll() is None]
        asked = self.write(self.run.stop_request, StopRequest(attempt=self.attempt, time=time.time(), signal=signum))
        # Without the request the tasks cannot hear the stop: signal them at once.
        deadline = time.monotonic() + (float(self.plan.grace_seconds) if asked else 0.0)
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in alive:
            if p.poll() is None:
                self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + KILL_AFTER_S
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in alive:
            if p.poll() is None:
                self._signal(p, signal.SIGKILL)
        for p in alive:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for name, running in self.running.items():
            if running.exit_code is None:
                code = running.poll()
                running.exit_code = code
                record = self.state.launches[name]
                record.exit_code, record.ended = code, time.time()
                if record.status != RoleState.HUNG:
                    record.status = RoleState.STOPPED
        self.save()

    def _signal(self, proc: subprocess.Popen, signum: int) -> None:
        try:
            if self.slurm:
                proc.send_signal(signum)  # srun ends its step
            else:
                os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    def finish(self, status: LauncherStatus, code: int) -> int:
        self.state.status, self.state.ended, self.state.exit_code = status, time.time(), code
        self.save()
        if self.plan.attach and status != LauncherStatus.REQUEUED:
            self.leave_pool()
        # Kept beside the attempt's logs: the next attempt's launcher.json replaces this one (restarts, hangs).
        self.write(self.run.attempt_launcher_state(self.attempt), self.state)
        self.stop_wandb()
        (log.info if status == LauncherStatus.COMPLETED else log.warning)(f"job {status} (exit {code})")
        return code

    def leave_pool(self) -> None:
        """A run attached to an inference pool ends: every pool server unloads its adapter, its record goes."""
        from prl.run.tenants import leave

        try:
            done = leave(RunDir(self.plan.attach), self.plan.name, self.run.read_api_key())
        except (OSError, RunDirError) as exc:
            log.warning(f"could not detach from the inference pool {self.plan.attach}: {exc}")
            return
        log.info(f"detached from the inference pool {self.plan.attach} ({len(done)} server(s) unloaded the adapter)")

    # -- W&B: `prl wandb --follow` for this attempt, beside the roles (its failure never touches them)
    def start_wandb(self) -> None:
        wb = self.plan.settings().wandb if self.mode == "run" else None
        if wb is None:
            return
        argv = [sys.executable, "-m", "prl.cli", "wandb", str(self.run.root), "--project", wb.project,
                "--attempt", str(self.attempt)] + (["--entity", wb.entity] if wb.entity else [])
        log_path = self.run.attempt_logs(self.attempt) / "wandb.log"
        with open(log_path, "ab") as out:
            self.wandb = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        log.info(f"W&B: following the run into project {wb.project} (log {log_path})")

    def stop_wandb(self) -> None:
        """Let the follower log the last steps (it sees this attempt's end in launcher.json), then stop it."""
        if self.wandb is None:
            return
        try:
            self.wandb.wait(timeout=WANDB_FINAL_S)
        except subprocess.TimeoutExpired:
            log.warning(f"W&B follower still running {WANDB_FINAL_S:.0f} s after the end; stopping it")
            self.wandb.terminate()
            try:
                self.wandb.wait(timeout=KILL_AFTER_S)
            except subprocess.TimeoutExpired:
                log.warning(f"W&B follower still running {KILL_AFTER_S:.0f} s after SIGTERM; killing it")
                self.wandb.kill()
                self.wandb.wait()
        if self.wandb.returncode:
            log.warning(f"W&B follower exited {self.wandb.returncode}: see its log (training was not affected)")
        self.wandb = None

    # -- the job
    def main(self) -> int:
        self.save()
        if self.cancelled():
            # A requeue that raced the user's cancel: this attempt must not start anything.
            log.warning("the job was cancelled before this attempt began: exiting")
            return self.finish(LauncherStatus.STOPPED, signal_exit(signal.SIGTERM))
        self.start_wandb()
        try:
            for launch in start_order(self.plan.launches):
                if not launch.waits_itself:
                    self.wait_ready(launch.start_after)
                self.start(launch)
            # The roles a role waits for itself: ready within the bound all the same, or named as the failure.
            self.wait_ready(sorted({name for launch in self.plan.launches for name in launch.start_after}))
            self.state.status = LauncherStatus.RUNNING
            self.save()
            self.wait_done()
        except RoleHung as hung:
            self.state.first_failure = Failure(role=hung.role, reason=hung.reason + self.disk_reason(),
                                               time=time.time(), hung=True)
            self.state.status = LauncherStatus.STOPPING
            log.error(f"{hung.role} {hung.reason}; stopping the job")
            self.stop_all()
            if self.slurm and self.plan.requeue:
                return self.requeue()
            return self.finish(LauncherStatus.FAILED, 1)
        except RoleFailed as failure:
            self.state.first_failure = Failure(role=failure.role, exit_code=failure.code,
                                               reason=failure.reason + self.disk_reason(), time=time.time())
            log.error(f"{failure.role} failed ({failure.reason}); stopping the other roles")
            self.stop_all()
            return self.finish(LauncherStatus.FAILED, failure.code or 1)
        except Stopped:
            return self.stopped()
        self.stop_all()
        return self.finish(LauncherStatus.COMPLETED, 0)

    def stopped(self) -> int:
        signum = self.signum or signal.SIGTERM
        # Recorded first: on scancel Slurm may kill this process before the roles are down.
        self.state.status, self.state.stop_signal, self.state.stop_time = LauncherStatus.STOPPING, signum, time.time()
        self.save()
        warning = self.slurm and _time_limit_warning()
        log.warning(f"signal {signum}{' (time-limit warning)' if warning else ''}: stopping every role")
        self.stop_all(signum)
        if warning and self.plan.requeue:
            return self.requeue()
        return self.finish(LauncherStatus.STOPPED, signal_exit(signum))

    def cancelled(self) -> bool:
        """The user cancelled this job: its record says so (`prl cancel` writes it before scancel), or a TERM
        came that is not Slurm's time-limit warning (a plain scancel). A cancelled job is never requeued."""
        try:
            job = self.run.read_job()
        except RunDirError as exc:
            log.warning(f"cannot read the job record ({exc}); taking the job as not cancelled")
            job = None
        if job is not None and job.cancelled is not None:
            return True
        return self.signum is not None and not (self.slurm and _time_limit_warning())

    def requeue(self) -> int:
        from prl.ops import slurm

        if self.cancelled():
            log.warning("the job was cancelled: not requeued")
            return self.finish(LauncherStatus.STOPPED, signal_exit(self.signum or signal.SIGTERM))
        # Recorded first: requeueing ends this process.
        code = self.finish(LauncherStatus.REQUEUED, 0)
        try:
            slurm.scontrol_requeue(os.environ["SLURM_JOB_ID"])
        except SlurmError as exc:
            log.error(f"could not requeue the job: {exc}")
            return self.finish(LauncherStatus.FAILED, 1)
        return code


def start_order(launches: Sequence[Launch]) -> list[Launch]:
    """The plan's launches, those the launcher makes wait for no role first (plan order otherwise): the trainer, which
    waits for rollouts itself, and the orchestrator, which waits for the servers' endpoints itself, start with the
    servers rather than behind them."""
    return sorted(launches, key=lambda launch: bool(launch.start_after) and not launch.waits_itself)


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _mib(size: int | None) -> str:
    return "? MiB" if size is None else f"{size / (1 << 20):.1f} MiB"


def restart_srun_args(args: tuple[str, ...], nodes: list[str]) -> list[str]:
    """A step's srun options narrowed to one server's node(s): one task per node, overlapping the step that
    still runs the role's other servers (it holds the nodes' CPUs, GPUs and memory: `--overlap` shares the
    first two, `--mem=0` the memory). `--ntasks` overrides the component's task count srun inherits."""
    out = [a for a in args if not a.startswith(("--nodes=", "--ntasks", "--nodelist=", "--overlap", "--mem"))]
    nodes = [n for n in nodes if n]
    count = max(1, len(nodes))
    out += [f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1", "--overlap", "--mem=0"]
    if nodes:
        out.append(f"--nodelist={','.join(nodes)}")
    return out


def _time_limit_warning() -> bool:
    """A TERM while Slurm still calls the job RUNNING is the --signal warning, not scancel or requeue."""
    from prl.ops import slurm

    try:
        rows = slurm.squeue_jobs([os.environ["SLURM_JOB_ID"]])
    except Exception:  # noqa: BLE001 - deliberate: if Slurm can't say, treat it as a plain stop
        return False
    return bool(rows) and all(r.state == JobState.RUNNING for r in rows.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prl.job.launch")
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    return run_entry("prl launcher", lambda: launch(args.run_dir))


def launch(run_dir: str) -> int:
    """One attempt of the job in `run_dir`: the run directory made ready for it, then the Launcher's run."""
    init_logging("launcher")
    run = RunDir(run_dir)
    plan = Plan.read(run)
    slurm = plan.slurm and "SLURM_JOB_ID" in os.environ
    # Under Slurm the attempt follows the requeue count; a PRL_ATTEMPT exported from the submitting shell is stale.
    attempt = current_attempt({k: v for k, v in os.environ.items() if k != "PRL_ATTEMPT"} if slurm else None)
    run.create()
    run.link_latest_logs(attempt)
    run.reset_attempt_state()
    if not run.make_reserve():
        log.warning(f"no room for the launcher's disk reserve in {run.root} ({_mib(run.free_bytes())} free)")
    for launch in plan.launches:
        state = run.read_state(launch.name)
        if state and state.status == RoleState.RUNNING and (state.attempt or 0) < attempt:
            run.write_state(launch.name, status=RoleState.INTERRUPTED)
    launcher = Launcher(run, plan, attempt, slurm, os.environ.get("PRL_MODE", "run"))

    def on_signal(signum: int, _frame: Any) -> None:
        launcher.signum = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    backend = Backend.SLURM if slurm else Backend.LOCAL
    log.info(f"attempt {attempt} of {plan.name} in {run.root} ({backend}, mode {launcher.mode})")
    return launcher.main()


if __name__ == "__main__":
    sys.exit(main())
