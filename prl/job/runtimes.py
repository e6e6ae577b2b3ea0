"""How one task of each role starts its runtime process and proves it healthy.

Called by `prl.job.role` after the preflight. Each role's runtime is a child process:

    inference / prefill / decode   python -m prl.inference   ready when /health answers 200 and it proves the key
    teacher / reference            python -m prl.inference   (scoring servers) the same; never load new weights
    router                         python -m prl.inference.router  (P/D)  ready on /health and the key proof
    orchestrator                   python -m prl.orchestrator         ready when it heartbeats
    trainer                        torchrun -m prl.trainer            ready at once (it runs last; torchrun as
                                                                      prl.trainer.torchrun runs it: its store
                                                                      bound to node 0's address)

Servers and router get the run's API key (`RUN/api_key`, written by `prl submit`) in
$PRL_INFERENCE_API_KEY, never on a command line; without the file they do not start, nor does the
orchestrator, which reads the file itself: its environment, which env workers and their tools
inherit, never holds the key (prl/orchestrator/sync.py `hold_keys`).
Readiness becomes `state/ready/ROLE.TASK.json` (the launcher starts the next role after it)
and, for servers, `state/endpoints/ROLE.REPLICA.json` with the URL other roles use.
Signals to the task are passed on to the child; the task exits with the child's code.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Callable

from prl.errors import StartTimeout, child_exit
from prl.log import get_logger
from prl.planner.model import KILL_AFTER_S, RENDEZVOUS_BACKEND, START_TIMEOUT_S, Plan, Server, node_address
from prl.run import api
from prl.run.records import Endpoint
from prl.run.rundir import API_KEY_VAR, RunDir, is_stable
from prl.states import KV_ROLES, SCORER_ROLES, SERVER_ROLES, Role, RoleState

log = get_logger(__name__)


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def serves_for_run(url: str, key: str) -> bool:
    """Readiness of a server or the router: /health answers 200 and the listener proves it holds the run's key."""
    return http_ok(f"{url}/health") and api.proves_key(url, key)


def wait_endpoint(run: RunDir, role: str, index: int, stopped: Callable[[], bool], *, url: bool = False) -> Endpoint:
    """Task/replica `index` of `role`'s endpoint once it is published (with `url`: once it serves, not only its
    head's address for the followers of a multi-node server)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while (found := run.read_endpoint(role, index)) is None or url and found.url is None:
        if time.monotonic() > deadline or stopped():
            raise StartTimeout(f"{role}: no endpoint from {role} {index} after {START_TIMEOUT_S:.0f} s "
                               f"({run.endpoint(role, index)})")
        time.sleep(0.2)
    return found


HEALTH_EVERY_S = 5.0
"""How often a server's task probes /health once the server is ready."""


def supervise(argv: list[str], env: dict[str, str], stop: Any, ready: Callable[[], bool],
              on_ready: Callable[[], None], *, health: Callable[[], bool] | None = None,
              hang_s: float | None = None) -> int:
    """Run the child; call on_ready once `ready()` holds; pass signals on; return its exit code.

    A child not ready within START_TIMEOUT_S is stopped. With `health`, a ready child is probed every
    HEALTH_EVERY_S; one that does not answer for `hang_s` seconds is hung: it is stopped and `stop.failure`
    says why. Stopped: SIGTERM once, SIGKILL KILL_AFTER_S later if it is still there (it may ignore SIGTERM).
    """
    log.info(" ".join(argv))
    proc = subprocess.Popen(argv, env=env)
    announced = False
    deadline = time.monotonic() + START_TIMEOUT_S
    last_ok = next_probe = stopped_at = 0.0

    def stop_child(why: str) -> float:
        log.error(f"{why}; stopping it")
        proc.terminate()
        return time.monotonic()

    while proc.poll() is None:
        now = time.monotonic()
        if stop.signum is not None:
            proc.send_signal(stop.signum)
            stop.signum = None
        if stopped_at:
            if now - stopped_at > KILL_AFTER_S:
                log.error(f"still running {KILL_AFTER_S:.0f} s after SIGTERM; killing it")
                proc.kill()
                proc.wait()
        elif not announced:
            if ready():
                on_ready()
                announced = True
                last_ok = next_probe = time.monotonic()
                log.info("ready")
            elif now > deadline:
                stopped_at = stop_child(f"not healthy after {START_TIMEOUT_S:.0f} s")
        elif health is not None and hang_s is not None and now >= next_probe and not getattr(stop, "stopping", False):
            next_probe = now + HEALTH_EVERY_S
            if health():
                last_ok = now
            elif now - last_ok > hang_s:
                stop.failure = f"hung: its health probe unanswered for {now - last_ok:.0f} s (bound {hang_s:.0f} s)"
                stopped_at = stop_child(stop.failure)
        time.sleep(0.5)
    return child_exit(proc.returncode)


