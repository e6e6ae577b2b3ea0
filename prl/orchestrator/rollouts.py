"""Rollouts: run groups of episodes on the servers, then turn them into training samples.

One *group* is `rollouts_per_example` episodes of the same task. Each episode
runs through `env.run_slot` with a ModelContext whose train client points at
one server new enough for the step, chosen by the router's rule
(`prl.inference.routing`, keyed by the task: a group's episodes share its
prompt, so they keep to one server's prefix cache while that server holds no
more than its share of requests in flight), and is stamped with
that server's weights version when it started (conservative: an update
landing mid-rollout only makes later tokens newer) and when it finished
(`version_end`: the versions the episode spans). A failed episode (HTTP
error, engine restart) is retried on another server up to `retries` times; a
group with an episode that still fails is dropped whole (its advantages would
be biased) and counted.

Every trainable branch of every trainable agent's trace becomes one `prl.run.batch.Sample`: token
ids, the sampled mask as loss mask, the engine's logprobs, the episode's
advantage and its policy versions (start and end).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prl.run.batch import Sample, picture_bytes
from prl.config.topology import Advantage
from prl.errors import ConfigError
from prl.orchestrator.advantages import group_advantages, is_zero_group
from prl.orchestrator.shaping import ShapingInputs, shape, shaper
from prl.orchestrator.sync import LiveServer, ServerPool
from prl.orchestrator.transcripts import conversation

T = TypeVar("T")


@dataclass
class Branch:
    token_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    images: list[bytes] = field(default_factory=list)
    """The pictures of its prompt (encoded), in placeholder order: the trainer re-runs the image processor."""
    routes: Any = None
    """[len(token_ids), layers, top_k] experts the server routed each token to (numpy; router replay), as
    verifiers joins them from its turns (`Branch.routed_experts`); None when a turn returned none."""


def pictures_of(messages: Sequence[Any]) -> list[bytes]:
    """The encoded pictures of a chat's `image_url` parts, in order (ValueError for one that is not a data URL:
    the server takes nothing else, `prl.run.batch.picture_bytes`)."""
    out = []
    for message in messages:
        content = getattr(message, "content", None)
        for part in content if isinstance(content, list) else ():
            url = getattr(getattr(part, "image_url", None), "url", None)
            if url is not None:
                out.append(picture_bytes(url))
    return out


@dataclass
class Rollout:
    reward: float
    version: int
    branches: list[Branch]
    completion_tokens: int
    truncated: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    attempts: int = 1
    turns: int = 0
    """Model turns of the episode's trainable traces."""
    version_end: int | None = None
    """The server's weights version when the episode finished (None: `version`); newer than `version` when a
    weight update landed mid-rollout (servers load weights without pausing generation)."""
    conversation: list = field(default_factory=list)
    """The episode's conversation as text (prl.run.records.Turn, prl/orchestrator/transcripts.py)."""
    clipped: bool = False
    """Some of `conversation`'s text was cut to its bound."""

    def __post_init__(self) -> None:
        if self.version_end is None:
            self.version_end = self.version

    @property
    def ok(self) -> bool:
        return self.error is None


def branch_of(b: Any) -> Branch:
    """A trainable verifiers Branch with token ids as a training branch (ValueError: a picture is not data)."""
    mask = [int(m) for m in b.sampled_mask]
    mask[0] = 0  # nothing predicts a sample's first token
    return Branch(list(b.token_ids), mask, list(b.logprobs), pictures_of(b.messages),
                  getattr(b, "routed_experts", None))


def rollout_from_episode(episode: Any, version: int, *, need_tokens: bool = True) -> Rollout:
    """What training needs of a verifiers Episode (reward, token branches, metrics), and its conversation."""
    traces = list(episode.traces)
    turns, clipped = conversation(traces)
    rollout = _rollout_of(episode, traces, version, need_tokens)
    rollout.conversation, rollout.clipped = turns, clipped
    return rollout


