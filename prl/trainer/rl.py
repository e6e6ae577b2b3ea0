"""RL as a spec of the training engine (prl/trainer/engine.py): policy-gradient steps on the orchestrator's rollouts.

    wait for rollouts/step_N (a heartbeat every HEARTBEAT_S meanwhile), check its token ids against the model's vocab
    this rank's micro-batches of it (the batch's packing, repacked if the trainer's dp size differs)
    loss: the policy-gradient loss of prl/trainer/loss.py (`training.loss`: a built-in kind or your own
          import_path, loaded at start) (+ the MoE router's aux loss), with the
          trainer/inference mismatch of the sampled tokens
    publish weights/step_N every step (inference waits for it); checkpoint every `checkpoint_interval`
    steps and at `max_steps`; keep `max_off_policy_steps` weights steps for inference
    record: the engine's fields + `wait_s` and `max_policy_lag`
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from prl.errors import StepTimeout
from prl.run.batch import SCORE_FIELDS, BatchError, MicroBatch, read_batch
from prl.run.rundir import HEARTBEAT_S, RunDir
from prl.trainer.config import TrainerConfig
from prl.trainer.engine import (LABELS, Engine, Spec, StepData, StopFlag, add_router_aux, forward_logprobs,
                                picture_inputs)
from prl.trainer.loss import LossInputs, custom_loss, load_custom_loss, policy_loss, sample_ids_of
from prl.trainer.parallel import Dist


def wait_rollouts(run: RunDir, step: int, cfg: TrainerConfig, stop: StopFlag, heartbeat) -> Path | None:
    """rollouts/step_N once published (heartbeating every HEARTBEAT_S meanwhile); None when SIGTERM came first."""
    timeout_s = cfg.training.rollout_timeout_s
    deadline = time.monotonic() + timeout_s
    next_beat = 0.0
    while stop.signum is None:
        now = time.monotonic()
        if now >= next_beat:
            heartbeat()
            next_beat = now + HEARTBEAT_S
        try:
            return run.wait_for_step("rollouts", step, min(1.0, max(0.0, deadline - now)))
        except StepTimeout:
            if time.monotonic() >= deadline:
                raise StepTimeout(
                    f"waited {timeout_s:.0f} s for rollouts/step_{step} in {run.root}; latest "
                    f"published rollouts step is {run.latest_stable('rollouts')}. Is the orchestrator running? "
                    f"See `prl status`.") from None
    return None


def mismatch_stats(logp: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Trainer vs inference-engine logprobs of the sampled tokens, before this step's update.

    Over loss tokens only, whatever the loss masks: r = exp(logp_trainer - logp_engine),
    sums of r and of the k3 KL estimate r - 1 - log r (KL(engine || trainer)), and min/max of r.
    """
    is_loss = mask.bool()
    log_r = torch.where(is_loss, logp.detach() - inference_logprobs, torch.zeros_like(logp))
    r = torch.exp(log_r)
    big = torch.finfo(r.dtype).max
    return {
        "mismatch_ratio_sum": float((r * mask).sum()),
        "mismatch_kl_sum": float(((r - 1 - log_r) * mask).sum()),
        "mismatch_ratio_max": float(torch.where(is_loss, r, torch.full_like(r, -big)).max()),
        "mismatch_ratio_min": float(torch.where(is_loss, r, torch.full_like(r, big)).min()),
    }


