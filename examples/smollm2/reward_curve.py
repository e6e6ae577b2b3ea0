"""Print a run's curve from RUN/metrics.jsonl as a Markdown table: an RL run's rewards, an SFT run's loss,
or two RL runs' rewards side by side.

    python examples/smollm2/reward_curve.py RUN [--every 1]            # RL: rewards, lag, step time, loss
    python examples/smollm2/reward_curve.py SFT_RUN                    # SFT: loss per step
    python examples/smollm2/reward_curve.py RUN --compare OTHER_RUN    # two RL runs' rewards, and their means
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean


class Curves:
    """One run's metrics records by role: RL train and eval rewards (orchestrator), trainer steps."""

    def __init__(self, run: Path):
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        self.train = {r["step"]: r for r in records if r.get("role") == "orchestrator" and not r.get("eval")}
        self.evals = {r["step"]: r for r in records if r.get("role") == "orchestrator" and r.get("eval")}
        self.trainer = {r["step"]: r for r in records if r.get("role") == "trainer" and "loss" in r}

    def shown(self, steps, every: int) -> list[int]:
        steps = sorted(steps)
        return [s for s in steps if s % every == 0 or s in (steps[0], steps[-1])]

    def summary(self, label: str) -> str:
        rewards = [self.train[s]["reward_mean"] for s in sorted(self.train)]
        evals = ", ".join(f"{self.evals[s]['reward_mean']:.3f} (step {s})" for s in sorted(self.evals))
        return (f"{label}: mean train reward steps 1-5 {mean(rewards[:5]):.3f}, last 5 {mean(rewards[-5:]):.3f}; "
                f"eval {evals or 'none'}")


def _reward(records: dict, step: int) -> str:
    return f"{records[step]['reward_mean']:.3f}" if step in records else ""


def rl_table(c: Curves, every: int) -> None:
    print("| step | train reward (mean) | eval reward | policy lag (max) | trainer step s | loss |")
    print("|---:|---:|---:|---:|---:|---:|")
    for step in c.shown(c.train, every):
        o, t = c.train[step], c.trainer.get(step, {})
        step_s = f"{t['step_s']:.1f}" if "step_s" in t else ""
        loss = f"{t['loss']:.4f}" if "loss" in t else ""
        print(f"| {step} | {o['reward_mean']:.3f} | {_reward(c.evals, step)} | {o.get('policy_lag_max', '')} "
              f"| {step_s} | {loss} |")
    print(f"\n{c.summary('this run')}")


def sft_table(c: Curves, every: int) -> None:
    print("| step | loss (token-mean NLL) | epoch | assistant tokens | trainer step s |")
    print("|---:|---:|---:|---:|---:|")
    for step in c.shown(c.trainer, every):
        t = c.trainer[step]
        print(f"| {step} | {t['loss']:.4f} | {t.get('epoch', 0):.2f} | {t.get('loss_tokens', '')} | {t['step_s']:.1f} |")


def compare_table(a: Curves, b: Curves, names: tuple[str, str], every: int) -> None:
    print(f"| step | train reward: {names[0]} | train reward: {names[1]} | eval: {names[0]} | eval: {names[1]} |")
    print("|---:|---:|---:|---:|---:|")
    for step in a.shown(set(a.train) | set(b.train), every):
        print(f"| {step} | {_reward(a.train, step)} | {_reward(b.train, step)} | {_reward(a.evals, step)} "
              f"| {_reward(b.evals, step)} |")
    print(f"\n{a.summary(names[0])}  \n{b.summary(names[1])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--compare", type=Path, help="a second RL run, shown beside RUN")
    parser.add_argument("--every", type=int, default=1, help="show every Nth step (and the first and last)")
    args = parser.parse_args()
    curves = Curves(args.run)
    if args.compare is not None:
        compare_table(curves, Curves(args.compare), (args.run.name, args.compare.name), args.every)
    elif curves.train:
        rl_table(curves, args.every)
    elif curves.trainer:
        sft_table(curves, args.every)
    else:
        raise SystemExit(f"{args.run}/metrics.jsonl has no trainer or reward records yet")


if __name__ == "__main__":
    main()
