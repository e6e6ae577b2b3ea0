"""What `prl submit --local` shows while the run goes on in the foreground: one line per trained step
(reward and policy lag of the step's rollouts, the trainer's loss and step time), a line per evaluation,
and at the end the reward's first and last steps and where to look next (`prl plot`, `prl status`).

It reads metrics.jsonl as the roles append it (only whole lines: a line still being written waits for the
next poll), so it shows what `prl status` and `prl plot` would, while the run's own logs stay in the run
directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from prl.run.handoffs import dropped_by, is_truncation
from prl.run.rundir import RunDir
from prl.states import Role

POLL_S = 1.0
REWARD_WINDOW = 4  # steps averaged at each end of the run for the summary line


@dataclass
class MetricsTail:
    """The records appended to one metrics.jsonl since the last read (whole lines only)."""

    path: Path
    offset: int = 0

    def read(self) -> list[dict[str, Any]]:
        """The new records, truncation records (a resume's `drop_metrics_after`) among them, for the
        reader to apply to what it kept of the lines before (`Progress.add` does)."""
        import json

        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        whole = data[: data.rfind(b"\n") + 1]
        self.offset += len(whole)
        records = []
        for line in whole.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line torn by a full disk: the roles' own problem, not the display's
            if isinstance(record, dict):
                records.append(record)
        return records


@dataclass
class Progress:
    """Joins the orchestrator's and the trainer's records of a step into one line."""

    max_steps: int
    say: Callable[[str], None] = print
    rewards: dict[int, float] = field(default_factory=dict)
    lags: dict[int, int] = field(default_factory=dict)
    trained: list[int] = field(default_factory=list)

    def add(self, record: dict[str, Any]) -> None:
        if is_truncation(record):
            self.forget(record)
            return
        step, role = record.get("step"), record.get("role")
        if not isinstance(step, int):
            return
        if role == Role.ORCHESTRATOR and record.get("eval"):
            self.say(f"eval at step {step}: reward {record.get('reward_mean', float('nan')):.3f}")
        elif role == Role.ORCHESTRATOR and "reward_mean" in record:
            self.rewards[step] = record["reward_mean"]
            self.lags[step] = record.get("policy_lag_max", 0)
        elif role == Role.TRAINER:
            self.trained.append(step)
            self.say(self.line(step, record))

    def forget(self, truncation: dict[str, Any]) -> None:
        """Drop what a resume dropped from metrics.jsonl (as `read_metrics` does): the steps it trains
        again are shown again, and the summary holds only the records `prl status` and `prl plot` read."""
        def kept(role: Role, step: int) -> bool:
            return not dropped_by(truncation, {"role": role, "step": step})

        self.rewards = {s: r for s, r in self.rewards.items() if kept(Role.ORCHESTRATOR, s)}
        self.lags = {s: lag for s, lag in self.lags.items() if kept(Role.ORCHESTRATOR, s)}
        self.trained = [s for s in self.trained if kept(Role.TRAINER, s)]

    def line(self, step: int, trainer: dict[str, Any]) -> str:
        parts = [f"step {step}/{self.max_steps}"]
        if step in self.rewards:
            parts.append(f"reward {self.rewards[step]:.3f}")
        if "max_policy_lag" in trainer:
            parts.append(f"lag {trainer['max_policy_lag']}")
        if "loss" in trainer:
            parts.append(f"loss {trainer['loss']:.4f}")
        if "step_s" in trainer:
            parts.append(f"{trainer['step_s']:.1f} s/step")
        return "  ".join(parts)

    def summary(self) -> str | None:
        """`reward 0.061 -> 0.247 (mean of the first and last 4 steps)`, or None without rewards."""
        steps = sorted(self.rewards)
        if not steps:
            return None
        n = min(REWARD_WINDOW, len(steps))
        first = sum(self.rewards[s] for s in steps[:n]) / n
        last = sum(self.rewards[s] for s in steps[-n:]) / n
        return f"reward {first:.3f} -> {last:.3f} (mean of the first and last {n} steps of {len(steps)})"


@dataclass
class RoleWatch:
    """Says when the launcher starts a role and when one ends (the roles start in order, each after the one
    before is healthy: vLLM's start-up is the long silence before the first step)."""

    run: RunDir
    say: Callable[[str], None] = print
    seen: dict[str, str] = field(default_factory=dict)

    def poll(self, elapsed: float) -> None:
        launcher = self.run.read_launcher()
        for role, launch in (launcher.launches if launcher else {}).items():
            state = launch.status.value if launch.status else None
            if state and self.seen.get(role) != state:
                self.seen[role] = state
                code = f" (exit code {launch.exit_code})" if launch.exit_code else ""
                error = f": {launch.error}" if launch.error else ""
                self.say(f"[{elapsed:5.0f} s] {role}: {state}{code}{error}")


def follow_local(run: RunDir, proc: subprocess.Popen, max_steps: int, say: Callable[[str], None] = print) -> int:
    """Show the run's progress until its launcher exits; its exit code. Ctrl-C stops every role cleanly
    (the launcher's grace applies); a second Ctrl-C kills them."""
    tail, progress, roles = MetricsTail(run.metrics_jsonl), Progress(max_steps, say), RoleWatch(run, say)
    start = time.monotonic()
    try:
        while True:
            try:
                code = proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                code = None
            roles.poll(time.monotonic() - start)
            for record in tail.read():
                progress.add(record)
            if code is not None:
                break
    except KeyboardInterrupt:
        code = _interrupt(proc)
    summary = progress.summary()
    if summary:
        say(summary)
    return code


def _interrupt(proc: subprocess.Popen) -> int:
    print("stopping (Ctrl-C again to kill)...", file=sys.stderr)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()
