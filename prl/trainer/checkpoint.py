"""Trainer checkpoints: checkpoints/step_N/trainer/ + STABLE.

    dcp/                       model + optimizer, torch.distributed.checkpoint (sharded;
                               loads on any number of ranks: DCP reshards DTensors); trainable
                               parameters only (with `model.lora`: the adapters and their AdamW state)
    rng/rank_K.safetensors     each rank's torch CPU (and CUDA) RNG state
    trainer_state.json         step, next rollout step, world size, seed

All ranks write into one temporary directory named by rank 0, then rank 0
renames it and writes the marker (RunDir.begin_publish / finish_publish), so a
crash mid-save leaves nothing a resume would pick up. `save_checkpoint` returns
once the checkpoint is published; with `training.checkpoint_async`,
`AsyncCheckpointer` snapshots the state to CPU memory, writes it in a thread
and publishes it at a later step boundary (`settle`), once every rank's write
is done: the same files, so a resume cannot tell the two apart. A resume on the same
number of ranks restores each rank's RNG; on another number, ranks reseed
from (seed, step, rank): the trainer draws no random numbers per step today,
so losses are identical either way.

Under expert parallelism each EP rank's experts are a different tensor under the same
parameter name; they are saved under `NAME.ep{rank}of{ep}` so DCP keeps them apart, and a
resume needs the same ep degree (dense weights and the expert FSDP dims still reshard).
"""

from __future__ import annotations

import json
import shutil
import time
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from prl.errors import RunDirError
from prl.run.rundir import RunDir, is_stable
from prl.trainer.moe import ExpertParallelExperts
from prl.states import Role
from prl.trainer.parallel import Dist, all_reduce_stats


def _broadcast_str(value: str | None) -> str:
    obj = [value]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _ep_names(model: torch.nn.Module, d: Dist) -> dict[str, str]:
    """Parameter name -> checkpoint name for this rank's expert-parallel parameters."""
    out = {}
    for prefix, m in model.named_modules():
        if isinstance(m, ExpertParallelExperts):
            for leaf, _ in m.named_parameters(recurse=False):
                out[f"{prefix}.{leaf}"] = f"{prefix}.{leaf}.ep{d.ep_rank}of{d.ep}"
    return out


def _renamed(state: dict, names: dict[str, str]) -> dict:
    """Model and optimizer state dicts ({"model", "optim"}) with parameter keys mapped through `names`."""
    if not names:
        return state
    optim = state["optim"]
    groups = [{**g, "params": [names.get(p, p) for p in g["params"]]} for g in optim["param_groups"]]
    return {
        "model": {names.get(k, k): v for k, v in state["model"].items()},
        "optim": {"state": {names.get(k, k): v for k, v in optim["state"].items()}, "param_groups": groups},
    }


TRAINED = StateDictOptions(ignore_frozen_params=True)
"""Checkpoints hold what training changes: with `model.lora` the adapters (the base model is its own files)."""


def _load_trained(model: torch.nn.Module, state: dict, path: Path) -> None:
    """Set the trainable parameters from a checkpoint's; the frozen ones (a LoRA run's base model) stay as loaded.
    `strict=False` lets the frozen keys be absent: every trainable one must still be there."""
    result = set_model_state_dict(model, state, options=StateDictOptions(ignore_frozen_params=True, strict=False))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(trainable & set(result.missing_keys)) + sorted(result.unexpected_keys)
    if missing:
        raise RunDirError(f"{path} does not hold this model's trainable parameters (e.g. {missing[0]}); was it "
                          f"saved with another model.lora?")


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    # A tied lm_head is another name of the frozen embedding, which `ignore_frozen_params` keeps: drop it too.
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    trained = {k: v for k, v in get_model_state_dict(model, options=TRAINED).items() if k not in frozen}
    return {"model": trained, "optim": get_optimizer_state_dict(model, optim, options=TRAINED)}


