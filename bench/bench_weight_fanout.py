"""One step to N inference workers: every worker pulling the feed vs one broadcast group, in one run (issue 19).

    python bench/bench_weight_fanout.py [--mb 474] [--receivers 1,2,4] [--repeats 5]

The transport alone, without vLLM: one feed (prl/weights/feed.py) in this process holds a step of `--mb` MB of
float32 tensors (16 of them, as a model's larger ones); N receiver processes, started once per N and kept,
stand for the workers. Per repeat, the two ways take turns at going first:

    pull   every receiver reads the whole step from the feed over its own TCP connection at the same time
           (`weights.transport: memory`): the feed sends the step N times.
    group  every receiver asks the feed for the step naming one broadcast group of world N + 1 and gets the
           tensors as gloo broadcasts (`weights.transport: broadcast`, prl/weights/collective.py).

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

KEY = b"bench-fanout-key"
TIMEOUT_S = 300.0
RECEIVER = """
import sys
from prl.run.api import Group
from prl.weights.feed import FeedReader

address, rank = sys.argv[1], int(sys.argv[2])
for line in sys.stdin:
    token, world = line.split()
    group = Group(token=token, world=int(world), rank=rank, timeout=float(sys.argv[3])) if token != "-" else None
    got = sum(t.numel() * t.element_size() for _, t in FeedReader(address, 1, sys.argv[4].encode(), 300, group=group))
    print(got, flush=True)
"""


def round_trip(receivers: list[subprocess.Popen], group: bool, nbytes: int) -> float:
    """Seconds until every receiver holds the step, pulled or by one group."""
    token, world = (os.urandom(16).hex(), len(receivers) + 1) if group else ("-", 0)
    t0 = time.perf_counter()
    for r in receivers:
        r.stdin.write(f"{token} {world}\n")
        r.stdin.flush()
    for r in receivers:
        got = r.stdout.readline().strip()
        if got != str(nbytes):
            raise SystemExit(f"a receiver answered {got!r}, not the step's {nbytes} bytes (exit {r.poll()})")
    return time.perf_counter() - t0


def bench(feed: FeedServer, n: int, repeats: int, nbytes: int) -> dict[str, list[float]]:
    receivers = [subprocess.Popen([sys.executable, "-c", RECEIVER, feed.address, str(rank + 1), str(TIMEOUT_S),
                                   KEY.decode()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
                 for rank in range(n)]
    times: dict[str, list[float]] = {"pull": [], "group": []}
    try:
        round_trip(receivers, False, nbytes)  # warm-up: imports, first connections
        round_trip(receivers, True, nbytes)
        for repeat in range(repeats):
            for way in ("pull", "group") if repeat % 2 == 0 else ("group", "pull"):
                times[way].append(round_trip(receivers, way == "group", nbytes))
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
    args = ap.parse_args()
    per = int(args.mb * 1e6 / 4 / 16)
    tensors = [(f"layer.{i}.weight", torch.randn(per)) for i in range(16)]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    print(f"{nbytes / 1e6:.0f} MB step, {args.repeats} repeats per way after a warm-up, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    with FeedServer("127.0.0.1", 0, KEY, groups=True, group_timeout=TIMEOUT_S) as feed:
        feed.publish(1, tensors)
        rows = []
        for n in (int(x) for x in args.receivers.split(",")):
            times = bench(feed, n, args.repeats, nbytes)
            pull, group = statistics.median(times["pull"]), statistics.median(times["group"])
            rows.append((n, pull, group))
            print(f"{n} receivers: pull {[round(t, 3) for t in times['pull']]} s, "
                  f"group {[round(t, 3) for t in times['group']]} s", flush=True)
    print(f"\nmedians (load average {os.getloadavg()[0]:.1f})\n{'receivers':>9} {'pull s':>8} {'group s':>8} "
          f"{'group/pull':>10} {'pull GB/s':>9} {'group GB/s':>10}")
    for n, pull, group in rows:
        print(f"{n:>9} {pull:>8.3f} {group:>8.3f} {group / pull:>9.2f}x {n * nbytes / pull / 1e9:>9.2f} "
              f"{n * nbytes / group / 1e9:>10.2f}")
    print("GB/s: bytes the receivers got together per second")


if __name__ == "__main__":
    main()
