"""The in-process fast path (prl/orchestrator/fastpath.py) changes the CPU a model call costs, not what it
produces: the same episode through verifiers' path as shipped and through the fast path gives the same
engine requests, token ids, loss masks, logprobs, rewards and failures, single- and multi-turn, with a
renderer that extends each turn and with one that re-renders the whole conversation."""

from __future__ import annotations

import asyncio

import openai
import pytest
import verifiers.v1 as vf
from pydantic import BaseModel, Field

from prl.orchestrator import engine_client, fastpath
from prl.orchestrator.clients import renderer_config
from prl.orchestrator.env import load_env
from prl.orchestrator.rollouts import rollout_from_episode
from testkit.fake_engine import FakeEngine
from tests.helpers import run_one_episode
from tests.test_multiturn import CHATML, Script

SCENARIOS = {
    # env, renderer, engine replies (None: random ids, which rarely re-tokenize to themselves)
    "single-turn": ("prl_letters", None),
    "multi-turn, extending renderer": ("prl_guess", CHATML),
    "multi-turn, re-rendering renderer": ("prl_guess", None),
}


def episode_through(parts, env_id, renderer, tokenizer_dir, tok, *, fail_every=0):
    """One episode of the env's first eval task with only `parts` of the fast path in place: the episode,
    the engine's record of (prompt ids, reply ids) per request, and which fast-path calls ran."""
    calls = {"local": 0, "engine_http": 0}
    local_call, post = fastpath.local_call, engine_client.EngineHTTP.post

    async def counted_local_call(*args, **kwargs):
        calls["local"] += 1
        return await local_call(*args, **kwargs)

    async def counted_post(self, *args, **kwargs):
        calls["engine_http"] += 1
        return await post(self, *args, **kwargs)

    script = Script(tok, seed=0)
    with pytest.MonkeyPatch.context() as mp, fastpath.parts(parts):
        mp.setattr(fastpath, "local_call", counted_local_call)
        mp.setattr(engine_client.EngineHTTP, "post", counted_post)
        env = load_env(env_id, args={"num_examples": 1}, split="eval")
        task = next(iter(env.taskset))
        with FakeEngine(model="m", stop_id=script.end, reply=script.reply, logprobs=script.logprobs) as eng:
            eng.fail_every = fail_every
            client = vf.TrainClientConfig(base_url=eng.url + "/v1", api_key_var="PRL_TEST_NO_KEY",
                                          renderer_model_name=str(tokenizer_dir), renderer=renderer_config(renderer))
            ctx = vf.ModelContext(model="m", client=client, sampling=vf.SamplingConfig(temperature=1.0, max_tokens=16))
            episode = run_one_episode(env, task, ctx)
    return episode, script.calls, calls


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_fast_path_trains_on_what_verifiers_path_trains_on(tokenizer_dir, tok, scenario):
    env_id, renderer = SCENARIOS[scenario]
    shipped, shipped_requests, shipped_calls = episode_through((), env_id, renderer, tokenizer_dir, tok)
    fast, fast_requests, fast_calls = episode_through(fastpath.PARTS, env_id, renderer, tokenizer_dir, tok)
    assert shipped.ok and fast.ok, (shipped.errors, fast.errors)
    turns = len(shipped_requests)
    assert shipped_calls == {"local": 0, "engine_http": 0}  # the control did not take the fast path
    assert fast_calls == {"local": turns, "engine_http": turns}  # ... and the fast path did, every turn
    assert fast_requests == shipped_requests  # the engine saw the same prompts (and sent the same replies)
    a, b = rollout_from_episode(shipped, version=0), rollout_from_episode(fast, version=0)
    assert [(x.token_ids, x.mask, x.logprobs) for x in a.branches] == [(x.token_ids, x.mask, x.logprobs)
                                                                      for x in b.branches]
    assert (a.reward, a.turns, a.completion_tokens, a.truncated, a.metrics) == (
        b.reward, b.turns, b.completion_tokens, b.truncated, b.metrics)
    if scenario == "multi-turn, extending renderer":
        assert turns == 4 and len(b.branches) == 1  # one exact sequence over four turns
    if scenario == "multi-turn, re-rendering renderer":
        assert len(b.branches) > 1  # re-rendered random replies split it, on both paths alike


def test_an_engine_failure_fails_the_rollout_as_on_verifiers_path(tokenizer_dir, tok):
    """Every generate answered 503: the rollout fails with the SDK's error and status on both paths."""
    shipped, _, _ = episode_through((), "prl_letters", None, tokenizer_dir, tok, fail_every=1)
    fast, _, _ = episode_through(fastpath.PARTS, "prl_letters", None, tokenizer_dir, tok, fail_every=1)
    assert not shipped.ok and not fast.ok
    errors = [[(e.type, e.status_code, e.message) for t in ep.traces for e in t.errors] for ep in (shipped, fast)]
    assert errors[0] == errors[1] and errors[0][0][:2] == ("ProviderError", 503), errors


def test_engine_http_raises_the_sdks_errors():
    """An HTTP error is the SDK's exception for its status (what verifiers maps to a retry or not); a server
    that is not there is a connection error (retried)."""
    from verifiers.v1.errors import model_error

    async def call(url: str, status_override: int | None = None):
        config = vf.TrainClientConfig(base_url=url + "/v1", api_key_var="PRL_TEST_NO_KEY")
        with pytest.raises(openai.OpenAIError) as e:
            await engine_client.EngineHTTP(config).post(f"{url}/inference/v1/generate", body={"token_ids": [1]})
        return e.value

    with FakeEngine(model="m") as eng:
        eng.fail_every = 1
        err = asyncio.run(call(eng.url))
    assert isinstance(err, openai.InternalServerError) and err.status_code == 503
    assert "injected failure" in str(err) and model_error(err).status_code == 503
    err = asyncio.run(call("http://127.0.0.1:9"))  # nothing listens on the discard port
    assert isinstance(err, openai.APIConnectionError) and model_error(err).status_code == 503
    for status, cls in [(400, openai.BadRequestError), (409, openai.ConflictError), (418, openai.APIStatusError)]:
        made = engine_client.status_error("POST", "http://x/y", status, b'{"error": "no"}')
        assert type(made) is cls and made.status_code == status and made.body == "no"


class Defaults(BaseModel):
    n: int = 0
    items: list[int] = Field(default_factory=list)
    doubled: int = Field(default_factory=lambda data: 2 * data["n"])


def test_the_default_factory_cache_gives_pydantics_answers():
    """`model_construct` with the cache: a plain factory and one taking the validated data both still work,
    and an unhashable callable is asked each time."""
    from pydantic._internal import _fields

    class Unhashable:
        __hash__ = None

        def __call__(self):
            return 1

    with fastpath.parts(()):
        original = _fields.takes_validated_data_argument
    with fastpath.parts(("factory_cache",)):
        check = _fields.takes_validated_data_argument
        assert check is not original and check.__wrapped__ is original
        assert check(list) is False and check(lambda data: data) is True and check(Unhashable()) is False
        built = Defaults.model_construct(n=3)
    assert built.items == [] and Defaults.model_construct(n=3).doubled == 6 == built.doubled
