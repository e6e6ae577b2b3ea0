"""prl_guess: guess a number; the environment answers "Higher." or "Lower." until it is found.

A multi-turn verifiers (v1) environment whose extra turns come from the
environment, not a simulated user: `GuessEnv.run` opens the conversation with
the task's prompt and answers each reply through `interaction.turn(feedback)`.
The reward is 1/guesses when the number is found within `max_guesses`, else 0:
dense enough that finding it sooner pays. A reply's first integer is its guess
(a reply without one is told to answer with a number, and counts as a guess).
`valid_guess_weight` adds a shaping reward, off by default: that weight times
the share of the game's replies whose guess lies in 1..high (a random tiny
model rarely finds the number, but it soon learns to answer one in range).

    {"taskset": {"id": "prl_guess", "split": "eval", "num_examples": 32, "high": 8}}

Fully offline: the secrets are drawn from a seed. Train and eval prompts differ
by their game number (disjoint ranges).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf

__all__ = ["GuessEnv", "GuessEnvConfig", "GuessTaskset", "GuessTask", "GuessData", "GuessConfig", "feedback", "guess_of"]

_EVAL_GAMES = 100_000
"""Eval games are numbered from here, train games from 0: the splits never share a prompt."""


class GuessConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    """Which split to load: their prompts (game numbers) are disjoint."""
    num_examples: int | None = None
    """Games to generate; default 512 (train) or 32 (eval)."""
    high: int = 8
    """The secret is drawn from 1..high."""
    max_guesses: int = 4
    """Guesses before the environment gives up (4 find any secret in 1..8 by halving)."""
    seed: int = 0
    valid_guess_weight: float = 0.0
    """Weight of the shaping reward `valid_guess`: the share of replies whose guess lies in 1..high (0: off)."""


class GuessData(vf.TaskData):
    secret: int
    """The number to find."""


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    pass


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> Iterator[GuessTask]:
        cfg = self.config
        n = cfg.num_examples if cfg.num_examples is not None else (512 if cfg.split == "train" else 32)
        first = 0 if cfg.split == "train" else _EVAL_GAMES
        rng = random.Random(f"{cfg.seed}-{cfg.split}")
        for i in range(n):
            prompt = (f"Game {first + i}: I think of a number from 1 to {cfg.high}. "
                      "Guess it: answer with one number. I will say higher or lower.")
            yield GuessTask(GuessData(id=f"{cfg.split}-{i}", prompt=prompt, secret=rng.randint(1, cfg.high)), cfg.task)


def guess_of(reply: str) -> int | None:
    """A reply's guess: its first integer, None when it has none."""
    numbers = re.findall(r"\d+", reply)
    return int(numbers[0]) if numbers else None


def feedback(reply: str, secret: int) -> str | None:
    """What the environment says to a reply; None when its first integer is the secret."""
    guess = guess_of(reply)
    if guess is None:
        return "Answer with a number."
    if guess == secret:
        return None
    return "Higher." if guess < secret else "Lower."


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task: GuessTask, agents) -> None:
        cfg = self.taskset.config
        limit = cfg.max_guesses
        guesses, valid, found = 0, 0, False
        async with agents.agent.interaction(task) as talk:
            segment = await talk.turn()  # the prompted task opens the conversation
            while not segment.terminated:  # a turn or token limit ends the game early
                guesses += 1
                valid += int(1 <= (guess_of(segment.last_reply) or 0) <= cfg.high)
                said = feedback(segment.last_reply, task.data.secret)
                if said is None or guesses == limit:
                    found = said is None
                    break
                segment = await talk.turn(said)
        talk.trace.record_reward("found_in", 1.0 / guesses if found else 0.0, 1.0)
        if cfg.valid_guess_weight:
            talk.trace.record_reward("valid_guess", valid / max(guesses, 1), cfg.valid_guess_weight)
        talk.trace.record_metric("guesses", float(guesses))
        talk.trace.record_metric("found", float(found))
