"""Publishing full weights in Hugging Face layout: weights/step_N/ + STABLE, written by all ranks.

Sharded publish (the trainer's path, `publish_weights`): every parameter is assigned to one
writer rank (greedy by size, the same deterministic plan on every rank, only ranks of the first
dp_replicate group write); parameters are gathered one at a time, cast to the published dtype
first (a per-parameter all-gather over the ranks that shard it, so any rank holds at most its
own share plus one full parameter), the owner keeps it, and each writer saves its tensors as
`model-0000K-of-0000N.safetensors`. Rank 0 writes `model.safetensors.index.json` (from the
plan, no communication), config and tokenizer files. All ranks write into one temp dir named
by rank 0 (`RunDir.begin_publish(dest, tag=...)`); after a barrier, rank 0 writes the one STABLE
marker of the step (every file and its size) into it and renames it: files and marker appear in one
rename, so a crash (or a full disk) anywhere leaves no accepted partial step.
A world of one writes a single `model.safetensors`.

Experts (fused [E, ...] parameters in memory, prl/trainer/moe.py) are written in their family's
checkpoint layout (`disk_layout`: per expert for most, Mixtral's names, fused for GPT-OSS, whose
EP ranks' experts are then gathered over the EP group into one tensor), the layout vLLM and
`from_pretrained` read; persistent buffers (a router's score-correction bias) go with the
parameters; a tied lm_head is stored once (as HF does).

A model stored block-FP8 (config.json `quantization_config`: `quant_method: fp8` with `weight_block_size`, as
DeepSeek-V3 and Kimi-K2 are released) is served as stored, so its steps are laid out so too, to the run directory
and the feeds alike: each weight vLLM keeps in FP8 is quantised by its writer rank into float8_e4m3fn blocks
beside its float32 `weight_scale_inv` (prl/weights/fp8.py, vLLM's own arithmetic), about half the bytes of bf16;
the rest goes in the published dtype.

Publishing does not overlap the next step: the step's weights are on disk and marked before
the next step's optimizer changes them, so staleness accounting stays exact.

`publish_weights_gathered` is the previous path (full state dict gathered on rank 0, rank 0
writes), kept as the benchmark baseline (bench/bench_publish.py).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from prl.run.rundir import MARKER, RunDir
from prl.trainer.loading import persistent_buffers
from prl.trainer.moe import (ExpertParallelExperts, disk_keys, disk_layout, disk_name, gather_experts, is_fused_experts,
                             split_experts)
from prl.weights.fp8 import Blocks, blocks_of, quantise_step, scale_name

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
INDEX = "model.safetensors.index.json"


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the full (unsharded) state dict on rank 0's CPU; empty on other ranks."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def tied_keys(model: torch.nn.Module) -> set[str]:
    """Keys that alias another weight (a tied lm_head), which HF stores once."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False):
        return set()
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied.keys() if isinstance(tied, dict) else tied)


def drop_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove keys that alias another weight (tied lm_head): HF stores them once."""
    tied = tied_keys(model)
    return {k: v for k, v in state.items() if k not in tied}


def to_hf_layout(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full state dict -> on-disk HF names: experts in the family's layout, tied keys dropped."""
    fused = {n for n, m in model.named_modules() if is_fused_experts(m)}
    layout = disk_layout(model)
    out = {}
    for k, v in drop_tied(model, state).items():
        prefix, _, leaf = k.rpartition(".")
        out.update(split_experts(layout, prefix, leaf, v, 0) if prefix in fused else {disk_name(layout, k): v})
    return out


def write_hf_metadata(out: Path, source_dir: str | Path, dtype: torch.dtype) -> None:
    """Copy config/tokenizer/generation files from `source_dir`; config.json gets the published dtype."""
    for f in Path(source_dir).iterdir():
        # Not the STABLE marker of a run's weights step the model came from (`model.from_run`): the publish
        # writes its own, listing these files.
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name != MARKER:
            shutil.copyfile(f, out / f.name)  # not copy2: the copy gets the run's private mode, not the source's
    config = json.loads((Path(source_dir) / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_hf_dir(
    out: Path,
    state: dict[str, torch.Tensor],
    source_dir: str | Path,
    dtype: torch.dtype,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write `state` as HF safetensors into `out`, with config/tokenizer files from `source_dir`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in state.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(tensors):
        nbytes = tensors[k].numel() * tensors[k].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = tensors[k]
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata=meta)
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2))
    write_hf_metadata(out, source_dir, dtype)


