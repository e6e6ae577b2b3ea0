"""YAML -> validated model, with errors that name the file, the line and the field.

OmegaConf does the YAML semantics users expect (interpolation such as
`${oc.env:USER}` or `${name}`, merging, `key=value` overrides); PyYAML's
node tree gives every key its line, which OmegaConf forgets; msgspec
checks the schema (strictly: `yes` is no int, "3" no number). Every failure becomes one ConfigError
whose message reads

    configs/topo.yaml:14 (trainer.ep): Input should be greater than or equal to 1 (got 0)

No input may crash or hang the loader: the file is stat'ed before it is read
(regular, at most 1 MiB, UTF-8), the YAML event stream is checked before any
tree is built (depth, tags, alias expansion), the tree before OmegaConf sees
it (duplicate and complex keys, base-60 numbers, merge keys), interpolation
before it is resolved (expanded size), and the resolved data before msgspec
(no non-finite floats anywhere).
"""

from __future__ import annotations

import copy
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import msgspec
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from prl.config.external import Unreadable, is_dir, read_bytes
from prl.config.fields import FieldPath, FieldValueError, shown, shown_path
from prl.errors import ConfigError

M = TypeVar("M", bound=msgspec.Struct)

MAX_BYTES = 1 << 20
"""Largest topology or profile file read."""
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists."""
MAX_VALUES = 10_000
"""Most values (scalars, mappings, lists) in one document, aliases expanded."""
MAX_EXPANDED = 1 << 20
"""Most characters and values the document may hold once interpolation is resolved."""
MAX_OVERRIDES = 1000
"""Most `key=value` overrides on one command line."""
MAX_REFERENCE_HOPS = 16
"""Longest chain of `${...}` references (a -> b -> c ...)."""

PUBLIC_ENV = frozenset({"USER", "LOGNAME", "HOME", "PWD", "TMPDIR", "SCRATCH", "WORK"})
"""Variables `${oc.env:...}` may resolve in any field at plan time: who and where you are, not secrets.
Any other variable may only feed a role's `env:` map, where it stays a reference resolved on the node."""
ENV_REFERENCE = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(?:,([\w./:@+-]*|'[^'\"`$\\{}]*'))?\}")
"""`${oc.env:NAME}`, `${oc.env:NAME,default}` or `${oc.env:NAME,'any default'}`: the forms an `env:` value keeps
as a reference (see `prl.planner.render`, which turns them into shell expansions on the node). OmegaConf reads
only ASCII letters unquoted: a default with other letters or spaces is quoted; no quote, '$', backtick,
backslash or brace in it (the shell would read them inside the expansion)."""

def reference_default(ref: re.Match) -> str | None:
    """The default of an ENV_REFERENCE match as the value it stands for (OmegaConf's single quotes dropped)."""
    default = ref.group(2)
    return default[1:-1] if default and default.startswith("'") else default


# Libyaml when present: a 1 MiB hostile file parses in milliseconds rather than seconds.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_CORE = "tag:yaml.org,2002:"
_ALLOWED_TAGS = {None, _CORE + "str", _CORE + "map", _CORE + "seq"}
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x84\x86-\x9f]")
_OCTAL = re.compile(r"\A[-+]?0[0-7_]+\Z")
_KEY_PART = re.compile(r"^[A-Za-z0-9_-]+$")
_PLAIN_PART = re.compile(r"^[\w.-]{1,64}$")
_READ_NAME = re.compile(r"oc\.env\s*:\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)")
"""The variable names an override's text reads through `oc.env`, however spaced or quoted."""
# A reference inside `${...}`: `a.b`, or `.b` / `..b` relative to the value's own mapping.
_REFERENCE = re.compile(r"(\.*)([A-Za-z_][\w-]*(?:\.[\w-]+)*)")


