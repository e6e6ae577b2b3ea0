"""`prl submit`: plan, render, submit one heterogeneous job (or local processes), record the handle.

The job handle (`RUN/job.json`, written only once the job exists) holds the job id, the
het components and their roles, the cluster, the mode and the scripts' hashes. Every
submission is also appended to the user's run registry (`$PRL_HOME/runs.jsonl`, default
`~/.local/state/prl`), so `prl status` with no argument finds the most recent run.

submitit is not used: it has no heterogeneous jobs (one configuration per job), and its
sacct watcher keys rows by the plain job id, so it never sees `ID+N` components finish.
prl renders its own hetjob script and submits it with `sbatch` through `prl.ops.slurm`; it
follows submitit in batching one squeue/sacct call per status and in a small error hierarchy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from prl.config.topology import TINY_MOE_FAMILIES, Model
from prl.errors import ConfigError, RunDirError, SlurmError
from prl.run import tenants
from prl.planner.prepare import Prepared, prepare, write_run_files
from prl.ops.registry import register
from prl.run.records import JobRecord
from prl.run.rundir import RunDir, pid_alive
from prl.states import LAUNCHER_ENDED, Backend

# sbatch complaint -> the profile or topology field that fixes it.
_HINTS = (
    (r"partition", "partitions.* in the cluster profile"),
    (r"account|association", "account in the cluster profile (or slurm.account in the topology)"),
    (r"qos", "qos in the cluster profile (or slurm.qos)"),
    (r"time limit", "default_time in the cluster profile (or slurm.time)"),
    (r"reservation", "slurm.reservation in the topology"),
    (r"node configuration is not available|gres|gpu", "gpu_node / gpu_directive / constraint in the cluster profile"),
    (r"node count|nodes", "the node counts in the topology, or max_nodes in the cluster profile"),
)


def _hint(message: str) -> str:
    for pattern, field in _HINTS:
        if re.search(pattern, message, re.IGNORECASE):
            return f"; check {field}"
    return ""


def _job_record(prepared: Prepared, backend: Backend, job_id: str, mode: str, hold: float, attempt_base: int,
                topology: Path, overrides: Sequence[str]) -> JobRecord:
    plan = prepared.plan
    scripts = {rel: hashlib.sha256(text.encode()).hexdigest() for rel, text in sorted(prepared.files.items())
               if rel.startswith("scripts/")}
    return JobRecord(
        job_id=job_id, name=plan.name, backend=backend, cluster=plan.cluster, mode=mode, hold=hold,
        hetjob=plan.hetjob, attempt_base=attempt_base, components={str(g.index): g.name for g in plan.groups},
        launches={s.name: s.group for s in plan.launches}, submitted=time.time(), topology=str(topology.resolve()),
        overrides=list(overrides), run_dir=plan.run_dir, scripts=scripts,
    )


def submit(topology: Path, overrides: Sequence[str], *, local: bool, detach: bool, resume: bool, force: bool,
           preflight: bool, hold: float) -> tuple[RunDir, JobRecord, subprocess.Popen | None]:
    """Submit; (run, its job, the local run's launcher when it runs in the foreground (`prl.ops.progress`
    follows it), else None)."""
    prepared = prepare(topology, overrides)
    if build_tiny_model(prepared.topology.model):
        prepared = prepare(topology, overrides)  # the model exists now: its path resolves, its config is checked
    run = RunDir(prepared.run_dir)
    old = run.read_job()
    if old and not (resume or force):
        raise ConfigError(f"{run.root} already holds job {old.job_id} ({old.backend}): use --resume to "
                          f"continue that run from its checkpoints, --force to submit anyway, or another run_dir")
    if old:
        ensure_ended(run, old)
    backend = Backend.LOCAL if local or not prepared.plan.slurm else Backend.SLURM
    mode = "preflight" if preflight else "run"
    attempt_base = max(run.attempts(), default=0)
    pool = RunDir(prepared.plan.attach) if prepared.plan.attach else None
    if pool is not None:
        tenants.check_attachable(pool, prepared.plan.name, run.root)
    write_run_files(prepared, force=True)  # first: it refuses a run_dir that is not this run's
    run.create()
    # A fresh key per submission; the role runner hands it to servers, router and orchestrator.
    run.create_api_key()
    if pool is not None:  # the pool's servers accept the run's key (its digest) from now on
        tenants.attach(pool, prepared.plan.name, run.root, run.read_api_key())
    env = {"PRL_MODE": mode, "PRL_HOLD": f"{hold:g}", "PRL_ATTEMPT_BASE": str(attempt_base)}
    if backend == Backend.SLURM:
        from prl.ops import slurm

        exports = ",".join(["ALL", *(f"{k}={v}" for k, v in env.items())])
        # sbatch records its umask (SLURM_UMASK); slurmd creates the batch log with it: keep that private too.
        umask = os.umask(0o077)
        try:
            job_id = slurm.sbatch(run.scripts_dir / "job.sbatch", extra_args=[f"--export={exports}",
                                                                              f"--chdir={run.root}"])
        except SlurmError as exc:
            raise SlurmError(f"sbatch rejected the job: {exc}{_hint(str(exc))} "
                             f"(cluster profile '{prepared.plan.cluster}')") from None
        finally:
            os.umask(umask)
        job = _job_record(prepared, backend, str(job_id), mode, hold, attempt_base, topology, overrides)
        run.write_job(job)
        register(run, job)
        return run, job, None

    job = _job_record(prepared, backend, f"local-{int(time.time())}", mode, hold, attempt_base, topology, overrides)
    log = open(run.launcher_log(backend), "ab")
    proc = subprocess.Popen([sys.executable, "-m", "prl.job.launch", "--run-dir", str(run.root)],
                            env={**os.environ, **env, "PRL_ATTEMPT": str(attempt_base + 1)}, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                            cwd=run.root, umask=0o077)
    log.close()
    job.pid = proc.pid
    run.write_job(job)
    register(run, job)
    return run, job, None if detach else proc


def build_tiny_model(m: Model, cwd: Path | None = None) -> bool:
    """`model.build_tiny`: build the tiny model at `model.path` when nothing is there yet (atomically: a
    directory built aside, then renamed); whether it built one."""
    if m.build_tiny is None or m.path is None:
        return False
    path = Path(m.path).expanduser()
    path = path if path.is_absolute() else (cwd or Path.cwd()) / path
    if path.exists():
        return False
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        raise ConfigError(f"model.build_tiny: building the tiny model at {path} needs torch and transformers "
                          f"(./scripts/install.sh, or pip install -e '.[train]')")
    print(f"model.path {m.path} holds no model yet: building a tiny random {m.build_tiny} model there "
          f"(model.build_tiny)", flush=True)
    aside = path.with_name(f".{path.name}.building-{os.getpid()}")
    family = {"moe": ["--moe"], "dense-lora": ["--lora"], "vlm": ["--vlm"],
              **{name: ["--family", name] for name in TINY_MOE_FAMILIES}}.get(m.build_tiny, [])
    done = subprocess.run([sys.executable, "-m", "prl.trainer.tiny_model", str(aside), *family],
                          capture_output=True, text=True)
    if done.returncode:
        shutil.rmtree(aside, ignore_errors=True)
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"model.build_tiny: building the tiny model at {path} failed: {last}")
    try:
        os.rename(aside, path)
    except OSError:
        shutil.rmtree(aside, ignore_errors=True)
        if not (path / "config.json").is_file():
            raise
        # Another submission built it meanwhile: theirs stays.
    return True


def job_alive(run: RunDir, job: JobRecord) -> bool:
    """Whether the run's job may still be running: Slurm's queue for a Slurm job; for a local run,
    its launcher's process (the launcher's record, else the pid `submit` saved)."""
    if job.backend == Backend.SLURM:
        from prl.ops import slurm

        try:
            rows = slurm.squeue_jobs([job.job_id])
        except SlurmError as exc:
            raise SlurmError(f"cannot tell whether job {job.job_id} still runs ({exc}); "
                             f"retry when squeue answers") from None
        return any(not r.terminal for r in rows.values())
    launcher = run.read_launcher()
    if launcher is not None and launcher.status in LAUNCHER_ENDED:
        return False
    return any(_is_launcher(pid) for pid in {launcher and launcher.pid, job.pid} if pid)


def _is_launcher(pid: Any, run: RunDir | None = None) -> bool:
    """pid is a live prl launcher (of `run`, when given), not a later process that reuses the number."""
    if not pid_alive(pid):
        return False
    try:
        argv = Path(f"/proc/{int(pid)}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # no /proc (or not ours to read): a live pid counts as alive
    return b"prl.job.launch" in argv and (run is None or str(run.root).encode() in argv)


def ensure_ended(run: RunDir, job: JobRecord) -> None:
    """Refuse to submit into a run whose previous job still runs (two jobs would write the same steps)."""
    if job_alive(run, job):
        raise RunDirError(f"job {job.job_id} of {run.root} is still running: stop it first "
                          f"(`prl cancel {run.root}`), then submit again")


def cancel(run: RunDir) -> tuple[JobRecord, bool]:
    """Cancel the run's job; (job, False) without touching anything if it already ended."""
    job = run.read_job()
    if job is None:
        raise ConfigError(f"{run.root} holds no submitted job (no job.json)")
    if job.backend == Backend.SLURM:
        from prl.ops import slurm

        rows = slurm.squeue_jobs([job.job_id])
        if not rows or all(r.terminal for r in rows.values()):
            return job, False
        # The intent first: a launcher about to requeue (a hung role) reads it and does not.
        job.cancelled = time.time()
        run.write_job(job)
        try:
            slurm.scancel(job.job_id)
        except SlurmError:
            job.cancelled = None
            run.write_job(job)
            raise
        return job, True
    launcher = run.read_launcher()
    if launcher is not None and launcher.status in LAUNCHER_ENDED:
        return job, False  # ended: its pid may belong to someone else by now
    if job.pid is None or not _is_launcher(job.pid, run):
        return job, False  # gone, or the number now belongs to another process: signal nothing
    try:
        os.killpg(job.pid, signal.SIGTERM)
    except ProcessLookupError:
        return job, False
    job.cancelled = time.time()
    run.write_job(job)
    return job, True
