"""Why msgspec refused a document, said as one message at one field (see `prl.config.loader.validate`).

msgspec stops at the first error and says it tersely (`Expected `int` >= 1 - at `$.trainer.nodes``);
users and tests know pydantic's words ("Input should be greater than or equal to 1"). This module
finds the field in the data, reads the constraint from the schema's annotation and says what is
wrong with the value written. Imported only when a document is refused.
"""

from __future__ import annotations

import difflib
import functools
import re
import sys
import types
import typing
from typing import Any

import msgspec

from prl.config.fields import FieldPath, FieldValueError, shown


def explain(model: type[msgspec.Struct], data: Any, exc: msgspec.ValidationError) -> tuple[FieldPath, str]:
    """(path in the data, message) for a refused document. An unknown key anywhere is reported before
    any other error: before the missing field it was probably meant to be."""
    unknown = _unknown_key(model, data, ())
    if unknown is not None:
        return unknown, _unknown(model, unknown)
    return _explain(model, data, exc)


_MISSING = object()
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]|(\[\.\.\.\])")
_BOOLEANS = "; YAML reads yes/no/on/off/true/false as booleans: write the value you mean"


def _explain(model: type, data: Any, exc: msgspec.ValidationError) -> tuple[FieldPath, str]:
    """msgspec's error (`Expected `int` >= 1 - at `$.trainer.nodes``) as a path in the data and a message."""
    text, at, where = str(exc).rpartition(" - at `")
    if not at:  # a refusal at the top names no place
        text, where = where, ""
    annotation, node, path = _follow(model, data, where.partition("$")[2])
    cause = exc.__cause__
    if isinstance(cause, FieldValueError):
        return path + cause.path, str(cause)
    if isinstance(cause, (ValueError, TypeError)) and not isinstance(cause, msgspec.ValidationError):
        return path, str(cause)  # raised by a schema's __post_init__
    if text.startswith("Object missing required field `"):
        return path + (text.split("`")[1],), "required field is missing"
    if where.startswith("key` in `") and isinstance(node, dict):  # a mapping's key was refused
        key_type = next((typing.get_args(option)[0] for option, _ in _options(annotation)
                         if typing.get_origin(option) is dict), None)
        bad = next((key for key in node if _refuses(key_type, key)), _MISSING)
        if bad is not _MISSING:
            return path, _describe(key_type, bad, text, got=False)
    return path, _describe(annotation, node, text)


def _follow(model: type, data: Any, where: str) -> tuple[Any, Any, FieldPath]:
    """(annotation, value, path in the data) at msgspec's location `.trainer.env[...]`."""
    annotation, node, path = model, data, ()
    for name, index, some_key in _STEP.findall(where):
        part: Any = name or int(index or 0)
        if some_key:  # msgspec does not say which value of a mapping it refused: the first that fails
            values = node.items() if isinstance(node, dict) else ()
            part = next((key for key, value in values if _refuses(_child(annotation, key), value)), _MISSING)
            if part is _MISSING:
                break
        annotation = _child(annotation, part)
        node = _at(node, part)
        path += (part,)
    return annotation, node, path


def _at(node: Any, part: Any) -> Any:
    if isinstance(node, dict):
        return node.get(part, _MISSING)
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return node[part]
    return _MISSING


def _refuses(annotation: Any, value: Any) -> bool:
    if annotation is None:
        return False
    try:
        msgspec.convert(value, annotation, strict=True)
    except msgspec.ValidationError:
        return True
    return False


def _options(annotation: Any) -> list[tuple[Any, list[msgspec.Meta]]]:
    """The members of a (possibly Optional, Annotated) type, each with its msgspec constraints."""
    metas: list[msgspec.Meta] = []
    if typing.get_origin(annotation) is typing.Annotated:
        annotation, *extra = typing.get_args(annotation)
        metas = [meta for meta in extra if isinstance(meta, msgspec.Meta)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [option for arg in typing.get_args(annotation) for option in _options(arg)]
    return [(annotation, metas)]


def struct_of(annotation: Any) -> type[msgspec.Struct] | None:
    """The schema inside an annotation (`Optional[Model]`), if any."""
    return next((option for option, _ in _options(annotation)
                 if isinstance(option, type) and issubclass(option, msgspec.Struct)), None)


@functools.cache
def fields_of(struct: type[msgspec.Struct]) -> dict[str, msgspec.structs.FieldInfo]:
    """Name -> field of a schema, annotations resolved (once: msgspec resolves them on every call)."""
    return {field.name: field for field in msgspec.structs.fields(struct)}


def _child(annotation: Any, part: Any) -> Any:
    """The annotation of `part` (field name, list index or mapping key) inside `annotation`; None: no schema."""
    struct = struct_of(annotation)
    if struct is not None:
        field = fields_of(struct).get(part)
        return field.type if field else None
    for option, _ in _options(annotation):
        origin = typing.get_origin(option)
        if origin is list and isinstance(part, int) or origin is dict:
            return typing.get_args(option)[-1]
    return None


def _unknown_key(annotation: Any, data: Any, path: FieldPath) -> FieldPath | None:
    """The first key that no schema field has: inside the fields first, in schema order, then beside them."""
    struct = struct_of(annotation)
    if struct is not None and isinstance(data, dict):
        fields = fields_of(struct)
        for name, field in fields.items():
            found = _unknown_key(field.type, data[name], path + (name,)) if name in data else None
            if found is not None:
                return found
        return next((path + (key,) for key in data if key not in fields), None)
    children = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for part, value in children:
        child = _child(annotation, part)
        found = _unknown_key(child, value, path + (part,)) if child is not None else None
        if found is not None:
            return found
    return None


def _unknown(model: type[msgspec.Struct], field: FieldPath) -> str:
    """`unknown field; did you mean 'trainer'?` with the closest name the schema has at that place."""
    annotation: Any = model
    for part in field[:-1]:
        annotation = _child(annotation, part)
    struct = struct_of(annotation)
    names = list(fields_of(struct)) if struct else []
    key = str(field[-1]) if field else ""
    if key.strip() != key and key.strip() in names:  # invisible in the file, and in the quoted name
        return f"unknown field: {key!r} has white space before or after {key.strip()!r}; remove it"
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5) if field else []
    if close:
        return f"unknown field; did you mean {close[0]!r}?"
    return "unknown field (check the spelling; docs/reference.md lists every field)"


