"""Process group, device meshes and FSDP2 wrapping for the trainer, carved as torchtitan does.

The world is dp_replicate x dp_shard x cp ranks, laid out with cp innermost:

    rank = (r * dp_shard + s) * cp + c

- dense parameters: FSDP over the dp_shard x cp ranks of a replica group ("dp_shard_cp"),
  replicated (HSDP) over dp_replicate;
- experts (MoE, `ep > 1`): each EP rank holds num_experts / ep of them; EP groups are runs of
  `ep` consecutive ranks inside a replica group, and expert weights are FSDP'd over the
  expert_shard = dp_shard * cp / ep ranks that hold the same experts ("efsdp"), replicated
  over dp_replicate;
- data: the dp_replicate x dp_shard ranks each read their own micro-batches
  (`dp_rank = r * dp_shard + s`); the cp ranks of one data rank split each micro-batch's
  sequence (Ulysses, see prl/trainer/context_parallel.py).

Gradients are summed, not averaged (every FSDP module's divide factor is 1): each rank's loss
is already its share of the global mean, so the sum over ranks is the step's gradient, for
dense and expert weights alike whatever they are sharded over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from prl.errors import ConfigError
from prl.trainer.config import TrainerConfig


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    """FSDP mesh of dense parameters: ("dp_shard_cp",) or ("dp_replicate", "dp_shard_cp")."""
    dp_size: int
    """Data-parallel ranks (dp_replicate * dp_shard): distinct micro-batch streams."""
    dp_rank: int = 0
    dp_replicate: int = 1
    cp: int = 1
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    ep: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    expert_mesh: DeviceMesh | None = None
    """FSDP mesh of expert weights when ep > 1: ("efsdp",) or ("dp_replicate", "efsdp")."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def check_degrees(cfg: TrainerConfig, world_size: int) -> None:
    """Refuse a mesh that does not multiply out to the world size, or an ep that does not divide dp_shard * cp."""
    m = cfg.mesh
    product = m.dp_replicate * m.dp_shard * m.cp
    if product != world_size or m.world_size != world_size:
        raise ConfigError(
            f"invalid trainer mesh: dp_replicate({m.dp_replicate}) * dp_shard({m.dp_shard}) * cp({m.cp}) "
            f"= {product}, plan world_size = {m.world_size}, but torchrun started {world_size} processes; "
            f"they must all be equal"
        )
    if m.ep < 1 or (m.dp_shard * m.cp) % m.ep:
        raise ConfigError(
            f"invalid trainer mesh: ep({m.ep}) must divide dp_shard({m.dp_shard}) * cp({m.cp}) = "
            f"{m.dp_shard * m.cp}: experts are sharded over the dp_shard x cp ranks"
        )


def _mesh(device_type: str, ranks: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    """A DeviceMesh over `ranks` (every rank passes the same tensor), dropping a leading size-1 replicate dim."""
    if ranks.dim() > 1 and ranks.shape[0] == 1 and names[0] == "dp_replicate":
        ranks, names = ranks[0], names[1:]
    return DeviceMesh(device_type, ranks, mesh_dim_names=names)


def build_dist(cfg: TrainerConfig, rank: int, world_size: int, local_rank: int, device: torch.device) -> Dist:
    """Collective: the meshes and process groups of the layout in the module doc."""
    R, S, C, E = cfg.mesh.dp_replicate, cfg.mesh.dp_shard, cfg.mesh.cp, cfg.mesh.ep
    ranks = torch.arange(world_size)
    dense = _mesh(device.type, ranks.view(R, S * C), ("dp_replicate", "dp_shard_cp"))
    cp_mesh = DeviceMesh(device.type, ranks.view(R * S, C), mesh_dim_names=("dp", "cp"))
    expert_mesh, ep_group = None, None
    if E > 1:
        ep_world = DeviceMesh(device.type, ranks.view(R, S * C // E, E), mesh_dim_names=("dp_replicate", "efsdp", "ep"))
        ep_group = ep_world.get_group("ep")
        expert_mesh = ep_world["dp_replicate", "efsdp"] if R > 1 else ep_world["efsdp"]
    inner = rank % (S * C)
    return Dist(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        mesh=dense,
        dp_size=R * S,
        dp_rank=rank // C,
        dp_replicate=R,
        cp=C,
        cp_rank=rank % C,
        cp_group=cp_mesh.get_group("cp") if C > 1 else None,
        ep=E,
        ep_rank=inner % E,
        ep_group=ep_group,
        expert_mesh=expert_mesh,
    )


def init_distributed(cfg: TrainerConfig) -> Dist:
    """Join (or, run without torchrun, create) the process group and build the meshes."""
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
    return build_dist(cfg, dist.get_rank(), world_size, local_rank, device)


def compute_dtype(cfg: TrainerConfig, device: torch.device) -> torch.dtype:
    """bf16 on accelerators when asked (fp8: bf16 outside the float8 matmuls); fp32 on CPU (see
    TrainerConfig.precision)."""
    return torch.bfloat16 if cfg.precision in ("bf16", "fp8") and device.type != "cpu" else torch.float32


def apply_fsdp(model: torch.nn.Module, cfg: TrainerConfig, d: Dist) -> torch.nn.Module:
    """Float8 linear layers (`precision: fp8`), activation checkpointing (optional), torch.compile of every
    transformer block (optional, as torchtitan orders them), then fully_shard experts (EP), every transformer
    block, the root.

    Works on a meta-device model (parameters are materialised later with `to_empty`).
    """
    from prl.trainer.moe import expert_modules
    from prl.trainer.vision import language_model

    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    param_dtype = compute_dtype(cfg, d.device)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # A VLM's blocks are its text decoder's; its image encoder stays in the root unit (prl/trainer/vision.py).
    text = language_model(model)
    block_types = set(getattr(text, "_no_split_modules", None) or [])
    blocks = [m for m in text.modules() if type(m).__name__ in block_types]
    if not blocks:
        raise ConfigError(
            f"{type(model).__name__} declares no transformer block class (_no_split_modules); cannot shard it"
        )
    if cfg.precision == "fp8":
        from prl.trainer.float8 import convert_blocks, gathers_float8

        convert_blocks(blocks, gathers_float8(d.mesh))
    if cfg.compile:
        for block in blocks:  # in place: the block keeps its class and its parameters' names
            block.compile()
    for block in blocks:
        if d.expert_mesh is not None:
            for experts in expert_modules(block):
                fully_shard(experts, mesh=d.expert_mesh, mp_policy=mp)
        fully_shard(block, mesh=d.mesh, mp_policy=mp)
    fully_shard(model, mesh=d.mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # SUM reductions (gloo has no PREMUL_SUM; the post-division by 1 is free).
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def clip_grad_norm(model: torch.nn.Module, max_norm: float, d: Dist) -> float:
    """Collective: the global gradient norm over dense and expert weights; scale grads down to `max_norm`.

    Every parameter is sharded across some ranks and replicated over dp_replicate, so the sum of
    every rank's local squared norms is dp_replicate times the global squared norm.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    sq = torch.stack([g.detach().float().pow(2).sum() for g in local]).sum() if local else torch.zeros(())
    sq = sq.to(torch.float64).to(d.device)
    if dist.is_initialized() and d.world_size > 1:
        dist.all_reduce(sq)
    total = float(sq.sqrt()) / d.dp_replicate**0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in local:
            g.detach().mul_(coef)
    return total


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
