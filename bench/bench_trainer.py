"""Trainer throughput vs a plain single-process transformers forward/backward.

    python bench/bench_trainer.py [--nproc 1] [--steps 4] [--hidden 256] [--layers 4] [--samples 16] [--len 256]
    python bench/bench_trainer.py --activation-checkpointing     # the same, trainer run with it off and on
    python bench/bench_trainer.py --logprob-memory [--tokens 4096] [--vocab 151936] [--hidden 1024]

Builds a Qwen3-style model in-process, publishes `--steps` rollout batches,
runs `python -m prl.trainer` on them (torchrun with `--nproc` CPU ranks) and
reads tokens/s (training compute only: forward, loss, backward, optimizer)
from metrics.jsonl, skipping the first step (warm-up). The baseline runs the
same model on the same packed micro-batches in this process: transformers'
own cross-entropy loss (labels=), backward, AdamW step. Prints both and the
ratio trainer / plain, plus the trainer's whole-step rate (with publish).

`--activation-checkpointing` runs the trainer a second time with `trainer.activation_checkpointing: true`
and prints its tokens/s and rank 0's peak RSS against the first run's (the ratios on / off).

`--logprob-memory` measures the logprob/entropy head alone, each way in a fresh subprocess: hidden states
[tokens, hidden] and an output weight [vocab, hidden] (fp32) -> logprobs and entropy of the targets -> a
loss on both -> backward, as the trainer does per micro-batch. `full` is the [T, V] fp32 logits path
(`prl.trainer.loss.token_logprobs_and_entropy`), `chunked` prl/trainer/logprobs.py, `fused` the same with
its per-chunk arithmetic compiled (what `trainer.compile` runs; compiled before the clock starts). Prints
each one's peak RSS growth over the inputs (resource.getrusage in the subprocess) and time, and the ratios
chunked / full and fused / chunked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from prl.run.batch import Sample, publish_batch, read_batch  # noqa: E402
from prl.run.rundir import RunDir  # noqa: E402
from testkit.plans import write_plan  # noqa: E402
from prl.trainer.tiny_model import build_tiny_model  # noqa: E402
from testkit.trainer_helpers import launch, make_plan  # noqa: E402


def samples(step: int, n: int, length: int, vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(n):
        ln = int(torch.randint(length // 2, length + 1, (1,), generator=g))
        prompt = ln // 4
        out.append(
            Sample(
                token_ids=torch.randint(0, vocab, (ln,), generator=g).tolist(),
                loss_mask=[0] * prompt + [1] * (ln - prompt),
                inference_logprobs=[-6.0] * ln,
                advantage=float(torch.randn(1, generator=g)),
                policy_version=step - 1,
            )
        )
    return out


def plain_tokens_per_s(model_dir: Path, run: RunDir, steps: int, mbt: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rates = []
    for step in range(1, steps + 1):
        mbs = [mb for mb in read_batch(run.rollouts(step)).micro_batches(0, 1, mbt) if mb is not None]
        t = time.perf_counter()
        tokens = 0
        for mb in mbs:
            ids = torch.from_numpy(mb.input_ids).long()[None]
            labels = ids.masked_fill(torch.from_numpy(mb.loss_mask)[None] == 0, -100)
            pos = torch.from_numpy(mb.position_ids).long()[None]
            model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss.backward()
            tokens += mb.num_tokens
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        rates.append(tokens / (time.perf_counter() - t))
    return statistics.median(rates[1:] or rates)


LOGPROB_CHILD = """
import resource, sys, time, torch
from prl.trainer.logprobs import chunked_logprobs_and_entropy
from prl.trainer.loss import token_logprobs_and_entropy
way, tokens, vocab, hidden = sys.argv[1], *map(int, sys.argv[2:])
g = torch.Generator().manual_seed(0)
h = torch.randn(tokens, hidden, generator=g).div_(hidden ** 0.5).requires_grad_()
w = torch.randn(vocab, hidden, generator=g).requires_grad_()
targets = torch.randint(0, vocab, (tokens,), generator=g)
if way == "fused":  # compile outside the measured part, on 32 tokens (the compiled row count is dynamic)
    logp, ent = chunked_logprobs_and_entropy(h[:32], w, targets[:32], fused=True)
    (-logp.mean() - 0.01 * ent.mean()).backward()
    h.grad = w.grad = None
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
if way == "full":
    logp, ent = token_logprobs_and_entropy(h @ w.t(), targets)
else:
    logp, ent = chunked_logprobs_and_entropy(h, w, targets, fused=way == "fused")
