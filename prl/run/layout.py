"""Where everything of a run lies: one class of paths, no file read or written (`RunLayout`).

    RUN/
      topology.yaml  plan.json  job.json      asked / planned / submitted
      api_key                                 the run's API key (0600; never in scripts, plans or logs)
      scripts/                                rendered sbatch + per-role scripts
      logs/attempt_N/<role>/<role>.log        one dir per attempt (requeue = new attempt)
      logs/attempt_N/<role>/rank_K.log        per-rank logs of multi-rank roles
      logs/latest -> attempt_N
      logs/launcher.log | logs/slurm-JOBID.out the launcher's own output (local | Slurm)
      rollouts/step_N/   + STABLE             orchestrator -> trainer
      weights/step_N/    + STABLE             trainer -> inference (HF layout)
      checkpoints/step_N/<role>/ + STABLE     per-role resumable state
      state/launcher.json                     the launcher's record of the current attempt
      state/<role>.json                       start / heartbeat / exit of each role (its rank 0)
      state/beats/<role>.<rank>.json          heartbeats of a multi-rank role's other ranks
      state/exits/<role>.<task>.json          how each task ended
      state/errors/<role>.<host>.<pid>.json   the prl error line a role's process ended on
      state/endpoints/<role>.<K>.json         how to reach task or replica K of a role
      state/ready/<role>.<task>.json          a task is healthy;  state/preflight/<role>.<task>.json its checks
      state/stop.json  state/stop/<role>.<replica>.json   the launcher's stop of the job / of one replica
      state/weights_feed.json                 the newest weights step the trainer's feeds serve
      state/pins/<owner>.json  state/holds/<owner>.json  weights steps cleanup keeps
      state/reserve                           4 MiB the launcher frees on a full disk to record the failure
      metrics.jsonl                           one JSON object per line
      plots/progress.png  wandb/  state/wandb.json   `prl plot` and `prl wandb` output
      evals/                                  `prl eval --run` sweeps: results, server logs, submitit files
      samples/step_N.json                     a sample of step N's rollouts, readable (`prl rollouts`)
      kv/                                     KV of a storage-based P/D connector (ExampleConnector)

Steps are numbered from 1: the trainer's step N consumes `rollouts/step_N` and publishes `weights/step_N`
(policy version N; the base model is version 0). The owner of the layout owns its parsing: attempt numbers,
rank log names and step directories are parsed here (and `step_of`, prl/run/files.py), nowhere else.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from prl.errors import RunDirError
from prl.states import Backend, Role

ROLES = tuple(Role)
"""Roles that may write state, logs and checkpoints under a run."""

KINDS = ("rollouts", "weights", "checkpoints")
"""Per-step directories under a run."""

_ATTEMPT_RE = re.compile(r"^attempt_(\d+)$")
_RANK_LOG_RE = re.compile(r"^rank_(\d+)\.log$")
_SAMPLE_RE = re.compile(r"^step_(\d+)\.json$")


def _numbered(folder: Path, pattern: re.Pattern) -> list[int]:
    """The numbers in the names of `folder`'s entries that `pattern` matches (its group 1), ascending."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := pattern.match(p.name)))


