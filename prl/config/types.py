"""The schemas' base types and bounds, shared by topologies (prl/config/topology.py) and cluster profiles
(prl/config/cluster.py).

    Strict                  the base of every user schema: frozen, unknown fields refused
    Text, NonEmptyText      printable strings of bounded length
    PathText                a path: printable, no '~' or '$', no leading '-', no component over 255 characters
    Token, PathToken        what lands in an #SBATCH line or an srun option
    Ident, Name             ids given to other systems; names used in paths and job names
    EnvName, Env            environment variables an `env:` map may set
    ShellLine               a line of an admin's shell code
    SlurmTime, checked_time a Slurm time limit, kept as Slurm's text
    MAX_*                   the bounds (a typo of 10**12 stops at the schema)

Each pattern is `explained` (prl.config.loader): a value it refuses is reported with the reason its helper
here gives (`control_characters`, `token_characters`, `path_characters`, ...).
"""

from __future__ import annotations

import re
from typing import Annotated, Union

import msgspec
from msgspec import Meta

from prl.config.fields import FieldValueError, shown
from prl.config.loader import explained

# Patterns are searched with Python's re: \A and \Z, since `$` also matches before a final newline.
_TIME = re.compile(r"\A([0-9]{1,3}-)?[0-9]{1,3}(:[0-9]{2}){0,2}\Z")
# Unicode's format characters (category Cf: zero-width spaces and joiners, bidirectional marks, overrides and
# isolates, tag characters, ...): invisible, they make text read other than it runs. Listed as of Unicode 15.1;
# tests/test_adversarial.py checks the list against the running Python's unicodedata.
FORMAT_CHARACTERS = (r"\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e"
                     r"\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f"
                     r"\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f")
# Letters (category Lo) that every font draws as nothing: Hangul's choseong, jungseong and halfwidth fillers and
# the Hangul filler, the blanks of look-alike names and arguments.
INVISIBLE_FILLERS = r"\u115f\u1160\u3164\uffa0"
# C0/C1 controls, line separators, format characters and fillers (text that reads other than it runs).
_CONTROLS = r"\x00-\x1f\x7f-\x9f\u2028\u2029" + FORMAT_CHARACTERS + INVISIBLE_FILLERS
_SHELL_CONTROLS = r"\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029" + FORMAT_CHARACTERS + INVISIBLE_FILLERS
_CONTROL = re.compile(f"[{_CONTROLS}]")
_SHELL_CONTROL = re.compile(f"[{_SHELL_CONTROLS}]")
_TOKEN_CHARS = r"""\s'"`$;\\"""
_TOKEN = re.compile(rf"\A[^{_TOKEN_CHARS}]+\Z")
NAME = r"\A[A-Za-z0-9][A-Za-z0-9._-]*\Z"
"""A name that may appear in paths, job names and messages as is."""

MAX_NODES = 100_000
"""Most nodes any count may name (a typo of 10**12 stops at the schema)."""
MAX_GPUS_PER_NODE = 1024
MAX_CPUS = 65_536
MAX_GB = 10_000_000
MAX_ITEMS = 1000
"""Most items in a list or mapping field."""
MAX_TEXT = 4096
"""Longest string field."""


def control_characters(value: str) -> str:
    """Why a value for scripts or screens was refused: control characters (newlines, tabs, terminal escapes,
    bidi overrides)."""
    found = _CONTROL.search(value)
    return (f"must not contain control characters such as newlines, tabs, escapes or invisible formatting "
            f"(zero-width, bidirectional) marks or fillers (U+{ord(found.group()):04X} in {shown(value)})") if found else ""


def shell_control_characters(value: str) -> str:
    """Admin shell code may span lines and hold tabs, but no other control characters."""
    found = _SHELL_CONTROL.search(value)
    return (f"must not contain control characters other than newlines and tabs "
            f"(U+{ord(found.group()):04X} in {shown(value)})") if found else ""


def token_characters(value: str) -> str:
    if not _TOKEN.search(value):
        return "must not contain spaces, quotes, '$', ';' or backslashes (it lands in a Slurm option)"
    return control_characters(value) or ascii_characters(value)


def option_like(value: str) -> str:
    return (f"{shown(value)} starts with '-': the command it is passed to would read it as an option "
            f"(write ./{value} for a relative path)")


def ascii_characters(value: str) -> str:
    """Names and ids are ASCII: a look-alike letter (Cyrillic 'а' for Latin 'a') would name another thing."""
    if value.startswith("-"):
        return option_like(value)
    found = next((c for c in value if not c.isascii()), "")
    return (f"must be ASCII: {found!r} (U+{ord(found):04X}) in {shown(value)} may look like an ASCII letter but "
            f"names something else") if found else control_characters(value)


def name_characters(value: str) -> str:
    """Which character of a name is refused, by its code point: an invisible one would not show in the quote."""
    found = next((c for c in value if not (c.isascii() and (c.isalnum() or c in "._-"))), None)
    where = f": U+{ord(found):04X} in {shown(value)} is not one" if found else ""
    return f"must use only letters, digits, '.', '_' and '-' (and start with a letter or digit){where}"


