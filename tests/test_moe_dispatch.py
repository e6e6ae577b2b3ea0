"""The EP dispatch on 2 gloo ranks (one spawn for both tests):

- when one rank's experts receive no token, forward and backward must still run the same collectives on
  every rank (a rank whose output did not depend on its received rows skipped the dispatch all-to-all's
  backward, and the other rank waited in it forever);
- on GPT-OSS's experts (transposed weights, biases, clamped SwiGLU on interleaved gate/up columns), the
  layout furthest from Qwen3's, ep=2 gives transformers' own outputs and gradients.
"""

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


def _starved(rank: int) -> tuple:
    from prl.trainer.moe import ExpertParallelExperts

    experts = ExpertParallelExperts(_Experts(4, 8, 16), ep=2, ep_rank=rank, group=dist.group.WORLD)
    hidden = torch.randn(5, 8, requires_grad=True)
    # Every token of both ranks goes to experts 0 and 1: rank 1's experts (2, 3) receive nothing.
    index = torch.tensor([[0, 1]] * 5)
    weights = torch.full((5, 2), 0.5)
    y = experts(hidden, index, weights)
    y.sum().backward()
    return tuple(y.shape), float(hidden.grad.abs().sum()), experts.gate_up_proj.grad is not None


def _gpt_oss(rank: int) -> dict[str, float]:
    """Largest differences between ep=2 and transformers' GptOssExperts on this rank's own tokens."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from prl.trainer.moe import ExpertParallelExperts
    from tests.tiny_model import tiny_moe_config

    torch.manual_seed(0)  # the same experts on both ranks
    ref = GptOssExperts(tiny_moe_config("gpt_oss", hidden_size=16, moe_intermediate_size=8))
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ep = ExpertParallelExperts(ref, ep=2, ep_rank=rank, group=dist.group.WORLD)
    torch.manual_seed(1 + rank)  # each rank its own tokens and routes
    hidden = torch.randn(7, 16)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(7)])
    weights = torch.softmax(torch.randn(7, 2), dim=-1)
    x_ref, x_ep = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    y_ref, y_ep = ref(x_ref, index, weights), ep(x_ep, index, weights)
    (y_ref ** 2).sum().backward()
    (y_ep ** 2).sum().backward()
    out = {"output": float((y_ref - y_ep).abs().max()), "input grad": float((x_ref.grad - x_ep.grad).abs().max())}
    local = slice(ep.first, ep.first + ep.num_local)
    for name in ep.param_names:  # an expert's gradient is the sum over both ranks' tokens
        grad = getattr(ref, name).grad
        dist.all_reduce(grad)
        out[name] = float((grad[local] - getattr(ep, name).grad).abs().max())
    out["moved"] = float(y_ref.abs().max())
    return out


def _worker(rank: int, store: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        out[rank] = {"starved": _starved(rank), "gpt_oss": _gpt_oss(rank)}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = mp.Manager().dict()
    store = str(tmp_path_factory.mktemp("dispatch") / "store")
    mp.spawn(_worker, args=(store, out), nprocs=2, join=True)
    return dict(out)


@pytest.mark.timeout(120)
def test_a_rank_whose_experts_get_no_token_still_joins_the_backward(two_ranks):
    for rank in (0, 1):
        shape, grad, expert_grad = two_ranks[rank]["starved"]
        assert shape == (5, 8) and grad > 0 and expert_grad, (rank, two_ranks[rank])


@pytest.mark.timeout(120)
def test_ep2_on_gpt_oss_experts_is_transformers_own_forward_and_backward(two_ranks):
    for rank in (0, 1):
        diffs = two_ranks[rank]["gpt_oss"]
        assert diffs.pop("moved") > 0.1, "the experts produce a real output"
        assert set(diffs) == {"output", "input grad", "gate_up_proj", "down_proj", "gate_up_proj_bias",
                              "down_proj_bias"}
        assert max(diffs.values()) < 1e-5, (rank, diffs)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_grouped_experts_are_transformers_per_expert_loop(family):
    """ExpertParallelExperts runs its experts as grouped matrix products (`grouped_linear`): at ep=1 (expert LoRA)
    its output and every gradient equal transformers' eager experts, a loop over the experts, with an expert that
    gets no token (GPT-OSS: transposed weights, biases, interleaved gate/up)."""
    import importlib

    from prl.trainer.moe import ExpertParallelExperts, is_fused_experts
    from tests.tiny_model import tiny_moe_config

    config = tiny_moe_config(family, hidden_size=32, moe_intermediate_size=16)
    config._experts_implementation = "eager"
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    ref = next(c for n, c in vars(modeling).items() if n.endswith("Experts") and isinstance(c, type))(config)
    assert is_fused_experts(ref)
    torch.manual_seed(0)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    grouped = ExpertParallelExperts(ref, ep=1, ep_rank=0, group=None)
    hidden = torch.randn(9, 32)
    index = torch.stack([torch.randperm(ref.num_experts - 1)[:2] for _ in range(9)])  # the last expert: no token
    weights = torch.softmax(torch.randn(9, 2), dim=-1)
    x_ref, x_grouped = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    y_ref, y_grouped = ref(x_ref, index, weights), grouped(x_grouped, index, weights)
    (y_ref ** 2).sum().backward()
    (y_grouped ** 2).sum().backward()
    assert float(y_ref.detach().abs().max()) > 0.1
    assert torch.allclose(y_grouped, y_ref, atol=1e-5), float((y_grouped - y_ref).abs().max())
    assert torch.allclose(x_grouped.grad, x_ref.grad, atol=1e-5)
    for name in grouped.param_names:
        assert torch.allclose(getattr(grouped, name).grad, getattr(ref, name).grad, atol=1e-5), name
    assert not grouped.down_proj.grad[-1].any(), "the expert without a token has a zero gradient"
