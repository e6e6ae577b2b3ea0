"""`trainer.precision: fp8` (prl/trainer/float8.py): torchao's Float8Linear in the transformer blocks.

On CPU torch runs the float8 casts and `_scaled_mm` in software, so the numerics are the GPU's:

- which layers convert (attention projections, dense MLPs, shared experts; not embeddings, `lm_head`, routers
  or the grouped experts), parameter names unchanged;
- a packed forward/backward in float8 against fp32: close, and not equal (the float8 path really ran);
- the real trainer on 2 ranks: FSDP2's float8 all-gather (dp_shard=2, each weight scaled by the amax of the
  whole weight) equals the same run without sharding (dp_replicate=2) to fp32 rounding, while both differ
  from fp32 training; a checkpoint resumes to the uninterrupted run; EP=2 with a DeepSeek-V3 (MLA, shared
  experts) trains in float8.
"""

from __future__ import annotations

import sys

import pytest
import torch

from prl.errors import ConfigError
from tests.test_trainer_parallel import _files_state, _vocab
from tests.tiny_model import build_tiny_model, build_tiny_moe
from testkit.trainer_helpers import launch, make_plan, make_samples, setup_run

pytest.importorskip("torchao.float8", reason="the fp8 extra (scripts/test.sh installs it)")


def _float8_names(model: torch.nn.Module) -> set[str]:
    from torchao.float8.float8_linear import Float8Linear

    return {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}


def _blocks(model):
    return list(model.model.layers)


