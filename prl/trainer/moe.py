"""Expert parallelism (EP) for transformers 5's fused-expert MoE blocks, every family with one layer.

transformers 5 stores a MoE layer's experts as 3-D parameters of one module (`Qwen3MoeExperts`,
`MixtralExperts`, `DeepseekV3Experts`, `Glm4MoeExperts`, `Qwen3_5MoeExperts`, `GptOssExperts`, ...),
called as `experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])` by the family's sparse
MoE block after its router. Each such class is decorated with transformers'
`use_experts_implementation`, which records its layout on the instance, and that is all this
module reads (no per-family code):

- `has_gate`: an input projection `gate_up_proj` whose output goes through the class's
  `_apply_gate` (SiLU(gate) * up by default; GPT-OSS's clamped SwiGLU on interleaved columns),
  else `up_proj` and `act_fn`;
- `is_transposed`: weights stored [E, in, out] (GPT-OSS: `x @ W`) instead of [E, out, in]
  (`F.linear(x, W)`);
- `has_bias`: per-expert biases `<proj>_bias` [E, out].

`install_expert_parallel` swaps each of those modules for an `ExpertParallelExperts` that keeps
only this EP rank's E/ep experts (same parameter names, so state-dict keys do not change) and
moves tokens to them:

    1. sort the (token, k) pairs by expert; all-to-all the per-expert counts (so every rank
       knows what it will receive) and then the hidden states, to the rank owning each expert;
    2. run each local expert on its rows (one grouped matrix product per projection for all of them;
       the family's own gate function);
    3. all-to-all the outputs back (the reverse splits), weight them by the router's top-k
       weights and sum each token's k rows.

Both all-to-alls are `torch.distributed.all_to_all_single` with uneven splits (gloo and NCCL
support it), wrapped in an autograd function whose backward is the reverse all-to-all. With ep=1
(LoRA on the experts of a model without EP: prl/trainer/lora.py `attach_experts`) the module holds
every expert and step 2 runs alone; each projection then adds its experts' adapters (`_adapted`).
Every rank runs the same layers in the same order (padding micro-batches included), so the
collectives always match. The router (softmax top-k, GPT-OSS's top-k softmax, DeepSeek-V3's and
GLM-4.5's group-limited sigmoid routing with its score-correction bias) and any shared expert stay
dense: replicated over the EP group, FSDP-sharded like every other dense weight.

On disk (Hugging Face layout, what vLLM and `from_pretrained` read) families differ, as
`DiskLayout` records: most store per-expert 2-D tensors `...experts.{e}.gate_proj.weight` [I, H],
`up_proj.weight`, `down_proj.weight` [H, I]; Mixtral names them w1 / w3 / w2 under
`block_sparse_moe` instead of `mlp`; GPT-OSS stores the fused tensors as they are in memory.
`disk_keys` / `split_experts` / `disk_name` map between the two (loading and publishing use them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from prl.errors import ConfigError


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


LAYOUT_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
"""What transformers' `use_experts_implementation` records on an experts module (module doc)."""


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers experts module of the layout in the module doc (or this module's EP version of one)."""
    if isinstance(module, ExpertParallelExperts):
        return True
    # is_concatenated only matters for splitting gate/up on disk (`disk_layout`); older classes may lack it.
    flags = all(hasattr(module, f) for f in ("has_gate", "has_bias", "is_transposed", "num_experts"))
    proj = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    return flags and all(isinstance(getattr(module, p, None), nn.Parameter) and getattr(module, p).dim() == 3
                         for p in (proj, "down_proj"))


def expert_param_names(module: nn.Module) -> tuple[str, ...]:
    """The per-expert parameters of a fused experts module: input projection, down projection, their biases."""
    proj = "gate_up_proj" if module.has_gate else "up_proj"
    names = (proj, "down_proj")
    return names + tuple(f"{n}_bias" for n in names) if module.has_bias else names


def _layout_attributes(experts: nn.Module) -> dict:
    """The plain settings of an experts module (flags, sizes, GPT-OSS's alpha and limit) that its gate reads."""
    out = {k: v for k, v in vars(experts).items()
           if not k.startswith("_") and k != "training" and isinstance(v, (bool, int, float, str))}
    return out | {f: bool(getattr(experts, f)) for f in LAYOUT_FLAGS if hasattr(experts, f)}


class ExpertParallelExperts(nn.Module):
    """This EP rank's experts of one MoE layer; a drop-in for a transformers fused experts module."""

    def __init__(self, experts: nn.Module, ep: int, ep_rank: int, group) -> None:
        super().__init__()
        for k, v in _layout_attributes(experts).items():
            setattr(self, k, v)
        self.num_experts = int(experts.num_experts)
        if self.num_experts % ep:
            raise ConfigError(f"trainer.ep({ep}) must divide num_experts({self.num_experts})")
        self.ep, self.group = ep, group
        self.num_local = self.num_experts // ep
        self.first = ep_rank * self.num_local
        local = slice(self.first, self.first + self.num_local)
        self.param_names = expert_param_names(experts)
        # On the meta device these are shapes only; the loader fills this rank's slice.
        for name in self.param_names:
            setattr(self, name, nn.Parameter(getattr(experts, name).data[local].clone()))
        if hasattr(experts, "act_fn"):
            self.act_fn = experts.act_fn
        self._gate_fn = type(experts)._apply_gate if self.has_gate else None
        # LoRA on the experts (prl/trainer/lora.py `attach_experts`): fused parameter -> the on-disk projection of
        # each part of its output (gate_up_proj: gate, up; down_proj: down), "" for a part without an adapter. A
        # part `p` has parameters `{p}_lora_A` [E_local, r, in] and `{p}_lora_B` [E_local, out, r].
        self.adapters: dict[str, tuple[str, ...]] = {}
        self.lora_scale, self.lora_dropout = 1.0, 0.0

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        T, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.ep == 1:  # every expert is here (expert LoRA on an ep=1 model): no dispatch
            back = self._run_experts(hidden[order // k], counts.tolist())
        else:
            back = self._dispatch(hidden, order, k, counts)
        weighted = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
        final = torch.zeros_like(hidden)
        return final.index_add(0, order // k, weighted.to(final.dtype))

    def _dispatch(self, hidden: torch.Tensor, order: torch.Tensor, k: int, counts: torch.Tensor) -> torch.Tensor:
        """The (token, k) rows in `order` through their experts over the EP group, back in `order`."""
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
        return all_to_all(out, send_splits, recv_splits, self.group)

    def _project(self, x: torch.Tensor, name: str, offsets: torch.Tensor, expert_of_row) -> torch.Tensor:
        """Projection `name` of rows `x` (consecutive blocks per local expert, ending at `offsets`), each block
        through its expert, plus its bias and adapters."""
        bias = getattr(self, f"{name}_bias")[expert_of_row] if self.has_bias else None
        y = grouped_linear(x, getattr(self, name), offsets, bias, self.is_transposed)
        return y + self._adapted(x, name, offsets, y.shape[-1]) if name in self.adapters else y

    def _adapted(self, x: torch.Tensor, name: str, offsets: torch.Tensor, width: int) -> torch.Tensor:
        """The experts' LoRA update of projection `name`: (alpha / r) B_e A_e x per part, the parts side by side."""
        parts = self.adapters[name]
        if self.lora_dropout > 0:
            x = F.dropout(x, self.lora_dropout, self.training)
        outs = [grouped_linear(grouped_linear(x, getattr(self, f"{p}_lora_A"), offsets),
                               getattr(self, f"{p}_lora_B"), offsets) if p
                else x.new_zeros((x.shape[0], width // len(parts))) for p in parts]
        return torch.cat(outs, dim=-1) * self.lora_scale

    def _run_experts(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """Each local expert on its consecutive block of rows, one grouped matrix product per projection
        (`grouped_linear`) rather than a few kernels per expert."""
        counts = torch.tensor(per_expert, device=rows.device)
        offsets = counts.cumsum(0, dtype=torch.int32)
        expert_of_row = torch.arange(self.num_local, device=rows.device).repeat_interleave(counts) \
            if self.has_bias else None
        h = self._project(rows, self.param_names[0], offsets, expert_of_row)
        h = self._gate_fn(self, h) if self.has_gate else self.act_fn(h)
        out = self._project(h, "down_proj", offsets, expert_of_row)
        # The output must depend on the received rows even when none came: otherwise this rank's autograd
        # never runs the dispatch all-to-all's backward while the others wait in it (a deadlock seen in the
        # local-moe run at step 3). Every expert weight gets a gradient from the grouped products' backward, a
        # zero one where an expert saw no token (FSDP reduce-scatters the same parameters on every rank).
        return out + 0.0 * rows.sum()

    def extra_repr(self) -> str:
        return f"experts {self.first}..{self.first + self.num_local - 1} of {self.num_experts} (ep {self.ep})"


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None = None,
                   transposed: bool = False) -> torch.Tensor:
    """Rows of `x` in consecutive blocks, block e ending at `offsets[e]`, each through expert e's `weight`
    ([E, out, in]; [E, in, out] when `transposed`), plus a per-row `bias` [rows, out]. transformers'
    `_grouped_linear`, what its own experts run: torch's grouped_mm, one kernel for every expert (on CPU in
    torch 2.13 too, backward included), where a loop over the experts launched a few per expert. On CUDA torch's
    grouped kernels take bfloat16 only (`torch.nn.functional.grouped_mm`), so other dtypes (`trainer.precision:
    fp32`) go through transformers' per-expert fallback op."""
    from transformers.integrations.moe import _grouped_linear

    if weight.is_cuda and weight.dtype != torch.bfloat16:
        w = weight if transposed else weight.transpose(-2, -1)
        out = torch.ops.transformers.grouped_mm_fallback(x.to(weight.dtype), w, offsets)
        return out + bias if bias is not None else out
    return _grouped_linear(x, weight, offsets, bias=bias, is_transposed=transposed)


def gather_experts(local: torch.Tensor, ep: int, group) -> torch.Tensor:
    """Collective over the EP group: every EP rank's experts [E/ep, ...] of one parameter, in expert order."""
    parts = [torch.empty_like(local) for _ in range(ep)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


def expert_modules(root: nn.Module) -> list[nn.Module]:
    """The fused-expert modules under `root` (transformers' or EP-installed)."""
    return [m for m in root.modules() if is_fused_experts(m)]


def install_expert_parallel(model: nn.Module, ep: int, ep_rank: int, group) -> int:
    """Replace every fused experts module with this rank's `ExpertParallelExperts`; return how many.

    Refuses (ConfigError) a model with no expert module of a known layout: ep > 1 needs one.
    """
    targets = [(name, m) for name, m in model.named_modules() if is_fused_experts(m)]
    if not targets:
        raise ConfigError(
            f"trainer.ep({ep}) needs an MoE model whose experts are transformers' fused experts modules; "
            f"{type(model).__name__} has none: use ep: 1"
        )
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, ExpertParallelExperts(m, ep, ep_rank, group))
    return len(targets)


@dataclass(frozen=True)
class DiskLayout:
    """How a family's Hugging Face checkpoints store the experts of one MoE layer (module doc)."""

    split: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")
    """Per-expert tensors `experts.{e}.{name}.weight` for (gate, up, down); None: the fused tensors as in memory."""
    rename: tuple[str, str] | None = None
    """(in memory, on disk): a part of the keys that the family's checkpoints spell differently."""


FUSED_ON_DISK = DiskLayout(split=None)
DISK_LAYOUTS: dict[str, DiskLayout] = {
    # transformers' conversion mapping for mixtral: `.block_sparse_moe.` -> `.mlp.`, experts w1 / w3 -> gate_up_proj.
    "mixtral": DiskLayout(split=("w1", "w3", "w2"), rename=(".mlp.", ".block_sparse_moe.")),
}
"""model_type -> layout, where it is not the default (per-expert gate_proj / up_proj / down_proj)."""


def disk_layout(model: nn.Module) -> DiskLayout:
    """The on-disk layout of `model`'s experts: its family's, or fused for experts that have no per-expert form.

    Experts stored transposed, with biases or with interleaved gate/up columns (GPT-OSS) are written
    fused, as transformers holds and saves them.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    if model_type in DISK_LAYOUTS:
        return DISK_LAYOUTS[model_type]
    for m in expert_modules(model):
        if m.is_transposed or m.has_bias or not m.has_gate or not getattr(m, "is_concatenated", True):
            return FUSED_ON_DISK
    return DiskLayout()


def disk_name(layout: DiskLayout, name: str) -> str:
    """The checkpoint's name of in-memory tensor `name` (not a per-expert one)."""
    return name.replace(*layout.rename) if layout.rename else name


def disk_keys(layout: DiskLayout, prefix: str, param: str, first: int, count: int) -> list[str]:
    """On-disk keys of experts first..first+count-1 of fused parameter `prefix.param`, in split order.

    A fused-on-disk layout has one key, the whole [E, ...] tensor (count must then be all experts).
    """
    if layout.split is None:
        return [disk_name(layout, f"{prefix}.{param}")]
    base, (gate, up, down) = disk_name(layout, prefix), layout.split
    experts = range(first, first + count)
    if param == "gate_up_proj":
        return [f"{base}.{e}.{p}.weight" for e in experts for p in (gate, up)]
    if param == "down_proj":
        return [f"{base}.{e}.{down}.weight" for e in experts]
    raise ValueError(f"no per-expert checkpoint name for {prefix}.{param}")


def split_experts(layout: DiskLayout, prefix: str, param: str, tensor: torch.Tensor, first: int
                  ) -> dict[str, torch.Tensor]:
    """Fused [E_local, ...] tensor -> on-disk tensors (views), experts numbered from `first`."""
    keys = disk_keys(layout, prefix, param, first, tensor.shape[0])
    if layout.split is None:
        return {keys[0]: tensor}
    parts = [half for t in tensor for half in t.chunk(2, dim=0)] if param == "gate_up_proj" else list(tensor)
    return dict(zip(keys, parts, strict=True))
