"""Weight update latency, step end -> new weights served: filesystem (hot, cold) vs memory vs broadcast (issue 19).

    VLLM_CPU_KVCACHE_SPACE=1 python bench/bench_weight_sync.py [--sizes 80,500,2000] [--repeats 3] [--warmup 1]
                                                               [--layers 8] [--wait-memory 900]

For each size in `--sizes` (MB of float32 weights) it builds a random Qwen3 of about that size
(`--layers` layers, hidden the multiple of 128 that comes nearest, head_dim 64, the test
tokenizer's ~500-token vocabulary, tied embeddings), starts one `python -m prl.inference` on it
(vLLM, float32, `--enforce-eager`, the run's key) and, per repeat, times one update by each path
the product has, the four taking turns at going first, so each sees the same load. The first
`--warmup` repeats are printed but not counted: on this VM the first writes of a size cost the most
kernel time (a 2 GB `save_file` outside the bench: 22-39 s, almost all of it system time; 474 MB:
5.9 s the first time, 0.13 s repeated); later writes still vary with the machine's memory state.

    filesystem  the clock starts with the step's tensors in memory, before the write: publish
                RUN/weights/step_N as a trainer of one rank does (model.safetensors + config and
                tokenizer in a temp dir, fsync, rename, STABLE), `POST /prl/weights {"step": N}`,
                then one probe generate request. Also printed: the write, and the load-only part
                (POST + probe, what this bench measured before it timed the write).
    fs-cold     as filesystem, the step's files then dropped from the page cache (posix_fadvise
                DONTNEED, counted in the write: milliseconds): the server reads them from the disk, as a
                server on another node than the trainer's must (the writer's page cache is not its own).
                Still a local disk, not a shared filesystem over a network.
    memory      the clock starts with the same kind of tensors in memory (the gathered state dict):
                `FeedServer.publish(step, tensors)` (prl/weights/feed.py; one feed, a trainer of one
                rank), the step's record (`RunDir.write_weights_feed`), then
                `POST /prl/weights {"step": N, "feeds": [address]}` (the server's workers read the
                feed over TCP, prl/inference/weight_engine.py), then the probe.
    broadcast   as memory, with a broadcast group in the body (`weights.transport: broadcast`, the
                orchestrator's group for this one server: world 2, the feed's sender and its one
                worker): the worker gets the header over the feed's socket and the tensors by gloo
                broadcasts (prl/weights/collective.py).

Every step carries new noise, and the probe's greedy logprob must differ from the previous
update's, whichever path that was (proof the new weights serve); otherwise the bench fails.
Two baselines, outside the timed updates: for the filesystem, a raw `safetensors.torch.load_file`
of the step's files plus a copy into preallocated tensors (what any in-place load must at least do;
`load_file` alone is nearly free from a hot page cache, so it is not printed); for memory, reading
the step from the feed in this process with `prl.weights.feed.fetch` (what a server's worker does
before vLLM's reload sees a tensor).

Prints each update, then per size the medians (ms) and the ratio memory / filesystem of the
medians: below 1 the memory path serves new weights sooner; issue 19's goal is <= 0.5 at 500 MB
and above. Every path runs on this one machine: the feed crosses loopback TCP and the files a
local disk whose page cache is hot, where a cluster has a network and a shared filesystem.
A size needs about 6x the model in memory plus 3.5 GB (measured here: bench and server together
held 6.4 GB at 474 MB, 4.1 GB at 76 MB); on a machine shared with other work the bench waits up
to `--wait-memory` seconds for that much to be available, then reports the size as not run, with
the numbers (a 2 GB model needs 15.5 GB: it ran on this 24 GiB machine, but not while a test
suite held 10 GB). A size whose server or update fails is reported with the error; the other
sizes are measured, and the bench then exits 1. Startup (building the model, vLLM's
warm-up: a minute or more per size on CPU) is not measured.
"""

from __future__ import annotations

import argparse
import math
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

from prl.run.records import FeedRecord  # noqa: E402
from prl.weights.feed import FeedServer, fetch  # noqa: E402
from prl.weights.layout import weight_files  # noqa: E402
from prl.run.rundir import API_KEY_VAR, RunDir  # noqa: E402
from prl.trainer.tiny_model import build_tiny_model  # noqa: E402
from testkit.servers import http_json, start_inference  # noqa: E402

