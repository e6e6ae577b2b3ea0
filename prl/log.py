"""One logging setup for every prl process (torchtitan's `init_logger`).

Each process that runs inside a job (the launcher, a role's task, a vLLM server, the router,
the orchestrator, a trainer rank) calls `init_logging(role, task)` once at its start; modules
log through `get_logger(__name__)`. Every line names the process, so the launcher's log and
the rank logs read alike and grep alike:

    [prl launcher] 2026-12-01 08:40:00 INFO started inference (1 task(s))
    [prl inference.0] 2026-12-01 08:40:02 INFO preflight on n1 (attempt 1, pid 4242)

User-facing output of `prl status/logs/plan` is not logging: those commands print.
Imports nothing of prl: every layer may use it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

ROOT = "prl"
"""The logger every prl module's logger descends from; `init_logging` configures it."""

DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class _Stdout(logging.StreamHandler):
    """Writes to whatever `sys.stdout` is when a record comes (a test may capture it), flushed per line."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:
        pass


def line_format(role: str, task: int | None = None) -> str:
    """The `logging` format of this process's lines: `[prl ROLE.TASK] time LEVEL message`."""
    name = role if task is None else f"{role}.{task}"
    return f"[prl {name}] %(asctime)s %(levelname)s %(message)s"


def init_logging(role: str, task: int | None = None, level: str | int | None = None) -> logging.Logger:
    """Send the `prl` loggers' records to stdout, one flushed line each, tagged `role.task`.

    Idempotent: a second call keeps the one handler and only updates its tag and level.
    Level: `level`, else $PRL_LOG_LEVEL, else INFO. Records do not propagate to the root
    logger, so a library's `basicConfig` (vLLM's, uvicorn's) never doubles them.
    """
    logger = logging.getLogger(ROOT)
    handler = next((h for h in logger.handlers if isinstance(h, _Stdout)), None)
    if handler is None:
        handler = _Stdout()
        logger.addHandler(handler)
    handler.setFormatter(logging.Formatter(line_format(role, task), DATE_FORMAT))
    level = level or os.environ.get("PRL_LOG_LEVEL") or logging.INFO
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    logger.propagate = False
    return logger


def get_logger(name: str) -> logging.Logger:
    """The logger of module `name` (a `prl.` name, so `init_logging` applies to it)."""
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")


class Throttled:
    """Warnings through `logger`, at most one per `every_s` seconds; the next one says how many were left out.
    For what a peer can cause on every connection (a refused key, a malformed request): one line, not a log
    filled at the peer's pace."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self._logger, self._every_s = logger, every_s
        self._lock = threading.Lock()
        self._next = 0.0
        self._skipped = 0

    def warning(self, msg: str, *args: object) -> bool:
        """Log `msg % args` unless a line went out less than `every_s` ago; returns whether it did."""
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                self._skipped += 1
                return False
            self._next, skipped, self._skipped = now + self._every_s, self._skipped, 0
        if skipped:
            msg, args = msg + " (and %d more like it in the last %g s)", (*args, skipped, self._every_s)
        self._logger.warning(msg, *args)
        return True
