"""prl_letters: answer with one letter, as many times as you like.

A toy verifiers (v1) environment with a dense reward, made so that a tiny
randomly initialised model learns it within a few RL steps on CPU: the reward
is the fraction of the reply's non-space characters that are the asked-for
letter (0 for an empty reply). Prompts differ by a filler word so tasks are
distinct; the train and eval splits use disjoint filler words.

    {"taskset": {"id": "prl_letters", "split": "eval", "num_examples": 32}}

Fully offline: the tasks are generated from a seed, nothing is downloaded.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf
from verifiers.v1.types import content_text

__all__ = ["LettersTaskset", "LettersTask", "LettersData", "LettersConfig", "letter_fraction", "last_reply"]

_WORDS = (
    "apple river stone cloud maple tiger lemon ocean piano candle forest silver "
    "rocket garden marble window copper meadow falcon harbor violet thunder pepper "
    "canyon lantern orbit willow ember glacier saddle quartz bramble comet velvet "
    "puzzle anchor cedar dune ferry hazel igloo jasper kettle lotus mango nectar "
    "olive pebble quill raven sparrow tulip umber vessel walnut yarrow zephyr"
).split()

_TEMPLATES = (
    "({word}) Reply with the letter {letter}, as many times as you can.",
    "({word}) Answer using only the letter {letter}.",
    "({word}) Write the letter {letter} over and over.",
    "({word}) Say {letter}. Only {letter}.",
)


class LettersConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    """Which split to load: the two use disjoint filler words."""
    letters: str = "a"
    """Letters the tasks ask for (one per task, cycling)."""
    num_examples: int | None = None
    """Tasks to generate; default 512 (train) or 32 (eval)."""
    seed: int = 0


class LettersData(vf.TaskData):
    letter: str
    """The letter the reply should consist of."""


def last_reply(trace: vf.Trace) -> str:
    """Text of the model's last reply in the trace ('' if it never answered)."""
    replies = trace.assistant_messages
    return content_text(replies[-1].content) if replies else ""


def letter_fraction(reply: str, letter: str) -> float:
    """Fraction of the reply's non-whitespace characters equal to `letter` (case-insensitive)."""
    chars = [c for c in reply.lower() if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c == letter.lower() for c in chars) / len(chars)


class LettersTask(vf.Task[LettersData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def letter_fraction(self, trace: vf.Trace) -> float:
        return letter_fraction(last_reply(trace), self.data.letter)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(last_reply(trace)))


class LettersTaskset(vf.Taskset[LettersTask, LettersConfig]):
    def load(self) -> Iterator[LettersTask]:
        cfg = self.config
        # Even-indexed words are train fillers, odd-indexed ones eval: the splits never share a prompt.
        words = _WORDS[0::2] if cfg.split == "train" else _WORDS[1::2]
        n = cfg.num_examples if cfg.num_examples is not None else (512 if cfg.split == "train" else 32)
        rng = random.Random(f"{cfg.seed}-{cfg.split}")
        letters = cfg.letters or "a"
        for i in range(n):
            letter = letters[i % len(letters)]
            prompt = rng.choice(_TEMPLATES).format(word=rng.choice(words), letter=letter)
            yield LettersTask(
                LettersData(id=f"{cfg.split}-{i}", prompt=prompt, letter=letter), cfg.task
            )
