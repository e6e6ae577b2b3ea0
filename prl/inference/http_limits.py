"""Bounds on the connections of prl's HTTP servers (the inference servers and the router): uvicorn's protocol
with a deadline for a request's headers and a cap on open connections (`BoundedHTTP`, uvicorn's `http=`).

uvicorn bounds a connection only after its first response (`timeout_keep_alive`), and a byte received cancels
even that: a connection that never completes its headers is held forever, and enough of them use up the
process's file descriptors, so accept fails and the launcher's `/health` probe goes unanswered until the
server is restarted `max_restarts` times. `limit_concurrency` is no help: it answers every request 503 while
the idle connections count, `/health` included. Here a connection must complete a request's headers within
HEADER_TIMEOUT_S of its accept (or of its previous response); and when the open connections reach the cap
(MAX_CONNECTIONS, below the descriptor limit), the oldest connection still waiting for headers is closed to
make room, so a new one (the probe) is always taken. docs/run-directory.md (Listeners) states the rule.
"""

from __future__ import annotations

import asyncio
import resource
from collections import OrderedDict

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from prl.log import Throttled, get_logger

log = get_logger(__name__)

HEADER_TIMEOUT_S = 10.0
"""How long a connection may take to complete a request's headers, from its accept or its previous response."""
MAX_CONNECTIONS = 16384
"""Open connections a server keeps at most (fewer where the descriptor limit is lower: `connection_cap`)."""
SPARE_FDS = 256
"""Descriptors left to the process itself (engine sockets, files) below its limit."""

_evictions = Throttled(log)


def connection_cap() -> int:
    """MAX_CONNECTIONS, or the process's soft descriptor limit less SPARE_FDS where that is lower (at least 16)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else min(MAX_CONNECTIONS, soft - SPARE_FDS)
    return max(16, limit)


class BoundedHTTP(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol (httptools or h11, as uvicorn picks) with the module doc's two bounds."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > connection_cap() and not self._evict_one():
            # every other connection is in a request: this one goes, and the next accept is taken again
            _evictions.warning("%d HTTP connections open, each in a request: closed a new one", len(self.connections))
            transport.close()
            return
        self._await_headers()

    def _evict_one(self) -> bool:
        """Close the oldest connection that has begun no request since it was accepted or last answered."""
        waiting = _waiting(self.server_state)
        while waiting:
            oldest, _ = waiting.popitem(last=False)
            if oldest.cycle is oldest._header_cycle and not oldest.transport.is_closing():
                _evictions.warning("%d HTTP connections open: closed the oldest one that sent no request headers",
                                   len(self.connections))
                oldest.transport.close()
                return True
        return False

    def on_response_complete(self) -> None:
        self._await_headers()  # before the pipelined next request (if any) starts and changes `cycle`
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._stop_waiting()
        self._header_cycle = self.cycle
        self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._header_deadline)
        _waiting(self.server_state)[self] = None

    def _stop_waiting(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None
        _waiting(self.server_state).pop(self, None)

    def _header_deadline(self) -> None:
        self._header_timer = None
        _waiting(self.server_state).pop(self, None)
        if self.cycle is self._header_cycle and not self.transport.is_closing():  # no request began since
            self.transport.close()


def _waiting(server_state) -> OrderedDict:
    """The server's connections waiting for request headers, oldest first (kept on uvicorn's ServerState)."""
    waiting = getattr(server_state, "prl_waiting", None)
    if waiting is None:
        waiting = server_state.prl_waiting = OrderedDict()
    return waiting
