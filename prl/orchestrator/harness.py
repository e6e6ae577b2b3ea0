"""The `prl` harness: a chat loop that runs inside the orchestrator's process.

verifiers' built-in harnesses each start a program per rollout (`null` starts
one Python process and runs `uv sync` at run time, which fails offline; about
1 rollout/s on two cores). `Harness.launch` is documented to allow an
in-process loop as long as every model call goes to the rollout's
interception `endpoint` with its `secret`: the interception server then
records the call on the trace, and with the train client the engine's token
ids, sampled mask and logprobs. This harness does exactly that: one chat
completion per turn over a shared HTTP connection pool, and returns a
synthetic successful `ProgramResult`.

Each launch is one model turn (the envs in `environments/` are single-turn);
an env that adds user turns gets them through the default `resume()`, which
relaunches on the accumulated conversation. No tools (MCP) yet.

verifiers resolves a harness id by importing a top-level module that exports
one `Harness` subclass in `__all__`; `register()` installs this module under
`HARNESS_ID` in `sys.modules`, which is enough for an in-process env.
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult

__all__ = ["PrlHarness", "PrlHarnessConfig"]

HARNESS_ID = "prl_harness"
"""The id under which `register()` makes this harness loadable by verifiers."""


class PrlHarnessConfig(vf.HarnessConfig):
    id: str = HARNESS_ID
    request_timeout: float = 600.0
    """Seconds one model call may take (the interception may queue it behind a pause)."""


_sessions: dict[int, aiohttp.ClientSession] = {}


def _session() -> aiohttp.ClientSession:
    """One pooled session per event loop (a session is bound to its loop). aiohttp, not httpx:
    httpcore's pool rescans every connection on each request event, which at a few hundred
    concurrent rollouts cost more CPU than the rest of the orchestrator."""
    loop = asyncio.get_running_loop()
    session = _sessions.get(id(loop))
    if session is None or session.closed:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
        session = _sessions[id(loop)] = aiohttp.ClientSession(connector=connector)
    return session


class PrlHarness(vf.Harness[PrlHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

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
        # Sampling (temperature, max_tokens) is the interception's to apply from ctx.sampling.
        async with _session().post(
            f"{endpoint.rstrip('/')}/chat/completions",
            headers={"Authorization": f"Bearer {secret}"},
            json={"model": ctx.model, "messages": messages},
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout),
        ) as resp:
            if resp.status >= 400:
                # A refused turn (limit, @stop) is an expected end; the trace records why.
                if trace.stop_condition is not None:
                    return ProgramResult(exit_code=0, stdout="", stderr="")
                text = await resp.text()
                return ProgramResult(exit_code=1, stdout="", stderr=f"model call failed: HTTP {resp.status}: {text[:500]}")
            payload = await resp.json(content_type=None)
        choice = (payload.get("choices") or [{}])[0]
        content = (choice.get("message") or {}).get("content") or ""
        return ProgramResult(exit_code=0, stdout=content, stderr="")


async def close_sessions() -> None:
    """Close this event loop's pooled session (call before the loop ends)."""
    session = _sessions.pop(id(asyncio.get_running_loop()), None)
    if session is not None:
        await session.close()


def register() -> str:
    """Make this harness loadable as `HARNESS_ID` (in this process) and return the id."""
    sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
    return HARNESS_ID
