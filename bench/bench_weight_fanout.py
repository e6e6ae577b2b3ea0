"""One step to N inference workers: every worker pulling the feed, one broadcast group, every worker pulling only
its tensor-parallel slices, and a broadcast group per place (its slices), in one run (issues 19 and 46).

    python bench/bench_weight_fanout.py [--mb 474] [--receivers 1,2,4] [--repeats 5] [--tp 2]

The transport alone, without vLLM: one feed (prl/weights/feed.py) in this process holds a step of `--mb` MB of
float32 tensors shaped and named as a Qwen3 model's (so that the slice rules of prl/weights/slices.py apply);
N receiver processes, started once per N and kept, stand for the workers of N / tp servers of `--tp` workers
each. Per repeat, the ways take turns at going first:

    pull    every receiver reads the whole step from the feed over its own TCP connection at the same time
            (`weights.transport: memory` for a family the rules do not slice): the feed sends the step N times.
    group   every receiver asks the feed for the step naming one broadcast group of world N + 1 and gets the
            tensors as gloo broadcasts (`weights.transport: broadcast`, prl/weights/collective.py).
    slices  every receiver names its place (tp rank of `--tp`) and reads only what that worker keeps
            (`weights.transport: memory` for a sliced family): the feed sends each byte about N / tp times.
    places  as slices, by broadcast: the receivers of one place form a group of their own (`weights.transport:
            broadcast` for a sliced family, a group per place), each group gets that place's view.

The clock runs from the command to the receivers until the last says it holds the whole step (each drops
the tensors as they come). Prints the medians and group / pull; below 1 the broadcast is faster. On one
machine every byte crosses loopback, so this measures CPU and memory bandwidth, not a network: on a
cluster the pull's cost is the trainer node's link carrying the step N times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from prl.weights.feed import FeedServer  # noqa: E402
from prl.weights.slices import Worker, slice_plan, worker_numel  # noqa: E402

KEY = b"bench-fanout-key"
TIMEOUT_S = 300.0
HEADER_BYTES = 1 << 20
"""Most a step's header may add to the tensors' bytes a receiver counts."""
RECEIVER = """
import sys
from prl.run.api import Group
from prl.weights.feed import FeedReader
from prl.weights.slices import Worker

address, index = sys.argv[1], int(sys.argv[2])
for line in sys.stdin:
    token, world, tp, rank = line.split()
    group = Group(token=token, world=int(world), rank=int(rank), timeout=float(sys.argv[3])) if token != "-" else None
    worker = Worker(tp=int(tp), tp_rank=index % int(tp)) if int(tp) > 1 else None
    reader = FeedReader(address, 1, sys.argv[4].encode(), 300, group=group, worker=worker)
    for _ in reader:  # each tensor dropped as it comes (a slice arrives placed in a tensor of the full shape)
        pass
    print(reader.received, flush=True)  # the bytes that came: the tensors' (or slices') and the step's header