def _begin(run: RunDir, step: int, d: Dist) -> tuple[Path, Path]:
    """Collective: step `step`'s checkpoint dir and the temporary dir every rank writes into (named by rank 0),
    with this rank's RNG state already in it."""
    from safetensors.torch import save_file

    dest = run.checkpoints(step, Role.TRAINER)
    tmp = Path(_broadcast_str(str(run.begin_publish(dest, tag=f"step{step}")) if d.is_main else None))
    (tmp / "rng").mkdir(exist_ok=True)
    save_file(_rng_tensors(), str(tmp / "rng" / f"rank_{d.rank}.safetensors"))
    return dest, tmp


def _finish(run: RunDir, step: int, dest: Path, tmp: Path, d: Dist, seed: int) -> None:
    """Rank 0, once every rank's part is in `tmp`: the progress record, then rename and STABLE."""
    progress = {
        "step": step,
        "next_rollout_step": step + 1,
        "world_size": d.world_size,
        "dp_size": d.dp_size,
        "ep": d.ep,
        "seed": seed,
        "time": time.time(),
    }
    (tmp / "trainer_state.json").write_text(json.dumps(progress, indent=2) + "\n")
    run.finish_publish(dest, tmp, step=step)


def save_checkpoint(
    run: RunDir, step: int, model: torch.nn.Module, optim: torch.optim.Optimizer, d: Dist, seed: int
) -> Path:
    """Collective: save model, optimizer, RNG and progress after `step`; returns once it is STABLE."""
    dest, tmp = _begin(run, step, d)
    dcp.save(_renamed(_state(model, optim), _ep_names(model, d)), checkpoint_id=str(tmp / "dcp"))
    dist.barrier()
    if d.is_main:
        _finish(run, step, dest, tmp, d, seed)
    dist.barrier()
    return dest


@dataclass
class _Write:
    """A checkpoint being written in the background."""

    step: int
    dest: Path
    tmp: Path
    future: Future
    """DCP's upload: done on every rank once the coordinator wrote the metadata after every rank's files (an
    error on any rank fails it on all)."""


class AsyncCheckpointer:
    """Checkpoints written in the background (`training.checkpoint_async`), at most one in flight.

    `start` snapshots this rank's state to CPU memory (DCP's default stager: a copy of each local shard,
    freed when the write ends) and returns; a thread writes it with `dcp.async_save` over a gloo group of
    its own, so its collectives never interleave with the training step's on the default group. STABLE is
    written by rank 0's main thread in `settle`, once every rank's write is done: a job killed before that
    leaves an unmarked temporary dir that no resume takes. A write that fails raises in `settle` on every
    rank, its temporary dir removed.
    """

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")  # collective: every rank creates it, in the same order
        self.writing: _Write | None = None

    def start(self, run: RunDir, step: int, model: torch.nn.Module, optim: torch.optim.Optimizer, d: Dist,
              seed: int) -> tuple[int | None, int]:
        """Collective: begin step `step`'s checkpoint once the previous one is finished. Returns the step that
        finished meanwhile (None: none was in flight) and the bytes of this rank's snapshot."""
        finished = self.settle(run, d, seed, wait=True)
        dest, tmp = _begin(run, step, d)
        state = _renamed(_state(model, optim), _ep_names(model, d))
        future = dcp.async_save(state, checkpoint_id=str(tmp / "dcp"), process_group=self.group)
        self.writing = _Write(step, dest, tmp, future)
        return finished, _local_bytes(state)

    def settle(self, run: RunDir, d: Dist, seed: int, *, wait: bool = False) -> int | None:
        """Collective: if the write in flight is done on every rank (`wait`: once it is), publish it and
        return its step; None while it runs, or with none in flight. Raises RunDirError if it failed."""
        w = self.writing
        if w is None:
            return None
        if wait:
            futures.wait([w.future])
        elif all_reduce_stats({"done_min": float(w.future.done())}, d.device)["done_min"] < 1:
            return None
        self.writing = None
        if (error := w.future.exception()) is not None:
            if d.is_main:
                shutil.rmtree(w.tmp, ignore_errors=True)
            raise RunDirError(f"the checkpoint of step {w.step} could not be written to {w.dest.parent} "
                              f"({type(error).__name__}: {error}); it was not published") from error
        if d.is_main:
            _finish(run, w.step, w.dest, w.tmp, d, seed)
        return w.step


