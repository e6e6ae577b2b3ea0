"""Bytes per weight update, whole step vs delta (`weights.delta`), over real trainer steps; and what the
delta costs the trainer's feed at publish.

    python bench/bench_weight_delta.py [--steps 20] [--nproc 1] [--hidden 256] [--layers 4]
                                       [--lrs 1e-6,1e-5,1e-4] [--dtypes bfloat16,float32]

For each published dtype and learning rate, runs `python -m prl.trainer` for `--steps` RL steps on the same
rollout batches (bench_trainer.py's), every step published to disk (the durable record a feed mirrors).
Then replays the steps through a real weight feed (`prl.weights.feed`) with deltas on: step 1 is read whole, each
later step by a reader that kept the one before, as an inference worker does; and through a feed that sends to
broadcast groups (`weights.transport: broadcast`), a group of one such worker per step. Prints, per run, the
bytes a worker reads per update (whole and delta, medians over steps 2..N; the group's broadcast bytes must
equal the delta's), their ratio, the share of elements
sent (a tensor sent whole counts whole), and the feed's publish time with deltas against without (the element-wise compare, on the
trainer). Adam moves every element by about `lr` a step, so what changes in bf16 (8 bits of mantissa) is
roughly the share of elements whose value moves past a rounding boundary: few at small learning rates,
nearly all in float32.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from bench_trainer import samples  # noqa: E402
from prl.run.batch import publish_batch  # noqa: E402
from prl.run.api import Group  # noqa: E402
from prl.weights.feed import Base, FeedReader, FeedServer  # noqa: E402
from prl.run.rundir import RunDir  # noqa: E402
from testkit.plans import write_plan  # noqa: E402
from prl.trainer.tiny_model import build_tiny_model  # noqa: E402
from testkit.trainer_helpers import launch, make_plan  # noqa: E402

KEY = b"bench-key"


def train(root: Path, model_dir: Path, args, dtype: str, lr: float) -> RunDir:
    """`args.steps` trainer steps, each step's weights published in `dtype` and kept."""
    run = write_plan(RunDir(root), make_plan(model_dir, root, world_size=args.nproc, max_steps=args.steps,
                                             checkpoint_interval=0, micro_batch_tokens=1024, lr=lr,
                                             max_off_policy_steps=args.steps, overrides=[f"model.dtype={dtype}"]))
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    for s in range(1, args.steps + 1):
        publish_batch(run, s, samples(s, 16, 256, vocab), dp_size=args.nproc, micro_batch_tokens=1024)
    launch(run, args.nproc, resume="none", timeout=1800, threads=max(1, torch.get_num_threads() // args.nproc))
    return run


def step_tensors(run: RunDir, step: int) -> list[tuple[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(run.weights(step).glob("*.safetensors")):
        tensors.update(load_file(path))
    return sorted(tensors.items())


def replay(run: RunDir, steps: int) -> dict[str, float]:
    """Each step through a delta feed, read as a worker that kept the previous step reads it, and broadcast to a
    group of one such worker."""
    whole, delta, changed, publish_on, publish_off, sent = [], [], [], [], [], []
    step_s = statistics.median(r["train_s"] + r["publish_s"] for r in run.read_metrics("trainer")[1:])
    with (FeedServer("127.0.0.1", 0, KEY, delta=True) as feed, FeedServer("127.0.0.1", 0, KEY) as plain,
          FeedServer("127.0.0.1", 0, KEY, delta=True, groups=True) as grouped):
        base = kept = None
        for s in range(1, steps + 1):
            tensors = step_tensors(run, s)
            t0 = time.perf_counter()
            plain.publish(s, tensors)
            t1 = time.perf_counter()
            feed.publish(s, tensors)
            t2 = time.perf_counter()
            grouped.publish(s, tensors)
            full_reader = FeedReader(plain.address, s, KEY, 60)
            list(full_reader)
            reader = FeedReader(feed.address, s, KEY, 60, base)
            got = dict(reader)
            kept, by_group = broadcast(grouped, s, kept)
            if s > 1:
                assert reader.delta, f"step {s} came whole"
                whole.append(full_reader.received)
                delta.append(reader.received)
                sent.append(by_group)
                elements = sum(t.numel() for _, t in tensors)
                changed.append(sum(meta.changed if meta.changed >= 0 else math.prod(meta.shape)
                                   for meta in reader.tensors) / elements)
                publish_off.append(t1 - t0)
                publish_on.append(t2 - t1)
            for name, t in tensors:  # what the worker rebuilt is the step, bit for bit, either way
                for rebuilt in (got[name], kept.tensors[name]):
                    assert torch.equal(rebuilt.view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
            base = Base(reader.id, got)
    assert sent == delta, f"the group was broadcast other bytes than the delta: {sent} vs {delta}"
    return {"whole_mb": statistics.median(whole) / 2**20, "delta_mb": statistics.median(delta) / 2**20,
            "ratio": statistics.median(d / w for d, w in zip(delta, whole)),
            "changed": statistics.median(changed),
            "encode_ratio": (statistics.median(publish_on) - statistics.median(publish_off)) / step_s}


def broadcast(feed: FeedServer, step: int, kept: Base | None) -> tuple[Base, int]:
    """`step` broadcast from `feed` to a group of one worker that kept `kept`: what it holds now, the bytes sent."""
    reader = FeedReader(feed.address, step, KEY, 60, kept, group=Group(token=os.urandom(16).hex(), world=2, rank=1, timeout=60.0))
    got = dict(reader)
    assert reader.delta == (kept is not None), f"step {step}: the group's delta is {reader.delta}"
    deadline = time.monotonic() + 60
    while not any(r["step"] == step for r in feed.group_log):  # its sender logs it once the broadcasts are done
        assert time.monotonic() < deadline, f"step {step}: the feed's sender never ended"
        time.sleep(0.01)
    [record] = [r for r in feed.group_log if r["step"] == step]
    assert "error" not in record, record
    return Base(reader.id, got), record["bytes"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lrs", default="1e-6,1e-5,1e-4")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_tiny_model(tmp / "model", hidden_size=args.hidden, num_layers=args.layers,
                                     num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 128), head_dim=64)
        for dtype in args.dtypes.split(","):
            for lr in (float(x) for x in args.lrs.split(",")):
                run = train(tmp / f"run-{dtype}-{lr:g}", model_dir, args, dtype, lr)
                rows.append((dtype, lr, replay(run, args.steps)))
    print(f"model hidden {args.hidden} x {args.layers} layers, {args.steps} trainer steps (AdamW) per row, "
          f"{args.nproc} rank(s); medians over steps 2..{args.steps}")
    print("(a group of one worker, broadcast each step, was sent exactly the delta's bytes every step)")
    print("  dtype     lr      whole MiB  delta MiB  delta/whole     elements sent  encode/step")
    for dtype, lr, r in rows:
        print(f"  {dtype:8s}  {lr:<7g} {r['whole_mb']:9.2f}  {r['delta_mb']:9.2f}  {r['ratio']:11.3f}  "
              f"{r['changed']:16.3f}  {r['encode_ratio']:11.3f}")


if __name__ == "__main__":
    main()
