"""The run directory: layout, atomic publish, waiting, clashes, cleanup, crash safety."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from prl.errors import PrlError, RunDirError, StepTimeout
from prl.run.rundir import MARKER, RunDir, atomic_write_json, atomic_write_text, current_attempt, is_stable, step_of
from prl.states import RoleState

REPO = Path(__file__).resolve().parents[1]


def test_layout(tmp_path):
    run = RunDir(tmp_path)
    assert run.topology_yaml == tmp_path / "topology.yaml"
    assert run.plan_json == tmp_path / "plan.json" and run.job_json == tmp_path / "job.json"
    assert run.scripts_dir == tmp_path / "scripts" and run.metrics_jsonl == tmp_path / "metrics.jsonl"
    assert run.role_log(2, "trainer") == tmp_path / "logs/attempt_2/trainer/trainer.log"
    assert run.role_log(0, "trainer", rank=3) == tmp_path / "logs/attempt_0/trainer/rank_3.log"
    assert run.role_state("orchestrator") == tmp_path / "state/orchestrator.json"
    assert run.rollouts(4) == tmp_path / "rollouts/step_4"
    assert run.weights(4) == tmp_path / "weights/step_4"
    assert run.checkpoints(4, "trainer") == tmp_path / "checkpoints/step_4/trainer"
    with pytest.raises(RunDirError, match="unknown role"):
        run.role_state("trainr")
    assert not tmp_path.joinpath("logs").exists(), "constructing a RunDir touches nothing"


def test_atomic_writes_and_latest_logs(tmp_path):
    run = RunDir(tmp_path).create()
    atomic_write_json(run.plan_json, {"a": 1})
    atomic_write_text(run.topology_yaml, "x: 1\n")
    assert json.loads(run.plan_json.read_text()) == {"a": 1}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temp files left"
    run.link_latest_logs(0)
    run.link_latest_logs(1)
    assert run.latest_logs.resolve() == run.attempt_logs(1).resolve()


def test_attempts_and_the_latest_one(tmp_path):
    run = RunDir(tmp_path)
    assert run.attempts() == [] and run.latest_attempt() is None, "no logs dir yet"
    for name in ("attempt_3", "attempt_1", "attempt_10", "attempt_x", "attempt_2.old", "launcher.log"):
        (run.logs_dir / name).mkdir(parents=True)
    assert run.attempts() == [1, 3, 10]
    assert run.latest_attempt() == 10, "without the latest link: the highest attempt"
    run.link_latest_logs(3)
    assert run.latest_attempt() == 3, "the link decides (a resubmission may leave a higher stale dir)"
    assert run.attempts() == [1, 3, 10], "logs/latest is not an attempt"


def test_rank_logs_are_parsed_by_rank_number(tmp_path):
    run = RunDir(tmp_path)
    assert run.rank_logs(1, "inference") == [], "the role has not started"
    folder = run.role_logs_dir(1, "inference")
    folder.mkdir(parents=True)
    for name in ("rank_10.log", "rank_2.log", "rank_0.log", "inference.log", "rank_x.log", "rank_3.log.1"):
        (folder / name).write_text("")
    assert run.rank_logs(1, "inference") == [(0, folder / "rank_0.log"), (2, folder / "rank_2.log"),
                                             (10, folder / "rank_10.log")]
    assert run.rank_logs(2, "inference") == []
    with pytest.raises(RunDirError, match="unknown role"):
        run.rank_logs(1, "trainr")


def test_log_paths_of_the_launcher_and_of_srun(tmp_path):
    run = RunDir(tmp_path)
    assert run.launcher_log("local") == tmp_path / "logs/launcher.log"
    assert run.launcher_log("slurm", "77") == tmp_path / "logs/slurm-77.out"
    assert run.batch_log_pattern.replace("%j", "77") == str(run.launcher_log("slurm", "77"))
    assert run.task_log_pattern(2, "decode").replace("%t", "5") == str(run.role_log(2, "decode", 5))


@pytest.mark.parametrize("env, want", [
    ({}, 1),
    ({"PRL_ATTEMPT": "4"}, 4),
    ({"PRL_ATTEMPT_BASE": "2"}, 3),
    ({"PRL_ATTEMPT_BASE": "2", "SLURM_RESTART_COUNT": "1"}, 4),
    ({"SLURM_RESTART_COUNT": "2"}, 3),
    ({"PRL_ATTEMPT": "2", "PRL_ATTEMPT_BASE": "5", "SLURM_RESTART_COUNT": "5"}, 2),
    ({"PRL_ATTEMPT": "", "PRL_ATTEMPT_BASE": "x", "SLURM_RESTART_COUNT": "-1"}, 1),
])
def test_current_attempt_counts_from_one(env, want):
    assert current_attempt(env) == want


def test_claim_defaults_to_the_current_attempt(tmp_path, monkeypatch):
    run = RunDir(tmp_path)
    for var in ("PRL_ATTEMPT", "PRL_ATTEMPT_BASE", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    assert run.claim("orchestrator").attempt == 1
    monkeypatch.setenv("PRL_ATTEMPT", "3")
    assert run.claim("orchestrator").attempt == 3


def test_weights_root_and_step_names(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    run = RunDir(tmp_path / "link")
    assert run.weights_root() == real / "weights", "resolved: the run dir may sit behind a symlink"
    assert step_of(run.weights(12)) == 12 and step_of("step_0") == 0
    assert [step_of(name) for name in ("step_", "step_1x", ".step_3.tmp-a", "weights", "step_-1")] == [None] * 5


def test_state_files_hold_plain_strings(tmp_path):
    """The states are enums in code; on disk they stay the strings `prl status` and older runs read."""
    run = RunDir(tmp_path)
    run.claim("trainer", attempt=1)
    assert json.loads(run.role_state("trainer").read_text())["status"] == "running"
    run.mark_exit("trainer", 3)
    assert '"status": "failed"' in run.role_state("trainer").read_text()


def test_publish_wait_and_clash(tmp_path):
    run = RunDir(tmp_path)
    d = run.publish_dir(run.weights(1), lambda t: (t / "a.bin").write_bytes(b"x" * 10), step=1)
    assert is_stable(d) and (d / "a.bin").read_bytes() == b"x" * 10
    assert json.loads((d / MARKER).read_text())["files"] == {"a.bin": 10}
    assert run.latest_stable("weights") == 1 and run.stable_steps("weights") == [1]
    with pytest.raises(RunDirError, match="already published"):
        run.publish_dir(run.weights(1), lambda t: None)
    assert run.wait_for_step("weights", 1, timeout=0) == d

    # A failing writer publishes nothing and leaves nothing behind.
    with pytest.raises(ZeroDivisionError):
        run.publish_dir(run.weights(2), lambda t: 1 / 0)
    assert run.steps("weights") == [1] and not list((tmp_path / "weights").glob(".*"))


def test_unmarked_leftovers_are_invisible_and_replaced(tmp_path):
    run = RunDir(tmp_path)
    run.weights(3).mkdir(parents=True)  # renamed, killed before the marker
    (run.weights(3) / "half").write_text("?")
    (tmp_path / "weights" / ".step_3.tmp-dead-1").mkdir()
    assert run.latest_stable("weights") is None
    with pytest.raises(StepTimeout):
        run.wait_for_step("weights", 3, timeout=0.05)
    run.publish_dir(run.weights(3), lambda t: (t / "ok").write_text("!"))
    assert sorted(p.name for p in run.weights(3).iterdir()) == [MARKER, "ok"]
    assert not list((tmp_path / "weights").glob(".*"))


def test_a_temp_dir_never_holds_the_marker(tmp_path, monkeypatch):
    """STABLE appears only in the directory under its final name: a reader handed a temp dir's path (or one
    left by a writer killed before its rename) never takes it for a published step."""
    from prl.run import rundir

    run = RunDir(tmp_path)
    renames, real_rename = [], os.rename

    def spy(src, dst):
        renames.append((Path(src).name, Path(dst).name, (Path(src) / MARKER).exists()))
        return real_rename(src, dst)

    monkeypatch.setattr(rundir.os, "rename", spy)
    d = run.publish_dir(run.weights(1), lambda t: (t / "a.bin").write_bytes(b"x"), step=1)
    (tmp, _, marked), (pending, stable, _) = renames
    assert tmp.startswith(".step_1.tmp-") and not marked and (pending, stable) == (".STABLE.pending", MARKER)
    assert is_stable(d) and sorted(p.name for p in d.iterdir()) == [MARKER, "a.bin"]

    def killed_between_the_renames(src, dst):
        if Path(dst).name == MARKER:
            raise OSError("killed")
        return real_rename(src, dst)

    monkeypatch.setattr(rundir.os, "rename", killed_between_the_renames)
    with pytest.raises(RunDirError):
        run.publish_dir(run.weights(2), lambda t: (t / "a.bin").write_bytes(b"y"))
    assert run.weights(2).is_dir() and not is_stable(run.weights(2)) and run.stable_steps("weights") == [1]
    monkeypatch.setattr(rundir.os, "rename", real_rename)
    assert is_stable(run.publish_dir(run.weights(2), lambda t: (t / "a.bin").write_bytes(b"z")))  # replaced

    with pytest.raises(RunDirError, match="holds a STABLE marker"):  # a writer that copied a published step
        run.publish_dir(run.weights(3), lambda t: (t / MARKER).write_text((d / MARKER).read_text()))
    assert not run.weights(3).exists() and not list((tmp_path / "weights").glob(".*"))


def test_wait_for_step_heartbeats_then_returns(tmp_path):
    run = RunDir(tmp_path)
    beats = []
    threading.Timer(0.3, lambda: run.publish_dir(run.rollouts(1), lambda t: None)).start()
    got = run.wait_for_step(
        "rollouts", 1, timeout=10, heartbeat=lambda: beats.append(1), poll=0.02, heartbeat_every=0.05
    )
    assert got == run.rollouts(1) and len(beats) >= 3


def test_wait_for_step_timeout_names_the_step(tmp_path):
    run = RunDir(tmp_path)
    with pytest.raises(StepTimeout, match=r"rollouts/step_7.*latest published rollouts step is None") as e:
        run.wait_for_step("rollouts", 7, timeout=0.1, poll=0.02)
    assert isinstance(e.value, PrlError)


def test_heartbeat_and_claim(tmp_path):
    run = RunDir(tmp_path)
    st = run.claim("trainer", attempt=0)
    assert st.status == RoleState.RUNNING and st.pid == os.getpid()
    run.heartbeat("trainer", step=3)
    assert run.read_state("trainer").step == 3
    run.claim("trainer", attempt=0)  # the same process may re-claim
    # Another live writer (fresh heartbeat, a live pid: here our parent) is a clash...
    alive = msgspec.structs.replace(run.read_state("trainer"), pid=os.getppid(), heartbeat=time.time())
    atomic_write_json(run.role_state("trainer"), alive)
    with pytest.raises(RunDirError, match="already running"):
        run.claim("trainer", attempt=0)
    # ...a stale heartbeat is not (its job died without saying so), nor a dead pid on this host,
    run.claim("trainer", attempt=0, stale_after=0.0)
    atomic_write_json(run.role_state("trainer"), msgspec.structs.replace(alive, pid=2**22 + 12345))
    run.claim("trainer", attempt=0)
    # ...nor a later attempt (Slurm requeued the job).
    atomic_write_json(run.role_state("trainer"), alive)
    run.claim("trainer", attempt=1)
    run.mark_exit("trainer", 0)
    assert run.read_state("trainer").status == RoleState.EXITED
    with pytest.raises(RunDirError, match="later than this"):
        run.claim("trainer", attempt=0)


def _publish_steps(run, steps):
    for s in steps:
        run.publish_dir(run.weights(s), lambda t: (t / "w").write_text(str(s)))


def test_cleanup_keeps_what_staleness_and_checkpoints_need(tmp_path):
    run = RunDir(tmp_path)
    _publish_steps(run, range(1, 9))
    for s in range(1, 11):
        run.publish_dir(run.rollouts(s), lambda t: None)
    for s in (2, 4, 6, 8):
        run.publish_dir(run.checkpoints(s, "trainer"), lambda t: None)
    run.checkpoints(6, "orchestrator").mkdir()
    run.cleanup(8, max_off_policy_steps=2, checkpoint_keep=2)
    assert run.steps("weights") == [6, 7, 8]
    assert run.stable_steps("checkpoints") == [6, 8] and run.steps("checkpoints") == [6, 8]
    assert run.checkpoints(6, "orchestrator").is_dir()
    assert run.steps("rollouts") == [9, 10], "after the newest checkpoint, incl. not-yet-consumed"


def test_cleanup_without_checkpoints_keeps_rollouts_for_replay(tmp_path):
    run = RunDir(tmp_path)
    for s in range(1, 5):
        run.publish_dir(run.rollouts(s), lambda t: None)
    run.cleanup(4, max_off_policy_steps=0, checkpoint_keep=2)
    assert run.steps("rollouts") == [1, 2, 3, 4]


def test_cleanup_keeps_the_newest_rollouts_step_where_a_requeued_orchestrator_resumes(tmp_path):
    """The orchestrator caught up with the trainer (step 8 trained and checkpointed): every rollouts step is
    consumed and replayable from the checkpoint, but the newest stays, or a requeued orchestrator would
    find none, start again from step 1 and drop its metrics records of steps 1-8."""
    run = RunDir(tmp_path)
    for s in range(1, 9):
        run.publish_dir(run.rollouts(s), lambda t: None)
        run.append_metrics({"role": "orchestrator", "step": s})
    for s in (6, 8):
        run.publish_dir(run.checkpoints(s, "trainer"), lambda t: None)
    run.cleanup(8, max_off_policy_steps=1, checkpoint_keep=2)
    assert run.steps("rollouts") == [8]
    assert run.latest_stable("rollouts") == 8
    run.drop_metrics_after("orchestrator", run.latest_stable("rollouts"))  # what the orchestrator does at start
    assert [r["step"] for r in run.read_metrics("orchestrator")] == list(range(1, 9))


def test_resume_leftovers_and_metrics(tmp_path):
    run = RunDir(tmp_path)
    _publish_steps(run, range(1, 6))
    for s in range(1, 6):
        run.append_metrics({"role": "trainer", "step": s})
    run.append_metrics({"role": "orchestrator", "step": 9})
    with open(run.metrics_jsonl, "a") as f:
        f.write('{"role": "trainer", "st')  # torn last line of a killed writer
    assert [m["step"] for m in run.read_metrics("trainer")] == [1, 2, 3, 4, 5]
    # The next record (the resumed writer's) starts a line of its own: only the torn line is lost.
    run.append_metrics({"role": "orchestrator", "step": 10})
    assert [m["step"] for m in run.read_metrics("orchestrator")] == [9, 10]
    assert run.metrics_jsonl.read_text().endswith('"st\n{"role": "orchestrator", "step": 10}\n')
    assert run.remove_steps_after("weights", 3) == [4, 5]
    assert run.drop_metrics_after("trainer", 3) == 2  # records; the torn line was none
    assert [m["step"] for m in run.read_metrics()] == [1, 2, 3, 9, 10]
    run.append_metrics({"role": "trainer", "step": 4})  # the resumed trainer's records stay
    assert [m["step"] for m in run.read_metrics("trainer")] == [1, 2, 3, 4]


# -- crash safety: SIGKILL a writer at random points, readers never accept a partial step

_WRITER = """
import sys, numpy as np
from safetensors.numpy import save_file
from prl.run.rundir import RunDir
run, step = RunDir(sys.argv[1]), int(sys.argv[2])
def write(t, s):
    for k in range(4):
        save_file({"x": np.full(256 * 1024, s * 10 + k, dtype=np.float32)}, str(t / f"part{k}.safetensors"))
