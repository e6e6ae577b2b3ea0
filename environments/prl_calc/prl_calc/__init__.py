"""prl_calc: arithmetic with a calculator tool.

A tool-use verifiers (v1) environment: each task is an expression such as
`37 * 14 - 5`; the model may call the `calc` tool (an MCP server shared by all
rollouts, `prl_calc/tools.py`) and ends with `Answer: N`. The system prompt pins
the Hermes tool-call format that prl's ChatML renderer parses (and Qwen3's):

    <tool_call>
    {"name": "calc", "arguments": {"expression": "37 * 14 - 5"}}
    </tool_call>

Reward: 1 when the last integer of the final reply is the value, plus 0.1 when
some tool call returned a result (not an error), a nudge towards the tool.

    {"taskset": {"id": "prl_calc", "split": "eval", "num_examples": 32}}

Fully offline: the expressions are drawn from a seed. The splits are disjoint:
train expressions start with an even number, eval ones with an odd one.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf
from verifiers.v1.types import content_text

from prl_calc.tools import CalcTools, evaluate

__all__ = ["CalcTaskset", "CalcTask", "CalcData", "CalcConfig", "CalcTools", "SYSTEM_PROMPT", "final_number"]

SYSTEM_PROMPT = (
    "You have a calculator tool, `calc`. To use it, reply with exactly\n"
    '<tool_call>\n{"name": "calc", "arguments": {"expression": "12 * (3 + 4)"}}\n</tool_call>\n'
    "and you will get its result. When you know the value, reply with `Answer: <number>`."
)


class CalcConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    """Which split to load: train expressions start with an even number, eval ones with an odd one."""
    num_examples: int | None = None
    """Tasks to generate; default 512 (train) or 32 (eval)."""
    operands: int = 3
    """Numbers in each expression (2..99 each, joined by + - *)."""
    seed: int = 0
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    """Where the `calc` server runs (default: a local subprocess; `url` for one already running)."""


class CalcData(vf.TaskData):
    answer: int
    """The expression's value."""


def final_number(reply: str) -> int | None:
    """The last integer in `reply` (None if there is none)."""
    numbers = re.findall(r"-?\d+", reply)
    return int(numbers[-1]) if numbers else None


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        return float(bool(replies) and final_number(content_text(replies[-1].content) or "") == self.data.answer)

    @vf.reward(weight=0.1)
    async def used_tool(self, trace: vf.Trace) -> float:
        results = [content_text(m.content) for m in trace.tool_messages]
        return float(any(not r.startswith("error:") for r in results))


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self) -> Iterator[CalcTask]:
        cfg = self.config
        n = cfg.num_examples if cfg.num_examples is not None else (512 if cfg.split == "train" else 32)
        rng = random.Random(f"{cfg.seed}-{cfg.split}")
        parity = 0 if cfg.split == "train" else 1
        for i in range(n):
            numbers = [2 * rng.randint(1, 49) + parity] + [rng.randint(2, 99) for _ in range(cfg.operands - 1)]
            expression = str(numbers[0])
            for x in numbers[1:]:
                expression += f" {rng.choice('+-*')} {x}"
            data = CalcData(id=f"{cfg.split}-{i}", prompt=f"What is {expression}?", system_prompt=SYSTEM_PROMPT,
                            answer=int(evaluate(expression)))
            yield CalcTask(data, cfg.task)

    @classmethod
    def toolsets(cls, config: CalcConfig) -> list[vf.Toolset]:
        return [CalcTools(config.tools)]