def _rollout_of(episode: Any, traces: list, version: int, need_tokens: bool) -> Rollout:
    if not episode.ok or not traces:
        errs = [e for t in traces for e in t.errors] + list(episode.errors)
        msg = f"{errs[-1].type}: {errs[-1].message}" if errs else "episode failed without an error"
        return Rollout(0.0, version, [], 0, error=msg)
    # Only the policy's traces count: an untrainable agent (a simulated user, a judge) is the
    # environment, so its tokens are never trained on and its reward is not the policy's.
    traces = [t for t in traces if t.agent.trainable]
    if not traces:
        return Rollout(0.0, version, [], 0, error="episode has no trace of a trainable agent")
    branches: list[Branch] = []
    completion = 0
    metrics: dict[str, float] = {}
    for trace in traces:
        try:
            trained = [branch_of(b) for b in trace.branches if b.trainable and b.token_ids]
        except ValueError as e:
            return Rollout(0.0, version, [], 0, error=str(e))
        branches += trained
        completion += sum(sum(b.mask) for b in trained)
        for name, value in trace.metrics.items():
            if value is not None:
                metrics[name] = float(value)
        for name, r in trace.rewards.items():
            if r is not None:
                metrics[f"reward/{name}"] = float(r.score)
    if need_tokens and not branches:
        return Rollout(0.0, version, [], 0, error="episode has no token ids: the train client was not used")
    if not branches:  # an OpenAI endpoint (`prl eval`): no token ids, but the provider counted the reply
        completion = sum(t.num_output_tokens for t in traces)
    reward = sum(t.reward for t in traces) / len(traces)
    return Rollout(reward, version, branches, completion, any(t.is_truncated for t in traces), metrics,
                   turns=sum(t.num_turns for t in traces))


def routing_key(task: Any) -> str:
    """The routing key of a task's episodes (`prl.inference.routing`): its verifiers identity `task.key`."""
    return f"task:{task.key}"


async def then(coro: Awaitable[T], done: Callable[[], None] | None) -> T:
    """Await `coro`, then call `done` (a heartbeat tick as each rollout group finishes)."""
    result = await coro
    if done is not None:
        done()
    return result


class Generator:
    """Runs episodes of one env on a server pool, one ModelContext per server."""

    def __init__(
        self,
        env: Any,
        pool: ServerPool,
        make_ctx: Callable[[LiveServer], Any],
        *,
        max_concurrent: int,
        retries: int,
        need_tokens: bool = True,
    ):
        self.env = env
        self.pool = pool
        self.make_ctx = make_ctx
        self.ctx: dict[int, Any] = {}
        self.sem = asyncio.Semaphore(max_concurrent)
        self.retries = retries
        self.need_tokens = need_tokens
        self.running = 0
        """Rollouts holding a concurrency slot now (the rest wait for a server new enough, or for a slot)."""

    def _ctx(self, server: LiveServer) -> Any:
        key = id(server)
        if key not in self.ctx:
            self.ctx[key] = self.make_ctx(server)
        return self.ctx[key]

    @contextlib.asynccontextmanager
    async def _slot(self, min_version: int, avoid: LiveServer | None, key: str) -> AsyncIterator[LiveServer]:
        """A concurrency slot and a server new enough. A rollout waits for a server (every one behind
        during a restart) without holding a slot, so the slots go to rollouts that can run;
        `pool.pick` ticks the heartbeat while it finds none."""
        while True:
            while self.pool.pick(min_version) is None:  # keyless: the cheap check
                await self.pool.moved(0.5)  # woken as new weights load: a step waits on no poll interval
            await self.sem.acquire()
            server = self.pool.pick(min_version, avoid=avoid, key=key)
            if server is not None:
                break
            self.sem.release()  # lost again while queued for a slot: wait without it
        self.running += 1
        try:
            yield server
        finally:
            self.running -= 1
            self.sem.release()

    async def rollout(self, task: Any, min_version: int, started: Callable[[int], None] | None = None) -> Rollout:
        """One episode (retried up to `retries` times); `started(version)` hears the weights each attempt starts on."""
        from verifiers.v1.env import RunSlot

        key = routing_key(task)
        last: LiveServer | None = None
        result: Rollout | None = None
        for attempt in range(1, self.retries + 2):
            async with self._slot(min_version, last, key) as server:
                version = self.pool.version_of(server)
                if started is not None:
                    started(version)
                server.inflight += 1
                try:
                    episode = await self.env.run_slot(RunSlot(task), self._ctx(server))
                finally:
                    server.inflight -= 1
                version_end = self.pool.version_of(server)
            result = rollout_from_episode(episode, version, need_tokens=self.need_tokens)
            result.attempts, result.version_end = attempt, max(version, version_end)
            if result.ok:
                return result
            last = server
            await self.pool.suspect(server)  # a dead server leaves rotation: the retry waits for one that lives
            if attempt <= self.retries:
                await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 10.0))
        assert result is not None
        return result

    async def group(self, task: Any, n: int, min_version: int,
                    started: Callable[[int], None] | None = None) -> list[Rollout]:
        return list(await asyncio.gather(*(self.rollout(task, min_version, started) for _ in range(n))))


