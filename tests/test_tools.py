"""Tool calls through the `prl` harness: a task's MCP toolset (tests/tools_env.py, served once by
verifiers' subprocess runtime) reaches the model as the request's `tools`; the model's Hermes
`<tool_call>` replies (scripted on a FakeEngine, parsed by prl's ChatML renderer) run with a timeout;
results and errors come back as tool messages, and the rollout still trains as one token sequence."""

from __future__ import annotations

import json
import os

import pytest
import verifiers.v1 as vf

from prl.orchestrator.chatml import IMPORT_PATH
from prl.orchestrator.clients import renderer_config
from prl.orchestrator.env import env_config
from prl.orchestrator.rollouts import rollout_from_episode
from testkit.fake_engine import FakeEngine
from tests.helpers import REPO, run_one_episode


def call(name: str, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


FIRST = "Let me compute. " + "".join([
    call("add", {"a": 2, "b": 3}),
    call("boom", {}),
    call("slow", {}),
    call("nope", {}),
    call("add", [2, 3]),  # arguments that are not an object
])
SECOND = "2 + 3 = 5."


def run_tools_episode(tok, replies: list[str], monkeypatch, **agent):
    # The shared tool server is `python -m tests.tools_env`: it inherits this PYTHONPATH.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    raw = env_config("tests.tools_env")
    raw["agent"]["harness"]["tool_timeout"] = 1.0
    raw["agent"].update(agent)
    env = vf.load_environment(vf.resolve_env_config(raw))
    task = next(iter(env.taskset))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    calls: list[tuple[list[int], list[int]]] = []

    def reply(prompt_ids: list[int]) -> list[int]:
        ids = tok.encode(replies[len(calls)], add_special_tokens=False) + [end]
        calls.append((prompt_ids, ids))
        return ids

    def logprobs(ids: list[int]) -> list[float]:
        return [-0.01 * (t % 97) - 0.001 for t in ids]

    with FakeEngine(model="m", stop_id=end, reply=reply, logprobs=logprobs) as eng:
        client = vf.TrainClientConfig(base_url=eng.url + "/v1", api_key_var="PRL_TEST_NO_KEY",
                                      renderer_model_name=tok.name_or_path,
                                      renderer=renderer_config({"name": "custom", "import_path": IMPORT_PATH}))
        ctx = vf.ModelContext(model="m", client=client, sampling=vf.SamplingConfig(temperature=1.0, max_tokens=200))
        episode = run_one_episode(env, task, ctx)
    assert episode.ok, episode.errors
    return episode, calls, logprobs


def test_tool_calls_round_trip_with_errors_and_a_timeout(tok, monkeypatch):
    episode, calls, logprobs = run_tools_episode(tok, [FIRST, SECOND], monkeypatch)
    (trace,) = episode.traces
    assert len(calls) == 2 and trace.num_turns == 2
    # The toolset's schemas reached the model through the chat template.
    first_prompt = tok.decode(calls[0][0])
    assert "<tools>" in first_prompt and '"name": "add"' in first_prompt and '"name": "slow"' in first_prompt

    (branch,) = trace.branches  # one exact token sequence: tool results extend the first turn
    tool_messages = [m for m in branch.messages if m.role == "tool"]
    results = [m.content if isinstance(m.content, str) else str(m.content) for m in tool_messages]
    assert len(results) == 5
    assert results[0] == "5"
    assert results[1].startswith("error: ") and "the boom tool exploded" in results[1]
    assert results[2] == "error: tool 'slow' timed out after 1 s"
    assert results[3] == "error: unknown tool 'nope'; the tools are add, boom, slow"
    assert results[4] == "error: the arguments of 'add' must be a JSON object, got list"
    caller = next(m for m in branch.messages if m.role == "assistant")
    assert [m.tool_call_id for m in tool_messages] == [c.id for c in caller.tool_calls]
    assert branch.messages[-1].content == SECOND

    rollout = rollout_from_episode(episode, version=0)
    (seq,) = rollout.branches
    ids, mask, lp = seq.token_ids, seq.mask, seq.logprobs
    sampled: set[int] = set()
    for prompt, out in calls:
        assert ids[: len(prompt) + len(out)] == prompt + out
        span = range(len(prompt), len(prompt) + len(out))
        sampled.update(span)
        assert [lp[i] for i in span] == pytest.approx(logprobs(out))
    assert {i for i, m in enumerate(mask) if m} == sampled  # the tool results (and all else) are masked out
    between = tok.decode(ids[len(calls[0][0]) + len(calls[0][1]): len(calls[1][0])])
    assert between.count("<|im_start|>tool\n<tool_response>") == 5 and "error: tool 'slow' timed out" in between


def test_the_turn_limit_ends_a_tool_loop(tok, monkeypatch):
    """The model keeps calling tools; max_turns refuses its next call and the rollout ends, kept, truncated."""
    episode, calls, _ = run_tools_episode(tok, [call("add", {"a": 1, "b": 1})] * 3, monkeypatch, max_turns=2)
    (trace,) = episode.traces
    assert len(calls) == trace.num_turns == 2 and trace.stop_condition == "max_turns"
    rollout = rollout_from_episode(episode, version=0)
    assert rollout.truncated and len(rollout.branches) == 1
    # The second call's tools never ran: nothing could read their result.
    assert [m.content for m in trace.branches[0].messages if m.role == "tool"] == ["2"]


# Each family's tool-call format, with the special tokens its tokenizer has (the tiny one gets them added).
FAMILY_CALLS = {
    "qwen3": ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', ["<tool_call>", "</tool_call>"]),
    "qwen3.5": ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
                "</function>\n</tool_call>", ["<tool_call>", "</tool_call>"]),
    "glm": ("<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key><arg_value>2</arg_value>"
            "</tool_call>", ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]),
    "deepseek-v3": ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a": 1, "b": 2}\n```'
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                    ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁sep｜>"]),
}


@pytest.mark.parametrize("family", sorted(FAMILY_CALLS))
def test_the_tool_parsers_docs_list_as_covered(family):
    """docs/orchestrator.md names these `renderers` tool parsers (`model.renderer: {name: default,
    tool_parser: ...}`) as covered: each turns its family's format into the call."""
    from renderers.parsers import get_tool_parser

    from tests.tiny_model import build_tokenizer

    text, specials = FAMILY_CALLS[family]
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    content, (parsed,) = get_tool_parser(family, tokenizer).extract(
        tokenizer.encode("Sure. " + text, add_special_tokens=False))
    assert tokenizer.decode(content).strip() == "Sure."
    assert (parsed.name, parsed.arguments, parsed.status.value) == ("add", {"a": 1, "b": 2}, "ok")
