"""Status logic with Slurm's answers faked: transient errors, forgotten jobs, command counts.
(The real-cluster path is in test_submit_slurm.py.)"""

from __future__ import annotations

import contextlib

import ast
import json
import os
import subprocess
import time

import pytest

from tests.helpers import REPO
from prl.ops import slurm
from prl.ops import status as status_module
from prl.planner.prepare import prepare, write_run_files
from prl.run.records import Failure, JobRecord, LauncherRecord, PreflightReport, RoleStateRecord, LaunchRecord
from prl.run.rundir import RunDir, atomic_write_json
from prl.ops.status import Status, _launcher_state, _role_status, collect, show
from prl.states import FAILED_STATES, TERMINAL_STATES, Backend, JobState, LauncherStatus, RoleState, ServerAction

RUNNING = LauncherRecord(attempt=1, status=LauncherStatus.RUNNING)
"""The launcher's record of a job whose roles all started."""


def _run(tmp_path, topology="lab", *overrides) -> RunDir:
    prepared = prepare(REPO / "configs" / f"{topology}.yaml", [f"run_dir={tmp_path / 'run'}", *overrides])
    write_run_files(prepared)
    run = RunDir(prepared.run_dir)
    run.create()
    run.write_job(JobRecord(job_id="77", backend=Backend.SLURM, name=prepared.plan.name, cluster=prepared.plan.cluster,
                            submitted=time.time(), run_dir=str(run.root),
                            components={str(g.index): g.name for g in prepared.plan.groups}))
    return run


class Fake:
    def __init__(self, answers):
        self.answers = answers
        self.calls = []

    def __call__(self, argv, timeout):
        self.calls.append(argv)
        out = self.answers.get(argv[0], ("", "", 0))
        if isinstance(out, Exception):
            raise out
        stdout, stderr, code = out
        return subprocess.CompletedProcess(argv, code, stdout, stderr)


def test_unreachable_controller_is_unknown_not_failed(tmp_path, monkeypatch):
    run = _run(tmp_path)
    atomic_write_json(run.launcher_state, RUNNING)
    monkeypatch.setattr(slurm, "RUNNER", Fake({"squeue": ("", "slurm_load_jobs error: Unable to contact slurm "
                                                              "controller (connect failure)", 1)}))
    status = collect(run)
    assert status.state == "UNKNOWN"
    assert all(r.slurm_state == "UNKNOWN" for r in status.roles)
    assert "state may be stale" in status.notes[0]


def test_forgotten_job_without_accounting_uses_the_launcher_record(tmp_path, monkeypatch):
    run = _run(tmp_path)
    atomic_write_json(run.launcher_state, LauncherRecord(
        status=LauncherStatus.FAILED, attempt=1,
        launches={"inference": LaunchRecord(status=RoleState.EXITED, exit_code=0),
               "orchestrator": LaunchRecord(status=RoleState.FAILED, exit_code=3)},
        first_failure=Failure(role="orchestrator", exit_code=3, reason="task 0 exited with code 3", time=time.time())))
    log = run.role_log(1, "orchestrator", 0)
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"line {i}\n" for i in range(40)))
    monkeypatch.setattr(slurm, "RUNNER", Fake({
        "squeue": ("", "slurm_load_jobs error: Invalid job id specified", 1),
        "sacct": ("", "Slurm accounting storage is disabled", 1),
        "scontrol": ("", "slurm_load_jobs error: Invalid job id specified", 1),
    }))
    status = collect(run)
    assert status.state == "FAILED"
    assert status.failure.role == "orchestrator" and status.failure.exit_code == 3
    assert status.failure.log_tail[-1] == "line 39" and len(status.failure.log_tail) == 15
    assert [r.status for r in status.roles] == ["exited", "failed", "not started"]
    assert any("no longer knows" in n for n in status.notes)


@pytest.mark.parametrize("topology", ["lab", "moe-1t"])
def test_slurm_commands_do_not_grow_with_roles(tmp_path, monkeypatch, topology):
    run = _run(tmp_path, topology, "model.path=/m")
    fake = Fake({"squeue": ("", "slurm_load_jobs error: Invalid job id specified", 1),
                 "sacct": ("77+0\x1fx\x1fCOMPLETED\x1f0:0\x1f00:00:05\x1fn1\x1f\x1f\x1f\x1f\n", "", 0)})
    monkeypatch.setattr(slurm, "RUNNER", fake)
    status = collect(run)
    assert status.slurm_commands == len(fake.calls) <= 2


def test_planned_run_has_no_job(tmp_path):
    prepared = prepare(REPO / "configs" / "lab.yaml", [f"run_dir={tmp_path / 'run'}"])
    write_run_files(prepared)
    status = collect(RunDir(prepared.run_dir))
    assert status.state == "PLANNED" and status.job_id is None
    assert json.loads(status.to_json())["roles"][0]["role"] == "inference"


FORGOTTEN = {"squeue": ("", "slurm_load_jobs error: Invalid job id specified", 1),
             "sacct": ("", "Slurm accounting storage is disabled", 1),
             "scontrol": ("", "slurm_load_jobs error: Invalid job id specified", 1)}
