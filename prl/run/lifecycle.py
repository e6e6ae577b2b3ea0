"""A runtime role's start and end in its state file (state/<role>.json), written one way for every role.

    with role_lifecycle(run, "orchestrator") as outcome:
        outcome.code = serve_the_role()
    return outcome.code

On the way in the role is claimed (unless the role claims it later itself, as the trainer's rank 0
does once the ranks are up); on the way out its exit is recorded: `outcome.code` when the body
returns, 1 with `Type: message` when it raises (the exception goes on). Only the process that holds
the role (its pid in the state file) records the exit, so a trainer rank other than 0, or a process
that lost the claim to a live holder, never overwrites the holder's record.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prl.run.rundir import RunDir


@dataclass
class RoleOutcome:
    """What the role's body sets: its exit code (1 until it says otherwise)."""

    code: int = 1


@contextmanager
def role_lifecycle(run: RunDir, role: str, *, claim: bool = True) -> Iterator[RoleOutcome]:
    """Claim `role` (when `claim`), run the body, record the role's exit if this process holds it."""
    if claim:
        run.claim(role)
    outcome, error = RoleOutcome(), None
    try:
        yield outcome
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        if holds_role(run, role):
            run.mark_exit(role, outcome.code if error is None else 1, error)


def holds_role(run: RunDir, role: str) -> bool:
    """True when this process is the role's claimed holder (its pid is in state/<role>.json)."""
    if not run.state_dir.exists():
        return False
    state = run.read_state(role)
    return state is not None and state.pid == os.getpid()