class TaskStream:
    """The train split as an endless, seeded, resumable sequence: epoch e is a shuffle of all tasks.

    Task `g` (`at(g)`) is a function of g and the seed alone; `tasks_for(step, k)` (step mode) returns the
    same k tasks for a step whatever happened before, so a resumed run continues the data order exactly.
    """

    def __init__(self, taskset: Any, seed: int):
        self.tasks = list(taskset) if getattr(taskset, "bounded", True) else None
        self.taskset = taskset
        self.seed = seed
        self._perms: dict[int, list[int]] = {}
        if self.tasks is not None and not self.tasks:
            raise ConfigError("the environment's train split has no tasks")

    def at(self, g: int) -> Any:
        if self.tasks is None:
            return next(iter(self.taskset.skip(g)))
        n = len(self.tasks)
        epoch, i = divmod(g, n)
        if epoch not in self._perms:
            perm = list(range(n))
            random.Random(f"{self.seed}-{epoch}").shuffle(perm)
            self._perms = {epoch: perm}
        return self.tasks[self._perms[epoch][i]]

    def tasks_for(self, step: int, k: int) -> list[Any]:
        return [self.at((step - 1) * k + j) for j in range(k)]

    def extra(self, step: int, attempt: int, k: int) -> Iterator[Any]:
        """Replacement tasks for dropped groups (seeded by step and attempt)."""
        rng = random.Random(f"{self.seed}-extra-{step}-{attempt}")
        for _ in range(k):
            yield self.at(rng.randrange(1 << 40))


@dataclass
class StepBatch:
    samples: list[Sample]
    rewards: list[float]
    """Rewards of every scored rollout (with dropped zero groups); `versions` only of the kept ones."""
    lengths: list[int]
    versions: list[int]
    truncated: int
    failed_rollouts: int
    failed_groups: int
    zero_groups: int
    dropped_zero_groups: int
    metrics: dict[str, list[float]]
    first_error: str | None = None
    groups_used: int = 0
    turns: list[int] = field(default_factory=list)
    """Model turns of every scored rollout, like `rewards`."""
    mid_rollout_updates: int = 0
    """Kept rollouts during which their server loaded newer weights."""
    stale_groups: int = 0
    """Groups left out because they became older than the staleness bound (continuous mode): finished while
    queued, or cancelled while running (`stale_cancelled` of them)."""
    stale_cancelled: int = 0
    """Running groups cancelled the moment one of their rollouts' weights fell outside the bound."""
    resampled_groups: int = 0
    """Groups without signal replaced by fresh ones (`advantage.dynamic_sampling`): in the stats, not trained."""
    fates: list = field(default_factory=list)
    """(rollouts, advantages or None, fate) of every group the step made, in order: what became of each
    (prl.run.records.ROLLOUT_FATES), for the step's rollout sample (prl/orchestrator/transcripts.py)."""


