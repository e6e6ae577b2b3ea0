"""Build the model on the meta device, shard it, then read each rank's shards from the HF safetensors.

No rank ever holds the full model: the module tree is created without storage
(`torch.device("meta")`), experts are cut to this EP rank's and every parameter becomes an FSDP2
DTensor shard (prl/trainer/parallel.py), then `to_empty` allocates only the local shards and
`load_shards` fills them with positioned reads of just the rows of each safetensors tensor that
this rank keeps (FSDP2 shards dim 0), straight into the shard's memory when the dtypes match.
Peak host memory per rank is about its shard (plus one tensor slice when the file's dtype
differs), not the model; tests/test_trainer_parallel.py measures it.

Non-persistent buffers (rotary `inv_freq`) are not in the checkpoint: their modules are
rebuilt from the config on the device after `to_empty`. Persistent ones (DeepSeek-V3's router
score-correction bias) are read whole on every rank, like the parameters they sit beside.
Checkpoint names follow the family's layout (`disk_layout` in prl/trainer/moe.py: Mixtral's
`block_sparse_moe`, per-expert or fused experts). A checkpoint stored block-FP8 (DeepSeek-V3's, Kimi-K2's
release: float8_e4m3fn weights beside a float32 `weight_scale_inv` per block, prl/weights/fp8.py) is
dequantised as its rows are read: the trainer trains in its own dtype, and publishes FP8 again
(prl/trainer/weights.py).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from torch import nn

from prl.errors import ConfigError
from prl.trainer.moe import DiskLayout, ExpertParallelExperts, disk_keys, disk_layout, disk_name, is_fused_experts
from prl.weights.fp8 import Blocks, blocks_of

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}


def build_meta_model(model_path: str | Path) -> nn.Module:
    """The model's module tree from its config.json, on the meta device, fp32, in training mode."""
    from transformers import AutoConfig

    from prl.trainer.vision import model_class

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = model_class(config).from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    model.train()  # HF applies activation checkpointing only in training mode
    return model


def _header(file: Path) -> tuple[int, dict]:
    """(byte offset of the data, JSON header) of a safetensors file."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def weight_map(model_path: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of an HF model dir (sharded with an index, or one file)."""
    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise ConfigError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    return {k: single for k in _header(single)[1] if k != "__metadata__"}


class _Reader:
    """Reads row ranges of tensors straight from safetensors files into destination tensors.

    Plain positioned reads, not mmap: mapped file pages would count in the process's RSS
    (half the file for half the rows); read() leaves them in the page cache only.
    """

    def __init__(self, model_path: str | Path) -> None:
        self.where = weight_map(model_path)
        self.path = model_path
        self.headers: dict[Path, tuple[int, dict]] = {}
        self.blocks = blocks_of(model_path)

    def _entry(self, name: str) -> tuple[Path, int, dict]:
        if name not in self.where:
            raise ConfigError(f"{self.path}: the checkpoint has no tensor {name!r} that the model needs")
        file = self.where[name]
        if file not in self.headers:
            self.headers[file] = _header(file)
        base, header = self.headers[file]
        return file, base, header[name]

    def read_into(self, name: str, start: int, dest: torch.Tensor) -> None:
        """Fill `dest` with rows [start, start + len(dest)) of tensor `name` (all of it if 0-d); an FP8 weight of a
        block-FP8 checkpoint dequantised by its scales' rows."""
        from prl.weights.fp8 import dequantise, scale_name

        scales = scale_name(name)
        if self.blocks is None or scales not in self.where or self._entry(name)[2]["dtype"] != "F8_E4M3":
            return self._read_rows(name, start, dest)
        q = torch.empty(dest.shape, dtype=torch.float8_e4m3fn)
        self._read_rows(name, start, q)
        first, stop = start // self.blocks.rows, -(-(start + len(dest)) // self.blocks.rows)
        scale = torch.empty((stop - first, *self._entry(scales)[2]["shape"][1:]), dtype=torch.float32)
        self._read_rows(scales, first, scale)
        rows = scale.repeat_interleave(self.blocks.rows, 0)[start - first * self.blocks.rows:][:len(dest)]
        dest.copy_(dequantise(q, rows, Blocks(1, self.blocks.cols)))

    def _read_rows(self, name: str, start: int, dest: torch.Tensor) -> None:
        """`read_into` of a tensor as it is stored (cast to `dest`'s dtype)."""
        file, base, entry = self._entry(name)
        shape, dtype = entry["shape"], _DTYPES[entry["dtype"]]
        stop = start + (dest.shape[0] if dest.dim() else 1)
        want = (stop - start, *shape[1:]) if shape else ()
        if tuple(want) != tuple(dest.shape) or (shape and stop > shape[0]):
            raise ConfigError(
                f"{self.path}: {name} has shape {tuple(shape)}; this rank needs rows {start}:{stop} "
                f"as {tuple(dest.shape)}; does config.json match the weights?"
            )
        begin, end = entry["data_offsets"]
        row = (end - begin) // shape[0] if shape and shape[0] else 0
        offset = base + begin + start * row
        nbytes = (stop - start) * row if shape else end - begin
        direct = dest.dtype == dtype and dest.device.type == "cpu" and dest.is_contiguous()
        buf = dest if direct else torch.empty(dest.shape, dtype=dtype)
        raw = buf.reshape(-1).view(torch.uint8).numpy()
        with open(file, "rb") as f:
            f.seek(offset)
            if f.readinto(raw) != nbytes:
                raise ConfigError(f"{file}: short read of {name}; is the file truncated?")
        if not direct:
            dest.copy_(buf)


