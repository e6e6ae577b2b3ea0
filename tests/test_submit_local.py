"""`prl submit --local`: the same launcher, run directory and log layout, as local processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

from prl.run.rundir import RunDir
from prl.states import LauncherStatus
from tests.helpers import REPO, prl_cli as prl, wait_for


def state(env, run) -> dict:
    return json.loads(prl(env, "status", run, "--json").stdout)


def submit(env, run, model, *extra, hold=5):
    return prl(env, "submit", "configs/local-tiny.yaml", f"run_dir={run}", f"model.path={model}", "--local",
               "--detach", "--preflight", "--hold", hold, *extra)


def test_local_preflight_run_completes_with_the_slurm_layout(tmp_path, env, model):
    run = tmp_path / "run"
    out = submit(env, run, model, hold=2).stdout
    assert "submitted local run" in out
    final = wait_for("COMPLETED", lambda: (s := state(env, run))["state"] == "COMPLETED" and s, 60)
    assert [r["role"] for r in final["roles"]] == ["inference", "orchestrator", "trainer"]
    assert [r["exit_code"] for r in final["roles"]] == [0, 0, 0]
    assert os.readlink(run / "logs" / "latest") == "attempt_1"
    log = prl(env, "logs", run, "--role", "inference").stdout
    assert "preflight on" in log and "[   ok] run_dir" in log
    assert "already ended; nothing to cancel" in prl(env, "cancel", run).stdout
    assert RunDir(run).read_job().cancelled is None
    doctor = prl(env, "doctor", run, "--role", "bogus", check=False)
    assert doctor.returncode == 2 and "this run's roles are inference, orchestrator, trainer" in doctor.stderr
    doctor = prl(env, "doctor", run, "--role", "trainer", "--lenient")
    assert "[   ok] run_dir" in doctor.stdout


def test_local_failure_is_reported(tmp_path, env):
    run = tmp_path / "run"
    submit(env, run, tmp_path / "no-model", "model.build_tiny=null", hold=60)  # no model, and none built
    final = wait_for("FAILED", lambda: (s := state(env, run))["state"] == "FAILED" and s, 60)
    # Both the servers and the trainer check the model in their preflight, and they start together: whichever
    # exits first is the cause (CI saw either), and its own log names the missing config.json.
    failed = final["failure"]["role"]
    assert failed in ("inference", "trainer") and final["failure"]["exit_code"] == 1, final["failure"]
    assert any("has no config.json" in line for line in final["failure"]["log_tail"])
    # The other model role is stopped (or fails on its own a moment later); the orchestrator, which starts with
    # the servers and waits for them itself, is stopped with the job: the failure stays the server's or trainer's.
    status = {r["role"]: r["status"] for r in final["roles"]}
    other = "trainer" if failed == "inference" else "inference"
    assert status[failed] == "failed" and status["orchestrator"] == "stopped", status
    assert status[other] in ("stopped", "failed"), status
    # Its own line, not an exit code: the preflight's check names the missing config.json.
    assert "preflight failed" in final["failure"]["reason"] and "has no config.json" in final["failure"]["reason"]


def test_a_roles_own_error_line_reaches_submit_and_status(tmp_path, env):
    """A role's error line never reaching the user: a trainer rank ends on a PrlError (empty SFT data, found at
    trainer start), torchrun passes on only an exit code (its own traceback in the rank's log), yet `prl submit
    --local` and `prl status` both name the failure by the rank's own line."""
    run, data = tmp_path / "run", tmp_path / "empty.jsonl"
    data.write_text("")
    line = f"sft.data {data} holds no conversations"
    submitted = prl(env, "submit", "configs/sft-tiny.yaml", f"run_dir={run}", f"model.path={tmp_path / 'tiny'}",
                    f"sft.data={data}", "--local", check=False, timeout=300)
    assert submitted.returncode == 1, submitted.stdout + submitted.stderr
    # Every rank meets the same data: the first to record it is named ("rank 1: " when not rank 0).
    said = re.compile(rf"(rank 1: )?{re.escape(line)}$")
    shown = [out for out in submitted.stdout.splitlines() if "trainer: failed (exit code 1): " in out]
    assert len(shown) == 1 and said.search(shown[0]), submitted.stdout
    final = state(env, run)
    assert final["failure"]["role"] == "trainer" and said.fullmatch(final["failure"]["reason"]), final["failure"]
    wide = {**env, "COLUMNS": "1000"}  # rich wraps at the terminal's width
    assert f"first failure: trainer exited 1 ({final['failure']['reason']})" in prl(wide, "status", run, check=False).stdout
    assert RunDir(run).read_state("trainer").error == final["failure"]["reason"]


def test_local_cancel(tmp_path, env, model):
    run = tmp_path / "run"
    submit(env, run, model, hold=120)
    wait_for("running", lambda: all(r["status"] == "running" for r in state(env, run)["roles"]), 60)
    log = run / "logs" / "attempt_1" / "trainer" / "rank_0.log"
    # "running" means started; the role has its SIGTERM handler once it holds
    wait_for("the trainer to hold", lambda: log.exists() and "holding" in log.read_text(), 30)
    prl(env, "cancel", run)
    final = wait_for("CANCELLED", lambda: (s := state(env, run))["state"] == "CANCELLED" and s, 60)
    assert all(r["status"] == "stopped" for r in final["roles"]), final["roles"]
    assert "stopped by signal 15" in log.read_text()


def _ctrl_c_reaches_python() -> None:
    """As in a terminal: a suite started in the background (`cmd &` without job control) ignores SIGINT,
    and Python keeps an ignored SIGINT ignored, so the CLI under test would never see its Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_every_role(tmp_path, env, model):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "prl.cli", "submit", "configs/local-tiny.yaml", f"run_dir={run}",
                             f"model.path={model}", "--local", "--preflight", "--hold", "120"],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ctrl_c_reaches_python)
    # `prl status` says running once the launcher started a role; its pid is in its state file a moment later.
    wait_for("running", lambda: (run / "state" / "launcher.json").exists()
             and all(r["status"] == "running" for r in state(env, run)["roles"])
             and all((run / "state" / f"{r}.json").exists() for r in ("inference", "trainer")), 60)
    pids = [RunDir(run).read_state(r).pid for r in ("inference", "trainer")]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, out + err
    assert "ended with exit code" in out
    assert RunDir(run).read_launcher().status == LauncherStatus.STOPPED
    for pid in pids:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}"), f"role process {pid} outlived Ctrl-C"
