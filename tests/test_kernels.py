"""Packed attention (no [T, T] mask) and chunked logprobs against the dense paths they replace.

- every CPU-runnable kernel of prl/trainer/attention.py, and the two GPU kernels' call sites (torch's
  `varlen_attn`, flash-attn's `flash_attn_varlen_func`) with a CPU stand-in of the documented signature,
  against sdpa with the dense block-causal mask: outputs and gradients;
- a tiny Qwen3 on one packed row: transformers' own sdpa (the dense mask it builds from position ids, what the
  trainer ran before) vs packed attention + the chunked logprob head (`engine.forward_logprobs`, eager and
  fused): logprobs, entropy, loss and every parameter's gradient;
- the chunked logprob/entropy function against the full-logits one, values and gradients, several chunks; its
  compiled arithmetic (`fused`, with `trainer.compile`) against the eager one;
- the kernel choice per device and dtype.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from prl.trainer import attention
from prl.trainer.attention import block_causal_mask, boundary_kwargs, cu_seqlens_of, packed_attention
from prl.trainer.logprobs import chunked_logprobs_and_entropy
from prl.trainer.loss import token_logprobs_and_entropy

LENGTHS = [5, 1, 9, 3]


def _row(lengths=LENGTHS) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def _qkv(heads=4, kv_heads=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS)
    return [torch.randn(1, h, t, d, generator=g, dtype=torch.float64, requires_grad=True)
            for h in (heads, kv_heads, kv_heads)]


def _grads(out, inputs):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return torch.autograd.grad((out * w).sum(), inputs)


def _dense_reference(q, k, v):
    mask = block_causal_mask(cu_seqlens_of(_row()), q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def test_boundaries_of_a_packed_row():
    b = boundary_kwargs(_row())
    assert b["cu_seq_lens_q"].tolist() == [0, 5, 6, 15, 18] and b["cu_seq_lens_q"].dtype == torch.int32
    assert b["max_length_k"] == 9
    # A context-parallel chunk that starts inside a sample: its first part is a sample of its own.
    assert cu_seqlens_of(torch.tensor([3, 4, 0, 1, 2])).tolist() == [0, 2, 5]


def _cpu_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """CPU stand-in for torch.nn.attention.varlen.varlen_attn as documented: [T, heads, D], causal iff (-1, 0)."""
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k
    assert int((cu_q[1:] - cu_q[:-1]).max()) == max_q
    assert window_size == (-1, 0)
    assert enable_gqa == (q.shape[1] != k.shape[1])
    return _by_sample(q, k, v, cu_q, scale)


def _cpu_flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
    """CPU stand-in for flash_attn.flash_attn_varlen_func as documented ([T, heads, D], GQA by head count)."""
    assert causal and dropout_p == 0.0 and cu_q.dtype == torch.int32 and max_q == max_k
    return _by_sample(q, k, v, cu_q, softmax_scale)


def _by_sample(q, k, v, cu, scale):
    b = cu.tolist()
    outs = [F.scaled_dot_product_attention(*(t[x:y].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                           scale=scale, enable_gqa=True).transpose(0, 1)
            for x, y in zip(b[:-1], b[1:])]
    return torch.cat(outs)


@pytest.fixture
def gpu_kernels_on_cpu(monkeypatch):
    """The `varlen` and `flash` call sites, with CPU stand-ins for the CUDA kernels they call."""
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", _cpu_varlen_attn)
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_cpu_flash_varlen))


@pytest.mark.parametrize("kernel", ["per_sample", "varlen", "flash", "dense"])
def test_each_kernel_matches_the_dense_mask_outputs_and_gradients(kernel, gpu_kernels_on_cpu):
    q, k, v = _qkv()
    b = boundary_kwargs(_row())
    out = packed_attention(q, k, v, b["cu_seq_lens_k"], b["max_length_k"], kernel=kernel)
    ref = _dense_reference(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for g, r in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v)), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_a_row_of_one_sample_is_plain_causal_attention():
    q, k, v = _qkv()
    cu = torch.tensor([0, q.shape[2]], dtype=torch.int32)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(packed_attention(q, k, v, cu, q.shape[2], kernel="per_sample"), want)


def test_the_kernel_follows_device_dtype_and_what_is_installed(gpu_kernels_on_cpu, monkeypatch):
    choose = attention.choose_kernel.__wrapped__
    assert choose("cpu", torch.float32) == "per_sample"
    assert choose("cpu", torch.bfloat16) == "per_sample"
    assert choose("cuda", torch.float32) == "per_sample"  # the varlen kernels are half precision only
    assert choose("cuda", torch.bfloat16) == "flash"
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed: import fails
    assert choose("cuda", torch.bfloat16) == "varlen"


def test_chunked_logprobs_match_full_logits_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    t, h, vocab = 37, 16, 50
    hidden = torch.randn(t, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, h, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (t,), generator=g)
    a, b = torch.randn(t, generator=g, dtype=torch.float64), torch.randn(t, generator=g, dtype=torch.float64)
    logp, ent = chunked_logprobs_and_entropy(hidden, weight, targets, chunk=8)  # 5 chunks, the last short
    ref_logp, ref_ent = token_logprobs_and_entropy(hidden @ weight.t(), targets)
    torch.testing.assert_close(logp, ref_logp.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent.float(), rtol=1e-6, atol=1e-6)
    got = torch.autograd.grad((logp * a).sum() + (ent * b).sum(), (hidden, weight))
    ref = torch.autograd.grad((ref_logp * a).sum() + (ref_ent * b).sum(), (hidden, weight))
    for x, y in zip(got, ref, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)  # both sides compute in fp32


@pytest.mark.parametrize("tokens", [37, 41])  # the last chunk of 8 rows has 5, then 1 (a compiled shape of its own)
def test_the_fused_head_matches_the_eager_one_values_and_gradients(tokens):
    """trainer.compile's head: the per-chunk arithmetic compiled (one max and one pass of sums forward, one
    elementwise expression backward) against the eager ops, in fp32, every chunk length a step meets."""
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (tokens,), generator=g)
    a, b = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)
    got = {}
    for fused in (False, True):
        logp, ent = chunked_logprobs_and_entropy(hidden, weight, targets, chunk=8, fused=fused)
        got[fused] = (logp, ent, *torch.autograd.grad((logp * a).sum() + (ent * b).sum(), (hidden, weight)))
    for name, x, y in zip(("logp", "entropy", "d hidden", "d weight"), got[True], got[False], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _tiny_qwen3():
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(config).to(torch.float64)


@pytest.mark.parametrize("fused", [False, True], ids=["eager head", "fused head"])
def test_a_packed_row_through_the_model_matches_transformers_dense_mask_losses_and_grads(fused):
    import copy

    from prl.trainer.attention import install_packed
    from prl.trainer.engine import forward_logprobs

    dense = _tiny_qwen3()
    packed = copy.deepcopy(dense)
    assert install_packed(packed)
    pos = _row()
    ids = torch.randint(0, 96, (pos.shape[0],), generator=torch.Generator().manual_seed(2))
    x = {"input_ids": ids, "position_ids": pos, "full_position_ids": pos, "targets": torch.roll(ids, -1)}
    mask = (pos != 0).roll(-1).float()  # a sample's last position predicts nothing of its own
    # Today's path: transformers' sdpa, whose mask it builds densely from the restarting position ids.
    logits = dense(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
    ref_logp, ref_ent = token_logprobs_and_entropy(logits, x["targets"])
    _, logp, ent = forward_logprobs(packed, x, 0.0, fused=fused)
    assert logp.dtype == torch.float32 and logp.shape == ref_logp.shape
    torch.testing.assert_close(logp, ref_logp.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent.float(), rtol=1e-6, atol=1e-6)
    loss, ref_loss = -(logp * mask).sum() + 0.1 * ent.sum(), -(ref_logp * mask).sum() + 0.1 * ref_ent.sum()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    loss.backward()
    ref_loss.backward()
    for (name, p), r in zip(packed.named_parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("head", ["chunked head", "full logits"])
def test_the_trainer_logprobs_are_at_the_sampling_temperature(monkeypatch, head):
    """`training.temperature`: the logprobs and entropy of logits / T (what the servers sample from and report,
    `--logprobs-mode processed_logprobs`), values and gradients, by both heads."""
    from prl.trainer import engine

    model = _tiny_qwen3()
    if head == "full logits":
        monkeypatch.setattr(engine, "supports_chunked_head", lambda m: False)
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(24)
    x = {"input_ids": ids, "position_ids": pos, "full_position_ids": pos, "targets": torch.roll(ids, -1)}
    logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0] / 0.7
    ref_logp, ref_ent = token_logprobs_and_entropy(logits, x["targets"])
    (ref_logp.sum() + ref_ent.sum()).backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _, logp, ent = engine.forward_logprobs(model, x, 0.0, temperature=0.7)
    torch.testing.assert_close(logp, ref_logp.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent.float(), rtol=1e-6, atol=1e-6)
    (logp.sum() + ent.sum()).backward()
    for (name, p), r in zip(model.named_parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, r, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    untempered = token_logprobs_and_entropy(logits * 0.7, x["targets"])[0]
    assert (logp - untempered.float()).abs().max() > 1e-2, "the temperature changed nothing"


def _fsdp_grads_and_layer_calls(model, checkpointing: bool, mesh) -> tuple[dict[str, torch.Tensor], list[int]]:
    """One forward/backward of `model` under FSDP2 (prl's apply_fsdp) on one packed row; each layer's MLP runs."""
    from prl.trainer.attention import install_packed
    from prl.trainer.engine import forward_logprobs
    from prl.trainer.parallel import apply_fsdp

    install_packed(model)
    cfg = types.SimpleNamespace(activation_checkpointing=checkpointing, precision="fp32", compile=False)
    apply_fsdp(model, cfg, types.SimpleNamespace(device=torch.device("cpu"), mesh=mesh, expert_mesh=None))
    calls = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        # A pre-hook: the recomputation stops as soon as the last saved tensor is back (torch's early stop).
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    model.train()
    pos = _row()
    ids = torch.randint(0, 96, (pos.shape[0],), generator=torch.Generator().manual_seed(3))
    x = {"input_ids": ids, "position_ids": pos, "full_position_ids": pos, "targets": torch.roll(ids, -1)}
    _, logp, ent = forward_logprobs(model, x, 0.0)
    (-logp.sum() + 0.1 * ent.sum()).backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}, calls


def test_activation_checkpointing_recomputes_every_layer_under_fsdp2_with_the_same_gradients(tmp_path):
    """trainer.activation_checkpointing: each transformer block's forward runs again in the backward (its
    activations were not kept), under FSDP2 and packed attention, and the gradients are unchanged."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", torch.arange(1), mesh_dim_names=("dp_shard_cp",))
        model = _tiny_qwen3()
        plain_grads, plain_calls = _fsdp_grads_and_layer_calls(copy.deepcopy(model), False, mesh)
        ac_grads, ac_calls = _fsdp_grads_and_layer_calls(model, True, mesh)
    finally:
        dist.destroy_process_group()
    assert plain_calls == [1, 1] and ac_calls == [2, 2]
    assert ac_grads.keys() == plain_grads.keys()
    for name, g in ac_grads.items():
        torch.testing.assert_close(g, plain_grads[name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_a_torch_varlen_without_enable_gqa_gets_the_kv_heads_repeated(monkeypatch):
    """torch 2.11's `varlen_attn` (a GPU image's) has no `enable_gqa`: the call site repeats KV heads itself."""
    import torch.nn.attention.varlen as varlen

    def no_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert q.shape[1] == k.shape[1] == v.shape[1] and window_size == (-1, 0)
        return _by_sample(q, k, v, cu_q, scale)

    monkeypatch.setattr(varlen, "varlen_attn", no_gqa)
    attention._varlen_takes_gqa.cache_clear()
    try:
        q, k, v = _qkv()
        b = boundary_kwargs(_row())
        out = packed_attention(q, k, v, b["cu_seq_lens_k"], b["max_length_k"], kernel="varlen")
        torch.testing.assert_close(out, _dense_reference(q, k, v), rtol=1e-10, atol=1e-10)
    finally:
        attention._varlen_takes_gqa.cache_clear()


def test_trainer_compile_compiles_each_transformer_block_in_place_before_fsdp2(tmp_path):
    """trainer.compile: every decoder block is compiled in place (its class and parameter names unchanged, so
    checkpoints, publish and the LoRA/EP code see the same model) and then sharded; the root is not compiled.
    Its speed and numbers were measured on a GPU (docs/trainer.md); on CPU it is refused at plan time, and a
    compile of even a tiny model takes minutes here, so no forward runs in this test."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

    from prl.trainer.parallel import apply_fsdp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", torch.arange(1), mesh_dim_names=("dp_shard_cp",))
        model = _tiny_qwen3()
        names = [n for n, _ in model.named_parameters()]
        cfg = types.SimpleNamespace(activation_checkpointing=False, precision="fp32", compile=True)
        apply_fsdp(model, cfg, types.SimpleNamespace(device=torch.device("cpu"), mesh=mesh, expert_mesh=None))
    finally:
        dist.destroy_process_group()
    assert all(layer._compiled_call_impl is not None and isinstance(layer, FSDPModule) for layer in model.model.layers)
    assert model._compiled_call_impl is None and model.model.norm._compiled_call_impl is None
    assert [n for n, _ in model.named_parameters()] == names