@dataclass(frozen=True)
class Unit:
    """One in-memory parameter or persistent buffer (or one EP rank's part of a fused expert parameter) to publish."""

    name: str
    ep_index: int | None
    """EP rank whose experts these are; None for a dense tensor, or experts gathered over the EP group."""
    keys: tuple[str, ...]
    """Its on-disk tensor names."""
    nbytes: int


def _units_of(name: str, p: torch.Tensor, owner, layout, itemsize: int, blocks: Optional[Blocks]) -> list[Unit]:
    """The units of one tensor: per EP index for experts stored per expert, else one (its keys with the scales of
    the FP8 ones, its bytes as published)."""
    prefix, _, leaf = name.rpartition(".")

    def unit(ep_index: int | None, keys: list[str], numel: int) -> Unit:
        if blocks is None or not any(blocks.quantised(k) for k in keys):
            return Unit(name, ep_index, tuple(keys), numel * itemsize)
        scales = math.ceil(numel / (blocks.rows * blocks.cols))  # about: edge blocks add a few
        return Unit(name, ep_index, tuple(keys) + tuple(scale_name(k) for k in keys if blocks.quantised(k)),
                    numel + 4 * scales)

    if isinstance(owner, ExpertParallelExperts):
        if layout.split is None:  # one fused tensor on disk: every EP rank's experts gathered into it
            return [unit(None, disk_keys(layout, prefix, leaf, 0, owner.num_experts), p.numel() * owner.ep)]
        return [unit(e, disk_keys(layout, prefix, leaf, e * owner.num_local, owner.num_local), p.numel())
                for e in range(owner.ep)]
    if owner is not None and is_fused_experts(owner):
        return [unit(None, disk_keys(layout, prefix, leaf, 0, p.shape[0]), p.numel())]
    return [unit(None, [disk_name(layout, name)], p.numel())]


