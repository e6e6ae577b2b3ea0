"""`prl submit/status/logs/cancel` against the real local Slurm cluster, as a user runs them.

The lab topology runs in preflight mode (`--preflight --hold N`): every role does its real
preflight on its allocated node, reports ready, and holds the allocation; the launcher
starts roles in order and ends the job on the first failure.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, prl_cli as prl, wait_for

pytestmark = pytest.mark.slurm


def status(env, run) -> dict:
    return json.loads(prl(env, "status", run, "--json").stdout)


@pytest.fixture
def lab(tmp_path, env, model, slurm_cluster):
    """Submit the lab topology; cancel whatever is left at the end."""
    runs = []

    def submit(*overrides, hold=20, name="run"):
        run = tmp_path / name
        result = prl(env, "submit", "configs/lab.yaml", f"run_dir={run}", f"model.path={model}", *overrides,
                     "--preflight", "--hold", hold)
        assert "submitted job" in result.stdout
        runs.append(run)
        return run, json.loads((run / "job.json").read_text())

    yield submit
    for run in runs:
        prl(env, "cancel", run, check=False)


def test_roles_run_in_order_then_complete(lab, env):
    run, job = lab(hold=10)
    assert job["components"] == {"0": "inference", "1": "orchestrator", "2": "trainer"}
    running = wait_for("every role running", lambda: (s := status(env, run))["state"] == "RUNNING" and all(
        r["status"] == "running" and r["slurm_state"] == "RUNNING" for r in s["roles"]) and s, timeout=60)
    assert [r["component"] for r in running["roles"]] == [f"{job['job_id']}+{i}" for i in range(3)]
    assert running["roles"][2]["nodes"]  # the trainer's two nodes
    done = wait_for("COMPLETED", lambda: (s := status(env, run))["state"] == "COMPLETED" and s, timeout=90)
    assert [r["exit_code"] for r in done["roles"]] == [0, 0, 0]
    launcher = json.loads((run / "state" / "launcher.json").read_text())
    # Every role starts at once, in plan order: the servers and the trainer wait for none, the orchestrator waits
    # for the servers itself (docs/jobs.md).
    starts = [launcher["launches"][r]["started"] for r in ("inference", "orchestrator", "trainer")]
    assert starts == sorted(starts), "roles must start in the launcher's order"
    assert (run / "logs" / "attempt_1" / "trainer" / "rank_1.log").exists()


def test_a_failing_role_ends_the_job_and_status_names_it(lab, env):
    # The trainer's rendezvous port is taken on its node: its preflight fails for real,
    # while inference and orchestrator hold their nodes for 300 s.
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("0.0.0.0", 18500))
    blocker.listen()
    try:
        run, job = lab(hold=300)
        start = time.monotonic()
        final = wait_for("the job to end", lambda: (s := status(env, run))["state"] in ("FAILED", "COMPLETED",
                                                                                         "CANCELLED") and s, 90)
        took = time.monotonic() - start
    finally:
        blocker.close()
    assert final["state"] == "FAILED", final
    assert took < 60, f"one failing role must end the job quickly, took {took:.0f} s"
    failure = final["failure"]
    assert failure["role"] == "trainer" and failure["exit_code"] == 1
    assert any("port 18500 is taken" in line for line in failure["log_tail"]), failure["log_tail"]
    shown = prl(env, "status", run, check=False)
    assert shown.returncode == 1 and "first failure: trainer exited 1" in shown.stdout
    assert "port 18500 is taken" in shown.stdout
    assert prl(env, "logs", run).stdout.count("preflight failed") == 1  # default role: the one that failed


def _all_running(env, run):
    s = status(env, run)
    return s["state"] == "RUNNING" and all(r["status"] == "running" for r in s["roles"]) and s


def test_cancel_gives_cancelled(lab, env):
    run, job = lab(hold=300)
    wait_for("every role running", lambda: _all_running(env, run), 60)
    assert "cancelled job" in prl(env, "cancel", run).stdout
    final = wait_for("CANCELLED", lambda: (s := status(env, run))["state"] == "CANCELLED" and s, 60)
    assert json.loads((run / "job.json").read_text())["cancelled"]
    assert all(r["status"] in ("stopped", "killed") for r in final["roles"]), final["roles"]


@pytest.mark.slow
def test_time_limit_gives_timeout(lab, env):
    run, job = lab("slurm.time=1", "cluster.requeue.signal_seconds=0", "cluster.requeue.enabled=false", hold=600)
    wait_for("running", lambda: status(env, run)["state"] == "RUNNING", 60)
    wait_for("TIMEOUT", lambda: status(env, run)["state"] == "TIMEOUT", timeout=150, interval=2)


def says(log: Path, text: str) -> bool:
    """`log` exists and has `text` (a role's log file appears when srun starts its step, after "running")."""
    return log.is_file() and text in log.read_text()


def test_requeue_starts_attempt_2_and_keeps_attempt_1_logs(lab, env):
    run, job = lab(hold=300)
    wait_for("every role running", lambda: _all_running(env, run), 60)
    first_log = run / "logs" / "attempt_1" / "trainer" / "rank_0.log"
    wait_for("the trainer to log", lambda: says(first_log, "holding"), 60)
    first_inference = run / "logs" / "attempt_1" / "inference" / "rank_0.log"
    wait_for("the inference server to log", lambda: says(first_inference, "attempt 1"), 60)
    subprocess.run(["scontrol", "requeue", job["job_id"]], check=True)
    wait_for("attempt 2 running", lambda: (s := status(env, run))["attempt"] == 2 and s["state"] == "RUNNING"
             and all(r["status"] == "running" for r in s["roles"]) and s, timeout=120, interval=1)
    assert os.readlink(run / "logs" / "latest") == "attempt_2"
    text = first_log.read_text()
    assert "preflight on" in text and "attempt 1" in text, "attempt 1's log was overwritten"
    # "running" means the launcher started the role's process; its first log line follows moments later
    second = run / "logs" / "attempt_2" / "trainer" / "rank_0.log"
    wait_for("attempt 2's trainer to log", lambda: says(second, "attempt 2"), 60)
    assert "attempt 1" in first_inference.read_text(), "attempt 1's inference log was overwritten"


def test_logs_follow_streams_a_growing_log(lab, env):
    run, job = lab(hold=14)
    wait_for("the trainer log", lambda: (run / "logs" / "latest" / "trainer" / "rank_0.log").exists(), 60)
    proc = subprocess.Popen([sys.executable, "-m", "prl.cli", "logs", str(run), "--role", "trainer", "-f", "-n", "0"],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    lines, stamps = [], []
    deadline = time.monotonic() + 90
    try:
        for line in proc.stdout:
            lines.append(line)
            stamps.append(time.monotonic())
            if time.monotonic() > deadline:
                break
        proc.wait(timeout=30)
    finally:
        proc.kill()
    holding = [i for i, line in enumerate(lines) if "holding the allocation" in line]
    assert len(holding) >= 2, lines
    assert stamps[holding[-1]] - stamps[holding[0]] >= 4, "lines must arrive as they are written, not at the end"
    assert proc.returncode == 0, "-f stops by itself once the job has ended"


def test_status_without_an_argument_is_the_latest_run(lab, env):
    run, job = lab(hold=1, name="latest")
    out = prl(env, "status", "--json").stdout
    assert json.loads(out)["run_dir"] == str(run)
    assert json.loads(prl(env, "status", job["job_id"], "--json").stdout)["run_dir"] == str(run)


def test_rejected_submission_prints_sbatchs_words_and_records_nothing(tmp_path, env, model, slurm_cluster):
    run = tmp_path / "rejected"
    result = prl(env, "submit", "configs/lab.yaml", f"run_dir={run}", f"model.path={model}",
                 "cluster.partitions.trainer=nosuchpart", "--preflight", check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "invalid partition" in result.stderr.lower() and "partitions.*" in result.stderr, result.stderr
    assert not (run / "job.json").exists()


def test_a_run_directory_with_a_job_is_refused(lab, env, model):
    run, job = lab(hold=1, name="twice")
    again = prl(env, "submit", "configs/lab.yaml", f"run_dir={run}", f"model.path={model}", "--preflight", check=False)
    assert again.returncode == 2 and f"already holds job {job['job_id']}" in again.stderr


@pytest.mark.slow
def test_time_limit_warning_requeues_the_job(lab, env):
    """The lab profile asks for TERM 60 s before the limit and allows requeue: the launcher
    stops the roles (their checkpoint window) and requeues, and attempt 2 starts."""
    run, job = lab("slurm.time=2", hold=600)
    wait_for("every role running", lambda: _all_running(env, run), 60)
    wait_for("attempt 2", lambda: (s := status(env, run))["attempt"] == 2 and s["state"] == "RUNNING" and s,
             timeout=200, interval=2)
    batch_log = (run / "logs" / f"slurm-{job['job_id']}.out").read_text()
    assert "(time-limit warning)" in batch_log and "job requeued" in batch_log, batch_log
    assert "stopped by signal 15" in (run / "logs" / "attempt_1" / "trainer" / "rank_0.log").read_text()
