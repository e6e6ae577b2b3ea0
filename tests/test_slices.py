"""What each vLLM worker keeps of each checkpoint tensor (prl/weights/slices.py), rule by rule: the cases read in
vLLM 0.32's loaders and seen in its TP workers (tests/test_weight_slices.py checks tp=2 against a real server)."""

from __future__ import annotations

import math

import pytest

from prl.weights.slices import Slice, Worker, slice_plan, tensor_slice, worker_numel, Dims

DENSE = {"model_type": "qwen3", "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
         "hidden_size": 64, "vocab_size": 1000}
L = "model.layers.3."


def cut(name: str, shape: tuple, config: dict = DENSE, **worker) -> Slice | None:
    return tensor_slice(name, shape, Dims.of(config), Worker(**worker))


def test_column_projections_keep_rows_and_row_projections_columns():
    assert cut(L + "mlp.gate_proj.weight", (256, 64), tp=4, tp_rank=1) == Slice(0, 64, 128)
    assert cut(L + "mlp.up_proj.weight", (256, 64), tp=4, tp_rank=3) == Slice(0, 192, 256)
    assert cut(L + "mlp.down_proj.weight", (64, 256), tp=4, tp_rank=2) == Slice(1, 128, 192)
    assert cut(L + "self_attn.o_proj.weight", (64, 128), tp=2, tp_rank=1) == Slice(1, 64, 128)
    assert cut(L + "input_layernorm.weight", (64,), tp=4, tp_rank=1) is None  # replicated
    assert cut(L + "self_attn.q_norm.weight", (16,), tp=4, tp_rank=1) is None


def test_attention_keeps_its_heads_and_shares_a_kv_head_when_tp_exceeds_them():
    assert cut(L + "self_attn.q_proj.weight", (128, 64), tp=4, tp_rank=1) == Slice(0, 32, 64)  # heads 2-3
    assert cut(L + "self_attn.k_proj.weight", (32, 64), tp=2, tp_rank=1) == Slice(0, 16, 32)  # kv head 1
    # tp 4 over 2 KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1 (vLLM groups them contiguously).
    assert [cut(L + "self_attn.v_proj.weight", (32, 64), tp=4, tp_rank=r) for r in range(4)] == [
        Slice(0, 0, 16), Slice(0, 0, 16), Slice(0, 16, 32), Slice(0, 16, 32)]
    assert cut(L + "self_attn.q_proj.bias", (128,), tp=4, tp_rank=3) == Slice(0, 96, 128)
    with pytest.raises(ValueError, match="does not divide by 3"):
        cut(L + "self_attn.q_proj.weight", (128, 64), tp=3, tp_rank=0)


def test_the_vocabulary_is_padded_to_64_over_the_whole_server():
    # 1000 rows pad to 1024: 256 per rank of 4; the last rank keeps the 232 real rows of its share.
    assert [cut("model.embed_tokens.weight", (1000, 64), tp=4, tp_rank=r) for r in range(4)] == [
        Slice(0, 0, 256), Slice(0, 256, 512), Slice(0, 512, 768), Slice(0, 768, 1000)]
    assert cut("lm_head.weight", (1000, 64), tp=2, tp_rank=1) == Slice(0, 512, 1000)


MOE = {**DENSE, "model_type": "qwen3_moe", "num_experts": 10}


def test_experts_are_tp_sliced_over_every_dp_x_tp_rank_or_whole_on_their_ep_rank():
    name = L + "mlp.experts.{}.gate_proj.weight"
    # Without EP, dp 2 x tp 2 = 4 MoE ranks slice every expert; attention stays split over tp alone.
    assert cut(name.format(7), (32, 64), MOE, tp=2, tp_rank=1, dp=2, dp_rank=1) == Slice(0, 24, 32)
    assert cut(L + "mlp.experts.7.down_proj.weight", (64, 32), MOE, tp=2, tp_rank=0, dp=2, dp_rank=1) == Slice(
        1, 16, 24)
    assert cut(L + "self_attn.q_proj.weight", (128, 64), MOE, tp=2, tp_rank=1, dp=2, dp_rank=1) == Slice(0, 64, 128)
    # With EP over 4 ranks, 10 experts place linearly: 3, 3, 2, 2.
    held = [[e for e in range(10) if cut(name.format(e), (32, 64), MOE, tp=2, tp_rank=r % 2, dp=2, dp_rank=r // 2,
                                         expert_parallel=True) is None] for r in range(4)]
    assert held == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert cut(name.format(0), (32, 64), MOE, tp=2, tp_rank=1, dp=2, dp_rank=1, expert_parallel=True) == Slice(0, 0, 0)
    assert cut(L + "mlp.gate.weight", (10, 64), MOE, tp=2, tp_rank=1) is None  # the router: replicated