"""Slurm answers for a job the controller forgot, on a cluster without accounting."""


@pytest.mark.parametrize("preflight_failed, want", [(1, 1), (None, 2)])
def test_the_failure_shows_the_log_of_the_task_that_failed(tmp_path, monkeypatch, preflight_failed, want):
    """The task whose preflight failed, else the log written last (srun reports only the step's worst)."""
    run = _run(tmp_path)
    atomic_write_json(run.launcher_state, LauncherRecord(
        status=LauncherStatus.FAILED, attempt=2, launches={"inference": LaunchRecord(status=RoleState.FAILED, exit_code=1)},
        first_failure=Failure(role="inference", exit_code=1, reason="exited with code 1", time=time.time())))
    for rank in (0, 2, 1, 10):
        log = run.role_log(2, "inference", rank)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"rank {rank}\n")
        os.utime(log, (1000 + rank, 1000 + (rank % 10)))  # rank 10 is not the newest: rank 2 is
        run.write_preflight("inference", rank, PreflightReport(host="n1", ok=rank != preflight_failed))
    monkeypatch.setattr(slurm, "RUNNER", Fake(FORGOTTEN))
    failure = collect(run).failure
    assert failure.log == str(run.role_log(2, "inference", want))
    assert failure.log_tail == [f"rank {want}"]


@pytest.mark.parametrize("launcher, cancelled, want", [
    (None, False, "PENDING"), (None, True, "PENDING"),
    ("starting", False, "RUNNING"), ("running", False, "RUNNING"), ("completed", False, "COMPLETED"),
    ("failed", False, "FAILED"), ("requeued", False, "REQUEUED"),
    ("stopping", False, "STOPPED"), ("stopped", False, "STOPPED"),
    ("stopping", True, "CANCELLED"), ("stopped", True, "CANCELLED"),
])
def test_the_launchers_record_gives_the_job_state(launcher, cancelled, want):
    assert _launcher_state(launcher, cancelled) is JobState(want)


def test_every_launcher_status_has_a_job_state():
    assert {_launcher_state(s.value, False) for s in LauncherStatus} <= set(JobState) - {JobState.UNKNOWN}


@pytest.mark.parametrize("launched, own, submitted, ended, want", [
    (None, None, False, False, ""),
    (None, "running", False, False, "running"),
    (None, None, True, False, "waiting"),
    (None, "running", True, True, "not started"),
    ("running", "exited", True, False, "running"),
    ("running", None, True, True, "killed"),
    ("stopped", "running", True, True, "stopped"),
    ("failed", None, True, True, "failed"),
    (None, "interrupted", False, True, "interrupted"),
])
def test_role_status(launched, own, submitted, ended, want):
    """launched: the launcher's step record's status (None: no record); own: the role's state file's."""
    step = None if launched is None else LaunchRecord(status=RoleState(launched))
    state = None if own is None else RoleStateRecord(status=RoleState(own))
    got = _role_status(step, state, submitted, ended)
    assert got == want and (got == "" or isinstance(got, RoleState))


def test_one_terminal_set():
    assert status_module.TERMINAL_STATES is slurm.TERMINAL_STATES is TERMINAL_STATES
    assert FAILED_STATES < TERMINAL_STATES


@pytest.mark.parametrize("state", list(JobState))
def test_status_watch_stops_at_a_terminal_state_and_fails_on_a_failed_one(tmp_path, monkeypatch, state):
    from prl import cli

    states = iter([state, JobState.COMPLETED])
    monkeypatch.setattr(status_module, "resolve_run", lambda arg: RunDir(tmp_path))
    monkeypatch.setattr(status_module, "collect", lambda run: Status(str(run.root), "x", None, "none", next(states),
                                                                     None, None, [], {}, None))
    shown = []
    monkeypatch.setattr(status_module, "show", shown.append)
    with pytest.raises(SystemExit) if state in FAILED_STATES else contextlib.nullcontext() as ended:
        cli.main(["status", str(tmp_path), "--watch", "--interval", "0"])
    assert [s.state for s in shown] == ([state] if state in TERMINAL_STATES else [state, JobState.COMPLETED])
    assert ended is None or ended.value.code == 1


def test_status_json_holds_plain_strings(tmp_path, monkeypatch):
    run = _run(tmp_path)
    atomic_write_json(run.launcher_state, RUNNING)
    monkeypatch.setattr(slurm, "RUNNER", Fake({"squeue": ("", "Unable to contact slurm controller", 1)}))
    out = json.loads(collect(run).to_json())
    assert out["state"] == "UNKNOWN" and {r["slurm_state"] for r in out["roles"]} == {"UNKNOWN"}
    assert [r["status"] for r in out["roles"]] == ["waiting", "waiting", "waiting"]


