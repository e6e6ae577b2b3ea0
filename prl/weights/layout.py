"""What a step of weights holds, read before any weight is touched: tensor names and shapes.

Pure and light (no vLLM, no torch): a server's admin route and its workers call these, and unit tests
exercise them without a server.

- `weight_files`: the safetensors files of a Hugging Face model directory (per its index when sharded).
- `checkpoint_layout`: the names and shapes in those files' headers, read with bounds (a malformed or
  hostile file is the request's fault: 422 naming the file).
- `compare_layouts`: that a step's layout is the served model's, so a wrong checkpoint is refused instead
  of half-loaded.

`UpdateRefused` is how every side of a transport refuses an update (prl/weights/transport.py): its HTTP
status is what the server answers.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

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

    def __reduce__(self):  # raised in a vLLM worker, it crosses the engine's RPC
        return UpdateRefused, (self.status, self.message)


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


SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
"""safetensors' dtype names -> torch's."""


def read_entries(file: Path) -> tuple[int, dict[str, dict]]:
    """Where one safetensors file's data begins, and its JSON header's entries (name -> {"dtype", "shape",
    "data_offsets"}), read with bounds; ValueError saying what is wrong with it."""
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
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"tensor {name[:80]!r}: \"shape\" must be a list of non-negative integers")
        entries[name] = entry
    return 8 + n, entries


def read_header(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from one safetensors file's JSON header; ValueError saying what is wrong with it."""
    return {name: tuple(entry["shape"]) for name, entry in read_entries(file)[1].items()}


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
