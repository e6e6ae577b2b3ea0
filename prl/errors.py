"""The project's error types. The CLI turns these into one-line messages.

Exit codes: 2 for bad input (the user can fix the file or the flag),
1 for failures of the system (Slurm, the run, a role).
"""

from __future__ import annotations

import errno

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
"""errnos of a full disk (or a used-up quota): a role that gets one says so in one line and exits 1."""


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
