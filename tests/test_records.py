"""The run directory's typed records: round trips, files written before records had a version, a later
version refused by name, and the backend vocabulary."""

from __future__ import annotations

import json

import pytest

from prl.errors import RunDirError
from prl.run import records
from prl.run.records import (RECORD_VERSION, DiskFull, Endpoint, Failure, FeedRecord, JobRecord, LauncherRecord,
                             PreflightCheck, PreflightReport, RankBeat, ReadyMarker, StableMarker, StepPin,
                             StopRequest, TenantRecord, WandbCursor,
                             RoleStateRecord, ServerFailure, LaunchRecord, TaskExit)
from prl.run.rundir import RunDir, atomic_write_json
from prl.states import Backend, LauncherStatus, RoleState, ServerAction

LAUNCHER = LauncherRecord(
    attempt=2, mode="run", job_id="77", pid=4242, started=100.0, status=LauncherStatus.FAILED, ended=200.5,
    exit_code=3, stop_signal=15, stop_time=190.0,
    first_failure=Failure(role="orchestrator", exit_code=3, reason="task 0 exited with code 3", time=150.0),
    disk_full=DiskFull(time=180.0, free_bytes=0, released_bytes=4 << 20),
    launches={"inference": LaunchRecord(status=RoleState.RUNNING, started=101.0, tasks=2, restarts=1, failures=[
        ServerFailure(time=120.0, task=1, replica=1, node="n1", exit_code=0, reason="exited",
                      action=ServerAction.RESTARTED, restarted=121.0, ready_after_s=9.5)]),
           "trainer": LaunchRecord(status=RoleState.HUNG, hung_at=160.0, last_heartbeat=120.0, hung_rank=1,
                                 last_step=4, last_phase="trained", hang_bound_s=30.0)})

JOB = JobRecord(job_id="77", name="lab", backend=Backend.SLURM, cluster="example", mode="preflight", hold=60.0,
                hetjob=True, attempt_base=1, components={"0": "inference"}, launches={"inference": 0},
                submitted=99.0, topology="/t.yaml", overrides=["a=1"], run_dir="/run", scripts={"scripts/x": "ab"},
                pid=None, cancelled=300.0)


@pytest.mark.parametrize("record, path", [
    (LAUNCHER, lambda run: run.launcher_state),
    (JOB, lambda run: run.job_json),
    (RoleStateRecord(status=RoleState.FAILED, host="h", pid=7, attempt=1, started=1.0, heartbeat=2.0, updated=3.0,
                     ended=4.0, exit_code=1, error="ValueError: x", step=5, phase="published", step_s=1.5,
                     published=5, weights_version=4, server_errors={"http://a": "boom"}, weights_attempt=1),
     lambda run: run.role_state("orchestrator")),
    (RankBeat(attempt=1, heartbeat=5.0, step=3, phase="trained", step_s=0.5), lambda run: run.rank_beat("trainer", 1)),
    (TaskExit(exit_code=0, time=5.0, host="h", node="n1", reason="r", failed=True, lasting=True, with_replica=True),
     lambda run: run.task_exit("inference", 1)),
    (Endpoint(role="inference", index=2, host="10.0.0.5", port=8000, url="http://10.0.0.5:8000", started=5.0,
              restart=1), lambda run: run.endpoint("inference", 2)),
    (ReadyMarker(host="n1", time=5.0), lambda run: run.task_ready("inference", 0)),
    (PreflightReport(host="h", node="n1", checks=[PreflightCheck("ports", "error", "port 8000 is taken")], ok=False),
     lambda run: run.preflight_report("trainer", 0)),
    (StopRequest(attempt=2, time=5.0, signal=15), lambda run: run.stop_request),
    (StepPin(step=3, time=5.0), lambda run: run.pins_dir / "orchestrator.json"),
    (FeedRecord(step=4, feeds=["h:1", "h:2"], time=5.0, group_timeout=7.0), lambda run: run.weights_feed_file),
    (WandbCursor(id="prl-ab", step=3), lambda run: run.wandb_cursor),
    (TenantRecord(name="exp-a", run_dir="/runs/a", key_sha256="0" * 64, attached=5.0),
     lambda run: run.root / "tenants" / "exp-a.json"),
])
def test_a_record_reads_back_as_written_with_its_version(tmp_path, record, path):
    run = RunDir(tmp_path).create()
    file = path(run)
    atomic_write_json(file, record)
    on_disk = json.loads(file.read_text())
    assert on_disk["version"] == RECORD_VERSION
    assert records.read(file, type(record)) == record


