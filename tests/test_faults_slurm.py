"""Faults in a real RL run on the lab cluster (one hetjob: a vLLM server on n1, the orchestrator,
a 2-rank FSDP2 trainer on two nodes), one run and four attempts for the whole story (each attempt
starts vLLM and the trainer again, so one run costs less than a run per fault):

1. kill -9 of the vLLM engine mid-run: the launcher restarts that server inside the allocation (a new
   srun step on its node, on the newest published weights); the orchestrator takes it out of rotation,
   its rollouts wait for it (one server: nowhere else to go, and no step may be lost) and it rejoins;
   `prl status` shows the restart. (Rollouts moving to another server: tests/test_resilience.py.)
2. SIGSTOP of trainer rank 1: the launcher declares the trainer HUNG within `hang_timeout_s`, stops
   the job and requeues it (the lab profile allows requeue);
3. in attempt 2, SIGSTOP of the orchestrator: HUNG names the orchestrator (not the trainer starving
   behind it), the job requeues;
4. in attempt 3 a trainer node is set DOWN: Slurm ends the attempt (NODE_FAIL) and requeues it;
5. attempt 4 completes: every trainer and orchestrator step is in metrics.jsonl exactly once, and
   `prl status` says how attempts 1-3 ended.

The measured numbers are printed (run with -s to see them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import prl_cli as prl, wait_for
from tests.tiny_model import build_tiny_model

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, pytest.mark.slow]

HANG_TIMEOUT_S = 60  # 30 s once declared a busy orchestrator hung on CI's loaded cores (a false HUNG)
OFF_POLICY = 1
CHECKPOINT_KEEP = 1


def _procs() -> list[tuple[int, int, str]]:
    """(pid, ppid, command line) of every process."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.append((int(entry.name), ppid, cmd))
    return out


