"""environments/prl_shapes, the vision environment: its prompts carry a PNG picture as an `image_url` part that
shows the task's shapes, its reward reads the reply's number, and `prl eval` sends the picture to the endpoint.
(tests/test_vlm.py runs it against the tiny VLM served by vLLM.)

Needs the env package installed: pip install --no-deps -e environments/prl_shapes
"""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
import verifiers.v1 as vf  # the env extra; CI installs it

from prl.errors import ConfigError
from prl.orchestrator.env import load_env
from prl.orchestrator.eval import evaluate_endpoint
from testkit.fake_engine import FakeEngine


def picture(url: str):
    """The PIL image in a PNG data URL."""
    from PIL import Image

    head, _, data = url.partition(",")
    assert head == "data:image/png;base64", head
    return Image.open(io.BytesIO(base64.b64decode(data)), formats=["PNG"])


def occupied_cells(image) -> list[int]:
    """The grid cells whose centre pixel is not white: what a perfect counter sees."""
    from prl_shapes import GRID

    step = image.width // GRID
    centres = [((c % GRID) * step + step // 2, (c // GRID) * step + step // 2) for c in range(GRID * GRID)]
    return [c for c, xy in enumerate(centres) if image.convert("RGB").getpixel(xy) != (255, 255, 255)]


def image_and_question(task) -> tuple[str, str]:
    """The task's one user turn: its image part's URL and its text."""
    (message,) = task.data.prompt
    assert message.role == "user"
    image, text = message.content
    assert isinstance(image, vf.ImageUrlContentPart) and isinstance(text, vf.TextContentPart)
    return image.image_url.url, text.text


def score(task, reply: str) -> tuple[float, dict]:
    """The task's reward and metrics for a finished trace whose one model turn is `reply`."""
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    trace = vf.Trace(
        task=TraceTask(type=type(task).__name__, data=task.data),
        agent=AgentInfo(config=vf.AgentConfig()),
        nodes=[MessageNode(message=task.data.prompt[0]),
               MessageNode(message=vf.AssistantMessage(content=reply), sampled=True, parent=0)],
    )
    asyncio.run(task.score(trace))
    return trace.reward, dict(trace.metrics)


def test_shapes_prompts_carry_a_png_of_the_shapes_with_disjoint_seeded_splits():
    from prl_shapes import QUESTION

    train = list(load_env("prl_shapes", args={"num_examples": 64}, split="train").taskset)
    ev = list(load_env("prl_shapes", split="eval").taskset)
    assert type(train[0]).__module__ == "prl_shapes" and len(ev) == 32
    for task in train + ev:
        url, text = image_and_question(task)
        assert text == QUESTION
        image = picture(url)
        assert image.size == (56, 56)  # the tiny VLM's image size: no resizing
        assert occupied_cells(image) == task.data.cells and task.data.count == len(task.data.cells)
    assert {t.data.count for t in train} == {1, 2, 3, 4}
    train_urls = {image_and_question(t)[0] for t in train}
    eval_urls = {image_and_question(t)[0] for t in ev}
    assert len(train_urls) == 64 and len(eval_urls) == 32 and not train_urls & eval_urls
    again = load_env("prl_shapes", args={"num_examples": 64}, split="train").taskset
    assert [image_and_question(t)[0] for t in again] == [image_and_question(t)[0] for t in train]
    other_seed = load_env("prl_shapes", args={"num_examples": 64, "seed": 1}, split="train").taskset
    assert [image_and_question(t)[0] for t in other_seed] != [image_and_question(t)[0] for t in train]


def test_shapes_args_reach_the_taskset_and_bad_ones_say_which():
    tasks = list(load_env("prl_shapes", args={"num_examples": 8, "min_shapes": 5, "max_shapes": 6, "size": 112},
                          split="eval").taskset)
    assert {t.data.count for t in tasks} <= {5, 6} and picture(image_and_question(tasks[0])[0]).size == (112, 112)
    with pytest.raises(ConfigError, match=r"min_shapes \(5\) is above max_shapes \(4\)"):
        load_env("prl_shapes", args={"min_shapes": 5}, split="eval")
    with pytest.raises(ConfigError, match="max_shapes"):
        load_env("prl_shapes", args={"max_shapes": 16}, split="eval")  # a full grid has no eval arrangement


def test_shapes_scores_the_replys_first_number():
    from prl_shapes import answer_of

    tasks = {t.data.count: t for t in load_env("prl_shapes", args={"num_examples": 32}, split="eval").taskset}
    three = tasks[3]
    assert score(three, "3") == (1.0, {"answered": 1.0})
    assert score(three, "There are three shapes.")[0] == 1.0
    assert score(three, "Three")[0] == 1.0
    assert score(three, "4") == (0.0, {"answered": 1.0})
    assert score(three, "3 or 4? I say 4")[0] == 1.0  # the first number is the answer
    assert score(three, "someone drew 4")[0] == 0.0  # "one" inside a word is no number
    assert score(three, "") == (0.0, {"answered": 0.0})
    assert score(tasks[1], "1")[0] == 1.0 and score(tasks[1], "2")[0] == 0.0
    assert [answer_of(r) for r in ("12 shapes", "TWO", "none", "x7y")] == [12, 2, None, 7]


def test_shapes_through_prl_eval_sends_the_picture():
    """`prl eval` against an OpenAI-style endpoint whose "model" counts the occupied cells of the picture it is
    sent: every answer is right, so the image part reaches the endpoint whole."""
    sent = []

    def chat(body):
        (message,) = body["messages"]
        image, text = message["content"]
        assert image["type"] == "image_url" and text["type"] == "text"
        sent.append(image["image_url"]["url"])
        return {"content": f"There are {len(occupied_cells(picture(image['image_url']['url'])))} shapes."}

    tasks = list(load_env("prl_shapes", args={"num_examples": 8}, split="eval").taskset)
    with FakeEngine(model="m", chat=chat) as eng:
        stats = evaluate_endpoint("prl_shapes", eng.url, "m", examples=8, args={"num_examples": 8})
    assert stats["failed_rollouts"] == 0 and stats["rollouts"] == 8
    assert stats["reward_mean"] == 1.0 and stats["metric/answered"] == 1.0
    assert sorted(sent) == sorted(image_and_question(t)[0] for t in tasks)
