"""Login-node start-up: `prl status --json` and `prl plan` against importing what they need, in one run.

    python bench/bench_startup.py [--runs 15]

Two ratios, each against a baseline measured interleaved with it (the machine is shared and
noisy; only the ratio means much):

- `prl status --json RUN` (a planned run of configs/local-tiny.yaml) / `python -c "import typer"`
  (goal: within 2x);
- `prl plan configs/moe-1t.yaml --no-write` (129 nodes, 1024 GPUs) / `python -c "import msgspec,
  omegaconf, jinja2, rich.table, yaml, typer"`, merely importing its own dependencies (goal:
  within 1.3x). The schemas are msgspec Structs: `prl plan` imports no pydantic.

Then the slowest imports of `prl plan`, from -X importtime.

Every command runs with its bytecode cached, as an installed prl runs for a user: the children
get a private PYTHONPYCACHEPREFIX and never PYTHONDONTWRITEBYTECODE (with it, each run would
recompile prl's sources and the ratio would measure the compiler).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO, env=ENV)
    return time.perf_counter() - start


def ratio(name: str, cmd: list[str], base: list[str], base_name: str, runs: int, goal: float) -> None:
    wall(cmd), wall(base)  # warm the page cache and .pyc files
    ours, theirs = [], []
    for _ in range(runs):
        theirs.append(wall(base))
        ours.append(wall(cmd))
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"{name:<40} median {a * 1000:6.0f} ms")
    print(f"{base_name:<40} median {b * 1000:6.0f} ms")
    print(f"  ratio {a / b:.2f}x (goal <= {goal}x)\n")


def import_profile(argv: list[str], top: int) -> list[tuple[int, str]]:
    err = subprocess.run([PY, "-X", "importtime", "-m", "prl.cli", *argv], capture_output=True, text=True, env=ENV,
                         cwd=REPO).stderr
    rows = []
    for line in err.splitlines():
        if line.startswith("import time:") and "cumulative" not in line:
            _, cumulative, name = line.split("|", 2)
            if (len(name) - len(name.lstrip())) // 2 <= 1:
                rows.append((int(cumulative), name.strip()))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ENV["PYTHONPYCACHEPREFIX"] = f"{tmp}/pycache"
        run = f"{tmp}/run"
        subprocess.run([PY, "-m", "prl.cli", "plan", "configs/local-tiny.yaml", f"run_dir={run}"], check=True,
                       cwd=REPO, stdout=subprocess.DEVNULL)
        ratio("prl status --json (planned run)", [PY, "-m", "prl.cli", "status", run, "--json"],
              [PY, "-c", "import typer"], 'python -c "import typer"', args.runs, 2.0)
        deps = "import msgspec, omegaconf, jinja2, rich.table, yaml, typer"
        plan = ["plan", "configs/moe-1t.yaml", "--no-write"]
        ratio("prl plan moe-1t --no-write", [PY, "-m", "prl.cli", *plan], [PY, "-c", deps],
              "python -c 'import <its dependencies>'", args.runs, 1.3)
        print("slowest imports of `prl plan` (cumulative us):")
        for us, name in import_profile(plan, 12):
            print(f"  {us:>8}  {name}")


if __name__ == "__main__":
    main()