def _descendants(pid: int, procs: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    kids = [p for p in procs if p[1] == pid]
    return kids + [d for k in kids for d in _descendants(k[0], procs)]


def engine_of(run: Path, port: int) -> int:
    """The vLLM engine-core process of the server of `run` listening on `port`."""
    procs = _procs()
    api = [p for p in procs if "prl.inference" in p[2] and str(run) in p[2] and f"--port {port}" in p[2]]
    assert len(api) == 1, f"expected one API server on port {port}: {api}"
    engines = [p for p in _descendants(api[0][0], procs) if "EngineCore" in p[2]]
    assert engines, f"no EngineCore under the API server {api[0]}: {_descendants(api[0][0], procs)}"
    return engines[0][0]


def trainer_rank(run: Path, rank: int) -> int:
    for pid, _, cmd in _procs():
        if "prl.trainer" in cmd and str(run) in cmd and "torch.distributed.run" not in cmd:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return pid
    raise AssertionError(f"no trainer rank {rank} process of {run}")


def process_of(run: Path, module: str) -> int:
    """The pid of the role process `python -m MODULE --run-dir RUN` (not its role runner)."""
    found = [pid for pid, _, cmd in _procs() if f"-m {module} " in cmd and str(run) in cmd]
    assert len(found) == 1, f"expected one {module} process of {run}: {found}"
    return found[0]


def status(env: dict, run: Path) -> dict:
    """`prl status RUN --json`, as a user reads it."""
    return json.loads(prl(env, "status", run, "--json", check=False).stdout)


def trained(run: Path) -> int:
    """The newest step the trainer recorded in metrics.jsonl (0: none yet)."""
    return max((r["step"] for r in records(run, "trainer")), default=0)


def records(run: Path, role: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
    out = []
    for line in lines:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("role") == role and not r.get("eval") and r.get("event") is None:
            out.append(r)
    return out


def test_one_run_survives_an_engine_kill_a_hung_trainer_a_hung_orchestrator_and_a_dead_node(
        tmp_path, env, slurm_cluster):
    model = build_tiny_model(tmp_path / "model")
    run = tmp_path / "run"
    max_steps = 16
    # One GPU per node: one inference server, so the run waits for the restarted one whatever its start-up takes.
    prl(env, "submit", "configs/lab.yaml", f"run_dir={run}", f"model.path={model}", f"training.max_steps={max_steps}",
        f"training.max_off_policy_steps={OFF_POLICY}", "training.checkpoint_interval=2",
        f"training.checkpoint_keep={CHECKPOINT_KEEP}", f"training.hang_timeout_s={HANG_TIMEOUT_S}",
        "cluster.gpu_node.gpus=1")
    try:
        numbers = kill_the_engine(env, run)
        numbers |= hang_the_trainer(env, run)
        numbers |= hang_the_orchestrator(env, run)
        numbers |= take_a_trainer_node_down(env, run)
        final = wait_for("the job to end", lambda: (s := status(env, run))["state"] in (
            "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and s["attempt"] == 4 and s, timeout=900, interval=3)
    finally:
        subprocess.run(["scontrol", "update", "nodename=n4", "state=RESUME"], check=False, capture_output=True)
        prl(env, "cancel", run, check=False)
    assert final["state"] == "COMPLETED", (final, prl(env, "logs", run, "-n", "40", check=False).stdout)
    lost = sorted(set(range(1, max_steps + 1)) - {r["step"] for r in records(run, "trainer")})
    assert [r["step"] for r in records(run, "trainer")] == list(range(1, max_steps + 1)), lost
    assert [r["step"] for r in records(run, "orchestrator")] == list(range(1, max_steps + 1))
    earlier = final["earlier"]
    assert [e["attempt"] for e in earlier] == [1, 2, 3], earlier
    assert [e["failure"]["role"] for e in earlier[:2]] == ["trainer", "orchestrator"], earlier
    assert earlier[2]["slurm_state"] == "NODE_FAIL", earlier
    text = prl(env, "status", run, check=False).stdout
    assert "attempt 1 ended" in text and "trainer HUNG" in text, text
    assert "attempt 2 ended" in text and "orchestrator HUNG" in text, text
    assert "attempt 3 ended" in text and "Slurm: NODE_FAIL" in text, text
    print("\nfault numbers:", json.dumps(numbers, indent=2))


def kill_the_engine(env: dict, run: Path) -> dict:
    """1. kill -9 of the engine once the loop runs: the launcher restarts the server (a new srun step on its node,
    on the newest published weights), `prl status` shows the restart, the restarted server serves rollouts again."""
    wait_for("trainer step 1", lambda: trained(run) >= 1, timeout=400, interval=2)
    os.kill(engine_of(run, 18000), signal.SIGKILL)
    killed = time.time()
    launcher = run / "state" / "launcher.json"
    event = wait_for("the server restarted and ready", lambda: next(
        (f for f in json.loads(launcher.read_text())["steps"]["inference"].get("failures", [])
         if f.get("action") == "restarted"), None), timeout=300, interval=1)
    shown = status(env, run)
    inference = next(r for r in shown["roles"] if r["role"] == "inference")
    assert inference["restarts"] == 1 and inference["failures"][0]["replica"] == 0, inference
    assert "exited" in inference["failures"][0]["reason"], inference["failures"]
    text = prl(env, "status", run, check=False).stdout
    assert "inference replica 0" in text and "restarted" in text, text
    # The restarted server takes rollouts again: its log shows token-level generate calls after the restart.
    log = run / "logs" / "attempt_1" / "inference" / "rank_0.log"
    wait_for("the restarted server to serve rollouts", lambda: log.read_text().split("restart: serving weights")[-1]
             .count("POST /inference/v1/generate") > 0, timeout=120, interval=1)
    return {"engine death -> restarted server ready (s)": round(event["time"] + event["ready_after_s"] - killed, 1),
            "engine death -> restarted server serving rollouts (s, polled)": round(time.time() - killed, 1)}


def hang_the_trainer(env: dict, run: Path) -> dict:
    """2. Once the run has gone on well past `max_off_policy_steps + checkpoint_keep` steps after the restart (the
    step the restarted server was started on is then one cleanup would delete, were it not held for that server),
    SIGSTOP of trainer rank 1: the launcher declares the trainer HUNG within `hang_timeout_s`, stops the job and
    requeues it (the lab profile allows it)."""
    restarted_at = trained(run)
    past = OFF_POLICY + CHECKPOINT_KEEP + 2
    wait_for(f"{past} steps after the restart", lambda: trained(run) >= restarted_at + past, timeout=400, interval=1)
    log = run / "logs" / "attempt_1" / "inference" / "rank_0.log"
    assert "Invalid repository ID" not in log.read_text(), "the restarted server lost its --model step"
    os.kill(trainer_rank(run, 1), signal.SIGSTOP)
    stopped = time.time()
    hung = wait_for("HUNG in status", lambda: (s := status(env, run))["failure"] and s["failure"].get("hung") and s,
                    timeout=HANG_TIMEOUT_S + 60, interval=1)
    detected = json.loads((run / "state" / "launcher.json").read_text())["steps"]["trainer"]["hung_at"]
    trainer = next(r for r in hung["roles"] if r["role"] == "trainer")
    assert trainer["status"] == "HUNG", trainer
    assert hung["failure"]["role"] == "trainer" and "no progress" in hung["failure"]["reason"], hung["failure"]
    assert detected - stopped < HANG_TIMEOUT_S + 30
    return {"trainer hang -> HUNG detected (s, bound %d)" % HANG_TIMEOUT_S: round(detected - stopped, 1)}


def hang_the_orchestrator(env: dict, run: Path) -> dict:
    """3. In attempt 2, once it trained a step of its own, SIGSTOP of the orchestrator: HUNG names the orchestrator
    (not the trainer starving behind it) within the bound, and the job requeues."""
    requeued = step_of_attempt(env, run, 2)
    first_resumed = min(r["time"] for r in records(run, "trainer") if r["time"] > requeued)
    # The trainer starts with the servers and may train on rollouts attempt 1 left before this attempt's
    # orchestrator runs: stop the orchestrator once its loop has reported (a step of its own), not before.
    wait_for("an orchestrator step of attempt 2", lambda: any(r["time"] > requeued for r in records(
        run, "orchestrator")), timeout=400, interval=2)
    os.kill(process_of(run, "prl.orchestrator"), signal.SIGSTOP)
    stopped = time.time()
    hung = wait_for("HUNG in status", lambda: (s := status(env, run))["failure"] and s["failure"].get("hung") and s,
                    timeout=HANG_TIMEOUT_S + 60, interval=1)
    detected = time.time()
    assert hung["failure"]["role"] == "orchestrator", hung["failure"]
    assert next(r for r in hung["roles"] if r["role"] == "orchestrator")["status"] == "HUNG"
    assert detected - stopped < HANG_TIMEOUT_S + 30
    return {"requeue seen -> first resumed trainer step (s)": round(first_resumed - requeued, 1),
            "orchestrator hang -> HUNG seen (s, polled)": round(detected - stopped, 1)}


def take_a_trainer_node_down(env: dict, run: Path) -> dict:
    """4. In attempt 3, once it trained a step of its own, a trainer node goes DOWN: Slurm ends the attempt
    (NODE_FAIL) and requeues it; `prl status` says how it ended."""
    step_of_attempt(env, run, 3)
    node = status(env, run)["roles"][-1]["nodes"]
    assert node.startswith("n[3-4]") or node == "n3,n4", node
    subprocess.run(["scontrol", "update", "nodename=n4", "state=DOWN", "reason=prl-fault-test"], check=True)
    down = time.time()
    shown = wait_for("attempt 3's end in status", lambda: (s := status(env, run))["earlier"][2:] and s,
                     timeout=180, interval=2)
    seen = time.time()
    # (Slurm may already have returned it to service: ReturnToService=2 and a live slurmd.)
    subprocess.run(["scontrol", "update", "nodename=n4", "state=RESUME"], check=False, capture_output=True)
    assert shown["earlier"][2]["slurm_state"] == "NODE_FAIL", shown["earlier"]
    return {"node DOWN -> attempt 3's end in status (s)": round(seen - down, 1)}


def step_of_attempt(env: dict, run: Path, attempt: int) -> float:
    """Wait until attempt `attempt` runs and its trainer has trained a step past every step seen before; returns
    when the attempt was first seen."""
    wait_for(f"attempt {attempt} running", lambda: status(env, run)["attempt"] == attempt, timeout=300, interval=2)
    seen = time.time()
    before = trained(run)
    wait_for(f"a step of attempt {attempt}", lambda: trained(run) > before, timeout=400, interval=2)
    return seen
