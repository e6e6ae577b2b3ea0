"""Print a run's reward curve from RUN/metrics.jsonl as a Markdown table.

    python examples/smollm2/reward_curve.py RUN [--every 1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=Path)
    parser.add_argument("--every", type=int, default=1)
    args = parser.parse_args()
    records = [json.loads(line) for line in (args.run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = {r["step"]: r for r in records if r.get("role") == "orchestrator" and not r.get("eval")}
    evals = {r["step"]: r for r in records if r.get("role") == "orchestrator" and r.get("eval")}
    trainer = {r["step"]: r for r in records if r.get("role") == "trainer"}
    print("| step | train reward (mean) | eval reward | policy lag (max) | trainer step s | loss |")
    print("|---:|---:|---:|---:|---:|---:|")
    for step in sorted(train):
        if step % args.every and step != max(train):
            continue
        o, t, e = train[step], trainer.get(step, {}), evals.get(step)
        eval_reward = f"{e['reward_mean']:.3f}" if e else ""
        step_s = f"{t['step_s']:.1f}" if "step_s" in t else ""
        loss = f"{t['loss']:.4f}" if "loss" in t else ""
        print(f"| {step} | {o['reward_mean']:.3f} | {eval_reward} | {o.get('policy_lag_max', '')} | {step_s} | {loss} |")


if __name__ == "__main__":
    main()
