"""`prl wandb RUN [--project P] [--entity E] [--follow]`: a run's metrics as one W&B run.

The roles write metrics.jsonl only; this reads it, joins trainer, orchestrator, eval and
inference records by step (prl.ops.metrics) and logs one W&B row per step. Run it from a
login node (compute nodes often have no internet), once after the run or with `--follow`
while it runs; `WANDB_MODE=offline` writes W&B's files under RUN/wandb for `wandb sync`.

One W&B run per prl run: its id is kept in state/wandb.json with the last step logged, so a
second `prl wandb` (or one after a requeue) continues the same W&B run with the new steps
only (W&B refuses steps that go backwards). A step is logged once it is complete: a later
step has records, or the job has ended. The run's settings (model, environment, training)
become the W&B config. wandb (the `wandb` extra) is imported by this command only.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Callable

from prl.errors import needs_extra
from prl.ops.metrics import step_rows
from prl.run.records import WandbCursor
from prl.run.rundir import RunDir
from prl.states import LauncherStatus

FOLLOW_SECONDS = 10.0


def pending_rows(run: RunDir, after: int, ended: bool) -> dict[int, dict[str, float]]:
    """Rows of the steps after `after` that are complete (all of them once the job ended)."""
    rows = {s: r for s, r in step_rows(run.read_metrics()).items() if s > after}
    if not ended and rows:
        rows.pop(max(rows))  # the newest step may still get records from a slower role
    return rows


ROLLOUT_COLUMNS = ["group", "index", "env", "fate", "reward", "advantage", "completion_tokens", "turns", "lag",
                   "truncated", "error", "conversation"]


def rollout_table(wandb, sample) -> Any:
    """A step's sampled rollouts (samples/step_N.json) as a W&B table: one row each, the conversation as text."""
    def text(r) -> str:
        return "\n\n".join(f"[{t.role}] {t.text}" + "".join(f"\n-> {c.name}({c.arguments})" for c in t.tool_calls)
                           for t in r.conversation)

    return wandb.Table(columns=ROLLOUT_COLUMNS, data=[
        [r.group, r.index, r.env, r.fate, r.reward, r.advantage, r.completion_tokens, r.turns, r.lag, r.truncated,
         r.error or "", text(r)] for r in sample.records])


def cursor(run: RunDir) -> WandbCursor:
    """The W&B run id and the last step logged; a new id on the first sync."""
    return run.read_wandb_cursor() or WandbCursor(id=f"prl-{secrets.token_hex(6)}")


def job_ended(run: RunDir) -> bool:
    from prl.ops.status import collect
    from prl.states import TERMINAL_STATES

    return collect(run).state in TERMINAL_STATES


def attempt_ended(run: RunDir, attempt: int) -> bool:
    """Attempt `attempt` of the job has ended (its launcher recorded an end, or a later attempt started): the
    launcher's follower then logs the last steps and exits; the next attempt's follower takes over."""
    record = run.read_launcher()
    if record is None or record.attempt != attempt:
        return True
    return record.status not in (None, LauncherStatus.STARTING, LauncherStatus.RUNNING, LauncherStatus.STOPPING)


def sync(run: RunDir, project: str, entity: str | None = None, follow: bool = False,
         ended: Callable[[RunDir], bool] = job_ended, poll: float = FOLLOW_SECONDS) -> int:
    """Log the run's new complete steps to its W&B run; with `follow`, until the job ends. Returns rows logged."""
    wandb = needs_extra("wandb", "wandb", "prl wandb")
    import msgspec

    from prl.planner.model import Plan

    plan = Plan.read(run)
    state = cursor(run)
    run.wandb_dir.mkdir(parents=True, exist_ok=True)
    wb = wandb.init(project=project, entity=entity, id=state.id, resume="allow", name=plan.name,
                    dir=str(run.root), config=msgspec.to_builtins(plan.settings()),
                    settings=wandb.Settings(console="off"))
    logged = 0
    try:
        while True:
            done = ended(run)
            for step, row in pending_rows(run, state.step, done).items():
                sample = run.read_rollout_sample(step)
                wb.log({**row, "rollouts": rollout_table(wandb, sample)} if sample and sample.records else row,
                       step=step)
                state.step = step
                logged += 1
            run.write_wandb_cursor(state)
            if done or not follow:
                return logged
            time.sleep(poll)
    finally:
        wb.finish()
