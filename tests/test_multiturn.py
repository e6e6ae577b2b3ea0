"""Multi-turn rollouts train token-exactly: with prl's ChatML renderer every turn extends the tokens the
model saw and sampled before, so a rollout with environment feedback is one sequence whose loss mask
covers exactly the sampled tokens. The env is environments/prl_guess (env-driven "higher"/"lower" turns),
the engine a FakeEngine, the tokenizer the tiny ChatML one."""

from __future__ import annotations

import random

import pytest
import verifiers.v1 as vf

from prl.orchestrator.chatml import IMPORT_PATH, ChatMLRenderer
from prl.orchestrator.clients import renderer_config
from prl.orchestrator.env import load_env
from prl.orchestrator.rollouts import rollout_from_episode
from testkit.fake_engine import FakeEngine
from tests.helpers import run_one_episode

CHATML = {"name": "custom", "import_path": IMPORT_PATH}


class Script:
    """The engine's side: each request's prompt ids and the reply it got. `replies` scripts the replies'
    text (then each ends with <|im_end|>); otherwise they are random ids, which rarely decode and re-encode
    to the same ids. Logprobs differ per token, so a test can tell whose they are."""

    def __init__(self, tok, replies: list[str] | None = None, seed: int = 0):
        self.tok, self.replies, self.rng = tok, replies, random.Random(seed)
        self.end = tok.convert_tokens_to_ids("<|im_end|>")
        self.calls: list[tuple[list[int], list[int]]] = []

    def reply(self, prompt_ids: list[int]) -> list[int]:
        if self.replies is not None:
            ids = self.tok.encode(self.replies[len(self.calls)], add_special_tokens=False) + [self.end]
        else:
            ids = [self.rng.randrange(3, 400) for _ in range(self.rng.randrange(2, 9))] + [self.end]
        self.calls.append((prompt_ids, ids))
        return ids

    @staticmethod
    def logprobs(ids: list[int]) -> list[float]:
        return [-0.01 * (t % 97) - 0.001 for t in ids]


def guess_env(**limits):
    """prl_guess with one game (secret in 1..8, four guesses)."""
    return load_env("prl_guess", args={"num_examples": 1}, split="eval", **limits)


def secret() -> int:
    return next(iter(guess_env().taskset)).data.secret


def run_episode(tokenizer_dir, script: Script, renderer: dict | None, **limits):
    env = guess_env(**limits)
    task = next(iter(env.taskset))
    with FakeEngine(model="m", stop_id=script.end, reply=script.reply, logprobs=script.logprobs) as eng:
        client = vf.TrainClientConfig(base_url=eng.url + "/v1", api_key_var="PRL_TEST_NO_KEY",
                                      renderer_model_name=str(tokenizer_dir), renderer=renderer_config(renderer))
        ctx = vf.ModelContext(model="m", client=client, sampling=vf.SamplingConfig(temperature=1.0, max_tokens=16))
        episode = run_one_episode(env, task, ctx)
    assert episode.ok, episode.errors
    return episode


@pytest.mark.parametrize("seed", [0, 1])
def test_a_multi_turn_rollout_is_one_exact_token_sequence(tokenizer_dir, tok, seed):
    """Random replies (which re-tokenize differently) over four turns with env feedback: one branch; each
    turn's prompt + reply is its prefix, token for token; the mask is 1 on the replies' tokens and nowhere
    else; their logprobs are the engine's."""
    script = Script(tok, seed=seed)
    episode = run_episode(tokenizer_dir, script, CHATML)
    (trace,) = episode.traces
    assert trace.num_turns == len(script.calls) == 4  # no reply is right: the env answers three times
    assert trace.metrics["found"] == 0.0
    rollout = rollout_from_episode(episode, version=0)
    (branch,) = rollout.branches
    ids, mask, lp = branch.token_ids, branch.mask, branch.logprobs
    assert len(ids) == len(mask) == len(lp)
    sampled: set[int] = set()
    for prompt, reply in script.calls:
        assert ids[: len(prompt) + len(reply)] == prompt + reply
        span = range(len(prompt), len(prompt) + len(reply))
        sampled.update(span)
        assert [lp[i] for i in span] == pytest.approx(Script.logprobs(reply))
    assert {i for i, m in enumerate(mask) if m} == sampled
    assert all(lp[i] == 0.0 for i in range(len(lp)) if i not in sampled)
    assert rollout.completion_tokens == sum(len(r) for _, r in script.calls) and rollout.turns == 4
    unsampled = tok.decode([t for i, t in enumerate(ids) if i not in sampled])
    assert unsampled.count("<|im_start|>user\n") == 4  # the task's prompt and the env's three replies