class Source:
    """Where the values of one loaded document came from: a file and its lines, plus overrides."""

    def __init__(self, path: Path, lines: dict[FieldPath, int], overrides: dict[FieldPath, str],
                 overridden: dict[FieldPath, FieldPath] | None = None):
        self.path = path
        self.lines = lines
        self.overrides = overrides
        self.overridden = overridden if overridden is not None else {path: path for path in overrides}
        """Every field an override writes (its key, and each key and item inside its value) -> that override's
        key: a list given on the command line replaces the file's, so its items are located at the override."""
        self.written: Any = None
        """The document with overrides merged and interpolation resolved, but `${oc.env:...}` kept as
        written: what may be saved (set by `load_document`)."""

    def locate(self, field: FieldPath) -> str:
        """`file:line (a.b.c)` for a field, or where it was overridden; nearest ancestor wins."""
        dotted = dotted_path(field)
        name = shown_path(self.path)
        below = [_told(path, item) for path, item in self.overrides.items() if path[:len(field)] == tuple(field)]
        in_file = any(len(path) > len(field) and path[:len(field)] == tuple(field) for path in self.lines)
        if field and below and not in_file:  # `trainer.nodes.x=3` made a mapping of what the file has as a value
            return f"override {shown(below[-1], 200)} ({dotted})"
        for cut in range(len(field), -1, -1):
            prefix = tuple(field[:cut])
            if prefix in self.overridden:
                key = self.overridden[prefix]
                return f"override {shown(_told(key, self.overrides[key]), 200)} ({dotted})"
            if prefix in self.lines:
                return f"{name}:{self.lines[prefix]} ({dotted})" if dotted else f"{name}:{self.lines[prefix]}"
        return f"{name} ({dotted})" if dotted else name

    def error(self, field: FieldPath, message: str) -> ConfigError:
        return ConfigError(f"{self.locate(field)}: {message}")

    def given(self, field: FieldPath) -> bool:
        """Whether the document (the file with its overrides merged) writes `field`, rather than leaving it to
        its default: a setting another one makes meaningless is refused only where someone wrote it."""
        node = self.written
        for part in field:
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
"""A name in an override's value (a key of a mapping, an option): `-` read as `_`, as `looks_secret` splits."""


def _told(path: FieldPath, override: str) -> str:
    """An override as an error quotes it: the value of a secret-named variable, one that reads a secret-named
    variable (whose default may be the secret itself), or one that names a secret inside (a mapping's
    `api_key:`, an option `--hf-token`) is never echoed to a terminal or log."""
    value = override.partition("=")[2]
    secret = (path and looks_secret(path[-1])) or any(looks_secret(name) for name in _READ_NAME.findall(value)) \
        or any(looks_secret(name.replace("-", "_")) for name in _NAME.findall(value))
    return override.partition("=")[0] + "=..." if secret else override


class _YamlProblem(Exception):
    """A YAML-level refusal at a line of the text being checked (a file, or an override's value)."""

    def __init__(self, line: int, message: str, field: FieldPath = ()):
        super().__init__(message)
        self.line = line
        self.message = message
        self.field = field


def dotted_path(field: FieldPath) -> str:
    out = ""
    for part in field:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        text = part if isinstance(part, str) and _PLAIN_PART.match(part) else shown(part, 40)
        out += f".{text}" if out else text
    return out


def read_text(path: Path) -> str:
    """The file's text; anything but a regular UTF-8 file of at most 1 MiB is refused before it is read."""
    name = shown_path(path)
    try:
        if is_dir(path):
            raise ConfigError(f"{name}: is a directory; give a YAML file")
        raw = read_bytes(path, MAX_BYTES, "a topology or profile (at most 1 MiB)")
    except Unreadable as exc:
        raise ConfigError(str(exc)) from None
    if raw is None:
        raise ConfigError(f"{name}: no such file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{name}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); "
                          f"save the file as UTF-8") from None
    return text[1:] if text.startswith("\ufeff") else text


def _check_text(text: str) -> None:
    """Control characters other than tab and newline: YAML refuses them, and they have no place here."""
    found = _CONTROL.search(text)
    if found:
        line = text[:found.start()].count("\n") + 1
        raise _YamlProblem(line, f"control character U+{ord(found.group()):04X} in the text; YAML files hold text")


