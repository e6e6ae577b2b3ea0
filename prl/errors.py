"""The project's error types. The CLI turns these into one-line messages.

Exit codes: 2 for bad input (the user can fix the file or the flag),
1 for failures of the system (Slurm, the run, a role), 128 + N for a process
that ended on signal N (`signal_exit`: 143 for SIGTERM, 130 for Ctrl-C).
"""

from __future__ import annotations

import errno
import importlib
import signal
import sys
from collections.abc import Callable
from types import ModuleType

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
"""errnos of a full disk (or a used-up quota): a role that gets one says so in one line and exits 1."""


def signal_exit(signum: int) -> int:
    """The exit code of a process that ends on signal `signum`: the shell's 128 + N."""
    return 128 + signum


def child_exit(returncode: int) -> int:
    """A child's exit code as the shell reports it: Popen's -N (killed by signal N) becomes `signal_exit(N)`."""
    return signal_exit(-returncode) if returncode < 0 else returncode


def disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_FULL


def disk_full_message(exc: OSError) -> str:
    return f"the run directory's disk is full: {exc.strerror} ({exc.filename or 'a write'})"


class PrlError(Exception):
    """Base of every error prl reports without a traceback."""

    exit_code = 1


class ConfigError(PrlError):
    """Bad user input: a topology, a cluster profile, an override, a flag."""

    exit_code = 2


class PlanError(ConfigError):
    """The topology is well-formed but cannot be placed on the cluster."""


class SlurmError(PrlError):
    """A Slurm command failed; the message carries Slurm's own words."""


class SlurmUnavailable(SlurmError):
    """Slurm could not be asked (no binaries, controller unreachable): state unknown."""


class RunDirError(PrlError):
    """The run directory is not in the state an operation needs (clash, missing step)."""


class StepTimeout(RunDirError):
    """A role waited longer than its limit for another role's step."""


class StartError(PrlError):
    """Something a role starts did not come up: it exited before it was ready (the environment worker pool, an
    evaluation server), or did not come within its start limit (StartTimeout)."""


class StartTimeout(StartError):
    """What a start waits for (another role's endpoint, the worker pool's address, a server's /health) did not
    come within its limit."""


class StaleReload(PrlError):
    """A server cannot take a weight update: vLLM's reload left trained weights at their old values. Raised in a
    vLLM worker; its one message pickles across vLLM's RPC as it is."""


class FeedError(PrlError):
    """A weight feed (prl/weights/feed.py) could not hand over a step: refused, gone, or cut mid-stream."""

    def __init__(self, address: str, reason: str):
        super().__init__(f"weight feed {address}: {reason}")
        self.address = address
        self.reason = reason

    def __reduce__(self):  # crosses process boundaries (a vLLM worker's RPC error)
        return FeedError, (self.address, self.reason)


def needs_extra(module: str, extra: str, command: str) -> ModuleType:
    """`module`, imported; ConfigError naming the extra that installs it when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{command} needs the {module} package: pip install 'prl[{extra}]'") from None


def one_line(text: str) -> str:
    """`text` on one line, whatever user text it quotes: newlines and terminal escapes are shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def run_entry(prog: str | None, body: Callable[[], int | None],
              record: Callable[[str], object] | None = None) -> int:
    """The one place an entry point's errors become messages; returns the process's exit code.

    `body()`'s own code (None is 0). A PrlError is one line on stderr (`PROG: error: message`, or
    `error: message` for the `prl` command itself) and its exit code (2 bad input, 1 failure); a full
    disk is one line and 1; Ctrl-C is `interrupted` and 130. Anything else is a bug: its traceback goes on.
    A role's process passes `record` (`RunDir.write_role_error`): a PrlError's line goes there too, where the
    launcher, `prl status` and `prl submit --local` find it (a parent such as torchrun passes on only a code).
    """
    def say(message: str) -> None:
        print(f"{prog}: error: {one_line(message)}" if prog else f"error: {one_line(message)}",
              file=sys.stderr, flush=True)

    try:
        return body() or 0
    except PrlError as e:
        say(str(e))
        if record is not None:
            try:
                record(one_line(str(e)))
            except OSError as exc:  # deliberate: the line is on stderr already, the exit code still tells
                say(f"cannot record this error in the run directory: {exc.strerror or exc}")
        return e.exit_code
    except OSError as e:
        if not disk_full(e):
            raise
        say(disk_full_message(e))
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted" if prog else "interrupted", file=sys.stderr, flush=True)
        return signal_exit(signal.SIGINT)
