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
from tests.plans import local_plan, write_plan

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
):
    """Start the trainer on `nproc` CPU ranks with torchrun; return the CompletedProcess (or Popen)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port or _free_port()),
        "-m",
        "prl.trainer",
        "--run-dir",
        str(run.root),
        "--resume",
        resume,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if not wait:
        return subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"trainer failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