def test_the_blocks_linear_layers_convert_and_nothing_else(tmp_path):
    from transformers import AutoModelForCausalLM

    from prl.trainer.float8 import convert_blocks

    dense = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "dense"))
    keys = list(dense.state_dict())
    assert convert_blocks(_blocks(dense), gather_float8=False) == 14
    assert _float8_names(dense) == {f"model.layers.{i}.{p}" for i in (0, 1) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert list(dense.state_dict()) == keys, "checkpoints, publish and the feed see the same names"

    moe = AutoModelForCausalLM.from_pretrained(build_tiny_moe(tmp_path / "dsv3", family="deepseek_v3"))
    convert_blocks(_blocks(moe), gather_float8=False)
    names = _float8_names(moe)
    assert "model.layers.1.mlp.shared_experts.down_proj" in names and "model.layers.1.self_attn.kv_b_proj" in names
    assert not any(n.endswith((".gate", ".experts")) or "lm_head" in n or "embed" in n for n in names), names


def test_the_filter_skips_routers_and_layers_float8_matmuls_cannot_take():
    from prl.trainer.float8 import converts

    assert converts(torch.nn.Linear(64, 32), "model.layers.0.mlp.up_proj")
    assert not converts(torch.nn.Linear(64, 8), "model.layers.0.mlp.gate"), "a router"
    assert not converts(torch.nn.Linear(64, 64), "model.layers.0.mlp.router")
    assert not converts(torch.nn.Linear(64, 1), "model.layers.0.mlp.shared_expert_gate"), "not a multiple of 16"
    assert not converts(torch.nn.Linear(40, 64), "model.layers.0.self_attn.q_proj")


def test_a_packed_float8_step_is_close_to_fp32_and_not_equal(tmp_path):
    """The tiny model on one packed row of 3 samples (71 tokens: the weight gradient's inner dimension is
    padded to 80): float8 next-token distributions within KL 1e-3 of fp32's (measured 2.7e-5; logits 4.5% off
    in norm), gradients pointing the same way (cosine > 0.98; measured 0.994, 0.997), neither equal to fp32's."""
    from transformers import AutoModelForCausalLM

    from prl.trainer.attention import install_packed
    from prl.trainer.float8 import convert_blocks

    path = build_tiny_model(tmp_path / "m")
    runs = {}
    for precision in ("fp32", "fp8"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        install_packed(model)
        if precision == "fp8":
            convert_blocks(_blocks(model), gather_float8=False)
        ids = torch.randint(0, model.config.vocab_size, (1, 71), generator=torch.Generator().manual_seed(0))
        positions = torch.cat([torch.arange(n) for n in (30, 25, 16)])[None]
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        logits.float().logsumexp(-1).sum().backward()
        runs[precision] = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    (l32, g32), (l8, g8) = runs["fp32"], runs["fp8"]
    err = float((l8 - l32).norm() / l32.norm())
    lp32, lp8 = l32.log_softmax(-1), l8.log_softmax(-1)
    kl = float((lp32.exp() * (lp32 - lp8)).sum(-1).mean())
    assert 1e-5 < err < 0.1 and 0 < kl < 1e-3, (err, kl)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        cos = torch.nn.functional.cosine_similarity(g8[name].flatten(), g32[name].flatten(), dim=0)
        assert 0.98 < cos and not torch.equal(g8[name], g32[name]), (name, cos)


def test_without_torchao_the_trainer_names_the_extra(monkeypatch):
    from prl.trainer.float8 import convert_blocks

    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match=r"trainer.precision: fp8 needs torchao .*prl\[fp8\]"):
        convert_blocks([torch.nn.Linear(16, 16)], gather_float8=False)


@pytest.mark.slow  # five 2-rank torchrun runs of 2-3 steps: ~60 s on 2 shared cores
def test_float8_all_gather_equals_unsharded_float8_and_resumes(tmp_path):
    from prl.run.batch import publish_batch
    from testkit.plans import write_plan

    model = build_tiny_model(tmp_path / "model")
    vocab = _vocab(model)
    runs = {}
    for name, overrides in {"sharded": [], "replicated": ["trainer.dp_replicate=2"]}.items():
        runs[name] = setup_run(tmp_path / name, model, range(1, 4), vocab, max_steps=3, checkpoint_interval=2,
                               overrides=["trainer.precision=fp8", *overrides])
        launch(runs[name], 2, resume="none")
    fp32 = setup_run(tmp_path / "fp32", model, range(1, 4), vocab, max_steps=3, checkpoint_interval=2,
                     overrides=["trainer.precision=fp32"])
    launch(fp32, 2, resume="none")
    a, b, c = (r.read_metrics("trainer") for r in (runs["sharded"], runs["replicated"], fp32))
    assert [m["loss"] for m in a] == pytest.approx([m["loss"] for m in b], rel=1e-6, abs=1e-8)
    assert [m["grad_norm"] for m in a] == pytest.approx([m["grad_norm"] for m in b], rel=1e-5)
    assert a[0]["loss"] == pytest.approx(c[0]["loss"], rel=2e-2) and a[0]["loss"] != c[0]["loss"]
    wa, wb, wc = (_files_state(r.weights(3)) for r in (runs["sharded"], runs["replicated"], fp32))
    assert wa.keys() == wb.keys() == wc.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
    assert max(float((wa[k] - wc[k]).abs().max()) for k in wa) > 1e-3, "float8 training differs from fp32"

    # Stop after checkpoint 2 and resume: step 3 as in the uninterrupted sharded run.
    run = setup_run(tmp_path / "resumed", model, range(1, 3), vocab, max_steps=2, checkpoint_interval=2,
                    overrides=["trainer.precision=fp8"])
    launch(run, 2, resume="none")
    publish_batch(run, 3, make_samples(3, vocab), dp_size=2, micro_batch_tokens=64)
    write_plan(run, make_plan(model, run.root, max_steps=3, checkpoint_interval=2,
                              overrides=["trainer.precision=fp8"]))
    launch(run, 2, resume="latest")
    assert [m["loss"] for m in run.read_metrics("trainer")] == pytest.approx([m["loss"] for m in a], rel=1e-6)


@pytest.mark.slow  # two 2-rank torchrun runs
def test_expert_parallel_deepseek_v3_trains_in_float8(tmp_path):
    """ep=2 on a DeepSeek-V3 (MLA projections and shared experts in float8, routed experts split over the ranks
    in bf16/fp32): the step-1 loss within 2% of fp32's, the published weights load and differ from fp32's."""
    model = build_tiny_moe(tmp_path / "dsv3", family="deepseek_v3")
    vocab = _vocab(model)
    runs = {}
    for precision in ("fp8", "fp32"):
        runs[precision] = setup_run(tmp_path / precision, model, range(1, 3), vocab, max_steps=2,
                                    checkpoint_interval=0, overrides=["trainer.ep=2", f"trainer.precision={precision}"])
        launch(runs[precision], 2, resume="none")
    l8, l32 = (runs[p].read_metrics("trainer")[0]["loss"] for p in ("fp8", "fp32"))
    assert l8 == pytest.approx(l32, rel=2e-2) and l8 != l32
    w8, w32 = (_files_state(runs[p].weights(2)) for p in ("fp8", "fp32"))
    assert w8.keys() == w32.keys()
    key = "model.layers.1.mlp.shared_experts.down_proj.weight"
    assert not torch.equal(w8[key], w32[key])