def test_the_handoffs_between_processes_are_read_and_written_through_the_run_directory(tmp_path):
    run = RunDir(tmp_path).create()
    assert (run.read_endpoint("inference", 0), run.read_ready("inference", 0), run.read_preflight("trainer", 0),
            run.read_weights_feed(), run.read_wandb_cursor()) == (None,) * 5
    head = Endpoint(role="decode", index=1, host="n2")  # a multi-node head's address, before it serves
    run.write_endpoint(head)
    run.write_endpoint(Endpoint(role="router", index=0, host="n1", port=8090, url="http://n1:8090"))
    assert run.endpoints() == {"decode": {1: head}, "router": {0: run.read_endpoint("router", 0)}}
    assert run.mark_ready("inference", 3, "n1") == run.read_ready("inference", 3)
    run.request_stop(run.replica_stop("decode", 1), attempt=2)
    assert records.read(run.replica_stop("decode", 1), StopRequest).signal is None
    run.pin_weights("orchestrator", 4)
    run.hold_weights("inference.0", 2)
    assert (run.weight_pins(), run.weight_holds()) == ({"orchestrator": 4}, {"inference.0": 2})
    # What another prl left where a record belongs is not read as one (an endpoint written as a bare dict).
    atomic_write_json(run.endpoint("inference", 5), {"url": "http://x:1"})
    atomic_write_json(run.holds_dir / "stale.json", {"step": "two"})
    assert 5 not in run.endpoints().get("inference", {}) and "stale" not in run.weight_holds()


def test_the_rundir_readers_return_the_types(tmp_path):
    run = RunDir(tmp_path).create()
    assert (run.read_job(), run.read_launcher(), run.read_state("trainer"), run.read_task_exit("trainer", 0)) == (
        None, None, None, None)
    run.write_job(JOB)
    atomic_write_json(run.launcher_state, LAUNCHER)
    atomic_write_json(run.attempt_launcher_state(2), LAUNCHER)
    run.write_task_exit("inference", 1, TaskExit(exit_code=3, time=1.0))
    beat = run.rank_heartbeat("trainer", 2, step=4, phase="trained")
    assert run.read_job() == JOB and run.read_launcher() == LAUNCHER == run.read_launcher(2)
    assert run.read_task_exit("inference", 1).exit_code == 3
    assert run.rank_heartbeats("trainer") == {2: beat}


# What the code before typed records wrote (no version), taken from run directories of that code.
OLD_JOB = {"job_id": "123", "name": "lab", "backend": "slurm", "cluster": "example", "mode": "run", "hold": 0,
           "hetjob": True, "attempt_base": 0, "components": {"0": "inference", "1": "trainer"},
           "steps": {"inference": 0, "trainer": 1}, "submitted": 1764700000.5, "topology": "/t/lab.yaml",
           "overrides": [], "run_dir": "/runs/lab", "scripts": {"scripts/job.sbatch": "0f"}, "pid": None,
           "cancelled": None}
OLD_LAUNCHER = {"attempt": 1, "mode": "run", "job_id": None, "pid": 321, "started": 1.0, "status": "running",
                "steps": {"inference": {"started": 2.0, "tasks": 2, "status": "running", "restarts": 1, "failures": [
                    {"time": 3.0, "task": 1, "replica": 1, "node": "n1", "exit_code": 0,
                     "reason": "server exited with code 0 while the job was running", "action": "restarting",
                     "restarted": 4.0}]}},
                "first_failure": None, "ended": None}
OLD_PIN = {"step": 3, "time": 5.0}
OLD_MARKER = {"attempt": 1, "files": {"model.safetensors": 4}, "host": "n1", "pid": 7, "step": 2, "time": 5.0}
OLD_TENANT = {"name": "exp-a", "run_dir": "/runs/a", "key_sha256": "ab" * 32, "attached": 5.0}
OLD_STATE = {"status": "running", "started": 1.0, "heartbeat": 2.0, "exit_code": None, "host": "h", "pid": 9,
             "attempt": 1, "updated": 2.0, "step": 3, "phase": "trained", "step_s": 0.25}


