"""`prl status` cost: wall time against one bare `squeue` in the same run, and Slurm commands per call.

    python bench/bench_status.py [--runs 10]

Needs the local test cluster (scripts/slurm-cluster.sh start). Submits the lab topology
(3 roles), then a prefill/decode variant of it (5 roles), in preflight mode holding their
nodes; counts Slurm commands per status call while each runs, times the first, cancels.
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
PD = ["inference.nodes=null", "inference.prefill.nodes=1", "inference.decode.nodes=1", "trainer.nodes=1",
      "orchestrator.placement=trainer"]


def prl(env: dict, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "prl.cli", *args], capture_output=True, text=True, check=True,
                          env=env, cwd=REPO).stdout


def wall(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env, cwd=REPO)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prl-bench-status-"))
    env = {**os.environ, "PRL_HOME": str(tmp / "home")}
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text("{}")
    runs = {"lab (3 roles)": (tmp / "lab", []), "lab P/D (5 roles)": (tmp / "pd", PD)}
    try:
        for index, (label, (run, extra)) in enumerate(runs.items()):
            prl(env, "submit", "configs/lab.yaml", f"run_dir={run}", f"model.path={tmp / 'model'}", *extra,
                "--preflight", "--hold", "300")
            job_id = json.loads((run / "job.json").read_text())["job_id"]
            deadline = time.monotonic() + 60
            while json.loads(prl(env, "status", str(run), "--json"))["state"] != "RUNNING":
                if time.monotonic() > deadline:
                    raise SystemExit(f"{label}: job {job_id} did not start within 60 s")
                time.sleep(1)
            status = json.loads(prl(env, "status", str(run), "--json"))
            print(f"{label}: {len(status['roles'])} roles, {status['slurm_commands']} Slurm command(s) per status call")
            if index == 0:
                status_cmd = [sys.executable, "-m", "prl.cli", "status", str(run), "--json"]
                squeue_cmd = ["squeue", "--noheader", f"--jobs={job_id}"]
                wall(status_cmd, env)
                s_t, q_t = [], []
                for _ in range(args.runs):
                    q_t.append(wall(squeue_cmd, env))
                    s_t.append(wall(status_cmd, env))
                s, q = statistics.median(s_t), statistics.median(q_t)
                print(f"prl status: median {s * 1000:.0f} ms; bare squeue: median {q * 1000:.0f} ms; "
                      f"ratio {s / q:.1f}x over {args.runs} runs")
            prl(env, "cancel", str(run))
            time.sleep(3)  # let the nodes drain before the next job
    finally:
        for run, _ in runs.values():
            subprocess.run([sys.executable, "-m", "prl.cli", "cancel", str(run)], env=env, cwd=REPO,
                           capture_output=True)


if __name__ == "__main__":
    main()
