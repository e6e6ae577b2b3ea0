"""`prl trainer`: the FSDP2 training loop of one run.

    for step in start..max_steps:
        wait for rollouts/step_N (heartbeat while waiting)
        forward/backward every micro-batch of this rank, clip, optimizer step
        publish weights/step_N (HF safetensors + STABLE)
        checkpoint every `checkpoint_interval` steps, clean up old steps
        append the step's metrics to metrics.jsonl

Started under torchrun (one process per GPU, or per CPU rank with gloo);
without torchrun it runs as a single rank. Settings come from RUN/plan.json
(see prl/trainer/config.py), the loss is in prl/trainer/loss.py.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from prl.run.batch import BatchError, MicroBatch, read_batch
from prl.run.rundir import RunDir
from prl.trainer.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from prl.trainer.config import TrainerConfig
from prl.trainer.loss import merge_stats, policy_loss, token_logprobs_and_entropy
from prl.trainer.parallel import Dist, all_reduce_stats, apply_fsdp, init_distributed
from prl.trainer.weights import publish_weights

ROLE = "trainer"


def log(d: Dist, msg: str) -> None:
    if d.is_main:
        print(f"[trainer] {msg}", flush=True)


def load_model(cfg: TrainerConfig, d: Dist) -> torch.nn.Module:
    """Every rank reads the checkpoint on CPU in fp32 (master weights); fully_shard keeps its shard
    and moves it to the device."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=torch.float32)
    model.config.use_cache = False
    model.train()  # HF applies activation checkpointing only in training mode
    return apply_fsdp(model, cfg, d)


def micro_batch_loss(model, mb: MicroBatch | None, cfg: TrainerConfig, n_loss_tokens: int, device):
    """Loss share and stats of one packed micro-batch; None is a padding pass that adds zero."""
    if mb is None:
        # FSDP ranks must run the same number of passes: a one-token dummy keeps the collectives matched.
        ids = torch.zeros((1, 2), dtype=torch.long, device=device)
        logits = model(input_ids=ids, position_ids=torch.arange(2, device=device)[None], use_cache=False).logits
        return logits.sum() * 0.0, {}
    t = {
        k: torch.from_numpy(getattr(mb, k)).to(device)
        for k in ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs")
    }
    out = model(input_ids=t["input_ids"].long()[None], position_ids=t["position_ids"].long()[None], use_cache=False)
    # Token t is predicted by the logits at t-1; a micro-batch's (and sample's) first token has no loss.
    logp, entropy = token_logprobs_and_entropy(out.logits[0, :-1], t["input_ids"][1:])
    return policy_loss(
        logp,
        t["inference_logprobs"][1:],
        t["advantages"][1:],
        t["loss_mask"][1:],
        cfg.loss,
        n_loss_tokens,
        entropy=entropy,
    )


def train_step(model, optim, micro_batches: list[MicroBatch | None], cfg: TrainerConfig, d: Dist) -> dict:
    """One optimizer step over this rank's micro-batches; returns globally reduced metrics."""
    local = sum(int(mb.loss_mask.sum()) for mb in micro_batches if mb is not None)
    n_total = int(all_reduce_stats({"n": float(local)}, d.device)["n"])
    parts = []
    for mb in micro_batches:
        loss, stats = micro_batch_loss(model, mb, cfg, n_total, d.device)
        # FSDP averages gradients over the dp ranks; the loss is already a global mean.
        (loss * d.dp_size).backward()
        parts.append(stats | {"tokens": float(mb.num_tokens if mb else 0)})
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optim.step()
    optim.zero_grad(set_to_none=True)
    s = all_reduce_stats(merge_stats(parts), d.device)
    n = max(s.get("loss_tokens", 0.0), 1.0)
    return {
        "loss": s.get("loss_sum", 0.0) / n,
        "entropy": s.get("entropy_sum", 0.0) / n,
        "kl": s.get("kl_sum", 0.0) / n,
        "ratio_mean": s.get("ratio_sum", 0.0) / n,
        "ratio_min": s.get("ratio_min", 1.0) if s.get("loss_tokens") else None,
        "ratio_max": s.get("ratio_max", 1.0) if s.get("loss_tokens") else None,
        "masked_fraction": s.get("masked_tokens", 0.0) / n,
        "grad_norm": float(grad_norm),
        "tokens": int(s.get("tokens", 0)),
        "loss_tokens": int(s.get("loss_tokens", 0)),
    }


