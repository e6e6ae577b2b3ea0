"""A test taskset with a shared MCP toolset: `add` works, `boom` raises, `slow` outlasts a short
`tool_timeout`. verifiers starts the toolset once per eval as `python -m tests.tools_env` (the
subprocess runtime), so `tests` must be importable from the environment's PYTHONPATH.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import verifiers.v1 as vf

__all__ = ["ToolsTaskset", "TestTools"]

SLOW_S = 30.0
"""How long `slow` sleeps: far past the test's tool_timeout."""


class TestTools(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the tools are called by their bare names

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @vf.tool
    async def boom(self) -> str:
        """Always fails."""
        raise RuntimeError("the boom tool exploded")

    @vf.tool
    async def slow(self) -> str:
        """Takes far too long."""
        await asyncio.sleep(SLOW_S)
        return "finally"


class ToolsTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self) -> Iterator[vf.Task]:
        yield vf.Task(vf.TaskData(id="tools-0", prompt="What is 2 + 3? Use the tools."), self.config.task)

    @classmethod
    def toolsets(cls, config: vf.TasksetConfig) -> list[vf.Toolset]:
        return [TestTools(vf.SharedToolsetConfig())]


if __name__ == "__main__":
    TestTools.run()
