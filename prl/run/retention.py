"""What old steps go, and what stays because someone still needs it (`Retention.cleanup`, pins and holds).

The trainer's rank 0 cleans up after each step: weights the staleness bound no longer needs (unless a server
serves one or may roll back to it: the orchestrator's pin; or a restarted server reads it as its `--model`: a
hold), checkpoints past `checkpoint_keep`, rollouts that no resume replays.

Pins and holds are leases: the process that wrote one renews it every RENEW_S (`LEASES`, a thread) while it
lives, and cleanup counts one only until LEASE_S after its last renewal, so those of an owner that was
SIGKILLed (or whose node went down) stop keeping steps. A lease rather than an owner's pid judged alive:
cleanup runs on the trainer's rank 0, the owners on inference nodes, the orchestrator's node and evaluation
nodes, where a pid means nothing to rank 0; a lease needs only the shared run directory and clocks that
agree to well within LEASE_S.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from prl.errors import RunDirError
from prl.log import get_logger
from prl.run import records
from prl.run.files import atomic_write_json
from prl.run.publish import Publishing
from prl.run.records import StepPin

log = get_logger(__name__)

LEASE_S = 600.0
"""How long a pin or hold keeps its steps after its owner last renewed it."""
RENEW_S = 60.0
"""How often a living owner renews its pins and holds (LEASE_S / 10: ten renewals may fail or be late)."""


class Leases:
    """The pins and holds this process owns (path -> step), rewritten with the time every RENEW_S by one daemon
    thread while the process lives. A forked child owns none of its parent's."""

    def __init__(self):
        self._forget()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self.lock = threading.Lock()
        self.owned: dict[Path, int] = {}
        self.thread: threading.Thread | None = None

    def keep(self, path: Path, step: int, *, write: bool = True) -> None:
        """Own the record at `path` for `step` (written now unless `write` is False: it says so already)."""
        with self.lock:
            if write:
                atomic_write_json(path, StepPin(step=step, time=time.time()))
            self.owned[path] = step
            if self.thread is None:
                self.thread = threading.Thread(target=self._renew, name="prl-leases", daemon=True)
                self.thread.start()

    def drop(self, path: Path) -> None:
        with self.lock:  # never after a renewal that would write it back
            self.owned.pop(path, None)
            path.unlink(missing_ok=True)

    def _renew(self) -> None:
        while True:
            time.sleep(RENEW_S)
            with self.lock:
                for path, step in list(self.owned.items()):
                    if not path.exists():  # removed by another (the run directory with it): owned no more
                        del self.owned[path]
                        continue
                    try:
                        atomic_write_json(path, StepPin(step=step, time=time.time()))
                    except OSError as e:  # the next round tries again; LEASE_S leaves room for several
                        log.warning("could not renew %s: %s", path, e)


LEASES = Leases()


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
        """Record that weights step `step` (and later) must stay on disk for `owner` (0: none needed), while
        this process lives (LEASES renews it)."""
        LEASES.keep(self.pins_dir / f"{owner}.json", step, write=self._steps_in(self.pins_dir).get(owner) != step)

    def weight_pins(self) -> dict[str, int]:
        """owner -> the oldest weights step it still needs (owners whose lease ran out left out)."""
        return self._steps_in(self.pins_dir)

    def hold_weights(self, owner: str, step: int) -> None:
        """Keep weights step `step` itself (not the ones after it) on disk while `owner` lives: a server
        started with `--model RUN/weights/step_N` reads that directory as long as it runs (LEASES renews the
        hold while this process lives)."""
        LEASES.keep(self.holds_dir / f"{owner}.json", step)

    def release_weights(self, owner: str) -> None:
        LEASES.drop(self.holds_dir / f"{owner}.json")

    def weight_holds(self) -> dict[str, int]:
        """owner -> the one weights step it holds (owners whose lease ran out left out)."""
        return self._steps_in(self.holds_dir)

    @staticmethod
    def _steps_in(folder: Path) -> dict[str, int]:
        steps, now = {}, time.time()
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                pin = records.read(path, StepPin)
            except (OSError, RunDirError):
                continue  # not a pin this prl reads (another version, a hand edit): the next cleanup looks again
            if pin is not None and now - pin.time <= LEASE_S:  # else its owner died LEASE_S or more ago
                steps[path.stem] = pin.step
        return steps
