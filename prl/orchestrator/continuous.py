"""Continuous rollouts: groups stay in flight across step boundaries; a step takes the groups that finish first.

    group g (g = 0, 1, ... of the TaskStream, k = examples_per_step groups a step) targets step g // k + 1
    keep launching groups, up to max_off_policy_steps + 1 steps ahead of the newest published step:
        a group starts once a server serves weights >= min_version(its target) (waiting without a slot);
        `max_concurrent_rollouts` rollouts run at once; a finished group goes to the back of a FIFO
    step s: the first k groups of the FIFO with version >= min_version(s) (all of a group's rollouts);
        a failed group is dropped and counted, a stale one (too old for s) dropped and counted as
        `stale_groups`; a running group one of whose rollouts started on weights < min_version(s) is
        cancelled while s forms (reason STALE_CANCELLED, counted as `stale_cancelled`, never trained);
        either way the next task of the stream takes its place. 2k failed groups in
        a row, none usable, stop the run with the first error.

So a long rollout holds up nothing but its own group: later groups fill the step, and the servers
load new weights while rollouts run (pause mode `keep`), each rollout recording the versions it spans.
The staleness bound stays exact: every group of step s started on weights >= s - 1 - max_off_policy_steps.

Data order: which tasks a step trains on depends on which groups finish first, so it is no longer a
function of the step. Every task is still used (or dropped, counted) once: each step's batch
records the `DataOrder` after it (`data_order` in the batch file's metadata), and a resume relaunches
first the tasks the stopped attempt launched but never used, then continues the stream after them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prl.errors import PrlError, StepTimeout
from prl.orchestrator.config import OrchestratorConfig
from prl.orchestrator.rollouts import Generator, Rollout, StepBatch, TaskStream, build_samples, has_signal
from prl.run.batch import read_meta
from prl.run.rundir import RunDir

STALE_CANCELLED = "stale_cancelled"
"""The typed reason of a rollout cancelled while running because its weights fell outside the staleness bound."""


@dataclass
class DataOrder:
    """The tasks of the stream a run is done with (trained on, or dropped as failed or stale)."""

    below: int = 0
    """Every task index below this one is done."""
    done: set[int] = field(default_factory=set)
    """Done indices >= `below` (the few a long rollout skipped past)."""
    used: list[int] = field(default_factory=list)
    """The indices of the groups the step's batch trained on."""
    dropped: list[int] = field(default_factory=list)
    """The indices the step dropped (failed or stale groups)."""

    def after(self, used: list[int], dropped: list[int]) -> DataOrder:
        """This order once a step has used and dropped these indices."""
        done, below = self.done | set(used) | set(dropped), self.below
        while below in done:
            done.discard(below)
            below += 1
        return DataOrder(below, done, list(used), list(dropped))

    @property
    def next(self) -> int:
        """The first index no attempt has launched yet, as far as the record goes."""
        return max(self.done, default=self.below - 1) + 1

    def pending(self) -> list[int]:
        """Indices below `next` that are not done: launched by a stopped attempt but never used."""
        return [i for i in range(self.below, self.next) if i not in self.done]

    def to_json(self) -> str:
        return json.dumps({"below": self.below, "done": sorted(self.done), "used": self.used, "dropped": self.dropped})

    @classmethod
    def from_json(cls, text: str) -> DataOrder:
        d = json.loads(text)
        return cls(int(d["below"]), {int(i) for i in d["done"]}, [int(i) for i in d["used"]],
                   [int(i) for i in d["dropped"]])

    @classmethod
    def of_step(cls, step: int, k: int) -> DataOrder:
        """Step mode's order after `step`: steps 1..step used tasks 0 .. step*k - 1 (and seeded replacements)."""
        return cls(step * k, set(), list(range((step - 1) * k, step * k)) if step else [], [])

    @classmethod
    def read(cls, run: RunDir, step: int, k: int) -> DataOrder:
        """The order the published `rollouts/step_N` recorded (one from step mode, or from before the record
        existed: the step's own tasks)."""
        text = read_meta(run.rollouts(step)).get("data_order") if step else None
        return cls.from_json(text) if text else cls.of_step(step, k)


