"""Progress output: a rich live panel on a terminal, one plain line per step otherwise (logs)."""

from __future__ import annotations

import sys

from prl.log import get_logger

log = get_logger(__name__)


def _line(step: int, max_steps: int, m: dict) -> str:
    return (
        f"step {step}/{max_steps}  reward {m['reward_mean']:.3f}±{m['reward_std']:.3f}  "
        f"len {m['completion_len_mean']:.1f}  lag {m['policy_lag_max']}/{m['policy_lag_mean']:.1f}  "
        f"{m['rollouts_per_s']:.1f} rollouts/s  wait {m['wait_weights_s']:.1f}s  "
        f"weights v{m['weights_version']}"
        + (f"  failed {m['failed_rollouts']}" if m.get("failed_rollouts") else "")
    )


class PlainDisplay:
    def __init__(self, max_steps: int, start: int):
        self.max_steps = max_steps
        log.info(f"steps {start + 1}..{max_steps}")

    def phase(self, step: int, phase: str) -> None:
        pass

    def step(self, step: int, m: dict) -> None:
        log.info(_line(step, self.max_steps, m))

    def eval(self, step: int, m: dict) -> None:
        log.info(f"eval at step {step}: reward {m['reward_mean']:.3f}±{m['reward_std']:.3f} "
                 f"over {m['rollouts']} rollouts")

    def close(self) -> None:
        pass


class RichDisplay(PlainDisplay):
    def __init__(self, max_steps: int, start: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.max_steps = max_steps
        self.console = Console()
        self.progress = Progress(
            TextColumn("[bold]orchestrator"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[phase]}"),
            console=self.console,
        )
        self.task = self.progress.add_task("steps", total=max_steps, completed=start, phase="starting")
        self.progress.start()

    def phase(self, step: int, phase: str) -> None:
        self.progress.update(self.task, phase=f"step {step}: {phase}")

    def step(self, step: int, m: dict) -> None:
        self.progress.console.print(_line(step, self.max_steps, m))
        self.progress.update(self.task, completed=step)

    def eval(self, step: int, m: dict) -> None:
        self.progress.console.print(
            f"[cyan]eval at step {step}: reward {m['reward_mean']:.3f}±{m['reward_std']:.3f} over {m['rollouts']} rollouts"
        )

    def close(self) -> None:
        self.progress.stop()


def make_display(max_steps: int, start: int) -> PlainDisplay:
    return RichDisplay(max_steps, start) if sys.stdout.isatty() else PlainDisplay(max_steps, start)
