"""Resilience logic without a cluster: failure policies in the plan, the launcher's server restarts
and hang detection (with real child processes), the hand-off protocol (STABLE inside the rename,
verified markers, fenced temp dirs, pinned weights, a real full disk), and what `prl status` shows.
The same behaviour on the real cluster with real vLLM is tests/test_faults_slurm.py."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from prl import weights
from prl.errors import ConfigError, RunDirError
from prl.job import launch as launch_module
from prl.job.launch import Launcher, RoleFailed, RoleHung, Running, restart_srun_args
from prl.ops.status import collect, show
from prl.planner.model import HANG_FLOOR_S
from prl.run import api
from prl.run.records import Failure, FeedRecord, LauncherRecord, RankBeat, ServerFailure, LaunchRecord
from prl.run.rundir import MARKER, RunDir, atomic_write_json, is_stable
from prl.states import LauncherStatus, RoleState, ServerAction
from tests.helpers import tmpfs, wait_for, publish_endpoint
from testkit.plans import local_plan, write_plan


# ---------------------------------------------------------------- the plan


def test_failure_policies_and_hang_bound_come_from_the_topology(tmp_path):
    plan = local_plan(tmp_path / "run", tmp_path, ["inference.on_failure.max_restarts=5"])
    inference = plan.failure_policy("inference")
    assert (inference.policy, inference.max_restarts) == ("restart", 5)
    assert plan.failure_policy("trainer").policy == "fail"
    assert plan.failure_policy("orchestrator").policy == "fail"
    # Default bound: the floor until steps are seen, then 4x the slowest step once that is above the floor.
    assert plan.hang_timeout_s is None
    assert plan.hang_bound(None) == HANG_FLOOR_S
    assert plan.hang_bound(10.0) == HANG_FLOOR_S
    assert plan.hang_bound(1000.0) == 4000.0
    fixed = local_plan(tmp_path / "run", tmp_path, ["training.hang_timeout_s=45", "inference.on_failure.policy=fail"])
    with pytest.raises(ConfigError, match="hang_timeout_s"):
        local_plan(tmp_path / "run", tmp_path, ["training.hang_timeout_s=10"])
    assert fixed.hang_bound(1000.0) == 45 and fixed.server_hang_s == 45
    assert fixed.failure_policy("inference").policy == "fail"


def test_the_trainer_cannot_be_given_a_restart_policy(tmp_path):
    with pytest.raises(ConfigError, match="trainer.on_failure.policy"):
        local_plan(tmp_path / "run", tmp_path, ["trainer.on_failure.policy=restart"])


def test_restart_srun_args_narrow_the_step_to_the_failed_servers_node():
    args = ("--het-group=0", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=4", "--job-name=inference",
            "--kill-on-bad-exit=1", "--gpus-per-node=2")
    out = restart_srun_args(args, ["n1"])
    assert out == ["--het-group=0", "--cpus-per-task=4", "--job-name=inference", "--kill-on-bad-exit=1",
                   "--gpus-per-node=2", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--overlap", "--mem=0",
                   "--nodelist=n1"]
    assert "--nodelist=n3,n4" in restart_srun_args(args, ["n3", "n4"])


# ---------------------------------------------------------------- the launcher, with real processes

SERVER = """
import json, os, sys, time
from pathlib import Path
from prl.run.rundir import RunDir as Run
run, task = Path(sys.argv[1]), int(os.environ["PRL_TASK"])
restart = int(os.environ.get("PRL_RESTART", "0"))
Run(run).mark_ready("inference", task, "localhost")
if restart == 0 and task == 1:
    time.sleep(0.5)
    # Exits 0, as vLLM's API server does after its engine was killed: still a failure.
    from prl.run.records import TaskExit
    from prl.run.rundir import RunDir
    RunDir(run).write_task_exit("inference", task, TaskExit(
        exit_code=0, time=time.time(), node="n1", failed=True,
        reason="server exited with code 0 while the job was running"))
    sys.exit(0)
time.sleep(60)
"""


def _launcher(tmp_path, overrides=()) -> tuple[Launcher, RunDir]:
    run = write_plan(RunDir(tmp_path / "run"), local_plan(tmp_path / "run", tmp_path, overrides))
    return Launcher(run, launch_module.Plan.read(run), attempt=1, slurm=False, mode="run"), run


def _fake_servers(run: RunDir, tmp_path: Path) -> None:
    """The inference launch script runs a fake server (task 1 dies once, exiting 0)."""
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    run.path("scripts/inference.sh").write_text(f"exec {sys.executable} {script} {run.root}\n")


def test_a_server_that_exits_0_is_restarted_then_a_second_failure_past_the_bound_ends_the_job(tmp_path):
    launcher, run = _launcher(tmp_path, ["inference.nodes=2", "inference.on_failure.max_restarts=1"])
    _fake_servers(run, tmp_path)
    launcher.start(launcher.plan.launch("inference"))
    running = launcher.running["inference"]
    try:
        deadline = time.monotonic() + 20
        while not launcher.state.launch("inference").restarts:
            launcher.check()
            assert time.monotonic() < deadline, launcher.state
            time.sleep(0.1)
        failure = launcher.state.launches["inference"].failures[0]
        assert (failure.task, failure.replica, failure.exit_code) == (1, 1, 0)
        assert "exited with code 0" in failure.reason
        deadline = time.monotonic() + 20
        while failure.action != ServerAction.RESTARTED:
            launcher.check()
            assert time.monotonic() < deadline, failure
            time.sleep(0.1)
        assert failure.ready_after_s >= 0
        saved = json.loads(run.launcher_state.read_text())["launches"]["inference"]
        assert saved["restarts"] == 1 and saved["failures"][0]["action"] == "restarted"
        assert run.read_launcher().launches["inference"] == launcher.state.launches["inference"]
        # The restarted task dies too (killed): max_restarts=1 is used up, so the job fails, naming it.
        os.killpg(running.task_proc[1].pid, signal.SIGKILL)
        with pytest.raises(RoleFailed, match="task 1 .*max_restarts") as info:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                launcher.check()
                time.sleep(0.1)
        assert info.value.role == "inference"
        launcher.finish(launch_module.LauncherStatus.FAILED, 1)
        kept = json.loads(run.attempt_launcher_state(1).read_text())
        assert [f["action"] for f in kept["launches"]["inference"]["failures"]] == ["restarted", "failed"]
    finally:
        for p in running.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_an_orchestrator_with_nothing_left_to_do_does_not_fail_the_attempt(tmp_path):
    """A requeued attempt whose orchestrator finds every rollouts step published exits 0 at once, before it ever
    heartbeats: the trainer, which waits on it, has what it needs, so that is not a failure (it was, and the
    attempt ended FAILED). A server that exits 0 before it is healthy still is one."""
    launcher, run = _launcher(tmp_path)
    run.path("scripts/orchestrator.sh").write_text("exit 0\n")
    launcher.start(launcher.plan.launch("orchestrator"))
    launcher.wait_ready(["orchestrator"])
    assert launcher.running["orchestrator"].exit_code == 0
    assert launcher.state.launches["orchestrator"].status == RoleState.EXITED


def test_a_role_that_ends_by_itself_after_the_last_step_keeps_its_own_exit(tmp_path):
    """The trainer's last step ends the run; an orchestrator still tearing down then gets OWN_END_S to exit on
    its own and keeps its exit 0 (it was stopped with 143, a code that reads as a failure, when a loaded
    machine made its teardown outlast the trainer's last step). One that does not end is stopped after it."""
    from prl.job import launch

    launcher, run = _launcher(tmp_path)
    run.path("scripts/trainer.sh").write_text("exit 0\n")
    run.path("scripts/orchestrator.sh").write_text("sleep 2; exit 0\n")
    launcher.start(launcher.plan.launch("orchestrator"))
    launcher.start(launcher.plan.launch("trainer"))
    launcher.wait_done()
    assert launcher.running["orchestrator"].exit_code == 0
    assert launcher.state.launches["orchestrator"].status == RoleState.EXITED

    launcher, run = _launcher(tmp_path / "2")
    run.path("scripts/trainer.sh").write_text("exit 0\n")
    run.path("scripts/orchestrator.sh").write_text("exec sleep 60\n")
    launcher.start(launcher.plan.launch("orchestrator"))
    launcher.start(launcher.plan.launch("trainer"))
    start = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "OWN_END_S", 1.0)
        launcher.wait_done()
    assert time.monotonic() - start < 30 and launcher.running["orchestrator"].exit_code is None
    launcher.stop_all()
    assert launcher.state.launches["orchestrator"].status == RoleState.STOPPED


