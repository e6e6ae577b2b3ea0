"""The run directory's files, written so a reader never sees half of one: atomic replaces, fsyncs, markers.

Every file prl writes under a run is private to its owner (FILE_MODE, in directories of DIR_MODE) and replaced
atomically (`atomic_write_bytes`: a temporary sibling, fsync, rename, fsync the directory). A published step
(prl/run/publish.py) is a directory whose STABLE marker lists every file and its size (`is_stable`). Imports no
torch: login nodes import it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from prl.errors import RunDirError
from prl.run import records

FILE_MODE = 0o600
"""Mode of every file prl writes under a run (the run directory itself is 0700)."""
DIR_MODE = 0o700
"""Mode of the run directory and the directories prl makes in it."""
MARKER = "STABLE"
"""Name of the marker file that makes a published directory visible to readers."""
PENDING_MARKER = ".STABLE.pending"
"""The marker's name inside a directory being published, until the directory has its final name."""

_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^\.step_\d+\.tmp-a(\d+)-")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes, mode: int = FILE_MODE) -> Path:
    """Write `data` to `path` so a reader sees the old file or the whole new one (created with `mode`)."""
    path = Path(path)
    path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        # 0600 from the first byte: run files may name hosts, ports and paths others should not read.
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str, mode: int = FILE_MODE) -> Path:
    """`atomic_write_bytes` for UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    """`atomic_write_bytes` for a JSON document (indented, trailing newline); a record (`prl.run.records`)
    is written with every field. The records a process hands another are read and written through RunDir's
    methods (`write_endpoint`, `mark_ready`, ...), never as dicts."""
    if isinstance(obj, msgspec.Struct):
        obj = records.encode(obj)
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under `path` (bottom-up), then `path`."""
    for dirpath, _dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def current_attempt(env: Mapping[str, str] | None = None) -> int:
    """This job's attempt number, from 1: one more per Slurm requeue and per `prl submit --resume`.

    $PRL_ATTEMPT when set: the launcher passes it to every task, and `prl submit --local` to
    the launcher. Else (the launcher of a Slurm job) the attempts before this submission
    ($PRL_ATTEMPT_BASE, set by `prl submit`) + Slurm's requeue count ($SLURM_RESTART_COUNT) + 1.
    """
    env = os.environ if env is None else env
    if env.get("PRL_ATTEMPT", "").isdigit():
        return int(env["PRL_ATTEMPT"])
    base, requeues = env.get("PRL_ATTEMPT_BASE", ""), env.get("SLURM_RESTART_COUNT", "")
    return (int(base) if base.isdigit() else 0) + (int(requeues) if requeues.isdigit() else 0) + 1


def step_of(path: str | Path) -> int | None:
    """N for a step directory `.../step_N`; None for any other name."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def is_stable(path: str | Path) -> bool:
    """True when `path` was published completely: its STABLE marker exists and every file it lists is
    there with the size it lists (a reader never takes a step whose files went missing or shrank)."""
    path = Path(path)
    marker = records.read_marker(path / MARKER)
    try:
        return marker is not None and all((path / name).stat().st_size == size for name, size in marker.files.items())
    except OSError:
        return False


def verify_stable(path: str | Path) -> bool:
    """`is_stable` for a decision that deletes (a resume): True when `path` was published completely; False when
    it holds no marker (never published, or a publish cut short: never anyone's work); RunDirError naming the
    file when it has a marker but that marker or a file it lists cannot be read (an I/O error, ESTALE on a
    network filesystem) or does not match (missing, short). Such a step is neither taken nor passed over:
    `is_stable` reads it as not published, which only a reader that waits may do."""
    path = Path(path)
    try:
        (path / MARKER).stat()
    except FileNotFoundError:
        return False
    except OSError as e:
        raise RunDirError(f"cannot read {path / MARKER}: {e.strerror or e}") from e
    marker = records.read_marker(path / MARKER)
    if marker is None:
        raise RunDirError(f"cannot read {path / MARKER} as a {MARKER} marker (unreadable or damaged)")
    for name, size in marker.files.items():
        try:
            have = (path / name).stat().st_size
        except OSError as e:
            raise RunDirError(f"cannot read {path / name} (listed in {MARKER}): {e.strerror or e}") from e
        if have != size:
            raise RunDirError(f"{path / name} has {have} bytes; its {MARKER} marker lists {size} (damaged)")
    return True


def _fence(tmp_name: str) -> int | None:
    """The attempt that owns a temporary publish dir (`.step_N.tmp-a<attempt>-<tag>`); None for another name."""
    m = _TMP_RE.match(tmp_name)
    return int(m.group(1)) if m else None


def pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True
    return True
