"""Faults in a real RL run on the lab cluster (one hetjob: a vLLM server on n1, the orchestrator,
a 2-rank FSDP2 trainer on two nodes), one run and four attempts for the whole story (each attempt
starts vLLM and the trainer again, so one run costs less than a run per fault):

1. kill -9 of the vLLM engine in the middle of a weight update (the engine stopped, an update posted, killed
   once the server logged that the update began): the launcher restarts that server inside the allocation (a
   new srun step on its node, on the newest published weights); the orchestrator takes it out of rotation,
   its rollouts wait for it (one server: nowhere else to go, and no step may be lost) and it rejoins;
   the trainer trains on; `prl status` shows the restart. (Rollouts moving to another server:
   tests/test_resilience.py.)
2. SIGSTOP of trainer rank 1: the launcher declares the trainer HUNG within `hang_timeout_s`, stops
   the job and requeues it (the lab profile allows requeue);
3. in attempt 2, SIGSTOP of the orchestrator: HUNG names the orchestrator (not the trainer starving
   behind it), the job requeues;
4. in attempt 3 a trainer node is set DOWN: Slurm ends the attempt (NODE_FAIL) and requeues it;
5. in attempt 4, trainer rank 1 dies while the server reads a step from the trainer's weight feeds (rank 1
   stopped, an update from the feeds posted, rank 1 killed once it began): the server keeps serving whole
   weights, the ones it served or the last ones from disk (its answer and `/prl/live` agree, the version
   checked); the trainer's exit fails the job, naming the trainer (a role's failure is not requeued);
6. the failed job's `prl status` says how attempts 1-3 ended and that the trainer failed attempt 4;
   `prl submit --resume` runs attempt 5 to the end: every trainer and orchestrator step is in metrics.jsonl
   exactly once.

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

from prl import weights
from prl.planner.model import Plan
from prl.run import api
from prl.run.rundir import RunDir
from tests.helpers import descendants, engine_of, prl_cli as prl, processes, wait_for
from tests.tiny_model import build_tiny_model

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, pytest.mark.slow]

HANG_TIMEOUT_S = 60  # 30 s once declared a busy orchestrator hung on CI's loaded cores (a false HUNG)
OFF_POLICY = 1
CHECKPOINT_KEEP = 1


def trainer_rank(run: Path, rank: int) -> int:
    for pid, _, cmd in processes():
        if "prl.trainer" in cmd and str(run) in cmd and "prl.trainer.torchrun" not in cmd:  # a rank, not torchrun
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return pid
    raise AssertionError(f"no trainer rank {rank} process of {run}")


def process_of(run: Path, module: str) -> int:
    """The pid of the role process `python -m MODULE --run-dir RUN` (not its role runner)."""
    found = [pid for pid, _, cmd in processes() if f"-m {module} " in cmd and str(run) in cmd]
    assert len(found) == 1, f"expected one {module} process of {run}: {found}"
    return found[0]


def status(env: dict, run: Path) -> dict:
    """`prl status RUN --json`, as a user reads it."""
    return json.loads(prl(env, "status", run, "--json", check=False).stdout)


def trained(run: Path) -> int:
    """The newest step the trainer recorded in metrics.jsonl (0: none yet)."""
    return max((r["step"] for r in records(run, "trainer")), default=0)


def records(run: Path, role: str) -> list[dict]:
    """`role`'s step records, as RunDir reads them (a resume's truncation records applied)."""
    out = []
    for r in RunDir(run).read_metrics(role):
        if not r.get("eval") and r.get("event") is None:
            out.append(r)
    return out


def test_one_run_survives_engine_and_trainer_deaths_mid_update_hangs_and_a_dead_node(
        tmp_path, env, slurm_cluster):
    model = build_tiny_model(tmp_path / "model")
    run = tmp_path / "run"
    # Attempts 1-4 end by faults, each after a few steps of its own (on CI's loaded cores 8, 4, 2, then 10 steps
    # while the test waited): attempt 4 must not reach the end first.
    max_steps = 40
    # One GPU per node: one inference server, so the run waits for the restarted one whatever its start-up takes.
    args = ["configs/lab.yaml", f"run_dir={run}", f"model.path={model}", f"training.max_steps={max_steps}",
            f"training.max_off_policy_steps={OFF_POLICY}", "training.checkpoint_interval=2",
            f"training.checkpoint_keep={CHECKPOINT_KEEP}", f"training.hang_timeout_s={HANG_TIMEOUT_S}",
            "cluster.gpu_node.gpus=1"]
    prl(env, "submit", *args)
    try:
        numbers = kill_the_engine(env, run)
        numbers |= hang_the_trainer(env, run)
        numbers |= hang_the_orchestrator(env, run)
        numbers |= take_a_trainer_node_down(env, run)
        numbers |= kill_a_trainer_rank_mid_send(env, run)
        failed, failed_text = status(env, run), prl(env, "status", run, check=False).stdout
        prl(env, "submit", "--resume", *args)
        final = wait_for("the job to end", lambda: (s := status(env, run))["state"] in (
            "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and s["attempt"] == 5 and s, timeout=900, interval=3)
    finally:
        subprocess.run(["scontrol", "update", "nodename=n4", "state=RESUME"], check=False, capture_output=True)
        prl(env, "cancel", run, check=False)
    assert final["state"] == "COMPLETED", (final, prl(env, "logs", run, "-n", "40", check=False).stdout)
    lost = sorted(set(range(1, max_steps + 1)) - {r["step"] for r in records(run, "trainer")})
    assert [r["step"] for r in records(run, "trainer")] == list(range(1, max_steps + 1)), lost
    assert [r["step"] for r in records(run, "orchestrator")] == list(range(1, max_steps + 1))
    # The failed submission's status (a resubmission's shows its own attempts): how attempts 1-3 ended, and 4.
    earlier = failed["earlier"]
    assert [e["attempt"] for e in earlier] == [1, 2, 3], earlier
    assert [e["failure"]["role"] for e in earlier[:2]] == ["trainer", "orchestrator"], earlier
    assert earlier[2]["slurm_state"] == "NODE_FAIL", earlier
    assert failed["attempt"] == 4 and failed["failure"]["role"] == "trainer", failed
    assert "attempt 1 ended" in failed_text and "trainer HUNG" in failed_text, failed_text
    assert "attempt 2 ended" in failed_text and "orchestrator HUNG" in failed_text, failed_text
    assert "attempt 3 ended" in failed_text and "Slurm: NODE_FAIL" in failed_text, failed_text
    assert final["attempt"] == 5 and final["earlier"] == [], final
    print("\nfault numbers:", json.dumps(numbers, indent=2))


def server(run: Path) -> str:
    """The URL of the run's one inference server (once this attempt's has published it)."""
    return wait_for("the inference server's endpoint", lambda: getattr(
        RunDir(run).endpoints().get("inference", {}).get(0), "url", None), timeout=300, interval=1)


def newest_update(run: Path) -> dict:
    """The `/prl/weights` body of the newest step, as the orchestrator's watcher builds it (the run's transport's
    offer: from memory when newer)."""
    rundir = RunDir(run)
    transport = weights.get(Plan.read(rundir).settings().weights.transport)

    def newest():
        offer = transport.offer(rundir)
        return None if offer is None else api.encode(offer.request)

    return wait_for("a published weights step", newest, timeout=300, interval=1)


def ask(run: Path, method: str, path: str, body: dict | None = None, timeout: float = 180) -> tuple[int, dict]:
    """(HTTP status, JSON answer) of the run's inference server, with the run's key; status 0: no answer."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{server(run)}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {RunDir(run).read_api_key()}",
                                              "Content-Type": "application/json"})
    def parsed(raw: bytes) -> dict:
        try:
            return json.loads(raw or b"{}")
        except ValueError:
            return {"error": raw.decode(errors="replace")[:300]}  # uvicorn's own "Internal Server Error"

    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, parsed(r.read())
    except urllib.error.HTTPError as e:
        return e.code, parsed(e.read())
    except OSError as e:  # the server went away under the request
        return 0, {"error": f"{type(e).__name__}: {e}"}