@dataclass
class Group:
    index: int
    """Its task's index in the TaskStream."""
    rollouts: list[Rollout]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rollouts)

    @property
    def version(self) -> int:
        """The oldest weights any of its rollouts started on."""
        return min(r.version for r in self.rollouts)


@dataclass
class Dropped:
    """The groups a step left out, each counted: failed, stale (older than the bound), resampled (no signal)."""

    failed: list[Group] = field(default_factory=list)
    stale: list[Group] = field(default_factory=list)
    resampled: list[Group] = field(default_factory=list)
    cancelled: int = 0
    """Of `stale`, the groups cancelled while running (their rollouts never finished)."""

    @property
    def all(self) -> list[Group]:
        return self.failed + self.stale + self.resampled


@dataclass
class StepRollouts:
    """One step's rollouts, as either mode made them."""

    batch: StepBatch
    ran: int
    """Rollouts the step accounts for (used, failed and stale)."""
    generate_s: float
    wait_s: float
    """Seconds the step waited for weights with no rollout running."""
    order: DataOrder
    """The data order once the step is published."""


class Scheduler:
    """Keeps groups in flight across steps and hands each step the first fresh groups to finish."""

    def __init__(self, gen: Generator, stream: TaskStream, cfg: OrchestratorConfig, order: DataOrder,
                 published: int, *, errors: list[BaseException] | None = None,
                 tick: Callable[[], None] | None = None, show: Callable[[int, str, str], None] | None = None):
        self.gen, self.stream, self.cfg = gen, stream, cfg
        self.order = order
        self.relaunch = deque(order.pending())
        self.cursor = order.next
        self.published = published
        self.errors = errors if errors is not None else []
        """Failures from outside (the weight watcher's), raised by `take`."""
        self.tick = tick or (lambda: None)
        self.show = show or (lambda step, phase, text: None)
        """The loop's phase report (heartbeat and display): generating, or waiting for weights."""
        self.running: dict[asyncio.Task, int] = {}
        """Groups in flight -> the step each was launched for."""
        self.started: dict[asyncio.Task, tuple[int, int]] = {}
        """Groups in flight that have started a rollout -> (task index, the oldest weights one started on)."""
        self.fifo: deque[Group] = deque()
        self.taken: list[Group] = []
        self.finished = asyncio.Event()

    def _queued(self) -> int:
        """Groups that hold a place in the coming steps: finished and unused, or running for a step not yet
        published. A straggler, still running when its step was published, holds none: a group is launched in
        its place, and it joins the step forming when it finishes, if still fresh enough."""
        ahead = sum(1 for target in self.running.values() if target > self.published)
        return ahead + len(self.fifo) + len(self.taken)

    def _launch(self) -> None:
        """Start groups until the steps that weights can reach soon (published + 1 + max_off_policy_steps) have
        enough: a group for a later step could only wait."""
        k = self.cfg.examples_per_step
        last = min(self.cfg.training.max_steps, self.published + 1 + self.cfg.training.max_off_policy_steps)
        while (target := self.published + 1 + self._queued() // k) <= last:
            if self.relaunch:
                index = self.relaunch.popleft()
            else:
                index, self.cursor = self.cursor, self.cursor + 1
            self.running[asyncio.create_task(self._run(index, target))] = target

    async def _run(self, index: int, target: int) -> None:
        me = asyncio.current_task()

        def started(version: int) -> None:
            self.started[me] = (index, min(version, self.started.get(me, (index, version))[1]))

        try:
            rollouts = await self.gen.group(self.stream.at(index), self.cfg.training.rollouts_per_example,
                                            self.cfg.min_version(target), started)
            self.fifo.append(Group(index, rollouts))
        except Exception as e:  # a bug in the env or in prl: stop the run with it, as step mode would
            self.errors.append(e)
        finally:
            self.running.pop(me, None)
            self.started.pop(me, None)
            self.finished.set()
        self.tick()

    def _cancel_stale(self, min_v: int, dropped: Dropped) -> None:
        """Cancel the running groups one of whose rollouts started on weights older than `min_v`: the group can
        only be stale (its version is its oldest rollout's), so it is never trained. Each becomes a stale group
        of failed rollouts whose error names the reason (STALE_CANCELLED), counted in `dropped.cancelled`."""
        n = self.cfg.training.rollouts_per_example
        for task, (index, version) in list(self.started.items()):
            if version >= min_v:
                continue
            task.cancel()
            del self.started[task]
            self.running.pop(task, None)
            reason = f"{STALE_CANCELLED}: started on weights {version}, the step needs >= {min_v}"
            group = Group(index, [Rollout(0.0, version, [], 0, error=reason) for _ in range(n)])
            dropped.stale.append(group)
            dropped.cancelled += 1

    def _sort(self, g: Group, min_v: int, dropped: Dropped) -> None:
        """Into the step's groups, or one of the dropped lists: failed, stale, or without signal while the
        step's dynamic sampling budget lasts."""
        advantage, budget = self.cfg.training.advantage, self.cfg.training.advantage.dynamic_sampling
        if not g.ok:
            dropped.failed.append(g)
        elif g.version < min_v:
            dropped.stale.append(g)
        elif len(dropped.resampled) < budget * self.cfg.examples_per_step and not has_signal(
                g.rollouts, advantage, self.cfg.training.max_tokens):
            dropped.resampled.append(g)
        else:
            self.taken.append(g)

    async def take(self, step: int) -> tuple[list[Group], Dropped, float]:
        """The first k groups to finish new enough for `step` (with signal, under dynamic sampling), the ones
        dropped on the way, and the seconds spent with no rollout running (waiting for weights)."""
        k, min_v = self.cfg.examples_per_step, self.cfg.min_version(step)
        dropped = Dropped()
        failed = dropped.failed
        idle = 0.0
        phase = "generating"
        self.show(step, phase, phase)
        while True:
            if self.errors:
                raise self.errors[0]
            self._cancel_stale(min_v, dropped)
            while self.fifo and len(self.taken) < k:
                self._sort(self.fifo.popleft(), min_v, dropped)
            if len(self.taken) == k:
                taken, self.taken = self.taken, []
                return taken, dropped, idle
            if len(failed) >= 2 * k and not self.taken:
                # A step's worth of groups and as many replacements failed, none succeeded: not transient.
                first = next(r.error for r in failed[0].rollouts if not r.ok)
                raise PrlError(f"step {step}: every rollout failed ({len(failed)} groups in a row, after retries); "
                               f"first error: {first}")
            self._launch()
            self.finished.clear()
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(self.finished.wait(), 1.0)
            except TimeoutError:
                pass
            now = "generating" if self.gen.running else "waiting_for_weights"
            if now != phase:
                phase = now
                self.show(step, phase, "generating" if self.gen.running else f"waiting for weights >= {min_v}")
            if self.gen.running == 0:
                # Nothing runs: every launched group waits for weights (the trainer's turn), not a hang.
                idle += time.monotonic() - t0
                self.tick()
                if idle > self.cfg.training.weights_timeout_s:
                    raise StepTimeout(
                        f"step {step}: waited {idle:.0f} s for weights step {min_v} or newer with no rollout to "
                        f"run; the servers serve step {self.gen.pool.version}, the newest published weights "
                        f"step is {self.gen.pool.target}. Is the trainer running? See `prl status`."
                    )

    async def make(self, step: int) -> StepRollouts:
        """Step `step`'s batch from the groups that finish first."""
        t0 = time.monotonic()
        self._launch()
        taken, dropped, idle = await self.take(step)
        training = self.cfg.training
        batch = build_samples([g.rollouts for g in taken + dropped.failed], training.advantage,
                              max_tokens=training.max_tokens, min_version=self.cfg.min_version(step),
                              resampled=[g.rollouts for g in dropped.resampled])
        batch.stale_groups, batch.stale_cancelled = len(dropped.stale), dropped.cancelled
        batch.fates += [(g.rollouts, None, "stale") for g in dropped.stale]
        order = self.order.after([g.index for g in taken], [g.index for g in dropped.all])
        ran = sum(len(g.rollouts) for g in taken + dropped.all)
        return StepRollouts(batch, ran, time.monotonic() - t0, idle, order)

    def published_step(self, step: int, order: DataOrder) -> None:
        """`step` is published with `order`: the groups of later steps may start."""
        self.published, self.order = step, order
        self._launch()

    async def close(self) -> None:
        """Cancel the groups still in flight (their tasks stay pending in the data order)."""
        for t in list(self.running):
            t.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)
