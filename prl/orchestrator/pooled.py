"""One pooled aiohttp session per event loop, for the model calls rollouts make (the harness's, the engine's).

aiohttp, not httpx: httpcore's pool rescans every connection on each request event, which at a few
hundred concurrent rollouts cost more CPU than the rest of the orchestrator.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

_sessions: dict[int, tuple[aiohttp.ClientSession, Any]] = {}
"""Per event loop: its pooled session and the async generator that closes it when the loop ends."""


async def session() -> aiohttp.ClientSession:
    """The running loop's pooled session (a session is bound to its loop).

    The session closes when its loop ends, wherever the loop is ours or not (an env worker process of
    `orchestrator.env_workers` runs verifiers' server loop): `asyncio.run` finalizes the loop's async
    generators before it closes, and one of them owns the session."""
    key = id(asyncio.get_running_loop())
    current, _ = _sessions.get(key, (None, None))
    if current is None or current.closed:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
        current = aiohttp.ClientSession(connector=connector)
        owner = _closes_at_loop_end(key, current)
        await owner.__anext__()  # now suspended; the loop's shutdown_asyncgens resumes it into `finally`
        _sessions[key] = (current, owner)  # held here: a collected generator would close the session at once
    return current


async def _closes_at_loop_end(key: int, current: aiohttp.ClientSession):
    try:
        yield
    finally:
        _sessions.pop(key, None)
        await current.close()
