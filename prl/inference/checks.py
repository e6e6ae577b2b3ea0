"""What a weight update is allowed to load, decided before any weight is touched.

Pure and light (no vLLM, no torch): the admin endpoint calls these, and unit
tests exercise them without a server.

- `resolve_weights_dir`: turn a request body (`{"step": N}` or `{"path": DIR}`)
  into a published directory under `RUN/weights/`. Anything that resolves
  outside it (a foreign path, `..`, a symlink escape) is refused with 403;
  a step that is not published yet (no STABLE marker) with 409.
- `resolve_feeds`: a `{"step": N, "feeds": ["host:port", ...]}` body, to load
  from the trainer's weight feeds (prl/inference/feed_engine.py checks the
  feeds' names and shapes in the worker, before loading).
- `checkpoint_layout` / `compare_layouts`: read the safetensors headers (names,
  shapes) of a directory and check they match what the server serves, so a
  wrong checkpoint is refused instead of half-loaded.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prl.run.collective import Group, member
from prl.run.rundir import RunDir, is_stable, step_of


MAX_STEP = 2**31 - 1
"""Largest weights step a request may name."""
MAX_PATH = 4096
"""Longest weights path a request may name (Linux's PATH_MAX)."""
MAX_FEEDS = 1024
"""Most weight feeds one memory update may name (one per trainer rank; the list fits an admin body)."""
_FEED_HOST = re.compile(r"[A-Za-z0-9._-]{1,253}")
MAX_HEADER_BYTES = 100_000_000
"""Largest safetensors header read (the safetensors library's own bound)."""
MAX_INDEX_BYTES = 64 << 20
"""Largest `model.safetensors.index.json` read (a model of a million tensors lists well under this)."""


class UpdateRefused(Exception):
    """A weight update request that must not be carried out; `status` is its HTTP code."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class WeightsTarget:
    """A published weights directory a server may load."""

    path: Path
    """Resolved (realpath) directory under RUN/weights/."""
    step: int | None
    """Policy version, from the directory name step_N (None for another name)."""
    adapter: bool = False
    """A LoRA adapter (PEFT's adapter_config.json + adapter_model.safetensors), not a whole model."""


@dataclass(frozen=True)
class FeedTarget:
    """A step to load from the trainer ranks' weight feeds (prl/run/feed.py)."""

    step: int
    feeds: tuple[str, ...]
    """host:port of each feed, one per trainer rank."""
    group: Group | None = None
    """The broadcast group the step comes by (`weights.transport: broadcast`), at this server's first rank;
    None: each worker reads the feeds."""

    @property
    def path(self) -> str:
        """What /prl/live reports as the weights' origin."""
        return f"memory:step_{self.step}"


def checked_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= MAX_STEP:
        raise UpdateRefused(400, f'"step" must be an integer in [1, {MAX_STEP}], got {str(step)[:40]!r}')
    return step


def resolve_feeds(body: Any) -> FeedTarget:
    """The step and feeds a `POST /prl/weights {"step", "feeds"}` body names, or `UpdateRefused(400)`."""
    if not isinstance(body, dict) or set(body) - {"group"} != {"step", "feeds"}:
        raise UpdateRefused(400, 'a memory update body is {"step": N, "feeds": ["host:port", ...]'
                                 '[, "group": {"token", "world", "rank", "timeout"}]}, '
                                 f'got the fields {sorted(body)[:5] if isinstance(body, dict) else body!r}')
    step, feeds = checked_step(body["step"]), body["feeds"]
    if not isinstance(feeds, list) or not 1 <= len(feeds) <= MAX_FEEDS:
        raise UpdateRefused(400, f'"feeds" must be a list of 1 to {MAX_FEEDS} "host:port" strings, '
                                 f'got {str(feeds)[:80]!r}')
    for feed in feeds:
        host, _, port = feed.rpartition(":") if isinstance(feed, str) else ("", "", "")
        if not (_FEED_HOST.fullmatch(host) and port.isdigit() and 1 <= int(port) <= 65535):
            raise UpdateRefused(400, f'"feeds" entries must be "host:port", got {str(feed)[:80]!r}')
    if len(set(feeds)) != len(feeds):
        raise UpdateRefused(400, '"feeds" names a feed twice')
    return FeedTarget(step, tuple(feeds), _group(body["group"]) if "group" in body else None)


def _group(asked: Any) -> Group:
    try:
        return member(asked)
    except ValueError as e:
        raise UpdateRefused(400, f'"group" (this server\'s first rank): {e}') from None


def _inside(path: Path, root: Path) -> bool:
    return path != root and os.path.commonpath([str(path), str(root)]) == str(root)


def resolve_weights_dir(run: RunDir, body: Any) -> WeightsTarget:
    """The directory a `POST /prl/weights` body names, or `UpdateRefused` (400/403/409)."""
    if not isinstance(body, dict) or ("step" in body) == ("path" in body):
        raise UpdateRefused(400, 'body must be a JSON object with exactly one of "step" (int) or "path" (str)')
    root = run.weights_root()
    if "step" in body:
        requested = run.weights(checked_step(body["step"]))
    else:
        raw = body["path"]
        if not isinstance(raw, str) or not raw or len(raw) > MAX_PATH or "\0" in raw:
            raise UpdateRefused(400, f'"path" must be a non-empty string of at most {MAX_PATH} characters '
                                     f'without NUL, got {str(raw)[:80]!r}')
        if not os.path.isabs(raw):
            raise UpdateRefused(400, f'"path" must be absolute, got {raw!r}')
        requested = Path(raw)
    real = Path(os.path.realpath(requested))
    if not _inside(real, root):
        raise UpdateRefused(403, f"refused: {str(requested)!r} resolves to {str(real)!r}, "
                                 f"which is not a directory under this run's weights dir {str(root)!r}")
    if not is_stable(real):  # False, not an error, for a name too long for the filesystem
        raise UpdateRefused(409, f"{real} is not published (no STABLE marker yet); "
                                 f"latest published step: {run.latest_stable('weights')}")
    for f in weight_files(real):
        if not _inside(Path(os.path.realpath(f)), root):
            raise UpdateRefused(403, f"refused: weight file {f} links outside {root}")
    return WeightsTarget(real, step_of(real), adapter=(real / ADAPTER_CONFIG).is_file())


ADAPTER_CONFIG = "adapter_config.json"
"""The file that makes a published step a LoRA adapter (what prl/trainer/lora.py writes; vLLM reads it)."""


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of an HF model directory (per its index when sharded), sorted;
    UpdateRefused(422) naming the index when it is not one."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(path.glob("*.safetensors"))
    try:
        loaded = json.loads(read_bounded(index, MAX_INDEX_BYTES))
    except (OSError, ValueError, RecursionError) as e:
        raise UpdateRefused(422, f"cannot read {index}: {_reason(e)}") from None
    weight_map = loaded.get("weight_map") if isinstance(loaded, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(n, str) and n for n in weight_map.values()):
        raise UpdateRefused(422, f"{index}: \"weight_map\" must be an object of tensor name -> file name")
    return [path / n for n in sorted(set(weight_map.values()))]


def read_bounded(file: Path, most: int) -> bytes:
    """The bytes of `file`; ValueError when it holds more than `most`."""
    with open(file, "rb") as f:
        data = f.read(most + 1)
    if len(data) > most:
        raise ValueError(f"larger than {most} bytes")
    return data


def read_header(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from one safetensors file's JSON header; ValueError saying what is wrong with it."""
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError("shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", prefix)
        if n > min(MAX_HEADER_BYTES, os.fstat(f.fileno()).st_size - 8):
            raise ValueError(f"header length {n} is beyond the file or over {MAX_HEADER_BYTES} bytes")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"header is a JSON {type(header).__name__}, not an object")
    shapes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"tensor {name[:80]!r}: \"shape\" must be a list of non-negative integers")
        shapes[name] = tuple(shape)
    return shapes


def checkpoint_layout(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over every safetensors file of `path`; UpdateRefused(422) naming the file if unreadable."""
    files = weight_files(path)
    if not files:
        raise UpdateRefused(422, f"{path} holds no .safetensors files")
    layout: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            layout.update(read_header(f))
        except (OSError, ValueError, RecursionError) as e:
            raise UpdateRefused(422, f"cannot read safetensors header of {f}: {_reason(e)}") from None
    return layout


def _reason(exc: BaseException) -> str:
    """An exception as a short reason (a JSON error names its position; a RecursionError only itself)."""
    if isinstance(exc, RecursionError):
        return "JSON nested too deeply"
    return str(exc)[:200]


def compare_layouts(expected: dict[str, tuple[int, ...]], got: dict[str, tuple[int, ...]], path: Path) -> None:
    """UpdateRefused(422) naming the first differences when `got` is not the served layout."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    shapes = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
    if not (missing or extra or shapes):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} tensors missing (e.g. {', '.join(missing[:3])})")
    if extra:
        parts.append(f"{len(extra)} unexpected tensors (e.g. {', '.join(extra[:3])})")
    if shapes:
        k = shapes[0]
        parts.append(f"{len(shapes)} shape mismatches (e.g. {k}: served {list(expected[k])}, got {list(got[k])})")
    raise UpdateRefused(422, f"{path} does not match the served model: " + "; ".join(parts))
