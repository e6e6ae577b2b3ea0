"""Evaluation on an environment's eval split: the in-run eval and the one against an endpoint.

    evaluate(gen, examples)          the orchestrator's periodic eval, on its own generator and servers
    evaluate_endpoint(env_id, url, model, examples=64)
                                     any OpenAI-compatible endpoint (vLLM, a hosted API) with verifiers'
                                     plain eval client, which needs no token ids; `prl eval` and a sweep task
    evaluate_endpoint(..., records=out)   also each rollout's RolloutRecord (`prl eval --records FILE`)

The same env code scores training and evaluation. This module returns numbers; the `prl eval` command
(prl/cli.py) prints them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable
from urllib.parse import urlparse

from prl.orchestrator.advantages import reward_stats
from prl.orchestrator.clients import endpoint_client
from prl.orchestrator.env import load_env
from prl.orchestrator.rollouts import Generator, Rollout, then
from prl.orchestrator.sync import LiveServer, ServerPool
from prl.orchestrator.transcripts import record_of
from prl.run.records import RolloutRecord


async def evaluate(gen: Generator, examples: int, rollouts: int = 1,
                   on_group: Callable[[], None] | None = None,
                   keep: list[list[Rollout]] | None = None) -> dict[str, Any]:
    """Run `rollouts` episodes on each of the first `examples` eval tasks; reward and metric stats.
    `on_group` is called as each task's group finishes (the orchestrator's heartbeat: an eval longer than
    the hang bound is progress, not a hang, as long as groups keep finishing); `keep` gets every task's group
    (the rollouts themselves, for their records)."""
    tasks = list(gen.env.taskset.take(examples))
    t0 = time.monotonic()
    groups: list[list[Rollout]] = await asyncio.gather(*(then(gen.group(t, rollouts, 0), on_group) for t in tasks))
    out = summarize([r for group in groups for r in group], time.monotonic() - t0)
    if rollouts > 1:
        out.update(pass_at_k(groups, rollouts))
    if keep is not None:
        keep.extend(groups)
    return out


def eval_records(groups: list[list[Rollout]], env: str) -> list[RolloutRecord]:
    """Each rollout of an evaluation as a person reads it (`prl rollouts`, `prl export-data`): step 0, fate
    `evaluated` (or `failed`), no advantage."""
    return [record_of(r, g, i, env, 0, None, "evaluated" if r.ok else "failed")
            for g, group in enumerate(groups) for i, r in enumerate(group)]


def pass_at_k(groups: list[list[Rollout]], k: int, solved: float = 1.0) -> dict[str, float]:
    """pass@1 and pass@k over tasks: a rollout passes with reward >= `solved`; the unbiased estimator
    1 - C(n-c, j) / C(n, j) of a task with n finished rollouts, c of them passing (Chen et al., 2021)."""
    from math import comb

    out = {}
    for j in sorted({1, k}):
        scores = []
        for group in groups:
            ok = [r for r in group if r.ok]
            n, c = len(ok), sum(r.reward >= solved for r in ok)
            if n >= j:
                scores.append(1.0 - comb(n - c, j) / comb(n, j))
        out[f"pass@{j}"] = sum(scores) / len(scores) if scores else 0.0
    return out


def summarize(results: list[Rollout], seconds: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    rewards = reward_stats([r.reward for r in ok])
    out: dict[str, Any] = {
        "rollouts": len(results),
        "failed_rollouts": len(results) - len(ok),
        "reward_mean": rewards["mean"],
        "reward_std": rewards["std"],
        "reward_min": rewards["min"],
        "reward_max": rewards["max"],
        "completion_len_mean": sum(r.completion_tokens for r in ok) / max(1, len(ok)),
        "eval_s": seconds,
    }
    names = sorted({k for r in ok for k in r.metrics})
    for name in names:
        vals = [r.metrics[name] for r in ok if name in r.metrics]
        out[f"metric/{name}"] = sum(vals) / len(vals)
    if len(ok) < len(results):
        out["first_error"] = next(r.error for r in results if not r.ok)
    return out


def _openai_base(url: str) -> str:
    """`http://host:port` -> `http://host:port/v1`; a URL with a path is kept as given."""
    url = url.rstrip("/")
    return url + "/v1" if urlparse(url).path in ("", "/") else url


def evaluate_endpoint(
    env_id: str,
    base_url: str,
    model: str,
    api_key_env: str | None = None,
    examples: int = 64,
    rollouts: int = 1,
    args: dict | None = None,
    *,
    harness: str = "prl",
    max_tokens: int | None = 512,
    temperature: float | None = 0.0,
    max_concurrent: int = 32,
    render_with: str | None = None,
    renderer: dict[str, Any] | None = None,
    records: list[RolloutRecord] | None = None,
) -> dict[str, Any]:
    """Evaluate `env_id`'s eval split against an OpenAI-compatible endpoint; its reward stats (`evaluate`'s)
    with `env`, `model` and `base_url`.

    `api_key_env` names the variable holding the API key (unset: no key, "EMPTY").
    `render_with`: a tokenizer directory; the conversation is then rendered here with it and `renderer`
    (`model.renderer`) and sent to the server's token-in/token-out generate route, as the orchestrator's
    in-run eval does (a prl server only; tool calls are parsed by the renderer, not the server).
    `records` gets each rollout's record (`eval_records`).
    """
    import verifiers.v1 as vf

    env = load_env(env_id, harness, args, split="eval")
    client = endpoint_client(_openai_base(base_url), api_key_env or "PRL_EVAL_NO_API_KEY", render_with, renderer)
    sampling = vf.SamplingConfig(temperature=temperature, max_tokens=max_tokens)
    server = LiveServer(base_url)
    pool = ServerPool(generate=[server], admin=[])

    async def run() -> dict[str, Any]:
        gen = Generator(env, pool, lambda s: vf.ModelContext(model=model, client=client, sampling=sampling),
                        max_concurrent=max_concurrent, retries=2, need_tokens=False)
        async with env.serving():
            return await evaluate(gen, examples, rollouts, keep=groups)

    groups: list[list[Rollout]] = []
    stats = asyncio.run(run())
    if records is not None:
        records.extend(eval_records(groups, env_id))
    stats.update(env=env_id, model=model, base_url=base_url)
    return stats
