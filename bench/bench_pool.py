"""Two LoRA runs on one inference pool vs the same two runs each with its own server, in one sitting.

    python bench/bench_pool.py [--steps 12]

Builds the tiny LoRA model (`build_tiny: dense-lora`'s), then, one after the other:
- *own servers*: two `configs/local-lora.yaml` runs submitted at once (`--local`), each starting its vLLM server;
- *pool*: `configs/local-pool.yaml` (one server), then two `configs/local-pool-run.yaml` runs attached to it,
  submitted at once; the pool's start counts (it is started for them), its stop does not.
Prints, for each, the wall time from submission to both runs' end, the trainer steps per second of each run
(its steps over its own wall time), the vLLM starts, and the ratios pool / own. Every run trains the same
`--steps` steps on the same settings. A machine with fewer cores than the runs' processes (2 here) measures
contention as much as serving: the ratio says what one start and one engine instead of two are worth there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def prl(*args, wait: bool = True, env: dict | None = None):
    cmd = [sys.executable, "-m", "prl.cli", *map(str, args)]
    if wait:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=1800)
        if done.returncode:
            raise SystemExit(f"prl {' '.join(map(str, args))} failed:\n{done.stdout}{done.stderr}")
        return done
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=REPO, env=env)


def run_both(submits: list[list[str]], env: dict) -> float:
    """Submit the runs at once and wait for them: the seconds until the last one ends."""
    t0 = time.perf_counter()
    procs = [prl(*args, wait=False, env=env) for args in submits]
    for p in procs:
        if p.wait(timeout=1800):
            raise SystemExit(f"a run failed: {submits[procs.index(p)]}")
    return time.perf_counter() - t0


def steps_per_s(run: Path) -> float:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trainer = [r for r in records if r.get("role") == "trainer" and r.get("event") is None]
    launcher = json.loads((run / "state" / "launcher.json").read_text())
    return len(trainer) / (launcher["ended"] - launcher["started"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    from prl.trainer.tiny_model import LORA_EMBED_SCALE
    from prl.trainer.tiny_model import build_tiny_model

    env = {**os.environ, "PRL_HOME": tempfile.mkdtemp(prefix="prl-bench-home-")}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny_model(tmp / "model", embed_scale=LORA_EMBED_SCALE)
        # configs/local-pool-run.yaml resamples groups without signal; the own-server runs do the same here
        common = [f"model.path={model}", f"training.max_steps={args.steps}", "training.advantage.dynamic_sampling=4",
                  "--local"]
        own = {n: tmp / f"own-{n}" for n in ("a", "b")}
        own_s = run_both([["submit", "configs/local-lora.yaml", f"name=own-{n}", f"run_dir={r}",
                           f"cluster.port_base={20000 + 100 * i}", *common] for i, (n, r) in enumerate(own.items())],
                         env)
        pool = tmp / "pool"
        t0 = time.perf_counter()
        prl("submit", "configs/local-pool.yaml", f"model.path={model}", f"run_dir={pool}", "cluster.port_base=20300",
            "--local", "--detach", env=env)
        while not (pool / "state" / "endpoints" / "inference.0.json").exists():
            time.sleep(0.5)
        started = time.perf_counter() - t0
        on_pool = {n: tmp / f"pool-{n}" for n in ("a", "b")}
        try:
            pool_s = started + run_both([["submit", "configs/local-pool-run.yaml", f"name=pool-{n}", f"run_dir={r}",
                                          f"inference.attach={pool}", f"cluster.port_base={20400 + 100 * i}",
                                          *common] for i, (n, r) in enumerate(on_pool.items())], env)
        finally:
            prl("cancel", pool, env=env)
        own_rate = [steps_per_s(r) for r in own.values()]
        pool_rate = [steps_per_s(r) for r in on_pool.values()]
    print(f"two LoRA runs of {args.steps} steps on the tiny model, submitted at once (cores: {os.cpu_count()})")
    print(f"  own servers: {own_s:6.1f} s wall, 2 vLLM starts, steps/s per run {own_rate[0]:.3f} {own_rate[1]:.3f}")
    print(f"  one pool:    {pool_s:6.1f} s wall (pool start {started:.1f} s included), 1 vLLM start, steps/s per run "
          f"{pool_rate[0]:.3f} {pool_rate[1]:.3f}")
    print(f"ratio pool/own: wall {pool_s / own_s:.2f}, steps/s per run "
          f"{sum(pool_rate) / sum(own_rate):.2f}")


if __name__ == "__main__":
    main()