def has_signal(group: Sequence[Rollout], cfg: Advantage, max_tokens: int) -> bool:
    """A group that scored and whose advantages are not all zero: what dynamic sampling keeps."""
    if not all(r.ok for r in group):
        return True  # failed groups are not its business (they are replaced or counted as failed)
    adv = group_advantages([r.reward for r in group], [r.completion_tokens for r in group], cfg, max_tokens)
    return not is_zero_group(adv)


def fates(groups: Sequence[Sequence[Rollout]], kept: Sequence[tuple[Sequence[Rollout], list[float]]],
          dropped: Sequence[tuple[Sequence[Rollout], list[float]]], resampled: Sequence[Sequence[Rollout]]) -> list:
    """(rollouts, advantages or None, fate) of every group of `groups` in their order: trained (`kept`), dropped
    for zero advantages (`dropped`), or failed (the rest); then the `resampled` ones."""
    trained = {id(g): adv for g, adv in kept}
    zero = {id(g) for g, _ in dropped}
    out = [(g, trained[id(g)], "trained") if id(g) in trained else (g, None, "zero_advantage") if id(g) in zero
           else (g, None, "failed") for g in groups]
    return out + [(g, None, "resampled") for g in resampled]


def build_samples(
    groups: Sequence[Sequence[Rollout]],
    cfg: Advantage,
    *,
    max_tokens: int,
    min_version: int,
    resampled: Sequence[Sequence[Rollout]] = (),
) -> StepBatch:
    """Advantages per group, then samples; drop failed groups (and all-zero ones when asked). `resampled`:
    groups dynamic sampling replaced, in the reward statistics only."""
    out = StepBatch([], [], [], [], 0, 0, 0, 0, 0, {}, resampled_groups=len(resampled))
    kept: list[tuple[Sequence[Rollout], list[float]]] = []
    zero: list[tuple[Sequence[Rollout], list[float]]] = []
    for group in groups:
        bad = [r for r in group if not r.ok]
        if bad:
            out.failed_rollouts += len(bad)
            out.failed_groups += 1
            out.first_error = out.first_error or bad[0].error
            continue
        stale = [r.version for r in group if r.version < min_version]
        if stale:
            # The pool never hands out a server older than the bound; this guards the invariant.
            raise AssertionError(f"rollout with policy version {min(stale)} < bound {min_version}")
        adv = group_advantages([r.reward for r in group], [r.completion_tokens for r in group], cfg, max_tokens)
        (zero if is_zero_group(adv) else kept).append((group, adv))
    out.zero_groups = len(zero)
    if cfg.drop_zero_groups and kept:
        out.dropped_zero_groups = len(zero)
    else:
        # Nothing informative left: keep the all-zero groups (a no-op step) rather than an empty batch.
        kept += zero
    for group in [*(g for g, _ in kept), *(g for g, _ in zero if out.dropped_zero_groups), *resampled]:
        # Stats cover every scored rollout, dropped zero groups too (else dropping would bias the mean).
        for r in group:
            out.rewards.append(r.reward)
            out.lengths.append(r.completion_tokens)
            out.turns.append(r.turns)
            out.truncated += int(r.truncated)
            for name, value in r.metrics.items():
                out.metrics.setdefault(name, []).append(value)
    out.fates = fates(groups, kept, zero if out.dropped_zero_groups else [], resampled)
    fn = shaper(cfg.shaping)
    for group, adv in kept:
        out.groups_used += 1
        for r, a in zip(group, adv):
            out.versions.append(r.version)
            out.mid_rollout_updates += int(r.version_end > r.version)
            for b in r.branches:
                shaped = a if fn is None else shape(fn, ShapingInputs(
                    b.token_ids, b.mask, r.reward, r.completion_tokens, r.truncated, r.metrics, max_tokens),
                    a, cfg.shaping)
                out.samples.append(Sample(b.token_ids, b.mask, b.logprobs, shaped, policy_version=r.version,
                                          policy_version_end=r.version_end, images=b.images,
                                          routed_experts=b.routes))
    return out