def _check_events(text: str) -> dict[tuple[int, int], str]:
    """Walk the event stream: one document, no deep nesting, aliases that expand to little.

    Returns where explicit tags other than !!str, !!map and !!seq are (line, column -> tag), for
    _line_map to refuse with the field they are on."""
    tags: dict[tuple[int, int], str] = {}
    anchors: dict[str, int] = {}
    open_anchors: list[tuple[str | None, int]] = []  # (anchor, total when the collection started)
    total = documents = 0
    for event in yaml.parse(text, Loader=_LOADER):
        line = event.start_mark.line + 1 if event.start_mark else 1
        if isinstance(event, yaml.DocumentStartEvent):
            documents += 1
            if documents > 1:
                raise _YamlProblem(line, "a second YAML document ('---'); one file holds one document")
        if isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)) and event.tag not in _ALLOWED_TAGS:
            tags[(event.start_mark.line, event.start_mark.column)] = event.tag
        if isinstance(event, yaml.AliasEvent):
            if any(name == event.anchor for name, _ in open_anchors):
                raise _YamlProblem(line, f"alias *{event.anchor} refers to a mapping or list that contains it")
            if event.anchor not in anchors:
                raise _YamlProblem(line, f"alias *{event.anchor} has no anchor &{event.anchor} before it")
            total += anchors[event.anchor]
        elif isinstance(event, yaml.ScalarEvent):
            total += 1
            if event.anchor:
                anchors[event.anchor] = 1
        elif isinstance(event, yaml.CollectionStartEvent):
            total += 1
            open_anchors.append((event.anchor, total - 1))
            if len(open_anchors) > MAX_DEPTH:
                raise _YamlProblem(line, f"nested more than {MAX_DEPTH} levels deep")
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, start = open_anchors.pop()
            if anchor:
                anchors[anchor] = total - start
        if total > MAX_VALUES:
            raise _YamlProblem(line, f"more than {MAX_VALUES} values (aliases expanded); a topology needs far fewer")
    return tags


def _is_base60(node: yaml.ScalarNode) -> bool:
    # YAML 1.1 reads plain 5:00 as 300 and 1:30:00 as 5400; nobody means that.
    return not node.style and ":" in node.value and node.tag in (_CORE + "int", _CORE + "float")


def _is_octal(node: yaml.ScalarNode) -> bool:
    # YAML 1.1 reads plain 0100 as 64 (YAML 1.2 and every reader of the number, 100).
    return not node.style and node.tag == _CORE + "int" and bool(_OCTAL.match(node.value))


def _as_decimal(text: str) -> str:
    """`0100` as the decimal its writer meant: `100` (`-0100`: `-100`)."""
    sign = text[0] if text[0] in "+-" else ""
    return sign + (text.lstrip("+-").lstrip("0_") or "0")


def _check_tag(node: yaml.Node, field: FieldPath, tags: dict[tuple[int, int], str]) -> None:
    tag = tags.get((node.start_mark.line, node.start_mark.column))
    if tag:
        raise _YamlProblem(node.start_mark.line + 1, f"YAML tag {shown(tag)} is not supported; write the plain "
                                                      f"value (quote it to keep it a string)", field)


def _line_map(node: yaml.Node, prefix: FieldPath, out: dict[FieldPath, int], tags: dict) -> None:
    """Record the line of every key, refusing what OmegaConf would crash on or misread."""
    out.setdefault(prefix, node.start_mark.line + 1)
    _check_tag(node, prefix, tags)
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            line = key.start_mark.line + 1
            _check_tag(key, prefix, tags)
            if not isinstance(key, yaml.ScalarNode):
                raise _YamlProblem(line, "a key must be a name, not a list or mapping ('? [a, b]')", prefix)
            if key.tag == _CORE + "merge":
                _merge_lines(value, prefix, out, tags)
                continue
            if key.tag != _CORE + "str":  # `~:`, `true:`, `1.5:` are no field names
                raise _YamlProblem(line, f"key {shown(key.value)} reads as {key.tag.rsplit(':', 1)[-1]}, not "
                                         f"a name; quote it", prefix)
            if key.value in seen:
                raise _YamlProblem(line, f"duplicate key {shown(key.value)} (first at line {seen[key.value]})",
                                   prefix + (key.value,))
            seen[key.value] = line
            out[prefix + (key.value,)] = line
            _line_map(value, prefix + (key.value,), out, tags)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _line_map(item, prefix + (index,), out, tags)
    elif isinstance(node, yaml.ScalarNode) and _is_base60(node):
        raise _YamlProblem(node.start_mark.line + 1, f"YAML 1.1 reads {node.value} as a base-60 number; "
                                                      f"quote it: \"{node.value}\"", prefix)
    elif isinstance(node, yaml.ScalarNode) and _is_octal(node):
        raise _YamlProblem(node.start_mark.line + 1, f"YAML 1.1 reads {node.value} as the octal number "
                                                      f"{int(node.value.replace('_', ''), 8)}; write "
                                                      f"{_as_decimal(node.value)} or '{node.value}'", prefix)
    elif isinstance(node, yaml.ScalarNode) and node.tag == _CORE + "value":
        raise _YamlProblem(node.start_mark.line + 1, "a lone '=' is a YAML 1.1 value key; quote it: \"=\"", prefix)


