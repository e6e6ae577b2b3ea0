"""Shared helpers of the trainer tests: a run dir with a plan and synthetic rollouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from prl.planner.model import Plan
from prl.run.batch import Sample, publish_batch
from prl.run.rundir import RunDir, is_stable
from testkit.ports import free_port
from testkit.plans import local_plan, write_plan

REPO = Path(__file__).resolve().parents[1]


def make_plan(
    model_dir: Path,
    run_dir: Path | None = None,
    *,
    world_size: int = 2,
    max_steps: int = 3,
    checkpoint_interval: int = 2,
    overrides: Sequence[str] = (),
    **training,
) -> Plan:
    """local-tiny on `world_size` CPU ranks with small, fast training settings; `training` overrides them by name,
    `overrides` are any others ("trainer.dp_replicate=2"). `run_dir` defaults to MODEL_DIR/../run."""
    training = {
        "batch_size": 4,
        "rollouts_per_example": 2,
        "micro_batch_tokens": 64,
        "max_off_policy_steps": 1,
        "lr": 1e-2,
        "max_steps": max_steps,
        "seed": 0,
        "checkpoint_interval": checkpoint_interval,
        "checkpoint_keep": 2,
        "loss.mode": "mask",
        "loss.ratio_low": 0.0,
        "loss.ratio_high": 5.0,
        "loss.kl_coef": 0.0,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "rollout_timeout_s": 120,
        **training,
    }
    return local_plan(
        run_dir or Path(model_dir).parent / "run",
        model_dir,
        [
            "model.max_model_len=256",
            f"trainer.gpus_per_node={world_size}",
            *(f"training.{k}={v}" for k, v in training.items()),
            *overrides,
        ],
    )


def make_samples(step: int, vocab: int, n: int = 8, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed * 1000 + step)
    out = []
    for _ in range(n):
        prompt, completion = int(rng.integers(3, 8)), int(rng.integers(5, 30))
        total = prompt + completion
        out.append(
            Sample(
                token_ids=rng.integers(0, vocab, total).tolist(),
                loss_mask=[0] * prompt + [1] * completion,
                inference_logprobs=(np.log(1.0 / vocab) + rng.normal(0, 0.3, total)).tolist(),
                advantage=float(rng.normal()),
                policy_version=max(step - 1, 0),
            )
        )
    return out


def setup_run(root: Path, model_dir: Path, steps: range, vocab: int, **plan_kw) -> RunDir:
    run = write_plan(RunDir(root), make_plan(model_dir, root, **plan_kw))
    for s in steps:
        publish_batch(run, s, make_samples(s, vocab), dp_size=2, micro_batch_tokens=64)
    return run


def launch(
    run: RunDir,
    nproc: int,
    resume: str = "latest",
    timeout: float = 240,
    wait: bool = True,
    port: int = 0,
    threads: int = 1,
    torchrun: bool | None = None,
):
    """Start the trainer on `nproc` CPU ranks; return the CompletedProcess (or, `wait=False`, torchrun's Popen).

    Waited for, the ranks are forked from this worker's rank zygote (testkit/rank_zygote.py: the trainer's entry
    in torchrun's rank environment, without paying torchrun's and each rank's imports again); not waited for,
    with `torchrun=True`, or with PRL_TEST_TORCHRUN=1 in the environment, torchrun starts them, as the job does."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    argv = ["--run-dir", str(run.root), "--resume", resume]
    port = port or free_port()
    if torchrun is None:
        torchrun = os.environ.get("PRL_TEST_TORCHRUN") == "1"
    if wait and not torchrun:
        return _forked(argv, {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, nproc, timeout)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(port), "-m", "prl.trainer", *argv]
    if not wait:
        return subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"trainer failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def _forked(argv: list[str], env: dict[str, str], nproc: int, timeout: float) -> subprocess.CompletedProcess:
    """`launch` through the rank zygote: every rank's stdout (and stderr) in rank order, as one CompletedProcess."""
    import shutil
    import tempfile

    from testkit.rank_zygote import zygote

    out = Path(tempfile.mkdtemp(prefix="prl-ranks-"))
    try:
        codes = zygote({**env, "OMP_NUM_THREADS": "1"}).run(argv, env, nproc, out / "rank", timeout)
        stdout, stderr = ("".join((out / f"rank.{r}{suffix}").read_text(errors="replace") for r in range(nproc))
                          for suffix in (".out", ".err"))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    code = next((c for c in codes if c != 0), 0)
    assert code == 0, f"trainer failed (rank exit codes {codes}):\n{stdout[-4000:]}\n{stderr[-8000:]}"
    return subprocess.CompletedProcess(["prl.trainer", *argv], code, stdout, stderr)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def wait_trainer_at(proc: subprocess.Popen, run: RunDir, step: int, timeout: float = 180) -> None:
    """Until weights step-1 are published and the trainer's state says it works on `step`; fails with the
    trainer's output if it exits first."""
    deadline = time.monotonic() + timeout
    while not (is_stable(run.weights(step - 1)) and getattr(run.read_state("trainer"), "step", None) == step):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"trainer did not reach step {step}"
        time.sleep(0.2)