def _local_bytes(state: dict) -> int:
    """Bytes of this rank's own tensors in a state dict (a DTensor counts its local shard)."""
    total = 0
    for v in _tensors(state):
        local = v.to_local() if isinstance(v, DTensor) else v
        total += local.numel() * local.element_size()
    return total


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def resolve_resume(run: RunDir, resume: str, *, tries: int | None = None, retry_s: float | None = None) -> int:
    """Step to resume from: 0 (fresh start) or a published trainer checkpoint's step.

    'latest': the newest checkpoint, or a fresh start if there is none.
    'none': a fresh start; refused if the run already has trainer output.
    'N': exactly that checkpoint.
    The resume then removes every later step, so a checkpoint is judged by `RunDir.verify_step`: one whose
    marker or files cannot be read (read `tries` times, `retry_s` apart) is a RunDirError naming the file,
    never passed over for an older one or for a fresh start.
    """
    def latest(kind: str, role: str | None = None) -> int | None:
        return run.latest_published(kind, role, tries=tries, retry_s=retry_s)

    if resume == "latest":
        return latest("checkpoints", Role.TRAINER) or 0
    if resume == "none":
        ckpt, weights = latest("checkpoints", Role.TRAINER), latest("weights")
        if ckpt is not None or weights is not None:
            raise RunDirError(
                f"{run.root} already has trainer output (checkpoints up to step {ckpt}, weights up to step "
                f"{weights}); use --resume latest, or a new run directory"
            )
        return 0
    if not resume.isdigit():
        raise RunDirError(f"--resume must be 'latest', 'none' or a step number, got {resume!r}")
    step = int(resume)
    if step != 0 and not (step in run.steps("checkpoints")
                          and run.verify_step("checkpoints", step, Role.TRAINER, tries=tries, retry_s=retry_s)):
        available = run.stable_steps("checkpoints", Role.TRAINER)
        raise RunDirError(f"no trainer checkpoint for step {step} in {run.root}; available: {available or 'none'}")
    return step


def load_checkpoint(
    run: RunDir, step: int, model: torch.nn.Module, optim: torch.optim.Optimizer, d: Dist, seed: int
) -> dict:
    """Collective: restore model, optimizer and RNG from step N's checkpoint; return its progress dict."""
    from safetensors.torch import load_file

    path = run.checkpoints(step, Role.TRAINER)
    if not is_stable(path):
        raise RunDirError(f"{path} is not a complete checkpoint (no STABLE marker)")
    progress = json.loads((path / "trainer_state.json").read_text())
    if progress.get("ep", 1) != d.ep:
        raise RunDirError(
            f"{path} was saved with ep={progress.get('ep', 1)}; this trainer runs ep={d.ep}. Expert-parallel "
            f"checkpoints resume with the same ep degree (dp_shard, dp_replicate and the rank count may change)"
        )
    names = _ep_names(model, d)
    state = _renamed(_state(model, optim), names)
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    back = {v: k for k, v in names.items()}
    state = _renamed(state, back)
    _load_trained(model, state["model"], path)
    set_optimizer_state_dict(model, optim, state["optim"], options=TRAINED)
    rng_file = path / "rng" / f"rank_{d.rank}.safetensors"
    if progress.get("world_size") == d.world_size and rng_file.is_file():
        rng = load_file(str(rng_file))
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        torch.manual_seed(seed * 1_000_003 + step * 1_009 + d.rank)
    return progress
