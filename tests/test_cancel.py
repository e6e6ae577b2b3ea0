"""A cancel always wins over a requeue (prl/job/launch.py `Launcher.cancelled`, prl/ops/submit.py `cancel`).

A launcher that found a role HUNG stops every role and then requeues the job; a user who runs
`prl cancel` in that window must find the job gone. `prl cancel` writes its intent to job.json
before it asks Slurm, the launcher reads it (and a TERM that is not the time-limit warning) before
any requeue, and a requeued attempt that finds it exits before starting anything. Slurm is the
fake RUNNER here (the command is what is checked); tests/test_faults_slurm.py runs real requeues.
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from prl.errors import SlurmError
from prl.job import launch as launch_module
from prl.job.launch import Launcher
from prl.ops import slurm, submit
from prl.run.records import JobRecord
from prl.run.rundir import RunDir
from prl.states import Backend, LauncherStatus
from testkit.plans import local_plan, write_plan


class Commands:
    """The fake Slurm: records each command, answers `answers[argv[0]]` (stdout, stderr, code) or success."""

    def __init__(self, answers: dict | None = None):
        self.answers = answers or {}
        self.calls: list[list[str]] = []

    def __call__(self, argv, timeout):
        self.calls.append(argv)
        stdout, stderr, code = self.answers.get(argv[0], ("", "", 0))
        return subprocess.CompletedProcess(argv, code, stdout, stderr)


def _job(run: RunDir, cancelled: float | None = None) -> JobRecord:
    job = JobRecord(job_id="4242", name="t", backend=Backend.SLURM, cluster="lab", submitted=time.time(),
                    run_dir=str(run.root), cancelled=cancelled)
    run.write_job(job)
    return job


@pytest.fixture
def hung_launcher(tmp_path, monkeypatch):
    """A Slurm launcher of attempt 1 whose roles are already stopped (the hang's stop-all is done)."""
    run = write_plan(RunDir(tmp_path / "run"), local_plan(tmp_path / "run", tmp_path, []))
    run.create()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    commands = Commands()
    monkeypatch.setattr(slurm, "RUNNER", commands)
    return Launcher(run, launch_module.Plan.read(run), attempt=1, slurm=True, mode="run"), run, commands


def test_a_hung_job_requeues_when_nobody_cancelled_it(hung_launcher):
    launcher, run, commands = hung_launcher
    _job(run)
    assert launcher.requeue() == 0
    assert ["scontrol", "requeue", "4242"] in commands.calls
    assert run.read_launcher().status == LauncherStatus.REQUEUED


def test_a_cancel_recorded_during_the_stop_prevents_the_requeue(hung_launcher):
    launcher, run, commands = hung_launcher
    _job(run, cancelled=time.time())
    assert launcher.requeue() == 128 + signal.SIGTERM
    assert not [c for c in commands.calls if c[:2] == ["scontrol", "requeue"]], commands.calls
    assert run.read_launcher().status == LauncherStatus.STOPPED


@pytest.mark.parametrize("time_limit_warning, requeued", [(False, False), (True, True)])
def test_a_term_requeues_only_when_it_is_the_time_limit_warning(hung_launcher, monkeypatch, time_limit_warning,
                                                                 requeued):
    """A scancel's TERM may reach the launcher before `prl cancel` has written its record (or scancel came
    from elsewhere): a TERM while Slurm no longer calls the job RUNNING is a cancel."""
    launcher, run, commands = hung_launcher
    _job(run)
    launcher.signum = signal.SIGTERM
    monkeypatch.setattr(launch_module, "_time_limit_warning", lambda: time_limit_warning)
    launcher.requeue()
    assert bool([c for c in commands.calls if c[:2] == ["scontrol", "requeue"]]) == requeued


def test_a_requeued_attempt_of_a_cancelled_job_starts_nothing(tmp_path, monkeypatch):
    run = write_plan(RunDir(tmp_path / "run"), local_plan(tmp_path / "run", tmp_path, []))
    run.create()
    _job(run, cancelled=time.time())
    launcher = Launcher(run, launch_module.Plan.read(run), attempt=2, slurm=False, mode="run")
    monkeypatch.setattr(launcher, "start", lambda step: pytest.fail(f"attempt 2 started {step.name}"))
    assert launcher.main() == 128 + signal.SIGTERM
    assert run.read_launcher().status == LauncherStatus.STOPPED and launcher.running == {}


def test_prl_cancel_records_its_intent_before_scancel_and_takes_it_back_if_scancel_fails(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run").create()
    _job(run)
    seen = []

    class Scancel(Commands):
        def __call__(self, argv, timeout):
            if argv[0] == "scancel":
                seen.append(run.read_job().cancelled)  # what a launcher reading job.json now would see
            return super().__call__(argv, timeout)

    monkeypatch.setattr(slurm, "RUNNER", Scancel())
    monkeypatch.setattr(slurm, "squeue_jobs", lambda ids: {"4242": type("Row", (), {"terminal": False})()})
    job, done = submit.cancel(run)
    assert done and seen[0] is not None and run.read_job().cancelled == job.cancelled

    _job(run)
    monkeypatch.setattr(slurm, "RUNNER", Scancel({"scancel": ("", "scancel: error: Access denied", 1)}))
    with pytest.raises(SlurmError):
        submit.cancel(run)
    assert seen[1] is not None and run.read_job().cancelled is None, "a failed scancel leaves no cancel record"


def test_prl_cancel_of_a_local_run_never_signals_a_process_that_reused_the_launchers_pid(tmp_path, monkeypatch):
    """The recorded pid now belongs to another process (a reboot, an OOM kill): nothing is signalled."""
    run = RunDir(tmp_path / "run").create()
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        job = JobRecord(job_id="local", name="t", backend=Backend.LOCAL, cluster="local", submitted=time.time(),
                        run_dir=str(run.root), pid=stranger.pid)
        run.write_job(job)
        assert submit.cancel(run) == (job, False)
        time.sleep(0.2)
        assert stranger.poll() is None, "prl cancel signalled a process that is not the run's launcher"
        assert run.read_job().cancelled is None
    finally:
        stranger.kill()
        stranger.wait()