def update_in_flight(run: Path, attempt: int, body, pid: int) -> tuple[int, dict, float]:
    """Stop `pid` (so no update can finish), post the update `body()` (the newest step once it is stopped),
    SIGKILL `pid` once the server's log shows an update begun and not ended (ours, or the watcher's that ours
    queues behind: either is held by the stopped process); returns the answer and the kill's time."""
    import concurrent.futures

    log = run / "logs" / f"attempt_{attempt}" / "inference" / "rank_0.log"

    def in_flight() -> bool:
        text = log.read_bytes()
        return text.count(b"weights update begins") > text.count(b"weights update ends")

    os.kill(pid, signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            answer = pool.submit(ask, run, "POST", "/prl/weights", body())
            wait_for("an update in flight", in_flight, timeout=60, interval=0.2)
            time.sleep(2)  # the feeds it reads first are read; the stopped process holds the update
        finally:  # never left stopped: a failed wait would hold the test until the POST's timeout
            os.kill(pid, signal.SIGKILL)
            killed = time.time()
        status_code, out = answer.result(timeout=300)
    return status_code, out, killed


def kill_the_engine(env: dict, run: Path) -> dict:
    """1. kill -9 of the engine in the middle of a weight update: the launcher restarts the server (a new srun step
    on its node, on the newest published weights), `prl status` shows the restart, the restarted server serves
    rollouts again, the trainer trains on."""
    wait_for("trainer step 1", lambda: trained(run) >= 1, timeout=400, interval=2)
    newest_update(run)
    answer, body, killed = update_in_flight(run, 1, lambda: newest_update(run), engine_of(run, 18000))
    assert answer != 200, (answer, body)  # the server died under it: no answer, or an error
    launcher = run / "state" / "launcher.json"
    event = wait_for("the server restarted and ready", lambda: next(
        (f for f in json.loads(launcher.read_text())["launches"]["inference"].get("failures", [])
         if f.get("action") == "restarted"), None), timeout=300, interval=1)
    shown = status(env, run)
    inference = next(r for r in shown["roles"] if r["role"] == "inference")
    assert inference["restarts"] == 1 and inference["failures"][0]["replica"] == 0, inference
    assert "its vLLM engine died" in inference["failures"][0]["reason"], inference["failures"]
    text = prl(env, "status", run, check=False).stdout
    assert "inference replica 0" in text and "restarted" in text, text
    # The restarted server takes rollouts again: its log shows token-level generate calls after the restart.
    log = run / "logs" / "attempt_1" / "inference" / "rank_0.log"
    wait_for("the restarted server to serve rollouts", lambda: log.read_text().split("restart: serving weights")[-1]
             .count("POST /inference/v1/generate") > 0, timeout=120, interval=1)
    before = trained(run)
    wait_for("the trainer to train on", lambda: trained(run) > before, timeout=300, interval=1)
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
    detected = json.loads((run / "state" / "launcher.json").read_text())["launches"]["trainer"]["hung_at"]
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


def kill_a_trainer_rank_mid_send(env: dict, run: Path) -> dict:
    """5. In attempt 4, once it trained a step of its own and serves it from memory, trainer rank 1 dies while the
    server reads that step from the feeds: the update fails whole (502: nothing loaded; 500: the last disk
    weights loaded again) and `/prl/live` reports the whole weights it names; the trainer's exit ends the attempt."""
    step_of_attempt(env, run, 4)
    rundir = RunDir(run)
    # (A new attempt's trainer drops the old record: any record now is this attempt's feeds.)
    wait_for("a step of attempt 4 served from memory", rundir.read_weights_feed, timeout=300, interval=0.5)
    sent = {}
    transport = Plan.read(rundir).settings().weights.transport

    def from_the_feeds() -> dict:
        held = rundir.read_weights_feed()
        return sent.setdefault("body", {"transport": transport, "step": held.step, "feeds": held.feeds})

    answer, body, killed = update_in_flight(run, 4, from_the_feeds, trainer_rank(run, 1))
    step = sent["body"]["step"]
    assert answer in (500, 502), (answer, body)
    live = wait_for("the server's /prl/live", lambda: (a := ask(run, "GET", "/prl/live", timeout=30))[0] and a,
                    timeout=60, interval=1)
    assert live[0] == 200 and live[1]["ok"], live
    served = live[1]
    if answer == 502:  # refused before any weight was touched: still what it served
        assert "nothing was loaded" in body["error"], body
    else:  # touched, then the last disk weights loaded again
        assert "rolled back to" in body["error"] and served["weights_path"] in body["error"], (body, served)
        assert served["weights_step"] == served["disk_step"], served
    assert served["weights_path"] != f"memory:step_{step}" or served["last_update"]["step"] == step, served
    ended = wait_for("the job to fail", lambda: (s := status(env, run))["state"] == "FAILED" and s,
                     timeout=300, interval=2)
    assert ended["attempt"] == 4 and ended["failure"]["role"] == "trainer", ended
    assert not ended["failure"].get("hung"), ended["failure"]
    return {"trainer rank death mid-send -> the job's failure in status (s)": round(time.time() - killed, 1),
            "server answer to the cut update": answer}


def step_of_attempt(env: dict, run: Path, attempt: int) -> float:
    """Wait until attempt `attempt` runs and its trainer has trained a step past every step seen before; returns
    when the attempt was first seen."""
    wait_for(f"attempt {attempt} running", lambda: status(env, run)["attempt"] == attempt, timeout=300, interval=2)
    seen = time.time()
    before = trained(run)
    wait_for(f"a step of attempt {attempt}", lambda: trained(run) > before, timeout=400, interval=2)
    return seen