BYTES = 4  # float32
PROBE = {"token_ids": list(range(10, 42)), "sampling_params": {"max_tokens": 1, "temperature": 0.0, "logprobs": 1}}
BENCH_COPIES, SERVER_COPIES, FIXED_GB = 4, 2, 3.5
"""Copies of the model each side holds at its peak (for the memory check): the bench its base state,
the step's tensors, the feed's previous snapshot and the baseline's buffer; the server its weights
and a reload's new tensors; plus what vLLM holds whatever the model (its 1 GiB KV cache, torch)."""


PATHS = ("filesystem", "fs-cold", "memory", "broadcast")
"""The paths each repeat times, starting one later each repeat, so each sees the same load."""
GROUP_TIMEOUT_S = 120.0


def shape_for(mb: float, layers: int) -> int:
    """Hidden size (a multiple of 128) of a `layers`-layer Qwen3 of about `mb` MB: 9 h^2 parameters
    a layer (attention 3 h^2 with half as many KV heads, MLP 3 x h x 2h)."""
    return max(128, 128 * round(math.sqrt(mb * 1e6 / (BYTES * 9 * layers)) / 128))


def mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) / 1e6


def wait_for_memory(need_gb: float, wait_s: float) -> float:
    """GB of memory available once `need_gb` is, or when `wait_s` seconds have passed."""
    deadline = time.monotonic() + wait_s
    while (have := mem_available_gb()) < need_gb and time.monotonic() < deadline:
        time.sleep(10)
    return have


def noisy(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """`state` moved by a little noise of its own per step (fresh tensors: a feed keeps what it is handed)."""
    gen = torch.Generator().manual_seed(step)
    return {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=gen) if v.numel() > 1 else v.clone()
            for k, v in state.items()}


class KeyedClient:
    """The inference server's requests with the run's bearer key."""

    def __init__(self, url: str, key: str):
        self.url, self.headers = url, {"Authorization": f"Bearer {key}"}

    def post(self, path: str, body: dict) -> dict:
        return http_json("POST", self.url + path, body, headers=self.headers, timeout=1200)

    def probe(self) -> float:
        return self.post("/inference/v1/generate", PROBE)["choices"][0]["logprobs"]["content"][0]["logprob"]


def by_filesystem(run: RunDir, server: KeyedClient, base: Path, tensors: dict, step: int, cold: bool = False) -> dict:
    t0 = time.perf_counter()

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for f in base.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                shutil.copy2(f, tmp / f.name)

    run.publish_dir(run.weights(step), write, step=step)
    if cold:
        evict(run.weights(step))
    t1 = time.perf_counter()
    out = server.post("/prl/weights", {"step": step})
    t2 = time.perf_counter()
    logprob = server.probe()
    t3 = time.perf_counter()
    assert out["step"] == step, out
    return {"total": t3 - t0, "write": t1 - t0, "post": t2 - t1, "load_only": t3 - t1,
            "pause": out["pause_seconds"], "load": out["load_seconds"], "logprob": logprob}


def evict(published: Path) -> None:
    """Drop the step's files from the page cache (written and fsynced, so clean): the server reads them from the
    disk, as a server on another node than the trainer's does (its page cache never held them)."""
    for f in published.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def by_memory(run: RunDir, server: KeyedClient, feed: FeedServer, tensors: dict, step: int, group: bool = False) -> dict:
    t0 = time.perf_counter()
    feed.publish(step, sorted(tensors.items()))
    run.write_weights_feed(FeedRecord(step=step, feeds=[feed.address], time=time.time(),
                                      group_timeout=GROUP_TIMEOUT_S if group else None))
    t1 = time.perf_counter()
    body = {"transport": "memory", "step": step, "feeds": [feed.address]}
    if group:  # the orchestrator's group for one server of one worker: the feed's sender and that worker
        body["transport"] = "broadcast"
        body["group"] = {"token": os.urandom(16).hex(), "world": 2, "rank": 1, "timeout": GROUP_TIMEOUT_S}
    out = server.post("/prl/weights", body)
    t2 = time.perf_counter()
    logprob = server.probe()
    t3 = time.perf_counter()
    assert out["step"] == step and out["path"] == f"memory:step_{step}" and out["group"] is group, out
    return {"total": t3 - t0, "write": t1 - t0, "post": t2 - t1, "load_only": t3 - t1,
            "pause": out["pause_seconds"], "load": out["load_seconds"], "logprob": logprob}


