"""The in-process fast path: what the `prl` harness saves of verifiers' per-model-call CPU.

A single-turn rollout through verifiers 0.4.0 as shipped cost the orchestrator 13-20 ms of CPU, 0.35x of
that with these (`bench/bench_rollout_cpu.py`, docs/orchestrator.md). Three costs in it are not the work
itself, and prl removes them in every process that runs its harness (the orchestrator, and each env worker
of `orchestrator.env_workers`):

    pydantic default factories   verifiers builds each trace node with `model_construct`; pydantic 2.13/2.14
                                 then asks `inspect.signature` of every unset field's `default_factory`
                                 (`list`: a parse of its text signature, ~0.2 ms) on every call. The answer
                                 depends on the factory alone, so it is cached here.
    the engine call              verifiers' train client posts to the engine's generate route through the
                                 OpenAI SDK (httpx): request building, auth hooks and httpcore's pool cost
                                 more CPU than the rest of the model call. `PrlTrainClient` posts the same
                                 body over prl's pooled aiohttp session, with the SDK's errors.
    the interception hop         the harness runs in the interception server's own process, so its model
                                 call need not cross a localhost HTTP connection: `local_call` hands the
                                 request to the server's own handler (the same checks, trace records and
                                 retry guard), in a task of its own as aiohttp would run it.

Nothing else changes: the same renderer renders the same messages, so the token ids, masks and logprobs
are those of verifiers' path (tests/test_fastpath.py compares them turn by turn). `install()` runs
when a `PrlHarness` is built (an env load builds one before any interception server starts);
`parts(())` restores verifiers' path as shipped, which the benchmark measures as its baseline.
The hooks are checked against the pinned versions (verifiers 0.4.0): another version gets verifiers'
own path and a warning, not a guess.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prl.log import get_logger

log = get_logger(__name__)

VERIFIERS_VERSION = "0.4.0"
"""The verifiers release whose interception server and train client these hooks were written against."""

PARTS = ("factory_cache", "engine_http", "local_call")
"""The fast path's parts, each installed by the hook of that name below."""

_wanted: set[str] = set(PARTS)
_installed: dict[str, Callable[[], None]] = {}
"""Installed parts, each with the function that restores what it replaced."""
_servers: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
"""Interception servers started in this process, by their base URL."""


def install() -> None:
    """Put the fast path in place in this process (idempotent; only the parts `parts` selected)."""
    if _wanted <= _installed.keys():
        return
    import verifiers

    if verifiers.__version__ != VERIFIERS_VERSION:
        log.warning("verifiers %s is not %s: the prl harness uses verifiers' own model-call path",
                    verifiers.__version__, VERIFIERS_VERSION)
        _wanted.clear()
        return
    for part in PARTS:
        if part in _wanted and part not in _installed:
            _installed[part] = _HOOKS[part]()


def uninstall() -> None:
    """Restore verifiers' and pydantic's own functions."""
    while _installed:
        _installed.popitem()[1]()


@contextlib.contextmanager
def parts(selected: Iterable[str]) -> Iterator[None]:
    """Within the block, only the `selected` parts of the fast path are in place (none: verifiers' path as
    shipped, the benchmark's baseline); restored after. An interception server keeps the client it was
    built with, so enter the block before `env.serving()`."""
    before_wanted, before_installed = set(_wanted), set(_installed)
    unknown = set(selected) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown fast path parts {sorted(unknown)}; the parts are {', '.join(PARTS)}")
    uninstall()
    _wanted.clear()
    _wanted.update(selected)
    install()
    try:
        yield
    finally:
        uninstall()
        _wanted.clear()
        _wanted.update(before_wanted)
        if before_installed:
            install()


def _factory_cache() -> Callable[[], None]:
    from pydantic._internal import _fields

    original = _fields.takes_validated_data_argument
    _fields.takes_validated_data_argument = _cached_factory_check(original)

    def undo() -> None:
        _fields.takes_validated_data_argument = original

    return undo


def _engine_http() -> Callable[[], None]:
    from verifiers.v1.interception import server as interception

    original = interception.resolve_client

    def resolve_client(config: Any) -> Any:
        from verifiers.v1.configs.client import TrainClientConfig

        if isinstance(config, TrainClientConfig):
            from prl.orchestrator.engine_client import PrlTrainClient

            return PrlTrainClient(config)
        return original(config)

    interception.resolve_client = resolve_client

    def undo() -> None:
        interception.resolve_client = original

    return undo


def _local_call() -> Callable[[], None]:
    from verifiers.v1.interception.server import InterceptionServer

    original = InterceptionServer.start

    @functools.wraps(original)
    async def start(self) -> None:
        await original(self)
        _servers[self.base_url] = self

    InterceptionServer.start = start

    def undo() -> None:
        InterceptionServer.start = original
        _servers.clear()

    return undo


_HOOKS: dict[str, Callable[[], Callable[[], None]]] = {
    "factory_cache": _factory_cache, "engine_http": _engine_http, "local_call": _local_call}


def _cached_factory_check(check):
    """pydantic's `takes_validated_data_argument`, answered once per default factory."""
    cached = functools.lru_cache(maxsize=4096)(check)

    @functools.wraps(check)
    def takes_validated_data_argument(default_factory):
        try:
            return cached(default_factory)
        except TypeError:  # an unhashable callable
            return check(default_factory)

    return takes_validated_data_argument


def local_server(endpoint: str) -> Any | None:
    """The interception server in this process behind a harness `endpoint` (`{base_url}/v1`), or None
    (the fast path is off, or the server is elsewhere: reach it over HTTP)."""
    if "local_call" not in _installed:
        return None
    return _servers.get(endpoint.rstrip("/").removesuffix("/v1"))


class _LocalRequest(dict):
    """What the interception handler reads of an aiohttp request, for a call that never left the process:
    headers, the body, the path, and per-request storage (the dict itself, as `web.Request` is a mapping)."""

    def __init__(self, path: str, headers: dict[str, str], body: bytes):
        super().__init__()
        self.path = path
        self.headers = headers
        self._read_bytes: bytes | None = body
        self._body = body
        self.content_length = len(body)

    async def read(self) -> bytes:
        return self._body


CHAT_ROUTE = "/v1/chat/completions"


async def local_call(server: Any, secret: str, body: dict) -> tuple[int, bytes]:
    """One chat-completions call handled by `server`'s own handler without HTTP: (status, response body).
    The handler runs in a task of its own, as aiohttp runs it: the session adopts that task (a concluded
    rollout cancels it) and not the caller's."""
    from pydantic_core import to_json
    from verifiers.v1.dialects import DIALECTS

    dialect = next(d for d in DIALECTS if CHAT_ROUTE in d.routes)
    request = _LocalRequest(CHAT_ROUTE, {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"},
                            to_json(body))
    response = await asyncio.ensure_future(server._handler_for(dialect)(request))
    return response.status, bytes(response.body or b"")
