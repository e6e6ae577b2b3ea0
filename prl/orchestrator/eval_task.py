"""One task of an evaluation sweep: serve one published weights step, evaluate environments on it.

    EvalTask(run_dir, step=20, envs=("prl_reverse_text",), examples=64)()   -> [row per environment]

A task is a plain picklable callable: `prl eval --run RUN` runs the tasks in-process
(`--local`) or as a submitit job array on Slurm (`--slurm`, prl.ops.sweep), one task per
weights step. Each task starts its own vLLM server (`python -m prl.inference`) on its node,
bound to 127.0.0.1 with a key made for this task alone, from `weights/step_N` (step 0: the
run's base model; the step is held against the run's cleanup until the task ends, `held_step`),
with the run's own server flags (dtype, max length, tensor parallelism) minus what belongs to a training fleet (ports, data parallelism, KV transfer). It then runs
every environment's eval split through `prl eval`'s own code (`eval.evaluate_endpoint`) and stops the server.
One server per step, not per step and environment: on CPU a start takes minutes, a second
environment on the same server only its rollouts. Conversations are rendered with the run's
`model.renderer` and sent token-in/token-out, as the orchestrator's in-run eval sends them, so a sweep
scores a step as training did (tool calls included: the server needs no tool-call parser).

Imports nothing heavy at module level: the control plane pickles tasks without torch or vLLM.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from prl.errors import ConfigError, RunDirError, StartError, StartTimeout
from prl.planner.model import START_TIMEOUT_S
from prl.run import api
from prl.states import Role

KEY_VAR = "PRL_EVAL_API_KEY"
BIND_TRIES = 3
"""Starts of an evaluation server whose port another process took before it bound (start_server)."""
@dataclass(frozen=True)
class EvalTask:
    run_dir: str
    step: int
    """Weights step to evaluate (0: the base model)."""
    envs: tuple[str, ...]
    examples: int = 64
    rollouts: int = 1
    max_tokens: int | None = 512
    temperature: float | None = 0.0
    env_args: dict[str, Any] = field(default_factory=dict)
    """Taskset arguments (empty: for the run's own environment, the run's `environment.args`)."""
    harness: str | None = None
    """verifiers harness id (None: for the run's own environment the run's `environment.harness`, else prl's)."""

    def environment(self, env_id: str, run_env) -> tuple[str, dict[str, Any]]:
        """The harness and taskset arguments `env_id` is evaluated with: what was asked, else for the run's own
        environment (`run_env`, None for an SFT run) what the run trained with, so an eval sweep rolls out as the
        run did."""
        own = run_env is not None and env_id == run_env.id
        harness = self.harness or (run_env.harness if own else "prl")
        return harness, dict(self.env_args) if self.env_args else dict(run_env.args) if own else {}

    def __call__(self) -> list[dict[str, Any]]:
        return evaluate_step(self)


def role_env(pairs: tuple[tuple[str, str], ...], environ: dict[str, str]) -> dict[str, str]:
    """A step's `env:` with its `${oc.env:NAME[,default]}` references read from `environ`, as its
    launch script does on the node (prl.planner.render.env_value)."""
    from prl.config.loader import ENV_REFERENCE, reference_default

    def value(ref) -> str:
        name, default = ref.group(1), reference_default(ref)
        if name in environ:
            return environ[name]
        if default is None:
            raise ConfigError(f"${{{name}}} is not set where this evaluation runs (the inference role's env)")
        return default

    return {key: ENV_REFERENCE.sub(value, text) for key, text in pairs}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def evaluate_step(task: EvalTask) -> list[dict[str, Any]]:
    from prl.run.rundir import RunDir

    run = RunDir(task.run_dir)
    with held_step(run, task.step):
        return _evaluate(run, task)


@contextmanager
def held_step(run, step: int) -> Iterator[None]:
    """Weights step `step` held against the run's cleanup while the block runs (its server reads
    `weights/step_N` as its `--model` for as long as it serves; step 0, the base model, holds nothing):
    RunDirError if the step is not published. Held first, looked at second: a cleanup between a look and
    a hold could take the step."""
    from prl.run.rundir import is_stable

    holder = f"eval.{socket.gethostname()}.{os.getpid()}"
    if step:
        run.hold_weights(holder, step)
    try:
        if step and not is_stable(run.weights(step)):
            raise RunDirError(f"weights step {step} of {run.root} is not published (no STABLE marker)")
        yield
    finally:
        if step:
            run.release_weights(holder)


def _evaluate(run, task: EvalTask) -> list[dict[str, Any]]:
    """`task` on a server of its step, which the caller holds."""
    from prl.orchestrator.eval import evaluate_endpoint
    from prl.planner.model import Plan

    plan = Plan.read(run)
    settings = plan.settings()
    model = settings.model.path if task.step == 0 else str(run.weights(task.step))
    # Rendered as the run's in-run eval renders (model.renderer, the run's tokenizer): the same prompts and
    # tool-call parsing as training, whatever chat and tool flags the server has.
    tokenizer = settings.model.tokenizer or settings.model.path
    served = plan.eval_server()
    key = secrets.token_urlsafe(24)
    log_path = run.eval_log(task.step)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    launch = plan.launch(served.launch)
    env = {**dict(served.env), **os.environ, **role_env(launch.env, dict(os.environ)), "PRL_ROLE": Role.INFERENCE,
           KEY_VAR: key}

    def argv(port: int) -> list[str]:
        return [sys.executable, "-m", "prl.inference", "--run-dir", str(run.root), "--api-key-env", KEY_VAR,
                "--model", model, "--served-model-name", plan.served_model_name, *served.args, "--host", "127.0.0.1",
                "--port", str(port)]

    server, url = start_server(argv, env, log_path)
    try:
        os.environ[KEY_VAR] = key  # prl eval's client reads the key from the variable it is named by
        rows = []
        for env_id in task.envs:
            harness, env_args = task.environment(env_id, settings.environment)
            stats = evaluate_endpoint(env_id, url, plan.served_model_name, api_key_env=KEY_VAR,
                                      examples=task.examples, rollouts=task.rollouts, args=env_args,
                                      harness=harness, max_tokens=task.max_tokens, temperature=task.temperature,
                                      render_with=tokenizer, renderer=settings.model.renderer)
            stats.pop("base_url", None)  # this task's own server, gone when it ends
            rows.append({"step": task.step, **stats})
        return rows
    finally:
        os.environ.pop(KEY_VAR, None)
        stop(server)


def start_server(argv: Callable[[int], list[str]], env: dict[str, str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """`argv(port)` started on a free port of 127.0.0.1 (its output appended to `log_path`), once healthy and
    proving the key `env[KEY_VAR]`: the process and its URL. Between `free_port()` and the server's bind another process can take the port (a
    busy node, or array tasks of the same sweep side by side): a server that exits saying the address is in
    use is started again on another port, BIND_TRIES times in all."""
    attempt = 1
    while True:
        port = free_port()
        logged = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as log:
            server = subprocess.Popen(argv(port), env=env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(server, url, log_path, env[KEY_VAR])
            return server, url
        except BaseException:
            stop(server)
            if attempt == BIND_TRIES or not port_taken(log_path, logged):
                raise
        attempt += 1


def port_taken(log_path: Path, since: int) -> bool:
    """Whether what the server logged after byte `since` says its port was taken."""
    with open(log_path, "rb") as log:
        log.seek(since)
        return b"Address already in use" in log.read()


def wait_healthy(server: subprocess.Popen, url: str, log_path: Path, key: str) -> None:
    """Until the server at `url` answers /health and proves it holds `key` (`api.proves_key`): another process
    that took the port first answers /health too, and must never be sent the key or the evaluation."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise StartError(f"the evaluation server exited with code {server.returncode} before it was "
                             f"healthy; its log: {log_path}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200 and api.proves_key(url, key):
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise StartTimeout(f"the evaluation server was not healthy after {START_TIMEOUT_S:.0f} s; its log: {log_path}")


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its engine processes too), SIGKILL after 30 s."""
    for signum, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if server.poll() is not None:
            return
        try:
            os.killpg(server.pid, signum)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
