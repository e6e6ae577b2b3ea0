"""YAML -> validated model, with errors that name the file, the line and the field.

OmegaConf does the YAML semantics users expect (interpolation such as
`${oc.env:USER}` or `${name}`, merging, `key=value` overrides); PyYAML's
node tree gives every key its line, which OmegaConf forgets; pydantic
checks the schema. Every failure becomes one ConfigError whose message reads

    configs/topo.yaml:14 (trainer.ep): Input should be greater than or equal to 1 (got 0)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from prl.errors import ConfigError

M = TypeVar("M", bound=BaseModel)

FieldPath = tuple[Any, ...]


class Source:
    """Where the values of one loaded document came from: a file and its lines, plus overrides."""

    def __init__(self, path: Path, lines: dict[FieldPath, int], overrides: dict[FieldPath, str]):
        self.path = path
        self.lines = lines
        self.overrides = overrides

    def locate(self, field: FieldPath) -> str:
        """`file:line (a.b.c)` for a field, or where it was overridden; nearest ancestor wins."""
        dotted = dotted_path(field)
        for cut in range(len(field), -1, -1):
            prefix = tuple(field[:cut])
            if prefix in self.overrides:
                return f"override {self.overrides[prefix]!r} ({dotted})"
            if prefix in self.lines:
                return f"{self.path}:{self.lines[prefix]} ({dotted})" if dotted else f"{self.path}:{self.lines[prefix]}"
        return f"{self.path} ({dotted})" if dotted else str(self.path)

    def error(self, field: FieldPath, message: str) -> ConfigError:
        return ConfigError(f"{self.locate(field)}: {message}")


def dotted_path(field: FieldPath) -> str:
    out = ""
    for part in field:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line_map(node: yaml.Node, prefix: FieldPath, out: dict[FieldPath, int]) -> None:
    out.setdefault(prefix, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = prefix + (key.value,)
            out[path] = key.start_mark.line + 1
            _line_map(value, path, out)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _line_map(item, prefix + (index,), out)


def read_yaml(path: Path) -> tuple[str, dict[FieldPath, int]]:
    """The file's text and the line of every key in it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    lines: dict[FieldPath, int] = {}
    if node is not None:
        if not isinstance(node, yaml.MappingNode):
            raise ConfigError(f"{path}:{node.start_mark.line + 1}: expected a mapping of fields at the top")
        _line_map(node, (), lines)
    return text, lines


def _parse_overrides(overrides: Sequence[str]) -> dict[FieldPath, str]:
    parsed: dict[FieldPath, str] = {}
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip() or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: expected key.path=value, e.g. trainer.nodes=8")
        parsed[tuple(key.strip().split("."))] = item
    return parsed


def load_document(path: Path, overrides: Sequence[str] = ()) -> tuple[dict[str, Any], Source]:
    """Read, merge overrides, resolve interpolation; return plain data and its Source."""
    text, lines = read_yaml(path)
    source = Source(path, lines, _parse_overrides(overrides))
    try:
        conf = OmegaConf.create(text or "{}")
        if overrides:
            conf = OmegaConf.merge(conf, OmegaConf.from_dotlist(list(overrides)))
        data = OmegaConf.to_container(conf, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        field = tuple(key.split(".")) if key else ()
        reason = str(exc).splitlines()[0]
        raise source.error(field, reason) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of fields at the top")
    return data, source


def validate(model: type[M], data: dict[str, Any], source: Source) -> M:
    """pydantic validation whose first error becomes a located ConfigError."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = tuple(part for part in first["loc"] if not _is_union_tag(part))
        raise source.error(field, _describe(first)) from None


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the chosen member's name in locations of tagged unions
    return isinstance(part, str) and (part[:1].isupper() or part.startswith("function-"))


_PATTERN_MEANING = {
    r"^[^\s'\"`$;\\]+$": "must not contain spaces, quotes, '$', ';' or backslashes (it lands in a Slurm option)",
    r"^[A-Za-z0-9][A-Za-z0-9._-]*$": "must use only letters, digits, '.', '_' and '-' (and start with a letter or digit)",
}


def _describe(error: dict[str, Any]) -> str:
    kind = error["type"]
    if kind == "string_pattern_mismatch":
        pattern = error.get("ctx", {}).get("pattern", "")
        meaning = _PATTERN_MEANING.get(pattern, f"must match {pattern}")
        return f"{meaning} (got {error['input']!r})"
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown field (check the spelling; see docs/topology.md)"
    message = error["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    if "input" in error and kind not in ("model_type", "dict_type"):
        shown = error["input"]
        if not isinstance(shown, (dict, list)):
            message += f" (got {shown!r})"
    return message


def load(model: type[M], path: Path, overrides: Sequence[str] = ()) -> tuple[M, Source]:
    data, source = load_document(path, overrides)
    return validate(model, data, source), source
