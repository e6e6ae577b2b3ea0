"""`prl orchestrator`: environment rollouts in, training batches out, weights pushed to the servers.

    for step in start+1 .. max_steps:
        the step's batch_size / rollouts_per_example groups of rollouts_per_example rollouts, all started on
            weights >= step - 1 - max_off_policy_steps (`training.rollout_mode`):
            continuous (default): the first groups to finish of those kept in flight across steps
                (prl/orchestrator/continuous.py); stale and failed groups dropped and counted
            step: wait until every server serves those weights, then run the step's groups alone
        group-relative advantages, pack, publish rollouts/step_N (STABLE) with its data order
        metrics to metrics.jsonl, heartbeat; eval on the eval split every `eval.every` steps
    meanwhile, the weight watcher loads every newly published weights/step_K on every server,
    while rollouts run

Resume: the run continues after the newest STABLE rollouts step (never
repeating or skipping one). In step mode the data order is a function of the
step; in continuous mode it depends on which groups finish first, and the
newest batch's data order says which tasks are done, so a resumed run uses
every task once. Settings: prl/orchestrator/config.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from typing import Any

from prl.run.batch import publish_batch
from prl.errors import ConfigError, PrlError
from prl.log import get_logger, init_logging
from prl.orchestrator.advantages import reward_stats
from prl.orchestrator.config import OrchestratorConfig
from prl.orchestrator.continuous import DataOrder, Scheduler, StepRollouts
from prl.planner.model import Plan
from prl.orchestrator.display import make_display
from prl.orchestrator.env import load_env
from prl.orchestrator.eval import evaluate
from prl.orchestrator.rollouts import Generator, StepBatch, TaskStream, build_samples, then
from prl.orchestrator.sync import ServerPool, WeightWatcher, discover, served_model, server_client, standalone
from prl.orchestrator.workers import EnvWorkers, check_env_id
from prl.run.lifecycle import role_lifecycle
from prl.run.rundir import API_KEY_VAR, RunDir

ROLE = "orchestrator"

log = get_logger("prl.orchestrator")


class Beat:
    """The role's heartbeat, from the main loop only (the launcher's hang detection reads it): at once on a
    phase change, and `tick()` (at most every `every` s) as rollout groups finish and while waiting for weights.
    A side task would keep beating for a loop that is stuck."""

    def __init__(self, run: RunDir, every: float = 10.0):
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


def renderer_config(renderer: dict[str, Any] | None) -> Any:
    """`model.renderer` as a `renderers.RendererConfig` (None stays None: chosen from the tokenizer);
    ConfigError naming the field when renderers refuses it (an unknown name, a field the renderer lacks,
    an import_path that does not load)."""
    if renderer is None:
        return None
    import pydantic
    from renderers import RendererConfig

    try:
        return pydantic.TypeAdapter(RendererConfig).validate_python(renderer)
    except pydantic.ValidationError as e:
        where = [".".join(map(str, err["loc"])) for err in e.errors()]
        problems = "; ".join(f"{w}: {err['msg']}" if w else err["msg"] for w, err in zip(where, e.errors()))
        raise ConfigError(f"model.renderer {renderer}: {problems}") from None
    except (ImportError, TypeError) as e:  # a custom import_path that does not load, or names no renderer
        raise ConfigError(f"model.renderer {renderer}: {type(e).__name__}: {e}") from None


def train_client(base_url: str, api_key_var: str, tokenizer: str, renderer: Any) -> Any:
    """verifiers' train client for a prl server at `base_url` (`.../v1`): conversations rendered here with
    `tokenizer` and `renderer` (from `renderer_config`), sent token-in/token-out to its generate route."""
    import verifiers.v1 as vf

    return vf.TrainClientConfig(base_url=base_url, api_key_var=api_key_var, renderer_model_name=tokenizer,
                                renderer=renderer)


def _contexts(cfg: OrchestratorConfig, pool: ServerPool):
    import verifiers.v1 as vf

    sampling = vf.SamplingConfig(temperature=cfg.temperature, max_tokens=cfg.max_tokens)
    renderer = renderer_config(cfg.renderer)

    def make(server) -> Any:
        client = train_client(f"{server.url}/v1", API_KEY_VAR, cfg.model_path, renderer)
        return vf.ModelContext(model=pool.model, client=client, sampling=sampling)

    return make


async def generate_step(
    gen: Generator, stream: TaskStream, cfg: OrchestratorConfig, step: int, beat: Beat | None = None
) -> tuple[StepBatch, int, float]:
    """All groups of one step (failed groups replaced once); the batch, rollouts run, seconds taken."""
    t0 = time.monotonic()
    min_v = cfg.min_version(step)
    k, n = cfg.examples_per_step, cfg.rollouts_per_example
    tick = beat.tick if beat else None
    groups = list(await asyncio.gather(*(then(gen.group(t, n, min_v), tick) for t in stream.tasks_for(step, k))))
    ran = k * n
    failed = sum(1 for g in groups if any(not r.ok for r in g))
    if 0 < failed < len(groups):
        # A few groups lost to errors: replace them once with fresh tasks so the batch keeps its size.
        groups += await asyncio.gather(*(gen.group(t, n, min_v) for t in stream.extra(step, 1, failed)))
        ran += failed * n
    # build_samples leaves failed groups out (and counts them).
    batch = build_samples(groups, cfg.advantage, max_tokens=cfg.max_tokens, min_version=min_v)
    return batch, ran, time.monotonic() - t0


class StepMode:
    """`rollout_mode: step`: each step waits until every server serves its weights, then runs its groups alone."""

    def __init__(self, gen: Generator, stream: TaskStream, cfg: OrchestratorConfig, pool: ServerPool,
                 errors: list[BaseException], beat: Beat, show: Callable[[int, str, str], None]):
        self.gen, self.stream, self.cfg, self.pool, self.errors, self.beat, self.show = (
            gen, stream, cfg, pool, errors, beat, show)

    async def make(self, step: int) -> StepRollouts:
        min_v = self.cfg.min_version(step)
        self.show(step, "waiting_for_weights", f"waiting for weights >= {min_v}")
        wait_s = await self.pool.wait_version(min_v, self.cfg.weights_timeout_s, self.errors, on_wait=self.beat)
        self.show(step, "generating", "generating")
        batch, ran, gen_s = await generate_step(self.gen, self.stream, self.cfg, step, self.beat)
        return StepRollouts(batch, ran, gen_s, wait_s, DataOrder.of_step(step, self.cfg.examples_per_step))

    def published_step(self, step: int, order: DataOrder) -> None:
        pass

    async def close(self) -> None:
        pass


def step_metrics(step: int, made: StepRollouts, pool: ServerPool) -> dict:
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
        "mid_rollout_updates": batch.mid_rollout_updates,
        "rollouts_per_s": ran / max(gen_s, 1e-9),
        "generate_s": gen_s,
        "wait_weights_s": made.wait_s,
        "weights_version": pool.version,
        "servers_failing": sum(1 for s in pool.admin if s.error),
    }
    for name, vals in sorted(batch.metrics.items()):
        m[f"metric/{name}"] = sum(vals) / len(vals)
    return m


async def orchestrate(run: RunDir, cfg: OrchestratorConfig, pool: ServerPool, beat: Beat) -> int:
    start = run.latest_stable("rollouts") or 0
    run.drop_metrics_after(ROLE, start)
    if start >= cfg.max_steps:
        log.info("rollouts up to step %d are published; nothing to do (max_steps %d)", start, cfg.max_steps)
        return 0
    async with server_client(timeout=30) as client:
        pool.model = pool.model or cfg.served_model_name or await served_model(client, pool.generate[0].url)
    make_ctx = _contexts(cfg, pool)  # first: a bad model.renderer stops the run before the env loads
    limits = {"max_turns": cfg.environment.max_turns, "max_total_tokens": cfg.environment.max_total_tokens}
    env = load_env(cfg.env_id, cfg.harness, cfg.env_args, split="train", **limits)
    eval_env = load_env(cfg.env_id, cfg.harness, cfg.env_args, split="eval", **limits) if cfg.eval.every else None
    if cfg.env_workers:
        check_env_id(cfg.env_id)
        env = EnvWorkers(env, cfg.env_workers)
    gen = Generator(env, pool, make_ctx, max_concurrent=cfg.max_concurrent_rollouts, retries=cfg.rollout_retries)
    eval_gen = (
        Generator(eval_env, pool, make_ctx, max_concurrent=cfg.max_concurrent_rollouts, retries=cfg.rollout_retries)
        if eval_env
        else None
    )
    stream = TaskStream(env.taskset, cfg.seed)
    watcher = WeightWatcher(run, pool, retries=cfg.weight_update_retries)
    pool.on_idle = beat.tick
    display = make_display(cfg.max_steps, start)

    def show(step: int, phase: str, text: str) -> None:
        beat(step=step, phase=phase)
        display.phase(step, text)

    k = cfg.examples_per_step
    source: StepMode | Scheduler = (
        Scheduler(gen, stream, cfg, DataOrder.read(run, start, k), start, errors=watcher.error, tick=beat.tick,
                  show=show)
        if cfg.rollout_mode == "continuous" else StepMode(gen, stream, cfg, pool, watcher.error, beat, show))
    background: list[asyncio.Task] = []
    try:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(env.serving())
            if eval_env is not None:
                await stack.enter_async_context(eval_env.serving())
            async with server_client() as client:
                await watcher.sync_live(client)
            background += [asyncio.create_task(watcher.run_forever())]
            for step in range(start + 1, cfg.max_steps + 1):
                made = await source.make(step)
                batch = made.batch
                if watcher.error:
                    raise watcher.error[0]
                if not batch.samples:
                    raise PrlError(
                        f"step {step}: every rollout failed ({batch.failed_rollouts} after retries); "
                        f"first error: {batch.first_error}"
                    )
                await asyncio.to_thread(
                    publish_batch,
                    run,
                    step,
                    batch.samples,
                    dp_size=cfg.dp_size,
                    micro_batch_tokens=cfg.micro_batch_tokens,
                    meta={"data_order": made.order.to_json()},
                )
                source.published_step(step, made.order)
                m = step_metrics(step, made, pool)
                run.append_metrics(m)
                # step_s: this step's longest stretch between heartbeats, at most; the launcher's hang bound grows with it.
                beat(step=step, phase="published", published=step, weights_version=pool.version,
                     step_s=round(made.generate_s, 3))
                display.step(step, m)

                if eval_gen is not None and step % cfg.eval.every == 0:
                    beat(phase="evaluating")
                    display.phase(step, "evaluating")
                    ev = await evaluate(eval_gen, cfg.eval.examples, on_group=beat.tick)
                    run.append_metrics({"role": ROLE, "step": step, "time": time.time(), "eval": True, **ev})
                    display.eval(step, ev)
    finally:
        await source.close()
        for t in background:
            t.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        display.close()
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
    beat = Beat(run)

    def on_term(signum, frame):  # the role runner passes SIGTERM on: unwind through the lifecycle below
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        with role_lifecycle(run, ROLE) as outcome:
            pool = standalone(servers) if servers else discover(run, plan, cfg.endpoint_timeout_s)
            outcome.code = asyncio.run(orchestrate(run, cfg, pool, beat))
        return outcome.code
    finally:
        signal.signal(signal.SIGTERM, old)
