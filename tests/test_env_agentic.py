"""The shipped multi-turn and tool-use environments (environments/prl_guess, environments/prl_calc):
scored right on hand-written play, through `prl eval` (a FakeEngine's chat route plays), and through one
step of the orchestrator loop (the FakeEngine's generate route, prl's ChatML renderer).

Needs the env packages installed: pip install -e environments/prl_guess -e environments/prl_calc
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from tests.helpers import publish_endpoint
import verifiers.v1 as vf

from prl.orchestrator import main
from prl.orchestrator.chatml import IMPORT_PATH
from prl.orchestrator.clients import renderer_config
from prl.orchestrator.env import load_env
from prl.orchestrator.eval import evaluate_endpoint
from prl.run.batch import read_batch
from prl.run.rundir import RunDir, atomic_write_json
from testkit.fake_engine import FakeEngine
from testkit.plans import local_plan, write_plan

CHATML = {"name": "custom", "import_path": IMPORT_PATH}


def run_episodes(env, tok, tokenizer_dir, plays) -> list:
    """One episode per (task, player) in `plays`, one after the other in one `env.serving()` (tool servers
    start once), on a FakeEngine whose generate route answers `player(prompt_text)`; the ChatML renderer
    renders and parses."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    playing = []

    def reply(prompt_ids):
        return tok.encode(playing[-1](tok.decode(prompt_ids)), add_special_tokens=False) + [end]

    async def run(ctx):
        episodes = []
        async with env.serving():
            for task, player in plays:
                playing.append(player)
                episodes.append(await env.run_slot(env.slots(task, 1)[0], ctx))
        return episodes

    with FakeEngine(model="m", stop_id=end, reply=reply) as eng:
        client = vf.TrainClientConfig(base_url=eng.url + "/v1", api_key_var="PRL_TEST_NO_KEY",
                                      renderer_model_name=str(tokenizer_dir), renderer=renderer_config(CHATML))
        episodes = asyncio.run(run(vf.ModelContext(model="m", client=client,
                                                   sampling=vf.SamplingConfig(temperature=1.0, max_tokens=64))))
    assert all(e.ok for e in episodes), [e.errors for e in episodes]
    return episodes


# -- prl_guess


