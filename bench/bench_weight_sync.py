"""Weight sync latency: STABLE written -> the inference server serving the new weights.

    python bench/bench_weight_sync.py [--hidden 512] [--layers 8] [--repeats 5]

Starts one `python -m prl.inference` (vLLM, float32) on a random Qwen3 of the
given size, then per repeat: publishes perturbed weights as
RUN/weights/step_N (the trainer's protocol: temp dir, fsync, rename,
STABLE), and from the moment `publish_dir` returns (STABLE is on disk)
times `POST /prl/weights {"step": N}` plus one probe generate request whose
logprob must differ from the previous step's (proof the new weights serve).
The baseline, in the same run on the same files, is a raw
`safetensors.torch.load_file` of the step's safetensors plus a copy into
preallocated tensors (what any in-place load must at least do; `load_file`
alone is also printed, but it is nearly free from a hot page cache). Prints
medians and the ratio (sync / raw). On CPU, startup (engine warm-up) takes about a
minute and is not part of the measurement.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from prl.inference.checks import weight_files  # noqa: E402
from prl.run.rundir import RunDir  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402
from tests.vllm_fixtures import start_inference  # noqa: E402


def publish_step(run: RunDir, step: int, base: Path, state: dict[str, torch.Tensor]) -> Path:
    """Publish `state` moved by a little noise as weights/step_N (config + tokenizer from `base`)."""
    gen = torch.Generator().manual_seed(step)
    noisy = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=gen) if v.numel() > 1 else v.clone()
             for k, v in state.items()}

    def write(tmp: Path) -> None:
        save_file(noisy, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for f in base.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                shutil.copy2(f, tmp / f.name)

    return run.publish_dir(run.weights(step), write, step=step)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        tmp = Path(tmp)
        heads = max(1, args.hidden // 64)
        base = build_tiny_model(tmp / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=heads,
                                num_kv_heads=max(1, heads // 2), head_dim=64, vocab_size=args.vocab)
        state = load_file(str(base / "model.safetensors"))
        n_params = sum(v.numel() for v in state.values())
        size_mb = sum(f.stat().st_size for f in weight_files(base)) / 1e6
        run = RunDir(tmp / "run").create()
        probe = {"token_ids": list(range(10, 42)),
                 "sampling_params": {"max_tokens": 1, "temperature": 0.0, "logprobs": 1}}
        with start_inference(run.root, base, extra_args=("--max-model-len", "256")) as server:
            print(f"model: {n_params / 1e6:.1f}M params, {size_mb:.0f} MB fp32; server start {server.start_seconds:.0f} s")
            last = server.post("/inference/v1/generate", probe)["choices"][0]["logprobs"]["content"][0]["logprob"]
            sync, post, raw, lazy = [], [], [], []
            state_copy = {k: torch.empty_like(v) for k, v in state.items()}
            for step in range(1, args.repeats + 1):
                published = publish_step(run, step, base, state)
                t0 = time.perf_counter()  # STABLE is on disk
                out = server.post("/prl/weights", {"step": step})
                t1 = time.perf_counter()
                lp = server.post("/inference/v1/generate", probe)["choices"][0]["logprobs"]["content"][0]["logprob"]
                t2 = time.perf_counter()
                assert out["step"] == step and lp != last, "the probe still sees the old weights"
                last = lp
                r0 = time.perf_counter()
                loaded = [load_file(str(f)) for f in weight_files(published)]
                r1 = time.perf_counter()
                for tensors in loaded:  # copy into existing storage, as any in-place load must
                    for k, v in tensors.items():
                        state_copy[k].copy_(v)
                lazy.append(r1 - r0)
                raw.append(time.perf_counter() - r0)
                sync.append(t2 - t0)
                post.append(t1 - t0)
                print(f"step {step}: POST /prl/weights {1000 * (t1 - t0):.1f} ms (server: pause "
                      f"{1000 * out['pause_seconds']:.1f} ms, load {1000 * out['load_seconds']:.1f} ms), "
                      f"+ probe = {1000 * (t2 - t0):.1f} ms; raw load {1000 * lazy[-1]:.1f} ms, + copy {1000 * raw[-1]:.1f} ms")
        med = statistics.median
        print(f"median: STABLE -> serving {1000 * med(sync):.1f} ms (POST {1000 * med(post):.1f} ms); "
              f"raw safetensors load + copy {1000 * med(raw):.1f} ms: ratio {med(sync) / med(raw):.1f}x "
              f"(vs load_file alone, {1000 * med(lazy):.1f} ms: {med(sync) / med(lazy):.0f}x; "
              f"{os.cpu_count()} CPUs, torch {torch.__version__})")


if __name__ == "__main__":
    main()
