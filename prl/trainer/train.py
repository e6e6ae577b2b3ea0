"""`prl trainer`'s entry: read the plan, pick the spec (SFT for an `sft:` plan, else RL), run the engine.

The step loop and everything around it is prl/trainer/engine.py; the RL and SFT specs are
prl/trainer/rl.py and prl/trainer/sft.py. Started under torchrun (one process per GPU, or per CPU
rank with gloo); without torchrun it runs as a single rank. Settings come from RUN/plan.json (see
prl/trainer/config.py). The model is built on the meta device and loaded shard by shard
(prl/trainer/loading.py); expert parallelism is in prl/trainer/moe.py, context parallelism in
prl/trainer/context_parallel.py, the meshes in prl/trainer/parallel.py.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from prl.log import init_logging
from prl.planner.model import Plan
from prl.run.lifecycle import role_lifecycle
from prl.run.rundir import RunDir
from prl.trainer.config import TrainerConfig
from prl.trainer.engine import ROLE, train
from prl.trainer.rl import RLSpec
from prl.trainer.sft import SFTSpec


def main(run_dir: str, resume: str = "latest") -> int:
    """Run the trainer on RUN (one rank of it, under torchrun). Returns 0 (128 + SIGTERM when stopped);
    raises PrlError on a clear failure.

    Records the role's start, heartbeats and exit in RUN/state/trainer.json (rank 0 claims the role once
    the ranks are up, in `engine.start`).
    """
    init_logging(ROLE, int(os.environ.get("RANK", "0")))
    run = RunDir(run_dir)
    try:
        with role_lifecycle(run, ROLE, claim=False) as outcome:
            cfg = TrainerConfig.from_plan(Plan.read(run))
            spec = SFTSpec(cfg) if cfg.sft is not None else RLSpec(cfg)
            outcome.code = train(run, cfg, spec, resume)
        return outcome.code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
