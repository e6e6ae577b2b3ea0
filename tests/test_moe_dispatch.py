"""The EP dispatch on 2 gloo ranks when one rank's experts receive no token: forward and backward
must still run the same collectives on every rank (a rank whose output did not depend on its received
rows skipped the dispatch all-to-all's backward, and the other rank waited in it forever)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class _Experts(nn.Module):
    """transformers' fused-expert parameters and layout flags, as ExpertParallelExperts takes them apart."""

    has_gate, has_bias, is_transposed, is_concatenated = True, False, False, True

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        torch.manual_seed(0)
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, inter) * 0.1)
        self.act_fn = nn.SiLU()

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def _worker(rank: int, store: str, out: dict) -> None:
    from prl.trainer.moe import ExpertParallelExperts

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        experts = ExpertParallelExperts(_Experts(4, 8, 16), ep=2, ep_rank=rank, group=dist.group.WORLD)
        hidden = torch.randn(5, 8, requires_grad=True)
        # Every token of both ranks goes to experts 0 and 1: rank 1's experts (2, 3) receive nothing.
        index = torch.tensor([[0, 1]] * 5)
        weights = torch.full((5, 2), 0.5)
        y = experts(hidden, index, weights)
        y.sum().backward()
        out[rank] = (tuple(y.shape), float(hidden.grad.abs().sum()), experts.gate_up_proj.grad is not None)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_rank_whose_experts_get_no_token_still_joins_the_backward(tmp_path):
    out = mp.Manager().dict()
    store = str(tmp_path / "store")
    mp.spawn(_worker, args=(store, out), nprocs=2, join=True)
    for rank in (0, 1):
        shape, grad, expert_grad = out[rank]
        assert shape == (5, 8) and grad > 0 and expert_grad, (rank, out[rank])