def raw_load(published: Path, into: dict[str, torch.Tensor]) -> float:
    """Seconds to read the published files with safetensors and copy them into existing storage."""
    r0 = time.perf_counter()
    for f in weight_files(published):
        for k, v in load_file(str(f)).items():
            into[k].copy_(v)
    return time.perf_counter() - r0


def feed_read(feed: FeedServer, step: int, key: str) -> float:
    """Seconds to read step `step` whole from `feed`, each tensor dropped once read."""
    r0 = time.perf_counter()
    for _ in fetch(feed.address, step, key.encode()):
        pass
    return time.perf_counter() - r0


def bench_size(mb: float, args, tmp: Path) -> dict:
    """Build, serve and update one model size; the per-path lists of timings."""
    hidden = shape_for(mb, args.layers)
    heads = hidden // 64
    base = build_tiny_model(tmp / "model", hidden_size=hidden, num_layers=args.layers, num_heads=heads,
                            num_kv_heads=heads // 2, head_dim=64)
    state = load_file(str(base / "model.safetensors"))
    params = sum(v.numel() for v in state.values())
    size_mb = sum(f.stat().st_size for f in weight_files(base)) / 1e6
    run = RunDir(tmp / "run").create()
    run.create_api_key()
    key = run.read_api_key()
    results = {"mb": size_mb, "params": params, "hidden": hidden, "raw": [], "read": [], **{p: [] for p in PATHS}}
    with start_inference(run.root, base, extra_args=("--max-model-len", "256", "--api-key-env", API_KEY_VAR),
                         env={API_KEY_VAR: key}, timeout=1800) as started, \
            FeedServer("127.0.0.1", 0, key.encode(), groups=True, group_timeout=GROUP_TIMEOUT_S) as feed:
        server = KeyedClient(started.url, key)
        print(f"\n== {size_mb:.0f} MB: Qwen3 hidden {hidden}, {args.layers} layers, {params / 1e6:.1f}M params fp32; "
              f"server start {started.start_seconds:.0f} s", flush=True)
        last, step, buffer = server.probe(), 0, {k: torch.empty_like(v) for k, v in state.items()}
        published: list[int] = []
        for repeat in range(args.warmup + args.repeats):
            for path in PATHS[repeat % len(PATHS):] + PATHS[:repeat % len(PATHS)]:
                step += 1
                tensors = noisy(state, step)
                if path in ("filesystem", "fs-cold"):
                    r = by_filesystem(run, server, base, tensors, step, cold=path == "fs-cold")
                    del tensors  # before the baseline's load: one copy fewer at the peak
                    baseline = ("raw", raw_load(run.weights(step), buffer), "raw load + copy")
                    published.append(step)
                    while len(published) > 2:  # keep the newest two on disk (the server's rollback target among them)
                        shutil.rmtree(run.weights(published.pop(0)), ignore_errors=True)
                else:
                    r = by_memory(run, server, feed, tensors, step, group=path == "broadcast")
                    del tensors  # the feed keeps them until the next publish
                    baseline = ("read", feed_read(feed, step, key), "feed read")
                assert r["logprob"] != last, f"step {step} ({path}): the probe still sees the previous weights"
                last = r["logprob"]
                if repeat >= args.warmup:
                    results[path].append(r)
                    results[baseline[0]].append(baseline[1])
                print(f"step {step} {path:10s}: {1000 * r['total']:8.1f} ms = "
                      f"{'write' if path.startswith('f') else 'publish':7s} {1000 * r['write']:7.1f} + "
                      f"POST {1000 * r['post']:7.1f} (pause {1000 * r['pause']:5.1f}, load {1000 * r['load']:7.1f}) + "
                      f"probe {1000 * (r['load_only'] - r['post']):6.1f}"
                      + f"; {baseline[2]} {1000 * baseline[1]:.1f} ms; load average {os.getloadavg()[0]:.1f}"
                      + (" (warm-up, not counted)" if repeat < args.warmup else ""),
                      flush=True)
    return results


def summary(sizes: list[float], done: dict) -> None:
    med = statistics.median
    print(f"\nmedians in ms ({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__})")
    print(f"{'size':>8} {'params':>8} | {'fs total':>9} {'write':>8} {'load-only':>9} {'raw':>8} | "
          f"{'cold total':>10} {'load':>8} | "
          f"{'mem total':>9} {'publish':>8} {'POST':>8} {'load':>8} {'read':>8} | {'bc total':>9} {'load':>8} | "
          f"{'mem/fs':>6} {'mem/fs load-only':>16} {'bc/fs':>6} {'mem/cold':>8} {'bc/cold':>7}")
    for mb in sizes:
        r = done[mb]
        if isinstance(r, str):
            print(f"{mb:>6.0f}MB  {r}")
            continue
        fs, cold, mem, bc = r["filesystem"], r["fs-cold"], r["memory"], r["broadcast"]

        def m(runs, key):
            return med(x[key] for x in runs)

        print(f"{r['mb']:>6.0f}MB {r['params'] / 1e6:>7.1f}M | {1000 * m(fs, 'total'):>9.1f} "
              f"{1000 * m(fs, 'write'):>8.1f} {1000 * m(fs, 'load_only'):>9.1f} {1000 * med(r['raw']):>8.1f} | "
              f"{1000 * m(cold, 'total'):>10.1f} {1000 * m(cold, 'load'):>8.1f} | "
              f"{1000 * m(mem, 'total'):>9.1f} "
              f"{1000 * m(mem, 'write'):>8.1f} {1000 * m(mem, 'post'):>8.1f} {1000 * m(mem, 'load'):>8.1f} "
              f"{1000 * med(r['read']):>8.1f} | {1000 * m(bc, 'total'):>9.1f} {1000 * m(bc, 'load'):>8.1f} | "
              f"{m(mem, 'total') / m(fs, 'total'):>5.2f}x {m(mem, 'load_only') / m(fs, 'load_only'):>15.2f}x "
              f"{m(bc, 'total') / m(fs, 'total'):>5.2f}x {m(mem, 'total') / m(cold, 'total'):>7.2f}x "
              f"{m(bc, 'total') / m(cold, 'total'):>6.2f}x")
    print("write/publish: the trainer's part; load-only: POST + probe; load: the server's in-worker load; "
          "raw, read: the baselines")
    print("mem/fs: memory total / filesystem total (goal <= 0.5x at 500 MB+); load-only: both without the "
          "trainer's write or publish; bc/fs: broadcast total / filesystem total")
    print("cold: the filesystem path with the step's files dropped from the page cache before the server reads "
          "them (a server on another node than the trainer); mem/cold, bc/cold: against it")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="80,500,2000", help="model sizes in MB of float32 weights, comma-separated")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="updates per path and size")
    ap.add_argument("--warmup", type=int, default=1, help="updates per path and size before those counted")
    ap.add_argument("--wait-memory", type=float, default=900, help="seconds a size may wait for its memory")
    args = ap.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    print(f"sizes {args.sizes} MB, {args.repeats} repeats per path after {args.warmup} warm-up, {args.layers} layers; "
          f"{mem_available_gb():.1f} GB memory available, load average {os.getloadavg()[0]:.1f}", flush=True)

    done: dict[float, dict | str] = {}
    for mb in sizes:
        need = (BENCH_COPIES + SERVER_COPIES) * mb / 1e3 + FIXED_GB
        if mem_available_gb() < need:
            print(f"\n== {mb:.0f} MB: waiting up to {args.wait_memory:.0f} s for {need:.1f} GB of memory "
                  f"({mem_available_gb():.1f} GB available)", flush=True)
        have = wait_for_memory(need, args.wait_memory)
        if need > have:
            done[mb] = f"not run: needs about {need:.1f} GB of memory ({BENCH_COPIES} copies of the model here, " \
                       f"{SERVER_COPIES} in the server, {FIXED_GB} GB of vLLM), {have:.1f} GB available " \
                       f"after {args.wait_memory:.0f} s"
            print(f"\n== {mb:.0f} MB: {done[mb]}", flush=True)
            continue
        with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
            try:
                done[mb] = bench_size(mb, args, Path(tmp))
            except Exception as e:  # noqa: BLE001 - report the size as failed, measure the others
                done[mb] = f"failed: {type(e).__name__}: {str(e)[-2000:]}"
                print(f"\n== {mb:.0f} MB: {done[mb]}", flush=True)
    summary(sizes, done)
    if any(isinstance(r, str) for r in done.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
