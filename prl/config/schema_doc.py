"""Write the field reference of topologies and cluster profiles from the schema itself.

    python -m prl.config.schema_doc > docs/reference.md

tests/test_docs.py fails when docs/reference.md is out of date.
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel

from prl.config.cluster import ClusterProfile
from prl.config.topology import Topology


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found:
            return found
    return None


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    for noise in ("prl.config.topology.", "prl.config.cluster.", "NoneType"):
        text = text.replace(noise, "None" if noise == "NoneType" else "")
    return text


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    nested = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        sub = _model_of(field.annotation)
        default = "required" if field.is_required() else ("see below" if sub and field.default is not None
                                                          else repr(field.default))
        kind = sub.__name__ if sub else _type_name(field.annotation)
        doc = (field.description or (sub.__doc__ or "").strip().splitlines()[0] if sub and sub.__doc__ else
               field.description or "").replace("\n", " ").replace("|", "\\|")
        doc = " ".join(doc.split())
        rows.append(f"| `{path}` | {kind.replace('|', ' or ')} | {default.replace('|', ' or ')} | {doc} |")
        if sub:
            nested.append((sub, path + "."))
    for sub, path in nested:
        rows += _rows(sub, path)
    return rows


def reference() -> str:
    head = "| field | type | default | meaning |\n|---|---|---|---|"
    return "\n".join([
        "# Field reference",
        "",
        "Generated from the schema by `python -m prl.config.schema_doc > docs/reference.md`; do not edit by hand.",
        "",
        "## Topology (`configs/*.yaml`)",
        "",
        head,
        *_rows(Topology, ""),
        "",
        "## Cluster profile (`clusters/*.yaml`)",
        "",
        head,
        *_rows(ClusterProfile, ""),
        "",
    ])


if __name__ == "__main__":
    print(reference(), end="")
