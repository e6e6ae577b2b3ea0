"""The names every config module shares: a field's path, a schema's blame of one field, a value as shown in a
message. A module of its own so that the loader and its refusal explainer import it, not each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FieldPath = tuple[Any, ...]
"""Where a value sits in a document: mapping keys and list indices, outermost first."""


class FieldValueError(ValueError):
    """Raised by a schema's `__post_init__` to blame one of its fields rather than the whole mapping: `field` is
    a name of the schema's own or a dotted path below it (`inference.attach` from the topology, whose check
    reads across sections), so the refusal is located at that field's own line under its full name."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.path: tuple[str, ...] = tuple(field.split("."))


def shown(value: Any, limit: int = 60) -> str:
    """A value as it may appear in a one-line message: repr'd (control characters escaped), cut short."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(str(value))} characters)"


def shown_path(path: Path | str) -> str:
    """A file name for a message: as is when printable, else escaped."""
    text = str(path)
    return text if text.isprintable() and len(text) <= 300 else shown(text, 300)
