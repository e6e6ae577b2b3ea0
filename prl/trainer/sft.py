"""`prl trainer` on an SFT topology: supervised fine-tuning with the RL trainer's machinery.

    for step in start+1..last:
        this step's conversations (deterministic from seed and step) -> token samples
        packed into this rank's micro-batches (prl.run.batch.pack: positions restart per sample)
        forward/backward (token-mean NLL on assistant tokens), clip, optimizer step
        every checkpoint_interval steps and at the end: publish weights/step_N (HF) + checkpoint
        append the step's metrics to metrics.jsonl, heartbeat

Everything but the data and the loss is the RL trainer's own code (prl/trainer/train.py):
`start_training` (ranks, model load, FSDP2, resume), `accumulate_step` (micro-batches, clipping,
AdamW), `publish_weights`, `save_checkpoint`, the stop flag and the run directory's state files.

Data order: conversation i of the stream is `perm_e[i mod n]` with e = i // n and `perm_e` a
permutation of the n conversations drawn from (seed, e); step N trains on stream positions
[(N-1)B, NB) for batch size B. A step's data depends on nothing but (seed, N), so a resume from
a checkpoint at step K replays exactly what an uninterrupted run does after K.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prl.errors import ConfigError
from prl.run.batch import MicroBatch, RolloutBatch, Sample, to_arrays
from prl.run.rundir import RunDir
from prl.trainer.config import TrainerConfig
from prl.trainer.loss import nll_loss, token_logprobs_and_entropy
from prl.trainer.parallel import Dist
from prl.trainer.sft_data import read_conversations, tokenize_conversation
from prl.trainer.checkpoint import save_checkpoint
from prl.trainer.train import (ROLE, StopFlag, accumulate_step, add_router_aux, forward, heartbeat_of, log,
                               peak_rss_mb, start_training)
from prl.trainer.weights import publish_weights


@dataclass
class SFTData:
    """The conversations of a run, tokenized on demand, in the order of the module doc."""

    conversations: list[list[dict[str, str]]]
    tokenizer: Any
    max_tokens: int
    batch_size: int
    seed: int

    @property
    def steps_per_epoch(self) -> float:
        return len(self.conversations) / self.batch_size

    def indices(self, step: int) -> list[int]:
        """Conversation indices of step `step` (from 1)."""
        n = len(self.conversations)
        first = (step - 1) * self.batch_size
        out, perms = [], {}
        for i in range(first, first + self.batch_size):
            epoch = i // n
            if epoch not in perms:
                perms[epoch] = np.random.default_rng((self.seed, epoch)).permutation(n)
            out.append(int(perms[epoch][i % n]))
        return out

    def samples(self, step: int) -> list[Sample]:
        return [tokenize_conversation(self.tokenizer, self.conversations[i], self.max_tokens)
                for i in self.indices(step)]

    def last_step(self, max_steps: int, epochs: int | None) -> int:
        """The run's last step: `max_steps`, or fewer when `epochs` passes end earlier."""
        if epochs is None:
            return max_steps
        return min(max_steps, math.ceil(epochs * len(self.conversations) / self.batch_size))


def load_data(cfg: TrainerConfig) -> SFTData:
    from transformers import AutoTokenizer

    assert cfg.sft is not None
    conversations = list(read_conversations(Path(cfg.sft.data), cfg.sft.split))
    if not conversations:
        raise ConfigError(f"sft.data {cfg.sft.data} holds no conversations")
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
    return SFTData(conversations, tokenizer, cfg.max_model_len, cfg.training.batch_size, cfg.seed)


def micro_batches(samples: list[Sample], cfg: TrainerConfig, d: Dist) -> list[MicroBatch | None]:
    """This rank's packed micro-batches of the step's samples (the RL batch format, packed the RL way)."""
    batch = RolloutBatch(step=0, arrays=to_arrays(samples), packing={})
    return batch.micro_batches(d.dp_rank, d.dp_size, cfg.micro_batch_tokens)


