"""SFT as a spec of the training engine (prl/trainer/engine.py): supervised fine-tuning on conversations.

    this step's conversations (deterministic from seed and step) -> token samples
    packed into this rank's micro-batches (prl.run.batch.pack: positions restart per sample)
    loss: token-mean NLL on assistant tokens (+ the MoE router's aux loss, as in RL)
    publish weights/step_N with every checkpoint (every `checkpoint_interval` steps) and at the last step
    the last step: `max_steps`, or fewer when `sft.epochs` passes end first
    record: the engine's fields + `epoch` and `data_s`

Data order: conversation i of the stream is `perm_e[i mod n]` with e = i // n and `perm_e` a
permutation of the n conversations drawn from (seed, e); step N trains on stream positions
[(N-1)B, NB) for batch size B. A step's data depends on nothing but (seed, N), so a resume from
a checkpoint at step K replays exactly what an uninterrupted run does after K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prl.errors import ConfigError
from prl.log import get_logger
from prl.run.batch import MicroBatch, RolloutBatch, Sample, to_arrays
from prl.trainer.config import TrainerConfig
from prl.trainer.engine import ROLE, Engine, Spec, StepData, add_router_aux, forward_logprobs
from prl.trainer.loss import nll_loss
from prl.trainer.parallel import Dist
from prl.trainer.sft_data import has_pictures, read_conversations, tokenize_conversation
from prl.trainer.vision import Pictures

log = get_logger(__name__)


@dataclass
class SFTData:
    """The conversations of a run, tokenized on demand, in the order of the module doc."""

    conversations: list[list[dict[str, Any]]]
    tokenizer: Any
    """The model's tokenizer, or its processor (a vision-language model)."""
    max_tokens: int
    batch_size: int
    seed: int
    image_token_id: int | None = None

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
        return [tokenize_conversation(self.tokenizer, self.conversations[i], self.max_tokens, self.image_token_id)
                for i in self.indices(step)]

    def last_step(self, max_steps: int, epochs: int | None) -> int:
        """The run's last step: `max_steps`, or fewer when `epochs` passes end earlier."""
        if epochs is None:
            return max_steps
        return min(max_steps, math.ceil(epochs * len(self.conversations) / self.batch_size))


def load_data(cfg: TrainerConfig, pictures: Pictures | None = None) -> SFTData:
    """The run's conversations and their tokenizer: the processor of a vision-language model (`pictures`)."""
    from transformers import AutoTokenizer

    assert cfg.sft is not None
    conversations = list(read_conversations(Path(cfg.sft.data), cfg.sft.split))
    if not conversations:
        raise ConfigError(f"sft.data {cfg.sft.data} holds no conversations")
    if pictures is None:
        with_pictures = next((i for i, c in enumerate(conversations) if has_pictures(c)), None)
        if with_pictures is not None:
            raise ConfigError(f"sft.data {cfg.sft.data}: conversation {with_pictures} has pictures, but "
                              f"{cfg.model_path} is not a vision-language model")
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
        return SFTData(conversations, tokenizer, cfg.max_model_len, cfg.training.batch_size, cfg.training.seed)
    return SFTData(conversations, pictures.processor, cfg.max_model_len, cfg.training.batch_size,
                   cfg.training.seed, pictures.image_token_id)


def micro_batches(samples: list[Sample], cfg: TrainerConfig, d: Dist) -> list[MicroBatch | None]:
    """This rank's packed micro-batches of the step's samples (the RL batch format, packed the RL way)."""
    batch = RolloutBatch(step=0, arrays=to_arrays(samples), packing={})
    return batch.micro_batches(d.dp_rank, d.dp_size, cfg.training.micro_batch_tokens)


class SFTSpec(Spec):
    """Supervised fine-tuning on `sft.data`'s conversations, in the order of the module doc."""

    def __init__(self, cfg: TrainerConfig) -> None:
        super().__init__(cfg)
        # Read in `setup`: once rank 0 holds the role, so a bad data file is recorded as the role's exit.
        self.data: SFTData | None = None

    def setup(self, eng: Engine) -> None:
        self.data = load_data(self.cfg, self.pictures)
        if eng.d.is_main:
            log.info("sft: %d conversations, %d per step (%.2f steps per epoch), steps %d..%d",
                     len(self.data.conversations), self.cfg.training.batch_size, self.data.steps_per_epoch,
                     eng.start + 1, self.last_step())

    def last_step(self) -> int:
        return self.data.last_step(self.cfg.training.max_steps, self.cfg.sft.epochs)

    def wait(self, eng: Engine, step: int) -> int:
        return step  # the data is at hand

    def load(self, eng: Engine, step: int, ready: int) -> StepData:
        return StepData(micro_batches(self.data.samples(step), self.cfg, eng.d))

    def micro_loss(self, model, x: dict[str, torch.Tensor], n_loss_tokens: int, aux_weight: float):
        """This micro-batch's share of the step's token-mean NLL (plus the MoE router's load-balancing loss
        when `training.router_aux_loss_coef` > 0, as in RL)."""
        coef = self.cfg.training.router_aux_loss_coef
        out, logp, entropy = forward_logprobs(model, x, coef, fused=self.cfg.compile)
        loss, stats = nll_loss(logp, x["loss_mask"], n_loss_tokens, entropy=entropy)
        return add_router_aux(loss, stats, out, coef, aux_weight), stats

    def summarize(self, s: dict[str, float], grad_norm: float) -> dict:
        n = max(s.get("loss_tokens", 0.0), 1.0)
        return {
            "loss": s.get("loss_sum", 0.0) / n,
            "entropy": s.get("entropy_sum", 0.0) / n,
            **({"router_aux_loss": s["router_aux_loss_sum"]} if "router_aux_loss_sum" in s else {}),
            "grad_norm": grad_norm,
            "tokens": int(s.get("tokens", 0)),
            "loss_tokens": int(s.get("loss_tokens", 0)),
        }

    def publishes(self, step: int, last: int) -> bool:
        # Weights go with checkpoints (and the last step): SFT has no inference role waiting for each step.
        return self.checkpoints(step, last)

    def checkpoints(self, step: int, last: int) -> bool:
        interval = self.cfg.training.checkpoint_interval
        return step == last or (interval > 0 and step % interval == 0)

    def cleanup(self, eng: Engine, step: int) -> None:
        # Weights stay as long as their checkpoint does (RL's staleness window, here back to the oldest kept).
        keep = self.cfg.training.checkpoint_keep
        kept = eng.run.stable_steps("checkpoints", ROLE)[-keep:]
        eng.run.cleanup(step, max_off_policy_steps=step - kept[0] if kept else step, checkpoint_keep=keep)

    def record(self, step: int, data: StepData, data_s: float) -> dict:
        return {"epoch": step / self.data.steps_per_epoch, "data_s": data_s}
