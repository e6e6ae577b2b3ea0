"""The training engine's seam: a third kind of training, defined in this file, runs through the engine's loop.

The spec below is neither RL nor SFT: it makes its own batches, adds a per-token weight to each
prepared micro-batch, owns its loss, trains the final norm alone, publishes only its last step and
writes its own record fields. Nothing in prl/trainer changes for it (prl/trainer/engine.py's doc), and
the engine's own duties hold for it: the checkpoint and weights of the last finished step on SIGTERM, resume.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from prl.run.rundir import RunDir
from tests.helpers import free_port
from testkit.plans import write_plan
from tests.tiny_model import build_tiny_model
from testkit.trainer_helpers import REPO, make_plan, make_samples

WEIGHT = 0.5

THIRD_SPEC = textwrap.dedent("""
    import os, signal, sys
    from prl.log import init_logging
    from prl.planner.model import Plan
    from prl.run.batch import RolloutBatch, to_arrays
    from prl.run.rundir import RunDir
    from prl.trainer.config import TrainerConfig
    from prl.trainer.engine import Spec, StepData, forward, micro_batch_inputs, train
    from prl.trainer.loss import token_logprobs_and_entropy
    from testkit.trainer_helpers import make_samples

    run_dir, vocab, weight, stop_at, resume = sys.argv[1:]
    vocab, weight, stop_at = int(vocab), float(weight), int(stop_at)


    class WeightedNLL(Spec):
        def parameters(self, model):
            return [p for name, p in model.named_parameters() if name == "model.norm.weight"]

        def last_step(self):
            return 2

        def wait(self, eng, step):
            if step == stop_at:  # the job's stop, as torchrun passes it on
                os.kill(os.getpid(), signal.SIGTERM)
            return step

        def load(self, eng, step, ready):
            batch = RolloutBatch(step, to_arrays(make_samples(step, vocab)), {})
            return StepData(batch.micro_batches(eng.d.dp_rank, eng.d.dp_size, 64), batch)

        def inputs(self, mb, d):
            x = micro_batch_inputs(mb, d)
            x["token_weight"] = x["loss_mask"] * weight
            return x

        def micro_loss(self, model, x, n_loss_tokens, aux_weight):
            logp, _ = token_logprobs_and_entropy(forward(model, x, 0.0).logits[0], x["targets"])
            loss = -(logp * x["token_weight"]).sum() / n_loss_tokens
            return loss, {"loss_sum": float(loss.detach()) * n_loss_tokens, "loss_tokens": float(x["loss_mask"].sum())}

        def summarize(self, s, grad_norm):
            return {"loss": s["loss_sum"] / s["loss_tokens"], "grad_norm": grad_norm, "tokens": int(s["tokens"])}

        def publishes(self, step, last):
            return step == last

        def checkpoints(self, step, last):
            return False

        def cleanup(self, eng, step):
            pass

        def record(self, step, data, data_s):
            return {"spec": "weighted_nll", "samples": data.source.num_samples}


    init_logging("trainer", 0)
    run = RunDir(run_dir)
    cfg = TrainerConfig.from_plan(Plan.read(run))
    sys.exit(train(run, cfg, WeightedNLL(cfg), resume))
""")


def _setup(tmp_path) -> tuple[RunDir, int]:
    model_dir = build_tiny_model(tmp_path / "tiny")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    run = write_plan(RunDir(tmp_path / "run"), make_plan(model_dir, tmp_path / "run", world_size=1, max_steps=5))
    (tmp_path / "third_spec.py").write_text(THIRD_SPEC)
    return run, vocab


def _train(run: RunDir, vocab: int, stop_at: int = 0, resume: str = "none") -> subprocess.CompletedProcess:
    """The third spec on one CPU rank (no torchrun), SIGTERM to itself when step `stop_at` begins."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, str(run.root.parent / "third_spec.py"), str(run.root), str(vocab), str(WEIGHT),
           str(stop_at), resume]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow  # one CPU rank: the tiny model, two steps (~15 s)
def test_a_spec_defined_outside_prl_runs_through_the_engine_loop(tmp_path):
    from transformers import AutoModelForCausalLM

    run, vocab = _setup(tmp_path)
    model_dir = tmp_path / "tiny"
    proc = _train(run, vocab)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "step 2 loss" in proc.stdout

    records = run.read_metrics("trainer")
    assert [(r["step"], r["spec"], r["samples"]) for r in records] == [(1, "weighted_nll", 8), (2, "weighted_nll", 8)]
    assert "data_s" not in records[0] and {"train_s", "publish_s", "step_s", "lr", "tokens_per_s"} <= set(records[0])
    assert run.stable_steps("weights") == [2] and run.stable_steps("checkpoints") == []

    # Step 1's loss is the spec's weighted NLL of the initial model; only the optimizer's parameter moved.
    before = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    samples = make_samples(1, vocab)
    total = 0.0
    for s in samples:  # one sample at a time, unpacked
        ids = torch.tensor(s.token_ids)[None]
        with torch.no_grad():
            logp = torch.log_softmax(before(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        total += float((logp * torch.tensor(s.loss_mask[1:], dtype=torch.float32)).sum())
    n = sum(sum(s.loss_mask[1:]) for s in samples)
    assert records[0]["loss"] == pytest.approx(-WEIGHT * total / n, rel=1e-5)
    after = AutoModelForCausalLM.from_pretrained(run.weights(2), dtype=torch.float32).state_dict()
    moved = {k for k, v in before.state_dict().items() if not torch.equal(v, after[k])}
    assert moved == {"model.norm.weight"}


@pytest.mark.slow  # two one-rank runs (~30 s)
def test_on_sigterm_the_engine_keeps_the_last_step_of_any_spec_and_resumes_there(tmp_path):
    """The spec publishes only at its end and never checkpoints; stopped at step 2, the engine still gives
    step 1 its weights and a checkpoint, exits 128 + SIGTERM, and the next attempt resumes after step 1."""
    run, vocab = _setup(tmp_path)
    stopped = _train(run, vocab, stop_at=2)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stdout[-4000:] + stopped.stderr[-4000:]
    assert "stopping: checkpoint of step 1" in stopped.stdout
    assert run.stable_steps("weights") == [1] and run.stable_steps("checkpoints") == [1]
    assert [r["step"] for r in run.read_metrics("trainer")] == [1]

    resumed = _train(run, vocab, resume="latest")
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert [r["step"] for r in run.read_metrics("trainer")] == [1, 2]
    assert run.stable_steps("weights") == [1, 2] and run.stable_steps("checkpoints") == [1]