(-logp.mean() - 0.01 * ent.mean()).backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024, time.perf_counter() - t)
"""


def logprob_memory(tokens: int, vocab: int, hidden: int) -> None:
    """Peak RSS growth and time of the logprob/entropy head's forward + backward: full logits, chunked, and
    chunked with the per-chunk arithmetic compiled (`trainer.compile`)."""
    import subprocess

    root = str(Path(__file__).resolve().parents[1])
    got = {}
    for way in ("full", "chunked", "fused"):
        out = subprocess.run([sys.executable, "-c", LOGPROB_CHILD, way, str(tokens), str(vocab), str(hidden)],
                             capture_output=True, text=True, check=True, env={**__import__("os").environ,
                                                                             "PYTHONPATH": root})
        got[way] = [float(v) for v in out.stdout.split()]
    print(f"logprobs + entropy, forward + backward: {tokens} tokens, vocab {vocab}, hidden {hidden} (fp32)")
    for way, (mb, s) in got.items():
        print(f"  {way:8s} peak RSS +{mb:8.0f} MiB  {s:6.2f} s")
    print(f"ratio chunked/full: memory {got['chunked'][0] / got['full'][0]:.3f}, time {got['chunked'][1] / got['full'][1]:.2f}")
    print(f"ratio fused/chunked: memory {got['fused'][0] / got['chunked'][0]:.3f}, "
          f"time {got['fused'][1] / got['chunked'][1]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--micro-batch-tokens", type=int, default=1024)
    ap.add_argument("--activation-checkpointing", action="store_true", help="also run the trainer with it on")
    ap.add_argument("--logprob-memory", action="store_true", help="only the logprob head's memory, full vs chunked")
    ap.add_argument("--tokens", type=int, default=4096, help="--logprob-memory: tokens")
    ap.add_argument("--vocab", type=int, default=151936, help="--logprob-memory: vocabulary")
    args = ap.parse_args()
    if args.logprob_memory:
        return logprob_memory(args.tokens, args.vocab, args.hidden)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_tiny_model(tmp / "model", hidden_size=args.hidden, num_layers=args.layers,
                                     num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 128), head_dim=64)
        base = trainer_run(tmp / "run", model_dir, args, [])
        ac = trainer_run(tmp / "run_ac", model_dir, args, ["trainer.activation_checkpointing=true"]) \
            if args.activation_checkpointing else None
        plain = plain_tokens_per_s(model_dir, RunDir(tmp / "run"), args.steps, args.micro_batch_tokens)
    print(
        f"model hidden {args.hidden} x {args.layers} layers; {args.samples} samples/step of <= {args.len} tokens; "
        f"micro_batch_tokens {args.micro_batch_tokens}; {args.nproc} trainer rank(s); median over steps 2..{args.steps}"
    )
    print(f"  trainer (train compute) {base[0]:10.0f} tokens/s   peak RSS {base[2]:7.0f} MiB (rank 0)")
    print(f"  trainer (whole step)    {base[1]:10.0f} tokens/s  (incl. weight publish, metrics)")
    print(f"  plain transformers      {plain:10.0f} tokens/s")
    print(f"ratio trainer/plain = {base[0] / plain:.2f}")
    if ac is not None:
        print(f"  activation checkpointing on: {ac[0]:10.0f} tokens/s   peak RSS {ac[2]:7.0f} MiB (rank 0)")
        print(f"ratio activation checkpointing on/off: tokens/s {ac[0] / base[0]:.2f}, peak RSS {ac[2] / base[2]:.2f}")


def trainer_run(root: Path, model_dir: Path, args, overrides: list[str]) -> tuple[float, float, float]:
    """The trainer on `args.steps` published batches: (train-compute tokens/s, whole-step tokens/s, peak RSS MiB)."""
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    run = write_plan(RunDir(root), make_plan(model_dir, root, world_size=args.nproc, max_steps=args.steps,
                                             checkpoint_interval=0, micro_batch_tokens=args.micro_batch_tokens,
                                             lr=1e-5, max_off_policy_steps=args.steps, overrides=overrides))
    for s in range(1, args.steps + 1):
        publish_batch(run, s, samples(s, args.samples, args.len, vocab), dp_size=args.nproc,
                      micro_batch_tokens=args.micro_batch_tokens)
    threads = max(1, torch.get_num_threads() // args.nproc)  # same cores for both sides: the ranks share them
    launch(run, args.nproc, resume="none", timeout=1800, threads=threads)
    m = run.read_metrics("trainer")[1:]
    return (statistics.median(r["tokens_per_s"] for r in m), statistics.median(r["tokens"] / r["step_s"] for r in m),
            max(r["peak_rss_mb"] for r in m))

if __name__ == "__main__":
    main()