def test_without_a_bridging_renderer_the_same_rollout_splits(tokenizer_dir, tok):
    """The control: renderers' default for an unknown model re-renders every turn, the random replies
    re-tokenize differently, and the rollout falls apart into several sequences."""
    episode = run_episode(tokenizer_dir, Script(tok, seed=0), None)
    assert len(rollout_from_episode(episode, version=0).branches) > 1


def test_re_rendering_the_conversation_gives_the_trained_ids(tokenizer_dir, tok):
    """With replies that re-tokenize to themselves, the chat template renders the finished conversation
    to the very ids trained on; the env's feedback led the model to the secret."""
    s = secret()
    script = Script(tok, replies=[str(s + 2), str(s + 1), str(s)])
    episode = run_episode(tokenizer_dir, script, CHATML)
    (trace,) = episode.traces
    assert trace.reward == pytest.approx(1 / 3) and trace.num_turns == 3
    (branch,) = trace.branches
    messages = [{"role": m.role, "content": m.content} for m in branch.messages]
    assert [m["content"] for m in messages] == [messages[0]["content"], *script.replies[:1], "Lower.",
                                                script.replies[1], "Lower.", script.replies[2]]
    template = tok.apply_chat_template(messages, tokenize=True)
    template = list(template["input_ids"] if not isinstance(template, list) else template)
    assert template == list(branch.token_ids) + tok.encode("\n", add_special_tokens=False)  # the template's last "\n"


def test_max_turns_stops_a_rollout_and_marks_it_truncated(tokenizer_dir, tok):
    script = Script(tok, replies=[str(secret() + d) for d in (4, 3, 2, 1)])
    episode = run_episode(tokenizer_dir, script, CHATML, max_turns=2)
    (trace,) = episode.traces
    assert trace.num_turns == len(script.calls) == 2 and trace.stop_condition == "max_turns"
    rollout = rollout_from_episode(episode, version=0)
    assert rollout.truncated and rollout.turns == 2 and len(rollout.branches) == 1


# -- the renderer on its own


@pytest.fixture(scope="module")
def chatml(tok):
    from renderers import CustomRendererConfig, create_renderer

    renderer = create_renderer(tok, CustomRendererConfig(import_path=IMPORT_PATH))
    assert isinstance(renderer, ChatMLRenderer)
    return renderer


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": " hello\nthere "},
]


def test_chatml_renders_what_the_chat_template_renders(chatml, tok):
    for messages in (CHAT, CHAT[1:], CHAT[:3]):
        rendered = chatml.render(messages, add_generation_prompt=True)
        template = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        assert rendered.token_ids == list(template["input_ids"] if not isinstance(template, list) else template)
    rendered = chatml.render(CHAT)
    sampled = [t for t, m in zip(rendered.token_ids, rendered.sampled_mask) if m]
    assert tok.decode(sampled) == "The answer is 5.<|im_end|>"  # the reply and its end, not the role line
    assert set(rendered.message_indices) == {0, 1, 2, 3}
    content = [t for t, c in zip(rendered.token_ids, rendered.is_content) if c]
    assert tok.decode(content) == "Be brief.What is 2 + 3?The answer is 5.<|im_end|> hello\nthere "