def test_a_run_directory_from_before_record_versions_still_reads(tmp_path):
    run = RunDir(tmp_path).create()
    for path, old in ((run.job_json, OLD_JOB), (run.launcher_state, OLD_LAUNCHER),
                      (run.role_state("trainer"), OLD_STATE)):
        path.write_text(json.dumps(old, indent=2, sort_keys=True))
    job, launcher, state = run.read_job(), run.read_launcher(), run.read_state("trainer")
    assert job.version == RECORD_VERSION and job.backend is Backend.SLURM and job.launches == {"inference": 0, "trainer": 1}
    assert launcher.status is LauncherStatus.RUNNING and launcher.first_failure is None
    failure = launcher.launches["inference"].failures[0]
    assert failure.action is ServerAction.RESTARTING and failure.ready_after_s is None
    assert state.status is RoleState.RUNNING and state.step == 3 and state.weights_attempt is None
    for path, old, kind in ((run.pins_dir / "orchestrator.json", OLD_PIN, StepPin),
                            (run.root / "weights" / "step_2" / "STABLE", OLD_MARKER, StableMarker),
                            (run.root / "tenants" / "exp-a.json", OLD_TENANT, TenantRecord)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(old))
        assert records.read(path, kind).version == RECORD_VERSION  # unchanged since 1: read as if written now
    # The old pin reads, but was renewed last at time 5.0: its lease (retention.LEASE_S) ran out long ago.
    assert records.read(run.pins_dir / "orchestrator.json", StepPin).step == 3 and run.weight_pins() == {}
    assert run.stable_steps("weights") == []  # its file is missing
    assert records.read_marker(run.root / "weights" / "step_2" / "STABLE").step == 2
    # Written again, every field is there with its name as before (version 2's renames applied), and the version.
    atomic_write_json(run.job_json, job)
    renamed = {k: v for k, v in OLD_JOB.items() if k != "steps"}
    assert json.loads(run.job_json.read_text()) == {**renamed, "launches": OLD_JOB["steps"], "version": RECORD_VERSION}
    run.heartbeat("trainer", step=4)
    again = json.loads(run.role_state("trainer").read_text())
    assert again["version"] == RECORD_VERSION and again["step"] == 4 and again["pid"] == 9


def test_unknown_fields_are_ignored_and_missing_optional_ones_defaulted(tmp_path):
    run = RunDir(tmp_path).create()
    run.task_exit("inference", 0).parent.mkdir(parents=True)
    run.task_exit("inference", 0).write_text(json.dumps({"exit_code": 1, "time": 5, "extra": {"x": 1}}))
    assert run.read_task_exit("inference", 0) == TaskExit(exit_code=1, time=5.0)


def test_a_later_version_is_refused_naming_the_file_and_the_version(tmp_path):
    run = RunDir(tmp_path).create()
    run.launcher_state.write_text(json.dumps({**OLD_LAUNCHER, "version": RECORD_VERSION + 1}))
    with pytest.raises(RunDirError) as info:
        run.read_launcher()
    message = str(info.value)
    assert message == (f"{run.launcher_state}: record version {RECORD_VERSION + 1} is newer than this prl reads "
                       f"({RECORD_VERSION}); use the prl that wrote the run")
    assert "\n" not in message


def test_a_record_of_the_wrong_shape_is_refused_naming_the_file_and_field(tmp_path):
    run = RunDir(tmp_path).create()
    run.job_json.write_text(json.dumps({**OLD_JOB, "backend": "kubernetes"}))
    with pytest.raises(RunDirError, match=r"job\.json: not a valid JobRecord .*\$\.backend"):
        run.read_job()
    run.job_json.write_text("[1, 2]")
    with pytest.raises(RunDirError, match=r"job\.json: not a prl record"):
        run.read_job()


def test_write_state_takes_only_fields_of_the_role_state(tmp_path):
    run = RunDir(tmp_path)
    state = run.write_state("trainer", step=2, weights_attempt=1)
    assert isinstance(state, RoleStateRecord) and (state.step, state.weights_attempt) == (2, 1)
    assert run.write_state("trainer", phase="x").step == 2, "fields merge"
    with pytest.raises(TypeError, match="stepp not a field of RoleStateRecord"):
        run.write_state("trainer", stepp=3)
    with pytest.raises(RunDirError, match=r"trainer\.json: not a valid RoleStateRecord .*\$\.step"):
        run.write_state("trainer", step="three")
    assert run.read_state("trainer").step == 2, "a refused write leaves the file as it was"


def test_the_backend_is_a_closed_vocabulary_that_reads_as_its_string():
    assert [b.value for b in Backend] == ["slurm", "local"]
    assert Backend("slurm") is Backend.SLURM and Backend.LOCAL == "local" and f"{Backend.SLURM}" == "slurm"
    assert json.dumps({"backend": Backend.LOCAL}) == '{"backend": "local"}'
    with pytest.raises(ValueError):
        Backend("kubernetes")
    assert RunDir("/r").launcher_log(Backend.SLURM, "12").name == "slurm-12.out"
    assert RunDir("/r").launcher_log(Backend.LOCAL).name == "launcher.log"
