"""Two LoRA RL runs on one inference pool, locally (configs/local-pool.yaml, configs/local-pool-run.yaml): the
pool runs one vLLM server and nothing else; each run attaches with its own key and name, trains its own adapter,
generates with it on the pool's server, and detaches when it ends. The pool's engine is killed mid-run: restarted
by the pool's launcher (its status names the engine's death), the server gets each run's newest adapter back from
that run's weight watcher. A run whose launcher died without detaching is detached by the pool's launcher.
Isolation shows in the numbers: each run's served logprobs are its trainer's at every step (an adapter of the other
run, or the base model after the restart, would not match them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prl.job.launch import TENANTS_CHECK_S
from prl.run import tenants
from prl.run.records import JobRecord, LauncherRecord
from prl.run.rundir import RunDir, atomic_write_json
from prl.states import Backend, LauncherStatus
from tests.helpers import REPO, engine_of, wait_for
from tests.test_e2e_local import assert_reward_rises
from tests.tiny_model import build_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 12


def prl(env: dict, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prl.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)


def test_two_lora_runs_share_one_pool_each_serving_its_own_adapter(tmp_path, env):
    from prl.trainer.tiny_model import LORA_EMBED_SCALE

    model = build_tiny_model(tmp_path / "model", embed_scale=LORA_EMBED_SCALE)
    pool = tmp_path / "pool"
    done = prl(env, "submit", "configs/local-pool.yaml", f"model.path={model}", f"run_dir={pool}",
               "cluster.port_base=19700", "--local", "--detach")
    assert done.returncode == 0, done.stderr
    runs = {name: tmp_path / name for name in ("run-a", "run-b")}
    try:
        wait_for("the pool's server", lambda: (pool / "state" / "endpoints" / "inference.0.json").exists(),
                 timeout=600, interval=1)
        procs = {name: subprocess.Popen(
            [sys.executable, "-m", "prl.cli", "submit", "configs/local-pool-run.yaml", f"name={name}",
             f"model.path={model}", f"run_dir={run}", f"inference.attach={pool}",
             f"cluster.port_base={19800 + 100 * i}", "--local"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
            for i, (name, run) in enumerate(runs.items())}
        attached = wait_for("both runs attached", lambda: len((s := status(env, pool))["attached"]) == 2 and s,
                            timeout=120, interval=1)
        assert sorted(a["name"] for a in attached["attached"]) == ["run-a", "run-b"]
        # The pool's server dies mid-run: its launcher restarts it (on the base model), each run's weight watcher
        # sees the new server, loads the run's newest adapter there and rejoins; rollouts wait meanwhile.
        wait_for("run-a's step 4", lambda: trained(runs["run-a"]) >= 4, timeout=600, interval=1)
        os.kill(engine_of(pool, 19700), signal.SIGKILL)
        outputs = {name: p.communicate(timeout=1200)[0] for name, p in procs.items()}
        for name, p in procs.items():
            assert p.returncode == 0, outputs[name] + (runs[name] / "logs" / "launcher.log").read_text()
        shown = status(env, pool)
        assert shown["state"] == "RUNNING" and shown["attached"] == [], shown  # both detached at their end
        server = next(r for r in shown["roles"] if r["role"] == "inference")
        assert server["restarts"] == 1 and "its vLLM engine died" in server["failures"][0]["reason"], server
        # A run whose launcher was killed -9 cannot detach: the pool's launcher does it once it sees the job ended.
        gone = RunDir(tmp_path / "run-c").create()
        gone.create_api_key()
        tenants.attach(RunDir(pool), "run-c", gone.root, gone.read_api_key())
        dead = subprocess.Popen(["true"])
        dead.wait()
        gone.write_job(JobRecord(job_id="local-c", name="run-c", backend=Backend.LOCAL, cluster="local",
                                 submitted=time.time() + 1, run_dir=str(gone.root), pid=dead.pid))
        atomic_write_json(gone.launcher_state, LauncherRecord(attempt=1, status=LauncherStatus.RUNNING))
        assert [a["name"] for a in status(env, pool)["attached"]] == ["run-c"]
        wait_for("the pool to detach the dead run", lambda: status(env, pool)["attached"] == [],
                 timeout=TENANTS_CHECK_S + 30, interval=1)
    finally:
        prl(env, "cancel", pool)
    log = (pool / "logs" / "attempt_1" / "inference" / "rank_0.log").read_text()
    for name, run in runs.items():
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert_reward_rises(records, STEPS, 0.02)  # learning itself: test_e2e_local.py (here: 2 runs, a restart)
        trainer = [r for r in records if r["role"] == "trainer"]
        # Served by the pool with this run's adapter N-1, scored by this run's trainer holding adapter N-1.
        for r in trainer:
            assert r["mismatch_kl"] < 1e-4 and 0.99 < r["mismatch_ratio_mean"] < 1.01, (name, r)
        assert sorted(p.name for p in (run / "weights" / f"step_{STEPS}").iterdir()) == [
            "STABLE", "adapter_config.json", "adapter_model.safetensors"]
        assert log.count(f"adapter update begins: run {name},") >= STEPS - 1, name
        assert f"run {name} detached (its adapter unloaded)" in log
        own = json.loads((run / "plan.json").read_text())
        assert own["servers"] == [] and own["attach"] == str(pool)


def trained(run: Path) -> int:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(x)["step"] for x in lines if '"role": "trainer"' in x), default=0)


def status(env: dict, run: Path) -> dict:
    done = prl(env, "status", run, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)

