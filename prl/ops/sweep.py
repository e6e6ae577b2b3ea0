"""`prl eval ENV... --run RUN`: evaluate a run's published weights steps, in-process or as a job array.

    prl eval prl_reverse_text --run RUN --steps all --slurm --parallel 4

The tasks (one per weights step; prl.orchestrator.eval_task.EvalTask, plain picklable callables)
run one after another in this process with `--local` (the default), or as one submitit job
array with `--slurm`: submitit is made for jobs that are Python functions (the RL job is a
heterogeneous job, which submitit cannot submit, hence rendered sbatch). The array's tasks get
the `#SBATCH` options of the run's inference nodes (partition, GPUs, account, QoS, reservation,
constraint, the topology's extra directives: whatever the RL job asked for them) with the array's
own shape (one node, one task, the time limit), the container the RL job's steps run in, and the
profile's setup lines, at most `--parallel` at a time. Results come back through submitit's job
handles; a failed task is reported with its log, never dropped. Everything lands in RUN/evals/sweep-<time>.json and
in one table.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from prl.errors import ConfigError
from prl.log import get_logger
from prl.planner.model import Plan
from prl.run.rundir import RunDir, atomic_write_json

TIMEOUT_MINUTES = 120
SACCT_BYPASS = "Bypassing sacct error"
"""What submitit logs on every poll where sacct fails (a cluster without job accounting)."""

log = get_logger(__name__)


@dataclass
class Outcome:
    step: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    log: str | None = None


def choose_steps(run: RunDir, spec: str) -> list[int]:
    """`all`, `latest`, or a comma list of steps (0: the base model) -> steps, each published or 0."""
    published = run.stable_steps("weights")
    if spec == "all":
        steps = published
    elif spec == "latest":
        steps = published[-1:]
    else:
        try:
            steps = sorted({int(s) for s in spec.split(",") if s.strip()})
        except ValueError:
            raise ConfigError(f"--steps {spec!r}: expected all, latest or a comma list of steps like 0,10,20") from None
        missing = [s for s in steps if s != 0 and s not in published]
        if missing:
            shown = ", ".join(map(str, published[-10:])) or "none yet"
            raise ConfigError(f"--steps: weights step(s) {', '.join(map(str, missing))} are not published in "
                              f"{run.root / 'weights'} (published: {shown})")
    if not steps:
        raise ConfigError(f"no published weights in {run.root / 'weights'} yet; --steps 0 evaluates the base model")
    return steps


def call(task: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """What each array task runs (a module-level function: submitit pickles it by name)."""
    return task()


def run_local(tasks: Sequence[Any]) -> list[Outcome]:
    outcomes = []
    for task in tasks:
        try:
            outcomes.append(Outcome(task.step, call(task)))
        except Exception as exc:  # noqa: BLE001 - deliberate: one failed step is reported, the sweep goes on
            outcomes.append(Outcome(task.step, error=f"{type(exc).__name__}: {exc}"))
    return outcomes


ARRAY_SHAPE = frozenset({"nodes", "ntasks-per-node", "cpus-per-task", "time", "job-name", "output", "error",
                         "open-mode", "signal", "requeue", "no-requeue"})
"""`#SBATCH` options an array task sets for itself (one node, one task, its own time and logs), not copied
from the inference group's directives."""


def array_parameters(plan: Plan, parallel: int, timeout_min: int) -> dict[str, Any]:
    """submitit SlurmExecutor parameters of the eval array: the inference group's directives but its shape."""
    group = plan.groups[plan.eval_server().group]
    extra: dict[str, Any] = {}
    for directive in group.directives:
        name, eq, value = directive.removeprefix("--").partition("=")
        if name not in ARRAY_SHAPE:
            extra[name.replace("-", "_")] = value if eq else True  # submitit writes True as a bare flag
    params: dict[str, Any] = dict(job_name=f"{plan.job_name}-eval", nodes=1, ntasks_per_node=1,
                                  cpus_per_task=group.cpus_per_task, time=timeout_min, array_parallelism=parallel,
                                  setup=list(plan.setup), additional_parameters=extra)
    if plan.container is not None:
        params["srun_args"] = list(plan.container.srun_args())
    return params


def run_slurm(run: RunDir, plan: Plan, tasks: Sequence[Any], parallel: int, timeout_min: int) -> list[Outcome]:
    import submitit

    params = array_parameters(plan, parallel, timeout_min)
    executor = submitit.SlurmExecutor(folder=str(run.evals_dir / "submitit" / "%j"), python=plan.python,
                                      max_num_timeout=0)
    executor.update_parameters(**params)
    outcomes = []
    with one_sacct_warning():
        jobs = executor.map_array(call, list(tasks))
        for job, task in zip(jobs, tasks):
            try:
                outcomes.append(Outcome(task.step, job.result()))
            except Exception as exc:  # noqa: BLE001 - submitit raises its own errors with the task's traceback
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                outcomes.append(Outcome(task.step, error=f"job {job.job_id}: {first}", log=str(job.paths.stderr)))
    return outcomes


class OneSacctWarning(logging.Filter):
    """Drops submitit's "Bypassing sacct error ..., status may be inaccurate", which it logs on every poll
    (to stdout and stderr both) where sacct fails; the first becomes one line of ours."""

    def __init__(self) -> None:
        super().__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if SACCT_BYPASS not in message:
            return True
        if not self.said:
            self.said = True
            reason = message.split(SACCT_BYPASS, 1)[1].split(", status may be inaccurate", 1)[0].strip()
            log.warning("sacct failed (%s): this cluster may keep no job accounting; the eval tasks are "
                        "followed through their result files", reason)
        return False


@contextlib.contextmanager
def one_sacct_warning():
    """While the block runs, submitit's sacct warning is said once (OneSacctWarning), not on every poll."""
    submitit_log = logging.getLogger("submitit")
    quiet = OneSacctWarning()
    submitit_log.addFilter(quiet)
    try:
        yield quiet
    finally:
        submitit_log.removeFilter(quiet)


def save(run: RunDir, outcomes: list[Outcome], meta: dict[str, Any]) -> Any:
    path = run.evals_dir / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}.json"
    atomic_write_json(path, {**meta, "rows": [r for o in outcomes for r in o.rows],
                             "failed": [{"step": o.step, "error": o.error, "log": o.log} for o in outcomes if o.error]})
    return path


def show(outcomes: list[Outcome], path: Any) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    rows = [r for o in outcomes for r in o.rows]
    passes = sorted({k for r in rows for k in r if k.startswith("pass@")}, key=lambda k: int(k[5:]))
    table = Table(title="evaluation sweep")
    for name in ("step", "environment", "reward", "min..max", *passes, "rollouts", "failed", "seconds"):
        table.add_column(name, justify="left" if name == "environment" else "right")
    for r in sorted(rows, key=lambda r: (r["step"], r["env"])):
        cells = (str(r["step"]), r["env"], f"{r['reward_mean']:.4f} ± {r['reward_std']:.4f}",
                 f"{r['reward_min']:.3f}..{r['reward_max']:.3f}", *(f"{r[k]:.3f}" for k in passes),
                 str(r["rollouts"]), str(r["failed_rollouts"]), f"{r['eval_s']:.1f}")
        table.add_row(*(Text(c) for c in cells))  # Text: an environment name is never read as markup
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)  # a pipe keeps whole rows
    console.print(table)
    for o in outcomes:
        if o.error:
            console.print(f"step {o.step} failed: {o.error}" + (f" (log: {o.log})" if o.log else ""), markup=False)
    console.print(f"results: {path}", markup=False)
