"""Process group, device mesh and FSDP2 wrapping for the trainer.

The mesh has the data-parallel dims only: ("dp_shard",) for plain FSDP, or
("dp_replicate", "dp_shard") for HSDP (parameters sharded inside a replica
group, gradients all-reduced across groups). Context and expert parallelism
are accepted from the plan but refused until they are implemented.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from prl.errors import ConfigError
from prl.trainer.config import TrainerConfig

UNIMPLEMENTED = {
    "cp": "context parallelism (CP: ring attention over long sequences)",
    "ep": "expert parallelism (EP: MoE experts sharded across ranks)",
}


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    dp_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def check_degrees(cfg: TrainerConfig, world_size: int) -> None:
    """Refuse CP/EP != 1 by name, and a mesh that does not multiply out to the world size."""
    for dim, feature in UNIMPLEMENTED.items():
        degree = getattr(cfg, dim)
        if degree != 1:
            raise ConfigError(
                f"trainer.mesh.{dim}={degree}: {feature} is not implemented in the trainer yet "
                f"(it lands with its own issue); set trainer.mesh.{dim}: 1"
            )
    product = cfg.dp_replicate * cfg.dp_shard * cfg.cp * cfg.ep
    if product != world_size or cfg.world_size != world_size:
        raise ConfigError(
            f"invalid trainer mesh: dp_replicate({cfg.dp_replicate}) * dp_shard({cfg.dp_shard}) * cp({cfg.cp}) "
            f"* ep({cfg.ep}) = {product}, plan world_size = {cfg.world_size}, but torchrun started "
            f"{world_size} processes; they must all be equal"
        )


def init_distributed(cfg: TrainerConfig) -> Dist:
    """Join (or, run without torchrun, create) the process group and build the mesh."""
    # Run as a plain process (no torchrun): a one-rank group.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(cfg.master_port))
    world_size = int(os.environ["WORLD_SIZE"])
    check_degrees(cfg, world_size)
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    if cfg.dp_replicate > 1:
        mesh = init_device_mesh(
            device.type, (cfg.dp_replicate, cfg.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )
    else:
        mesh = init_device_mesh(device.type, (cfg.dp_shard,), mesh_dim_names=("dp_shard",))
    return Dist(dist.get_rank(), world_size, local_rank, device, mesh, cfg.dp_size)


def compute_dtype(cfg: TrainerConfig, device: torch.device) -> torch.dtype:
    """bf16 on accelerators when asked; fp32 on CPU (see TrainerConfig.precision)."""
    return torch.bfloat16 if cfg.precision == "bf16" and device.type != "cpu" else torch.float32


def apply_fsdp(model: torch.nn.Module, cfg: TrainerConfig, d: Dist) -> torch.nn.Module:
    """Activation checkpointing (optional), then fully_shard every transformer block, then the root."""
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    param_dtype = compute_dtype(cfg, d.device)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    block_types = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_types]
    if not blocks:
        raise ConfigError(
            f"{type(model).__name__} declares no transformer block class (_no_split_modules); cannot shard it"
        )
    for block in blocks:
        fully_shard(block, mesh=d.mesh, mp_policy=mp)
    fully_shard(model, mesh=d.mesh, mp_policy=mp)
    return model


def all_reduce_stats(stats: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum (min/max for *_min/*_max keys) statistics over all ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(stats)
    out = {}
    for op, pick in (
        (dist.ReduceOp.SUM, lambda k: not k.endswith(("_min", "_max"))),
        (dist.ReduceOp.MIN, lambda k: k.endswith("_min")),
        (dist.ReduceOp.MAX, lambda k: k.endswith("_max")),
    ):
        keys = sorted(k for k in stats if pick(k))
        if not keys:
            continue
        t = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        out.update(zip(keys, t.tolist(), strict=True))
    return out