def test_state_vocabularies_are_listed_only_in_prl_states():
    """No module restates two words of one state vocabulary in a tuple, list, set or dict (use prl.states)."""
    vocabularies = [{s.value for s in kind} for kind in (JobState, LauncherStatus, RoleState, Backend, ServerAction)]
    found = []
    for path in sorted((REPO / "prl").rglob("*.py")):
        if path == REPO / "prl" / "states.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
            if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                continue
            words = {e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            if any(len(words & vocabulary) >= 2 for vocabulary in vocabularies):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {sorted(words)}")
    assert not found, "states listed outside prl/states.py:\n" + "\n".join(found)


def test_a_requeued_job_says_how_each_earlier_attempt_ended(tmp_path, monkeypatch):
    """Attempt 1 HUNG (the launcher's record), attempt 2 killed by a node failure (only Slurm knows: NODE_FAIL),
    attempt 3 pending: one more Slurm command, `sacct --duplicates`, and a line per earlier attempt."""
    run = _run(tmp_path)
    now = time.time()
    atomic_write_json(run.attempt_launcher_state(1), LauncherRecord(
        attempt=1, status=LauncherStatus.REQUEUED, ended=now - 300, first_failure=Failure(
            role="orchestrator", hung=True, time=now - 310,
            reason="hung: no progress for 31 s (bound 30 s); last step 3, phase generating")))
    attempt_2 = LauncherRecord(attempt=2, status=LauncherStatus.STOPPED, ended=now - 60, stop_signal=15,
                               launches={"trainer": LaunchRecord(status=RoleState.STOPPED, exit_code=1)})
    atomic_write_json(run.attempt_launcher_state(2), attempt_2)
    atomic_write_json(run.launcher_state, attempt_2)
    row = "77+{c}\x1flab\x1f{state}\x1f0:0\x1f0:0\x1f00:01:00\x1fn{c}\x1f{start}\x1f{end}\x1fNone\n"
    sacct = "".join(row.format(c=c, state=state, start=start, end=end) for state, start, end in (
        ("REQUEUED", "2026-12-01T19:00:00", "2026-12-01T19:04:00"),
        ("NODE_FAIL", "2026-12-01T19:05:00", "2026-12-01T19:09:00"),
        ("PENDING", "Unknown", "Unknown")) for c in range(3))
    # squeue: JobID HetJobID HetJobOffset Name State Reason TimeUsed NodeList exit DerivedEC RestartCnt Start End
    pending = "".join(f"{77 + c}\x1f77\x1f{c}\x1flab\x1fPENDING\x1fBeginTime\x1f0:00\x1f\x1f0\x1f0:0\x1f2\x1fN/A\x1fN/A\x1f\n"
                      for c in range(3))
    fake = Fake({"squeue": (pending, "", 0), "sacct": (sacct, "", 0)})
    monkeypatch.setattr(slurm, "RUNNER", fake)
    status = collect(run)
    assert status.state == "PENDING"
    assert [(e.attempt, e.slurm_state) for e in status.earlier] == [(1, "REQUEUED"), (2, "NODE_FAIL")]
    assert any("--duplicates" in c for c in fake.calls[-1]) and status.slurm_commands == len(fake.calls)
    from rich.console import Console

    console = Console(record=True, width=250)
    show(status, console)
    text = console.export_text()
    assert "orchestrator HUNG (hung: no progress for 31 s" in text
    assert "attempt 2 ended" in text and "stopped by signal 15; Slurm: NODE_FAIL" in text
    # A job that has not been requeued asks Slurm nothing more.
    atomic_write_json(run.launcher_state, RUNNING)
    assert collect(run).earlier == []


def test_an_sft_run_shows_its_loss_and_epoch_not_rollouts(tmp_path):
    prepared = prepare(REPO / "configs" / "sft-tiny.yaml", [f"run_dir={tmp_path / 'run'}"])
    write_run_files(prepared)
    run = RunDir(prepared.run_dir)
    for step, loss in ((1, 3.5), (2, 2.25)):
        run.append_metrics({"role": "trainer", "step": step, "loss": loss, "epoch": step / 4})
    status = collect(run)
    assert status.progress == {"trainer_step": 2, "last_loss": 2.25, "epoch": 0.5, "checkpoint": None}
    from rich.console import Console

    console = Console(record=True, width=200)
    show(status, console)
    text = console.export_text()
    assert "progress: trainer step 2, loss 2.2500, epoch 0.50, last checkpoint -" in text and "reward" not in text


def test_an_rl_run_with_weights_in_memory_shows_the_trainers_own_step(tmp_path):
    """Under `weights.transport: memory` only checkpoint steps reach weights/: the trainer step comes from its
    records too (it showed the last checkpoint step, up to checkpoint_interval - 1 steps behind)."""
    prepared = prepare(REPO / "configs" / "local-tiny.yaml", [f"run_dir={tmp_path / 'run'}"])
    write_run_files(prepared)
    run = RunDir(prepared.run_dir)
    run.create()
    run.publish_dir(run.weights(5), lambda tmp: None, step=5)
    for step in range(1, 8):
        run.append_metrics({"role": "trainer", "step": step, "loss": 0.1})
    run.publish_dir(run.rollouts(8), lambda tmp: None, step=8)
    progress = collect(run).progress
    assert (progress["trainer_step"], progress["rollout_step"], progress["lag"]) == (7, 8, 1), progress
