"""`prl trainer`: the FSDP2 training loop of one run.

    for step in start..max_steps:
        wait for rollouts/step_N (heartbeat while waiting)
        forward/backward every micro-batch of this rank (its cp share of each), clip, optimizer step
        publish weights/step_N (every rank writes its share of the HF safetensors; one STABLE)
        checkpoint every `checkpoint_interval` steps, clean up old steps
        append the step's metrics to metrics.jsonl

An SFT plan (`sft:` topology) runs `prl.trainer.sft.run_sft` instead: the same start, step,
publishing and checkpoint functions from this module, with its own data and NLL loss.

Started under torchrun (one process per GPU, or per CPU rank with gloo);
without torchrun it runs as a single rank. Settings come from RUN/plan.json
(see prl/trainer/config.py), the loss is in prl/trainer/loss.py. The model is built on the
meta device and loaded shard by shard (prl/trainer/loading.py); expert parallelism is in
prl/trainer/moe.py, context parallelism in prl/trainer/context_parallel.py, the meshes in
prl/trainer/parallel.py.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from prl.planner.model import Plan
from prl.run.batch import BatchError, MicroBatch, read_batch
from prl.errors import StepTimeout
from prl.run.rundir import RunDir, current_attempt
from prl.trainer.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from prl.trainer.config import TrainerConfig
from prl.trainer.loss import merge_stats, policy_loss, token_logprobs_and_entropy
from prl.trainer.parallel import Dist, all_reduce_stats, apply_fsdp, clip_grad_norm, init_distributed
from prl.trainer.weights import publish_weights

ROLE = "trainer"


def log(d: Dist, msg: str) -> None:
    if d.is_main:
        print(f"[trainer] {msg}", flush=True)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    """This process's resident memory now (Linux /proc; the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return peak_rss_mb()


def load_model(cfg: TrainerConfig, d: Dist) -> tuple[torch.nn.Module, float]:
    """Meta-device model -> EP experts / Ulysses attention -> FSDP2 -> this rank's shards from the safetensors.

    No rank reads the whole checkpoint (prl/trainer/loading.py); fp32 master weights. Returns the
    model and how far loading raised this rank's peak RSS above its RSS before (MiB).
    """
    from prl.trainer.context_parallel import install_ulysses
    from prl.trainer.loading import build_meta_model, load_model as load_shards_into
    from prl.trainer.moe import install_expert_parallel

    model = build_meta_model(cfg.model_path)
    if d.ep > 1:
        install_expert_parallel(model, d.ep, d.ep_rank, d.ep_group)
    if d.cp > 1:
        install_ulysses(model, d.cp)
    apply_fsdp(model, cfg, d)
    before = current_rss_mb()
    load_shards_into(model, cfg.model_path, d.device)
    return model, peak_rss_mb() - before


def prepare(mb: MicroBatch | None, d: Dist) -> dict[str, torch.Tensor]:
    """This rank's positions of one micro-batch, labels shifted on the whole sequence first.

    Position p carries its input token and, as its label side, token p+1 with that token's loss
    mask, advantage and sampling logprob (the last position, and a sample's first token, have
    no loss). The sequence is padded to a multiple of cp with masked positions (a separate
    pseudo-sample), then cp rank c keeps the c-th consecutive chunk. None (a padding pass:
    every rank runs the same number of passes) becomes two masked tokens per cp rank.
    """
    if mb is None:
        ids = np.zeros(2 * d.cp, dtype=np.int64)
        pos, zero = np.arange(2 * d.cp), np.zeros(2 * d.cp)
        arrays = {"input_ids": ids, "position_ids": pos, "loss_mask": zero, "advantages": zero,
                  "inference_logprobs": zero}
    else:
        arrays = {k: getattr(mb, k) for k in ("input_ids", "position_ids", "loss_mask", "advantages",
                                              "inference_logprobs")}
    n = arrays["input_ids"].shape[0]
    pad = (-n) % d.cp
    x = {
        "input_ids": torch.from_numpy(np.asarray(arrays["input_ids"])).long(),
        "position_ids": torch.from_numpy(np.asarray(arrays["position_ids"])).long(),
        "real": torch.full((n,), mb is not None, dtype=torch.bool),  # counted in the step's tokens
    }
    for k, out in (("input_ids", "targets"), ("loss_mask", "loss_mask"), ("advantages", "advantages"),
                   ("inference_logprobs", "inference_logprobs")):
        v = torch.from_numpy(np.asarray(arrays[k]))
        x[out] = torch.cat([v[1:], v.new_zeros(1)])
    x["targets"] = x["targets"].long()
    x["loss_mask"] = x["loss_mask"].float()
    x["advantages"] = x["advantages"].float()
    x["inference_logprobs"] = x["inference_logprobs"].float()
    if pad:
        for k, v in x.items():
            x[k] = torch.cat([v, torch.arange(pad) if k == "position_ids" else v.new_zeros(pad)])
    x["full_position_ids"] = x["position_ids"]
    if d.cp > 1:
        from prl.trainer.context_parallel import split_for_cp

        x = {k: v if k == "full_position_ids" else split_for_cp(v, d.cp, d.cp_rank) for k, v in x.items()}
    return {k: v.to(d.device) for k, v in x.items()}


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


