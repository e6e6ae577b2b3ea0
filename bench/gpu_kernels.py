"""The trainer's packed-attention kernels and chunked logprob head on a GPU, against the dense paths they replace.

    python bench/gpu_kernels.py             # one GPU, bf16: checks, then times; about a minute on an H200
    python bench/gpu_kernels.py --smoke     # CPU, fp32, small shapes: checks the code path (a few seconds)

Checks first (the script exits 1 on a failed one, after printing every result):
- each packed kernel prl/trainer/attention.py can pick on this device (torch's `varlen_attn`, flash-attn's
  varlen function when installed, one sdpa call per sample) on a ragged packed row of Qwen3-0.6B's attention
  shape (16 query heads, 8 KV heads, head dim 128), bf16: its output and q/k/v gradients against sdpa with the
  dense block-causal mask computed in fp32. A kernel passes when its error is within 2x (plus a bf16 ulp) of
  the error of the dense mask itself run in bf16: as exact as the path it replaces.
- the chunked logprob/entropy head (prl/trainer/logprobs.py), eager and with its per-chunk arithmetic compiled
  (`fused`, what `trainer.compile` runs), against full [T, V] logits in fp64, bf16 hidden states and weight:
  logprobs, entropy and their gradients, within 2x (plus an ulp) of the full logits' own error in bf16.
- prl's MoE experts (`ExpertParallelExperts` at ep=1: grouped matrix products, `grouped_linear` in
  prl/trainer/moe.py) against transformers' eager experts (a loop over the experts) in fp64: output, input
  and weight gradients, in bf16 (torch's grouped_mm) and on the GPU also in fp32 (transformers' fallback op,
  what `trainer.precision: fp32` runs); within 2x (plus an ulp) of the loop's own error in that dtype.

Then times (CUDA events; median of 10 after 3 warm-ups):
- attention forward + backward of 8 equal samples per row at 16k and 64k tokens: each kernel, and the dense
  mask at 16k (at 64k its [T, T] mask alone is 4 GiB and sdpa's masked path does not fit well);
  ratio dense / kernel.
- the logprob head on 16k tokens x 151,936 vocabulary (Qwen3's), hidden 1024, forward + backward: time and
  peak memory above the inputs, full logits, chunks of 2^24 to 2^30 logit elements and the default chunk
  fused (compiled before it is timed); ratios to full.
- one MoE layer's experts of Qwen3-30B-A3B's shape (128 experts top-8, hidden 2048, expert width 768) on
  16k tokens, forward + backward: transformers' eager loop vs prl's grouped experts; ratio loop / grouped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from prl.trainer.attention import block_causal_mask, cu_seqlens_of, packed_attention  # noqa: E402
from prl.trainer.logprobs import CHUNK_ELEMENTS, chunk_tokens, chunked_logprobs_and_entropy  # noqa: E402
from prl.trainer.loss import token_logprobs_and_entropy  # noqa: E402

RAGGED = [700, 1, 1500, 333, 64, 1490]  # a packed row: long, one-token and short samples


def kernels_here(device: torch.device) -> list[str]:
    """The packed kernels that run on `device` (the GPU ones only where their library has them)."""
    names = ["per_sample"]
    if device.type == "cuda":
        from torch.nn.attention import varlen

        if hasattr(varlen, "varlen_attn"):
            names.insert(0, "varlen")
        try:
            import flash_attn  # noqa: F401

            names.insert(0, "flash")
        except ImportError:
            pass
    return names


def qkv(lengths: list[int], device, dtype, heads=16, kv_heads=8, dim=128, seed=0) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    t = sum(lengths)
    return [torch.randn(1, h, t, dim, generator=g, device=device, dtype=dtype).requires_grad_()
            for h in (heads, kv_heads, kv_heads)]


def row(lengths: list[int], device) -> tuple[torch.Tensor, int]:
    pos = torch.cat([torch.arange(n, device=device) for n in lengths])
    return cu_seqlens_of(pos).to(torch.int32), max(lengths)


def dense(q, k, v, cu) -> torch.Tensor:
    mask = block_causal_mask(cu, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def out_and_grads(fn, inputs: list[torch.Tensor], w: torch.Tensor) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad((out.float() * w).sum(), leaves)
    return [out.detach().float(), *(g.float() for g in grads)]


def max_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    return [float((a - b).abs().max()) for a, b in zip(got, want, strict=True)]


def check_attention(device, dtype) -> bool:
    lengths = RAGGED if device.type == "cuda" else [40, 1, 75, 9]
    inputs = qkv(lengths, device, dtype)
    cu, longest = row(lengths, device)
    w = torch.randn(inputs[0].shape, generator=torch.Generator(device=device).manual_seed(1), device=device)
    want = out_and_grads(lambda q, k, v: dense(q.double(), k.double(), v.double(), cu), inputs, w)
    base = max_err(out_and_grads(lambda q, k, v: dense(q, k, v, cu), inputs, w), want)
    ulp = torch.finfo(dtype).eps
    print(f"attention check, {sum(lengths)} tokens in {len(lengths)} samples, {str(dtype)[6:]}; max |error| of "
          f"(out, dq, dk, dv) vs the dense mask in fp64:")
    print(f"  dense mask, {str(dtype)[6:]:8s}  " + "  ".join(f"{e:.2e}" for e in base))
    ok = True
    for name in kernels_here(device):
        try:
            errs = max_err(out_and_grads(lambda q, k, v: packed_attention(q, k, v, cu, longest, kernel=name),
                                         inputs, w), want)
        except Exception as e:  # noqa: BLE001 - a kernel this torch cannot run is reported, the others still run
            print(f"  {name:18s}  FAILED: {type(e).__name__}: {e}")
            ok = False
            continue
        passed = all(e <= 2 * b + ulp for e, b in zip(errs, base, strict=True))
        ok &= passed
        print(f"  {name:18s}  " + "  ".join(f"{e:.2e}" for e in errs) + ("  ok" if passed else "  FAILED"))
    return ok


def check_logprobs(device, dtype) -> bool:
    t, hidden_size, vocab = (2048, 256, 32000) if device.type == "cuda" else (64, 32, 500)
    g = torch.Generator(device=device).manual_seed(2)
    hidden = torch.randn(t, hidden_size, generator=g, device=device).to(dtype)
    weight = (0.05 * torch.randn(vocab, hidden_size, generator=g, device=device)).to(dtype)
    targets = torch.randint(0, vocab, (t,), generator=g, device=device)
    a, b = torch.randn(t, generator=g, device=device), torch.randn(t, generator=g, device=device)

    def run(fn, precision):
        h, w = (x.to(precision).requires_grad_() for x in (hidden, weight))
        logp, ent = fn(h, w)
        grads = torch.autograd.grad((logp * a).sum() + (ent * b).sum(), (h, w))
        return [logp.detach().double(), ent.detach().double(), *(x.double() for x in grads)]

    want = run(lambda h, w: token_logprobs_and_entropy(h @ w.t(), targets), torch.float64)
    base = max_err(run(lambda h, w: token_logprobs_and_entropy(h @ w.t(), targets), dtype), want)
    ulp = torch.finfo(dtype).eps
    print(f"logprob head check, {t} tokens x {vocab} vocabulary, {str(dtype)[6:]}; max |error| of (logp, entropy, "
          f"d hidden, d weight) vs full logits in fp64:")
    print(f"  full logits, {str(dtype)[6:]:8s}  " + "  ".join(f"{e:.2e}" for e in base))
    ok = True
    for name, fused in (("chunked", False), ("chunked, fused", True)):  # fused: compiled, as trainer.compile runs it
        errs = max_err(run(lambda h, w: chunked_logprobs_and_entropy(h, w, targets, chunk=t // 3 + 1, fused=fused),
                           dtype), want)
        good = all(e <= 2 * x + ulp * float(r.abs().max()) for e, x, r in zip(errs, base, want, strict=True))
        print(f"  {name:22s}" + "  ".join(f"{e:.2e}" for e in errs) + ("  ok" if good else "  FAILED"))
        ok &= good
    return ok


def experts_pair(device, experts: int, k: int, hidden: int, width: int, tokens: int, seed: int = 3):
    """transformers' eager Qwen3-MoE experts (a loop over the experts) and prl's ExpertParallelExperts at ep=1 on
    the same weights (fp32, on `device`), with `tokens` random routes: (loop, grouped, x, index, weights)."""
    import importlib

    from prl.trainer.moe import ExpertParallelExperts
    from prl.trainer.tiny_model import tiny_moe_config

    config = tiny_moe_config("qwen3_moe", hidden_size=hidden, moe_intermediate_size=width, num_experts=experts,
                             top_k=k)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    loop = importlib.import_module("transformers.models.qwen3_moe.modeling_qwen3_moe").Qwen3MoeExperts(config)
    for param in loop.parameters():
        torch.nn.init.normal_(param, std=hidden ** -0.5)
    loop = loop.to(device)
    grouped = ExpertParallelExperts(loop, ep=1, ep_rank=0, group=None)
    index = torch.stack([torch.randperm(experts - 1)[:k] for _ in range(tokens)]).to(device)  # one expert idle
    weights = torch.softmax(torch.randn(tokens, k), -1).to(device)
    return loop, grouped, torch.randn(tokens, hidden, device=device), index, weights


def experts_out_and_grads(module, x, index, weights, dtype) -> list[torch.Tensor]:
    module = module.to(dtype)
    module.zero_grad()
    xi = x.to(dtype, copy=True).requires_grad_()
    out = module(xi, index, weights.to(dtype))
    out.backward(torch.ones_like(out) / out.shape[0])
    return [t.detach().double() for t in (out, xi.grad, module.gate_up_proj.grad, module.down_proj.grad)]


def check_experts(device, dtype) -> bool:
    loop, grouped, x, index, weights = experts_pair(device, 16, 4, 256, 128, 1024 if device.type == "cuda" else 96)
    want = experts_out_and_grads(loop, x, index, weights, torch.float64)
    dtypes = [dtype] + ([torch.float32] if device.type == "cuda" and dtype != torch.float32 else [])
    print(f"experts check, 16 experts top-4 (one idle), {x.shape[0]} tokens; max |error| of (out, dx, d gate_up, "
          f"d down) vs the loop in fp64:")
    ok = True
    for precision in dtypes:
        base = max_err(experts_out_and_grads(loop, x, index, weights, precision), want)
        errs = max_err(experts_out_and_grads(grouped, x, index, weights, precision), want)
        ulp = torch.finfo(precision).eps
        passed = all(e <= 2 * b + ulp * float(r.abs().max()) for e, b, r in zip(errs, base, want, strict=True))
        ok &= passed
        print(f"  loop, {str(precision)[6:]:8s}        " + "  ".join(f"{e:.2e}" for e in base))
        print(f"  grouped, {str(precision)[6:]:8s}     " + "  ".join(f"{e:.2e}" for e in errs)
              + ("  ok" if passed else "  FAILED"))
    return ok


def time_experts(device, dtype) -> None:
    loop, grouped, x, index, weights = experts_pair(device, 128, 8, 2048, 768, 16384)
    ms = {name: cuda_time(lambda m=m: experts_out_and_grads(m, x, index, weights, dtype))
          for name, m in (("loop", loop), ("grouped", grouped))}
    print(f"experts forward + backward, 128 experts top-8, hidden 2048, width 768, 16384 tokens, {str(dtype)[6:]}: "
          f"loop {ms['loop']:.1f} ms, grouped {ms['grouped']:.1f} ms ({ms['loop'] / ms['grouped']:.1f}x)")


def cuda_time(fn, warmup=3, reps=10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_attention(device, dtype) -> None:
    print("attention forward + backward, 8 equal samples per row (ms; dense / kernel):")
    for tokens in (16384, 65536):
        lengths = [tokens // 8] * 8
        inputs = qkv(lengths, device, dtype)
        cu, longest = row(lengths, device)
        w = torch.randn(inputs[0].shape, device=device, dtype=dtype)
        step = {name: (lambda name=name: out_and_grads(
            lambda q, k, v: packed_attention(q, k, v, cu, longest, kernel=name), inputs, w))
            for name in kernels_here(device)}
        if tokens <= 16384:
            step["dense mask"] = lambda: out_and_grads(lambda q, k, v: dense(q, k, v, cu), inputs, w)
        ms = {}
        for name, fn in step.items():
            try:
                ms[name] = cuda_time(fn)
            except Exception as e:  # noqa: BLE001 - reported by the check above already
                print(f"  {tokens:6d} tokens: {name} failed: {type(e).__name__}: {e}")
        ref = ms.get("dense mask")
        print(f"  {tokens:6d} tokens: " + ", ".join(
            f"{n} {t:.2f}" + (f" ({ref / t:.1f}x)" if ref and n != "dense mask" else "") for n, t in ms.items()))
        del inputs, w
        torch.cuda.empty_cache()


def time_logprobs(device, dtype) -> None:
    t, hidden_size, vocab = 16384, 1024, 151936
    hidden = torch.randn(t, hidden_size, device=device, dtype=dtype).requires_grad_()
    weight = (0.02 * torch.randn(vocab, hidden_size, device=device)).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (t,), device=device)

    def step(fn):
        logp, ent = fn()
        torch.autograd.grad(logp.sum() + ent.sum(), (hidden, weight))

    ways = {"full logits": lambda: token_logprobs_and_entropy(hidden @ weight.t(), targets)}
    for elements in (2**24, 2**26, 2**28, 2**30):  # the CPU's chunk, the GPU's (prl.trainer.logprobs), around
        n = chunk_tokens(vocab) * elements // CHUNK_ELEMENTS["cpu"]
        ways[f"chunks of {n}"] = lambda n=n: chunked_logprobs_and_entropy(hidden, weight, targets, chunk=n)
    n = chunk_tokens(vocab, device.type)  # trainer.compile's head: the default chunk, its arithmetic compiled
    ways[f"chunks of {n}, fused"] = lambda: chunked_logprobs_and_entropy(hidden, weight, targets, chunk=n, fused=True)
    res = {}
    for name, fn in ways.items():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step(lambda: fn())
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30
        res[name] = (cuda_time(lambda: step(fn)), peak)
    tf, mf = res["full logits"]
    print(f"logprob head, {t} tokens x {vocab} vocabulary, hidden {hidden_size}, {str(dtype)[6:]}, fwd + bwd "
          f"(the default chunk on this device: {chunk_tokens(vocab, device.type)} tokens):")
    for name, (tc, mc) in res.items():
        print(f"  {name:23s} {tc:7.1f} ms {mc:6.2f} GiB above the inputs; / full logits: time {tc / tf:.2f}x, "
              f"memory {mc / mf:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, small shapes: the checks only")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("gpu_kernels.py needs a CUDA GPU (use --smoke to check the code path on CPU)")
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke)"
    print(f"{name}, torch {torch.__version__}; packed kernels here: {', '.join(kernels_here(device))}")
    ok = check_attention(device, dtype)
    ok &= check_logprobs(device, dtype)
    ok &= check_experts(device, dtype)
    if device.type == "cuda":
        time_attention(device, dtype)
        time_logprobs(device, dtype)
        time_experts(device, dtype)
    if not ok:
        sys.exit("a check FAILED (above)")


if __name__ == "__main__":
    main()
