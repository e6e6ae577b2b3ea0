"""Trainer throughput vs a plain single-process transformers forward/backward.

    python bench/bench_trainer.py [--nproc 1] [--steps 4] [--hidden 256] [--layers 4] [--samples 16] [--len 256]

Builds a Qwen3-style model in-process, publishes `--steps` rollout batches,
runs `python -m prl.trainer` on them (torchrun with `--nproc` CPU ranks) and
reads tokens/s (training compute only: forward, loss, backward, optimizer)
from metrics.jsonl, skipping the first step (warm-up). The baseline runs the
same model on the same packed micro-batches in this process: transformers'
own cross-entropy loss (labels=), backward, AdamW step. Prints both and the
ratio trainer / plain, plus the trainer's whole-step rate (with publish).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from prl.run.batch import Sample, publish_batch, read_batch  # noqa: E402
from prl.run.rundir import RunDir  # noqa: E402
from tests.plans import write_plan  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402
from tests.trainer_helpers import launch, make_plan  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--micro-batch-tokens", type=int, default=1024)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_tiny_model(
            tmp / "model",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.hidden // 64,
            num_kv_heads=max(1, args.hidden // 128),
            head_dim=64,
        )
        vocab = int(__import__("json").loads((model_dir / "config.json").read_text())["vocab_size"])
        run = write_plan(RunDir(tmp / "run"), make_plan(
            model_dir,
            tmp / "run",
            world_size=args.nproc,
            max_steps=args.steps,
            checkpoint_interval=0,
            micro_batch_tokens=args.micro_batch_tokens,
            lr=1e-5,
            max_off_policy_steps=args.steps,
        ))
        for s in range(1, args.steps + 1):
            publish_batch(
                run,
                s,
                samples(s, args.samples, args.len, vocab),
                dp_size=args.nproc,
                micro_batch_tokens=args.micro_batch_tokens,
            )
        # Same cores for both sides: the trainer's ranks share them.
        threads = max(1, torch.get_num_threads() // args.nproc)
        launch(run, args.nproc, resume="none", timeout=1800, threads=threads)
        m = run.read_metrics("trainer")[1:]
        trainer = statistics.median(r["tokens_per_s"] for r in m)
        whole = statistics.median(r["tokens"] / r["step_s"] for r in m)
        plain = plain_tokens_per_s(model_dir, run, args.steps, args.micro_batch_tokens)
    print(
        f"model hidden {args.hidden} x {args.layers} layers; {args.samples} samples/step of <= {args.len} tokens; "
        f"{args.nproc} trainer rank(s); median over steps 2..{args.steps}"
    )
    print(f"  trainer (train compute) {trainer:10.0f} tokens/s")
    print(f"  trainer (whole step)    {whole:10.0f} tokens/s  (incl. weight publish, metrics)")
    print(f"  plain transformers      {plain:10.0f} tokens/s")
    print(f"ratio trainer/plain = {trainer / plain:.2f}")


if __name__ == "__main__":
    main()
