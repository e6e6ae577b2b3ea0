"""Weight hand-off cost: publish + load through the run directory vs a raw safetensors save + load.

    python bench/bench_weights.py [--params-m 50] [--dtype bfloat16] [--repeats 3]

The run-directory path is what the trainer and inference do each step:
write HF safetensors + config/tokenizer into a temp dir, fsync, rename, write
STABLE; then a reader waits for the marker and loads the file. The raw path
is `safetensors.torch.save_file` + `load_file` of the same tensors (no fsync,
no rename). Prints medians and the ratio (run dir / raw); also the ratio to a
raw save that fsyncs, which isolates the protocol from the durability cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from prl.run.rundir import RunDir  # noqa: E402
from prl.trainer.weights import write_hf_dir  # noqa: E402


def make_state(params_m: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Transformer-shaped random tensors totalling about `params_m` million parameters."""
    hidden, vocab = 1024, 32000
    state = {"model.embed_tokens.weight": torch.randn(vocab, hidden, dtype=dtype)}
    per_layer = 12 * hidden * hidden
    for i in range(max(1, int((params_m * 1e6 - vocab * hidden) // per_layer))):
        p = f"model.layers.{i}."
        state[p + "self_attn.qkv.weight"] = torch.randn(3 * hidden, hidden, dtype=dtype)
        state[p + "self_attn.o_proj.weight"] = torch.randn(hidden, hidden, dtype=dtype)
        state[p + "mlp.up_gate.weight"] = torch.randn(8 * hidden, hidden, dtype=dtype)
        state[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
    return state


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params-m", type=float, default=50.0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    state = make_state(args.params_m, dtype)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        tmp = Path(tmp)
        src = tmp / "src"
        src.mkdir()
        (src / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
        (src / "tokenizer.json").write_text("{}")
        run = RunDir(tmp / "run")
        rows = {"rundir": [], "raw": [], "raw_fsync": []}
        for i in range(args.repeats):

            def publish_and_load() -> None:
                run.publish_dir(run.weights(i + 1), lambda d: write_hf_dir(d, state, src, dtype), step=i + 1)
                d = run.wait_for_step("weights", i + 1, timeout=10)
                load_file(str(d / "model.safetensors"))

            def raw(fsync: bool) -> None:
                path = tmp / f"raw_{i}_{fsync}.safetensors"
                save_file(state, str(path))
                if fsync:
                    fd = os.open(path, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
                load_file(str(path))

            rows["rundir"].append(timed(publish_and_load))
            rows["raw"].append(timed(lambda: raw(False)))
            rows["raw_fsync"].append(timed(lambda: raw(True)))
            run.cleanup(i + 1, max_off_policy_steps=0, checkpoint_keep=0)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"tensors: {len(state)}, {nbytes / 2**20:.0f} MiB {args.dtype}, {args.repeats} repeats (median)")
    for k, v in med.items():
        print(f"  {k:10s} {v * 1000:8.1f} ms  {nbytes / 2**20 / v:8.0f} MiB/s")
    print(f"ratio rundir/raw        = {med['rundir'] / med['raw']:.2f}")
    print(f"ratio rundir/raw+fsync  = {med['rundir'] / med['raw_fsync']:.2f}")


if __name__ == "__main__":
    main()