def forward(model, x: dict[str, torch.Tensor], aux_coef: float):
    """The model on one prepared micro-batch; with the router's logits when its aux loss is on."""
    return model(
        input_ids=x["input_ids"][None],
        position_ids=x["position_ids"][None],
        use_cache=False,
        **({"output_router_logits": True} if aux_coef > 0 else {}),
    )


def add_router_aux(loss: torch.Tensor, stats: dict[str, float], out, aux_coef: float, aux_weight: float
                   ) -> torch.Tensor:
    """`loss` plus the MoE load-balancing loss of this micro-batch's routing (`training.router_aux_loss_coef`),
    weighted by the micro-batch's share of the step's tokens; a dense model has none (unchanged)."""
    if aux_coef > 0 and getattr(out, "aux_loss", None) is not None:
        loss = loss + aux_coef * aux_weight * out.aux_loss
        stats["router_aux_loss_sum"] = float(out.aux_loss.detach()) * aux_weight
    return loss


def micro_batch_loss(model, x: dict[str, torch.Tensor], cfg: TrainerConfig, n_loss_tokens: int, aux_weight: float):
    """Loss share and stats of this rank's positions of one micro-batch (see `prepare`)."""
    out = forward(model, x, cfg.router_aux_loss_coef)
    logp, entropy = token_logprobs_and_entropy(out.logits[0], x["targets"])
    loss, stats = policy_loss(
        logp, x["inference_logprobs"], x["advantages"], x["loss_mask"], cfg.loss, n_loss_tokens, entropy=entropy
    )
    stats |= mismatch_stats(logp, x["inference_logprobs"], x["loss_mask"])
    return add_router_aux(loss, stats, out, cfg.router_aux_loss_coef, aux_weight), stats


def accumulate_step(model, optim, micro_batches: list[MicroBatch | None], cfg: TrainerConfig, d: Dist,
                    micro_loss) -> tuple[dict[str, float], float]:
    """One optimizer step over this rank's micro-batches, whatever the loss (RL's or SFT's).

    `micro_loss(model, x, n_loss_tokens, token_weight)` returns one prepared micro-batch's share of the
    step's token-mean loss and its statistics (sums). Returns the statistics summed over micro-batches
    and ranks, and the gradient norm before clipping.
    """
    from prl.trainer.context_parallel import ulysses_context

    xs = [prepare(mb, d) for mb in micro_batches]
    counts = all_reduce_stats(
        {"n": float(sum(float(x["loss_mask"].sum()) for x in xs)), "t": float(sum(int(x["real"].sum()) for x in xs))},
        d.device,
    )
    n_total, t_total = int(counts["n"]), max(counts["t"], 1.0)
    parts = []
    for x in xs:
        ctx = ulysses_context(d.cp_group, d.cp, x["full_position_ids"]) if d.cp > 1 else contextlib.nullcontext()
        with ctx:
            loss, stats = micro_loss(model, x, n_total, float(x["real"].sum()) / t_total)
            # Gradients are summed over ranks (divide factor 1): each loss is already its share of the mean.
            loss.backward()
        parts.append(stats | {"tokens": float(x["real"].sum())})
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    grad_norm = clip_grad_norm(model, max_norm, d)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return all_reduce_stats(merge_stats(parts), d.device), float(grad_norm)


