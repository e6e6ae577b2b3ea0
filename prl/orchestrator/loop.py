"""`prl orchestrator`: environment rollouts in, training batches out, weights pushed to the servers.

    for step in start+1 .. max_steps:
        the step's batch_size / rollouts_per_example groups of rollouts_per_example rollouts, all started on
            weights >= step - 1 - max_off_policy_steps (`training.rollout_mode`):
            continuous (default): the first groups to finish of those kept in flight across steps
                (prl/orchestrator/continuous.py); stale and failed groups dropped and counted
            step: wait until every server serves those weights, then run the step's groups alone
        group-relative advantages; the scoring servers' logprobs of the sampled tokens (teacher:, reference:,
            prl/orchestrator/scoring.py); pack, publish rollouts/step_N (STABLE) with its data order
        metrics to metrics.jsonl, heartbeat; eval on the eval split every `eval.every` steps
    meanwhile, the weight watcher loads every newly published weights/step_K on every server,
    while rollouts run

Resume: the run continues after the newest STABLE rollouts step (never
repeating or skipping one). In step mode the data order is a function of the
step; in continuous mode it depends on which groups finish first, and the
newest batch's data order says which tasks are done, so a resumed run uses
every task once. Settings: prl/orchestrator/config.py.

Assembly: `assemble` builds every component once and whole (the served model name is asked first, so
the server pool and the model contexts are complete when built): environments, generators, the task
stream, the weight watcher, the display and the step source (`Scheduler` or `StepMode`). `orchestrate`
is then the loop above, step by step: make rollouts, check, publish, record, maybe evaluate.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from prl import weights
from prl.errors import PrlError
from prl.log import get_logger, init_logging
from prl.orchestrator.advantages import reward_stats
from prl.orchestrator.clients import renderer_config, train_contexts
from prl.orchestrator.config import OrchestratorConfig
from prl.orchestrator.continuous import DataOrder, Scheduler, StepRollouts
from prl.orchestrator.display import PlainDisplay, make_display
from prl.orchestrator.env import load_env
from prl.orchestrator.eval import evaluate
from prl.orchestrator.rollouts import Generator, StepBatch, TaskStream, build_samples, has_signal, then
from prl.orchestrator.scoring import Scorers, ScoreStats
from prl.orchestrator.shaping import shaper
from prl.orchestrator.sync import (Fleet, ServerPool, WeightWatcher, discover, generation_client, hold_keys,
                                   read_endpoints, served_model, server_client, standalone)
from prl.orchestrator.transcripts import step_sample
from prl.orchestrator.workers import EnvWorkers, check_env_id
from prl.planner.model import START_TIMEOUT_S, Plan
from prl.run.batch import publish_batch, read_meta
from prl.run.lifecycle import role_lifecycle
from prl.run.rundir import HEARTBEAT_S, RunDir
from prl.states import Role

ROLE = Role.ORCHESTRATOR

log = get_logger(__name__)


class Beat:
    """The role's heartbeat, from the main loop only (the launcher's hang detection reads it): at once on a
    phase change, and `tick()` (at most every `every` s) as rollout groups finish and while waiting for weights.
    A side task would keep beating for a loop that is stuck."""

    def __init__(self, run: RunDir, every: float = HEARTBEAT_S):
        self.run = run
        self.every = every
        self.fields: dict[str, Any] = {}
        self.last = 0.0

    def __call__(self, **fields: Any) -> None:
        self.fields.update(fields)
        self.run.heartbeat(ROLE, **self.fields)
        self.last = time.monotonic()

    def tick(self) -> None:
        if time.monotonic() - self.last >= self.every:
            self()


def show_phase(beat: Beat, display: PlainDisplay, step: int, phase: str, text: str) -> None:
    """A phase of `step` (waiting_for_weights, generating, evaluating): to the heartbeat and the display."""
    beat(step=step, phase=phase)
    display.phase(step, text)


async def generate_step(
    gen: Generator, stream: TaskStream, cfg: OrchestratorConfig, step: int, beat: Beat | None = None
) -> tuple[StepBatch, int, float]:
    """All groups of one step (failed groups replaced once); the batch, rollouts run, seconds taken."""
    t0 = time.monotonic()
    min_v = cfg.min_version(step)
    k, n = cfg.examples_per_step, cfg.training.rollouts_per_example
    tick = beat.tick if beat else None
    groups = list(await asyncio.gather(*(then(gen.group(t, n, min_v), tick) for t in stream.tasks_for(step, k))))
    ran = k * n
    failed = sum(1 for g in groups if any(not r.ok for r in g))
    if 0 < failed < len(groups):
        # A few groups lost to errors: replace them once with fresh tasks so the batch keeps its size.
        groups += await asyncio.gather(*(gen.group(t, n, min_v) for t in stream.extra(step, 1, failed)))
        ran += failed * n
    resampled = await resample_zero_groups(gen, stream, cfg, step, groups)
    ran += len(resampled) * n
    # build_samples leaves failed groups out (and counts them).
    batch = build_samples(groups, cfg.training.advantage, max_tokens=cfg.training.max_tokens, min_version=min_v,
                          resampled=resampled)
    return batch, ran, time.monotonic() - t0


async def resample_zero_groups(gen: Generator, stream: TaskStream, cfg: OrchestratorConfig, step: int,
                               groups: list) -> list:
    """Dynamic sampling (`advantage.dynamic_sampling`): replace the groups without signal in `groups` by fresh
    tasks' groups, round after round, until every group has signal or the step's budget of replacements
    (dynamic_sampling x its groups) is spent; the replaced groups."""
    training = cfg.training
    budget = training.advantage.dynamic_sampling * cfg.examples_per_step
    replaced: list = []
    attempt = 2  # attempt 1 of the step's extra tasks replaces failed groups
    while budget > 0:
        zero = [g for g in groups if not has_signal(g, training.advantage, training.max_tokens)][:budget]
        if not zero:
            break
        gone = {id(g) for g in zero}
        groups[:] = [g for g in groups if id(g) not in gone]
        replaced += zero
        budget -= len(zero)
        groups += await asyncio.gather(*(gen.group(t, training.rollouts_per_example, cfg.min_version(step))
                                         for t in stream.extra(step, attempt, len(zero))))
        attempt += 1
    return replaced


class StepMode:
    """`rollout_mode: step`: each step waits until every server serves its weights, then runs its groups alone."""

    def __init__(self, gen: Generator, stream: TaskStream, cfg: OrchestratorConfig, pool: ServerPool,
                 errors: list[BaseException], beat: Beat, show: Callable[[int, str, str], None]):
        self.gen, self.stream, self.cfg, self.pool, self.errors, self.beat, self.show = (
            gen, stream, cfg, pool, errors, beat, show)

    async def make(self, step: int) -> StepRollouts:
        min_v = self.cfg.min_version(step)
        self.show(step, "waiting_for_weights", f"waiting for weights >= {min_v}")
        timeout = self.cfg.training.weights_timeout_s
        wait_s = await self.pool.wait_version(min_v, timeout, self.errors, on_wait=self.beat)
        self.show(step, "generating", "generating")
        batch, ran, gen_s = await generate_step(self.gen, self.stream, self.cfg, step, self.beat)
        return StepRollouts(batch, ran, gen_s, wait_s, DataOrder.of_step(step, self.cfg.examples_per_step))

    def published_step(self, step: int, order: DataOrder) -> None:
        pass

    async def close(self) -> None:
        pass


def score_metrics(scored: ScoreStats | None, generate_s: float, tokens: int) -> dict[str, float]:
    """Per scoring role: seconds, tokens scored per second, and that rate over the step's generation rate
    (all of a sample's tokens over `generate_s`): above 1 the scorers keep up with the student."""
    if scored is None:
        return {}
    gen_rate = tokens / max(generate_s, 1e-9)
    out: dict[str, float] = {}
    for role, seconds in scored.seconds.items():
        rate = scored.tokens[role] / max(seconds, 1e-9)
        out |= {f"{role}_score_s": seconds, f"{role}_tokens_per_s": rate, f"{role}_vs_generate": rate / gen_rate}
    return out


def step_metrics(step: int, made: StepRollouts, pool: ServerPool, scored: ScoreStats | None = None) -> dict:
    batch, ran, gen_s = made.batch, made.ran, made.generate_s
    rewards = reward_stats(batch.rewards)
    lags = [step - v for v in batch.versions]
    m: dict[str, Any] = {
        "role": ROLE,
        "step": step,
        "time": time.time(),
        "reward_mean": rewards["mean"],
        "reward_std": rewards["std"],
        "reward_min": rewards["min"],
        "reward_max": rewards["max"],
        "completion_len_mean": sum(batch.lengths) / max(1, len(batch.lengths)),
        "completion_len_max": max(batch.lengths, default=0),
        "truncated_fraction": batch.truncated / max(1, len(batch.lengths)),
        "turns_mean": sum(batch.turns) / max(1, len(batch.turns)),
        "policy_lag_max": max(lags, default=0),
        "policy_lag_mean": sum(lags) / max(1, len(lags)),
        "rollouts": ran,
        "samples": len(batch.samples),
        "groups": batch.groups_used,
        "zero_adv_groups": batch.zero_groups,
        "dropped_groups": batch.dropped_zero_groups,
        "failed_rollouts": batch.failed_rollouts,
        "stale_groups": batch.stale_groups,
        "stale_cancelled": batch.stale_cancelled,
        "resampled_groups": batch.resampled_groups,
        "mid_rollout_updates": batch.mid_rollout_updates,
        "rollouts_per_s": ran / max(gen_s, 1e-9),
        "generate_s": gen_s,
        "wait_weights_s": made.wait_s,
        "weights_version": pool.version,
        "servers_failing": sum(1 for s in pool.admin if s.error),
    }
    m |= score_metrics(scored, gen_s, sum(len(s.token_ids) for s in batch.samples))
    for name, vals in sorted(batch.metrics.items()):
        m[f"metric/{name}"] = sum(vals) / len(vals)
    return m


@dataclass(frozen=True)
class Orchestrator:
    """Every component of one orchestrator run, built once by `assemble`; the step loop (`orchestrate`) calls
    its steps in the order of the algorithm."""

    run: RunDir
    cfg: OrchestratorConfig
    pool: ServerPool
    env: Any
    """The train split's environment (in worker processes with `orchestrator.env_workers`)."""
    eval_env: Any | None
    eval_gen: Generator | None
    """The eval split and its generator (None: `environment.eval.every` is 0)."""
    watcher: WeightWatcher
    source: StepMode | Scheduler
    """Where each step's rollouts come from (`training.rollout_mode`)."""
    beat: Beat
    display: PlainDisplay
    scorers: Scorers | None = None
    """The teacher / reference servers that score every sample (None: the run has none)."""

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The env servers up, every server's weights version asked, the weight watcher in the background; on the
        way out the env servers closed, the rollouts in flight and the watcher cancelled, the display closed."""
        background: list[asyncio.Task] = []
        try:
            async with contextlib.AsyncExitStack() as stack:
                await stack.enter_async_context(self.env.serving())
                if self.eval_env is not None:
                    await stack.enter_async_context(self.eval_env.serving())
                async with server_client() as client:
                    await self.watcher.sync_live(client)
                background.append(asyncio.create_task(self.watcher.run_forever()))
                yield
        finally:
            await self.source.close()
            for t in background:
                t.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            self.display.close()

    def check(self, step: int, batch: StepBatch) -> None:
        """Stop the run on the weight watcher's failure, or when every rollout of the step failed."""
        if self.watcher.error:
            raise self.watcher.error[0]
        if not batch.samples:
            raise PrlError(f"step {step}: every rollout failed ({batch.failed_rollouts} after retries); "
                           f"first error: {batch.first_error}")

    async def score(self, step: int, made: StepRollouts) -> ScoreStats | None:
        """The scoring servers' logprobs on every sample of the step (before it is published)."""
        if self.scorers is None:
            return None
        show_phase(self.beat, self.display, step, "scoring", f"scoring by {', '.join(self.scorers.roles)}")
        return await self.scorers.score(made.batch.samples)

    async def publish(self, step: int, made: StepRollouts, record: dict) -> None:
        """rollouts/step_N (STABLE) packed for the trainer's dp ranks, with the data order after it and the
        step's metrics record (`recover_record` appends it on resume if metrics.jsonl never got it)."""
        await asyncio.to_thread(publish_batch, self.run, step, made.batch.samples, dp_size=self.cfg.dp_size,
                                micro_batch_tokens=self.cfg.training.micro_batch_tokens,
                                meta={"data_order": made.order.to_json(), RECORD_KEY: json.dumps(record)})
        self.source.published_step(step, made.order)
        if self.cfg.environment.sample_rollouts:
            sample = step_sample(step, made.batch.fates, self.cfg.environment.id,
                                 limit=self.cfg.environment.sample_rollouts, rollouts=made.ran)
            try:
                await asyncio.to_thread(self.run.write_rollout_sample, sample)
            except OSError as e:  # what a person reads later, not a hand-off: the step stands without it
                log.warning("step %d: its rollout sample was not written (%s)", step, e)

    def record(self, step: int, made: StepRollouts, m: dict) -> None:
        """The step's metrics record (`step_metrics`), heartbeat and progress line."""
        self.run.append_metrics(m)
        # step_s: this step's longest stretch between heartbeats, at most; the launcher's hang bound grows with it.
        self.beat(step=step, phase="published", published=step, weights_version=self.pool.version,
                  step_s=round(made.generate_s, 3))
        self.display.step(step, m)

    def eval_due(self, step: int) -> bool:
        return self.eval_gen is not None and step % self.cfg.environment.eval.every == 0

    async def evaluate(self, step: int) -> None:
        """`environment.eval.examples` tasks of the eval split, one rollout each, to metrics (`"eval": true`)."""
        assert self.eval_gen is not None
        show_phase(self.beat, self.display, step, "evaluating", "evaluating")
        ev = await evaluate(self.eval_gen, self.cfg.environment.eval.examples, on_group=self.beat.tick)
        self.run.append_metrics({"role": ROLE, "step": step, "time": time.time(), "eval": True, **ev})
        self.display.eval(step, ev)


def load_environments(cfg: OrchestratorConfig) -> tuple[Any, Any | None]:
    """The train split's environment (served by worker processes with `orchestrator.env_workers`), and the eval
    split's when evals are on (in this process). It needs no server, so it runs while the servers start (the
    launcher starts the orchestrator with them): a bad `model.renderer` stops the run before the environment
    loads, and a shaping function that does not load stops it here, not at step 1."""
    renderer_config(cfg.renderer)
    e = cfg.environment
    limits = {"max_turns": e.max_turns, "max_total_tokens": e.max_total_tokens}
    env = load_env(e.id, e.harness, dict(e.args), split="train", **limits)
    eval_env = load_env(e.id, e.harness, dict(e.args), split="eval", **limits) if e.eval.every else None
    if cfg.env_workers:
        check_env_id(e.id)
        env = EnvWorkers(env, cfg.env_workers)
    shaper(cfg.training.advantage.shaping)
    return env, eval_env


async def assemble(run: RunDir, cfg: OrchestratorConfig, fleet: Fleet, beat: Beat, start: int,
                   envs: tuple[Any, Any | None]) -> Orchestrator:
    """Build every component once, each complete before it is handed on: the served model name first (an async
    question to a server), so the contexts and the pool are whole when built."""
    model = cfg.served_model_name or await served_model(fleet)
    pool = ServerPool.of(fleet, on_idle=beat.tick)
    make_ctx = train_contexts(cfg, model)
    env, eval_env = envs
    t = cfg.training

    def generator(e: Any) -> Generator:
        return Generator(e, pool, make_ctx, max_concurrent=t.max_concurrent_rollouts, retries=t.rollout_retries)

    gen = generator(env)
    stream = TaskStream(env.taskset, t.seed)
    watcher = WeightWatcher(run, pool, weights.get(cfg.weights.transport), retries=t.weight_update_retries)
    display = make_display(t.max_steps, start)
    show = functools.partial(show_phase, beat, display)
    source: StepMode | Scheduler = (
        Scheduler(gen, stream, cfg, DataOrder.read(run, start, cfg.examples_per_step), start, errors=watcher.error,
                  tick=beat.tick, show=show)
        if t.rollout_mode == "continuous" else StepMode(gen, stream, cfg, pool, watcher.error, beat, show))
    return Orchestrator(run, cfg, pool, env, eval_env, generator(eval_env) if eval_env is not None else None, watcher,
                        source, beat, display, scorers(run, cfg, fleet))


def scorers(run: RunDir, cfg: OrchestratorConfig, fleet: Fleet) -> Scorers | None:
    """The scoring roles' clients: their servers as the run's endpoint files list them at each step (a restarted
    server publishes its new address), or as given to a standalone orchestrator."""
    if not cfg.scorers:
        return None
    t = cfg.training

    def urls(role: str) -> list[str]:
        return read_endpoints(run).get(role, []) if fleet.follow_endpoints else fleet.scorers.get(role, [])

    return Scorers(cfg.scorers, urls, generation_client, max_concurrent=t.max_concurrent_rollouts,
                   retries=t.rollout_retries)


RECORD_KEY = "metrics"
"""The published batch's metadata key that holds the step's metrics record (JSON)."""


def recover_record(run: RunDir, step: int) -> bool:
    """Append the metrics record of published rollouts step `step` if metrics.jsonl lacks it: the step was
    published and its record then lost (a full disk tore the line, or the orchestrator died between the two);
    a resumed run starts after that step and would never write it. Returns whether it appended."""
    if step < 1 or any(r.get("step") == step and not r.get("eval") and r.get("event") is None
                       for r in run.read_metrics(ROLE)):
        return False
    text = read_meta(run.rollouts(step)).get(RECORD_KEY)
    if text is None:  # published before records rode along
        return False
    run.append_metrics(json.loads(text))
    log.info("rollouts step %d was published but its metrics record was lost; appended it from the batch", step)
    return True


async def orchestrate(run: RunDir, cfg: OrchestratorConfig, find_fleet: Callable[[], Fleet], beat: Beat) -> int:
    """The orchestrator's steps after the newest published one, to `training.max_steps`. What needs no server is
    loaded first (`load_environments`); `find_fleet` then waits for the servers (`discover`), which start with
    this process."""
    start = run.latest_published("rollouts") or 0  # an unreadable newest step raises: nothing is redone over it
    run.drop_metrics_after(ROLE, start)
    recover_record(run, start)
    max_steps = cfg.training.max_steps
    if start >= max_steps:
        log.info("rollouts up to step %d are published; nothing to do (max_steps %d)", start, max_steps)
        return 0
    envs = load_environments(cfg)
    # In this thread, blocking the loop: nothing runs on it yet, and SIGTERM's KeyboardInterrupt (`main`) must
    # reach the wait (a worker thread would keep the process alive until its wait ended).
    fleet = find_fleet()
    o = await assemble(run, cfg, fleet, beat, start, envs)
    async with o.running():
        for step in range(start + 1, max_steps + 1):
            made = await o.source.make(step)
            o.check(step, made.batch)
            record = step_metrics(step, made, o.pool, await o.score(step, made))
            await o.publish(step, made, record)
            o.record(step, made, record)
            if o.eval_due(step):
                await o.evaluate(step)
    return 0


def main(run_dir: str, servers: list[str] | None = None) -> int:
    """Run the orchestrator of RUN to max_steps; return 0. Raises PrlError on a clear failure.

    `servers`: explicit inference URLs (standalone use); otherwise they come from
    RUN/state/endpoints. Records start, heartbeats and exit in RUN/state/orchestrator.json.
    """
    run = RunDir(run_dir)
    plan = Plan.read(run)
    cfg = OrchestratorConfig.from_plan(plan)
    init_logging(ROLE)
    run.create()
    hold_keys(run)  # before anything starts a process: environments get the generation-only key alone
    beat = Beat(run)

    def on_term(signum, frame):  # the role runner passes SIGTERM on: unwind through the lifecycle below
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        with role_lifecycle(run, ROLE) as outcome:
            # The launcher starts the orchestrator with the servers (its imports and `load_environments`
            # overlap their start-up): wait at least as long as the launcher lets a server take to start.
            timeout = max(cfg.training.endpoint_timeout_s, START_TIMEOUT_S)
            find = (lambda: standalone(servers)) if servers else (lambda: discover(run, plan, timeout))
            outcome.code = asyncio.run(orchestrate(run, cfg, find, beat))
        return outcome.code
    finally:
        signal.signal(signal.SIGTERM, old)
