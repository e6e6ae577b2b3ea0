"""Continuous rollouts (`training.rollout_mode: continuous`): groups in flight across steps, the staleness
bound under heavy-tailed rollout lengths, weight updates landing mid-rollout, and a resume that neither
repeats nor skips a task. The scheduler's own rules are tested first without a server."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from prl.orchestrator import main
from prl.orchestrator.config import OrchestratorConfig
from prl.orchestrator.continuous import STALE_CANCELLED, DataOrder, Scheduler
from prl.orchestrator.rollouts import Generator, TaskStream
from prl.orchestrator.sync import LiveServer, ServerPool
from prl.run.batch import read_batch
from prl.run.rundir import RunDir
from tests.helpers import REPO
from testkit.plans import local_plan
from tests.test_orchestrator import FakeTrainer, engine, make_run

# -- the scheduler without a server


def test_data_order_keeps_every_task_once():
    order = DataOrder().after([0, 2], [3])
    assert (order.below, order.done, order.next, order.pending()) == (1, {2, 3}, 4, [1])
    order = order.after([1, 5], [])
    assert (order.below, order.done, order.pending()) == (4, {5}, [4])
    assert DataOrder.from_json(order.to_json()) == order
    assert DataOrder.of_step(3, 4) == DataOrder(12, set(), [8, 9, 10, 11], [])


class Tasks:
    """A fake env whose episode for task i ends when the test releases i (or at once, if never held)."""

    def __init__(self, server: LiveServer, pool: ServerPool):
        self.server, self.pool = server, pool
        self.held: dict[int, asyncio.Event] = {}
        self.fail: set[int] = set()
        self.started: list[int] = []

    def hold(self, *ids: int) -> None:
        for i in ids:
            self.held[i] = asyncio.Event()

    async def run_slot(self, slot, ctx):
        from tests.test_orchestrator_logic import fake_trace

        i = slot.task.key
        self.started.append(i)
        if i in self.held:
            await self.held[i].wait()
        if i in self.fail:
            return SimpleNamespace(ok=False, errors=[SimpleNamespace(type="ProviderError", message="503")], traces=[])
        return SimpleNamespace(ok=True, errors=[], traces=[fake_trace(float(i % 2), [1, 2, 3])])


class SignalTasks(Tasks):
    """Tasks whose rollouts all score the same (no signal), except those in `signal`, whose rollouts alternate
    rewards 0 and 1."""

    def __init__(self, server: LiveServer, pool: ServerPool, signal: set[int]):
        super().__init__(server, pool)
        self.signal, self.calls = signal, 0

    async def run_slot(self, slot, ctx):
        from tests.test_orchestrator_logic import fake_trace

        i = slot.task.key
        self.started.append(i)
        self.calls += 1
        return SimpleNamespace(ok=True, errors=[], traces=[fake_trace(float(self.calls % 2 if i in self.signal
                                                                            else 0.5), [1, 2, 3])])


def scheduler(tmp_path, k: int, max_off_policy: int, order: DataOrder | None = None, ticks: list | None = None,
              phases: list | None = None, extra: tuple[str, ...] = (), signal: set[int] | None = None):
    cfg = OrchestratorConfig.from_plan(local_plan(tmp_path / "run", tmp_path / "model", [
        f"training.batch_size={k}", "training.rollouts_per_example=1", "training.max_steps=3",
        f"training.max_off_policy_steps={max_off_policy}", "trainer.gpus_per_node=1", "trainer.dp_shard=1",
        *extra]))
    server = LiveServer("http://a", version=0)
    pool = ServerPool(generate=[server], admin=[server])
    env = Tasks(server, pool) if signal is None else SignalTasks(server, pool, signal)
    gen = Generator(env, pool, lambda s: None, max_concurrent=8, retries=0)
    stream = TaskStream([SimpleNamespace(key=i) for i in range(100)], seed=0)
    stream.at = lambda g: stream.tasks[g]  # task g is index g: the test reads indices off the episodes
    tick = (lambda: ticks.append(gen.running)) if ticks is not None else None
    show = (lambda step, phase, text: phases.append((step, phase))) if phases is not None else None
    return Scheduler(gen, stream, cfg, order or DataOrder(), 0, tick=tick, show=show), env, server


def test_a_long_group_does_not_hold_up_the_step_and_is_dropped_once_stale(tmp_path):
    """k=1 group a step, max_off_policy_steps=1: group 0 runs long; steps 1 and 2 take the groups after it
    (a group takes its place once step 1 is published without it); by step 3 (weights >= 1) it is stale:
    dropped and counted, and step 3 takes the next group."""
    sched, env, server = scheduler(tmp_path, k=1, max_off_policy=1)

    async def run():
        env.hold(0, 2, 3)
        one = await asyncio.wait_for(sched.make(1), 60)
        assert one.order.used == [1] and env.started == [0, 1]  # launched for steps 1 and 2 together
        sched.published_step(1, one.order)
        server.version = 1  # the trainer's weights 1: group 3 (for step 3, weights >= 1) may start
        env.held[2].set()
        two = await asyncio.wait_for(sched.make(2), 60)
        sched.published_step(2, two.order)
        env.held[0].set()
        await asyncio.sleep(0.2)  # group 0 finishes first
        env.held[3].set()
        three = await asyncio.wait_for(sched.make(3), 60)
        await sched.close()
        return one, two, three

    one, two, three = asyncio.run(run())
    assert two.order.used == [2] and [s.policy_version for s in two.batch.samples] == [1]
    assert three.batch.stale_groups == 1 and three.order.dropped == [0] and three.order.used == [3]
    assert [s.policy_version for s in three.batch.samples] == [1] and three.ran == 2
    assert (three.order.below, three.order.done) == (4, set())  # tasks 0..3 each used or dropped once
    assert env.started == [0, 1, 2, 3]


def test_a_running_group_is_cancelled_one_step_past_the_bound_and_kept_at_it(tmp_path):
    """max_off_policy_steps=1, k=1: group 0 (weights 0) finishes while step 2 forms (weights >= 0, exactly the
    bound behind): trained. Group 2 started on weights 0 and still runs when step 3 (weights >= 1) forms: one
    step past the bound, so it is cancelled there (typed reason, counted), never finishes and is never trained."""
    sched, env, server = scheduler(tmp_path, k=1, max_off_policy=1)

    async def run():
        env.hold(0, 2, 3)
        one = await asyncio.wait_for(sched.make(1), 60)
        sched.published_step(1, one.order)
        await asyncio.sleep(0.2)  # group 2 (for step 2, weights >= 0) starts on weights 0
        server.version = 1
        env.held[0].set()
        two = await asyncio.wait_for(sched.make(2), 60)
        sched.published_step(2, two.order)
        server.version = 2
        env.held[3].set()
        await asyncio.sleep(0.2)  # group 3 finishes; group 2 still runs
        three = await asyncio.wait_for(sched.make(3), 60)
        still = sorted(sched.running.values())
        await sched.close()
        return two, three, still

    two, three, still = asyncio.run(run())
    assert two.order.used == [0] and [s.policy_version for s in two.batch.samples] == [0]
    assert (two.batch.stale_groups, two.batch.stale_cancelled) == (0, 0)
    assert (three.batch.stale_groups, three.batch.stale_cancelled) == (1, 1)
    assert three.order.dropped == [2] and three.order.used == [3] and 2 not in still
    assert all(s.policy_version >= 1 for s in three.batch.samples)
    [(rollouts, advantages, fate)] = [f for f in three.batch.fates if f[2] == "stale"]
    assert advantages is None and [r.error.split(":")[0] for r in rollouts] == [STALE_CANCELLED]
    assert not env.held[2].is_set()


def test_the_scheduler_ticks_while_waiting_for_weights_and_replaces_a_failed_group(tmp_path):
    """Synchronous (max_off_policy_steps=0): step 2 waits for weights 1 with nothing running, ticking the
    heartbeat; a failed group is dropped and counted, and the next task replaces it."""
    ticks: list[int] = []
    phases: list[tuple[int, str]] = []
    sched, env, server = scheduler(tmp_path, k=1, max_off_policy=0, ticks=ticks, phases=phases)
    env.fail.add(1)

    async def run():
        one = await asyncio.wait_for(sched.make(1), 60)
        sched.published_step(1, one.order)
        ticks.clear()
        waiting = asyncio.create_task(sched.make(2))
        await asyncio.sleep(2.5)
        assert not waiting.done() and env.started == [0] and ticks and set(ticks) == {0}
        assert phases[-1] == (2, "waiting_for_weights")  # the heartbeat's phase says what it waits for
        server.version = 1
        two = await asyncio.wait_for(waiting, 60)
        await sched.close()
        return two

    two = asyncio.run(run())
    assert two.batch.failed_groups == 1 and two.order.dropped == [1] and two.order.used == [2]
    assert env.started == [0, 1, 2] and two.wait_s > 2


async def two_steps(sched: Scheduler, server: LiveServer) -> tuple:
    """Steps 1 and 2 (weights 1 served once step 1 is published); the scheduler closed after."""
    one = await asyncio.wait_for(sched.make(1), 60)
    sched.published_step(1, one.order)
    server.version = 1
    two = await asyncio.wait_for(sched.make(2), 60)
    await sched.close()
    return one, two


DYNAMIC = ("training.rollouts_per_example=2", "training.advantage.dynamic_sampling=1")


def test_dynamic_sampling_replaces_groups_without_signal_within_its_bound(tmp_path):
    """Continuous mode, 2 groups a step (batch 4, 2 rollouts each), dynamic_sampling 1: at most 2 groups without
    signal are replaced in a step. Step 1: tasks 0, 1 have none, 2, 3 do: 0 and 1 are dropped, 2 and 3 trained
    on. Step 2: 4, 5, 6 have none: 4 and 5 use the budget, 6 is taken as it is (with 7, which has signal)."""
    sched, env, server = scheduler(tmp_path, k=4, max_off_policy=0, extra=DYNAMIC, signal={2, 3, 7})

    one, two = asyncio.run(two_steps(sched, server))
    assert (one.order.used, one.order.dropped, one.batch.resampled_groups) == ([2, 3], [0, 1], 2)
    assert len(one.batch.samples) == 4 and one.ran == 8
    assert len(one.batch.rewards) == 8  # the replaced groups count in the reward statistics
    assert sorted(two.order.used) == [6, 7] and two.order.dropped == [4, 5] and two.batch.resampled_groups == 2
    assert two.batch.zero_groups == 1  # group 6, past the bound: trained on as it is


def test_dynamic_sampling_in_step_mode_replaces_round_after_round(tmp_path):
    """Step mode: the step's groups (tasks of the stream), then the extra tasks of attempts 2, 3, ... in place
    of the groups without signal, until the bound (2 groups) is spent."""
    from prl.orchestrator.loop import generate_step

    sched, env, server = scheduler(tmp_path, k=4, max_off_policy=0, extra=DYNAMIC, signal=set())
    stream, cfg = sched.stream, sched.cfg
    picked = iter(range(100, 200))
    stream.extra = lambda step, attempt, n: [SimpleNamespace(key=next(picked)) for _ in range(n)]
    env.signal = {1, 100}
    batch, ran, _ = asyncio.run(generate_step(sched.gen, stream, cfg, 1))
    # Round 1 replaces task 0 (no signal) by 100 (signal); task 1 has signal.
    assert batch.resampled_groups == 1 and batch.groups_used == 2 and ran == 6, batch
    env.signal, server.version = set(), 1  # step 2 takes weights >= 1
    batch, ran, _ = asyncio.run(generate_step(sched.gen, stream, cfg, 2))
    # Round 1 replaces both groups (the bound: 2), their replacements lack signal too and stay.
    assert batch.resampled_groups == 2 and batch.zero_groups == 2 and ran == 8, batch
    assert len(batch.rewards) == 8


def test_a_resumed_scheduler_relaunches_the_unused_tasks_first(tmp_path):
    """The data order says tasks 2 and 4 were launched but never used: they go first, then 6, 7, ..."""
    sched, env, server = scheduler(tmp_path, k=2, max_off_policy=0, order=DataOrder(2, {3, 5}, [3], [5]))

    one, two = asyncio.run(two_steps(sched, server))
    assert sorted(one.order.used) == [2, 4] and sorted(two.order.used) == [6, 7] and env.started[:2] == [2, 4]
    assert (two.order.below, two.order.done) == (8, set())


# -- the whole loop against the stand-in engine


def heavy_tail(engines: list, seed: int = 0, base: float = 0.05):
    """Per-request latency: 10% of requests take 10x longer, and at least until the engine (`engines[0]`) has
    loaded newer weights than at their start (at most 10 s): an update lands in the middle of each."""
    rng = random.Random(seed)

    async def long() -> None:
        eng = engines[0]
        start, t0 = eng.weights_step, time.monotonic()
        while eng.weights_step == start and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.01)
        # The orchestrator hears of the new weights meanwhile (its POST /prl/weights returns). 0.5 s was once too
        # little on CI's loaded cores: no sample of a run ended on newer weights than it started on.
        await asyncio.sleep(base * 40)

    return lambda prompt: long() if rng.random() < 0.1 else base


def published_at(run: RunDir, step: int) -> float:
    return json.loads((run.rollouts(step) / "STABLE").read_text())["time"]


def requests_of(eng, batch) -> list[dict]:
    """The engine's record of the requests that made the batch's samples (prompt + reply = the sample)."""
    by_ids = {tuple(e["prompt"] + e["reply"]): e for e in eng.log}
    ids = batch.arrays["input_ids"].tolist()
    off = batch.offsets.tolist()
    return [by_ids[tuple(ids[a:b])] for a, b in zip(off, off[1:])]


def data_orders(run: RunDir, steps) -> list[DataOrder]:
    return [DataOrder.from_json(read_batch(run.rollouts(s)).meta["data_order"]) for s in steps]


def test_rollouts_stay_in_flight_across_steps_within_the_staleness_bound(tmp_path, tokenizer_dir):
    """Heavy-tailed rollouts (10% take 10x longer), max_off_policy_steps=1, a trainer publishing weights as
    rollout steps appear: every sample within the bound, weights landing mid-rollout, and the next step's
    rollouts already running when a step is published."""
    steps = 6
    run = make_run(tmp_path, tokenizer_dir, max_steps=steps, max_off_policy_steps=1)
    engines: list = []
    eng = engine(run, delay=heavy_tail(engines))
    engines.append(eng)
    try:
        with FakeTrainer(run, delay=0.1):
            assert main(str(run.root)) == 0
    finally:
        eng.stop()
    batches = {s: read_batch(run.rollouts(s)) for s in range(1, steps + 1)}
    for s, b in batches.items():
        start, end = b.arrays["policy_version"].tolist(), b.arrays["policy_version_end"].tolist()
        assert b.num_samples == 8 and min(start) >= s - 2, (s, start)  # version >= s - 1 - k
        assert all(e >= v for v, e in zip(start, end))
        for e, v in zip(requests_of(eng, b), start):  # conservative: the engine served these weights or newer
            assert e["weights"] >= v
    assert any((b.arrays["policy_version_end"] > b.arrays["policy_version"]).any() for b in batches.values())
    assert any(min(e["start"] for e in requests_of(eng, batches[s + 1])) < published_at(run, s) for s in range(1, steps))
    used = [i for o in data_orders(run, range(1, steps + 1)) for i in o.used + o.dropped]
    assert len(used) == len(set(used))
    metrics = [m for m in run.read_metrics("orchestrator") if not m.get("eval")]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(0 <= m["stale_cancelled"] <= m["stale_groups"] and m["policy_lag_max"] <= 2 for m in metrics)
    assert sum(m["mid_rollout_updates"] for m in metrics) > 0


@pytest.mark.slow  # two orchestrator runs: 26-50 s on 2 shared cores
def test_a_resumed_continuous_run_neither_repeats_nor_skips_a_task(tmp_path, tokenizer_dir):
    """Stop the orchestrator (SIGTERM) while one group is still running, past its step; the restarted one
    relaunches that task first, and over the whole run every task is used or dropped exactly once. The bound is 2
    so the slow group (on weights 0) is still within it at step 3, running rather than cancelled as stale."""
    steps = 6
    run = make_run(tmp_path, tokenizer_dir, max_steps=steps, max_off_policy_steps=2)
    first_attempt, slow = [True], []

    def delay(prompt):  # the first task's rollouts take long in the first attempt only
        if not slow:
            slow.append(prompt)
        return 8.0 if first_attempt[0] and prompt == slow[0] else 0.02

    eng = engine(run, delay=delay)
    try:
        with FakeTrainer(run, delay=0.1):
            proc = subprocess.Popen([sys.executable, "-m", "prl.orchestrator", "--run-dir", str(run.root)], cwd=REPO,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
            deadline = time.monotonic() + 120
            while not (run.rollouts(3) / "STABLE").exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) != 0, "the first attempt must be stopped mid-run"
            stopped_at = run.latest_stable("rollouts")
            first_attempt[0] = False
            assert 3 <= stopped_at < steps
            pending = DataOrder.from_json(read_batch(run.rollouts(stopped_at)).meta["data_order"]).pending()
            assert pending, "the slow group was still running when the first attempt stopped"
            assert main(str(run.root)) == 0
    finally:
        eng.stop()
    orders = data_orders(run, range(1, steps + 1))
    every = [i for o in orders for i in o.used + o.dropped]
    assert len(every) == len(set(every)), "a task was used twice"
    later = {i for o in orders[stopped_at:] for i in o.used + o.dropped}
    assert set(pending) <= later, "a task the stopped attempt launched was never used"
    assert set(range(orders[-1].below)) <= set(every) and orders[-1].done <= set(every)
    for s in range(1, steps + 1):
        assert read_batch(run.rollouts(s)).arrays["policy_version"].min() >= s - 3
