"""LoRA vs full fine-tuning in one run: trainer step time and peak memory, and what each step publishes.

    python bench/bench_lora.py [--nproc 2] [--steps 4] [--hidden 512] [--layers 4] [--rank 16] [--moe]

Builds a Qwen3-style model in-process, publishes `--steps` rollout batches and runs `python -m prl.trainer`
on them twice, the same batches: full fine-tuning, then `model.lora` (rank `--rank`, every attention and MLP
projection). Reads from metrics.jsonl, skipping the first step (warm-up): the median train-compute time of a
step (forward, backward, optimizer), the median publish time (the weights step written and marked STABLE),
and rank 0's peak RSS; and the bytes of the last published step on disk. Prints both and the ratios
lora / full. On CPU the peak RSS includes torch itself (some 400 MiB), so its ratio understates what LoRA
saves on a GPU, where the optimizer state and gradients of the frozen weights are most of the memory.

`--moe`: a Qwen3-MoE of the same size (8 experts, top-2, expert width hidden / 2) and three SFT runs (an RL plan
on a CPU cluster refuses an MoE's adapters: no CPU server can serve them), the same conversations: full,
LoRA on the attention, LoRA on the attention and every expert's gate/up/down; the last step publishes (its
bytes are counted; its time is not: an SFT step publishes after its metrics record).
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

from bench_sft import write_dataset  # noqa: E402
from bench_trainer import samples  # noqa: E402
from prl.run.batch import publish_batch  # noqa: E402
from prl.run.rundir import RunDir  # noqa: E402
from testkit.plans import local_plan, write_plan  # noqa: E402
from prl.trainer.tiny_model import build_tiny_model, build_tiny_moe  # noqa: E402
from testkit.trainer_helpers import launch, make_plan  # noqa: E402


def rl_run(root: Path, model_dir: Path, args, overrides: list[str]) -> RunDir:
    """An RL trainer run on `--steps` rollout batches (bench_trainer.py's samples)."""
    run = write_plan(RunDir(root), make_plan(model_dir, root, world_size=args.nproc, max_steps=args.steps,
                                             checkpoint_interval=0, micro_batch_tokens=args.micro_batch_tokens,
                                             lr=1e-4, max_off_policy_steps=args.steps, overrides=overrides))
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    for s in range(1, args.steps + 1):
        publish_batch(run, s, samples(s, args.samples, args.len, vocab), dp_size=args.nproc,
                      micro_batch_tokens=args.micro_batch_tokens)
    return run


def sft_run(root: Path, model_dir: Path, args, overrides: list[str]) -> RunDir:
    """An SFT trainer run on `args.data`, `--samples` conversations a step, publishing at the last."""
    return write_plan(RunDir(root), local_plan(root, model_dir, [
        f"trainer.gpus_per_node={args.nproc}", f"sft.data={args.data}", f"model.max_model_len={args.len}",
        f"training.batch_size={args.samples}", f"training.max_steps={args.steps}", "training.lr=1e-4",
        f"training.micro_batch_tokens={args.micro_batch_tokens}", f"training.checkpoint_interval={args.steps}",
        *overrides], topology="sft-tiny"))


def run_trainer(root: Path, model_dir: Path, args, overrides: list[str]) -> dict[str, float]:
    """The trainer on the batches: median train and publish seconds, peak RSS, bytes of the last weights step."""
    run = (sft_run if args.moe else rl_run)(root, model_dir, args, overrides)
    launch(run, args.nproc, resume="none", timeout=1800, threads=max(1, torch.get_num_threads() // args.nproc))
    m = run.read_metrics("trainer")[1:]
    last = run.weights(args.steps)
    return {"train_s": statistics.median(r["train_s"] for r in m),
            # An SFT step publishes after its metrics record, with its checkpoint: not timed there.
            "publish_s": float("nan") if args.moe else statistics.median(r["publish_s"] for r in m),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in m),
            "bytes": sum(p.stat().st_size for p in last.iterdir() if p.is_file())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--moe", action="store_true", help="a Qwen3-MoE, SFT, adapters on attention and on experts")
    args = ap.parse_args()
    args.samples, args.len, args.micro_batch_tokens = 16, 256, 1024  # bench_trainer.py's defaults
    rank = f"model.lora.rank={args.rank}"
    attention = "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        heads = {"num_heads": args.hidden // 64, "num_kv_heads": max(1, args.hidden // 128), "head_dim": 64}
        if args.moe:
            model_dir = build_tiny_moe(tmp / "model", hidden_size=args.hidden, num_layers=args.layers,
                                       num_experts=8, moe_intermediate_size=args.hidden // 2, **heads)
            args.data = write_dataset(tmp / "chat.jsonl", n=args.samples * args.steps, turns=2)
            runs = {"full": [], "lora attention": [rank, attention], "lora +experts": [rank]}
        else:
            model_dir = build_tiny_model(tmp / "model", hidden_size=args.hidden, num_layers=args.layers, **heads)
            runs = {"full": [], "lora": [rank]}
        results = {name: run_trainer(tmp / f"run{i}", model_dir, args, o) for i, (name, o) in enumerate(runs.items())}
    what = "SFT, Qwen3-MoE 8 experts" if args.moe else "RL, Qwen3"
    print(f"{what}: hidden {args.hidden} x {args.layers} layers; {args.samples} samples/step of <= {args.len} "
          f"tokens; {args.nproc} trainer rank(s); LoRA rank {args.rank}; median over steps 2..{args.steps}")
    for name, r in results.items():
        print(f"  {name:15s}: train {r['train_s']:7.3f} s/step   publish {r['publish_s'] * 1000:8.1f} ms   "
              f"peak RSS {r['peak_rss_mb']:7.0f} MiB   published {r['bytes'] / 2**20:8.2f} MiB")
    full = results.pop("full")
    for name, r in results.items():
        print(f"ratio {name}/full: " + ", ".join(f"{k} {r[k] / full[k]:.3f}" for k in full))


if __name__ == "__main__":
    main()
