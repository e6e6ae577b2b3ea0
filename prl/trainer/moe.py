"""Expert parallelism (EP) for transformers' fused-expert MoE blocks (Qwen3-MoE).

transformers 5 stores a MoE layer's experts as two 3-D parameters of one module
(`Qwen3MoeExperts`): `gate_up_proj` [E, 2I, H] (gate rows first, then up) and `down_proj`
[E, H, I], called as `experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])` by the
sparse MoE block after its router. `install_expert_parallel` swaps each of those modules for an
`ExpertParallelExperts` that keeps only this EP rank's E/ep experts (same parameter names, so
state-dict keys do not change) and moves tokens to them:

    1. sort the (token, k) pairs by expert; all-to-all the per-expert counts (so every rank
       knows what it will receive) and then the hidden states, to the rank owning each expert;
    2. run each local expert on its rows (SiLU-gated MLP, as transformers does);
    3. all-to-all the outputs back (the reverse splits), weight them by the router's top-k
       weights and sum each token's k rows.

Both all-to-alls are `torch.distributed.all_to_all_single` with uneven splits (gloo and NCCL
support it), wrapped in an autograd function whose backward is the reverse all-to-all.
Every rank runs the same layers in the same order (padding micro-batches included), so the
collectives always match. The router, its softmax/top-k and any shared expert stay dense
(replicated over the EP group, FSDP-sharded like every other dense weight).

On disk (Hugging Face layout, what vLLM reads) experts are per-expert 2-D tensors
`...experts.{e}.gate_proj.weight` [I, H], `up_proj.weight` [I, H], `down_proj.weight` [H, I];
`expert_keys` / `split_experts` map between the two (loading and publishing use them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from prl.errors import ConfigError

# transformers classes with the fused-expert layout and call convention above.
FUSED_EXPERT_CLASSES = ("Qwen3MoeExperts",)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with uneven splits; the gradient takes the reverse route."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable all-to-all of the rows of `x` (in_splits rows to each rank, out_splits from each)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class ExpertParallelExperts(nn.Module):
    """This EP rank's experts of one MoE layer; a drop-in for transformers' fused experts module."""

    def __init__(self, experts: nn.Module, ep: int, ep_rank: int, group) -> None:
        super().__init__()
        self.num_experts = int(experts.num_experts)
        if self.num_experts % ep:
            raise ConfigError(f"ep({ep}) must divide num_experts({self.num_experts})")
        self.ep, self.group = ep, group
        self.num_local = self.num_experts // ep
        self.first = ep_rank * self.num_local
        local = slice(self.first, self.first + self.num_local)
        # On the meta device these are shapes only; the loader fills this rank's slice.
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.data[local].clone())
        self.down_proj = nn.Parameter(experts.down_proj.data[local].clone())
        self.act_fn = experts.act_fn

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        T, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_counts = recv_counts.view(self.ep, self.num_local)  # [source rank, local expert]
        send_splits = counts.view(self.ep, self.num_local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()

        rows = all_to_all(hidden[order // k], recv_splits, send_splits, self.group)
        # Received rows are grouped by source, then expert; regroup by expert for the matmuls.
        expert_of_row = torch.arange(self.num_local, device=hidden.device).repeat(self.ep)
        expert_of_row = expert_of_row.repeat_interleave(recv_counts.reshape(-1))
        by_expert = torch.argsort(expert_of_row, stable=True)
        out = self._run_experts(rows[by_expert], recv_counts.sum(0).tolist())
        out = out[torch.argsort(by_expert)]
        back = all_to_all(out, send_splits, recv_splits, self.group)

        weighted = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
        final = torch.zeros_like(hidden)
        return final.index_add(0, order // k, weighted.to(final.dtype))

    def _run_experts(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """Each local expert on its consecutive block of rows."""
        outs = []
        for e, chunk in enumerate(torch.split(rows, per_expert)):
            if chunk.shape[0] == 0:
                continue
            gate, up = F.linear(chunk, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
        out = torch.cat(outs) if outs else rows.new_zeros((0, self.down_proj.shape[1]))
        # Every expert weight must get a gradient (zero if it saw no token): FSDP reduce-scatters
        # the same parameters on every rank. And the output must depend on the received rows even
        # when none came: otherwise this rank's autograd never runs the dispatch all-to-all's
        # backward while the others wait in it (a deadlock seen in the local-moe run at step 3).
        return out + 0.0 * (self.gate_up_proj.sum() + self.down_proj.sum() + rows.sum())

    def extra_repr(self) -> str:
        return f"experts {self.first}..{self.first + self.num_local - 1} of {self.num_experts} (ep {self.ep})"


def is_fused_experts(module: nn.Module) -> bool:
    return type(module).__name__ in FUSED_EXPERT_CLASSES or isinstance(module, ExpertParallelExperts)


def expert_modules(root: nn.Module) -> list[nn.Module]:
    """The fused-expert modules under `root` (transformers' or EP-installed)."""
    return [m for m in root.modules() if is_fused_experts(m)]


def install_expert_parallel(model: nn.Module, ep: int, ep_rank: int, group) -> int:
    """Replace every fused experts module with this rank's `ExpertParallelExperts`; return how many.

    Refuses (ConfigError) a model with no expert module of a known layout: ep > 1 needs one.
    """
    targets = [(name, m) for name, m in model.named_modules() if type(m).__name__ in FUSED_EXPERT_CLASSES]
    if not targets:
        raise ConfigError(
            f"trainer.ep({ep}) needs an MoE model with an EP implementation (experts classes "
            f"{', '.join(FUSED_EXPERT_CLASSES)}); {type(model).__name__} has none: use ep: 1"
        )
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, ExpertParallelExperts(m, ep, ep_rank, group))
    return len(targets)


def expert_keys(prefix: str, param: str, first: int, count: int) -> list[str]:
    """On-disk keys of experts first..first+count-1 of fused parameter `prefix.param`, in split order."""
    if param == "gate_up_proj":
        return [f"{prefix}.{e}.{p}.weight" for e in range(first, first + count) for p in ("gate_proj", "up_proj")]
    if param == "down_proj":
        return [f"{prefix}.{e}.down_proj.weight" for e in range(first, first + count)]
    raise ValueError(f"not a fused expert parameter: {prefix}.{param}")


def split_experts(prefix: str, param: str, tensor: torch.Tensor, first: int) -> dict[str, torch.Tensor]:
    """Fused [E_local, ...] tensor -> per-expert on-disk tensors (views), experts numbered from `first`."""
    keys = expert_keys(prefix, param, first, tensor.shape[0])
    parts = [half for t in tensor for half in t.chunk(2, dim=0)] if param == "gate_up_proj" else list(tensor)
    return dict(zip(keys, parts, strict=True))