def _merge_lines(value: yaml.Node, prefix: FieldPath, out: dict[FieldPath, int], tags: dict) -> None:
    """`<<: *base` or `<<: [*a, *b]`: merged keys get the lines of their anchor, unless given here too."""
    sources = value.value if isinstance(value, yaml.SequenceNode) else [value]
    for source in sources:
        if not isinstance(source, yaml.MappingNode):
            raise _YamlProblem(source.start_mark.line + 1, "a merge key '<<' takes a mapping or a list of mappings",
                               prefix)
        merged: dict[FieldPath, int] = {}
        _line_map(source, prefix, merged, tags)
        for path, line in merged.items():
            out.setdefault(path, line)


def check_yaml(text: str, lines: dict[FieldPath, int] | None = None) -> yaml.Node | None:
    """The checked node tree of a YAML text, the line of every key into `lines`; _YamlProblem if refused."""
    _check_text(text)
    try:
        tags = _check_events(text)
        node = yaml.compose(text, Loader=_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if "nesting" in problem:
            # PyYAML 6.0.4 has a nesting bound of its own that may fire before ours: one refusal, in our words.
            problem = f"nested more than {MAX_DEPTH} levels deep"
        else:
            problem = f"invalid YAML: {problem}"
        raise _YamlProblem(mark.line + 1 if mark else 1, problem) from None
    if node is not None:
        _line_map(node, (), {} if lines is None else lines, tags)
    elif tags:
        raise _YamlProblem(min(tags)[0] + 1, f"YAML tag {shown(tags[min(tags)])} is not supported")
    return node


def read_yaml(path: Path) -> tuple[str, dict[FieldPath, int]]:
    """The file's text and the line of every key in it."""
    text = read_text(path)
    lines: dict[FieldPath, int] = {}
    try:
        node = check_yaml(text, lines)
        if node is not None and not isinstance(node, yaml.MappingNode):
            raise _YamlProblem(node.start_mark.line + 1, "expected a mapping of fields at the top")
    except _YamlProblem as problem:
        field = f" ({dotted_path(problem.field)})" if problem.field else ""
        raise ConfigError(f"{shown_path(path)}:{problem.line}{field}: {problem.message}") from None
    return text, lines


def _parse_overrides(overrides: Sequence[str]) -> tuple[dict[FieldPath, str], dict[FieldPath, FieldPath]]:
    """`key.path=value` -> path, and every field it writes -> path (`Source.overridden`); the key must be dotted
    names, the value YAML that passes check_yaml."""
    parsed: dict[FieldPath, str] = {}
    overridden: dict[FieldPath, FieldPath] = {}
    if len(overrides) > MAX_OVERRIDES:
        raise ConfigError(f"override {shown(overrides[MAX_OVERRIDES], 200)}: more than {MAX_OVERRIDES} overrides "
                          f"({len(overrides)}); put the settings in the file")
    for item in overrides:
        if not _is_utf8(item):
            raise ConfigError(f"override {shown(item, 200)}: not valid UTF-8 text")
        key, sep, value = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) > MAX_DEPTH or not all(_KEY_PART.match(part) for part in parts):
            raise ConfigError(f"override {shown(item, 200)}: expected key.path=value, the key at most {MAX_DEPTH} "
                              f"names of letters, digits, '_' and '-', e.g. trainer.nodes=8")
        inside: dict[FieldPath, int] = {}
        try:
            check_yaml(value, inside)
        except _YamlProblem as problem:
            raise ConfigError(f"override {shown(item, 200)} ({dotted_path(tuple(parts))}): {problem.message}") from None
        parsed[tuple(parts)] = item
        overridden.update({tuple(parts) + sub: tuple(parts) for sub in (*inside, ())})
    return parsed, overridden


