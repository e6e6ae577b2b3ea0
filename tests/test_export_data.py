"""An evaluation's rollouts kept as records (`prl eval --records`), read with `prl rollouts FILE`, and the good ones
exported as SFT data (`prl export-data`) that prl's SFT reader takes as it is, tool turns included. Against the real
verifiers environment (prl_calc, which calls a tool) through `prl eval`'s own client and the stand-in engine."""

from __future__ import annotations

import json
import os
import re

import pytest

from prl.ops.export_data import choose, messages_of
from prl.run.records import RolloutRecord, ToolCallText, Turn
from testkit.fake_engine import FakeEngine
from tests.helpers import prl_cli

HERMES = (  # ChatML with tool calls rendered as Hermes' <tool_call> blocks (as Qwen's templates do)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def calc_chat(body):
    """Calls the tool, then answers with its result on even tasks and wrongly on odd ones."""
    last = body["messages"][-1]
    if last["role"] == "tool":
        expression = re.findall(r"What is ([^?]+)\?", body["messages"][1]["content"])[-1]
        wrong = sum(map(ord, expression)) % 2
        return {"content": "Answer: 123456789" if wrong else f"Answer: {last['content']}"}
    expression = re.findall(r"What is ([^?]+)\?", last["content"])[-1]
    return {"content": "", "tool_calls": [{"id": f"call_{abs(hash(expression)) % 1000}", "type": "function",
                                           "function": {"name": "calc",
                                                        "arguments": json.dumps({"expression": expression})}}]}


@pytest.fixture(scope="module")
def records_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "calc.json"
    with FakeEngine(model="m", chat=calc_chat) as eng:
        done = prl_cli(dict(os.environ), "eval", "prl_calc", "--base-url", eng.url, "--model", "m", "-n", "6",
                       "--arg", "num_examples=6", "--records", out)
    assert f"wrote {out}: 6 rollout record(s)" in done.stdout, done.stdout
    return out


def test_an_eval_keeps_every_rollout_readable(records_file):
    from prl.ops.rollouts import RecordsFile

    sample = RecordsFile(records_file).sample
    assert sample.step == 0 and sample.rollouts == 6 and len(sample.records) == 6
    assert {r.fate for r in sample.records} == {"evaluated"} and {r.env for r in sample.records} == {"prl_calc"}
    rewards = sorted(r.reward for r in sample.records)
    assert rewards[0] < rewards[-1], rewards  # some answered right, some wrong
    for r in sample.records:
        roles = [t.role for t in r.conversation]
        assert roles[-3:] == ["assistant", "tool", "assistant"], roles
        assert r.conversation[-3].tool_calls[0].name == "calc" and r.conversation[-2].tool_call_id.startswith("call_")
    shown = prl_cli(dict(os.environ), "rollouts", records_file, "--sort", "worst", "--limit", "2").stdout
    assert shown.count("prl_calc: reward") == 2 and "-> calc(" in shown and "[evaluated]" in shown, shown


def test_the_good_rollouts_export_as_sft_data_with_their_tool_turns(records_file, tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    from prl.ops.rollouts import RecordsFile
    from prl.trainer.sft_data import read_conversations, tokenize_conversation

    best = max(r.reward for r in RecordsFile(records_file).sample.records)
    out = tmp_path / "good.jsonl"
    done = prl_cli(dict(os.environ), "export-data", records_file, "--min-reward", best, "-o", out)
    passed = sum(r.reward >= best for r in RecordsFile(records_file).sample.records)
    assert f"wrote {out}: {passed} of 6 rollout(s) (left out: {6 - passed} below --min-reward)" in done.stdout, done
    conversations = list(read_conversations(out))
    assert len(conversations) == passed
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = HERMES
    for messages in conversations:
        call = next(m for m in messages if m.get("tool_calls"))
        answer = next(m for m in messages if m["role"] == "tool")
        assert call["tool_calls"][0]["id"] == answer["tool_call_id"] and call["tool_calls"][0]["function"]["name"] == "calc"
        sample = tokenize_conversation(tok, messages, max_tokens=4096)
        trained = tok.decode([t for t, m in zip(sample.token_ids, sample.loss_mask) if m])
        assert '<tool_call>\n{"name": "calc"' in trained and "Answer:" in trained, trained


def test_nothing_to_export_is_one_line_and_no_file(records_file, tmp_path):
    out = tmp_path / "none.jsonl"
    done = prl_cli(dict(os.environ), "export-data", records_file, "--min-reward", 99, "-o", out, check=False)
    assert done.returncode != 0 and "Traceback" not in done.stderr and not out.exists()
    (line,) = done.stderr.strip().splitlines()
    assert "no rollout to write, nothing written: 0 of 6 rollout(s) (left out: 6 below --min-reward)" in line, line


def rec(group, reward, *, fate="evaluated", **kw) -> RolloutRecord:
    conversation = kw.pop("conversation", [Turn(role="user", text="q"), Turn(role="assistant", text="a")])
    return RolloutRecord(group=group, index=0, env="e", reward=reward, fate=fate, conversation=conversation, **kw)


def test_what_is_left_out_and_why_and_the_best_of_each_task():
    records = [(1, rec(0, 0.2)), (1, rec(0, 0.9)), (1, rec(0, 0.7)), (1, rec(1, 1.0, truncated=True)),
               (1, rec(1, 1.0, error="boom", fate="failed")), (1, rec(2, 1.0, clipped=True)),
               (2, rec(0, 1.0, conversation=[Turn(role="user", text="q", pictures=1), Turn(role="assistant")])),
               (2, rec(1, 1.0, conversation=[Turn(role="user", text="q")])), (2, rec(2, 0.6))]
    kept, skipped = choose(records, 0.5, best_per_task=True)
    assert [r.reward for r in kept] == [0.9, 0.6]
    assert skipped == {"below --min-reward": 1, "not the best of its task": 1, "truncated": 1, "failed": 1,
                       "text cut to the record's bound": 1, "has pictures": 1, "no assistant turn": 1}
    every, _ = choose(records, 0.5, best_per_task=False)
    assert [r.reward for r in every] == [0.9, 0.7, 0.6]


def test_tool_calls_take_the_ids_their_answers_carry():
    turns = [Turn(role="user", text="q"),
             Turn(role="assistant", text="", reasoning="think", tool_calls=[ToolCallText(name="f", arguments="{}"),
                                                                            ToolCallText(name="g", arguments="1")]),
             Turn(role="tool", text="r1", tool_call_id="c1"), Turn(role="tool", text="r2", tool_call_id="c2"),
             Turn(role="assistant", text="done", tool_calls=[ToolCallText(name="h", arguments="{}")])]
    messages = messages_of(rec(0, 1.0, conversation=turns))
    assert [c.get("id") for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[1]["reasoning_content"] == "think" and messages[2]["tool_call_id"] == "c1"
    assert messages[4]["tool_calls"] == [{"type": "function", "function": {"name": "h", "arguments": "{}"}}]


def test_the_sft_reader_refuses_a_malformed_tool_call_at_its_line(tmp_path):
    from prl.trainer.sft_data import DataError, read_conversations

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                                                               "tool_calls": [{"function": {}}]}]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: messages\[1\].tool_calls\[0\]: expected"):
        list(read_conversations(bad))
