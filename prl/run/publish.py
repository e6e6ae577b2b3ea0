"""Publishing a step, and waiting for one: the hand-off protocol every role's steps go through (`Publishing`).

Hand-off protocol (`publish_dir`): write into a hidden temporary sibling (`.step_N.tmp-a<attempt>-<tag>`),
write the marker (every file and its size) into it as `.STABLE.pending`, fsync every file and directory,
rename the directory to its final name, then rename the pending marker to `STABLE` and fsync both
directories. A temporary dir never holds a `STABLE` marker (a reader handed its path must not take it for a
step), and the marker can only become `STABLE` inside the directory it describes. A reader accepts a step
only when the marker exists and every file it lists is there with its size (`is_stable`), so a writer killed
(or out of disk) at any point leaves a hidden temp dir or an unmarked step dir, both ignored by readers and
removed by the next publish of that step by a writer of the same or a later job attempt (never an earlier
one: a stale writer is fenced off), or by cleanup (prl/run/retention.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prl.errors import RunDirError, StepTimeout
from prl.run import records
from prl.log import get_logger
from prl.run.files import (FILE_MODE, MARKER, PENDING_MARKER, _fence, _fsync_dir, current_attempt, fsync_tree,
                           is_stable, step_of, verify_stable)
from prl.run.handoffs import HEARTBEAT_S
from prl.run.layout import KINDS, RunLayout
from prl.run.records import StableMarker

log = get_logger(__name__)

VERIFY_TRIES = 3
"""Reads of a published step's marker and files before `verify_step` reports it unreadable."""
VERIFY_RETRY_S = 5.0
"""Seconds between those reads: an ESTALE or EIO of a network filesystem usually passes within them."""