def publish_plan(model: torch.nn.Module, d, dtype: torch.dtype, blocks: Optional[Blocks] = None
                 ) -> tuple[list[Unit], dict[Unit, int]]:
    """Units to publish and the writer rank of each; identical on every rank (no communication).

    Writers are the ranks of replica group 0; an EP unit may only go to a rank of its EP index
    (the ranks that can gather it). `blocks`: the servers load FP8 (the units' keys carry the scales).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    tied = tied_keys(model)
    modules = dict(model.named_modules())
    layout = disk_layout(model)
    units: list[Unit] = []
    for name, p in [*model.named_parameters(), *persistent_buffers(model)]:
        if name not in tied:
            units += _units_of(name, p, modules.get(name.rpartition(".")[0]), layout, itemsize, blocks)
    writers = list(range(d.world_size // d.dp_replicate))
    load = dict.fromkeys(writers, 0)
    owners: dict[Unit, int] = {}
    for u in sorted(units, key=lambda u: (-u.nbytes, u.name, u.ep_index or 0)):
        eligible = [r for r in writers if u.ep_index is None or r % d.ep == u.ep_index]
        r = min(eligible, key=lambda r: (load[r], r))
        owners[u] = r
        load[r] += u.nbytes
    return units, owners


def file_names(owners: dict[Unit, int]) -> dict[int, str]:
    """Writer rank -> its safetensors file name (one `model.safetensors` if one rank writes all)."""
    ranks = sorted(set(owners.values()))
    if len(ranks) == 1:
        return {ranks[0]: "model.safetensors"}
    return {r: f"model-{i:05d}-of-{len(ranks):05d}.safetensors" for i, r in enumerate(ranks, 1)}


def gather_owned(model: torch.nn.Module, d, dtype: torch.dtype, units: list[Unit], owners: dict[Unit, int],
                 blocks: Optional[Blocks] = None):
    """Collective: the on-disk tensors of the units this rank writes (full, on CPU, in `dtype`; with `blocks`, each
    weight the servers keep in FP8 quantised, beside its scale, on the device before it leaves it: half the bytes
    to copy, and a GPU quantises far faster than the host)."""
    modules = dict(model.named_modules())
    tensors = {**dict(model.named_parameters()), **dict(persistent_buffers(model))}
    layout = disk_layout(model)
    mine: dict[str, torch.Tensor] = {}
    for u in units:
        if u.ep_index is not None and u.ep_index != d.ep_rank:
            continue  # gathered (and written) by the ranks of that EP index
        prefix, _, leaf = u.name.rpartition(".")
        owner = modules.get(prefix)
        p = tensors[u.name].detach().to(dtype)
        full = unwrapped(p.full_tensor() if hasattr(p, "full_tensor") else p)
        if isinstance(owner, ExpertParallelExperts) and u.ep_index is None:
            full = gather_experts(full, d.ep, d.ep_group)
        if owners[u] != d.rank:
            continue
        if owner is not None and is_fused_experts(owner):
            first = owner.first if u.ep_index is not None else 0
            parts = list(split_experts(layout, prefix, leaf, full, first).items())
        else:
            parts = [(disk_name(layout, u.name), full)]
        if blocks is not None:
            parts = quantise_step(parts, blocks)
        mine.update((k, v.cpu().contiguous()) for k, v in parts)
    return mine


def unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a wrapper subclass (torchao's float8 weights under FSDP2, `precision: fp8`:
    safetensors and the feed need plain storage); a plain tensor as it is."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        t = getattr(t, inner[0])
    return t


def shares(model: torch.nn.Module, dtype: torch.dtype, d, blocks: Optional[Blocks] = None
           ) -> tuple[list[tuple[str, torch.Tensor]], list[int]]:
    """Collective: this rank's share of the weights (the tensors a sharded publish would write to its file, by
    name; empty on a rank that writes none; `blocks`: laid out for FP8 servers) and the writer ranks, whose shares
    together are the model: what a transport that sends from memory sends (prl/weights)."""
    units, owners = publish_plan(model, d, dtype, blocks)
    return sorted(gather_owned(model, d, dtype, units, owners, blocks).items()), sorted(set(owners.values()))


def _broadcast_str(value: str | None) -> str:
    obj = [value]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(obj, src=0)
    return obj[0]


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def publish_weights(
    run: RunDir, step: int, model: torch.nn.Module, source_dir: str | Path, dtype: torch.dtype, d
) -> Path:
    """Collective: every writer rank saves its share of weights/step_N; rank 0 publishes it atomically."""
    from safetensors.torch import save_file

    dest = run.weights(step)
    blocks = blocks_of(source_dir)
    tmp = Path(_broadcast_str(str(run.begin_publish(dest, tag=f"step{step}")) if d.is_main else None))
    units, owners = publish_plan(model, d, dtype, blocks)
    files = file_names(owners)
    mine = gather_owned(model, d, dtype, units, owners, blocks)
    if d.rank in files:
        save_file(mine, str(tmp / files[d.rank]), metadata={"format": "pt"})
    del mine
    _barrier()
    if d.is_main:
        if len(files) > 1:
            weight_map = {k: files[owners[u]] for u in units for k in u.keys}
            index = {"metadata": {"total_size": sum(u.nbytes for u in units)}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX).write_text(json.dumps(index, indent=2))
        write_hf_metadata(tmp, source_dir, dtype)
        run.finish_publish(dest, tmp, step=step)
    _barrier()
    return dest


def publish_weights_gathered(
    run: RunDir, step: int, model: torch.nn.Module, source_dir: str | Path, dtype: torch.dtype, is_main: bool
) -> Path:
    """Collective, the baseline: gather the full state dict on rank 0, which alone writes and publishes.

    Dense and ep=1 models only (under EP a rank's state dict holds only its own experts).
    """
    if any(isinstance(m, ExpertParallelExperts) for m in model.modules()):
        raise ValueError("publish_weights_gathered cannot publish an expert-parallel model; use publish_weights")
    if blocks_of(source_dir) is not None:
        raise ValueError("publish_weights_gathered writes the published dtype only; a block-FP8 model's servers "
                         "load FP8: use publish_weights")
    state = full_state_dict(model)
    dest = run.weights(step)
    if is_main:
        state = to_hf_layout(model, state)
        run.publish_dir(dest, lambda tmp: write_hf_dir(tmp, state, source_dir, dtype), step=step)
    return dest
