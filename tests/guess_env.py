"""A multi-turn test environment with environment feedback: guess a number, told "higher" or "lower".

The env (not the model) drives the turns through `interaction.turn(feedback)`, the way verifiers v1
envs add user turns. Reward 1 when the number is found. Load it with
`load_env("tests.guess_env")` (a dotted id is aliased to `guess_env`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import verifiers.v1 as vf

__all__ = ["GuessEnv", "GuessEnvConfig", "GuessTaskset"]


class GuessConfig(vf.TasksetConfig):
    num_examples: int = 4
    high: int = 8


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    pass


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> Iterator[GuessTask]:
        high = self.config.high
        for i in range(self.config.num_examples):
            prompt = f"I think of a number from 1 to {high}. Guess it: answer with one number."
            yield GuessTask(GuessData(id=f"guess-{i}", prompt=prompt, secret=1 + (3 * i) % high), self.config.task)


def feedback(reply: str, secret: int) -> str | None:
    """What the env says to a guess; None when it is right."""
    numbers = re.findall(r"\d+", reply)
    if not numbers:
        return "Answer with a number."
    guess = int(numbers[0])
    if guess == secret:
        return None
    return "Higher." if guess < secret else "Lower."


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    rounds: int = 3
    """Feedback turns the env gives before it gives up."""


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        found = False
        async with agents.agent.interaction(task) as talk:
            segment = await talk.turn()  # the prompted task opens the conversation
            for _ in range(self.config.rounds):
                if segment.terminated:
                    break
                said = feedback(segment.last_reply, task.data.secret)
                if said is None:
                    found = True
                    break
                segment = await talk.turn(said)
            else:
                found = not segment.terminated and feedback(segment.last_reply, task.data.secret) is None
        talk.trace.record_reward("found", float(found), 1.0)
