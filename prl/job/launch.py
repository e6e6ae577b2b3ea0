"""The launcher: starts a job's roles in order, watches them, ends the job when one fails.

    python -m prl.job.launch --run-dir RUN          (exec'd by scripts/job.sbatch, or by `prl submit --local`)

Inside Slurm each role is one `srun` step with the plan's placement; locally each task
is a process. A role starts once every role it comes after has all its tasks ready
(their `state/ready/` markers: real health, never a sleep). The first role to exit
non-zero ends the job: the others get SIGTERM, `grace_seconds` to finish a checkpoint,
then SIGKILL. The job completes when the last role (the trainer) exits 0.

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
import time
from dataclasses import dataclass, field
from typing import Any

from prl.log import get_logger, init_logging
from prl.planner.model import Plan, Step
from prl.run.rundir import RunDir, atomic_write_json, current_attempt, read_json
from prl.states import JobState, LauncherStatus, RoleState

log = get_logger(__name__)

POLL_SECONDS = 0.5
START_TIMEOUT = float(os.environ.get("PRL_START_TIMEOUT", "1800"))


class RoleFailed(Exception):
    def __init__(self, role: str, code: int, reason: str):
        super().__init__(f"{role}: {reason}")
        self.role, self.code, self.reason = role, code, reason


class Stopped(Exception):
    pass


@dataclass
class Running:
    step: Step
    procs: list[subprocess.Popen] = field(default_factory=list)
    exit_code: int | None = None

    @property
    def name(self) -> str:
        return self.step.name

    @property
    def tasks(self) -> int:
        return self.step.tasks

    def poll(self) -> int | None:
        """None while any process runs; else the first non-zero exit code (or 0)."""
        codes = [p.poll() for p in self.procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return _code(failed[0])
        if any(c is None for c in codes):
            return None
        return 0


def _code(returncode: int) -> int:
    # Popen gives -N for death by signal N; the shell convention is 128 + N.
    return 128 - returncode if returncode < 0 else returncode


class Launcher:
    def __init__(self, run: RunDir, plan: Plan, attempt: int, slurm: bool, mode: str):
        self.run, self.plan, self.attempt, self.slurm, self.mode = run, plan, attempt, slurm, mode
        self.running: dict[str, Running] = {}
        self.signum: int | None = None
        self.state: dict[str, Any] = {
            "attempt": attempt, "mode": mode, "job_id": os.environ.get("SLURM_JOB_ID"), "pid": os.getpid(),
            "started": time.time(), "status": LauncherStatus.STARTING, "steps": {}, "first_failure": None,
            "ended": None,
        }

    # -- bookkeeping
    def save(self) -> None:
        atomic_write_json(self.run.launcher_state, self.state)

    def note_step(self, name: str, **fields: Any) -> None:
        self.state["steps"].setdefault(name, {}).update(fields)
        self.save()

    # -- starting roles
    def start(self, step: Step) -> None:
        script = str(self.run.path(step.script))
        env = {**os.environ, "PRL_ATTEMPT": str(self.attempt), "PRL_MODE": self.mode}
        running = Running(step)
        self.run.role_logs_dir(self.attempt, step.name).mkdir(parents=True, exist_ok=True)
        if self.slurm:
            argv = ["srun", *step.srun_args, f"--output={self.run.task_log_pattern(self.attempt, step.name)}",
                    "--open-mode=append", "bash", script]
            running.procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL))
        else:
            for task in range(running.tasks):
                output = open(self.run.role_log(self.attempt, step.name, task), "ab")
                task_env = {**env, "PRL_TASK": str(task), "PRL_NODE": str(task // step.ntasks_per_node)}
                running.procs.append(subprocess.Popen(["bash", script], env=task_env, stdout=output,
                                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                      start_new_session=True))
                output.close()
        self.running[step.name] = running
        log.info(f"started {step.name} ({running.tasks} task(s))")
        self.note_step(step.name, started=time.time(), tasks=running.tasks, status=RoleState.RUNNING)

    def ready(self, name: str) -> bool:
        running = self.running[name]
        return all(self.run.task_ready(name, t).exists() for t in range(running.tasks))

    # -- watching
    def check(self) -> None:
        """Raise Stopped on a signal, RoleFailed on the first role that exited non-zero; record clean exits."""
        if self.signum is not None:
            raise Stopped()
        for name, running in self.running.items():
            if running.exit_code is not None:
                continue
            code = running.poll()
            if code is None:
                continue
            running.exit_code = code
            self.note_step(name, exit_code=code, ended=time.time(),
                           status=RoleState.EXITED if code == 0 else RoleState.FAILED)
            if code != 0:
                code, task = self.first_task_failure(name, running.tasks, code)
                running.exit_code = code
                self.note_step(name, exit_code=code)
                where = f"task {task} " if task is not None else ""
                raise RoleFailed(name, code, f"{where}exited with code {code}")
            log.info(f"{name} exited 0")

    def first_task_failure(self, name: str, tasks: int, fallback: int) -> tuple[int, int | None]:
        """The exit code of the task that failed first: srun reports the step's worst, often a
        sibling killed by --kill-on-bad-exit (143) rather than the cause."""
        records = []
        for task in range(tasks):
            record = read_json(self.run.task_exit(name, task))
            if record and record["exit_code"] != 0:
                records.append((record["time"], record["exit_code"], task))
        if not records:
            return fallback, None
        _, code, task = min(records)
        return code, task

    def wait_ready(self, names: tuple[str, ...] | list[str]) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        waiting = [n for n in names if n in self.running]
        while True:
            self.check()
            pending = [n for n in waiting if not self.ready(n)]
            for n in pending:
                if self.running[n].exit_code == 0:
                    raise RoleFailed(n, 1, "exited 0 before it was ready")
            if not pending:
                return
            if time.monotonic() > deadline:
                raise RoleFailed(pending[0], 1, f"not ready after {START_TIMEOUT:.0f} s")
            time.sleep(POLL_SECONDS)

    def wait_done(self) -> None:
        last = self.plan.steps[-1].name
        while True:
            self.check()
            if self.running[last].exit_code == 0 or all(r.exit_code == 0 for r in self.running.values()):
                return
            time.sleep(POLL_SECONDS)

    # -- stopping
    def stop_all(self, signum: int = signal.SIGTERM) -> None:
        """Ask every task to stop through the run directory, give them the grace period, then kill.

        Not a signal to srun: srun turns SIGTERM into an immediate kill of the step, which would
        leave no time for a checkpoint. The tasks watch state/stop.json and pass SIGTERM on.
        """
        alive = [p for r in self.running.values() for p in r.procs if p.poll() is None]
        atomic_write_json(self.run.stop_request, {"attempt": self.attempt, "signal": signum, "time": time.time()})
        deadline = time.monotonic() + float(self.plan.grace_seconds)
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in alive:
            if p.poll() is None:
                self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + 10
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
                self.state["steps"][name].update(exit_code=code, ended=time.time(), status=RoleState.STOPPED)
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
        self.state.update(status=status, ended=time.time(), exit_code=code)
        self.save()
        (log.info if status == LauncherStatus.COMPLETED else log.warning)(f"job {status} (exit {code})")
        return code

    # -- the job
    def main(self) -> int:
        self.save()
        try:
            for step in self.plan.steps:
                self.wait_ready(step.start_after)
                self.start(step)
            self.state["status"] = LauncherStatus.RUNNING
            self.save()
            self.wait_done()
        except RoleFailed as failure:
            self.state["first_failure"] = {"role": failure.role, "exit_code": failure.code,
                                           "reason": failure.reason, "time": time.time()}
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
        self.state.update(status=LauncherStatus.STOPPING, stop_signal=signum, stop_time=time.time())
        self.save()
        warning = self.slurm and _time_limit_warning()
        log.warning(f"signal {signum}{' (time-limit warning)' if warning else ''}: stopping every role")
        self.stop_all(signum)
        if warning and self.plan.requeue:
            from prl.ops import slurm

            slurm.scontrol_requeue(os.environ["SLURM_JOB_ID"])
            return self.finish(LauncherStatus.REQUEUED, 0)
        return self.finish(LauncherStatus.STOPPED, 128 + signum)


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
    init_logging("launcher")
    run = RunDir(args.run_dir)
    plan = Plan.read(run)
    slurm = plan.slurm and "SLURM_JOB_ID" in os.environ
    # Under Slurm the attempt follows the requeue count; a PRL_ATTEMPT exported from the submitting shell is stale.
    attempt = current_attempt({k: v for k, v in os.environ.items() if k != "PRL_ATTEMPT"} if slurm else None)
    run.create()
    run.link_latest_logs(attempt)
    run.reset_attempt_state()
    for step in plan.steps:
        state = run.read_state(step.name)
        if state and state.get("status") == RoleState.RUNNING and int(state.get("attempt", 0)) < attempt:
            run.write_state(step.name, status=RoleState.INTERRUPTED)
    launcher = Launcher(run, plan, attempt, slurm, os.environ.get("PRL_MODE", "run"))

    def on_signal(signum: int, _frame: Any) -> None:
        launcher.signum = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info(f"attempt {attempt} of {plan.name} in {run.root} ({'slurm' if slurm else 'local'}, mode {launcher.mode})")
    return launcher.main()


if __name__ == "__main__":
    sys.exit(main())