def test_chatml_bridges_a_turn_and_closes_a_reply_cut_by_the_token_limit(chatml, tok):
    prompt = chatml.render_ids(CHAT[:2], add_generation_prompt=True)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    cut = tok.encode("The answer", add_special_tokens=False)  # no <|im_end|>: max_tokens cut it
    bridged = chatml.bridge_to_next_turn(prompt, cut, [{"role": "user", "content": "And 3 + 4?"}])
    assert bridged.token_ids[: len(prompt) + len(cut) + 1] == prompt + cut + [end]
    assert tok.decode(bridged.token_ids[len(prompt) + len(cut):]) == (
        "<|im_end|>\n<|im_start|>user\nAnd 3 + 4?<|im_end|>\n<|im_start|>assistant\n")
    assert not any(bridged.sampled_mask)
    assert bridged.message_indices[: len(prompt) + len(cut) + 1] == [-1] * (len(prompt) + len(cut) + 1)
    assert chatml.bridge_to_next_turn(prompt, cut + [end], [{"role": "assistant", "content": "x"}]) is None


def test_chatml_parses_hermes_tool_calls_from_text(chatml, tok):
    """The tiny tokenizer has no <tool_call> token: the tags are several tokens and still parse."""
    from renderers import ToolCallParseStatus as S

    end = tok.convert_tokens_to_ids("<|im_end|>")
    text = ('Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            "<tool_call>{oops</tool_call><tool_call>[1]</tool_call><tool_call>{\"arguments\": {}}</tool_call>"
            '<tool_call>{"name": "add"')
    parsed = chatml.parse_response(tok.encode(text, add_special_tokens=False) + [end])
    assert parsed.content == "Let me add."
    assert [(c.status, c.name, c.arguments) for c in parsed.tool_calls] == [
        (S.OK, "add", {"a": 1, "b": 2}), (S.INVALID_JSON, None, None), (S.MALFORMED_STRUCTURE, None, None),
        (S.MISSING_NAME, None, {}), (S.UNCLOSED_BLOCK, None, None)]
    plain = chatml.parse_response(tok.encode(" just text ", add_special_tokens=False) + [end, 5, 6])
    assert plain.content == "just text" and plain.tool_calls == []


def test_chatml_renders_tools_and_tool_results(chatml, tok):
    tools = [{"name": "add", "description": "Add two numbers.", "parameters": {"type": "object"}}]
    messages = [
        {"role": "user", "content": "1 + 2?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    text = tok.decode(chatml.render_ids(messages, tools=tools, add_generation_prompt=True))
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '\n{"name": "add", "description": "Add two numbers.", "parameters": {"type": "object"}}\n</tools>' in text
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # What the model wrote parses back into the call it made.
    reply = chatml.render(messages[:2])
    sampled = [t for t, m in zip(reply.token_ids, reply.sampled_mask) if m]
    (call,) = chatml.parse_response(sampled).tool_calls
    assert (call.name, call.arguments) == ("add", {"a": 1, "b": 2})


def test_chatml_default_system_prompt_and_a_tokenizer_without_chatml(chatml, tok):
    from renderers import CustomRendererConfig, create_renderer

    smol = create_renderer(tok, CustomRendererConfig(import_path=IMPORT_PATH, default_system="You are SmolLM."))
    text = tok.decode(smol.render_ids([{"role": "user", "content": "hi"}], add_generation_prompt=True))
    assert text == ("<|im_start|>system\nYou are SmolLM.<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert chatml.get_stop_token_ids() == [tok.convert_tokens_to_ids("<|im_end|>")]

    class NoChatML:
        name_or_path, unk_token_id, eos_token_id = "gpt2ish", 0, 1

        def convert_tokens_to_ids(self, token):
            return 0

    with pytest.raises(ValueError, match=r"tokenizer 'gpt2ish' has no <\|im_start\|> token: it is not a ChatML model"):
        ChatMLRenderer(NoChatML())
