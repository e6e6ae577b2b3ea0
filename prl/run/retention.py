"""What old steps go, and what stays because someone still needs it (`Retention.cleanup`, pins and holds).

The trainer's rank 0 cleans up after each step: weights the staleness bound no longer needs (unless a server
serves one or may roll back to it: the orchestrator's pin; or a restarted server reads it as its `--model`: a
hold), checkpoints past `checkpoint_keep`, rollouts that no resume replays.
"""

from __future__ import annotations

import time
from pathlib import Path

from prl.errors import RunDirError
from prl.run import records
from prl.run.files import atomic_write_json
from prl.run.publish import Publishing
from prl.run.records import StepPin


class Retention(Publishing):
    """Cleanup of a run's steps, and the pins and holds it respects."""

    def cleanup(self, step: int, *, max_off_policy_steps: int, checkpoint_keep: int) -> list[Path]:
        """Drop what neither the staleness bound nor the checkpoint policy needs; return what went.

        After trainer step `step`:
        - weights: keep the newest `max_off_policy_steps + 1` steps (inference
          servers and in-flight rollouts may still use any of them), and every
          step from the oldest one a server serves or may roll back to
          (`weight_pins`, kept by the orchestrator), and each step a live server
          was started from (`weight_holds`: vLLM reads its `--model` directory
          for as long as it runs);
        - checkpoints: keep the newest `checkpoint_keep` trainer checkpoints
          (0 keeps all); older step dirs go whole, every role's part;
        - rollouts: keep those after the newest kept checkpoint (a resume
          replays them; with no checkpoint at all, every one is kept), never
          the ones not yet consumed (> `step`), and always the newest one
          (where a requeued orchestrator resumes).
        Unfinished (unmarked) dirs older than what is kept go as well.
        """
        removed: list[Path] = []

        def drop(kind: str, keep_from: int) -> None:
            for s in self.steps(kind):
                if s < keep_from:
                    self.remove_step(kind, s)
                    removed.append(self.step_dir(kind, s))

        pinned = [v for v in self.weight_pins().values() if v > 0]
        held = set(self.weight_holds().values())
        for s in self.steps("weights"):
            if s < min([step - max_off_policy_steps, *pinned]) and s not in held:
                self.remove_step("weights", s)
                removed.append(self.step_dir("weights", s))
        ckpts = self.stable_steps("checkpoints")
        if checkpoint_keep > 0 and len(ckpts) > checkpoint_keep:
            drop("checkpoints", ckpts[-checkpoint_keep])
            ckpts = ckpts[-checkpoint_keep:]
        replay_from = (ckpts[-1] if ckpts else 0) + 1
        # The newest published rollouts step always stays: a requeued orchestrator resumes after it (and reads
        # its data order); with it gone, it would start again from step 1 and drop its metrics records.
        newest = self.latest_stable("rollouts")
        drop("rollouts", min(replay_from, step + 1, newest if newest is not None else step + 1))
        return removed

    def pin_weights(self, owner: str, step: int) -> None:
        """Record that weights step `step` (and later) must stay on disk for `owner` (0: none needed)."""
        path = self.pins_dir / f"{owner}.json"
        if self._steps_in(self.pins_dir).get(owner) != step:
            atomic_write_json(path, StepPin(step=step, time=time.time()))

    def weight_pins(self) -> dict[str, int]:
        """owner -> the oldest weights step it still needs."""
        return self._steps_in(self.pins_dir)

    def hold_weights(self, owner: str, step: int) -> None:
        """Keep weights step `step` itself (not the ones after it) on disk while `owner` lives: a server
        started with `--model RUN/weights/step_N` reads that directory as long as it runs."""
        atomic_write_json(self.holds_dir / f"{owner}.json", StepPin(step=step, time=time.time()))

    def release_weights(self, owner: str) -> None:
        (self.holds_dir / f"{owner}.json").unlink(missing_ok=True)

    def weight_holds(self) -> dict[str, int]:
        """owner -> the one weights step it holds."""
        return self._steps_in(self.holds_dir)

    @staticmethod
    def _steps_in(folder: Path) -> dict[str, int]:
        steps = {}
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                pin = records.read(path, StepPin)
            except (OSError, RunDirError):
                continue  # not a pin this prl reads (another version, a hand edit): the next cleanup looks again
            if pin is not None:
                steps[path.stem] = pin.step
        return steps