def _is_utf8(text: str) -> bool:
    # Undecodable bytes in argv arrive as lone surrogates, which no YAML parser can take.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _omegaconf_error(exc: Exception, source: Source, blame: FieldPath = ()) -> ConfigError:
    key = getattr(exc, "full_key", None) or ""
    field = blame or tuple(int(p) if p.isdigit() else p for p in re.split(r"[.\[\]]+", str(key)) if p)
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    # A warning OmegaConf raises as an error (load_document) reads as its own words.
    reason = reason.replace("UserWarning raised while resolving interpolation: ", "").split(" See https://")[0]
    if reason.startswith("token recognition error"):  # OmegaConf reads only ASCII letters outside quotes
        reason += "; inside `${...}` put text other than ASCII letters, digits and ./:@+- in single quotes: " \
                  "`${oc.env:NAME,'café'}`"
    return source.error(field, reason)


def _omegaconf_warning(warning: UserWarning, raw: Any, source: Source) -> ConfigError:
    """OmegaConf's warning as a refusal, at the first value that holds the text it quotes (`In the sequence ...`)."""
    reason = str(warning).split(" See https://", 1)[0]
    quoted = re.findall(r"`([^`]+)`", reason)
    field = next((at for at, text in _strings(raw) if quoted and quoted[0] in text), ()) if raw is not None else ()
    return source.error(field, reason)


def _merge_overrides(conf: Any, source: Source) -> Any:
    """Apply the overrides in one merge; when that fails, again one by one, so that the error names the override
    that caused it (a thousand merges one by one take seconds)."""
    if not source.overrides:
        return conf
    try:
        return OmegaConf.merge(conf, OmegaConf.from_dotlist(list(source.overrides.values())))
    except (OmegaConfBaseException, yaml.YAMLError, TypeError, ValueError):
        pass
    for path, item in source.overrides.items():
        try:
            conf = OmegaConf.merge(conf, OmegaConf.from_dotlist([item]))
        except (OmegaConfBaseException, yaml.YAMLError) as exc:
            raise _omegaconf_error(exc, source, path) from None
        except (TypeError, ValueError) as exc:  # OmegaConf's "Cannot merge incompatible container types"
            raise source.error(path, f"cannot merge it into the file: {exc}") from None
    return conf


def _oversized(raw: Any) -> FieldPath | None:
    """The deepest field that would hold too much once `${...}` is resolved (an upper-bound estimate).

    `b: ${a}${a}`, `c: ${b}${b}`, ... doubles at each line; OmegaConf would build it all."""
    sizes: dict[FieldPath, int] = {}

    def lookup(path: FieldPath) -> Any:
        node = raw
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def size(path: FieldPath, value: Any, active: frozenset, hops: int) -> int:
        if path in sizes:
            return sizes[path]
        if path in active:  # a loop: OmegaConf reports it by name
            return 0
        if hops > MAX_REFERENCE_HOPS:  # a chain of references this long is an attack: count it as too large
            return MAX_EXPANDED + 1
        active = active | {path}
        if isinstance(value, dict):
            total = 1 + sum(size(path + (k,), v, active, hops) for k, v in value.items())
        elif isinstance(value, list):
            total = 1 + sum(size(path + (i,), v, active, hops) for i, v in enumerate(value))
        elif isinstance(value, str) and "${" in value:
            total = len(value)
            for dots, ref in _REFERENCE.findall(value[value.index("${"):]):
                target = (path[:len(path) - len(dots)] if dots else ()) + tuple(ref.split("."))
                found = lookup(target)
                if found is not None:
                    total += size(target, found, active, hops + 1)
                if total > MAX_EXPANDED:
                    break
        else:
            total = 1 if not isinstance(value, str) else len(value)
        sizes[path] = total
        return total

    try:
        size((), raw, frozenset(), 0)
    except RecursionError:  # references into deep mappings, many times over
        return ()
    return max((path for path, n in sizes.items() if n > MAX_EXPANDED), key=len, default=None)