"""


def qwen3_like(mb: float) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """A config.json and float32 tensors of about `mb` MB named and shaped as a Qwen3 model's layers."""
    hidden, heads, kv_heads, head_dim, inter = 1024, 16, 8, 64, 3072
    vocab = 32768 if mb >= 500 else 4096
    config = {"model_type": "qwen3", "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab}
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
              "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim)}
    mlp = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    per_layer = sum(a * b for a, b in [*shapes.values(), *mlp.values()]) + 2 * hidden
    layers = max(1, round((mb * 1e6 / 4 - vocab * hidden) / per_layer))
    tensors = [("model.embed_tokens.weight", torch.randn(vocab, hidden))]
    for i in range(layers):
        tensors += [(f"model.layers.{i}.self_attn.{n}.weight", torch.randn(*s)) for n, s in shapes.items()]
        tensors += [(f"model.layers.{i}.mlp.{n}.weight", torch.randn(*s)) for n, s in mlp.items()]
        tensors += [(f"model.layers.{i}.{n}.weight", torch.randn(hidden)) for n in ("input_layernorm",
                                                                                  "post_attention_layernorm")]
    return config, tensors


def orders(n: int, way: str, tp: int) -> list[str]:
    """Each receiver's line for `way`: its group's token and world (`-` for none), the tp it slices for, its rank.
    `places`: receiver i is tp rank i % tp, and the receivers of one tp rank form a group of their own."""
    if way == "group":
        token = os.urandom(16).hex()
        return [f"{token} {n + 1} 1 {i + 1}" for i in range(n)]
    if way == "places":
        tokens = [os.urandom(16).hex() for _ in range(tp)]
        members = [[i for i in range(n) if i % tp == p] for p in range(tp)]
        return [f"{tokens[i % tp]} {len(members[i % tp]) + 1} {tp} {members[i % tp].index(i) + 1}" for i in range(n)]
    return [f"- 0 {tp if way == 'slices' else 1} 0"] * n


def round_trip(receivers: list[subprocess.Popen], way: str, expected: list[int], tp: int) -> float:
    """Seconds until every receiver holds what `way` gives it (`expected[i]` bytes: the step, or its slices)."""
    lines = orders(len(receivers), way, tp)
    t0 = time.perf_counter()
    for r, line in zip(receivers, lines):
        r.stdin.write(line + "\n")
        r.stdin.flush()
    for r, want in zip(receivers, expected):
        got = r.stdout.readline().strip()
        if not got.isdigit() or not want <= int(got) <= want + HEADER_BYTES:
            raise SystemExit(f"a receiver got {got!r} bytes, not the {want} of {way} and a header (exit {r.poll()})")
    return time.perf_counter() - t0


WAYS = ("pull", "group", "slices", "places")


def bench(feed: FeedServer, n: int, repeats: int, expected: dict[str, list[int]], tp: int) -> dict[str, list[float]]:
    receivers = [subprocess.Popen([sys.executable, "-c", RECEIVER, feed.address, str(index), str(TIMEOUT_S),
                                   KEY.decode()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
                 for index in range(n)]
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        for way in WAYS:  # warm-up: imports, first connections, the feed's view of each place
            round_trip(receivers, way, expected[way][:n], tp)
        for repeat in range(repeats):
            for way in WAYS[repeat % len(WAYS):] + WAYS[:repeat % len(WAYS)]:
                times[way].append(round_trip(receivers, way, expected[way][:n], tp))
    finally:
        for r in receivers:
            r.stdin.close()
        for r in receivers:
            r.wait(60)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=474.0, help="size of the step in MB")
    ap.add_argument("--receivers", default="1,2,4", help="receiver counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tp", type=int, default=2, help="workers per server: what the `slices` way slices for")
    args = ap.parse_args()
    config, tensors = qwen3_like(args.mb)
    layout = {name: tuple(t.shape) for name, t in tensors}
    nbytes = 4 * sum(t.numel() for _, t in tensors)
    most = max(int(x) for x in args.receivers.split(","))
    mine = [4 * worker_numel(slice_plan(config, layout, Worker(tp=args.tp, tp_rank=r % args.tp)), layout)
            for r in range(most)]
    expected = {"pull": [nbytes] * most, "group": [nbytes] * most, "slices": mine, "places": mine}
    print(f"{nbytes / 1e6:.0f} MB step ({len(tensors)} tensors), tp {args.tp}: a worker's slices are "
          f"{max(mine) / 1e6:.0f} MB ({max(mine) / nbytes:.3f} of the step); {args.repeats} repeats per way after a "
          f"warm-up, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    with FeedServer("127.0.0.1", 0, KEY, groups=True, group_timeout=TIMEOUT_S, config=config) as feed:
        feed.publish(1, tensors)
        rows = []
        for n in (int(x) for x in args.receivers.split(",")):
            times = bench(feed, n, args.repeats, expected, args.tp)
            rows.append((n, *(statistics.median(times[way]) for way in WAYS)))
            print(f"{n} receivers: " + ", ".join(f"{way} {[round(t, 3) for t in times[way]]} s" for way in WAYS),
                  flush=True)
    print(f"\nmedians (load average {os.getloadavg()[0]:.1f})\n{'receivers':>9} {'pull s':>8} {'group s':>8} "
          f"{'slices s':>8} {'places s':>8} {'group/pull':>10} {'slices/pull':>11} {'places/pull':>11} "
          f"{'MB/worker pull':>14} {'MB/worker slices':>16}")
    for n, pull, group, sliced, places in rows:
        print(f"{n:>9} {pull:>8.3f} {group:>8.3f} {sliced:>8.3f} {places:>8.3f} {group / pull:>9.2f}x "
              f"{sliced / pull:>10.2f}x {places / pull:>10.2f}x {nbytes / 1e6:>14.0f} {max(mine[:n]) / 1e6:>16.0f}")
    print("below 1x: faster than every worker pulling the whole step")


if __name__ == "__main__":
    main()
