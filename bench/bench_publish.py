"""Weight publishing: sharded (every rank writes its share) vs the rank-0 gather, at 2 and 4 CPU ranks.

    python bench/bench_publish.py [--params-m 120] [--ranks 2 4] [--repeats 2] [--dtype bfloat16]

For each rank count and method, starts `torchrun --nproc-per-node N` on this file: each rank
builds the same Qwen3-shaped model (random weights, FSDP2-sharded over the N ranks, built on
the meta device so no rank ever holds it whole), then publishes `--repeats` steps into a run
directory with one method:

    sharded   prl.trainer.weights.publish_weights: per-parameter gather to its owner rank,
              each rank writes its own safetensors file, rank 0 writes the index + STABLE
    gathered  prl.trainer.weights.publish_weights_gathered: the full state dict gathered to
              rank 0's CPU, rank 0 writes everything

and reports the median wall time per publish and how far publishing raised rank 0's peak RSS
(one process per method and rank count, so the peaks do not mix). Prints the ratios
sharded / gathered measured in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def model_config(params_m: float):
    """A Qwen3 config of about `params_m` million parameters (hidden 1024, untied embeddings)."""
    from transformers import Qwen3Config

    hidden, vocab = 1024, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * 3072
    layers = max(1, int((params_m * 1e6 - 2 * vocab * hidden) // per_layer))
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3072, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=64, tie_word_embeddings=False)


def worker(args) -> None:
    """One rank: shard a random model, publish `repeats` steps with `method`, report (rank 0) to --out."""
    import resource

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from prl.planner.model import Mesh
    from prl.run.rundir import RunDir
    from prl.trainer.parallel import apply_fsdp, build_dist
    from prl.trainer.weights import publish_weights, publish_weights_gathered

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = SimpleNamespace(mesh=Mesh(dp_replicate=1, dp_shard=world, cp=1, ep=1, world_size=world), precision="fp32",
                          activation_checkpointing=False, compile=False)
    d = build_dist(cfg, rank, world, rank, torch.device("cpu"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(args.params_m), dtype=torch.float32)
    apply_fsdp(model, cfg, d)
    model.to_empty(device="cpu")
    torch.manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
    run = RunDir(args.run_dir)
    dtype = getattr(torch, args.dtype)
    dist.barrier()
    rss0 = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    times = []
    for step in range(1, args.repeats + 1):
        dist.barrier()
        t = time.perf_counter()
        if args.method == "sharded":
            publish_weights(run, step, model, args.source, dtype, d)
        else:
            publish_weights_gathered(run, step, model, args.source, dtype, d.is_main)
        dist.barrier()
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if rank == 0:
        nparams = sum(p.numel() for p in model.parameters())
        Path(args.out).write_text(json.dumps({"s": statistics.median(times), "rss_growth_mb": peak - rss0,
                                              "params": nparams}))
    dist.destroy_process_group()


def launch(method: str, ranks: int, args, tmp: Path) -> dict:
    out = tmp / f"{method}-{ranks}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
           "127.0.0.1", "--master-port", str(29700 + ranks), __file__, "--worker", "--method", method,
           "--run-dir", str(tmp / f"run-{method}-{ranks}"), "--source", str(tmp / "src"), "--out", str(out),
           "--params-m", str(args.params_m), "--repeats", str(args.repeats), "--dtype", args.dtype]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params-m", type=float, default=120.0)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", choices=["sharded", "gathered"])
    ap.add_argument("--run-dir")
    ap.add_argument("--source")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_config(args.params_m).save_pretrained(tmp / "src")
        results = {(m, n): launch(m, n, args, tmp) for n in args.ranks for m in ("gathered", "sharded")}
    params = next(iter(results.values()))["params"]
    print(f"publish of a {params / 1e6:.0f}M-parameter model as {args.dtype} "
          f"({params * 2 / 2**20:.0f} MiB), median of {args.repeats}; rank 0's peak RSS growth while publishing")
    for n in args.ranks:
        g, s = results[("gathered", n)], results[("sharded", n)]
        print(f"  {n} ranks: gathered {g['s']:6.2f} s {g['rss_growth_mb']:7.0f} MiB | "
              f"sharded {s['s']:6.2f} s {s['rss_growth_mb']:7.0f} MiB | "
              f"ratio sharded/gathered: time {s['s'] / g['s']:.2f}, rank-0 memory "
              f"{s['rss_growth_mb'] / max(g['rss_growth_mb'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