def _describe(annotation: Any, value: Any, fallback: str, got: bool = True) -> str:
    """Why `value` does not fit `annotation`, in the words users know from pydantic's messages."""
    options = [(option, metas) for option, metas in _options(annotation)
               if option not in (type(None), msgspec.UnsetType)]
    fitting = next(((option, metas) for option, metas in options if _is_kind(option, value)), None)
    expected = fitting[0] if fitting else options[0][0] if options else None
    if fitting is not None:
        message = _refusal(*fitting, value) or fallback
    elif struct_of(expected) is not None:
        return f"Input should be a valid dictionary or instance of {expected.__name__}"
    elif typing.get_origin(expected) is dict:
        return "Input should be a valid dictionary"
    elif typing.get_origin(expected) is typing.Literal:
        *others, last = [repr(v) for v in typing.get_args(expected)]
        message = f"Input should be {', '.join(others)} or {last}" if others else f"Input should be {last}"
    else:
        kind = {bool: "a valid boolean", int: "a valid integer", float: "a valid number", str: "a valid string",
                list: "a valid list"}.get(typing.get_origin(expected) or expected)
        message = f"Input should be {kind}" if kind else fallback
    return _with_input(message, value, hint=expected is not bool) if got else message


def _is_kind(option: Any, value: Any) -> bool:
    if option is typing.Any:
        return True
    if typing.get_origin(option) is typing.Literal:
        return isinstance(value, str) and value in typing.get_args(option)
    if option is float:  # an int as large as 1e400 is no float
        return isinstance(value, float) or _is_kind(int, value) and abs(value) <= sys.float_info.max
    if option is int:
        return isinstance(value, int) and not isinstance(value, bool)
    base = typing.get_origin(option) or (dict if struct_of(option) else option)
    return isinstance(base, type) and isinstance(value, base)


def _refusal(option: Any, metas: list[msgspec.Meta], value: Any) -> str | None:
    """The first constraint of `metas` that `value` breaks, said as pydantic says it."""
    size = len(value) if isinstance(value, (str, list, dict)) else None
    noun = {str: "String", list: "List", dict: "Dictionary"}.get(type(value))
    for meta in metas:
        if meta.ge is not None and value < meta.ge:
            return f"Input should be greater than or equal to {meta.ge}"
        if meta.gt is not None and value <= meta.gt:
            return f"Input should be greater than {meta.gt}"
        if meta.le is not None and value > meta.le:
            return f"Input should be less than or equal to {meta.le}"
        if meta.lt is not None and value >= meta.lt:
            return f"Input should be less than {meta.lt}"
        if size is not None and meta.min_length is not None and size < meta.min_length:
            unit = ("character" if noun == "String" else "item") + ("s" if meta.min_length != 1 else "")
            return f"{noun} should have at least {meta.min_length} {unit}"
        if size is not None and meta.max_length is not None and size > meta.max_length:
            if noun == "String":
                return f"String should have at most {meta.max_length} characters"
            return f"{noun} should have at most {meta.max_length} items after validation, not {size}"
    for meta in metas:
        if meta.pattern is not None and isinstance(value, str) and not re.search(meta.pattern, value):
            explain = (meta.extra or {}).get("explain")
            return explain(value) if explain else f"must match {meta.pattern}"
    return None


def _with_input(message: str, value: Any, hint: bool) -> str:
    """The refused value after the message (unless it shows it), and a word on YAML's booleans."""
    if value is _MISSING or isinstance(value, (dict, list)):
        return message
    if shown(value) not in message:
        message += f" (got {shown(value)})"
    if hint and isinstance(value, bool):
        message += _BOOLEANS
    return message