def train_step(model, optim, micro_batches: list[MicroBatch | None], cfg: TrainerConfig, d: Dist) -> dict:
    """One RL optimizer step over this rank's micro-batches; returns globally reduced metrics."""
    s, grad_norm = accumulate_step(model, optim, micro_batches, cfg, d,
                                   lambda model, x, n, w: micro_batch_loss(model, x, cfg, n, w))
    n = max(s.get("loss_tokens", 0.0), 1.0)
    has = bool(s.get("loss_tokens"))
    return {
        "loss": s.get("loss_sum", 0.0) / n,
        "entropy": s.get("entropy_sum", 0.0) / n,
        "kl": s.get("kl_sum", 0.0) / n,
        "ratio_mean": s.get("ratio_sum", 0.0) / n,
        "ratio_min": s.get("ratio_min", 1.0) if has else None,
        "ratio_max": s.get("ratio_max", 1.0) if has else None,
        "mismatch_ratio_mean": s.get("mismatch_ratio_sum", 0.0) / n if has else None,
        "mismatch_ratio_min": s.get("mismatch_ratio_min") if has else None,
        "mismatch_ratio_max": s.get("mismatch_ratio_max") if has else None,
        "mismatch_kl": s.get("mismatch_kl_sum", 0.0) / n if has else None,
        **({"router_aux_loss": s["router_aux_loss_sum"]} if "router_aux_loss_sum" in s else {}),
        "masked_fraction": s.get("masked_tokens", 0.0) / n,
        "grad_norm": float(grad_norm),
        "tokens": int(s.get("tokens", 0)),
        "loss_tokens": int(s.get("loss_tokens", 0)),
    }


def start_training(run: RunDir, cfg: TrainerConfig, resume: str
                   ) -> tuple[Dist, torch.nn.Module, torch.optim.Optimizer, int]:
    """Collective, shared by RL and SFT: ranks, model, optimizer, and the step to resume from.

    Rank 0 claims the role (its state file), loads the checkpoint to resume from (`resume`: latest,
    none or a step) and drops every weights step, checkpoint and metrics record after it: they were
    made by an attempt that is being replaced. Returns (dist, model, optimizer, last finished step).
    """
    d = init_distributed(cfg)
    torch.manual_seed(cfg.seed)
    if d.is_main:
        run.claim(ROLE)
    model, grown = load_model(cfg, d)
    load_rss = all_reduce_stats({"load_rss_growth_mb_max": grown}, d.device)["load_rss_growth_mb_max"]
    log(d, f"model loaded from {cfg.model_path}: loading raised peak RSS by {load_rss:.1f} MiB (max over ranks)")
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    start = resolve_resume(run, resume) if d.is_main else 0
    start = int(_broadcast_int(start))
    if start > 0:
        load_checkpoint(run, start, model, optim, d, cfg.seed)
    if d.is_main:
        # Steps after the resume point were made by an attempt that is being replaced: drop them.
        run.remove_steps_after("weights", start)
        run.remove_steps_after("checkpoints", start)
        run.drop_metrics_after(ROLE, start)
        # The orchestrator's weight watcher waits for this: until now a published step may be the replaced attempt's.
        run.write_state(ROLE, weights_attempt=current_attempt())
    dist.barrier()
    log(d, f"world {d.world_size} (dp {d.dp_size}, cp {d.cp}, ep {d.ep}) on {d.device}; "
           f"steps {start + 1}..{cfg.max_steps}")
    return d, model, optim, start


