"""`prl eval ENV --run RUN`: a run's published weights evaluated step by step, here or as a submitit job array."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from prl.errors import ConfigError, RunDirError, StartError
from prl.ops.sweep import array_parameters, choose_steps
from prl.orchestrator.eval import pass_at_k
from prl.orchestrator.rollouts import Rollout
from prl.orchestrator import eval_task
from prl.orchestrator.eval_task import role_env
from prl.planner.model import Plan
from prl.run.rundir import RunDir
from prl.job.runtimes import http_ok
from tests.helpers import REPO, prl_cli as prl, wait_for
from tests.tiny_model import build_tiny_model


def test_an_evaluation_server_takes_what_one_server_of_the_model_takes_and_nothing_of_the_fleet(tmp_path):
    """The plan says what a lone server of the run's model takes (its flags, tp, memory, the user's extra
    arguments) without its place in the fleet: dp, ports, expert parallelism, KV transfer and offload."""
    from testkit.plans import local_plan

    plan = local_plan(tmp_path / "run", tmp_path, ["inference.dp=2", "inference.extra_args=[--enforce-eager]"])
    lone = plan.eval_server().args
    assert lone == plan.inference[0].lone_args and "--enforce-eager" in lone
    assert lone[:2] == ("--dtype", plan.settings().model.dtype) and "--tensor-parallel-size" in lone
    fleet = set(plan.servers[0].args) - set(lone)
    assert {"--data-parallel-size", "--port"} <= fleet and not {"--model", "--served-model-name"} & set(lone)


def test_role_env_reads_references_like_the_step_script():
    pairs = (("A", "plain"), ("B", "${oc.env:TOKEN}"), ("C", "x-${oc.env:MISSING,fallback}-y"))
    assert role_env(pairs, {"TOKEN": "s3cret"}) == {"A": "plain", "B": "s3cret", "C": "x-fallback-y"}
    with pytest.raises(ConfigError, match=r"\$\{TOKEN\} is not set"):
        role_env(pairs, {})


HEALTH_SERVER = """
import http.server, json, os, sys, urllib.parse
from prl.run import api
class Health(http.server.BaseHTTPRequestHandler):  # /health, and the key proof where it holds the key
    def do_GET(self):
        path, _, query = self.path.partition("?")
        nonce = urllib.parse.parse_qs(query).get("nonce", [""])[0]
        key = os.environ.get("PRL_EVAL_API_KEY")
        ok = path == "/health" or path == api.PROOF_PATH and key is not None
        self.send_response(200 if ok else 404)
        self.end_headers()
        if path == api.PROOF_PATH and key is not None:
            self.wfile.write(json.dumps({"proof": api.key_proof(key, nonce, int(sys.argv[1]))}).encode())
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""
KEYED = {"PRL_EVAL_API_KEY": "eval-key", "PYTHONPATH": str(REPO)}


def test_an_evaluation_server_whose_port_was_taken_before_it_bound_starts_again_on_another(tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1], taken.getsockname()[1], eval_task.free_port()])
    monkeypatch.setattr(eval_task, "free_port", lambda: next(ports))
    log = tmp_path / "eval.log"
    with taken:
        server, url = eval_task.start_server(lambda port: [sys.executable, "-c", HEALTH_SERVER, str(port)], KEYED, log)
    try:
        assert url.endswith(f":{server.args[-1]}") and server.poll() is None
        assert log.read_text().count("Address already in use") == 2  # two starts refused, the third serves
    finally:
        eval_task.stop(server)


def test_a_process_on_the_evaluation_server_s_port_is_never_taken_for_it(tmp_path, monkeypatch):
    """A squatter answering /health on the port picked for the server: the server's bind fails, it starts again
    on another port, and the squatter (which cannot prove the key) never got the evaluation."""
    squat_port, free = eval_task.free_port(), eval_task.free_port()
    squatter = subprocess.Popen([sys.executable, "-c", HEALTH_SERVER, str(squat_port)],
                                env={k: v for k, v in {**os.environ, **KEYED}.items() if k != "PRL_EVAL_API_KEY"})
    ports = iter([squat_port, free])
    monkeypatch.setattr(eval_task, "free_port", lambda: next(ports))
    try:
        wait_for("the squatter", lambda: http_ok(f"http://127.0.0.1:{squat_port}/health"), timeout=30)

        def argv(port: int) -> list[str]:  # the real server binds a moment after the squatter answers /health
            return [sys.executable, "-c", f"import time; time.sleep(1.5); exec({HEALTH_SERVER!r})", str(port)]

        server, url = eval_task.start_server(argv, {**os.environ, **KEYED}, tmp_path / "eval.log")
        try:
            assert url == f"http://127.0.0.1:{free}"
        finally:
            eval_task.stop(server)
    finally:
        squatter.terminate()
        squatter.wait(timeout=30)