def restart_model(run: RunDir, server: Server, holder: str) -> str:
    """What a restarted server serves: the newest published weights step, if any, so it rejoins on the weights
    the others serve instead of its base model. The step is held for `holder` (cleanup keeps it) until
    `run.release_weights(holder)`: vLLM reads `--model` as long as it runs."""
    step = run.latest_stable("weights")
    # A LoRA server starts on the base model: its steps are adapters, which the weight watcher loads once it is up.
    if step is None or server.adapters:
        return server.model
    run.hold_weights(holder, step)
    if not is_stable(run.weights(step)):  # a cleanup took it between the look and the hold: look again
        run.release_weights(holder)
        return restart_model(run, server, holder)
    log.info(f"restart: serving weights step {step} ({run.weights(step)}) instead of {server.model}")
    return str(run.weights(step))


def _ready_marker(run: RunDir, role: str, task: int) -> Callable[[], None]:
    return lambda: run.mark_ready(role, task, socket.gethostname())


def run_server(run: RunDir, plan: Plan, role: str, task: int, stop: Any) -> int:
    """One vLLM server process: a whole replica, or one node's share of a multi-node replica."""
    server = plan.server(role, task)
    host = node_address(plan)
    extra: list[str] = []
    env = dict(os.environ)
    if server.gpus and os.environ.get("PRL_DEVICE") != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, server.gpus))
    if server.side_channel_port is not None:
        # Where decode servers ask this one for its KV layout (vLLM's default, localhost:5600, is shared by
        # every server of a node and unreachable from others).
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(server.side_channel_port)
    if server.address_from_head:
        # Multi-node replica: its head publishes its address (no url until healthy) for the followers.
        if server.head:
            run.write_endpoint(Endpoint(role=role, index=server.replica, host=host))
        head = wait_endpoint(run, role, server.replica, lambda: stop.signum is not None)
        extra += ["--data-parallel-address", head.host]
    restart = int(os.environ.get("PRL_RESTART", "0") or 0)
    holder = f"{role}.{task}"
    # A scorer's model never changes; the others' restart on the newest published step.
    model = restart_model(run, server, holder) if restart and role not in SCORER_ROLES else None
    env[API_KEY_VAR] = run.read_api_key()
    argv = [sys.executable, "-m", "prl.inference", "--run-dir", str(run.root), "--api-key-env", API_KEY_VAR,
            *server.argv(model), *extra, "--host", host]
    try:
        return _supervise_server(run, plan, role, task, stop, argv, env, host, restart)
    finally:
        run.release_weights(holder)


