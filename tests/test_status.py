"""Status logic with Slurm's answers faked: transient errors, forgotten jobs, command counts.
(The real-cluster path is in test_submit_slurm.py.)"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from conftest import REPO
from prl.ops import slurm
from prl.planner.prepare import prepare, write_run_files
from prl.run.rundir import RunDir, atomic_write_json
from prl.ops.status import collect


def _run(tmp_path, topology="lab", *overrides) -> RunDir:
    prepared = prepare(REPO / "configs" / f"{topology}.yaml", [f"run_dir={tmp_path / 'run'}", *overrides])
    write_run_files(prepared)
    run = RunDir(prepared.run_dir)
    run.create()
    job = {"job_id": "77", "backend": "slurm", "name": prepared.plan.name, "mode": "run", "cancelled": None,
           "components": {str(g.index): g.name for g in prepared.plan.groups}}
    atomic_write_json(run.job_json, job)
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
    atomic_write_json(run.launcher_state, {"status": "running", "attempt": 1, "steps": {}})
    monkeypatch.setattr(slurm, "RUNNER", Fake({"squeue": ("", "slurm_load_jobs error: Unable to contact slurm "
                                                              "controller (connect failure)", 1)}))
    status = collect(run)
    assert status.state == "UNKNOWN"
    assert all(r.slurm_state == "UNKNOWN" for r in status.roles)
    assert "state may be stale" in status.notes[0]


def test_forgotten_job_without_accounting_uses_the_launcher_record(tmp_path, monkeypatch):
    run = _run(tmp_path)
    atomic_write_json(run.launcher_state, {
        "status": "failed", "attempt": 1,
        "steps": {"inference": {"status": "exited", "exit_code": 0}, "orchestrator": {"status": "failed",
                                                                                       "exit_code": 3}},
        "first_failure": {"role": "orchestrator", "exit_code": 3, "reason": "task 0 exited with code 3",
                          "time": time.time()}})
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
    assert status.failure["role"] == "orchestrator" and status.failure["exit_code"] == 3
    assert status.failure["log_tail"][-1] == "line 39" and len(status.failure["log_tail"]) == 15
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
