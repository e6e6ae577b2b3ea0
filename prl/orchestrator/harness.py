"""The `prl` harness: a chat loop that runs inside the orchestrator's process.

verifiers' built-in harnesses each start a program per rollout (`null` starts
one Python process and runs `uv sync` at run time, which fails offline; about
1 rollout/s on two cores). `Harness.launch` is documented to allow an
in-process loop as long as every model call goes to the rollout's
interception `endpoint` with its `secret`: the interception server then
records the call on the trace, and with the train client the engine's token
ids, sampled mask and logprobs. This harness does exactly that, and returns a
synthetic successful `ProgramResult`. The server runs in this process, so the
call goes straight to its handler (prl/orchestrator/fastpath.py: no localhost
HTTP); a server elsewhere is reached over one pooled HTTP client.

Tools: a task's MCP toolsets (`Task.toolsets`, `Taskset.toolsets`) arrive as
`mcp_urls`; their schemas go to the model as the request's `tools` (the
renderer writes them into the chat template and parses the reply's tool calls),
each call runs with `tool_timeout`, and its result, or an "error: ..." line,
goes back as a `tool` message. A launch ends on a reply without tool calls, or
when the interception refuses a call because a limit (max_turns, ...) stopped
the rollout. An env that adds user turns gets them through the default
`resume()`, which relaunches on the accumulated conversation.

verifiers resolves a harness id by importing a top-level module that exports
one `Harness` subclass in `__all__`: this one's is `prl_harness` (the package
`prl_harness/`, importable in env worker processes too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import connect_mcp, mcp_content_to_chat_content
from verifiers.v1.runtimes import ProgramResult

from prl.orchestrator import fastpath
from prl.orchestrator.pooled import session

__all__ = ["PrlHarness", "PrlHarnessConfig"]

HARNESS_ID = "prl_harness"
"""The id verifiers loads this harness by (the top-level package `prl_harness` re-exports it)."""


class PrlHarnessConfig(vf.HarnessConfig):
    id: str = HARNESS_ID
    request_timeout: float = 600.0
    """Seconds one model call may take (the interception may queue it behind a pause)."""


MCP_CONNECT_TIMEOUT = 60.0
"""Seconds to connect to a rollout's tool servers and list their tools."""


class PrlHarness(vf.Harness[PrlHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    SUPPORTS_MCP = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    def __init__(self, config: PrlHarnessConfig):
        super().__init__(config)
        fastpath.install()  # before the env serves: its interception servers take the fast path's client

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
    ) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(message_to_wire(m) for m in prompt)
        async with contextlib.AsyncExitStack() as stack:
            tools, dispatch, servers = await self._connect(mcp_urls, stack)
            while True:
                reply = await self._complete(ctx, trace, endpoint, secret, messages, tools)
                if isinstance(reply, ProgramResult):
                    return reply
                calls = reply.get("tool_calls") or []
                # A limit that this reply reached (max_turns, ...) refuses the next call: skip its tools.
                if not calls or trace.stop_condition is not None:
                    return ProgramResult(exit_code=0, stdout=reply.get("content") or "", stderr="")
                messages.append(reply)
                for call in calls:
                    function = call.get("function") or {}
                    name = function.get("name") or ""
                    content = await self._call_tool(name, function.get("arguments"), dispatch, servers)
                    messages.append({"role": "tool", "tool_call_id": call.get("id") or "", "name": name,
                                     "content": content})

    async def _connect(self, mcp_urls: dict[str, str], stack: contextlib.AsyncExitStack):
        """The tool schemas (OpenAI `tools`), the name -> (server, tool) map and the connections; closed with
        `stack`."""
        if not mcp_urls:
            return [], {}, {}
        spec = {"mcpServers": {name: {"url": url, "timeout": self.config.tool_timeout}
                               for name, url in mcp_urls.items()}}
        return await asyncio.wait_for(connect_mcp(spec, stack), MCP_CONNECT_TIMEOUT)

    async def _complete(self, ctx: vf.ModelContext, trace: vf.Trace, endpoint: str, secret: str,
                        messages: list[dict], tools: list[dict]) -> dict | ProgramResult:
        """One model call: the reply message, or the ProgramResult that ends the launch."""
        # Sampling (temperature, max_tokens) is the interception's to apply from ctx.sampling.
        body: dict = {"model": ctx.model, "messages": messages}
        if tools:
            body["tools"] = tools
        status, payload = await self._post(endpoint, secret, body)
        if status >= 400:
            # A refused turn (limit, @stop) is an expected end; the trace records why.
            if trace.stop_condition is not None:
                return ProgramResult(exit_code=0, stdout="", stderr="")
            text = payload.decode(errors="replace")
            return ProgramResult(exit_code=1, stdout="", stderr=f"model call failed: HTTP {status}: {text[:500]}")
        choice = (json.loads(payload).get("choices") or [{}])[0]
        return {"role": "assistant", **(choice.get("message") or {})}

    async def _post(self, endpoint: str, secret: str, body: dict) -> tuple[int, bytes]:
        """POST `body` to the interception's chat route: (status, response body). In-process when the server
        is this process's (`fastpath.local_call`), else over HTTP."""
        server = fastpath.local_server(endpoint)
        if server is not None:
            async with asyncio.timeout(self.config.request_timeout):
                return await fastpath.local_call(server, secret, body)
        async with (await session()).post(
            f"{endpoint.rstrip('/')}/chat/completions",
            headers={"Authorization": f"Bearer {secret}"},
            json=body,
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout),
        ) as resp:
            return resp.status, await resp.read()

    async def _call_tool(self, name: str, arguments: Any, dispatch: dict, servers: dict) -> str | list:
        """A tool's result, or "error: ..." for the model to read: a bad call or a failing tool is the
        model's to see and correct, not the end of the rollout."""
        try:
            args = json.loads(arguments or "{}") if isinstance(arguments, str) else arguments
        except json.JSONDecodeError as e:
            return f"error: invalid JSON in the arguments of {name!r} ({e}); resend the call with valid JSON"
        if not isinstance(args, dict):
            return f"error: the arguments of {name!r} must be a JSON object, got {type(args).__name__}"
        if name not in dispatch:
            return f"error: unknown tool {name!r}; the tools are {', '.join(sorted(dispatch)) or 'none'}"
        server, tool = dispatch[name]
        timeout = self.config.tool_timeout
        try:
            # MCPConnection retries a failed call with back-off; wait_for bounds the whole of it.
            result = await asyncio.wait_for(servers[server].run(lambda client: client.call_tool(tool, args)), timeout)
        except asyncio.TimeoutError:
            return f"error: tool {name!r} timed out after {timeout:g} s"
        except Exception as e:  # noqa: BLE001 - the connection failed for good: the model hears why
            return f"error: tool {name!r} failed: {type(e).__name__}: {e}"
        content = mcp_content_to_chat_content(result.content)
        # An exception inside the tool comes back as an error result, not as an exception.
        return f"error: {content}" if result.is_error and isinstance(content, str) else content
