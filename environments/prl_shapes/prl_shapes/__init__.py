"""prl_shapes: count the shapes in a picture (a vision-language environment).

A single-turn verifiers (v1) environment for vision-language models: the user
turn is an `image_url` part, a PNG data URL of a generated picture (1 to 4
coloured discs and squares on white, each in its own cell of a 4 x 4 grid), and
the question "How many shapes are in the picture?". The reward is 1 when the
reply's first number (digits or a word, "three") is the count, else 0 (with
`partial: true`, a wrong number earns 1 - |number - count| / max_shapes); the
metric `answered` is the share of replies that hold a number at all. Four
classes and a short answer: chance is 0.25, and a tiny model can learn it.

    {"taskset": {"id": "prl_shapes", "split": "eval", "num_examples": 32}}

The picture is 56 x 56 pixels by default (`size`), the tiny VLM's image size
(prl/trainer/tiny_model.py `build_tiny_vlm`), so its 14-pixel cells are its
vision patches; another model's processor resizes it. Fully offline: the
pictures are drawn from a seed. The splits never share a picture: a train
picture's occupied cells sum to an even number, an eval picture's to an odd one.
"""

from __future__ import annotations

import base64
import io
import random
import re
from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field, model_validator
from verifiers.v1.types import content_text

__all__ = ["ShapesTaskset", "ShapesTask", "ShapesData", "ShapesConfig", "QUESTION", "answer_of", "draw",
           "png_data_url"]

GRID = 4
"""Cells per side: a picture holds at most GRID * GRID - 1 shapes, one per cell (a full grid has one arrangement,
which only the train split could hold)."""
COLOURS = ("red", "green", "blue", "orange", "purple")
KINDS = ("disc", "square")
QUESTION = "How many shapes are in the picture? Answer with one number."
_WORDS = {"zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
          "nine": 9, "ten": 10}
_NUMBER = re.compile(r"\d+|\b(?:" + "|".join(_WORDS) + r")\b", re.IGNORECASE)


class ShapesConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    """Which split to load: their pictures differ (even vs odd sum of the occupied cells)."""
    num_examples: int | None = None
    """Pictures to generate; default 512 (train) or 32 (eval)."""
    min_shapes: int = Field(1, ge=1, le=GRID * GRID - 1)
    """Fewest shapes in a picture."""
    max_shapes: int = Field(4, ge=1, le=GRID * GRID - 1)
    """Most shapes in a picture (each count from min_shapes to max_shapes is equally likely)."""
    size: int = Field(56, ge=4 * GRID)
    """The picture's width and height in pixels."""
    seed: int = 0
    partial: bool = False
    """Partial credit for a wrong number, by how close it is: 1 - |number - count| / max_shapes, at least 0 (no
    number: 0). A tiny random model rarely names the count; this gives its first steps a gradient."""

    @model_validator(mode="after")
    def _counts_in_order(self) -> ShapesConfig:
        if self.min_shapes > self.max_shapes:
            raise ValueError(f"min_shapes ({self.min_shapes}) is above max_shapes ({self.max_shapes})")
        return self


class ShapesData(vf.TaskData):
    count: int
    """The number of shapes: the answer."""
    cells: list[int]
    """The occupied cells, row-major in the GRID x GRID grid (0 is top left)."""
    shapes: list[str]
    """What each occupied cell holds, e.g. "red disc" (same order as `cells`)."""
    partial_over: int = 0
    """`partial`: a wrong number earns 1 - |number - count| / partial_over (0: no partial credit)."""


def answer_of(reply: str) -> int | None:
    """A reply's answer: its first number, in digits or as a word up to ten; None when it has none."""
    match = _NUMBER.search(reply)
    if match is None:
        return None
    word = match.group(0).lower()
    return _WORDS[word] if word in _WORDS else int(word)


def last_reply(trace: vf.Trace) -> str:
    """Text of the model's last reply in the trace ('' if it never answered)."""
    replies = trace.assistant_messages
    return content_text(replies[-1].content) if replies else ""


def draw(cells: list[int], shapes: list[str], size: int = 56):
    """The picture: on white, each `shapes[i]` ("red disc", "blue square") in grid cell `cells[i]`."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    pen = ImageDraw.Draw(image)
    step = size // GRID
    margin = max(1, step // 7)
    for cell, shape in zip(cells, shapes):
        colour, kind = shape.split()
        x, y = (cell % GRID) * step, (cell // GRID) * step
        box = (x + margin, y + margin, x + step - margin - 1, y + step - margin - 1)
        (pen.ellipse if kind == "disc" else pen.rectangle)(box, fill=colour)
    return image


def png_data_url(image) -> str:
    """`image` as a PNG data URL (lossless: the server decodes the very pixels that were drawn)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class ShapesTask(vf.Task[ShapesData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        answer = answer_of(last_reply(trace))
        if answer is None or not self.data.partial_over:
            return float(answer == self.data.count)
        return max(0.0, 1.0 - abs(answer - self.data.count) / self.data.partial_over)

    @vf.metric
    async def answered(self, trace: vf.Trace) -> float:
        return float(answer_of(last_reply(trace)) is not None)


class ShapesTaskset(vf.Taskset[ShapesTask, ShapesConfig]):
    def load(self) -> Iterator[ShapesTask]:
        cfg = self.config
        n = cfg.num_examples if cfg.num_examples is not None else (512 if cfg.split == "train" else 32)
        rng = random.Random(f"{cfg.seed}-{cfg.split}")
        parity = 0 if cfg.split == "train" else 1
        for i in range(n):
            count = rng.randint(cfg.min_shapes, cfg.max_shapes)
            cells = sorted(rng.sample(range(GRID * GRID), count))
            while sum(cells) % 2 != parity:  # half of the arrangements belong to each split
                cells = sorted(rng.sample(range(GRID * GRID), count))
            shapes = [f"{rng.choice(COLOURS)} {rng.choice(KINDS)}" for _ in cells]
            prompt = [vf.UserMessage(content=[
                vf.ImageUrlContentPart(image_url=vf.ImageUrlSource(url=png_data_url(draw(cells, shapes, cfg.size)))),
                vf.TextContentPart(text=QUESTION),
            ])]
            data = ShapesData(id=f"{cfg.split}-{i}", prompt=prompt, count=count, cells=cells, shapes=shapes,
                              partial_over=cfg.max_shapes if cfg.partial else 0)
            yield ShapesTask(data, cfg.task)
