"""The orchestrator loop end to end against a stand-in engine (no vLLM): batches, staleness,
weight watcher, resume, retries, eval. The real-server test is tests/test_orchestrator_vllm.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from prl.errors import PrlError
from prl.orchestrator import main
from prl.planner.model import Plan
from prl.run.batch import read_batch
from prl.run.rundir import RunDir, atomic_write_json
from testkit.fake_engine import FakeEngine
from tests.helpers import REPO, publish_endpoint
from testkit.plans import local_plan, write_plan


def make_plan(run: RunDir, tokenizer_dir, *overrides: str, **training) -> Plan:
    """local-tiny, smaller: 2 prompts x 4 rollouts a step, 12 tokens each; `training` overrides by name."""
    training = {"batch_size": 8, "rollouts_per_example": 4, "max_steps": 3, "max_off_policy_steps": 1, "max_tokens": 12,
                **training}
    return local_plan(run.root, tokenizer_dir, [*(f"training.{k}={v}" for k, v in training.items()), *overrides])


def make_run(tmp_path, tokenizer_dir, *overrides: str, **training) -> RunDir:
    run = RunDir(tmp_path / "run")
    return write_plan(run, make_plan(run, tokenizer_dir, *overrides, **training))


def engine(run: RunDir, **kw) -> FakeEngine:
    eng = FakeEngine(model="local-tiny", token_ids=range(3, 400), stop_id=2, run_dir=run.root, **kw).start()
    publish_endpoint(run, "inference", 0, eng.url)
    return eng


class FakeTrainer:
    """Publishes weights/step_N once rollouts/step_N is published, like the trainer does."""

    def __init__(self, run: RunDir, delay: float = 0.2):
        self.run, self.delay, self.stopped = run, delay, False
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def loop(self):
        n = (self.run.latest_stable("weights") or 0) + 1
        while not self.stopped:
            if (self.run.rollouts(n) / "STABLE").exists():
                time.sleep(self.delay)
                self.run.publish_dir(self.run.weights(n), lambda d: (d / "config.json").write_text("{}"), step=n)
                n += 1
            time.sleep(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopped = True
        self.thread.join(5)


MODES = pytest.mark.parametrize("mode", ["continuous", "step"])


@pytest.mark.parametrize(("mode", "env_workers"), [
    ("continuous", 0), ("step", 0), pytest.param("continuous", 2, marks=pytest.mark.slow)])  # 3 spawned processes
def test_steps_respect_the_staleness_bound_and_weights_reach_the_server(tmp_path, tokenizer_dir, mode, env_workers,
                                                                        monkeypatch):
    """Both rollout modes in-process, and continuous through 2 env worker processes (verifiers' env server pool)."""
    import psutil
    from verifiers.v1.env import Env

    run = make_run(tmp_path, tokenizer_dir, "environment.eval.every=2", "environment.eval.examples=4",
                   f"orchestrator.env_workers={env_workers}", max_steps=4, max_off_policy_steps=1, rollout_mode=mode)
    here = []  # episodes run in this process (evaluation always is)
    run_slot = Env.run_slot
    monkeypatch.setattr(Env, "run_slot", lambda self, *a, **kw: here.append(1) or run_slot(self, *a, **kw))
    children: set[int] = set()
    watching = threading.Event()

    def spawned(p: psutil.Process) -> bool:
        try:
            return "spawn" in " ".join(p.cmdline())
        except psutil.Error:  # gone (or a zombie) between the listing and the look
            return False

    def watch():  # the env worker pool: a broker and its workers, children of this process
        while not watching.wait(0.2):
            children.update(p.pid for p in psutil.Process().children(recursive=True) if spawned(p))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    eng = engine(run)
    try:
        with FakeTrainer(run):
            assert main(str(run.root)) == 0
    finally:
        watching.set()
        eng.stop()
    # 2 evaluations of 4 run here; the 4 steps' 32 rollouts (and any replacing stale groups) here or in workers.
    assert len(here) == 8 if env_workers else len(here) >= 8 + 32, len(here)
    assert len(children) >= (env_workers + 1 if env_workers else 0), children
    # The engine heard only prl's fast path (fastpath.py), in the workers too: aiohttp, never the OpenAI SDK.
    assert eng.generate_clients == {"Python"}, eng.generate_clients
    assert run.stable_steps("rollouts") == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        b = read_batch(run.rollouts(step))
        versions = b.arrays["policy_version"].tolist()
        assert b.num_samples == 8 and min(versions) >= max(0, step - 2)  # k=1: version >= N-1-k
        mask, lp = b.arrays["loss_mask"], b.arrays["inference_logprobs"]
        assert mask.sum() > 0 and (lp[mask == 1] < 0).all() and (lp[mask == 0] == 0).all()
        adv, off = b.arrays["advantages"], b.offsets
        for g in range(2):
            assert abs(sum(float(adv[off[i]]) for i in range(4 * g, 4 * g + 4))) < 1e-5
        assert b.packing["dp_size"] == 2  # packed for the plan's trainer mesh
    # the watcher loads the newest published step (skipping any it was too late for), in order
    assert eng.weight_requests and eng.weight_requests == sorted(set(eng.weight_requests))
    assert eng.weights_step >= 2
    metrics = run.read_metrics("orchestrator")
    train = [m for m in metrics if not m.get("eval")]
    evals = [m for m in metrics if m.get("eval")]
    assert [m["step"] for m in train] == [1, 2, 3, 4] and [m["step"] for m in evals] == [2, 4]
    for key in ("reward_mean", "reward_std", "completion_len_mean", "policy_lag_max", "policy_lag_mean",
                "rollouts_per_s", "wait_weights_s", "metric/reply_chars"):
        assert key in train[0], key
    assert all(m["policy_lag_max"] <= 2 for m in train)
    assert all(m["turns_mean"] == 1.0 for m in train)  # a single-turn env: one model turn a rollout
    assert evals[0]["rollouts"] == 4 and 0.0 <= evals[0]["reward_mean"] <= 1.0
    state = run.read_state("orchestrator")
    assert state.status == "exited" and state.exit_code == 0 and state.published == 4


def test_env_workers_and_what_they_start_hold_the_generation_key_and_never_the_run_s(tmp_path, tokenizer_dir,
                                                                                     monkeypatch):
    """The orchestrator takes the run's key out of its environment before an environment loads (`hold_keys`):
    the real env worker process (verifiers' pool, spawned) was started with the generation-only key in its
    environment, and the run's key nowhere in it, so neither it nor a tool it starts can read it there."""
    import asyncio

    import psutil

    from prl.orchestrator import sync
    from prl.orchestrator.config import OrchestratorConfig
    from prl.orchestrator.loop import load_environments
    from prl.run.api import generation_key
    from prl.run.rundir import API_KEY_VAR, GENERATION_KEY_VAR

    run = make_run(tmp_path, tokenizer_dir, "orchestrator.env_workers=1")
    run.create_api_key()
    key = run.read_api_key()
    monkeypatch.setenv(API_KEY_VAR, key)  # as a standalone orchestrator is handed it
    monkeypatch.setenv(GENERATION_KEY_VAR, "stale")  # restored (removed) after the test
    monkeypatch.setattr(sync, "_HELD", {})
    sync.hold_keys(run)
    env, _ = load_environments(OrchestratorConfig.from_plan(Plan.read(run)))

    async def environs() -> list[dict]:
        async with env.serving():
            # What each process was started with (/proc/PID/environ): what its tools inherit, and can read.
            return [p.environ() for p in psutil.Process().children(recursive=True) if "spawn" in " ".join(p.cmdline())]

    seen = asyncio.run(environs())
    assert seen, "no env worker process ran"
    for environ in seen:
        assert API_KEY_VAR not in environ and not [k for k, v in environ.items() if key in v], sorted(environ)
        assert environ[GENERATION_KEY_VAR] == generation_key(key)
    assert sync.auth_headers() == {"Authorization": f"Bearer {key}"}  # the weight watcher's, in this process


def test_env_workers_need_an_installed_environment_and_warn_without_the_cores(tmp_path, tokenizer_dir):
    from prl.errors import ConfigError
    from prl.orchestrator.workers import check_env_id

    check_env_id("prl_letters")
    with pytest.raises(ConfigError, match=r"environment.id 'prl_letters.tasks': orchestrator.env_workers needs an "
                                          r"installed environment package .* \(e.g. 'tasks'\)"):
        check_env_id("prl_letters.tasks")
    plan = make_plan(RunDir(tmp_path / "run"), tokenizer_dir, "orchestrator.env_workers=4", "orchestrator.cpus=2")
    assert plan.orchestrator.env_workers == 4
    assert any("orchestrator.env_workers (4) and the orchestrator itself want 5 cores but orchestrator.cpus is 2" in w
               for w in plan.warnings), plan.warnings
    # The local cluster's node has this machine's cores (2 in CI); asking for more is refused by the planner.
    enough = make_plan(RunDir(tmp_path / "run"), tokenizer_dir, "orchestrator.env_workers=1", "orchestrator.cpus=2")
    assert not [w for w in enough.warnings if "orchestrator.env_workers" in w], enough.warnings


@MODES
def test_synchronous_mode_generates_step_n_with_weights_n_minus_1(tmp_path, tokenizer_dir, mode):
    run = make_run(tmp_path, tokenizer_dir, max_steps=3, max_off_policy_steps=0, rollout_mode=mode)
    eng = engine(run)
    try:
        with FakeTrainer(run):
            assert main(str(run.root)) == 0
    finally:
        eng.stop()
    for step in (1, 2, 3):
        assert set(read_batch(run.rollouts(step)).arrays["policy_version"].tolist()) == {step - 1}
    assert [m["policy_lag_max"] for m in run.read_metrics("orchestrator")] == [1, 1, 1]


@MODES
def test_resume_continues_after_the_newest_published_step(tmp_path, tokenizer_dir, mode):
    run = make_run(tmp_path, tokenizer_dir, max_steps=2, max_off_policy_steps=5, rollout_mode=mode)
    eng = engine(run)
    try:
        assert main(str(run.root)) == 0
        first = read_batch(run.rollouts(2)).arrays["input_ids"].tolist()
        write_plan(run, make_plan(run, tokenizer_dir, max_steps=4, max_off_policy_steps=5, rollout_mode=mode))
        run.append_metrics({"role": "orchestrator", "step": 3, "stale": True})  # from a killed attempt
        assert main(str(run.root)) == 0
    finally:
        eng.stop()
    assert run.stable_steps("rollouts") == [1, 2, 3, 4]
    assert read_batch(run.rollouts(2)).arrays["input_ids"].tolist() == first  # untouched
    assert [m["step"] for m in run.read_metrics("orchestrator")] == [1, 2, 3, 4]  # none repeated or stale


def test_transient_http_errors_are_retried(tmp_path, tokenizer_dir):
    run = make_run(tmp_path, tokenizer_dir, max_steps=1)
    eng = engine(run)
    eng.fail_every = 3  # every third generate request answers 503
    try:
        assert main(str(run.root)) == 0
    finally:
        eng.stop()
    assert read_batch(run.rollouts(1)).num_samples == 8
    assert eng.requests >= 11  # 8 rollouts + the failed attempts


@MODES
def test_a_server_that_cannot_load_weights_fails_the_orchestrator(tmp_path, tokenizer_dir, mode):
    run = make_run(tmp_path, tokenizer_dir, max_steps=3, max_off_policy_steps=0, weight_update_retries=2,
                   rollout_mode=mode)
    eng = engine(run)
    eng.weights_fail = True
    try:
        with FakeTrainer(run), pytest.raises(PrlError, match=r"could not load weights step 1 after 2 attempts.*HTTP 500"):
            main(str(run.root))
    finally:
        eng.stop()
    state = run.read_state("orchestrator")
    assert state.status == "failed" and "WeightUpdateError" in state.error
    assert eng.url in state.server_errors
    assert run.stable_steps("rollouts") == [1]  # step 2 needed weights 1: never generated


def test_module_entry_point_with_explicit_servers(tmp_path, tokenizer_dir):
    run = make_run(tmp_path, tokenizer_dir, max_steps=1)
    with FakeEngine(model="local-tiny", token_ids=range(3, 400), stop_id=2) as eng:
        proc = subprocess.run(
            [sys.executable, "-m", "prl.orchestrator", "--run-dir", str(run.root), "--server", eng.url],
            capture_output=True, text=True, timeout=400, cwd=REPO,  # a hang guard: 27 s alone, over 120 on CI
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 1/1" in proc.stdout and run.stable_steps("rollouts") == [1]
    bad = subprocess.run([sys.executable, "-m", "prl.orchestrator", "--run-dir", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 1 and "no plan in" in bad.stderr and "Traceback" not in bad.stderr


def test_prl_eval_against_an_openai_endpoint(capsys):
    from prl.cli import show_eval
    from prl.orchestrator.eval import evaluate_endpoint

    with FakeEngine(model="m") as eng:  # its chat replies are random strings of 'a', 'b' and ' '
        stats = evaluate_endpoint("prl_letters", eng.url, "m", examples=6, rollouts=2)
    assert stats["rollouts"] == 12 and stats["failed_rollouts"] == 0
    assert 0.2 < stats["reward_mean"] < 0.8
    assert "metric/reply_chars" in stats
    assert stats["completion_len_mean"] == 512  # the usage the endpoint reports: replies of max_tokens (512 by default)
    show_eval(stats)  # the `prl eval` command's report
    assert "prl_letters (eval split) on m: reward" in capsys.readouterr().out