class RunLayout:
    """The paths of one run directory (constructing it touches nothing on disk)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).absolute()

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    @property
    def topology_yaml(self) -> Path:
        return self.root / "topology.yaml"

    @property
    def plan_json(self) -> Path:
        return self.root / "plan.json"

    @property
    def job_json(self) -> Path:
        return self.root / "job.json"

    @property
    def scripts_dir(self) -> Path:
        return self.root / "scripts"

    @property
    def api_key_file(self) -> Path:
        """The run's API key (mode 0600): written by `prl submit`, read on the nodes by the role runner."""
        return self.root / "api_key"

    @property
    def metrics_jsonl(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    def attempt_logs(self, attempt: int) -> Path:
        return self.logs_dir / f"attempt_{attempt}"

    def attempts(self) -> list[int]:
        """Every attempt that has a log dir (logs/attempt_N), ascending."""
        return _numbered(self.logs_dir, _ATTEMPT_RE)

    def latest_attempt(self) -> int | None:
        """The attempt logs/latest points at; else the highest with a log dir; None before the job started."""
        try:
            m = _ATTEMPT_RE.match(os.readlink(self.latest_logs))
        except OSError:
            m = None
        if m:
            return int(m.group(1))
        return max(self.attempts(), default=None)

    @property
    def latest_logs(self) -> Path:
        """Symlink to the newest attempt's log dir (see `link_latest_logs`)."""
        return self.logs_dir / "latest"

    def role_logs_dir(self, attempt: int, role: str) -> Path:
        """logs/attempt_N/<role>: the role's logs of one attempt."""
        _check_role(role)
        return self.attempt_logs(attempt) / role

    def role_log(self, attempt: int, role: str, rank: int | None = None) -> Path:
        name = f"{role}.log" if rank is None else f"rank_{rank}.log"
        return self.role_logs_dir(attempt, role) / name

    def rank_logs(self, attempt: int, role: str) -> list[tuple[int, Path]]:
        """(rank, path) of every per-rank log of `role` in `attempt`, by rank."""
        folder = self.role_logs_dir(attempt, role)
        if not folder.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _RANK_LOG_RE.match(p.name)))

    def launcher_log(self, backend: Backend, job_id: str | None = None) -> Path:
        """The launcher's own output: logs/slurm-JOBID.out on Slurm (the batch script's), else logs/launcher.log."""
        if backend == Backend.SLURM:
            return self.logs_dir / f"slurm-{job_id}.out"
        return self.logs_dir / "launcher.log"

    @property
    def batch_log_pattern(self) -> str:
        """`sbatch --output` pattern of the launcher's log on Slurm (`launcher_log(Backend.SLURM, JOBID)`)."""
        return str(self.logs_dir / "slurm-%j.out")

    def link_latest_logs(self, attempt: int) -> Path:
        """Point logs/latest at attempt_N (atomic replace of the link)."""
        self.attempt_logs(attempt).mkdir(parents=True, exist_ok=True)
        tmp = self.logs_dir / f".latest.tmp-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(f"attempt_{attempt}", tmp)
        os.replace(tmp, self.latest_logs)
        return self.latest_logs

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    def role_state(self, role: str) -> Path:
        _check_role(role)
        return self.state_dir / f"{role}.json"

    def rank_beat(self, role: str, rank: int) -> Path:
        """state/beats/<role>.<rank>.json: the heartbeat of one rank other than 0 (rank 0's is in the role's state)."""
        _check_role(role)
        return self.state_dir / "beats" / f"{role}.{rank}.json"

    def step_dir(self, kind: str, step: int) -> Path:
        if kind not in KINDS:
            raise RunDirError(f"unknown step kind {kind!r}; expected one of {', '.join(KINDS)}")
        if step < 0:
            raise RunDirError(f"step must be >= 0, got {step}")
        return self.root / kind / f"step_{step}"

    @property
    def kv_storage(self) -> Path:
        """kv/: where a storage-based KV connector (`ExampleConnector`) of prefill/decode servers shares KV."""
        return self.root / "kv"

    def weights_root(self) -> Path:
        """weights/, resolved (the run dir itself may sit behind a symlink): what a server may load from."""
        return Path(os.path.realpath(self.root / "weights"))

    def rollouts(self, step: int) -> Path:
        return self.step_dir("rollouts", step)

    def weights(self, step: int) -> Path:
        return self.step_dir("weights", step)

    def checkpoints(self, step: int, role: str | None = None) -> Path:
        """checkpoints/step_N, or checkpoints/step_N/<role> (what one role publishes)."""
        d = self.step_dir("checkpoints", step)
        if role is None:
            return d
        _check_role(role)
        return d / role

    def _published(self, kind: str, step: int, role: str | None) -> Path:
        return self.checkpoints(step, role or Role.TRAINER) if kind == "checkpoints" else self.step_dir(kind, step)

    @property
    def pins_dir(self) -> Path:
        return self.state_dir / "pins"

    @property
    def weights_feed_file(self) -> Path:
        return self.state_dir / "weights_feed.json"

    @property
    def holds_dir(self) -> Path:
        return self.state_dir / "holds"

    @property
    def evals_dir(self) -> Path:
        """evals/: `prl eval --run` results (sweep-<time>.json), its servers' logs and submitit's files."""
        return self.root / "evals"

    def eval_log(self, step: int) -> Path:
        """The log of the server an evaluation sweep started for weights step `step`."""
        return self.evals_dir / "logs" / f"server_step_{step}.log"

    @property
    def samples_dir(self) -> Path:
        """samples/: each step's sample of rollouts as a person reads them (`prl rollouts`)."""
        return self.root / "samples"

    def rollout_sample(self, step: int) -> Path:
        return self.samples_dir / f"step_{step}.json"

    def rollout_sample_steps(self) -> list[int]:
        """The steps with a rollout sample, oldest first."""
        return _numbered(self.samples_dir, _SAMPLE_RE)

    @property
    def progress_png(self) -> Path:
        """plots/progress.png: `prl plot`'s default output."""
        return self.root / "plots" / "progress.png"

    @property
    def wandb_dir(self) -> Path:
        """W&B's own files for this run (`prl wandb`; offline runs wait here for `wandb sync`)."""
        return self.root / "wandb"

    @property
    def wandb_cursor(self) -> Path:
        """state/wandb.json: the W&B run id and the last step `prl wandb` logged."""
        return self.state_dir / "wandb.json"

    @property
    def launcher_state(self) -> Path:
        """state/launcher.json: attempt, mode, per-step start/exit, first failure, final status."""
        return self.state_dir / "launcher.json"

    def attempt_launcher_state(self, attempt: int) -> Path:
        """logs/attempt_N/launcher.json: the launcher's final record of attempt N (launcher.json is the latest's)."""
        return self.attempt_logs(attempt) / "launcher.json"

    def task_ready(self, role: str, task: int) -> Path:
        """Marker a role's task writes once it is healthy; the launcher starts the next role after all of them."""
        _check_role(role)
        return self.state_dir / "ready" / f"{role}.{task}.json"

    def preflight_report(self, role: str, task: int) -> Path:
        _check_role(role)
        return self.state_dir / "preflight" / f"{role}.{task}.json"

    def probe_file(self) -> Path:
        """A scratch file of this process under state/ (the preflight's check that the run dir is writable)."""
        return self.state_dir / "preflight" / f".probe-{socket.gethostname()}-{os.getpid()}"

    def task_exit(self, role: str, task: int) -> Path:
        """A task's own record of how it ended (exit code, time): srun reports only the step's worst."""
        _check_role(role)
        return self.state_dir / "exits" / f"{role}.{task}.json"

    def role_error(self, role: str, host: str, pid: int) -> Path:
        """The error line process `pid` on `host` of `role` ended on (a trainer rank, the role runner itself)."""
        _check_role(role)
        return self.state_dir / "errors" / f"{role}.{host}.{pid}.json"

    def role_errors(self, role: str) -> list[Path]:
        """Every error record of `role`'s processes in this attempt."""
        _check_role(role)
        folder = self.state_dir / "errors"
        return sorted(folder.glob(f"{role}.*.json")) if folder.is_dir() else []

    @property
    def reserve(self) -> Path:
        """state/reserve: RESERVE_BYTES of real blocks the launcher gives back when the disk fills, so it can
        still record what failed and ask the roles to stop (`make_reserve`, `release_reserve`)."""
        return self.state_dir / "reserve"

    @property
    def stop_request(self) -> Path:
        """Written by the launcher to ask every task of this attempt to stop (checkpoint, then exit)."""
        return self.state_dir / "stop.json"

    def replica_stop(self, role: str, replica: int) -> Path:
        """Written by the launcher to stop the live tasks of one multi-node server replica whose other task
        failed (a head without its followers, or followers without their head, cannot serve), so the replica
        restarts whole."""
        _check_role(role)
        return self.state_dir / "stop" / f"{role}.{replica}.json"

    @property
    def endpoints_dir(self) -> Path:
        return self.state_dir / "endpoints"

    def endpoint(self, role: str, index: int) -> Path:
        """Where task/replica `index` of `role` says how to reach it (host, port)."""
        _check_role(role)
        return self.endpoints_dir / f"{role}.{index}.json"

    def task_log_pattern(self, attempt: int, role: str) -> str:
        """`srun --output` pattern for one log per task: role_log(attempt, role, rank=K) for task K."""
        return str(self.role_logs_dir(attempt, role) / "rank_%t.log")

    def path(self, relative: str | Path) -> Path:
        """A path the plan records relative to the run directory (a step's script), made absolute."""
        return self.root / relative


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise RunDirError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