def sft_micro_loss(model, x: dict[str, torch.Tensor], cfg: TrainerConfig, n_loss_tokens: int, aux_weight: float):
    """`accumulate_step`'s loss for SFT: this micro-batch's share of the step's token-mean NLL (plus the
    MoE router's load-balancing loss when `training.router_aux_loss_coef` > 0, as in RL)."""
    out = forward(model, x, cfg.router_aux_loss_coef)
    logp, entropy = token_logprobs_and_entropy(out.logits[0], x["targets"])
    loss, stats = nll_loss(logp, x["loss_mask"], n_loss_tokens, entropy=entropy)
    return add_router_aux(loss, stats, out, cfg.router_aux_loss_coef, aux_weight), stats


def sft_step(model, optim, mbs: list[MicroBatch | None], cfg: TrainerConfig, d: Dist) -> dict:
    s, grad_norm = accumulate_step(model, optim, mbs, cfg, d,
                                   lambda model, x, n, w: sft_micro_loss(model, x, cfg, n, w))
    n = max(s.get("loss_tokens", 0.0), 1.0)
    return {
        "loss": s.get("loss_sum", 0.0) / n,
        "entropy": s.get("entropy_sum", 0.0) / n,
        **({"router_aux_loss": s["router_aux_loss_sum"]} if "router_aux_loss_sum" in s else {}),
        "grad_norm": grad_norm,
        "tokens": int(s.get("tokens", 0)),
        "loss_tokens": int(s.get("loss_tokens", 0)),
    }


def run_sft(run: RunDir, cfg: TrainerConfig, resume: str = "latest") -> int:
    assert cfg.sft is not None
    d, model, optim, start = start_training(run, cfg, resume)
    data = load_data(cfg)
    publish_dtype = getattr(torch, cfg.model_dtype)
    last = data.last_step(cfg.max_steps, cfg.sft.epochs)
    interval = cfg.checkpoint_interval
    log(d, f"sft: {len(data.conversations)} conversations, {cfg.training.batch_size} per step "
           f"({data.steps_per_epoch:.2f} steps per epoch), steps {start + 1}..{last}")
    beat = heartbeat_of(run, d)
    stop = StopFlag.install()
    saved = start if start > 0 else None
    for step in range(start + 1, last + 1):
        if stop.agreed(False, d):
            # SIGTERM (the job is stopping): keep what the last finished step did, then leave.
            if step - 1 > start and saved != step - 1:
                log(d, f"stopping: checkpoint of step {step - 1} before exiting")
                publish_weights(run, step - 1, model, cfg.model_path, publish_dtype, d)
                save_checkpoint(run, step - 1, model, optim, d, cfg.seed)
            return 128 + signal.SIGTERM
        t0 = time.monotonic()
        mbs = micro_batches(data.samples(step), cfg, d)
        t1 = time.monotonic()
        metrics = sft_step(model, optim, mbs, cfg, d)
        t2 = time.monotonic()
        if step == last or (interval > 0 and step % interval == 0):
            # Weights go with checkpoints (and the last step): SFT has no inference role waiting for each step.
            publish_weights(run, step, model, cfg.model_path, publish_dtype, d)
            save_checkpoint(run, step, model, optim, d, cfg.seed)
            saved = step
        t3 = time.monotonic()
        if d.is_main:
            # Weights stay as long as their checkpoint does (RL's staleness window, here back to the oldest kept).
            kept = run.stable_steps("checkpoints", ROLE)[-cfg.checkpoint_keep:]
            run.cleanup(step, max_off_policy_steps=step - kept[0] if kept else step,
                        checkpoint_keep=cfg.checkpoint_keep)
            record = {
                "role": ROLE, "step": step, "time": time.time(), **metrics,
                "epoch": step / data.steps_per_epoch,
                "tokens_per_s": metrics["tokens"] / max(t2 - t1, 1e-9),
                "data_s": t1 - t0, "train_s": t2 - t1, "publish_s": t3 - t2, "step_s": time.monotonic() - t0,
                "lr": cfg.lr, "peak_rss_mb": peak_rss_mb(),
            }
            run.append_metrics(record)
            log(d, f"step {step} loss {metrics['loss']:.6f} grad_norm {metrics['grad_norm']:.4f} "
                   f"tok/s {record['tokens_per_s']:.0f}")
        beat(step=step, phase="trained", step_s=round(time.monotonic() - t0, 3))
    torch.distributed.barrier()
    return 0