def test_an_evaluation_server_that_fails_for_another_reason_is_not_started_again(tmp_path):
    starts = []

    def argv(port: int) -> list[str]:
        starts.append(port)
        return [sys.executable, "-c", "raise SystemExit('no model here')"]

    with pytest.raises(StartError, match=r"exited with code 1 before it was healthy; its log: .*eval.log"):
        eval_task.start_server(argv, KEYED, tmp_path / "eval.log")
    assert len(starts) == 1


def rollouts(rewards: list[float], failed: int = 0) -> list[Rollout]:
    return [Rollout(r, 0, [], 1) for r in rewards] + [Rollout(0.0, 0, [], 0, error="x") for _ in range(failed)]


def test_pass_at_k_is_the_unbiased_estimate_over_finished_rollouts():
    groups = [rollouts([1, 0, 0, 0]), rollouts([0, 0, 0, 0]), rollouts([1, 1, 1, 1]), rollouts([1, 0], failed=2)]
    out = pass_at_k(groups, 4)
    # pass@1: mean of c/n = (1/4 + 0 + 1 + 1/2) / 4; pass@4: tasks with >= 4 finished rollouts only
    assert out["pass@1"] == pytest.approx((0.25 + 0 + 1 + 0.5) / 4)
    assert out["pass@4"] == pytest.approx((1 + 0 + 1) / 3)


def test_the_eval_array_asks_slurm_for_what_the_inference_nodes_got(tmp_path):
    """Account, QoS, exclusive nodes, GPUs by gres and the topology's extra directives come from the inference
    group; the array's own shape (one node, one task, its time) replaces theirs; the container too. The profile's
    segment(8) is not given to a one-node group (Slurm refuses a segment that does not divide the nodes)."""
    from prl.planner.prepare import prepare
    from testkit.plans import REPO

    plan = prepare(REPO / "configs" / "dense-8b.yaml", [f"run_dir={tmp_path}/run", "slurm.qos=high",
                                                       "slurm.extra_directives=[--mail-type=END]"], cwd=REPO).plan
    params = array_parameters(plan, parallel=3, timeout_min=30)
    assert params["additional_parameters"] == {
        "partition": "batch", "gres": "gpu:8", "exclusive": True, "mem": "0",
        "account": "llm-post-training", "qos": "high", "mail_type": "END"}
    assert (params["nodes"], params["ntasks_per_node"], params["time"], params["array_parallelism"]) == (1, 1, 30, 3)
    assert params["srun_args"] == ["--container-image=nvcr.io#nvidia/pytorch:25.09-py3",
                                   f"--container-mounts=/lustre/fs1:/lustre/fs1,{tmp_path}/run:{tmp_path}/run",
                                   "--container-workdir=/lustre/fs1/prl"]


def test_an_sft_runs_evaluation_server_takes_the_models_own_settings(tmp_path, tiny_model_dir):
    """An SFT run has no inference servers to copy: its evaluation server serves the model with its own dtype,
    context length and tokenizer, with the trainer's env, on a node of the trainer's group (eager on CPU)."""
    from testkit.plans import local_plan, write_plan

    run = write_plan(RunDir(tmp_path / "run"), local_plan(
        tmp_path / "run", tiny_model_dir, [f"sft.data={tmp_path}/chat.jsonl", f"model.tokenizer={tiny_model_dir}"],
        topology="sft-tiny"))
    plan = Plan.read(run)
    served = plan.eval_server()
    assert served.args == ("--dtype", "float32", "--max-model-len", "256", "--tokenizer", str(tiny_model_dir),
                           "--enforce-eager")  # the sweep adds the model, its name (plan.served_model_name), the port
    assert (served.launch, served.group, served.env) == ("trainer", plan.trainer.group, (("VLLM_CPU_KVCACHE_SPACE", "2"),))
    assert array_parameters(plan, 2, 30)["cpus_per_task"] == plan.groups[plan.trainer.group].cpus_per_task


