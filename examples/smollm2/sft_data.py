"""Write SFT demonstrations for a shipped environment: chat `messages` JSONL from its TRAIN split,
the assistant turns being a correct solution.

    python examples/smollm2/sft_data.py prl_reverse_text runs/data/reverse-sft.jsonl [--examples 400]
    python examples/smollm2/sft_data.py prl_calc runs/data/calc-sft.jsonl [--call-only]

- `prl_reverse_text`: the reply is the reversed text.
- `prl_calc`: a tool-use conversation: a `calc` call on the task's expression, the tool's result, and
  `Answer: N`. The system turn holds the task's system prompt and the tool list exactly as prl's
  ChatML renderer writes them in an RL rollout (the schema is the one the `calc` MCP server lists).
  With `--call-only` a demonstration ends at the tool call: SFT teaches the call's format, and what to
  do with the result is left for RL to learn (docs/recipes/smollm2-calc.md).

The prompt is built the way the RL run builds it (the env loaded through prl; the `prl` harness
emits a task's system prompt, if any, as a system message and its prompt as the user turn), so SFT
and RL see the same conversation. Only the train split is read: the held-out eval split that the
recipes score on stays unseen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from pathlib import Path


def reverse_text(task) -> list[dict]:
    # As PrlHarness.launch sends it (APPENDS_SYSTEM_PROMPT: a system prompt stays its own turn).
    system = [{"role": "system", "content": task.data.system_prompt}] if task.data.system_prompt else []
    return system + [{"role": "user", "content": task.data.prompt},
                     {"role": "assistant", "content": task.data.text[::-1]}]


def _calc_tools() -> list[dict]:
    """The `calc` tool's schema exactly as the harness sends it: the tool server started as verifiers starts
    it (`python -m prl_calc.tools`), listed through verifiers' MCP client."""
    import contextlib
    import subprocess
    import tempfile
    import time

    from verifiers.v1.harnesses.utils.mcp import connect_mcp

    async def listed(url: str) -> list[dict]:
        async with contextlib.AsyncExitStack() as stack:
            tools, _, _ = await connect_mcp({"mcpServers": {"": {"url": url, "timeout": 30}}}, stack)
            return tools

    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        server = subprocess.Popen([sys.executable, "-m", "prl_calc.tools"], env={**os.environ, "MCP_PORT_FILE": str(port_file)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 300  # its imports took over 60 s on two loaded cores
            while not (port_file.is_file() and port_file.read_text().strip()):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("error: the calc tool server (python -m prl_calc.tools) did not start")
                time.sleep(0.1)
            port = int(port_file.read_text())
            deadline = time.monotonic() + 60
            while True:
                try:
                    return asyncio.run(listed(f"http://127.0.0.1:{port}/mcp"))
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        finally:
            server.terminate()
            server.wait(10)


def calc(task, tools: list[dict], call_only: bool) -> list[dict]:
    from prl.orchestrator.chatml import system_with_tools, tool_call_text, tool_response_text
    from prl_calc import evaluate

    expression = re.fullmatch(r"What is (.+)\?", task.data.prompt).group(1)
    value = evaluate(expression)
    call = [{"role": "system", "content": system_with_tools(task.data.system_prompt, tools)},
            {"role": "user", "content": task.data.prompt},
            {"role": "assistant", "content": tool_call_text("calc", {"expression": expression})}]
    if call_only:
        return call
    return call + [{"role": "tool", "content": tool_response_text(str(value))},
                   {"role": "assistant", "content": f"Answer: {value}"}]


def demonstrations(env_id: str, examples: int, call_only: bool = False) -> list[dict]:
    from prl.orchestrator.env import load_env

    env = load_env(env_id, split="train")
    if env_id == "prl_calc":
        tools = _calc_tools()
        return [{"messages": calc(task, tools, call_only)} for task in env.taskset.take(examples)]
    return [{"messages": reverse_text(task)} for task in env.taskset.take(examples)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("env", choices=["prl_reverse_text", "prl_calc"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--examples", type=int, default=400, help="demonstrations (the first N train tasks)")
    parser.add_argument("--call-only", action="store_true",
                        help="prl_calc: end each demonstration at the tool call (RL learns to use the result)")
    args = parser.parse_args()
    if args.call_only and args.env != "prl_calc":
        parser.error("--call-only is for prl_calc (the only tool-use environment)")
    rows = demonstrations(args.env, args.examples, args.call_only)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, args.out)
    print(f"wrote {args.out} ({len(rows)} demonstrations from the {args.env} train split)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