class Publishing(RunLayout):
    """A run's steps: which are published, publishing one atomically, waiting for one, removing them."""

    def steps(self, kind: str) -> list[int]:
        """All step numbers that have a directory of `kind`, stable or not, ascending."""
        base = self.root / kind
        if kind not in KINDS:
            raise RunDirError(f"unknown step kind {kind!r}; expected one of {', '.join(KINDS)}")
        if not base.is_dir():
            return []
        return sorted(step for p in base.iterdir() if (step := step_of(p)) is not None)

    def stable_steps(self, kind: str, role: str | None = None) -> list[int]:
        """Published (STABLE) steps of `kind`, ascending. Checkpoints: of `role` (default trainer)."""
        return [s for s in self.steps(kind) if is_stable(self._published(kind, s, role))]

    def latest_stable(self, kind: str, role: str | None = None) -> int | None:
        steps = self.stable_steps(kind, role)
        return steps[-1] if steps else None

    def verify_step(self, kind: str, step: int, role: str | None = None, *, tries: int | None = None,
                    retry_s: float | None = None) -> bool:
        """`verify_stable` of step `step` of `kind` (checkpoints: of `role`), read again up to `tries` times
        (VERIFY_TRIES), `retry_s` apart (VERIFY_RETRY_S), while it cannot be verified; then its RunDirError
        (naming the file) propagates."""
        tries = VERIFY_TRIES if tries is None else tries
        retry_s = VERIFY_RETRY_S if retry_s is None else retry_s
        path, attempt = self._published(kind, step, role), 1
        while True:
            try:
                return verify_stable(path)
            except RunDirError as e:
                if attempt >= tries:
                    raise RunDirError(f"{e}; read {attempt} time(s), {retry_s:g} s apart. Nothing was removed: "
                                      f"restore the file, or name an older step to resume from") from e
                attempt += 1
                log.warning("%s; reading it again in %g s (%d of %d)", e, retry_s, attempt, tries)
                time.sleep(retry_s)

    def latest_published(self, kind: str, role: str | None = None, *, tries: int | None = None,
                         retry_s: float | None = None) -> int | None:
        """The newest published step of `kind`, for a decision that removes what is newer (a resume). Judged
        newest first by `verify_step`: an unmarked step is passed over (never published); one with a marker
        that cannot be verified raises, never passed over for an older one (whose resume would remove it)."""
        for step in reversed(self.steps(kind)):
            if self.verify_step(kind, step, role, tries=tries, retry_s=retry_s):
                return step
        return None

    def begin_publish(self, dest: Path, tag: str | None = None) -> Path:
        """Return a fresh, empty temporary dir to fill before `finish_publish(dest, tmp)`.

        Several ranks writing one directory (a sharded checkpoint) pass the same
        `tag` so they agree on the temp name; only one of them calls this, then
        the others wait on a barrier. The temp name carries this job attempt
        (`.step_N.tmp-a<attempt>-<tag>`): leftovers of earlier attempts (whose
        processes are gone) are removed, another writer's dir of this or a later
        attempt never is. Raises RunDirError if `dest` is already published
        (another run or attempt got there first) or a later attempt writes it
        (this writer is stale: fenced off).
        """
        dest = Path(dest)
        if verify_stable(dest):  # and a marked step that cannot be verified is never removed here: it raises
            raise RunDirError(
                f"{dest} is already published (has {MARKER}); another run or attempt wrote this step. "
                f"Resume from a checkpoint (which removes later steps) or use a new run directory."
            )
        attempt = current_attempt()
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.tmp-a{attempt}-{tag or f'{socket.gethostname()}-{os.getpid()}'}"
        for old in dest.parent.glob(f".{dest.name}.tmp-*"):
            owner = _fence(old.name)
            if owner is not None and owner > attempt:
                raise RunDirError(
                    f"{old} belongs to attempt {owner}, later than this writer's attempt {attempt}: this process "
                    f"outlived its job attempt and must not publish {dest}."
                )
            if owner is None or owner < attempt or old == tmp:
                shutil.rmtree(old, ignore_errors=True)  # a dead writer's leftovers: never visible to readers
        # An unmarked step dir is a removal cut short (marker first, then files) or a publish cut short between
        # its two renames: never anyone's work.
        if dest.exists():
            shutil.rmtree(dest)
        tmp.mkdir()
        return tmp

    def finish_publish(self, dest: Path, tmp: Path, *, step: int | None = None, samples: int | None = None) -> Path:
        """Write the marker (files and sizes) into `tmp` as PENDING_MARKER, fsync it all, rename `tmp` to
        `dest`, then the pending marker to STABLE (the module doc's protocol): only a directory under its
        final name ever holds STABLE, and only the marker written for it (a `StableMarker`, with the step it
        publishes and, for rollouts, its samples)."""
        dest = Path(dest)
        if (tmp / MARKER).exists():
            shutil.rmtree(tmp, ignore_errors=True)  # unpublishable, and no reader may find a marked temp dir
            raise RunDirError(f"{tmp / MARKER}: a directory being published holds a {MARKER} marker (copied "
                              f"from a published step?); the publish writes its own")
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        marker = StableMarker(files=files, time=time.time(), host=socket.gethostname(), pid=os.getpid(),
                              attempt=current_attempt(), step=step, samples=samples)
        with open(os.open(tmp / PENDING_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "w") as f:
            f.write(json.dumps(records.encode(marker), indent=2, sort_keys=True) + "\n")
        fsync_tree(tmp)
        try:
            os.rename(tmp, dest)
            os.rename(dest / PENDING_MARKER, dest / MARKER)
        except OSError as e:
            raise RunDirError(f"cannot publish {dest}: another writer created or removed it meanwhile ({e})") from e
        _fsync_dir(dest)
        _fsync_dir(dest.parent)
        return dest

    def publish_dir(self, dest: Path, write: Callable[[Path], Any], *, step: int | None = None,
                    samples: int | None = None) -> Path:
        """Publish a directory atomically: `write(tmp_dir)` fills it, then it becomes `dest` + STABLE.

        If `write` raises, the temp dir is removed and nothing is published.
        """
        tmp = self.begin_publish(dest)
        try:
            write(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self.finish_publish(dest, tmp, step=step, samples=samples)

    def wait_for_step(
        self,
        kind: str,
        step: int,
        timeout: float,
        heartbeat: Callable[[], Any] | None = None,
        *,
        poll: float = 0.5,
        heartbeat_every: float = HEARTBEAT_S,
        role: str | None = None,
    ) -> Path:
        """Block until step `step` of `kind` is published; return its directory.

        Calls `heartbeat()` at start and every `heartbeat_every` seconds while
        waiting, so the waiter never looks hung. Raises StepTimeout after `timeout` s.
        """
        dest = self._published(kind, step, role)
        start = last_beat = time.monotonic()
        if heartbeat is not None:
            heartbeat()
        while not is_stable(dest):
            now = time.monotonic()
            if now - start >= timeout:
                latest = self.latest_stable(kind, role)
                raise StepTimeout(
                    f"waited {timeout:.0f} s for {kind}/step_{step} in {self.root}; latest published "
                    f"{kind} step is {latest}. Is the producer running? See `prl status`."
                )
            if heartbeat is not None and now - last_beat >= heartbeat_every:
                heartbeat()
                last_beat = now
            time.sleep(min(poll, max(0.0, timeout - (now - start))))
        return dest

    def remove_step(self, kind: str, step: int) -> None:
        """Delete a step: the marker first, so readers stop accepting it before files vanish."""
        d = self.step_dir(kind, step)
        for marker in [d / MARKER, *d.glob(f"*/{MARKER}")]:
            marker.unlink(missing_ok=True)
        shutil.rmtree(d, ignore_errors=True)
        for tmp in d.parent.glob(f".{d.name}.tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)

    def remove_steps_after(self, kind: str, step: int) -> list[int]:
        """Delete every step of `kind` later than `step` (a resume's leftovers); return them."""
        later = [s for s in self.steps(kind) if s > step]
        for s in later:
            self.remove_step(kind, s)
        return later
