"""Expert parallelism throughput: the trainer with ep=2 vs the same MoE without EP, on the same 2 CPU ranks.

    python bench/bench_moe.py [--family qwen3_moe] [--steps 4] [--hidden 256] [--layers 4] [--experts 8]
                              [--top-k 2] [--samples 16] [--len 256] [--micro-batch-tokens 1024]

Builds an MoE of `--family` (prl/trainer/tiny_model.py MOE_FAMILIES) in-process, publishes `--steps` rollout batches, runs `python -m prl.trainer`
twice under torchrun with 2 gloo ranks: ep=1 (every rank holds every expert, FSDP-sharded) and
ep=2 (each rank holds half of the experts; tokens move with all-to-all). Reads tokens/s
(training compute: forward, loss, backward, optimizer) from metrics.jsonl, median over steps
2..N (step 1 warms up), and prints both and the ratio ep2 / ep1 measured in this run.

    python bench/bench_moe.py --experts-kernel [--tokens 4096]

One process, no trainer: forward and backward of one MoE layer's experts on `--tokens` tokens, prl's
ExpertParallelExperts at ep=1 (its experts as grouped matrix products, `grouped_linear` in prl/trainer/moe.py)
against transformers' eager experts on the same weights (a Python loop over the experts, what prl ran before),
for 8 experts top-2, 32 top-4 and 128 top-8 (one expert idle; the layer bench/gpu_kernels.py checks and times on
a GPU); medians of 4 after a warm-up, and the largest relative difference of the output and the gradients (they
must agree).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_trainer import samples  # noqa: E402
from prl.run.batch import publish_batch  # noqa: E402
from prl.run.rundir import RunDir  # noqa: E402
from testkit.plans import write_plan  # noqa: E402
from prl.trainer.tiny_model import MOE_FAMILIES, build_tiny_moe  # noqa: E402
from testkit.trainer_helpers import launch, make_plan  # noqa: E402


def run_once(tmp: Path, model: Path, ep: int, args, vocab: int) -> list[dict]:
    root = tmp / f"run-ep{ep}"
    plan = make_plan(model, root, world_size=2, max_steps=args.steps, checkpoint_interval=0,
                     micro_batch_tokens=args.micro_batch_tokens, lr=1e-5, max_off_policy_steps=args.steps,
                     overrides=[f"trainer.ep={ep}"])
    run = write_plan(RunDir(root), plan)
    for s in range(1, args.steps + 1):
        publish_batch(run, s, samples(s, args.samples, args.len, vocab), dp_size=2,
                      micro_batch_tokens=args.micro_batch_tokens)
    launch(run, 2, resume="none", timeout=3600, threads=1)
    return run.read_metrics("trainer")[1:]


def moe_arguments(family: str) -> argparse.ArgumentParser:
    """The model and batch options of the MoE benches (this one, bench_router_replay.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=MOE_FAMILIES, default=family)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--micro-batch-tokens", type=int, default=1024)
    return ap


def build_model(tmp: Path, args) -> Path:
    """The MoE the options describe, in `tmp/model`."""
    return build_tiny_moe(tmp / "model", family=args.family, hidden_size=args.hidden, num_layers=args.layers,
                          num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 128), head_dim=64,
                          num_experts=args.experts, top_k=args.top_k, moe_intermediate_size=args.hidden * 2)


def experts_kernel(tokens: int) -> None:
    import time

    import torch

    from bench.gpu_kernels import experts_out_and_grads, experts_pair

    for experts, k, hidden in ((8, 2, 256), (32, 4, 256), (128, 8, 512)):
        loop, grouped, x, index, weights = experts_pair(torch.device("cpu"), experts, k, hidden, 128, tokens)
        times: dict[str, list[float]] = {"loop": [], "grouped": []}
        for _ in range(5):
            for name, module in (("loop", loop), ("grouped", grouped)):
                start = time.perf_counter()
                result = experts_out_and_grads(module, x, index, weights, torch.float32)
                times[name].append(time.perf_counter() - start)
                module.result = result
        diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(grouped.result, loop.result))
        loop_s, grouped_s = (statistics.median(times[n][1:]) for n in ("loop", "grouped"))
        print(f"{experts:4d} experts top-{k}, hidden {hidden}, {tokens} tokens: loop {loop_s * 1e3:7.1f} ms, grouped "
              f"{grouped_s * 1e3:7.1f} ms, ratio grouped/loop {grouped_s / loop_s:.2f}; largest relative difference "
              f"{diff:.1e}")


def main() -> None:
    ap = moe_arguments("qwen3_moe")
    ap.add_argument("--experts-kernel", action="store_true", help="only the experts layer: grouped vs a loop")
    ap.add_argument("--tokens", type=int, default=4096, help="--experts-kernel: tokens")
    args = ap.parse_args()
    if args.experts_kernel:
        return experts_kernel(args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_model(tmp, args)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        rates = {ep: run_once(tmp, model, ep, args, vocab) for ep in (1, 2)}
    tps = {ep: statistics.median(r["tokens_per_s"] for r in m) for ep, m in rates.items()}
    step = {ep: statistics.median(r["tokens"] / r["step_s"] for r in m) for ep, m in rates.items()}
    print(f"{args.family} hidden {args.hidden} x {args.layers} layers, {args.experts} experts top-{args.top_k}; "
          f"{args.samples} samples/step of <= {args.len} tokens; 2 CPU ranks (gloo); median over steps 2..{args.steps}")
    for ep in (1, 2):
        print(f"  ep={ep}: train compute {tps[ep]:8.0f} tokens/s, whole step {step[ep]:8.0f} tokens/s")
    print(f"ratio ep2/ep1 = {tps[2] / tps[1]:.2f} (train compute), {step[2] / step[1]:.2f} (whole step)")


if __name__ == "__main__":
    main()
