"""How one task of each role starts its runtime process and proves it healthy.

Called by `prl.job.role` after the preflight. Each role's runtime is a child process:

    inference / prefill / decode   python -m prl.inference   ready when /health answers 200
    router                         python -m prl.inference.router  (P/D)  ready on /health
    orchestrator                   python -m prl.orchestrator         ready when it heartbeats
    trainer                        torchrun -m prl.trainer            ready at once (it runs last)

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

from prl.log import get_logger
from prl.planner.model import Plan
from prl.run.rundir import RunDir, atomic_write_json
from prl.states import RoleState

log = get_logger(__name__)

START_TIMEOUT = float(os.environ.get("PRL_START_TIMEOUT", "1800"))
ENDPOINT_WAIT_SECONDS = START_TIMEOUT


def node_address(plan: Plan) -> str:
    """This node's address as other nodes reach it (the profile's interface when it names one)."""
    iface = plan.network_interface
    if iface:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface[:15].encode()))  # SIOCGIFADDR
            return socket.inet_ntoa(packed[20:24])
    if not plan.slurm:
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_endpoint(run: RunDir, role: str, index: int, stopped: Callable[[], bool]) -> dict[str, Any]:
    path = run.endpoint(role, index)
    deadline = time.monotonic() + ENDPOINT_WAIT_SECONDS
    while not path.exists():
        if time.monotonic() > deadline or stopped():
            raise RuntimeError(f"{role}: no endpoint from {role} {index} after {ENDPOINT_WAIT_SECONDS:.0f} s ({path})")
        time.sleep(0.2)
    return json.loads(path.read_text())


def supervise(argv: list[str], env: dict[str, str], stop: Any, ready: Callable[[], bool],
              on_ready: Callable[[], None]) -> int:
    """Run the child; call on_ready once `ready()` holds; pass signals on; return its exit code."""
    log.info(" ".join(argv))
    proc = subprocess.Popen(argv, env=env)
    announced = False
    deadline = time.monotonic() + START_TIMEOUT
    while proc.poll() is None:
        if stop.signum is not None:
            proc.send_signal(stop.signum)
            stop.signum = None
        if not announced:
            if ready():
                on_ready()
                announced = True
                log.info("ready")
            elif time.monotonic() > deadline:
                log.error(f"not healthy after {START_TIMEOUT:.0f} s; stopping it")
                proc.terminate()
        time.sleep(0.5)
    code = proc.returncode
    return 128 - code if code < 0 else code


def _ready_marker(run: RunDir, role: str, task: int) -> Callable[[], None]:
    return lambda: atomic_write_json(run.task_ready(role, task), {"host": socket.gethostname(), "time": time.time()})


def run_server(run: RunDir, plan: Plan, role: str, task: int, stop: Any) -> int:
    """One vLLM server process: a whole replica, or one node's share of a multi-node replica."""
    server = plan.server(role, task)
    host = node_address(plan)
    args = list(server.args)
    env = dict(os.environ)
    if server.gpus and os.environ.get("PRL_DEVICE") != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, server.gpus))
    if server.address_from_head:
        # Multi-node replica: its head publishes its address (no url until healthy) for the followers.
        if server.head:
            atomic_write_json(run.endpoint(role, server.replica), {"host": host})
        head = wait_endpoint(run, role, server.replica, lambda: stop.signum is not None)
        args += ["--data-parallel-address", head["host"]]
    argv = [sys.executable, "-m", "prl.inference", "--run-dir", str(run.root), *args, "--host", host]
    mark = _ready_marker(run, role, task)
    if not server.head:
        return supervise(argv, env, stop, lambda: True, mark)
    url = f"http://{host}:{server.port}"

    def on_ready() -> None:
        atomic_write_json(run.endpoint(role, server.replica), {"url": url, "host": host, "role": role,
                                                                "replica": server.replica})
        mark()

    return supervise(argv, env, stop, lambda: http_ok(f"{url}/health"), on_ready)


def run_router(run: RunDir, plan: Plan, task: int, stop: Any) -> int:
    host = node_address(plan)
    port = plan.router_port
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for role in urls:
        replicas = sorted({s.replica for s in plan.role_servers(role)})
        urls[role] = [wait_endpoint(run, role, r, lambda: stop.signum is not None)["url"] for r in replicas]
    argv = [sys.executable, "-m", "prl.inference.router", "--host", host, "--port", str(port)]
    for role, found in urls.items():
        for url in found:
            argv += [f"--{role}", url]
    url = f"http://{host}:{port}"

    def on_ready() -> None:
        atomic_write_json(run.endpoint("router", 0), {"url": url, "role": "router", "replica": 0})
        _ready_marker(run, "router", task)()

    return supervise(argv, dict(os.environ), stop, lambda: http_ok(f"{url}/health"), on_ready)


def run_orchestrator(run: RunDir, plan: Plan, task: int, stop: Any) -> int:
    started = time.time()

    def heartbeating() -> bool:
        state = run.read_state("orchestrator") or {}
        return state.get("status") == RoleState.RUNNING and float(state.get("heartbeat") or 0) >= started

    argv = [sys.executable, "-m", "prl.orchestrator", "--run-dir", str(run.root)]
    return supervise(argv, dict(os.environ), stop, heartbeating, _ready_marker(run, "orchestrator", task))


def run_trainer(run: RunDir, plan: Plan, task: int, stop: Any) -> int:
    """torchrun on this node; node 0 publishes the rendezvous address for the others."""
    tr = plan.trainer
    if task == 0:
        atomic_write_json(run.endpoint("trainer", 0), {"host": node_address(plan), "port": tr.master_port})
    head = wait_endpoint(run, "trainer", 0, lambda: stop.signum is not None)
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={tr.nodes}",
            f"--nproc-per-node={tr.gpus_per_node}", f"--node-rank={task}",
            f"--master-addr={head['host']}", f"--master-port={head['port']}",
            "-m", "prl.trainer", "--run-dir", str(run.root)]
    return supervise(argv, dict(os.environ), stop, lambda: True, _ready_marker(run, "trainer", task))


RUNTIMES: dict[str, Callable[..., int]] = {
    "trainer": run_trainer,
    "orchestrator": run_orchestrator,
    "router": run_router,
}


def run_role(run: RunDir, plan: Plan, role: str, task: int, stop: Any) -> int:
    if role in ("inference", "prefill", "decode"):
        return run_server(run, plan, role, task, stop)
    return RUNTIMES[role](run, plan, task, stop)
