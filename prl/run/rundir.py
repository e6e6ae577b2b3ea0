"""The run directory: the one place that knows its layout, and the one object every role and command holds.

Every role (inference, orchestrator, trainer) and the control plane share a run only through this directory,
on a shared filesystem; nothing else joins path pieces under a run. `RunDir` is made of one part per concern,
each a module of its own:

    prl/run/layout.py     RunLayout    every path of the run (the layout drawn there), and their parsing
    prl/run/files.py      -            atomic writes, fsyncs, the STABLE marker check (`is_stable`)
    prl/run/publish.py    Publishing   publishing a step atomically, waiting for one, listing and removing them
    prl/run/retention.py  Retention    cleanup after each step, and the pins and holds it keeps
    prl/run/handoffs.py   Handoffs     the typed records processes hand each other (prl/run/records.py)
    here                  RunDir       making the directory, a new attempt's reset, the launcher's disk reserve

It imports no torch: login nodes import it. The names other modules import from here (`atomic_write_json`,
`is_stable`, `MARKER`, `current_attempt`, `API_KEY_VAR`, `HEARTBEAT_S`, ...) are the parts' own.
"""

from __future__ import annotations

import os
import shutil

from prl.run.files import (DIR_MODE, FILE_MODE, MARKER, PENDING_MARKER, atomic_write_bytes, atomic_write_json,
                           atomic_write_text, current_attempt, fsync_tree, is_stable, pid_alive, step_of,
                           verify_stable)
from prl.run.handoffs import API_KEY_VAR, GENERATION_KEY_VAR, HEARTBEAT_S, Handoffs
from prl.run.layout import KINDS, ROLES
from prl.run.retention import Retention

__all__ = ["API_KEY_VAR", "DIR_MODE", "FILE_MODE", "GENERATION_KEY_VAR", "HEARTBEAT_S", "KINDS", "LOW_DISK_BYTES",
           "MARKER", "PENDING_MARKER", "RESERVE_BYTES", "ROLES", "RunDir", "atomic_write_bytes", "atomic_write_json",
           "atomic_write_text", "current_attempt", "fsync_tree", "is_stable", "pid_alive", "step_of",
           "verify_stable"]

RESERVE_BYTES = 4 << 20
"""The launcher's disk reserve (state/reserve): room to record a failure and stop the roles on a full disk."""
LOW_DISK_BYTES = 1 << 20
"""Less free than this under the run directory is a full disk (`RunDir.disk_low`)."""


class RunDir(Handoffs, Retention):
    """Paths and protocols of one run directory. Constructing it touches nothing on disk; `create()` makes the
    skeleton."""

    def create(self) -> RunDir:
        """Make the top-level directories (idempotent); the run directory is private to its owner (0700)."""
        self.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        if self.root.stat().st_mode & 0o777 != DIR_MODE:
            self.root.chmod(DIR_MODE)
        for d in (self.scripts_dir, self.logs_dir, self.state_dir, *(self.root / k for k in KINDS)):
            d.mkdir(mode=DIR_MODE, exist_ok=True)
        return self

    def make_reserve(self, size: int | None = None) -> bool:
        """Write the reserve (zeros, really allocated); False when the disk has no room for it."""
        size = RESERVE_BYTES if size is None else size
        try:
            with open(self.reserve, "wb") as f:
                for _ in range(size // (1 << 20)):
                    f.write(bytes(1 << 20))
                f.write(bytes(size % (1 << 20)))
                f.flush()
                os.fsync(f.fileno())
            return True
        except OSError:
            self.reserve.unlink(missing_ok=True)
            return False

    def release_reserve(self) -> int:
        """Delete the reserve; the bytes given back (0 when there was none)."""
        try:
            size = self.reserve.stat().st_size
            self.reserve.unlink()
            return size
        except FileNotFoundError:
            return 0

    def disk_low(self) -> bool:
        """Less than LOW_DISK_BYTES free under the run directory (False when the filesystem cannot be asked)."""
        free = self.free_bytes()
        return free is not None and free < LOW_DISK_BYTES

    def free_bytes(self) -> int | None:
        """Bytes free to this user on the run directory's filesystem (None if it cannot be asked)."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def reset_attempt_state(self) -> None:
        """Forget an earlier attempt's readiness markers and endpoints before a new attempt starts."""
        for sub in ("ready", "endpoints", "preflight", "exits", "errors", "beats", "stop"):
            shutil.rmtree(self.state_dir / sub, ignore_errors=True)
        self.stop_request.unlink(missing_ok=True)
        for kind in KINDS:
            base = self.root / kind
            if base.is_dir():
                for tmp in base.glob(".step_*.tmp-*"):
                    shutil.rmtree(tmp, ignore_errors=True)
