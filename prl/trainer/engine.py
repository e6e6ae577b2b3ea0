"""The training engine: one FSDP2 step loop that every kind of training runs, the kind plugged in as a `Spec`.

    start: ranks, seed, rank 0 claims the role, model (meta -> EP/Ulysses -> spec.transform_model -> FSDP2
           -> this rank's shards), AdamW over spec.parameters, resume (and drop a replaced attempt's later steps)
    spec.setup
    for step in start+1..spec.last_step():
        ready = spec.wait(step)            RL: rollouts/step_N, heartbeating; None when SIGTERM came first
        ranks agree to stop?               -> the last finished step gets its weights and a checkpoint; exit 143
        data = spec.load(step, ready)      this rank's micro-batches
        forward/backward each micro-batch (spec.inputs, spec.micro_loss), clip, optimizer step; spec.summarize
        spec.publishes(step)   -> spec.publish (weights/step_N); with a transport that sends from memory
                                  (prl/weights), only checkpoint steps and the last step go to disk
        a background checkpoint whose write finished gets STABLE (`settle`)
        spec.checkpoints(step) -> save_checkpoint; with `training.checkpoint_async` begun in the background
                                  (the previous one finished first; the last step's is written at once)
        rank 0: spec.cleanup, the metrics record (the engine's fields + spec.record), one log line
        heartbeat with the step's busy time (the launcher's hang bound follows it)

RL (prl/trainer/rl.py) and SFT (prl/trainer/sft.py) are specs; prl/trainer/train.py picks one from the plan.
The engine imports neither. torchtitan's `TrainSpec` is the anchor: the loop is fixed, the variant is data.

## The seam

A spec subclasses `Spec` and gets the `TrainerConfig` in its constructor. Hooks, in the order the engine
calls them, with the variant each one is for:

- `transform_model(model, d)`: the meta-device model after EP/Ulysses, before FSDP2 shards it. The default
  adds `model.lora`'s adapters to the target layers (prl/trainer/lora.py; parameters a transform adds are not
  in the safetensors: their module's `fresh_parameters` gives the loader their initial values) and freezes
  the rest.
- `parameters(model)`: what the optimizer steps (default: all; with `model.lora` the adapters only).
- `setup(eng)`: once the model is loaded and resumed (SFT reads its conversations and tokenizer here).
- `last_step()`: the run's last step (RL: `training.max_steps`; SFT: fewer when `sft.epochs` end first).
- `wait(eng, step)` / `load(eng, step, ready)`: what a step trains on, as `StepData` (this rank's
  micro-batches; `source` is the spec's own, for its record). `wait` may block (heartbeating with
  `eng.beat`) and returns None when `eng.stop` was set meanwhile.
- `inputs(mb, d)`: the tensors of one micro-batch (default `micro_batch_inputs`: this rank's positions,
  labels shifted). Distillation passes more label-side arrays
  (`micro_batch_inputs(mb, d, labels=LABELS + ("teacher_logprobs",))`, shifted and cp-split like the others); a VLM adds its per-micro-batch pixel tensors to the dict.
- `micro_loss(model, x, n_loss_tokens, aux_weight)`: the spec owns the forward (`forward_logprobs`: the
  targets' logprobs and entropy without the [T, V] logits; `forward` for the logits; or its own call with extra
  inputs, passing the packed row's `attention.boundary_kwargs`) and the loss: one micro-batch's share of the step's token-mean loss and its
  statistics (sums). A loss by import path is a spec whose `micro_loss` calls the imported function.
- `summarize(stats, grad_norm)`: the step's metrics from the statistics summed over micro-batches and ranks.
- `publishes(step, last)` / `publish(eng, step)`: when and what to publish (default: the full model as an
  HF directory, weights/step_N; with `model.lora` the adapter alone, in PEFT's layout).
- `checkpoints(step, last)`, `cleanup(eng, step)` (rank 0): checkpoint cadence and what old steps go.
- `record(step, data, data_s)`, `progress(record)`: extra metrics-record fields and log-line text.

On SIGTERM the engine gives the last finished step its published weights and a checkpoint, unless it has
them, whatever the spec: a requeued attempt resumes there. A background checkpoint still being written is
waited for first (published once done); a kill meanwhile leaves it without STABLE.

The weight transport (`weights.transport`, prl/weights) decides how a step reaches the servers. One that sends
from memory gives every rank a `Sender` from `start`; a step that is not a checkpoint step nor the last one is
gathered as a sharded publish would gather it (`shares`) and each rank hands its share to its sender instead
of a file. Disk stays the durable record: checkpoint steps, the last step and a SIGTERM's step are published
to weights/step_N.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from prl.errors import ConfigError, signal_exit
from prl.log import get_logger
from prl import weights
from prl.run.batch import MicroBatch
from prl.run.rundir import RunDir, current_attempt
from prl.states import Role
from prl.trainer.checkpoint import AsyncCheckpointer, load_checkpoint, resolve_resume, save_checkpoint
from prl.trainer.config import TrainerConfig
from prl.trainer.attention import boundary_kwargs
from prl.trainer.float8 import after_optimizer_step, gathers_float8
from prl.trainer.logprobs import logprob_head, supports_chunked_head
from prl.trainer.lora import adapter_parameters, attach, publish_adapter
from prl.trainer.loss import merge_stats, token_logprobs_and_entropy
from prl.trainer.parallel import Dist, all_reduce_stats, apply_fsdp, clip_grad_norm, init_distributed
from prl.trainer.replay import set_routes
from prl.trainer.vision import PIXEL_PREFIXES, SAMPLED_IMAGE_TOKEN, Pictures, set_picture_span
from prl.trainer.weights import publish_weights, shares
from prl.weights.fp8 import blocks_of

ROLE = Role.TRAINER
LABELS = ("loss_mask", "advantages", "inference_logprobs")
"""The micro-batch arrays `micro_batch_inputs` moves to the label side (position p carries token p+1's)."""

log = get_logger(__name__)


@dataclass
class StepData:
    """What one step trains on: this rank's micro-batches (None: a padding pass) and the spec's own source."""

    micro_batches: list[MicroBatch | None]
    source: Any = None
    """What the spec loaded them from (RL: the `RolloutBatch`), for its `record`."""


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


@dataclass
class Engine:
    """One rank's training state, whole when `start` returns; the loop moves `saved` and `published` on."""

    run: RunDir
    cfg: TrainerConfig
    d: Dist
    model: torch.nn.Module
    optim: torch.optim.Optimizer
    start: int
    """The last finished step when this attempt began (0: from the model itself)."""
    beat: Callable[..., None]
    """This rank's heartbeat (`heartbeat_of`)."""
    stop: StopFlag
    saved: int | None
    """The newest step with a published (STABLE) checkpoint."""
    published: int | None
    """The newest step with weights published to disk (a SIGTERM publishes the last finished step unless it is)."""
    sender: weights.Sender | None = None
    """This rank's side of a transport that sends steps from memory (None: every step goes to disk)."""
    checkpointer: AsyncCheckpointer | None = None
    """Writes checkpoints in the background (`training.checkpoint_async`; None: every rank waits for the write)."""


class Spec(ABC):
    """What varies between kinds of training; the engine's loop calls these hooks (see the module doc)."""

    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.pictures: Pictures | None = None
        """A vision-language model's image processor (None: a text model); the engine sets it before `setup`."""

    def transform_model(self, model: torch.nn.Module, d: Dist) -> torch.nn.Module:
        """The meta-device model before FSDP2 shards it; default: with `model.lora`, adapters on the target
        layers and the rest frozen (prl/trainer/lora.py), else unchanged."""
        if self.cfg.lora is not None:
            attach(model, self.cfg.lora, self.cfg.training.seed)
        return model

    def parameters(self, model: torch.nn.Module) -> Iterable[torch.nn.Parameter]:
        """The parameters the optimizer steps; default all that train (with `model.lora`: the adapters; a VLM's
        frozen image encoder is left out)."""
        if self.cfg.lora is not None:
            return adapter_parameters(model)
        return [p for p in model.parameters() if p.requires_grad]

    def setup(self, eng: Engine) -> None:
        """Once the model is loaded and resumed: read what the steps need."""

    @abstractmethod
    def last_step(self) -> int:
        """The run's last step."""

    @abstractmethod
    def wait(self, eng: Engine, step: int) -> Any | None:
        """Until step `step`'s data can be read (heartbeating while it blocks); None when `eng.stop` came first."""

    @abstractmethod
    def load(self, eng: Engine, step: int, ready: Any) -> StepData:
        """This rank's micro-batches of step `step` (`ready` is what `wait` returned)."""

    def inputs(self, mb: MicroBatch | None, d: Dist) -> dict[str, torch.Tensor]:
        """The tensors of one micro-batch on this rank (add per-micro-batch inputs here); default
        `micro_batch_inputs`, with a VLM's pixels (`picture_inputs`)."""
        return picture_inputs(self.pictures, mb, d)

    @abstractmethod
    def micro_loss(self, model: torch.nn.Module, x: dict[str, torch.Tensor], n_loss_tokens: int,
                   aux_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's share of the step's token-mean loss and its statistics (sums, see `merge_stats`)."""

    @abstractmethod
    def summarize(self, stats: dict[str, float], grad_norm: float) -> dict:
        """The step's metrics from its statistics (summed over micro-batches and ranks) and gradient norm."""

    @abstractmethod
    def publishes(self, step: int, last: int) -> bool:
        """Whether step `step` publishes weights."""

    def publish(self, eng: Engine, step: int) -> None:
        """Collective: publish weights/step_N; default the whole model as a Hugging Face directory (with
        `model.lora`: the adapter alone, in PEFT's layout)."""
        dtype = getattr(torch, eng.cfg.model_dtype)
        if eng.cfg.lora is not None:
            publish_adapter(eng.run, step, eng.model, eng.cfg.lora, eng.cfg.model_path, dtype, eng.d.is_main)
        else:
            publish_weights(eng.run, step, eng.model, eng.cfg.model_path, dtype, eng.d)

    @abstractmethod
    def checkpoints(self, step: int, last: int) -> bool:
        """Whether step `step` saves a checkpoint."""

    @abstractmethod
    def cleanup(self, eng: Engine, step: int) -> None:
        """Rank 0, after step `step`: remove the run directory's steps nobody needs any more."""

    def record(self, step: int, data: StepData, data_s: float) -> dict:
        """This spec's fields of the step's metrics record (`data_s`: the seconds `wait` and `load` took)."""
        return {"data_s": data_s}

    def progress(self, record: dict) -> str:
        """Text appended to the step's log line."""
        return ""


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


def load_model(cfg: TrainerConfig, d: Dist, transform: Callable[[torch.nn.Module, Dist], torch.nn.Module]
               = lambda model, d: model) -> tuple[torch.nn.Module, float]:
    """Meta-device model -> EP experts / Ulysses attention -> `transform` -> FSDP2 -> this rank's shards.

    No rank reads the whole checkpoint (prl/trainer/loading.py); fp32 master weights. Returns the
    model and how far loading raised this rank's peak RSS above its RSS before (MiB).
    """
    from prl.trainer.attention import install_packed
    from prl.trainer.context_parallel import install_ulysses
    from prl.trainer.loading import build_meta_model, load_model as load_shards_into
    from prl.trainer.moe import install_expert_parallel
    from prl.trainer.replay import install as install_router_replay
    from prl.trainer.vision import freeze_encoder, install as install_pictures, install_cp as install_picture_cp, is_vlm

    model = build_meta_model(cfg.model_path)
    freeze_encoder(model, cfg.train_vision)
    install_pictures(model)
    if d.ep > 1:
        install_expert_parallel(model, d.ep, d.ep_rank, d.ep_group)
    if cfg.training.router_replay:
        install_router_replay(model)
    if d.cp > 1:
        install_ulysses(model, d.cp, d.cp_group)
        if is_vlm(model.config):
            install_picture_cp(model)
    else:
        install_packed(model)
    model = transform(model, d)
    apply_fsdp(model, cfg, d)
    before = current_rss_mb()
    load_shards_into(model, cfg.model_path, d.device)
    return model, peak_rss_mb() - before


def micro_batch_inputs(mb: MicroBatch | None, d: Dist, labels: tuple[str, ...] = LABELS, counted: int | None = None
            ) -> dict[str, torch.Tensor]:
    """This rank's positions of one micro-batch, labels shifted on the whole sequence first.

    Position p carries its input token and, as its label side, token p+1 (`targets`) with that token's
    `labels` arrays (loss mask, advantage and sampling logprob; the last position, and a sample's first
    token, have no loss). The sequence is padded to a multiple of cp with masked positions (a separate
    pseudo-sample), then cp rank c keeps the c-th consecutive chunk. None (a padding pass: every rank
    runs the same number of passes) becomes two masked tokens per cp rank. Positions from `counted` on (a blank
    picture's sample appended to the row) are not counted in the step's tokens.
    """
    if mb is None:
        zero = np.zeros(2 * d.cp)
        arrays = {"input_ids": np.zeros(2 * d.cp, dtype=np.int64), "position_ids": np.arange(2 * d.cp),
                  **{k: zero for k in labels}}
    else:
        arrays = {k: getattr(mb, k) for k in ("input_ids", "position_ids", *labels)}
    tensors = {k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()}
    n = tensors["input_ids"].shape[0]

    def shifted(v: torch.Tensor) -> torch.Tensor:
        return torch.cat([v[1:], v.new_zeros(1)])

    x = {
        "input_ids": tensors["input_ids"].long(),
        "position_ids": tensors["position_ids"].long(),
        "real": torch.arange(n) < (0 if mb is None else n if counted is None else counted),  # in the step's tokens
        "targets": shifted(tensors["input_ids"]).long(),
        **{k: shifted(tensors[k]).float() for k in labels},
    }
    if mb is not None and mb.routed_experts is not None:
        # Input side, not shifted: position p is routed as the server routed token p.
        x["routed_experts"] = torch.from_numpy(np.asarray(mb.routed_experts).astype(np.int64))
        x["routed_mask"] = torch.from_numpy(np.asarray(mb.routed_mask).astype(bool))
    pad = (-n) % d.cp
    if pad:
        x["position_ids"] = torch.cat([x["position_ids"], torch.arange(pad)])
    x["full_position_ids"] = x["position_ids"]
    x = {k: v if k in ("position_ids", "full_position_ids") else on_this_rank(v, d) for k, v in x.items()}
    x["position_ids"] = on_this_rank(x["position_ids"], d)
    return {k: v.to(d.device) for k, v in x.items()}


def on_this_rank(v: torch.Tensor, d: Dist) -> torch.Tensor:
    """This cp rank's positions of a whole row's array: padded with zeros to a multiple of cp, then its c-th
    consecutive chunk (the whole array without cp)."""
    pad = (-v.shape[0]) % d.cp
    if pad:
        v = torch.cat([v, v.new_zeros((pad, *v.shape[1:]))])
    if d.cp == 1:
        return v
    from prl.trainer.context_parallel import split_for_cp

    return split_for_cp(v, d.cp, d.cp_rank)


def picture_inputs(pictures: Pictures | None, mb: MicroBatch | None, d: Dist, labels: tuple[str, ...] = LABELS
                   ) -> dict[str, torch.Tensor]:
    """`micro_batch_inputs`, and for a vision-language model (`pictures`) the row's pixel inputs too (a blank picture's
    sample appended where the encoder trains and the row has none; prl/trainer/vision.py), its tokens not
    counted."""
    if pictures is None:
        return micro_batch_inputs(mb, d, labels)
    where = "a padding pass" if mb is None else f"the micro-batch of samples {mb.sample_ids}"
    if mb is not None:
        pictures.check(mb, where)
    row = pictures.with_encoder_pass(mb, labels)
    x = micro_batch_inputs(row, d, labels, counted=0 if mb is None else mb.num_tokens)
    if row is not None:
        sampled = on_this_rank(torch.from_numpy(pictures.sampled(row)), d).to(d.device)
        x["input_ids"][sampled] = SAMPLED_IMAGE_TOKEN
    if d.cp > 1 and row is not None and row.images:
        x["picture_span"] = pictures.picture_span(row, d.cp, d.cp_rank)
    pixels = pictures.inputs(row.images, where) if row is not None else {}
    return x | {k: v.to(d.device) for k, v in pixels.items()}


def forward(model, x: dict[str, torch.Tensor], aux_coef: float):
    """The model on one prepared micro-batch; with the router's logits when its aux loss is on.

    The packed row's sample boundaries (of the full row: with cp, every rank's attention sees all of it after
    the all-to-all) go to attention as transformers' packed-sequence kwargs (prl/trainer/attention.py). With
    router replay the row's server routes are set first (prl/trainer/replay.py; none: the routers' own).
    """
    set_routes(model, x.get("routed_experts"), x.get("routed_mask"))
    set_picture_span(model, x.get("picture_span"))
    return model(
        input_ids=x["input_ids"][None],
        position_ids=x["position_ids"][None],
        use_cache=False,
        **boundary_kwargs(x["full_position_ids"]),
        **{k: v for k, v in x.items() if k.startswith(PIXEL_PREFIXES)},
        **({"output_router_logits": True} if aux_coef > 0 else {}),
    )


def forward_logprobs(model, x: dict[str, torch.Tensor], aux_coef: float, fused: bool = False,
                     temperature: float = 1.0):
    """`forward`, then the targets' logprobs and the entropy [T] in fp32 of the logits / `temperature` (the
    distribution the rollouts were sampled from), without the [T, V] logits where the model allows
    (prl/trainer/logprobs.py; `fused`: its per-chunk arithmetic compiled, with `trainer.compile`); returns
    (model output, logp, entropy)."""
    if not supports_chunked_head(model):
        out = forward(model, x, aux_coef)
        logits = out.logits[0] if temperature == 1.0 else out.logits[0] / temperature
        return (out, *token_logprobs_and_entropy(logits, x["targets"]))
    with logprob_head(model, x["targets"], fused, temperature):
        out = forward(model, x, aux_coef)
    return out, out.logits[0, :, 0], out.logits[0, :, 1]


def add_router_aux(loss: torch.Tensor, stats: dict[str, float], out, aux_coef: float, aux_weight: float
                   ) -> torch.Tensor:
    """`loss` plus the MoE load-balancing loss of this micro-batch's routing (`training.router_aux_loss_coef`),
    weighted by the micro-batch's share of the step's tokens; a dense model has none (unchanged)."""
    if aux_coef > 0 and getattr(out, "aux_loss", None) is not None:
        loss = loss + aux_coef * aux_weight * out.aux_loss
        stats["router_aux_loss_sum"] = float(out.aux_loss.detach()) * aux_weight
    return loss


def accumulate_step(model, optim, micro_batches: list[MicroBatch | None], spec: Spec, cfg: TrainerConfig,
                    d: Dist) -> tuple[dict[str, float], float]:
    """One optimizer step over this rank's micro-batches, with the spec's inputs and loss.

    Returns the statistics summed over micro-batches and ranks, and the gradient norm before clipping.
    """
    xs = [spec.inputs(mb, d) for mb in micro_batches]
    counts = all_reduce_stats(
        {"n": float(sum(float(x["loss_mask"].sum()) for x in xs)), "t": float(sum(int(x["real"].sum()) for x in xs))},
        d.device,
    )
    n_total, t_total = int(counts["n"]), max(counts["t"], 1.0)
    parts = []
    for x in xs:
        loss, stats = spec.micro_loss(model, x, n_total, float(x["real"].sum()) / t_total)
        # Gradients are summed over ranks (divide factor 1): each loss is already its share of the mean.
        loss.backward()
        parts.append(stats | {"tokens": float(x["real"].sum())})
    set_routes(model, None, None)  # no later forward (a check, an eval) replays this step's last routes
    max_norm = cfg.training.max_grad_norm if cfg.training.max_grad_norm > 0 else float("inf")
    grad_norm = clip_grad_norm(model, max_norm, d)
    optim.step()
    optim.zero_grad(set_to_none=True)
    if cfg.precision == "fp8" and gathers_float8(d.mesh):
        after_optimizer_step(model)
    return all_reduce_stats(merge_stats(parts), d.device), float(grad_norm)


def train_step(model, optim, micro_batches: list[MicroBatch | None], spec: Spec, cfg: TrainerConfig,
               d: Dist) -> dict:
    """One optimizer step over this rank's micro-batches; the spec's metrics of it, reduced over ranks."""
    stats, grad_norm = accumulate_step(model, optim, micro_batches, spec, cfg, d)
    return spec.summarize(stats, grad_norm)


def heartbeat_of(run: RunDir, d: Dist) -> Callable[..., None]:
    """This rank's heartbeat: rank 0 writes the role's state; every other rank its own beat file, so a rank
    stopped while rank 0 still waits for rollouts is seen within the hang bound, not once rank 0 blocks on it."""
    if d.is_main:
        return lambda **fields: run.heartbeat(ROLE, **fields)
    return lambda **fields: run.rank_heartbeat(ROLE, d.rank, **fields)


def _broadcast_int(value: int) -> int:
    t = torch.tensor([value], dtype=torch.long)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.broadcast(t, src=0)
    return int(t.item())


def resume(run: RunDir, cfg: TrainerConfig, d: Dist, model, optim, resume_from: str) -> int:
    """Collective: load the checkpoint to resume from (`resume_from`: latest, none or a step); returns its step.

    Rank 0 then drops every weights step, checkpoint and metrics record after it: they were made by an
    attempt that is being replaced.
    """
    start = int(_broadcast_int(resolve_resume(run, resume_from) if d.is_main else 0))
    if start > 0:
        load_checkpoint(run, start, model, optim, d, cfg.training.seed)
    if d.is_main:
        run.remove_steps_after("weights", start)
        run.remove_steps_after("checkpoints", start)
        run.drop_metrics_after(ROLE, start)
        # The orchestrator's weight watcher waits for this: until now a published step may be the replaced attempt's.
        run.write_state(ROLE, weights_attempt=current_attempt())
    dist.barrier()
    return start


def start(run: RunDir, cfg: TrainerConfig, spec: Spec, resume_from: str) -> Engine:
    """Collective: ranks, seed, the role claimed by rank 0, the model, the optimizer, the step to resume from."""
    d = init_distributed(cfg)
    torch.manual_seed(cfg.training.seed)
    if d.is_main:
        run.claim(ROLE)
    model, grown = load_model(cfg, d, spec.transform_model)
    load_rss = all_reduce_stats({"load_rss_growth_mb_max": grown}, d.device)["load_rss_growth_mb_max"]
    if d.is_main:
        log.info("model loaded from %s: loading raised peak RSS by %.1f MiB (max over ranks)", cfg.model_path, load_rss)
    optim = torch.optim.AdamW(spec.parameters(model), lr=cfg.training.lr, weight_decay=cfg.training.weight_decay)
    transport = weights.get(cfg.weights.transport)
    if d.is_main:
        transport.forget(run)  # what a replaced attempt held in memory is gone; before `resume` trusts the weights
    step = resume(run, cfg, d, model, optim, resume_from)
    if d.is_main:
        log.info("world %d (dp %d, cp %d, ep %d) on %s; steps %d..%d", d.world_size, d.dp_size, d.cp, d.ep, d.device,
                 step + 1, cfg.training.max_steps)
    done = step if step > 0 else None
    return Engine(run, cfg, d, model, optim, step, heartbeat_of(run, d), StopFlag.install(), saved=done,
                  published=done, sender=start_sender(run, cfg, transport, spec),
                  checkpointer=AsyncCheckpointer() if cfg.training.checkpoint_async else None)


def start_sender(run: RunDir, cfg: TrainerConfig, transport: weights.Transport, spec: Spec) -> weights.Sender | None:
    """Collective: this rank's sender of the run's transport (None: every step goes to disk)."""
    if transport.feeds and (type(spec).publish is not Spec.publish or cfg.lora is not None):
        raise ConfigError(f"weights.transport {transport.name} sends whole models; {type(spec).__name__} publishes "
                          f"weights of its own: use weights.transport: filesystem")
    config = json.loads((Path(cfg.model_path) / "config.json").read_text()) if transport.feeds else None
    return transport.sender(run, cfg.weights, cfg.node_address, cfg.weight_ports, config, cfg.weight_backend)


def publish(eng: Engine, spec: Spec, step: int, durable: bool = True) -> None:
    """Collective: step `step`'s weights to disk (`durable`, or without a sender), else to the ranks' senders."""
    if eng.sender is None or durable:
        spec.publish(eng, step)
        eng.published = step
        return
    tensors, writers = shares(eng.model, getattr(torch, eng.cfg.model_dtype), eng.d, blocks_of(eng.cfg.model_path))
    eng.sender.send(step, tensors, writers)


def checkpoint(eng: Engine, step: int, background: bool = False) -> dict:
    """Collective: step `step`'s checkpoint; with a checkpointer and `background`, begun (the previous one
    finished first) and written while training goes on, else written before this returns. Returns the
    record's fields of it."""
    t0 = time.monotonic()
    if eng.checkpointer is not None and background:
        finished, snapshot = eng.checkpointer.start(eng.run, step, eng.model, eng.optim, eng.d, eng.cfg.training.seed)
        eng.saved = finished or eng.saved
        return {"checkpoint_s": time.monotonic() - t0, "checkpoint_snapshot_mb": snapshot / 2**20}
    settle(eng, wait=True)
    save_checkpoint(eng.run, step, eng.model, eng.optim, eng.d, eng.cfg.training.seed)
    eng.saved = step
    return {"checkpoint_s": time.monotonic() - t0}


def settle(eng: Engine, wait: bool = False) -> None:
    """Collective: publish a background checkpoint whose write is done (`wait`: wait for it first)."""
    if eng.checkpointer is not None:
        eng.saved = eng.checkpointer.settle(eng.run, eng.d, eng.cfg.training.seed, wait=wait) or eng.saved


def stop_after(eng: Engine, spec: Spec, step: int) -> int:
    """SIGTERM (the job is stopping): keep what finished step `step` did (weights and checkpoint), then leave.
    A checkpoint being written is waited for first: a kill meanwhile leaves it unmarked, never taken for one."""
    settle(eng, wait=True)
    if step > eng.start and (eng.published, eng.saved) != (step, step):
        if eng.d.is_main:
            log.info("stopping: checkpoint of step %d before exiting", step)
        if eng.published != step:
            publish(eng, spec, step)
        if eng.saved != step:
            checkpoint(eng, step)
    return signal_exit(signal.SIGTERM)


def record_step(eng: Engine, spec: Spec, step: int, data: StepData, metrics: dict,
                times: tuple[float, float, float, float]) -> None:
    """Rank 0: append the step's metrics record and log its line (`times`: step start, data, trained, published;
    `metrics` with the checkpoint's fields on a checkpoint step)."""
    t0, t1, t2, t3 = times
    record = {
        "role": ROLE, "step": step, "time": time.time(), **metrics,
        "tokens_per_s": metrics["tokens"] / max(t2 - t1, 1e-9),
        **spec.record(step, data, t1 - t0),
        "train_s": t2 - t1, "publish_s": t3 - t2, "step_s": time.monotonic() - t0,
        "lr": eng.cfg.training.lr, "peak_rss_mb": peak_rss_mb(),
    }
    eng.run.append_metrics(record)
    log.info("step %d loss %.6f grad_norm %.4f tok/s %.0f%s", step, metrics["loss"], metrics["grad_norm"],
             record["tokens_per_s"], spec.progress(record))


def train(run: RunDir, cfg: TrainerConfig, spec: Spec, resume_from: str = "latest") -> int:
    """Collective: train `spec` on RUN from the step `resume_from` names to its last step (module doc).

    Returns 0, or 128 + SIGTERM when the job stopped it.
    """
    eng = start(run, cfg, spec, resume_from)
    spec.pictures = Pictures.of(cfg.model_path, cfg.train_vision, cfg.mesh.cp)
    spec.setup(eng)
    last = spec.last_step()
    for step in range(eng.start + 1, last + 1):
        t0 = time.monotonic()
        ready = spec.wait(eng, step)
        if eng.stop.agreed(ready is None, eng.d):
            return stop_after(eng, spec, step - 1)
        busy = time.monotonic()
        data = spec.load(eng, step, ready)
        t1 = time.monotonic()
        metrics = train_step(eng.model, eng.optim, data.micro_batches, spec, cfg, eng.d)
        t2 = time.monotonic()
        if spec.publishes(step, last):
            publish(eng, spec, step, durable=step == last or spec.checkpoints(step, last))
        t3 = time.monotonic()
        settle(eng)
        if spec.checkpoints(step, last):
            metrics |= checkpoint(eng, step, background=step != last)
        if eng.d.is_main:
            spec.cleanup(eng, step)
            record_step(eng, spec, step, data, metrics, (t0, t1, t2, t3))
        # step_s: this step's longest stretch without a heartbeat; the launcher's hang bound grows with it.
        eng.beat(step=step, phase="trained", step_s=round(time.monotonic() - busy, 3))
    settle(eng, wait=True)
    dist.barrier()
    if eng.sender is not None:
        eng.sender.close()  # the last step went to disk: no server reads the sender any more
    return 0
