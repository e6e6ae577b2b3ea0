"""Functions of the user's own, named in a topology as `package.module:function` (a custom loss, a
per-token advantage shaping): imported where the role runs, at its start, and checked against the
keyword arguments the topology gives them, so a typo fails the role at once with a one-line error that
names the setting, not at the first step."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from prl.errors import ConfigError


def load_function(import_path: str, setting: str, args: dict[str, Any], params: tuple[str, ...], role: str
                  ) -> Callable:
    """The function `import_path` names, callable as fn(*params, **args); else a ConfigError naming `setting`
    (e.g. `training.loss.import_path`)."""
    module_name, _, attr = import_path.partition(":")
    where = f"{setting} ({import_path})"
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import {module_name}: {e}; install it where the {role} runs") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{where}: module {module_name} has no {attr}")
    if not callable(fn):
        raise ConfigError(f"{where}: {attr} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(*([None] * len(params)), **args)
    except TypeError as e:
        shape = ", ".join([*params, "**args"])
        raise ConfigError(f"{setting.rsplit('.', 1)[0]}.args: {import_path} cannot be called as fn({shape}) with "
                          f"args {sorted(args)}: {e}") from None
    except ValueError:
        pass  # no signature to check (a builtin): the first call tells
    return fn
