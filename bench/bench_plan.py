"""How long `prl plan` takes on the 1000+-GPU topology, as a ratio to a bare interpreter start.

    python bench/bench_plan.py [--runs 10]

Prints the median wall time of `prl plan configs/moe-1t.yaml --no-write` and of
`python -c pass`, measured interleaved in the same run (the machine is shared and noisy,
so only the ratio means much), then the slowest imports of `prl.cli` from -X importtime.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    return time.perf_counter() - start


def import_profile(top: int) -> list[tuple[int, str]]:
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import prl.cli"], capture_output=True, text=True,
                         cwd=REPO, check=True).stderr
    rows = []
    for line in out.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line.split("|", 2)
        depth = (len(name) - len(name.lstrip())) // 2
        rows.append((int(cumulative), depth, name.strip()))
    # Depth-1 entries are what `import prl.cli` pulls in directly or first.
    return sorted(((us, name) for us, depth, name in rows if depth <= 1), reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    plan_cmd = [sys.executable, "-m", "prl.cli", "plan", "configs/moe-1t.yaml", "--no-write"]
    base_cmd = [sys.executable, "-c", "pass"]
    wall(plan_cmd)  # warm the page cache and .pyc files
    plan_t, base_t = [], []
    for _ in range(args.runs):
        base_t.append(wall(base_cmd))
        plan_t.append(wall(plan_cmd))
    p, b = statistics.median(plan_t), statistics.median(base_t)
    print(f"prl plan moe-1t (129 nodes, 1024 GPUs): median {p * 1000:.0f} ms over {args.runs} runs")
    print(f"python -c pass:                         median {b * 1000:.0f} ms")
    print(f"ratio plan / bare interpreter: {p / b:.1f}x  (extra {1000 * (p - b):.0f} ms)")
    print("slowest imports of prl.cli (cumulative us):")
    for us, name in import_profile(12):
        print(f"  {us:>8}  {name.strip()}")


if __name__ == "__main__":
    main()
