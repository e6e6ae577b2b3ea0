"""Write the field reference of topologies and cluster profiles from the schema itself.

    python -m prl.config.schema_doc > docs/reference.md

tests/test_docs.py fails when docs/reference.md is out of date.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
import typing
from typing import Any

import msgspec

from prl.config.cluster import ClusterProfile
from prl.config.refusal import fields_of, struct_of
from prl.config.topology import Topology


def _type_name(annotation: Any) -> str:
    """A type as a reader says it: `int or None`, `list of str`, "one of `mask`, `clip`"."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(arg) for arg in args if arg not in (type(None), msgspec.UnsetType)]
        return " or ".join(names + (["None"] if type(None) in args else []))
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{value}`" for value in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    if annotation is typing.Any:
        return "any value"
    if annotation is type(None):
        return "None"
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def _field_docs(model: type[msgspec.Struct]) -> dict[str, str]:
    """The docstring under each field, read from the source (Python keeps none at run time)."""
    docs: dict[str, str] = {}
    for cls in reversed([c for c in model.__mro__ if issubclass(c, msgspec.Struct) and c is not msgspec.Struct]):
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for field, doc in zip(body, body[1:]):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)):
                docs[field.target.id] = inspect.cleandoc(doc.value.value)
    return docs


def _default(field: msgspec.structs.FieldInfo, sub: type | None) -> str:
    if field.required:
        return "required"
    default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    if default is msgspec.UNSET:
        return "unset"
    return "see below" if sub and default is not None else repr(default)


def _rows(model: type[msgspec.Struct], prefix: str) -> list[str]:
    rows = []
    nested = []
    docs = _field_docs(model)
    for name, field in fields_of(model).items():
        path = f"{prefix}{name}"
        sub = struct_of(field.type)
        default = _default(field, sub)
        kind = sub.__name__ if sub else _type_name(field.type)
        described = docs.get(name)
        doc = (described or (sub.__doc__ or "").strip().splitlines()[0] if sub and sub.__doc__ else
               described or "").replace("\n", " ").replace("|", "\\|")
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