RESERVED_ENV = ("PRL_RUN_DIR", "PRL_ROLE", "PRL_ATTEMPT", "PRL_ATTEMPT_BASE", "PRL_MODE", "PRL_RESTART", "PRL_TASKS",
                "PRL_TASK", "PRL_NODE", "PRL_INFERENCE_API_KEY", "CUDA_VISIBLE_DEVICES", "VLLM_NIXL_SIDE_CHANNEL_HOST",
                "VLLM_NIXL_SIDE_CHANNEL_PORT")
"""Variables prl sets for each role (the launch scripts, the launcher and the role runner): an `env:` map may not
set them, since one of the two values would silently lose. Slurm's own `SLURM_*` are refused as well."""
_RESERVED_ENV = rf"(?!SLURM_)(?!(?:{'|'.join(RESERVED_ENV)})\Z)"


def env_name(value: str) -> str:
    if value.startswith("SLURM_") or value in RESERVED_ENV:
        return (f"{value} is set by {'Slurm' if value.startswith('SLURM_') else 'prl'} for every role; an `env:` map "
                f"cannot override it (remove it)")
    return f"environment variable name {shown(value)} is not a valid shell name"


PRINTABLE = explained(rf"\A[^{_CONTROLS}]*\Z", control_characters)

Text = Annotated[str, Meta(max_length=MAX_TEXT), PRINTABLE]
"""A string of at most 4096 printable characters."""

NonEmptyText = Annotated[Text, Meta(min_length=1)]

MAX_PATH_PART = 255
"""Longest component of a path (the filesystems' NAME_MAX); a longer one fails every system call on it."""


def path_characters(value: str) -> str:
    long = max(value.split("/"), key=len)
    if len(long) > MAX_PATH_PART:
        return (f"has a path component of {len(long)} characters ({shown(long, 40)}); "
                f"filesystems allow at most {MAX_PATH_PART}")
    if value.startswith("-"):
        return option_like(value)
    if value.startswith("~") or "$" in value:
        return (f"{shown(value)}: prl does not expand '~' or '$VARIABLES' in paths (the nodes would get them "
                f"literally); write an absolute path, or `${{oc.env:HOME}}/...` (resolved when planned)")
    return control_characters(value)


PathText = Annotated[str, Meta(min_length=1, max_length=MAX_TEXT),
                     explained(rf"\A(?![~-])(?!.*?[^/]{{{MAX_PATH_PART + 1}}})[^${_CONTROLS}]*\Z", path_characters)]
"""A file or directory path (or a name that may be one): printable, no component over 255 characters, no '~' or
'$' (never expanded: write the absolute path or `${oc.env:HOME}`), no leading '-' (an option to the command). Non-ASCII letters are fine in paths."""

Token = Annotated[str, Meta(min_length=1, max_length=256),
                  explained(rf"\A[^{_TOKEN_CHARS}\x00-\x20\x7f-\U0010ffff]+\Z", token_characters)]
"""A name that lands in an #SBATCH line or an srun option (partition, account, image): ASCII without spaces,
quotes, '$', ';' or backslashes."""

PathToken = Annotated[str, Meta(min_length=1, max_length=MAX_TEXT),
                      explained(rf"\A[^{_TOKEN_CHARS}{_CONTROLS}]+\Z", token_characters)]
"""A path that lands in an srun option (a container mount or workdir): no spaces, quotes, '$', ';' or
backslashes; non-ASCII letters are fine."""

Ident = Annotated[str, Meta(min_length=1, max_length=MAX_TEXT), explained(r"\A(?!-)[\x20-\x7e]+\Z", ascii_characters)]
"""An id or name given to another system (an environment module, a W&B project): printable ASCII, not starting
with '-' (a command would read it as an option)."""

Name = Annotated[str, Meta(max_length=128), explained(NAME, name_characters)]
"""Letters, digits, '.', '_', '-', starting with a letter or digit."""

EnvName = Annotated[str, explained(rf"\A{_RESERVED_ENV}[A-Za-z_][A-Za-z0-9_]{{0,255}}\Z", env_name)]

Env = Annotated[dict[EnvName, Text], Meta(max_length=MAX_ITEMS)]
"""Environment variables: shell names to printable values."""

ShellLine = Annotated[str, Meta(max_length=16 * MAX_TEXT),
                      explained(rf"\A[^{_SHELL_CONTROLS}]*\Z", shell_control_characters)]
"""A line of an admin's shell code (a profile's `setup`): newlines and tabs are fine, other control characters are not."""

SlurmTime = Union[str, int]
"""A Slurm time limit; `time: 30` in YAML is an int, which Slurm reads as minutes."""


class Strict(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of the user's schemas: immutable, unknown fields refused. `prl.config.loader.validate` converts
    strictly: YAML's `yes` is no number and "3" no int (and the loader refuses inf and nan)."""


def checked_time(owner: Strict, field: str) -> None:
    """Keep a time limit as Slurm's text (a YAML int is minutes) and refuse what Slurm would not read."""
    value = getattr(owner, field)
    if value is None:
        return
    text = str(value)
    if not _TIME.search(text):
        raise FieldValueError(field, f"time must look like MM, HH:MM:SS or D-HH:MM:SS, not {shown(text)}")
    if not text.strip("0:-"):
        # Slurm reads a limit of 0 as none at all: a partition with a MaxTime then keeps the job pending for good.
        raise FieldValueError(field, f"time {shown(text)} is zero, which Slurm reads as no time limit; give the "
                                     f"limit the job needs (e.g. 04:00:00), or leave {field} unset for the default")
    msgspec.structs.force_setattr(owner, field, text)