class RLSpec(Spec):
    """Policy-gradient training on the rollouts the orchestrator publishes, one rollouts step per step."""

    def __init__(self, cfg: TrainerConfig) -> None:
        super().__init__(cfg)
        self.custom_loss = load_custom_loss(cfg.training.loss)  # at start: a bad import_path fails here
        self.labels = LABELS + tuple(SCORE_FIELDS[role] for role in cfg.scorers)
        """The label-side arrays of a micro-batch: the scoring servers' logprobs with the sampling ones."""

    def last_step(self) -> int:
        return self.cfg.training.max_steps

    def wait(self, eng: Engine, step: int) -> Path | None:
        return wait_rollouts(eng.run, step, self.cfg, eng.stop,
                             heartbeat=lambda: eng.beat(step=step, phase="waiting_for_rollouts"))

    def load(self, eng: Engine, step: int, ready: Path) -> StepData:
        batch = read_batch(ready)
        missing = [k for k in self.labels if k not in batch.arrays]
        if missing:
            raise BatchError(f"{ready}: the run's scoring servers' {', '.join(missing)} are missing from the batch")
        vocab_size = eng.model.get_input_embeddings().num_embeddings
        if batch.num_tokens and int(batch.arrays["input_ids"].max()) >= vocab_size:
            raise BatchError(
                f"{ready}: token id {int(batch.arrays['input_ids'].max())} >= the model's "
                f"vocab_size {vocab_size}; were the rollouts made with another tokenizer?"
            )
        return StepData(batch.micro_batches(eng.d.dp_rank, eng.d.dp_size, self.cfg.training.micro_batch_tokens),
                        source=batch)

    def inputs(self, mb: MicroBatch | None, d: Dist) -> dict[str, torch.Tensor]:
        return picture_inputs(self.pictures, mb, d, self.labels)

    def micro_loss(self, model, x: dict[str, torch.Tensor], n_loss_tokens: int, aux_weight: float):
        """Loss share and stats of this rank's positions of one micro-batch (see `engine.micro_batch_inputs`)."""
        coef = self.cfg.training.router_aux_loss_coef
        out, logp, entropy = forward_logprobs(model, x, coef, fused=self.cfg.compile,
                                              temperature=self.cfg.training.temperature)
        inputs = LossInputs(logp, x["inference_logprobs"], x["advantages"], x["loss_mask"],
                            sample_ids_of(x["position_ids"]), n_loss_tokens,
                            teacher_logprobs=x.get("teacher_logprobs"), reference_logprobs=x.get("reference_logprobs"))
        if self.custom_loss is not None:
            loss, stats = custom_loss(self.custom_loss, inputs, self.cfg.training.loss, entropy)
        else:
            loss, stats = policy_loss(logp, inputs.inference_logprobs, inputs.advantages, inputs.loss_mask,
                                      self.cfg.training.loss, n_loss_tokens, entropy=entropy,
                                      sample_ids=inputs.sample_ids, teacher_logprobs=inputs.teacher_logprobs,
                                      reference_logprobs=inputs.reference_logprobs)
        stats |= mismatch_stats(logp, x["inference_logprobs"], x["loss_mask"])
        if self.cfg.training.router_replay:  # on every rank and pass alike: the stats' keys must match
            stats["replayed_tokens"] = float((x["routed_mask"] & x["real"]).sum()) if "routed_mask" in x else 0.0
        return add_router_aux(loss, stats, out, coef, aux_weight), stats

    def summarize(self, s: dict[str, float], grad_norm: float) -> dict:
        n = max(s.get("loss_tokens", 0.0), 1.0)
        has = bool(s.get("loss_tokens"))
        return {
            "loss": s.get("loss_sum", 0.0) / n,
            "entropy": s.get("entropy_sum", 0.0) / n,
            "kl": s.get("kl_sum", 0.0) / n,
            **({"teacher_kl": s["teacher_kl_sum"] / n} if "teacher_kl_sum" in s else {}),
            **({"ref_kl": s["ref_kl_sum"] / n} if "ref_kl_sum" in s else {}),
            "ratio_mean": s.get("ratio_sum", 0.0) / n,
            "ratio_min": s.get("ratio_min", 1.0) if has else None,
            "ratio_max": s.get("ratio_max", 1.0) if has else None,
            "mismatch_ratio_mean": s.get("mismatch_ratio_sum", 0.0) / n if has else None,
            "mismatch_ratio_min": s.get("mismatch_ratio_min") if has else None,
            "mismatch_ratio_max": s.get("mismatch_ratio_max") if has else None,
            "mismatch_kl": s.get("mismatch_kl_sum", 0.0) / n if has else None,
            **({"router_aux_loss": s["router_aux_loss_sum"]} if "router_aux_loss_sum" in s else {}),
            **({"replayed_fraction": s.get("replayed_tokens", 0.0) / max(s.get("tokens", 0.0), 1.0)}
               if self.cfg.training.router_replay else {}),
            "masked_fraction": s.get("masked_tokens", 0.0) / n,
            "grad_norm": float(grad_norm),
            "tokens": int(s.get("tokens", 0)),
            "loss_tokens": int(s.get("loss_tokens", 0)),
        }

    def publishes(self, step: int, last: int) -> bool:
        return True  # inference waits for every step's weights

    def checkpoints(self, step: int, last: int) -> bool:
        interval = self.cfg.training.checkpoint_interval
        return interval > 0 and (step % interval == 0 or step == last)

    def cleanup(self, eng: Engine, step: int) -> None:
        eng.run.cleanup(step, max_off_policy_steps=self.cfg.training.max_off_policy_steps,
                        checkpoint_keep=self.cfg.training.checkpoint_keep)

    def record(self, step: int, data: StepData, data_s: float) -> dict:
        versions = data.source.arrays["policy_version"]
        return {"wait_s": data_s, "max_policy_lag": int(step - versions.min()) if versions.size else 0}

    def progress(self, record: dict) -> str:
        return f" wait {record['wait_s']:.2f}s"
