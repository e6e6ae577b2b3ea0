"""One torchrun job for tests/test_moe_families.py: the trainer's own pieces on each tiny MoE family in turn.

    python -m torch.distributed.run --nproc-per-node N tests/moe_family_worker.py OUT.json STEPS RUN_DIR...

Each RUN_DIR holds a plan (RUN/plan.json) of one family's tiny model. Per run, every rank: the plan's
TrainerConfig, the meta-device model with EP installed, FSDP2, this rank's shards loaded (engine.load_model);
the sharded publish of the untouched model as weights/step_0 (the load/publish round trip); STEPS RL steps
(RLSpec, engine.train_step) on testkit.trainer_helpers.make_samples, packed several to a micro-batch
(MICRO_BATCH_TOKENS); the sharded publish of the trained model as weights/step_STEPS. Rank 0 writes {run_dir: {"losses", "grad_norms"}} to OUT.
One process group serves every family: spawning torchrun per family would cost more than the steps.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

from prl.planner.model import Mesh, Plan
from prl.run.batch import RolloutBatch, to_arrays
from prl.run.rundir import RunDir
from prl.trainer.attention import has_sliding_window
from prl.trainer.config import TrainerConfig
from prl.trainer.engine import load_model, train_step
from prl.trainer.parallel import init_distributed
from prl.trainer.rl import RLSpec
from prl.trainer.weights import publish_weights
from testkit.trainer_helpers import make_samples

MICRO_BATCH_TOKENS = 64
"""make_samples' 8 to 37 tokens a sample: two or three samples a packed row (packed attention; Qwen3.5's
linear-attention layers run per sample). GPT-OSS trains one sample per micro-batch: install_packed leaves its
sliding-window layers on transformers' attention, and a packed row of its tiny model was measured 0.42 off in the
logits of its second sample (the samples are not kept apart there)."""


def trainer_config(run: RunDir) -> TrainerConfig:
    """The plan's trainer settings; on more ranks than the plan's (the local cluster profile refuses more ranks
    than the machine's CPUs), the plan's ep with dp_shard over all of them, as the planner derives it."""
    cfg = TrainerConfig.from_plan(Plan.read(run))
    world = int(os.environ["WORLD_SIZE"])
    if world == cfg.mesh.world_size:
        return cfg
    return replace(cfg, mesh=Mesh(dp_replicate=1, dp_shard=world, cp=1, ep=cfg.mesh.ep, world_size=world))


def train_family(run: RunDir, steps: int) -> dict:
    """Load, publish step 0, train `steps` steps, publish the last; the per-step losses and gradient norms."""
    cfg = trainer_config(run)
    d = init_distributed(cfg)
    torch.manual_seed(cfg.training.seed)
    model, _ = load_model(cfg, d)
    publish_weights(run, 0, model, cfg.model_path, torch.float32, d)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr, weight_decay=cfg.training.weight_decay)
    spec = RLSpec(cfg)
    vocab = model.config.get_text_config().vocab_size
    out = {"losses": [], "grad_norms": []}
    for step in range(1, steps + 1):
        batch = RolloutBatch(step, to_arrays(make_samples(step, vocab)), {})
        mbs = batch.micro_batches(d.dp_rank, d.dp_size, 1 if has_sliding_window(model) else MICRO_BATCH_TOKENS)
        metrics = train_step(model, optim, mbs, spec, cfg, d)
        out["losses"].append(metrics["loss"])
        out["grad_norms"].append(metrics["grad_norm"])
    publish_weights(run, steps, model, cfg.model_path, torch.float32, d)
    return out


def main(out_path: str, steps: int, run_dirs: list[str]) -> None:
    results = {run_dir: train_family(RunDir(run_dir), steps) for run_dir in run_dirs}
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