def run_trainer(run: RunDir, cfg: TrainerConfig, resume: str = "latest") -> int:
    d, model, optim, start = start_training(run, cfg, resume)
    publish_dtype = getattr(torch, cfg.model_dtype)
    vocab_size = model.get_input_embeddings().num_embeddings
    beat = heartbeat_of(run, d)
    stop = StopFlag.install()
    saved = start if start > 0 else None
    for step in range(start + 1, cfg.max_steps + 1):
        t0 = time.monotonic()
        step_dir = wait_rollouts(run, step, cfg, stop, heartbeat=lambda: beat(step=step, phase="waiting_for_rollouts"))
        if stop.agreed(step_dir is None, d):
            # SIGTERM (the job is stopping): keep what the last finished step did, then leave.
            if step - 1 > start and saved != step - 1:
                log(d, f"stopping: checkpoint of step {step - 1} before exiting")
                save_checkpoint(run, step - 1, model, optim, d, cfg.seed)
            return 128 + signal.SIGTERM
        t_start = time.monotonic()
        batch = read_batch(step_dir)
        if batch.num_tokens and int(batch.arrays["input_ids"].max()) >= vocab_size:
            raise BatchError(
                f"{step_dir}: token id {int(batch.arrays['input_ids'].max())} >= the model's "
                f"vocab_size {vocab_size}; were the rollouts made with another tokenizer?"
            )
        micro_batches = batch.micro_batches(d.dp_rank, d.dp_size, cfg.micro_batch_tokens)
        t1 = time.monotonic()

        metrics = train_step(model, optim, micro_batches, cfg, d)
        t2 = time.monotonic()

        publish_weights(run, step, model, cfg.model_path, publish_dtype, d)
        t3 = time.monotonic()

        if cfg.checkpoint_interval > 0 and (step % cfg.checkpoint_interval == 0 or step == cfg.max_steps):
            save_checkpoint(run, step, model, optim, d, cfg.seed)
            saved = step
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
                "peak_rss_mb": peak_rss_mb(),
                "max_policy_lag": int(step - versions.min()) if versions.size else 0,
            }
            run.append_metrics(record)
            log(
                d,
                f"step {step} loss {metrics['loss']:.6f} grad_norm {metrics['grad_norm']:.4f} "
                f"tok/s {record['tokens_per_s']:.0f} wait {record['wait_s']:.2f}s",
            )
        # step_s: this step's longest stretch without a heartbeat; the launcher's hang bound grows with it.
        beat(step=step, phase="trained", step_s=round(time.monotonic() - t_start, 3))
    dist.barrier()
    return 0


def heartbeat_of(run: RunDir, d: Dist):
    """This rank's heartbeat: rank 0 writes the role's state; every other rank its own beat file, so a rank
    stopped while rank 0 still waits for rollouts is seen within the hang bound, not once rank 0 blocks on it."""
    if d.is_main:
        return lambda **fields: run.heartbeat(ROLE, **fields)
    return lambda **fields: run.rank_heartbeat(ROLE, d.rank, **fields)


class StopFlag:
    """SIGTERM to a rank (torchrun passes the job's stop on) sets it; ranks agree on it between steps."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @classmethod
    def install(cls) -> StopFlag:
        flag = cls()

        def on_term(signum: int, _frame) -> None:
            flag.signum = signum

        signal.signal(signal.SIGTERM, on_term)
        return flag

    def agreed(self, local: bool, d: Dist) -> bool:
        """Collective: True on every rank when any rank was asked to stop (or gave up waiting because of it)."""
        wants = float(local or self.signum is not None)
        return all_reduce_stats({"stop": wants}, d.device)["stop"] > 0


def wait_rollouts(run: RunDir, step: int, cfg: TrainerConfig, stop: StopFlag, heartbeat) -> Path | None:
    """rollouts/step_N once published (heartbeating every 10 s meanwhile); None when SIGTERM came first."""
    deadline = time.monotonic() + cfg.rollout_timeout_s
    next_beat = 0.0
    while stop.signum is None:
        now = time.monotonic()
        if now >= next_beat:
            heartbeat()
            next_beat = now + 10.0
        try:
            return run.wait_for_step("rollouts", step, min(1.0, max(0.0, deadline - now)))
        except StepTimeout:
            if time.monotonic() >= deadline:
                raise StepTimeout(
                    f"waited {cfg.rollout_timeout_s:.0f} s for rollouts/step_{step} in {run.root}; latest "
                    f"published rollouts step is {run.latest_stable('rollouts')}. Is the orchestrator running? "
                    f"See `prl status`.") from None
    return None


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
        cfg = TrainerConfig.from_plan(Plan.read(run))
        if cfg.sft is not None:
            from prl.trainer.sft import run_sft

            code = run_sft(run, cfg, resume)
        else:
            code = run_trainer(run, cfg, resume)
        return code
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        state = run.read_state(ROLE) if run.state_dir.exists() else None
        if state and state.pid == os.getpid():  # only the holder of the role records its exit
            run.mark_exit(ROLE, code if error is None else 1, error)
        if dist.is_initialized():
            dist.destroy_process_group()
