"""What a weight update is allowed to load, decided before any weight is touched.

Pure and light (no vLLM, no torch): the admin endpoint calls these, and unit
tests exercise them without a server.

- `resolve_weights_dir`: turn a request body (`{"step": N}` or `{"path": DIR}`)
  into a published directory under `RUN/weights/`. Anything that resolves
  outside it (a foreign path, `..`, a symlink escape) is refused with 403;
  a step that is not published yet (no STABLE marker) with 409.
- `checkpoint_layout` / `compare_layouts`: read the safetensors headers (names,
  shapes) of a directory and check they match what the server serves, so a
  wrong checkpoint is refused instead of half-loaded.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prl.run.rundir import RunDir, is_stable, step_of


MAX_STEP = 2**31 - 1
"""Largest weights step a request may name."""
MAX_PATH = 4096
"""Longest weights path a request may name (Linux's PATH_MAX)."""


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


def _inside(path: Path, root: Path) -> bool:
    return path != root and os.path.commonpath([str(path), str(root)]) == str(root)


def resolve_weights_dir(run: RunDir, body: Any) -> WeightsTarget:
    """The directory a `POST /prl/weights` body names, or `UpdateRefused` (400/403/409)."""
    if not isinstance(body, dict) or ("step" in body) == ("path" in body):
        raise UpdateRefused(400, 'body must be a JSON object with exactly one of "step" (int) or "path" (str)')
    root = run.weights_root()
    if "step" in body:
        step = body["step"]
        if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= MAX_STEP:
            raise UpdateRefused(400, f'"step" must be an integer in [1, {MAX_STEP}], got {str(step)[:40]!r}')
        requested = run.weights(step)
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
    return WeightsTarget(real, step_of(real))


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of an HF model directory (per its index when sharded), sorted."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


def read_header(file: Path) -> dict[str, dict]:
    """The tensor entries of one safetensors file's JSON header (name -> dtype, shape, offsets)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def checkpoint_layout(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over every safetensors file of `path`; UpdateRefused(422) if unreadable."""
    files = weight_files(path)
    if not files:
        raise UpdateRefused(422, f"{path} holds no .safetensors files")
    layout: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            header = read_header(f)
        except (OSError, ValueError, struct.error) as e:
            raise UpdateRefused(422, f"cannot read safetensors header of {f}: {e}") from e
        for name, entry in header.items():
            layout[name] = tuple(entry["shape"])
    return layout


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
