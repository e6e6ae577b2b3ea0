"""The project's verifiers environments (environments/): load offline, score hand-written replies.

Needs the env packages installed: pip install -e environments/prl_letters -e environments/prl_reverse_text
(and, for the loading test, -e environments/prl_guess -e environments/prl_calc; tests/test_env_agentic.py
plays those two).
"""

from __future__ import annotations

import asyncio

import pytest
import verifiers.v1 as vf  # the env extra; CI installs it

from prl.orchestrator.env import env_config, load_env
from testkit.fake_engine import FakeEngine
from tests.helpers import run_one_episode

ENVS = ("prl_letters", "prl_reverse_text", "prl_guess", "prl_calc")


def reply_trace(task, reply: str):
    """A finished trace whose one model turn is `reply` (what scoring reads)."""
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    return vf.Trace(
        task=TraceTask(type=type(task).__name__, data=task.data),
        agent=AgentInfo(config=vf.AgentConfig()),
        nodes=[
            MessageNode(message=vf.UserMessage(content=task.data.prompt)),
            MessageNode(message=vf.AssistantMessage(content=reply), sampled=True, parent=0),
        ],
    )


def score(task, reply: str) -> tuple[float, dict]:
    trace = reply_trace(task, reply)
    asyncio.run(task.score(trace))
    return trace.reward, dict(trace.metrics)


@pytest.mark.parametrize("env_id", ENVS)
def test_env_loads_offline_with_disjoint_splits(env_id):
    raw = env_config(env_id, "prl", {}, split="train")
    assert raw["agent"]["runtime"] == {"type": "subprocess"}  # never the remote-sandbox default
    train = load_env(env_id, split="train")
    ev = load_env(env_id, split="eval")
    assert train.taskset.config.split == "train" and ev.taskset.config.split == "eval"
    train_prompts = {t.data.prompt for t in train.taskset}
    eval_prompts = {t.data.prompt for t in ev.taskset}
    assert len(train_prompts) > 10 and eval_prompts and not train_prompts & eval_prompts
    assert type(train.taskset).__module__ == env_id


def test_env_args_reach_the_taskset():
    env = load_env("prl_letters", args={"letters": "xy", "num_examples": 6}, split="train")
    tasks = list(env.taskset)
    assert [t.data.letter for t in tasks] == list("xyxyxy")
    from prl.errors import ConfigError

    with pytest.raises(ConfigError, match="invalid config"):
        load_env("prl_letters", args={"no_such_field": 1}, split="train")


def test_rollout_limits_reach_the_agent():
    """`environment.max_turns` / `max_total_tokens` become the agent's limits (verifiers stops the rollout)."""
    raw = env_config("prl_letters", max_turns=3, max_total_tokens=500)
    assert (raw["agent"]["max_turns"], raw["agent"]["max_total_tokens"]) == (3, 500)
    assert "max_turns" not in env_config("prl_letters")["agent"]  # None: verifiers' default, no limit
    agent = load_env("prl_letters", split="train", max_turns=3).config.agent
    assert (agent.max_turns, agent.max_total_tokens) == (3, None)


def test_letters_scores_hand_written_replies():
    task = next(iter(load_env("prl_letters", split="eval").taskset))
    assert task.data.letter == "a"
    assert score(task, "aaaa")[0] == 1.0
    assert score(task, "a a b b")[0] == 0.5
    assert score(task, "A")[0] == 1.0
    assert score(task, "")[0] == 0.0
    assert score(task, "xyz")[1] == {"reply_chars": 3.0}


def test_reverse_text_scores_hand_written_replies():
    from prl_reverse_text import lcs_ratio

    task = next(iter(load_env("prl_reverse_text", split="eval").taskset))
    target = task.data.text[::-1]
    assert score(task, target) == (1.0, {"exact": 1.0})
    assert score(task, f"  {target}\n") == (1.0, {"exact": 1.0})
    assert score(task, task.data.text)[0] == pytest.approx(lcs_ratio(task.data.text, target))
    assert score(task, "")[0] == 0.0
    assert lcs_ratio("abcd", "abd") == pytest.approx(2 * 3 / 7)
    assert lcs_ratio("", "") == 1.0


def test_a_rollout_through_the_prl_harness_is_scored_and_tokenized(tokenizer_dir):
    """The in-process harness + verifiers' train client against a scripted engine."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def reply(prompt_ids):  # answer every reverse-text prompt correctly
        text = tok.decode(prompt_ids).split("Text: ", 1)[1].split("<|im_end|>", 1)[0]
        return tok.encode(text[::-1], add_special_tokens=False) + [end]

    env = load_env("prl_reverse_text", split="eval")
    task = next(iter(env.taskset))
    with FakeEngine(model="m", reply=reply) as eng:
        ctx = vf.ModelContext(
            model="m",
            client=vf.TrainClientConfig(base_url=eng.url + "/v1", api_key_var="PRL_TEST_NO_KEY", renderer_model_name=str(tokenizer_dir)),
            sampling=vf.SamplingConfig(temperature=1.0, max_tokens=32),
        )
        episode = run_one_episode(env, task, ctx)
    trace = episode.traces[0]
    assert episode.ok and trace.reward == 1.0 and trace.metrics == {"exact": 1.0}
    (branch,) = trace.branches
    ids, mask, lp = branch.token_ids, branch.sampled_mask, branch.logprobs
    assert len(ids) == len(mask) == len(lp)
    completion = [t for t, m in zip(ids, mask) if m]
    assert completion[-1] == end and tok.decode(completion[:-1]) == task.data.text[::-1]
    assert not mask[0] and all(x == 0.0 for x, m in zip(lp, mask) if not m)