MLA = {"model_type": "deepseek_v3", "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 64,
       "vocab_size": 1000, "n_routed_experts": 8}


def test_mla_splits_its_up_projections_by_rows_and_keeps_its_latent_down_projections_whole():
    """vLLM's DeepseekV2MLAAttention: q_b_proj, kv_b_proj (and q_proj without a q LoRA) ColumnParallel, o_proj
    RowParallel, the fused q_a/kv_a down-projections and their norms replicated; the MoE's router replicated,
    its shared experts a TP-split MLP."""
    assert cut(L + "self_attn.q_b_proj.weight", (8 * 24, 32), MLA, tp=4, tp_rank=1) == Slice(0, 48, 96)
    assert cut(L + "self_attn.kv_b_proj.weight", (8 * 32, 16), MLA, tp=2, tp_rank=1) == Slice(0, 128, 256)
    assert cut(L + "self_attn.q_proj.weight", (8 * 24, 64), MLA, tp=2, tp_rank=0) == Slice(0, 0, 96)
    assert cut(L + "self_attn.o_proj.weight", (64, 8 * 16), MLA, tp=2, tp_rank=1) == Slice(1, 64, 128)
    for whole in ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.q_a_layernorm.weight",
                  "self_attn.kv_a_layernorm.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias"):
        assert cut(L + whole, (24, 64), MLA, tp=2, tp_rank=1) is None, whole
    assert cut(L + "mlp.shared_experts.up_proj.weight", (32, 64), MLA, tp=2, tp_rank=1) == Slice(0, 16, 32)
    assert cut(L + "mlp.experts.5.down_proj.weight", (64, 32), MLA, tp=2, tp_rank=1) == Slice(1, 16, 32)


def test_a_family_the_rules_do_not_know_goes_whole_and_one_worker_keeps_everything():
    other = {**DENSE, "model_type": "gpt_oss"}
    layout = {L + "mlp.gate_proj.weight": (256, 64), "model.embed_tokens.weight": (1000, 64)}
    assert set(slice_plan(other, layout, Worker(tp=4, tp_rank=1)).values()) == {None}
    assert set(slice_plan(DENSE, layout, Worker()).values()) == {None}
    assert worker_numel(slice_plan(DENSE, layout, Worker(tp=4, tp_rank=3)), layout) == 64 * 64 + 232 * 64


def test_prl_plan_shows_the_transport_and_the_bytes_each_worker_receives(tmp_path, capsys):
    """`prl plan` on a model this machine sees: the shares the slice rules give each worker of a tp=2 server,
    the whole step for tp=1, and why not where the model's files are not here."""
    import json

    from prl.cli import main
    from prl.planner.prepare import weight_shares
    from prl.trainer.tiny_model import build_tiny_model
    from prl.weights.layout import checkpoint_layout
    from testkit.plans import REPO, local_plan

    model = build_tiny_model(tmp_path / "tiny", hidden_size=64, num_heads=2, num_kv_heads=2, vocab_size=512)
    layout = checkpoint_layout(model)
    whole = 4 * sum(math.prod(shape) for shape in layout.values())  # float32
    (one,), why = weight_shares(local_plan(tmp_path / "run1", model))
    assert (one.most, one.least, one.whole, why) == (whole, whole, whole, "")
    (two,), _ = weight_shares(local_plan(tmp_path / "run2", model, ["inference.tp=2"]))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    # Each of the two keeps half of every projection, norms whole, and its rows of the vocabulary padded to 64:
    # rank 0 the first half of the padded rows, rank 1 the rest of the real ones.
    padded_half = -(-vocab // 64) * 64 // 2
    rest = sum(math.prod(s) // (1 if "norm" in n else 2) for n, s in layout.items() if "embed_tokens" not in n)
    rows = [padded_half, vocab - padded_half]
    assert (two.most, two.least) == (4 * (rest + max(rows) * 64), 4 * (rest + min(rows) * 64)), two
    assert two.whole == whole and "lm_head.weight" not in layout  # tied: the embedding is the only vocab tensor
    main(["plan", str(REPO / "configs" / "local-tiny.yaml"), f"run_dir={tmp_path / 'run3'}", f"model.path={model}",
          "inference.tp=2", "weights.transport=memory", "--no-write"])
    out = " ".join(capsys.readouterr().out.split())
    got = f"{two.least / 1e6:.3g} MB-{two.most / 1e6:.3g} MB of {whole / 1e6:.3g} MB"
    assert "weights: memory (" in out and f"each inference worker receives {got}" in out, out
    assert "(tp2: its slices)" in out
    (none, why) = weight_shares(local_plan(tmp_path / "run4", tmp_path / "elsewhere"))
    assert none == () and "not readable on this machine" in why
