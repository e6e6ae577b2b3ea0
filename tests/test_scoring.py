"""prl/orchestrator/scoring.py against a stand-in of vLLM's /v1/completions (prompt_logprobs); the real server is
in tests/test_e2e_distill.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from prl.orchestrator.scoring import Scorers, ScoringError, token_logprobs
from prl.run.batch import Sample


def fake_vllm(seen: list[tuple[str, dict]], fail: set[str] = frozenset()) -> httpx.MockTransport:
    """Answers as vLLM does with prompt_logprobs 0: null, then {str(token): {"logprob": -token/10, ...}}."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, body))
        if request.url.host in fail:
            return httpx.Response(503, text="overloaded")
        entries = [None] + [{str(t): {"logprob": -t / 10, "rank": 1, "decoded_token": "x"}} for t in body["prompt"][1:]]
        return httpx.Response(200, json={"choices": [{"text": "", "prompt_logprobs": entries}]})

    return httpx.MockTransport(handle)


def scorers(transport: httpx.MockTransport, urls: dict[str, list[str]], retries: int = 1) -> Scorers:
    return Scorers(tuple(urls), lambda role: urls[role], lambda **kw: httpx.AsyncClient(transport=transport, **kw),
                   max_concurrent=2, retries=retries)


def test_every_model_token_gets_each_roles_logprob_and_the_rest_zero():
    seen: list = []
    samples = [Sample([1, 2, 3, 4], [0, 1, 0, 1], [0.0] * 4, 1.0), Sample([5, 6, 7], [0, 1, 1], [0.0] * 3, 0.0)]
    stats = asyncio.run(scorers(fake_vllm(seen), {"teacher": ["http://t0", "http://t1"],
                                                  "reference": ["http://r0"]}).score(samples))
    assert samples[0].scores == {"teacher": [0.0, -0.2, 0.0, -0.4], "reference": [0.0, -0.2, 0.0, -0.4]}
    assert samples[1].scores["teacher"] == [0.0, -0.6, -0.7]
    assert stats.tokens == {"teacher": 7, "reference": 7} and set(stats.seconds) == {"teacher", "reference"}
    # one request per sample and role, round-robin over the role's servers, the whole sequence as the prompt
    assert sorted(host for host, _ in seen) == ["r0", "r0", "t0", "t1"]
    body = next(b for _, b in seen if b["prompt"] == [1, 2, 3, 4])
    assert (body["max_tokens"], body["prompt_logprobs"], body["model"]) == (1, 0, "teacher")


def test_a_failing_server_is_retried_on_the_next_and_a_lasting_failure_named():
    seen: list = []
    samples = [Sample([1, 2], [0, 1], [0.0, 0.0], 1.0)]
    asyncio.run(scorers(fake_vllm(seen, fail={"t0"}), {"teacher": ["http://t0", "http://t1"]}).score(samples))
    assert samples[0].scores["teacher"] == [0.0, -0.2] and [h for h, _ in seen] == ["t0", "t1"]
    with pytest.raises(ScoringError, match=r"teacher could not score a sample of 2 tokens: http://t0 answered 503"):
        asyncio.run(scorers(fake_vllm([], fail={"t0"}), {"teacher": ["http://t0"]}).score(samples))


def test_prompt_logprobs_that_do_not_match_the_tokens_are_refused():
    assert token_logprobs({"prompt_logprobs": [None, {"7": {"logprob": -1.5}}]}, [3, 7]) == [0.0, -1.5]
    with pytest.raises(ScoringError, match="has 1 entries for 2 tokens"):
        token_logprobs({"prompt_logprobs": [None]}, [3, 7])
    with pytest.raises(ScoringError, match="position 1 lacks token 7"):
        token_logprobs({"prompt_logprobs": [None, {"8": {"logprob": -1.0}}]}, [3, 7])
