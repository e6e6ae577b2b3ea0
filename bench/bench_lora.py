"""LoRA vs full fine-tuning in one run: trainer step time and peak memory, and what each step publishes.

    python bench/bench_lora.py [--nproc 2] [--steps 4] [--hidden 512] [--layers 4] [--rank 16]

Builds a Qwen3-style model in-process, publishes `--steps` rollout batches and runs `python -m prl.trainer`
on them twice, the same batches: full fine-tuning, then `model.lora` (rank `--rank`, every attention and MLP
projection). Reads from metrics.jsonl, skipping the first step (warm-up): the median train-compute time of a
step (forward, backward, optimizer), the median publish time (the weights step written and marked STABLE),
and rank 0's peak RSS; and the bytes of the last published step on disk. Prints both and the ratios
lora / full. On CPU the peak RSS includes torch itself (some 400 MiB), so its ratio understates what LoRA
saves on a GPU, where the optimizer state and gradients of the frozen weights are most of the memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_trainer import samples  # noqa: E402
from prl.run.batch import publish_batch  # noqa: E402
from prl.run.rundir import RunDir  # noqa: E402
from tests.plans import write_plan  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402
from tests.trainer_helpers import launch, make_plan  # noqa: E402


def run_trainer(root: Path, model_dir: Path, args, overrides: list[str]) -> dict[str, float]:
    """The trainer on the batches: median train and publish seconds, peak RSS, bytes of the last weights step."""
    run = write_plan(RunDir(root), make_plan(model_dir, root, world_size=args.nproc, max_steps=args.steps,
                                             checkpoint_interval=0, micro_batch_tokens=args.micro_batch_tokens,
                                             lr=1e-4, max_off_policy_steps=args.steps, overrides=overrides))
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    for s in range(1, args.steps + 1):
        publish_batch(run, s, samples(s, args.samples, args.len, vocab), dp_size=args.nproc,
                      micro_batch_tokens=args.micro_batch_tokens)
    launch(run, args.nproc, resume="none", timeout=1800, threads=max(1, torch.get_num_threads() // args.nproc))
    m = run.read_metrics("trainer")[1:]
    last = run.weights(args.steps)
    return {"train_s": statistics.median(r["train_s"] for r in m),
            "publish_s": statistics.median(r["publish_s"] for r in m),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in m),
            "bytes": sum(p.stat().st_size for p in last.iterdir() if p.is_file())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    args.samples, args.len, args.micro_batch_tokens = 16, 256, 1024  # bench_trainer.py's defaults
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_tiny_model(tmp / "model", hidden_size=args.hidden, num_layers=args.layers,
                                     num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 128), head_dim=64)
        full = run_trainer(tmp / "full", model_dir, args, [])
        lora = run_trainer(tmp / "lora", model_dir, args, [f"model.lora.rank={args.rank}"])
    print(f"model hidden {args.hidden} x {args.layers} layers; {args.samples} samples/step of <= {args.len} tokens; "
          f"{args.nproc} trainer rank(s); LoRA rank {args.rank} on every projection; median over steps 2..{args.steps}")
    for name, r in (("full", full), ("lora", lora)):
        print(f"  {name}: train {r['train_s']:7.3f} s/step   publish {r['publish_s'] * 1000:8.1f} ms   "
              f"peak RSS {r['peak_rss_mb']:7.0f} MiB   published {r['bytes'] / 2**20:8.2f} MiB")
    print("ratio lora/full: " + ", ".join(f"{k} {lora[k] / full[k]:.3f}" for k in full))


if __name__ == "__main__":
    main()