REPLICA_TASK = """
import os, signal, sys, time
from prl.job.role import _Stop, record_exit, task_index
from prl.planner.model import Plan
from prl.run.rundir import RunDir, atomic_write_json
run, task = RunDir(sys.argv[1]), task_index()
replica = Plan.read(run).server("inference", task).replica
stop = _Stop()
signal.signal(signal.SIGTERM, stop)
stop.watch(run, run.replica_stop("inference", replica))
print(f"task {task} restart {os.environ.get('PRL_RESTART')}", flush=True)  # logged before it counts as ready
run.mark_ready("inference", task, "localhost")
if os.environ.get("PRL_RESTART") == "0" and task == 0:
    time.sleep(0.5)
    sys.exit(record_exit(run, "inference", 1, stop))  # the head of replica 0 dies
deadline = time.monotonic() + 60
while stop.signum is None and time.monotonic() < deadline:
    time.sleep(0.1)
print(f"task {task} with_replica={stop.with_replica}", flush=True)
sys.exit(record_exit(run, "inference", 128 + signal.SIGTERM, stop))
"""


def test_a_failed_task_of_a_multi_node_replica_stops_the_rest_and_the_replica_restarts_whole(tmp_path):
    """Replica 0 = tasks 0 (head) and 1 (follower) on two nodes: the head dies, the launcher stops the
    follower through the role runner's replica stop, and restarts both; replica 1 is not touched."""
    launcher, run = _launcher(tmp_path, ["inference.nodes=4", "inference.dp=2", "cluster.gpu_node.gpus=1",
                                         "trainer.gpus_per_node=1"])
    assert [(s.task, s.replica, s.head) for s in launcher.plan.role_servers("inference")] == [
        (0, 0, True), (1, 0, False), (2, 1, True), (3, 1, False)]
    script = tmp_path / "replica_task.py"
    script.write_text(REPLICA_TASK)
    run.path("scripts/inference.sh").write_text(f"cd {Path(__file__).resolve().parents[1]}\n"
                                                f"exec {sys.executable} {script} {run.root}\n")
    launcher.start(launcher.plan.launch("inference"))
    running = launcher.running["inference"]
    first = dict(running.task_proc)
    try:
        deadline = time.monotonic() + 30
        while not launcher.state.launch("inference").restarts:
            launcher.check()
            assert time.monotonic() < deadline, launcher.state
            time.sleep(0.1)
        events = launcher.state.launches["inference"].failures
        # One failure (the head's); the follower's stop is not a second one, and nothing of replica 1 moved.
        assert [(e.task, e.action) for e in events] == [(0, ServerAction.RESTARTING)], events
        # The follower wrote its exit record (so the launcher restarted the replica); its process may take a
        # moment more to end on a loaded machine.
        first[1].wait(timeout=30)
        assert "task 1 with_replica=True" in run.role_log(1, "inference", 1).read_text()
        assert first[2].poll() is None and first[3].poll() is None
        assert running.task_proc[0] is not first[0] and running.task_proc[1] is not first[1]
        assert not run.replica_stop("inference", 0).exists()
        deadline = time.monotonic() + 20
        while events[0].action != ServerAction.RESTARTED:
            launcher.check()
            assert time.monotonic() < deadline, events
            time.sleep(0.1)
        # RESTARTED follows the head's ready marker; the follower logs its own start in its own time.
        wait_for("the follower's restart line",
                 lambda: "task 1 restart 1" in run.role_log(1, "inference", 1).read_text(), 20)
    finally:
        for p in running.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_a_trainer_whose_heartbeat_stops_is_hung_after_the_bound(tmp_path):
    launcher, run = _launcher(tmp_path, ["training.hang_timeout_s=30"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        launcher.running["trainer"] = Running(launcher.plan.launch("trainer"), procs=[sleeper])
        launcher.state.launches["trainer"] = LaunchRecord(status=RoleState.RUNNING)
        now = time.time()
        # Still loading (no heartbeat after its start): never hung, however old.
        run.write_state("trainer", attempt=1, status=RoleState.RUNNING, started=now - 100, heartbeat=now - 100)
        launcher.check_hangs()
        # In its loop, last beat 25 s ago: fine; 31 s ago: hung.
        run.write_state("trainer", started=now - 100, heartbeat=now - 25, step=3, phase="trained")
        launcher.check_hangs()
        run.write_state("trainer", heartbeat=now - 31)
        with pytest.raises(RoleHung, match=r"no progress for 3\d s \(bound 30 s\); last step 3, phase trained"):
            launcher.check_hangs()
        assert launcher.state.launches["trainer"].status == RoleState.HUNG
        # Rank 0 beating while it waits, rank 1 silent for 31 s (stopped): hung, naming rank 1 and its last phase.
        run.write_state("trainer", heartbeat=now - 1, phase="waiting_for_rollouts")
        launcher.check_hangs()
        atomic_write_json(run.rank_beat("trainer", 1), RankBeat(attempt=1, heartbeat=now - 20, step=4,
                                                                 phase="waiting_for_rollouts"))
        launcher.check_hangs()
        atomic_write_json(run.rank_beat("trainer", 1), RankBeat(attempt=1, heartbeat=now - 31, step=4, phase="trained"))
        with pytest.raises(RoleHung, match=r"no progress on rank 1 for 3\d s \(bound 30 s\); last step 4, phase trained"):
            launcher.check_hangs()
        assert launcher.state.launches["trainer"].hung_rank == 1
        # A beat of an earlier attempt, or from before this start (still loading), does not count.
        atomic_write_json(run.rank_beat("trainer", 1), RankBeat(attempt=0, heartbeat=now - 31))
        launcher.check_hangs()
        atomic_write_json(run.rank_beat("trainer", 1), RankBeat(attempt=1, heartbeat=now - 101))
        launcher.check_hangs()
        # An earlier attempt's state says nothing about this one.
        run.write_state("trainer", attempt=0)
        launcher.check_hangs()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_status_shows_hung_and_restarts(tmp_path, monkeypatch):
    from tests.test_status import _run

    run = _run(tmp_path)
    now = time.time()
    atomic_write_json(run.launcher_state, LauncherRecord(
        attempt=1, mode="run", status=LauncherStatus.STOPPING, started=now - 60,
        first_failure=Failure(role="trainer", hung=True, time=now,
                              reason="hung: no progress for 31 s (bound 30 s); last step 4, phase trained"),
        launches={"inference": LaunchRecord(status=RoleState.RUNNING, restarts=1, failures=[
            ServerFailure(task=1, replica=1, node="n1", exit_code=0, time=now - 50, action=ServerAction.RESTARTED,
                          reason="server exited with code 0 while the job was running", ready_after_s=70.5)]),
               "orchestrator": LaunchRecord(status=RoleState.STOPPED), "trainer": LaunchRecord(status=RoleState.HUNG)}))
    import prl.ops.status as status_module

    monkeypatch.setattr(status_module, "_slurm_rows", lambda job, notes: ({}, 0))
    status = collect(run)
    roles = {r.role: r for r in status.roles}
    assert roles["trainer"].status == RoleState.HUNG
    assert roles["inference"].restarts == 1
    from rich.console import Console

    console = Console(record=True, width=200)
    show(status, console)
    text = console.export_text()
    assert "first failure: trainer HUNG (hung: no progress for 31 s" in text
    assert "inference replica 1 (task 1, node n1): server exited with code 0 while the job was running; restarted " \
           "(serving again 70.5 s after)" in text


# ---------------------------------------------------------------- the hand-off protocol


def _write(files: dict[str, bytes]):
    def write(tmp: Path) -> None:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
    return write


def test_stable_arrives_with_the_files_in_one_rename_and_readers_check_it(tmp_path):
    run = RunDir(tmp_path).create()
    dest = run.publish_dir(run.weights(1), _write({"a.safetensors": b"x" * 10, "config.json": b"{}"}), step=1)
    marker = json.loads((dest / MARKER).read_text())
    assert marker["files"] == {"a.safetensors": 10, "config.json": 2} and marker["step"] == 1
    assert is_stable(dest) and run.latest_stable("weights") == 1
    # A file that shrank or vanished: the step is not accepted.
    (dest / "a.safetensors").write_bytes(b"x" * 9)
    assert not is_stable(dest) and run.latest_stable("weights") is None
    (dest / "a.safetensors").unlink()
    assert not is_stable(dest)
    # A writer that dies before the rename leaves only a hidden temp dir: no step dir at all.
    tmp = run.begin_publish(run.weights(2), tag="w")
    (tmp / "a.safetensors").write_bytes(b"y")
    assert not run.weights(2).exists() and run.steps("weights") == [1]


def test_begin_publish_never_deletes_another_live_writers_temp_dir(tmp_path, monkeypatch):
    run = RunDir(tmp_path).create()
    monkeypatch.setenv("PRL_ATTEMPT", "2")
    older = run.begin_publish(run.weights(3), tag="old")  # attempt 2's
    monkeypatch.setenv("PRL_ATTEMPT", "3")
    other = run.weights(3).parent / ".step_3.tmp-a3-otherwriter"
    other.mkdir()
    mine = run.begin_publish(run.weights(3), tag="mine")
    assert not older.exists(), "an earlier attempt's leftovers go"
    assert other.exists(), "another writer of this attempt keeps its temp dir"
    assert mine.name == ".step_3.tmp-a3-mine"
    # A writer of an earlier attempt that is still around is fenced off.
    monkeypatch.setenv("PRL_ATTEMPT", "2")
    with pytest.raises(RunDirError, match="later than this writer's attempt 2"):
        run.begin_publish(run.weights(3), tag="stale")
    assert mine.exists()


def test_cleanup_keeps_every_weights_step_a_server_serves(tmp_path):
    run = RunDir(tmp_path).create()
    for s in range(1, 7):
        run.publish_dir(run.weights(s), _write({"w": b"1"}), step=s)
    run.pin_weights("orchestrator", 2)  # a server still serves step 2 (or rolls back to it)
    run.cleanup(6, max_off_policy_steps=1, checkpoint_keep=2)
    assert run.stable_steps("weights") == [2, 3, 4, 5, 6]
    run.pin_weights("orchestrator", 6)
    run.cleanup(6, max_off_policy_steps=1, checkpoint_keep=2)
    assert run.stable_steps("weights") == [5, 6]
    run.pin_weights("orchestrator", 0)  # base model: nothing under weights/ needed
    run.cleanup(6, max_off_policy_steps=0, checkpoint_keep=2)
    assert run.stable_steps("weights") == [6]


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a real ENOSPC."""
    with tmpfs(tmp_path / "small", "1m") as mount:
        yield mount


def test_a_full_disk_during_a_publish_leaves_no_step_and_the_next_publish_works(small_disk):
    run = RunDir(small_disk / "run").create()
    filler = small_disk / "filler"
    filler.write_bytes(b"0" * 700 * 1024)
    with pytest.raises(OSError) as info:
        run.publish_dir(run.weights(1), _write({"model.safetensors": b"w" * 600 * 1024}), step=1)
    assert info.value.errno == errno.ENOSPC
    assert run.steps("weights") == [] and not list((run.root / "weights").iterdir()), "no step, no temp dir left"
    filler.unlink()  # space freed: the same step publishes
    run.publish_dir(run.weights(1), _write({"model.safetensors": b"w" * 600 * 1024}), step=1)
    assert run.stable_steps("weights") == [1]
    shutil.rmtree(run.root)


def test_the_launcher_records_on_a_full_disk_by_giving_back_its_reserve(tmp_path):
    """A run directory on a 1 MiB tmpfs, filled but for the launcher's reserve: its record still gets written
    (the reserve is given back once, and noted), and a role failure names the full disk."""
    with tmpfs(tmp_path / "small", "1m") as disk:
        run = write_plan(RunDir(disk / "run"), local_plan(disk / "run", tmp_path))
        launcher = Launcher(run, launch_module.Plan.read(run), attempt=1, slurm=False, mode="run")
        assert run.make_reserve(256 * 1024)
        with open(disk / "filler", "wb") as f:
            with pytest.raises(OSError):
                f.write(bytes(1 << 20))
        launcher.state.first_failure = Failure(role="trainer", reason="exited with code 1" + launcher.disk_reason())
        launcher.save()
        saved = json.loads(run.launcher_state.read_text())
        assert saved["disk_full"]["released_bytes"] == 256 * 1024 and not run.reserve.exists()
        assert saved["first_failure"]["reason"].startswith("exited with code 1; the run directory's disk is full (")
        # Nothing left to give back: a write that still fails is logged, and the launcher goes on.
        with open(disk / "filler", "ab") as f:
            with pytest.raises(OSError):
                f.write(bytes(1 << 20))
        launcher.state.first_failure.reason += "x" * (64 * 1024)
        assert launcher.write(run.launcher_state, launcher.state) is False


# ---------------------------------------------------------------- the trainer on SIGTERM


@pytest.mark.slow  # two torchrun runs on CPU, ~60 s
def test_sigterm_checkpoints_the_last_finished_step_and_the_resume_continues_there(tmp_path):
    from tests.tiny_model import build_tiny_model
    from testkit.trainer_helpers import launch, make_samples, setup_run, wait_trainer_at
    from prl.run.batch import publish_batch

    model_dir = build_tiny_model(tmp_path / "model")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    # No checkpoint before the end (interval 10): only the SIGTERM path can write step 3's.
    run = setup_run(tmp_path / "run", model_dir, range(1, 4), vocab, max_steps=5, checkpoint_interval=10)
    proc = launch(run, 2, resume="none", wait=False)
    wait_trainer_at(proc, run, 4)
    assert run.stable_steps("checkpoints") == []
    proc.send_signal(signal.SIGTERM)  # torchrun passes it to both ranks, as the role runner does to torchrun
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 30, out
    assert run.stable_steps("checkpoints") == [3], out
    assert "stopping: checkpoint of step 3" in out
    for s in (4, 5):
        publish_batch(run, s, make_samples(s, vocab), dp_size=2, micro_batch_tokens=64)
    launch(run, 2, resume="latest")
    assert [m["step"] for m in run.read_metrics("trainer")] == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------- the orchestrator's view of the servers


async def until(watcher, what: str, probe, timeout: float = 30.0) -> None:
    """Wait for `probe()` while `watcher` runs: a bound on waiting, not a timing check (generous under load)."""
    import asyncio

    deadline = time.monotonic() + timeout
    while not probe():
        assert not watcher.error, watcher.error
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def watcher_of(run: RunDir, pool, transport: str, **kwargs):
    """The orchestrator's weight watcher over `pool`, with the run's transport named `transport`."""
    from prl.orchestrator.sync import WeightWatcher

    return WeightWatcher(run, pool, weights.get(transport), retries=5, poll=0.05, **kwargs)


def offered(watcher) -> tuple[int, dict] | None:
    """The watcher's newest offer as (step, the body it posts)."""
    offer = watcher.newest()
    return None if offer is None else (offer.step, api.encode(offer.request))


def held(run: RunDir, step: int, feeds: list[str], group_timeout: float | None = None) -> None:
    """What the trainer's rank 0 records once its feeds hold `step` (prl/weights/memory.py)."""
    run.write_weights_feed(FeedRecord(step=step, feeds=feeds, time=time.time(), group_timeout=group_timeout))


def test_the_watcher_drops_a_dead_server_and_takes_it_back_on_the_newest_weights(tmp_path):
    import asyncio

    import httpx

    from prl.orchestrator.sync import LiveServer, ServerPool, WeightWatcher
    from testkit.fake_engine import FakeEngine

    run = RunDir(tmp_path / "run").create()
    for s in (1, 2):
        run.publish_dir(run.weights(s), _write({"w": b"1"}), step=s)
    a, b = FakeEngine(run_dir=run.root).start(), FakeEngine(run_dir=run.root).start()

    def endpoint(index: int, url: str, started: float) -> None:
        publish_endpoint(run, "inference", index, url, started)

    endpoint(0, a.url, 1.0)
    endpoint(1, b.url, 1.0)
    sa, sb = LiveServer(a.url), LiveServer(b.url)
    pool = ServerPool(generate=[sa, sb], admin=[sa, sb], follow_endpoints=True)
    watcher = watcher_of(run, pool, "filesystem")

    async def scenario():
        task = asyncio.create_task(watcher.run_forever())
        try:
            await until(watcher, "both on step 2", lambda: sa.version == sb.version == 2)
            # The pin follows on the watcher's next pass (a loaded machine saw the step-0 pin still in place).
            await until(watcher, "the pin on step 2", lambda: run.weight_pins() == {"orchestrator": 2})
            # b dies: its task withdraws the endpoint. Out of rotation, no pushes, no failure of the orchestrator.
            b.stop()
            run.endpoint("inference", 1).unlink()
            await until(watcher, "b out of rotation", lambda: not sb.alive)
            assert {pool.pick(0) for _ in range(20)} == {sa}
            run.publish_dir(run.weights(3), _write({"w": b"1"}), step=3)
            await until(watcher, "a on step 3", lambda: sa.version == 3)
            assert pool.version == 3 and sb.version == 2
            assert run.weight_pins() == {"orchestrator": 2}, "b's last step stays pinned until it is back"
            # b is restarted on its port (base weights here): it rejoins only once on step 3.
            b2 = FakeEngine(run_dir=run.root, port=b.port).start()
            try:
                endpoint(1, b2.url, 2.0)
                await until(watcher, "b rejoined", lambda: sb.alive)
                assert sb.version == 3 and b2.weight_requests == [3]
                # The pin moves on the watcher's next pass, not with the rejoin itself.
                await until(watcher, "the pin on step 3", lambda: run.weight_pins() == {"orchestrator": 3})
                # A step that is not published (409) is waited for, never a failure of the server.
                async with httpx.AsyncClient() as client:
                    await watcher.push(client, sb, 9)
                assert sb.failures == 0 and sb.version == 3 and not watcher.error
            finally:
                b2.stop()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(scenario())
    finally:
        a.stop()


def test_a_server_slow_to_load_a_step_holds_no_other_server_s_next_step(tmp_path):
    """Each server's update is its own task: while b is still loading step 2, a loads steps 2 and 3 and rollouts
    run on it; the watcher's rounds go on and leave b's version to its update; b then catches up to step 3."""
    import asyncio
    import threading

    from prl.orchestrator.sync import LiveServer, ServerPool, WeightWatcher
    from testkit.fake_engine import FakeEngine

    run = RunDir(tmp_path / "run").create()
    a, b = FakeEngine(run_dir=run.root).start(), FakeEngine(run_dir=run.root).start()
    b.weights_gate = threading.Event()
    sa, sb = LiveServer(a.url), LiveServer(b.url)
    pool = ServerPool(generate=[sa, sb], admin=[sa, sb])
    watcher = watcher_of(run, pool, "filesystem", live_every=0.1)

    def running() -> list[str]:
        return [url for url, push in watcher.pushes.items() if not push.done()]

    async def scenario():
        task = asyncio.create_task(watcher.run_forever())
        try:
            run.publish_dir(run.weights(2), _write({"w": b"1"}), step=2)
            await until(watcher, "a on step 2, b loading it", lambda: sa.version == 2 and b.weight_requests == [2])
            run.publish_dir(run.weights(3), _write({"w": b"1"}), step=3)
            await until(watcher, "a on step 3 while b still loads step 2", lambda: sa.version == 3)
            assert sb.version == 0 and b.weight_requests == [2] and running() == [b.url]
            assert pool.pick(3) is sa and sb.alive
            await asyncio.sleep(0.3)  # a few rounds of `sync_live` (b answers /prl/live with step 0 meanwhile)
            assert sb.version == 0 and sb.failures == 0 and running() == [b.url]
            b.weights_gate.set()
            await until(watcher, "b on step 3", lambda: sb.version == 3)
            assert b.weight_requests == [2, 3] and a.weight_requests == [2, 3] and sb.failures == 0
            assert pool.version == 3
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert watcher.pushes == {}

    try:
        asyncio.run(scenario())
    finally:
        a.stop()
        b.stop()


def test_a_failed_rollout_takes_a_dead_server_out_of_rotation_at_once(tmp_path):
    """The weight watcher may be held by an update to a dying server: a rollout that fails on a server that no
    longer answers /health takes it out of rotation itself (the next rollouts wait for a server instead of
    failing), and a server that answers stays."""
    import asyncio

    from prl.orchestrator.sync import LiveServer, ServerPool
    from testkit.fake_engine import FakeEngine

    run = RunDir(tmp_path / "run").create()
    a, b = FakeEngine(run_dir=run.root).start(), FakeEngine(run_dir=run.root).start()
    sa, sb = LiveServer(a.url), LiveServer(b.url)
    pool = ServerPool(generate=[sa, sb], admin=[sa, sb], follow_endpoints=True)
    try:
        asyncio.run(pool.suspect(sa))
        assert sa.alive and not sa.rejoining
        b.stop()
        asyncio.run(pool.suspect(sb))
        assert not sb.alive and sb.rejoining and {pool.pick(0) for _ in range(10)} == {sa}
        a.stop()
        asyncio.run(pool.suspect(sa))
        assert pool.pick(0) is None  # nothing in rotation: rollouts wait (`Generator._slot`)
    finally:
        a.stop()


def test_the_watcher_pushes_steps_from_memory_and_follows_the_feeds_forward(tmp_path):
    """weights.transport: memory: the newer of disk and the feed record wins (disk on a tie); a feed that
    moved on to a newer step is asked for that step, not counted as a failure."""
    import asyncio

    import httpx

    from prl.orchestrator.sync import LiveServer, ServerPool
    from testkit.fake_engine import FakeEngine

    run = RunDir(tmp_path / "run").create()
    run.publish_dir(run.weights(1), _write({"w": b"1"}), step=1)
    with FakeEngine(run_dir=run.root) as engine:
        server = LiveServer(engine.url)
        watcher = watcher_of(run, ServerPool(generate=[server], admin=[server]), "memory")
        assert offered(watcher) == (1, {"step": 1})
        held(run, 2, ["h:1", "h:2"])
        assert offered(watcher) == (2, {"transport": "memory", "step": 2, "feeds": ["h:1", "h:2"]})
        assert offered(watcher_of(run, watcher.pool, "filesystem")) == (1, {"step": 1})  # memory is not its

        async def push(step: int) -> None:
            async with httpx.AsyncClient() as client:
                await watcher.push(client, server, step)

        asyncio.run(push(2))
        assert server.version == 2 and engine.feed_requests == [2] and engine.weight_requests == [2]
        assert server.disk_version == 0  # a failed update rolls it back to the base model, not to step 2
        watcher.pool.follow_endpoints = True
        watcher.pin()
        assert run.weight_pins() == {"orchestrator": 0}
        watcher.pool.follow_endpoints = False
        # The trainer published step 4 to its feeds while step 3 was being asked for.
        held(run, 3, ["h:1"])
        engine.feed_step = 4
        real_newest = watcher.newest

        def newest_then_moved():
            found = real_newest()
            held(run, 4, ["h:1"])  # from now on the record says 4
            return found

        watcher.newest = newest_then_moved
        asyncio.run(push(3))
        assert server.version == 4 and server.failures == 0 and engine.feed_requests == [2, 3, 4]
        watcher.newest = real_newest
        run.publish_dir(run.weights(4), _write({"w": b"1"}), step=4)
        assert offered(watcher) == (4, {"step": 4})  # a checkpoint step: disk on a tie
        asyncio.run(push(4))
        assert (server.version, server.disk_version) == (4, 4)
        weights.get("memory").forget(run)  # a new trainer attempt
        assert run.read_weights_feed() is None


def test_the_watcher_broadcasts_a_step_to_every_server_behind_and_a_failed_group_reads_the_feeds(tmp_path):
    """weights.transport: broadcast: the servers behind on a step from memory whose workers all take the whole step
    get one group (one token, a world of 1 + their workers, each worker at the next rank, the trainer's bound); a server whose group fails
    reads the feeds at once, not counted as a failure; one whose worker count is unknown reads the feeds."""
    import asyncio

    import httpx

    from prl.orchestrator.sync import LiveServer, ServerPool
    from testkit.fake_engine import FakeEngine

    run = RunDir(tmp_path / "run").create()
    engines = [FakeEngine(run_dir=run.root).start() for _ in range(3)]
    engines[1].workers, engines[2].workers = 2, None
    servers = [LiveServer(e.url) for e in engines]
    watcher = watcher_of(run, ServerPool(generate=servers, admin=servers), "broadcast")

    async def scenario():
        async with httpx.AsyncClient() as client:
            await watcher.sync_live(client)
        assert [s.workers for s in servers] == [1, 2, None]
        task = asyncio.create_task(watcher.run_forever())
        try:
            held(run, 2, ["h:1", "h:2"], group_timeout=7.0)
            await until(watcher, "every server on step 2", lambda: all(s.version == 2 for s in servers))
            a, b = engines[0].groups, engines[1].groups
            assert len(a) == len(b) == 1 and len(a[0]) == 1 and len(b[0]) == 2  # a group per worker
            assert len({g["token"] for g in a[0] + b[0]}) == 1 and len(a[0][0]["token"]) == 32  # one place
            assert [(g["world"], g["rank"], g["timeout"]) for g in a[0] + b[0]] == [(4, 1, 7.0), (4, 2, 7.0),
                                                                                    (4, 3, 7.0)]
            assert engines[2].groups == [] and engines[2].feed_requests == [2]

            engines[1].group_fail = True
            held(run, 3, ["h:1", "h:2"], group_timeout=7.0)
            await until(watcher, "every server on step 3", lambda: all(s.version == 3 for s in servers))
            assert len(engines[1].groups) == 2 and engines[1].feed_requests == [2, 3, 3]
            assert engines[0].feed_requests == [2, 3] and all(s.failures == 0 for s in servers)

            held(run, 4, ["h:1", "h:2"])  # feeds that send to no groups
            await until(watcher, "every server on step 4", lambda: all(s.version == 4 for s in servers))
            assert [len(e.groups) for e in engines] == [2, 2, 0]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(scenario())
    finally:
        for e in engines:
            e.stop()


def test_a_group_is_asked_for_the_step_it_was_formed_on_after_the_trainer_moved_on(tmp_path):
    """Each member of a group asks for the group's step, even where the feeds already hold a newer one when its
    push starts: a member asking for another step would leave the others waiting for it until the timeout."""
    import asyncio

    import httpx

    from prl.orchestrator.sync import LiveServer, ServerPool
    from testkit.fake_engine import FakeEngine

    run = RunDir(tmp_path / "run").create()
    with FakeEngine(run_dir=run.root) as engine:
        server = LiveServer(engine.url, workers=1)
        watcher = watcher_of(run, ServerPool(generate=[server], admin=[server]), "broadcast")
        held(run, 5, ["h:1"], group_timeout=7.0)
        grouped = watcher.requests([server], watcher.newest())[server.url]
        assert (grouped.step, grouped.feeds, grouped.transport) == (5, ["h:1"], "broadcast") and grouped.once
        held(run, 6, ["h:1"], group_timeout=7.0)

        async def push() -> None:
            async with httpx.AsyncClient() as client:
                await watcher.push(client, server, 5, grouped)

        asyncio.run(push())
        assert engine.feed_requests == [5] and engine.groups == [msgspec.to_builtins(grouped.groups)]
        assert server.version == 5 and server.failures == 0
        held(run, 7, ["h:1"])  # feeds that send to no groups
        assert not watcher.requests([server], watcher.newest())[server.url].once


def planned_server(adapters: bool = False):
    from prl.planner.model import Server

    return Server(role="inference", replica=0, group=0, node=0, task=0, gpus=(), port=18001, rpc_port=None,
                  side_channel_port=None, head=True, address_from_head=False, model="/models/base",
                  served_name="x", adapters=adapters, args=("--port", "18001"))


def test_a_restarted_server_starts_on_the_newest_published_weights(tmp_path):
    from prl.job.runtimes import restart_model

    run = RunDir(tmp_path).create()
    server = planned_server()
    assert restart_model(run, server, "inference.0") == "/models/base", "nothing published yet: the base model"
    assert run.weight_holds() == {}
    for s in (1, 2):
        run.publish_dir(run.weights(s), _write({"model.safetensors": b"w"}), step=s)
    run.publish_dir(run.weights(3), _write({"model.safetensors": b"w"}), step=3)
    (run.weights(3) / "model.safetensors").write_bytes(b"")  # damaged: not a published step any more
    model = restart_model(run, server, "inference.0")
    assert server.argv(model) == ("--model", str(run.weights(2)), "--served-model-name", "x", "--port", "18001")
    assert run.weight_holds() == {"inference.0": 2}
    # A server of adapters restarts on its base model: its steps are adapters the orchestrator loads.
    assert restart_model(run, planned_server(adapters=True), "inference.1") == "/models/base"


def test_the_step_a_restarted_server_started_from_outlives_the_staleness_window(tmp_path):
    """A server restarted with `--model RUN/weights/step_2` reads that directory as long as it runs: cleanup
    keeps step 2 itself (not every step after it) until the server releases it, however far training goes."""
    from prl.job.runtimes import restart_model

    run = RunDir(tmp_path).create()
    for s in (1, 2):
        run.publish_dir(run.weights(s), _write({"model.safetensors": b"w"}), step=s)
    restart_model(run, planned_server(), "inference.0")
    for s in range(3, 12):  # training goes on far past max_off_policy_steps + checkpoint_keep
        run.publish_dir(run.weights(s), _write({"model.safetensors": b"w"}), step=s)
        run.pin_weights("orchestrator", s - 1)  # the servers load each new step
        run.cleanup(s, max_off_policy_steps=1, checkpoint_keep=1)
    assert run.stable_steps("weights") == [2, 10, 11]
    run.release_weights("inference.0")  # the server exited (or restarted onto a newer step)
    run.cleanup(11, max_off_policy_steps=1, checkpoint_keep=1)
    assert run.stable_steps("weights") == [10, 11]


OWNER = """
import sys, time
from prl.run import retention
from prl.run.rundir import RunDir
retention.RENEW_S = 0.2
run = RunDir(sys.argv[1])
run.hold_weights("inference.0", 2)  # a restarted server's task holds its --model step
run.pin_weights("orchestrator", 3)  # the orchestrator pins the oldest step its servers serve
print("held", flush=True)
time.sleep(600)
"""


def test_the_pins_and_holds_of_a_sigkilled_owner_expire_and_a_living_owner_s_are_renewed(tmp_path, monkeypatch):
    """A child process holds step 2 and pins step 3. While it lives it renews them: past twice the lease, the
    trainer's cleanup of step 6 still keeps 2 and 3 on. SIGKILLed (no release, its files stay), its records stop
    counting one lease after their last renewal, and the next cleanup takes the steps the window does not need."""
    from prl.run import retention

    monkeypatch.setattr(retention, "LEASE_S", 3.0)
    run = RunDir(tmp_path / "run").create()
    for s in range(1, 7):
        run.publish_dir(run.weights(s), _write({"model.safetensors": b"w"}), step=s)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(run.root)], stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        assert owner.stdout.readline() == b"held\n"
        time.sleep(2 * retention.LEASE_S)  # only renewals keep them counting now
        run.cleanup(6, max_off_policy_steps=1, checkpoint_keep=1)
        assert (run.weight_holds(), run.weight_pins()) == ({"inference.0": 2}, {"orchestrator": 3})
        assert run.stable_steps("weights") == [2, 3, 4, 5, 6]
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
    assert {p.name for p in (*run.holds_dir.iterdir(), *run.pins_dir.iterdir())} == {"inference.0.json",
                                                                                     "orchestrator.json"}
    time.sleep(retention.LEASE_S + 0.5)
    assert (run.weight_holds(), run.weight_pins()) == ({}, {})
    run.cleanup(6, max_off_policy_steps=1, checkpoint_keep=1)
    assert run.stable_steps("weights") == [5, 6]


def test_a_task_of_a_multi_task_restart_step_logs_into_its_own_rank_log(tmp_path):
    """srun numbers a restart step's tasks from 0 (%t); the role runner moves each task's output to
    rank_K.log of the task it runs (PRL_TASKS[SLURM_PROCID])."""
    run = RunDir(tmp_path / "run")
    run.create()
    run.role_logs_dir(2, "inference").mkdir(parents=True)
    env = {**os.environ, "PRL_TASKS": "4,5", "SLURM_PROCID": "1", "PRL_ATTEMPT": "2"}
    code = "from prl.job.role import into_rank_log; import sys; into_rank_log('inference', sys.argv[1]); " \
           "print('to stdout'); print('to stderr', file=sys.stderr)"
    out = subprocess.run([sys.executable, "-c", code, str(run.root)], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == "" and out.stderr == "", out
    assert run.role_log(2, "inference", 5).read_text() == "to stdout\nto stderr\n"
    assert oct(run.role_log(2, "inference", 5).stat().st_mode & 0o777) == "0o600"


def test_a_server_whose_preflight_fails_for_good_is_not_restarted(tmp_path):
    """The real launch script and role runner: the model has no config.json on the node, so the preflight fails;
    starting the server again on the same node would fail the same way, so the job fails at once, saying why."""
    from prl.planner.prepare import prepare, write_run_files

    prepared = prepare(Path(__file__).resolve().parents[1] / "configs" / "local-tiny.yaml",
                       [f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'no-model'}"])
    write_run_files(prepared)
    run = RunDir(prepared.run_dir)
    run.create_api_key()
    launcher = Launcher(run, launch_module.Plan.read(run), attempt=1, slurm=False, mode="run")
    launcher.start(launcher.plan.launch("inference"))
    running = launcher.running["inference"]
    try:
        with pytest.raises(RoleFailed) as info:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                launcher.check()
                time.sleep(0.2)
        assert info.value.role == "inference" and running.restarts == 0
        assert "preflight failed: model" in info.value.reason and "has no config.json" in info.value.reason
        assert "not restarted: it would fail the same way on that node" in info.value.reason
    finally:
        for p in running.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_a_server_task_stops_a_server_whose_health_probe_goes_unanswered(monkeypatch):
    """`supervise` with a health probe (a server's task probes `/prl/engine`, which asks the engine): a ready
    child whose probe fails for `hang_s` is terminated and the stop says it hung; one that answers runs on."""
    from types import SimpleNamespace

    from prl.job import runtimes

    monkeypatch.setattr(runtimes, "HEALTH_EVERY_S", 0.1)
    answers = iter([True] * 3 + [False] * 10_000)
    stop = SimpleNamespace(signum=None, stopping=False, failure=None)
    t0 = time.monotonic()
    code = runtimes.supervise([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), stop,
                              lambda: True, lambda: None, health=lambda: next(answers), hang_s=1.0)
    assert code == 128 + signal.SIGTERM and time.monotonic() - t0 < 20
    assert stop.failure.startswith("hung: its health probe unanswered for ") and "(bound 1 s)" in stop.failure
    healthy = SimpleNamespace(signum=None, stopping=False, failure=None)
    assert runtimes.supervise([sys.executable, "-c", "import time; time.sleep(2)"], dict(os.environ), healthy,
                              lambda: True, lambda: None, health=lambda: True, hang_s=1.0) == 0
    assert healthy.failure is None


def test_the_router_waits_for_a_server_that_serves_not_for_its_head_s_address(tmp_path):
    """A multi-node server's head first publishes its address alone (for its followers), and its URL once it
    answers /health: the router takes only the URL (a head's bare address once crashed its task on a KeyError)."""
    import threading

    from prl.job.runtimes import wait_endpoint
    from prl.run.records import Endpoint

    run = RunDir(tmp_path / "run").create()
    run.write_endpoint(Endpoint(role="prefill", index=0, host="n1"))
    assert wait_endpoint(run, "prefill", 0, lambda: False).url is None  # what a follower needs: the address
    later = threading.Timer(0.5, run.write_endpoint, [Endpoint(role="prefill", index=0, host="n1", port=8000,
                                                               url="http://n1:8000")])
    later.start()
    assert wait_endpoint(run, "prefill", 0, lambda: False, url=True).url == "http://n1:8000"
    later.join()


# -- resume under a failing filesystem: nothing is removed on the word of a stat() that failed

def _fail_stat(monkeypatch, path: Path, times: int = 1_000_000) -> list[int]:
    """Make os.stat of `path` raise ESTALE (a network filesystem's stale handle) for its next `times` calls."""
    real, calls = os.stat, [0]

    def stat(p, *args, **kwargs):
        if Path(p) == path and calls[0] < times:
            calls[0] += 1
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(p))
        return real(p, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    return calls


def _trainer_output(run: RunDir, checkpoints: tuple[int, ...], weights: int) -> None:
    for s in range(1, weights + 1):
        run.publish_dir(run.weights(s), _write({"model.safetensors": b"w" * s}), step=s)
    for s in checkpoints:
        run.publish_dir(run.checkpoints(s, "trainer"), _write({"trainer_state.json": b'{"step": %d}' % s}), step=s)


def test_an_unreadable_checkpoint_stops_the_resume_and_nothing_is_removed(tmp_path, monkeypatch):
    import torch.distributed as dist
    from types import SimpleNamespace

    from prl.trainer import engine

    run = RunDir(tmp_path / "run").create()
    _trainer_output(run, checkpoints=(4,), weights=4)
    state = run.checkpoints(4, "trainer") / "trainer_state.json"
    calls = _fail_stat(monkeypatch, state)
    monkeypatch.setattr("prl.run.publish.VERIFY_RETRY_S", 0.01)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RunDirError, match=f"cannot read {state}.*Stale file handle.*read 3 time.*Nothing was removed"):
            engine.resume(run, None, SimpleNamespace(is_main=True), None, None, "latest")
    finally:
        dist.destroy_process_group()
    assert calls[0] == 3, "read again twice (VERIFY_TRIES) before giving up"
    monkeypatch.undo()
    assert run.stable_steps("weights") == [1, 2, 3, 4] and run.stable_steps("checkpoints") == [4]


def test_a_checkpoint_read_once_more_after_a_transient_fault_is_the_one_resumed(tmp_path, monkeypatch):
    from prl.trainer.checkpoint import resolve_resume

    run = RunDir(tmp_path).create()
    _trainer_output(run, checkpoints=(2, 4), weights=4)
    _fail_stat(monkeypatch, run.checkpoints(4, "trainer") / "trainer_state.json", times=1)
    assert resolve_resume(run, "latest", retry_s=0.01) == 4, "not the older step 2, whose resume removes step 4"
    _fail_stat(monkeypatch, run.checkpoints(4, "trainer") / MARKER, times=1)
    assert resolve_resume(run, "4", retry_s=0.01) == 4


def test_a_damaged_checkpoint_is_named_not_passed_over_for_an_older_one(tmp_path):
    from prl.trainer.checkpoint import resolve_resume

    run = RunDir(tmp_path).create()
    _trainer_output(run, checkpoints=(2, 4), weights=4)
    state = run.checkpoints(4, "trainer") / "trainer_state.json"
    state.write_bytes(b"{")  # short: a file lost part of itself
    with pytest.raises(RunDirError, match=f"{state} has 1 bytes; its STABLE marker lists 11"):
        resolve_resume(run, "latest", retry_s=0)
    with pytest.raises(RunDirError, match="has 1 bytes"):
        resolve_resume(run, "none", retry_s=0)  # nor taken for a run without output, which would remove it all
    state.unlink()
    with pytest.raises(RunDirError, match=f"cannot read {state}.*No such file"):
        resolve_resume(run, "latest", tries=1)
    assert resolve_resume(run, "2") == 2, "an older step named by the user is still taken"
    # A step dir with no marker was never published (a save cut short): passed over, as before.
    (run.checkpoints(4, "trainer") / MARKER).unlink()
    assert resolve_resume(run, "latest") == 2


def test_a_published_step_that_cannot_be_verified_is_never_removed_by_a_new_publish(tmp_path, monkeypatch):
    run = RunDir(tmp_path).create()
    _trainer_output(run, checkpoints=(), weights=3)
    _fail_stat(monkeypatch, run.weights(3) / "model.safetensors")
    with pytest.raises(RunDirError, match="Stale file handle"):
        run.latest_published("weights", retry_s=0)
    with pytest.raises(RunDirError, match="Stale file handle"):
        run.begin_publish(run.weights(3))
    monkeypatch.undo()
    assert run.stable_steps("weights") == [1, 2, 3]


# -- a child that ignores SIGTERM is killed after KILL_AFTER_S, wherever prl stops one

_IGNORES_SIGTERM = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                    "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)")


def _bounded(call, pidfile: Path, within: float) -> list:
    """Run `call` in a thread; fail if it has not returned within `within` s (then SIGKILL the child it left)."""
    import threading

    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(within)
    if thread.is_alive():
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
        thread.join(10)
        pytest.fail(f"still waiting after {within:g} s for a child that ignores SIGTERM")
    return out


def test_a_child_never_ready_that_ignores_sigterm_is_killed(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from prl.job import runtimes

    monkeypatch.setattr(runtimes, "START_TIMEOUT_S", 0.5)
    monkeypatch.setattr(runtimes, "KILL_AFTER_S", 1.0)
    pidfile = tmp_path / "pid"
    stop = SimpleNamespace(signum=None, stopping=False, failure=None)
    [code] = _bounded(lambda: runtimes.supervise([sys.executable, "-c", _IGNORES_SIGTERM, str(pidfile)],
                                                 dict(os.environ), stop, lambda: False, lambda: None), pidfile, 20)
    assert code == 128 + signal.SIGKILL


def test_the_wandb_follower_is_killed_when_it_ignores_sigterm(tmp_path, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(launch_module, "WANDB_FINAL_S", 0.3)
    monkeypatch.setattr(launch_module, "KILL_AFTER_S", 0.5)
    pidfile = tmp_path / "pid"
    follower = subprocess.Popen([sys.executable, "-c", _IGNORES_SIGTERM, str(pidfile)])
    while not pidfile.exists() or not pidfile.read_text():
        time.sleep(0.05)
    launcher = SimpleNamespace(wandb=follower)
    _bounded(lambda: Launcher.stop_wandb(launcher), pidfile, 15)
    assert follower.returncode == -signal.SIGKILL and launcher.wandb is None