while True:
    run.publish_dir(run.weights(step), lambda t: write(t, step), step=step)
    step += 1
"""


def _check_accepted(run):
    from safetensors.numpy import load_file

    for s in run.stable_steps("weights"):
        for k in range(4):
            x = load_file(str(run.weights(s) / f"part{k}.safetensors"))["x"]
            assert x.shape == (256 * 1024,) and (x == s * 10 + k).all(), f"step {s} part {k} is damaged"


def test_sigkill_mid_publish_never_leaves_an_accepted_partial_step(tmp_path):
    import random

    run = RunDir(tmp_path)
    rng = random.Random(0)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    caught_mid_publish = 0
    for _ in range(6):
        start = (run.latest_stable("weights") or 0) + 1  # a restarted writer continues after the last stable step
        p = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(start)], env=env)
        time.sleep(0.4 + rng.random() * 0.6)
        p.send_signal(signal.SIGKILL)
        p.wait()
        _check_accepted(run)
        unmarked = set(run.steps("weights")) - set(run.stable_steps("weights"))
        caught_mid_publish += bool(unmarked or list((tmp_path / "weights").glob(".step_*")))
    steps = run.steps("weights")
    assert run.stable_steps("weights"), "the writer got some steps through"
    assert caught_mid_publish >= 3, "the kills should land inside publish_dir"
    assert len(steps) - len(run.stable_steps("weights")) <= 1, "at most the last (killed) step is unmarked"


# -- metrics.jsonl: two roles that resume while the other appends

_METRICS_WRITER = """
import sys, time
from pathlib import Path
from prl.run.rundir import RunDir
run, role, rounds, steps = RunDir(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
(run.root / f"ready-{role}").touch()
while not (run.root / "go").exists():  # both start at once: their drops and appends interleave
    time.sleep(0.001)
for _ in range(rounds):
    run.drop_metrics_after(role, 0)  # what a resumed role does at its start
    for step in range(1, steps + 1):
        run.append_metrics({"role": role, "step": step})
"""


def test_two_roles_resuming_while_the_other_appends_lose_no_line_and_bring_none_back(tmp_path):
    run = RunDir(tmp_path).create()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", _METRICS_WRITER, str(tmp_path), role, "200", "20"], env=env)
             for role in ("trainer", "orchestrator")]
    while not all((tmp_path / f"ready-{role}").exists() for role in ("trainer", "orchestrator")):
        time.sleep(0.01)
    (tmp_path / "go").touch()
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    for role in ("trainer", "orchestrator"):
        assert [r["step"] for r in run.read_metrics(role)] == list(range(1, 21)), role
    # The file only grew: a reader that follows it (`prl submit --local`'s progress) never loses its place.
    # (An append that finds the other's line not yet ended starts its own on a new line: an empty line at most.)
    lines = [line for line in run.metrics_jsonl.read_text().splitlines() if line]
    assert len(lines) == 2 * 200 * 20 + 2 * 200 - 2, "every append and every resume after the first is a line"