def _local_box(param: torch.Tensor) -> tuple[torch.Size, tuple[int, ...]]:
    """Shape and global offset of this rank's shard of `param` (a DTensor, or a plain tensor)."""
    if not hasattr(param, "device_mesh"):
        return param.shape, (0,) * param.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if any(offset[1:]):
        raise ConfigError(f"sharded load expects dim-0 shards; got offset {offset} for a {tuple(param.shape)} tensor")
    return torch.Size(shape), tuple(offset)


def _fill_experts(reader: _Reader, layout: DiskLayout, prefix: str, leaf: str, first: int, dest: torch.Tensor) -> None:
    """Fill a fused expert shard (experts first, first+1, ...) from the checkpoint: rows of the fused tensor when
    the checkpoint has one, else the per-expert tensors of the family's layout."""
    fused = disk_name(layout, f"{prefix}.{leaf}")
    if fused in reader.where:
        reader.read_into(fused, first, dest)
        return
    keys = iter(disk_keys(layout, prefix, leaf, first, dest.shape[0]))
    for i in range(dest.shape[0]):
        parts = dest[i].chunk(2, dim=0) if leaf == "gate_up_proj" else (dest[i],)
        for part in parts:
            reader.read_into(next(keys), 0, part)


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers saved with the weights (DeepSeek-V3's and GLM-4.5's router score-correction bias), by name."""
    out = []
    for prefix, module in model.named_modules():
        for n, b in module.named_buffers(recurse=False):
            if b is not None and n not in module._non_persistent_buffers_set:
                out.append((f"{prefix}.{n}" if prefix else n, b))
    return out


def rebuild_nonpersistent_buffers(model: nn.Module, device: torch.device) -> None:
    """Recompute buffers that are not in the checkpoint (rotary inv_freq) after `to_empty`."""
    for module in model.modules():
        names = [n for n in module._non_persistent_buffers_set if getattr(module, n, None) is not None]
        if not names:
            continue
        if not hasattr(module, "config"):
            raise ConfigError(f"cannot rebuild buffers {names} of {type(module).__name__} after meta init")
        with torch.device(device):
            fresh = type(module)(config=module.config)
        for n in names:
            setattr(module, n, getattr(fresh, n).to(device))


@torch.no_grad()
def load_shards(model: nn.Module, model_path: str | Path) -> int:
    """Fill every parameter's local shard, and every persistent buffer, from the safetensors of `model_path`;
    return bytes filled."""
    reader = _Reader(model_path)
    layout = disk_layout(model)
    fused = {name: m for name, m in model.named_modules() if is_fused_experts(m)}
    modules = dict(model.named_modules())
    total = 0
    for name, param in model.named_parameters():
        shape, offset = _local_box(param)
        local = param.to_local() if hasattr(param, "to_local") else param
        if tuple(local.shape) != tuple(shape):
            raise ConfigError(f"{name}: local shard {tuple(local.shape)} != expected {tuple(shape)}")
        if local.numel() == 0:
            continue
        prefix, _, leaf = name.rpartition(".")
        fresh = getattr(modules.get(prefix), "fresh_parameters", {})
        if leaf in fresh:  # added by a transform (LoRA's adapters): not in the checkpoint, its module says how
            local.copy_(fresh[leaf](name, tuple(param.shape))[offset[0]:offset[0] + local.shape[0]])
        elif prefix in fused:
            first = fused[prefix].first if isinstance(fused[prefix], ExpertParallelExperts) else 0
            _fill_experts(reader, layout, prefix, leaf, first + offset[0], local)
        else:
            reader.read_into(disk_name(layout, name), offset[0] if local.dim() else 0, local)
        total += local.numel() * local.element_size()
    for name, buf in persistent_buffers(model):
        reader.read_into(disk_name(layout, name), 0, buf)
        total += buf.numel() * buf.element_size()
    return total


def load_model(model: nn.Module, model_path: str | Path, device: torch.device) -> nn.Module:
    """Materialise a sharded meta model on `device` and load its weights (see module doc)."""
    model.to_empty(device=device)
    rebuild_nonpersistent_buffers(model, device)
    load_shards(model, model_path)
    return model