def _check_finite(data: Any, source: Source, path: FieldPath = ()) -> None:
    if isinstance(data, float) and not math.isfinite(data):
        raise source.error(path, f"{data} is not a finite number")
    if isinstance(data, dict):
        for key, value in data.items():
            _check_finite(value, source, path + (key,))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            _check_finite(value, source, path + (index,))


def _is_env_map(path: FieldPath) -> bool:
    """A value of a role's (or the profile's) `env:` map, not of the environment's free-form args."""
    return len(path) >= 2 and path[-2] == "env" and path[0] != "environment"


def _strings(data: Any, path: FieldPath = ()):
    """(path, text) of every string value in plain data."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _strings(value, path + (key,))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield from _strings(value, path + (index,))
    elif isinstance(data, str):
        yield path, data


def _set(data: Any, path: FieldPath, value: Any) -> None:
    for part in path[:-1]:
        data = data[part]
    data[path[-1]] = value


SECRET_WORDS = frozenset({"KEY", "APIKEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIALS", "PASS"})
"""Words of an `env:` name (split at `_`) that say its value is a secret: WANDB_API_KEY, HF_TOKEN, ..."""


WHERE_WORDS = frozenset({"PATH", "FILE", "DIR", "DIRECTORY"})
"""A last word that makes a name say where a secret is kept, not the secret: HF_TOKEN_PATH, SSL_KEY_FILE."""


def looks_secret(name: Any) -> bool:
    if not isinstance(name, str):
        return False
    words = name.upper().split("_")
    return bool(SECRET_WORDS & set(words)) and words[-1] not in WHERE_WORDS


def _keep_env_references(raw: dict[str, Any], source: Source) -> None:
    """Keep secrets off the disk: in `env:` maps, escape `${oc.env:NAME}` so it stays text (a reference the
    launch script resolves on the node); refuse a misspelt reference, an unset variable without a default and
    a default for a secret. Whatever still reads the environment after this is `_check_environment_reads`'s."""
    for path, text in list(_strings(raw)):
        if "${oc.env:" not in text:
            continue
        if ENV_REFERENCE.sub("", text).count("${oc.env:"):
            raise source.error(path, "write environment references as `${oc.env:NAME}` or `${oc.env:NAME,default}` "
                                     "(a default of letters, digits and ./:@+- only, or in single quotes without "
                                     "quotes, '$', backticks, backslashes or braces)")
        if _is_env_map(path):
            if "${" in ENV_REFERENCE.sub("", text):  # another resolver could expand the kept reference
                raise source.error(path, "an `env:` value that reads `${oc.env:...}` cannot use other interpolation")
            for ref in ENV_REFERENCE.finditer(text):
                if ref.group(2) is None and ref.group(1) not in os.environ:
                    raise source.error(path, f"environment variable {ref.group(1)} is not set (it is read where "
                                             f"the role runs; set it before submitting, or give a default)")
                if ref.group(2) is not None and (looks_secret(ref.group(1)) or looks_secret(path[-1])):
                    raise source.error(path, f"a default for a secret would be saved in plan.json, topology.yaml and "
                                             f"the scripts; export {ref.group(1)} where the role runs and drop the default")
            _set(raw, path, ENV_REFERENCE.sub(lambda m: "\\" + m.group(0), text))
            continue


def _check_environment_reads(raw: dict[str, Any], source: Source) -> None:
    """Refuse every field that would still read a non-public environment variable at plan time, however the
    read is spelt (`${ oc.env:X }`, quotes, a nested default, a field that reads another field): the document
    is resolved once with `oc.env` swapped for a marker, and every string that carries a marker read it.
    `env:` maps' own references are escaped by now (kept as text), so any read left would be written to disk."""
    if not any("${" in text and "env" in text for _, text in _strings(raw)):
        return
    for path, name in _environment_reads(raw):
        if name in PUBLIC_ENV:
            continue
        if _is_env_map(path):
            raise source.error(path, f"write the reference to {name} exactly as `${{oc.env:{name}}}` (or with a "
                                     f"default): this spelling would be resolved here and its value saved on disk")
        raise source.error(path, f"`${{oc.env:{name}}}` would write {name}'s value into plan.json and the "
                                 f"scripts; read it in a role's `env:` map (resolved on the node), or write "
                                 f"the value here if it is no secret")


