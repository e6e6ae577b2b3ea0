"""Files the planner reads but prl did not write for this run: a model's config.json, a tokenizer.json, another run's
(or an inference pool's) plan.json. One reader for all of them: bounded in size, decoded into a type, and every way
such a file can fail to read (missing permission, a symlink loop, a NUL in the path, a huge or mistyped file) comes
back as `Unreadable` with one line naming the file; the caller adds the field that led there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TypeVar

import msgspec

from prl.config.fields import shown, shown_path

T = TypeVar("T")


class Unreadable(Exception):
    """A file (or directory) the planner needs cannot be read as what it should be: the message says why, in one
    line naming the path."""


def stat_of(path: Path | str) -> os.stat_result | None:
    """`path`'s stat (links followed); None where nothing is. Unreadable where the path cannot be asked: another
    user's private directory, a symlink loop, a NUL character."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise Unreadable(f"cannot read {shown_path(path)}: {exc.strerror}") from None
    except ValueError:
        raise Unreadable(f"{shown(str(path), 200)} is not a path: it holds a NUL character") from None


def is_dir(path: Path | str) -> bool:
    """A directory is at `path` (Unreadable as `stat_of`)."""
    info = stat_of(path)
    return info is not None and stat.S_ISDIR(info.st_mode)


def real_path(path: Path | str) -> Path:
    """`path` absolute with its links resolved; Unreadable for a symlink loop, a NUL or a path it may not see."""
    stat_of(path)  # refuses what cannot be asked before resolve() meets it (a loop is a RuntimeError there)
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError) as exc:
        raise Unreadable(f"cannot resolve {shown_path(path)}: {getattr(exc, 'strerror', None) or exc}") from None


def read_bytes(path: Path | str, limit: int, what: str) -> bytes | None:
    """The bytes of the regular file at `path` (None where nothing is), at most `limit` of them: `what` the file
    should be ("a model's config.json") says why a larger or other kind of file is refused."""
    info = stat_of(path)
    if info is None:
        return None
    name = shown_path(path)
    if not stat.S_ISREG(info.st_mode):
        raise Unreadable(f"{name} is not a regular file; it should be {what}")
    if info.st_size > limit:
        raise Unreadable(f"{name} is {info.st_size} bytes, over the {limit} bytes that {what} may have")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(limit + 1)
    except OSError as exc:
        raise Unreadable(f"cannot read {name}: {exc.strerror}") from None
    if len(raw) > limit:
        raise Unreadable(f"{name} grew past the {limit} bytes that {what} may have while it was read")
    return raw


def read_json(path: Path | str, kind: type[T], limit: int, what: str) -> T | None:
    """The JSON file at `path` decoded as `kind` (None where nothing is); Unreadable naming the first value of an
    unexpected type (`$.added_tokens[0].id`), a file that is no JSON, or one nested too deeply."""
    raw = read_bytes(path, limit, what)
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise Unreadable(f"{shown_path(path)} is not {what} prl can read: {exc}") from None
    except RecursionError:
        raise Unreadable(f"{shown_path(path)} nests too deeply to be {what}") from None