def _supervise_server(run: RunDir, plan: Plan, role: str, task: int, stop: Any, argv: list[str],
                      env: dict[str, str], host: str, restart: int) -> int:
    server = plan.server(role, task)
    mark = _ready_marker(run, role, task)
    if not server.head:
        return supervise(argv, env, stop, lambda: True, mark)
    url = f"http://{host}:{server.port}"

    def on_ready() -> None:
        # `started` tells the orchestrator a restarted server from the one it knew at the same url.
        run.write_endpoint(Endpoint(role=role, index=server.replica, host=host, port=server.port, url=url,
                                    started=time.time(), restart=restart))
        mark()

    try:
        return supervise(argv, env, stop, lambda: serves_for_run(url, env[API_KEY_VAR]), on_ready,
                         health=lambda: http_ok(f"{url}/prl/engine", timeout=15.0), hang_s=plan.server_hang_s)
    finally:
        # A server that is gone must not be advertised: the orchestrator drops it from rotation at once.
        run.endpoint(role, server.replica).unlink(missing_ok=True)
        run.task_ready(role, task).unlink(missing_ok=True)


def run_router(run: RunDir, plan: Plan, task: int, stop: Any) -> int:
    host = node_address(plan)
    port = plan.router_port
    urls: dict[str, list[str]] = {role: [] for role in KV_ROLES}
    for role in urls:
        replicas = sorted({s.replica for s in plan.role_servers(role)})
        urls[role] = [wait_endpoint(run, role, r, lambda: stop.signum is not None, url=True).url for r in replicas]
    env = {**os.environ, API_KEY_VAR: run.read_api_key()}
    argv = [sys.executable, "-m", "prl.inference.router", "--host", host, "--port", str(port),
            "--api-key-env", API_KEY_VAR]
    for role, found in urls.items():
        for url in found:
            argv += [f"--{role}", url]
    url = f"http://{host}:{port}"

    def on_ready() -> None:
        run.write_endpoint(Endpoint(role=Role.ROUTER, index=0, host=host, port=port, url=url))
        _ready_marker(run, Role.ROUTER, task)()

    return supervise(argv, env, stop, lambda: serves_for_run(url, env[API_KEY_VAR]), on_ready)


def run_orchestrator(run: RunDir, plan: Plan, task: int, stop: Any) -> int:
    started = time.time()

    def heartbeating() -> bool:
        state = run.read_state(Role.ORCHESTRATOR)
        return state is not None and state.status == RoleState.RUNNING and (state.heartbeat or 0.0) >= started

    argv = [sys.executable, "-m", "prl.orchestrator", "--run-dir", str(run.root)]
    run.read_api_key()  # fails closed here, as for the servers; the orchestrator reads it itself (`hold_keys`)
    env = {k: v for k, v in os.environ.items() if k != API_KEY_VAR}  # nothing it starts may inherit the key
    return supervise(argv, env, stop, heartbeating, _ready_marker(run, Role.ORCHESTRATOR, task))


def run_trainer(run: RunDir, plan: Plan, task: int, stop: Any) -> int:
    """torchrun on this node (prl.trainer.torchrun: its store bound to node 0's address); node 0 publishes the
    rendezvous address for the others."""
    tr = plan.trainer
    if task == 0:
        run.write_endpoint(Endpoint(role=Role.TRAINER, index=0, host=node_address(plan), port=tr.master_port))
    head = wait_endpoint(run, Role.TRAINER, 0, lambda: stop.signum is not None)
    argv = [sys.executable, "-m", "prl.trainer.torchrun", f"--nnodes={tr.nodes}",
            f"--nproc-per-node={tr.gpus_per_node}", f"--rdzv-backend={RENDEZVOUS_BACKEND}",
            f"--rdzv-endpoint={head.host}:{head.port}", f"--rdzv-conf=rank={task}",
            "-m", "prl.trainer", "--run-dir", str(run.root)]
    return supervise(argv, dict(os.environ), stop, lambda: True, _ready_marker(run, Role.TRAINER, task))


RUNTIMES: dict[str, Callable[..., int]] = {
    Role.TRAINER: run_trainer,
    Role.ORCHESTRATOR: run_orchestrator,
    Role.ROUTER: run_router,
}


def run_role(run: RunDir, plan: Plan, role: str, task: int, stop: Any) -> int:
    if role in SERVER_ROLES:
        return run_server(run, plan, role, task, stop)
    return RUNTIMES[role](run, plan, task, stop)