def halving(secret: int, high: int) -> list[int]:
    """The guesses of a player who halves the range each time."""
    lo, hi, guesses = 1, high, []
    while True:
        guesses.append((lo + hi) // 2)
        if guesses[-1] == secret:
            return guesses
        lo, hi = (guesses[-1] + 1, hi) if guesses[-1] < secret else (lo, guesses[-1] - 1)


def halving_reply(conversation: list[tuple[str, str]], high: int) -> str:
    """The halving player's next reply, from the (role, text) conversation so far."""
    lo, hi = 1, high
    for (role, text), (_, answer) in zip(conversation, conversation[1:]):
        if role == "assistant":
            guess = int(text)
            lo, hi = (guess + 1, hi) if answer.startswith("Higher") else (lo, guess - 1)
    return str((lo + hi) // 2)


def test_guess_feedback_and_scores():
    from prl_guess import feedback

    assert feedback("5", 5) is None and feedback("I say 3, or 7", 5) == "Higher." and feedback("9", 5) == "Lower."
    assert feedback("no idea", 5) == "Answer with a number."
    assert halving(1, 8) == [4, 2, 1] and halving(8, 8) == [4, 6, 7, 8]


def test_guess_scores_hand_written_play(tok, tokenizer_dir):
    """The halving player finds every secret in 1..8 within 4 guesses (reward 1/guesses); a player that
    never answers a number gets 0 after the 4 guesses the game allows."""
    env = load_env("prl_guess", args={"num_examples": 8}, split="eval")
    tasks = list(env.taskset)
    assert len({t.data.secret for t in tasks}) > 3

    def halve(prompt_text):
        turns = re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", prompt_text, re.S)
        return halving_reply([(r, t) for r, t in turns if r in ("user", "assistant")], 8)

    *halved, silent = run_episodes(env, tok, tokenizer_dir, [(t, halve) for t in tasks] + [(tasks[0], lambda _: "hmm")])
    for task, episode in zip(tasks, halved):
        (trace,) = episode.traces
        n = len(halving(task.data.secret, 8))
        assert trace.num_turns == n and trace.reward == pytest.approx(1 / n)
        assert trace.metrics == {"guesses": n, "found": 1.0}
    (trace,) = silent.traces
    assert trace.num_turns == 4 and trace.reward == 0.0 and trace.metrics == {"guesses": 4, "found": 0.0}
    said = [m.content for m in trace.branches[0].messages if m.role == "user"][1:]
    assert said == ["Answer with a number."] * 3


def test_guess_shaping_rewards_guesses_in_range(tok, tokenizer_dir):
    """valid_guess_weight adds that weight times the share of replies whose guess lies in 1..high: a player
    answering 9 then the halving guesses is rewarded for the in-range ones; off (the default), nothing is."""
    env = load_env("prl_guess", args={"num_examples": 4, "valid_guess_weight": 0.5}, split="eval")
    task = next(t for t in env.taskset if len(halving(t.data.secret, 8)) <= 3)

    def out_then_halve(prompt_text):
        turns = re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", prompt_text, re.S)
        played = [(r, t) for r, t in turns if r in ("user", "assistant")]
        if len(played) == 1:
            return "9 is my guess"
        return halving_reply([played[0]] + played[3:], 8)  # the halving player never saw the 9

    played, silent = run_episodes(env, tok, tokenizer_dir, [(task, out_then_halve), (task, lambda _: "hmm")])
    n = len(halving(task.data.secret, 8))
    (trace,) = played.traces
    assert trace.num_turns == n + 1 and trace.metrics == {"guesses": n + 1, "found": 1.0}
    assert trace.reward == pytest.approx(1 / (n + 1) + 0.5 * n / (n + 1))
    (trace,) = silent.traces
    assert trace.reward == 0.0


def test_guess_through_prl_eval():
    """`prl eval` with an OpenAI-style endpoint whose model halves the range: reward 1/guesses, exactly."""
    def chat(body):
        conversation = [(m["role"], m["content"]) for m in body["messages"] if m["role"] in ("user", "assistant")]
        return {"content": halving_reply(conversation, 8)}

    secrets = [t.data.secret for t in load_env("prl_guess", args={"num_examples": 6}, split="eval").taskset]
    with FakeEngine(model="m", chat=chat) as eng:
        stats = evaluate_endpoint("prl_guess", eng.url, "m", examples=6, args={"num_examples": 6})
    assert stats["failed_rollouts"] == 0 and stats["rollouts"] == 6
    expected = [1 / len(halving(s, 8)) for s in secrets]
    assert stats["reward_mean"] == pytest.approx(sum(expected) / 6)
    assert stats["metric/found"] == 1.0


# -- prl_calc


def test_calc_scores_hand_written_play(tok, tokenizer_dir):
    """Through the real `calc` server: a tool call then the right answer earns 1.1; the right answer
    alone 1.0; a failing tool call (an expression the tool refuses) no bonus; a wrong answer 0."""
    env = load_env("prl_calc", args={"num_examples": 4}, split="eval")
    tasks = list(env.taskset)
    answers = {t.data.prompt: t.data.answer for t in tasks}

    def question(prompt_text):
        return re.findall(r"What is ([^?]+)\?", prompt_text)[-1]

    def with_tool(prompt_text):
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt_text, re.S)
        if results:
            return f"Answer: {results[-1]}"
        call = {"name": "calc", "arguments": {"expression": question(prompt_text)}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    def broken_tool(prompt_text):
        if "<tool_response>" in prompt_text:
            return f"Answer: {answers['What is ' + question(prompt_text) + '?']}"
        return '<tool_call>\n{"name": "calc", "arguments": {"expression": "2 ** 8"}}\n</tool_call>'

    players = [
        (with_tool, 1.1, 2),
        (lambda p: f"It is {answers['What is ' + question(p) + '?']}.", 1.0, 1),
        (broken_tool, 1.0, 2),
        (lambda p: f"Answer: {answers['What is ' + question(p) + '?'] + 1}", 0.0, 1),
    ]
    plays = [(task, player) for player, _, _ in players for task in tasks[:2]]
    episodes = run_episodes(env, tok, tokenizer_dir, plays)
    for i, episode in enumerate(episodes):
        (trace,) = episode.traces
        _, reward, turns = players[i // 2]
        assert (trace.reward, trace.num_turns) == (pytest.approx(reward), turns), i
    # The tool's refusal reached the model as an error message.
    (result,) = [m.content for m in episodes[4].traces[0].tool_messages]
    assert result.startswith("error: ") and "not allowed in an expression: '2 ** 8'" in result


def test_calc_tool_evaluates_safely():
    from prl_calc.tools import evaluate

    assert evaluate("12 * (3 + 4)") == 84 and evaluate("7 / 2") == 3.5 and evaluate("-3 + 1") == -2
    for bad in ("2 ** 99999", "__import__('os')", "x + 1", "1 +"):
        with pytest.raises(ValueError):
            evaluate(bad)


def test_calc_through_prl_eval():
    """`prl eval` with an OpenAI-style endpoint that calls the tool, then answers with its result."""
    bodies: list[dict] = []

    def chat(body):
        bodies.append(body)
        last = body["messages"][-1]
        if last["role"] == "tool":
            return {"content": f"Answer: {last['content']}"}
        expression = re.findall(r"What is ([^?]+)\?", last["content"])[-1]
        return {"content": "", "tool_calls": [{"id": f"call_{len(bodies)}", "type": "function", "function": {
            "name": "calc", "arguments": json.dumps({"expression": expression})}}]}

    with FakeEngine(model="m", chat=chat) as eng:
        stats = evaluate_endpoint("prl_calc", eng.url, "m", examples=4, args={"num_examples": 4})
    assert stats["failed_rollouts"] == 0 and stats["rollouts"] == 4
    assert stats["reward_mean"] == pytest.approx(1.1)
    assert len(bodies) == 8 and [t["function"]["name"] for t in bodies[0]["tools"]] == ["calc"]
    assert bodies[0]["messages"][0]["role"] == "system" and "<tool_call>" in bodies[0]["messages"][0]["content"]


def test_calc_through_prl_eval_rendered_as_the_run_renders(tok, tokenizer_dir):
    """`prl eval --run` (render_with: the run's tokenizer and model.renderer) renders here and calls the
    token-in/token-out route, so a tool env needs no tool-call parser on the server: the engine sees the
    tool list in the prompt, its Hermes text becomes the tool call, the tool's result comes back."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts: list[str] = []

    def reply(prompt_ids):
        text = tok.decode(prompt_ids)
        prompts.append(text)
        if "<tool_response>" in text.rsplit("<|im_start|>user", 1)[-1]:
            result = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)[-1]
            out = f"Answer: {result}"
        else:
            expression = re.findall(r"What is ([^?]+)\?", text)[-1]
            out = '<tool_call>\n{"name": "calc", "arguments": {"expression": "%s"}}\n</tool_call>' % expression
        return tok.encode(out, add_special_tokens=False) + [end]

    with FakeEngine(model="m", stop_id=end, reply=reply) as eng:
        stats = evaluate_endpoint("prl_calc", eng.url, "m", examples=4, args={"num_examples": 4},
                                  render_with=str(tokenizer_dir), renderer=CHATML)
    assert stats["failed_rollouts"] == 0 and stats["rollouts"] == 4
    assert stats["reward_mean"] == pytest.approx(1.1)
    assert len(prompts) == 8 and all('"name": "calc"' in p.split("<|im_start|>user")[0] for p in prompts)


# -- one step of the orchestrator loop


@pytest.mark.parametrize("env_id", ["prl_guess", "prl_calc"])
def test_one_orchestrator_step(tmp_path, tokenizer_dir, env_id):
    """Random replies from the engine; the step publishes a batch whose loss mask covers the sampled tokens
    only, one sequence per rollout (the ChatML renderer extends each turn)."""
    run = RunDir(tmp_path / "run")
    training = {"batch_size": 4, "rollouts_per_example": 2, "max_steps": 1, "max_tokens": 12}
    plan = local_plan(run.root, tokenizer_dir, [f"environment.id={env_id}", f"model.renderer={json.dumps(CHATML)}",
                                                *(f"training.{k}={v}" for k, v in training.items())])
    write_plan(run, plan)
    eng = FakeEngine(model="local-tiny", token_ids=range(3, 400), stop_id=2, run_dir=run.root).start()
    publish_endpoint(run, "inference", 0, eng.url)
    try:
        assert main(str(run.root)) == 0
    finally:
        eng.stop()
    batch = read_batch(run.rollouts(1))
    assert batch.num_samples == 4  # one sequence per rollout
    mask, lp = batch.arrays["loss_mask"], batch.arrays["inference_logprobs"]
    assert mask.sum() > 0 and (lp[mask == 1] < 0).all() and (lp[mask == 0] == 0).all()
    (metrics,) = run.read_metrics("orchestrator")
    assert metrics["step"] == 1 and metrics["turns_mean"] >= 1.0
    if env_id == "prl_guess":  # random replies rarely guess right: the env answers, and the model goes on
        assert metrics["turns_mean"] > 1.0