def _environment_reads(raw: dict[str, Any]) -> list[tuple[FieldPath, str]]:
    """(field, variable) of every `oc.env` read the resolved document makes; [] when it does not resolve (the
    real resolution that follows reports why)."""
    from omegaconf.resolvers import oc

    marker = f"prl-env-{os.urandom(8).hex()}-"
    # The default goes along: a default that reads another variable is a read too.
    OmegaConf.register_resolver("oc.env", lambda key, default="": f"{marker}{str(key).encode().hex()}-{default}",
                                replace=True, annotation_validation="off")
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(raw), resolve=True)
    except (OmegaConfBaseException, ValueError, TypeError):
        return []
    finally:
        OmegaConf.register_resolver("oc.env", oc.env, replace=True, annotation_validation="off")
    read = re.compile(re.escape(marker) + "([0-9a-f]*)-")
    return [(path, bytes.fromhex(m.group(1)).decode(errors="replace"))
            for path, text in _strings(resolved) for m in read.finditer(text)]


def _written(raw: dict[str, Any]) -> dict[str, Any]:
    """The document (as the user wrote it, checked by `_keep_env_references`) resolved except for every
    `${oc.env:...}`, which stays as written (RUN/topology.yaml)."""
    kept = raw
    for path, text in list(_strings(kept)):
        if "${oc.env:" in text:
            _set(kept, path, ENV_REFERENCE.sub(lambda m: "\\" + m.group(0), text))
    return OmegaConf.to_container(OmegaConf.create(kept), resolve=True)


def _leaked_references(data: Any, source: Source) -> None:
    """A field outside the `env:` maps that copied an `env:` reference (`${trainer.env.KEY}`) cannot use it."""
    for path, text in _strings(data):
        if "${oc.env:" in text and not _is_env_map(path):
            raise source.error(path, "refers to a value read from the environment on the node; only `env:` "
                                     "maps can hold such a reference")


def load_document(path: Path, overrides: Sequence[str] = ()) -> tuple[dict[str, Any], Source]:
    """Read, merge overrides, resolve interpolation; return plain data and its Source.

    `source.written` is the same document with every `${oc.env:...}` kept as written (what
    RUN/topology.yaml records): no value read from the environment is written to disk.
    """
    text, lines = read_yaml(path)
    source = Source(path, lines, *_parse_overrides(overrides))
    raw: Any = None
    try:
        with warnings.catch_warnings():
            # OmegaConf warns where it means a refusal (`${oc.env:A,}`): an error at the field, not a warning
            # printed above the line.
            warnings.simplefilter("error", UserWarning)
            conf = _merge_overrides(OmegaConf.create(text or "{}"), source)
            raw = OmegaConf.to_container(conf, resolve=False)
            oversized = _oversized(raw)
            if oversized is not None:
                raise source.error(oversized, f"interpolation ('${{...}}') chains more than {MAX_REFERENCE_HOPS} "
                                              f"references or expands to more than {MAX_EXPANDED} characters")
            if isinstance(raw, dict) and any("${oc.env:" in text for _, text in _strings(raw)):
                as_written = copy.deepcopy(raw)
                _keep_env_references(raw, source)
                _check_environment_reads(raw, source)
                source.written = _written(as_written)
                data = OmegaConf.to_container(OmegaConf.create(raw), resolve=True)
            else:
                if isinstance(raw, dict):
                    _check_environment_reads(raw, source)
                # No environment reference: what is saved is the resolved document (and two OmegaConf passes,
                # a tenth of `prl plan`, are saved).
                data = OmegaConf.to_container(conf, resolve=True)
                source.written = data
    except UserWarning as exc:
        raise _omegaconf_warning(exc, raw, source) from None
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        raise _omegaconf_error(exc, source) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{shown_path(path)}: expected a mapping of fields at the top")
    _check_finite(data, source)
    _leaked_references(data, source)
    _check_env_values(data, source)
    _refuse_literal_secrets(data, source)
    return data, source