def test_steps_are_published_ones_or_the_base_model(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    with pytest.raises(ConfigError, match="no published weights .* --steps 0 evaluates the base model"):
        choose_steps(run, "all")
    for step in (2, 4):
        run.publish_dir(run.weights(step), lambda tmp: (tmp / "model.safetensors").write_bytes(b"x"))
    assert choose_steps(run, "all") == [2, 4] and choose_steps(run, "latest") == [4]
    assert choose_steps(run, "4,0, 2") == [0, 2, 4]
    with pytest.raises(ConfigError, match=r"step\(s\) 3 are not published .* \(published: 2, 4\)"):
        choose_steps(run, "2,3")
    with pytest.raises(ConfigError, match="expected all, latest or a comma list"):
        choose_steps(run, "last")


def publish_copy(run: RunDir, step: int, model: Path, broken: bool = False) -> None:
    def write(tmp: Path) -> None:
        for f in model.iterdir():
            shutil.copy(f, tmp)
        if broken:
            (tmp / "config.json").write_text('{"model_type": "no-such-architecture"}')

    run.publish_dir(run.weights(step), write)


def test_an_evaluated_step_is_held_against_the_run_s_cleanup_until_its_task_ends(tmp_path, monkeypatch):
    """While a task evaluates weights step 2 (its server reading weights/step_2 as its --model), the trainer's
    cleanup of step 6 keeps step 2, far outside the staleness window; once the task ends the hold is gone and
    the next cleanup takes it. A step the cleanup took first is refused, holding nothing."""
    from prl.orchestrator import eval as evaluation
    from testkit.plans import local_plan, write_plan

    run = write_plan(RunDir(tmp_path / "run"), local_plan(tmp_path / "run", tmp_path / "model"))
    for step in range(1, 7):
        run.publish_dir(run.weights(step), lambda tmp: (tmp / "model.safetensors").write_bytes(b"x"), step=step)
    seen, start_server = {}, eval_task.start_server

    def serve(argv, env, log_path):  # a stand-in server: /health and the key proof, as start_server needs
        return start_server(lambda port: [sys.executable, "-c", HEALTH_SERVER, str(port)],
                                      {**os.environ, **env, **KEYED}, log_path)

    def evaluate(env_id, url, model, **kwargs):  # the trainer cleans up while the task evaluates
        run.cleanup(6, max_off_policy_steps=1, checkpoint_keep=1)
        seen["weights"], seen["holds"] = run.stable_steps("weights"), run.weight_holds()
        return {"env": env_id, "reward": 0.5}

    monkeypatch.setattr(eval_task, "start_server", serve)
    monkeypatch.setattr(evaluation, "evaluate_endpoint", evaluate)
    rows = eval_task.EvalTask(str(run.root), step=2, envs=("prl_reverse_text",))()
    assert rows == [{"step": 2, "env": "prl_reverse_text", "reward": 0.5}]
    assert seen["weights"] == [2, 5, 6] and list(seen["holds"].values()) == [2], seen
    assert run.weight_holds() == {}
    run.cleanup(6, max_off_policy_steps=1, checkpoint_keep=1)
    assert run.stable_steps("weights") == [5, 6]
    with pytest.raises(RunDirError, match="weights step 2 of .* is not published"):
        eval_task.EvalTask(str(run.root), step=2, envs=("prl_reverse_text",))()
    assert run.weight_holds() == {}


def test_submitits_sacct_warning_is_said_once_not_on_every_poll(capfd):
    """Where sacct fails (a cluster without accounting) submitit warns on every poll, on stdout and stderr."""
    import logging

    from submitit.core import logger as submitit_logger

    from prl.ops.sweep import one_sacct_warning

    class Kept(logging.Handler):
        """prl's own records, whether or not an earlier test's init_logging stopped them propagating."""

        def __init__(self) -> None:
            super().__init__()
            self.records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    kept = Kept()
    logging.getLogger("prl.ops.sweep").addHandler(kept)
    warn = "Call #%d - Bypassing sacct error Command '['sacct']' returned non-zero exit status 1., status may be inaccurate."
    try:
        with one_sacct_warning():
            for call in range(1, 6):
                submitit_logger.get_logger().warning(warn % call)
            submitit_logger.get_logger().warning("another warning")
    finally:
        logging.getLogger("prl.ops.sweep").removeHandler(kept)
    out, err = capfd.readouterr()
    assert "Bypassing" not in out + err and "another warning" in err
    said = [r.getMessage() for r in kept.records if "sacct failed" in r.getMessage()]
    assert len(said) == 1 and "returned non-zero exit status 1.)" in said[0], said
    submitit_logger.get_logger().warning(warn % 6)  # outside a sweep submitit's logging is its own
    assert "Bypassing sacct error" in capfd.readouterr().err


@pytest.mark.slurm
@pytest.mark.vllm
@pytest.mark.slow
def test_a_sweep_runs_as_a_submitit_job_array_and_reports_a_failed_step_with_its_log(tmp_path, env, slurm_cluster):
    model = build_tiny_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    prl(env, "plan", "configs/lab.yaml", f"run_dir={run_dir}", f"model.path={model}")
    run = RunDir(run_dir)
    publish_copy(run, 1, model)
    publish_copy(run, 2, model)
    publish_copy(run, 3, model, broken=True)

    out = prl(env, "eval", "prl_letters", "--run", run_dir, "--slurm", "--parallel", "3", "--examples", "4",
              "--rollouts", "2", "--max-tokens", "8", "--timeout-min", "15", check=False, timeout=1200)
    assert out.returncode == 1, out.stdout + out.stderr  # step 3 failed, and says so
    assert "as a Slurm job array" in out.stdout and "step 3 failed: job " in out.stdout, out.stdout

    [sweep] = run.evals_dir.glob("sweep-*.json")
    result = json.loads(sweep.read_text())
    assert result["backend"] == "slurm"
    rows = sorted(result["rows"], key=lambda r: r["step"])
    assert [(r["step"], r["env"], r["rollouts"], r["failed_rollouts"]) for r in rows] == [
        (1, "prl_letters", 8, 0), (2, "prl_letters", 8, 0)]
    assert all(0.0 <= r["reward_mean"] <= 1.0 and "pass@2" in r for r in rows)
    # Same weights, greedy decoding: the two steps score the same.
    assert rows[0]["reward_mean"] == pytest.approx(rows[1]["reward_mean"])
    [failed] = result["failed"]
    assert failed["step"] == 3 and Path(failed["log"]).is_file()
    assert "evaluation server exited" in Path(failed["log"]).read_text()
    # Each array task ran as its own Slurm job through submitit's files in the run directory.
    assert len(list((run.evals_dir / "submitit").glob("*_submission.sh"))) + len(
        list((run.evals_dir / "submitit").glob("*/*_submission.sh"))) >= 1


def test_a_sweep_rolls_out_the_runs_own_environment_as_the_run_did_unless_told_otherwise():
    """`prl eval ENV --run RUN`: for the run's own environment its harness and taskset arguments; what the command
    gives replaces them; another environment gets prl's harness and no arguments."""
    from prl.config.topology import Environment
    from prl.orchestrator.eval_task import EvalTask

    run_env = Environment(id="prl_letters", harness="my_agent", args={"n": 3})
    plain = EvalTask("/r", 1, ("prl_letters",))
    assert plain.environment("prl_letters", run_env) == ("my_agent", {"n": 3})
    assert plain.environment("prl_calc", run_env) == ("prl", {})
    assert plain.environment("prl_letters", None) == ("prl", {})  # an SFT run trained no environment
    told = EvalTask("/r", 1, ("prl_letters",), env_args={"n": 5}, harness="other")
    assert told.environment("prl_letters", run_env) == ("other", {"n": 5})


def test_prl_eval_runs_the_rollouts_in_the_harness_it_is_given():
    """`prl eval ENV --harness H` reaches the environment's loading: a harness that is not importable is refused
    in one line naming it, before any request."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "prl.cli", "eval", "prl_letters", "--harness", "no_such_harness",
                           "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "-n", "1"],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "harness 'no_such_harness'" in done.stderr, done.stderr