def run_trainer(run: RunDir, resume: str = "latest") -> int:
    cfg = TrainerConfig.from_plan(run.read_plan())
    d = init_distributed(cfg)
    torch.manual_seed(cfg.seed)
    if d.is_main:
        run.claim(ROLE)
    model = load_model(cfg, d)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    publish_dtype = getattr(torch, cfg.model_dtype)
    vocab_size = model.get_input_embeddings().num_embeddings

    start = resolve_resume(run, resume) if d.is_main else 0
    start = int(_broadcast_int(start))
    if start > 0:
        load_checkpoint(run, start, model, optim, d, cfg.seed)
    if d.is_main:
        # Steps after the resume point were made by an attempt that is being replaced: drop them.
        run.remove_steps_after("weights", start)
        run.remove_steps_after("checkpoints", start)
        run.drop_metrics_after(ROLE, start)
    dist.barrier()
    log(d, f"world {d.world_size} (dp {d.dp_size}) on {d.device}; steps {start + 1}..{cfg.max_steps}")

    beat = (lambda **kw: run.heartbeat(ROLE, **kw)) if d.is_main else (lambda **kw: None)
    for step in range(start + 1, cfg.max_steps + 1):
        t0 = time.monotonic()
        step_dir = run.wait_for_step(
            "rollouts", step, cfg.rollout_timeout_s, heartbeat=lambda: beat(step=step, phase="waiting_for_rollouts")
        )
        batch = read_batch(step_dir)
        if batch.num_tokens and int(batch.arrays["input_ids"].max()) >= vocab_size:
            raise BatchError(
                f"{step_dir}: token id {int(batch.arrays['input_ids'].max())} >= the model's "
                f"vocab_size {vocab_size}; were the rollouts made with another tokenizer?"
            )
        micro_batches = batch.micro_batches(d.rank, d.dp_size, cfg.micro_batch_tokens)
        t1 = time.monotonic()

        metrics = train_step(model, optim, micro_batches, cfg, d)
        t2 = time.monotonic()

        publish_weights(run, step, model, cfg.model_path, publish_dtype, d.is_main)
        t3 = time.monotonic()

        if cfg.checkpoint_interval > 0 and (step % cfg.checkpoint_interval == 0 or step == cfg.max_steps):
            save_checkpoint(run, step, model, optim, d, cfg.seed)
        if d.is_main:
            run.cleanup(step, max_off_policy_steps=cfg.max_off_policy_steps, checkpoint_keep=cfg.checkpoint_keep)
            versions = batch.arrays["policy_version"]
            record = {
                "role": ROLE,
                "step": step,
                "time": time.time(),
                **metrics,
                "tokens_per_s": metrics["tokens"] / max(t2 - t1, 1e-9),
                "wait_s": t1 - t0,
                "train_s": t2 - t1,
                "publish_s": t3 - t2,
                "step_s": time.monotonic() - t0,
                "lr": cfg.lr,
                "max_policy_lag": int(step - versions.min()) if versions.size else 0,
            }
            run.append_metrics(record)
            beat(step=step, phase="trained")
            log(
                d,
                f"step {step} loss {metrics['loss']:.6f} grad_norm {metrics['grad_norm']:.4f} "
                f"tok/s {record['tokens_per_s']:.0f} wait {record['wait_s']:.2f}s",
            )
    dist.barrier()
    return 0


def _broadcast_int(value: int) -> int:
    t = torch.tensor([value], dtype=torch.long)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.broadcast(t, src=0)
    return int(t.item())


def main(run_dir: str, resume: str = "latest") -> int:
    """Run the trainer on RUN (one rank of it, under torchrun). Returns 0; raises PrlError on a clear failure.

    Records the role's start, heartbeats and exit in RUN/state/trainer.json (rank 0).
    """
    run = RunDir(run_dir)
    code, error = 1, None
    try:
        code = run_trainer(run, resume)
        return code
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        state = run.read_state(ROLE) if run.state_dir.exists() else None
        if state and state.get("pid") == os.getpid():  # only the holder of the role records its exit
            run.mark_exit(ROLE, code if error is None else 1, error)
        if dist.is_initialized():
            dist.destroy_process_group()