def _check_env_values(data: Any, source: Source, path: FieldPath = ()) -> None:
    """`env:` values are text: a number becomes its digits (`OMP_NUM_THREADS: 4`), a true/false is refused
    (which spelling?)."""
    if isinstance(data, dict):
        for key, value in data.items():
            at = path + (key,)
            if _is_env_map(at) and isinstance(value, bool):
                raise source.error(at, f"write the value in quotes ('1', 'true', ...): an environment variable is text")
            if _is_env_map(at) and isinstance(value, (int, float)):
                data[key] = value = str(value)
            _check_env_values(value, source, at)
    elif isinstance(data, list):
        for index, value in enumerate(data):
            _check_env_values(value, source, path + (index,))


FREE_FORM_MAPS = frozenset({"args"})
"""Keys whose mapping holds names of the user's own, passed on as written and saved in plan.json and topology.yaml:
`training.loss.args`, `training.advantage.shaping.args`, `environment.args`."""
ARGUMENT_LISTS = frozenset({"extra_args"})
"""Keys whose list holds a program's command-line arguments, rendered into the scripts (`inference.extra_args`,
a teacher's or reference's)."""


def _secret_literals(data: Any, path: FieldPath = (), free: bool = False) -> Iterator[tuple[FieldPath, str]]:
    """(where, name) of every value the plan would store that a secret-like name gives literally: a variable of an
    `env:` map (a `${oc.env:NAME}` reference is no literal), a key at any depth of a free-form map, an option
    of an argument list (`--hf-token X`, `--api-key=X`)."""
    if isinstance(data, dict):
        for key, value in data.items():
            at = path + (key,)
            literal = value not in (None, "", {}, []) and not (isinstance(value, str) and ENV_REFERENCE.search(value))
            if (free or _is_env_map(at)) and looks_secret(key) and literal:
                yield at, str(key)
            yield from _secret_literals(value, at, free or key in FREE_FORM_MAPS)
    elif isinstance(data, list):
        for index, value in enumerate(data):
            at = path + (index,)
            option = value.lstrip("-").partition("=")[0] if isinstance(value, str) and value.startswith("--") else ""
            if path and path[-1] in ARGUMENT_LISTS and looks_secret(option.replace("-", "_")):
                yield at, value.partition("=")[0]
            yield from _secret_literals(value, at, free)


def _refuse_literal_secrets(data: Any, source: Source) -> None:
    """One rule for every value the plan stores as written: a secret-named one given literally is refused, since
    plan.json, topology.yaml and the scripts would keep it; it belongs in a role's `env:` as a reference."""
    for at, name in _secret_literals(data):
        if _is_env_map(at):
            fix = f"export it and write `${{oc.env:{name}}}` (read where the role runs)"
        else:
            fix = ("export it, pass it to the role as an `env:` variable (`${oc.env:NAME}`, read where the role "
                   "runs) and read it there from the environment")
        raise source.error(at, f"{name} looks like a secret: a value written here would be saved in plan.json, "
                               f"topology.yaml and the scripts; {fix}")


def explained(pattern: str, explain: Callable[[str], str]) -> msgspec.Meta:
    """A string pattern whose refusal reads as `explain(value)` rather than as the regex."""
    return msgspec.Meta(pattern=pattern, extra={"explain": explain})


def validate(model: type[M], data: dict[str, Any], source: Source) -> M:
    """Strict msgspec conversion whose refusal becomes a located ConfigError.

    An unknown key anywhere is reported before any other error: before the missing field it was
    probably meant to be."""
    try:
        return msgspec.convert(data, model, strict=True)
    except msgspec.ValidationError as exc:
        from prl.config.refusal import explain  # only a refused document pays for the explanation

        field, message = explain(model, data, exc)
        raise source.error(field, message) from None


def load(model: type[M], path: Path, overrides: Sequence[str] = ()) -> tuple[M, Source]:
    data, source = load_document(path, overrides)
    return validate(model, data, source), source
