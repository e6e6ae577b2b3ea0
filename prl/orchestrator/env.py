"""Load a verifiers (0.4.0, `verifiers.v1`) environment the way prl runs it: offline, in-process.

verifiers' defaults do not fit a cluster job: the default runtime is a remote
sandbox and the default harness runs model-issued shell commands on the host.
Here both are explicit: the subprocess runtime (nothing leaves the machine)
and the `prl` in-process harness (see prl/orchestrator/harness.py) unless the
plan names another verifiers harness. Nothing is pushed anywhere: we call
`env.run_slot` directly (or, with `orchestrator.env_workers`, verifiers' env server pool:
prl/orchestrator/workers.py), not the eval CLI that uploads results.

A taskset id must be an importable top-level module (verifiers fails on a
dotted path); a dotted id is imported and aliased under its last component.
Train and eval splits: a taskset whose config has a `split` field (the
environments in `environments/` do) gets `split="train"` or `"eval"`; one
without gets the same tasks for both (with a warning).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from prl.errors import ConfigError
from prl.log import get_logger

log = get_logger(__name__)


def taskset_module_id(env_id: str) -> str:
    """The id verifiers can import: `env_id` itself, or an alias for a dotted module path."""
    if "." not in env_id:
        return env_id
    alias = env_id.rsplit(".", 1)[-1]
    try:
        module = importlib.import_module(env_id)
    except ModuleNotFoundError as e:
        raise ConfigError(f"environment.id {env_id!r}: cannot import it ({e}); install the environment package") from e
    existing = sys.modules.get(alias)
    if existing is not None and existing is not module:
        raise ConfigError(
            f"environment.id {env_id!r}: its alias {alias!r} is already another module ({existing.__name__})"
        )
    sys.modules[alias] = module
    return alias


def harness_id(name: str) -> str:
    """'prl' is prl's in-process harness (the top-level package `prl_harness`, importable in any process);
    other names are verifiers harness ids."""
    if name == "prl":
        from prl.orchestrator.harness import HARNESS_ID

        return HARNESS_ID
    return name


def env_config(env_id: str, harness: str = "prl", args: dict | None = None, split: str | None = None, *,
               max_turns: int | None = None, max_total_tokens: int | None = None) -> dict[str, Any]:
    """The raw verifiers env config (for `vf.resolve_env_config`); the limits are the agent's (None: none)."""
    import verifiers.v1 as vf

    tid = taskset_module_id(env_id)
    taskset: dict[str, Any] = {"id": tid, **(args or {})}
    if split is not None:
        try:
            fields_ = vf.taskset_config_type(tid).model_fields
        except ModuleNotFoundError as e:
            raise ConfigError(
                f"environment.id {env_id!r} is not installed ({e}); e.g. pip install -e environments/{tid}"
            ) from e
        if "split" in fields_:
            taskset["split"] = split
        elif split != "train":
            log.warning("taskset %s has no `split` field: evaluating on its (training) tasks", tid)
    agent: dict[str, Any] = {"harness": {"id": harness_id(harness)}, "runtime": {"type": "subprocess"}}
    limits = {"max_turns": max_turns, "max_total_tokens": max_total_tokens}
    agent.update({name: value for name, value in limits.items() if value is not None})
    return {"taskset": taskset, "agent": agent}


def load_env(env_id: str, harness: str = "prl", args: dict | None = None, split: str | None = None, *,
             max_turns: int | None = None, max_total_tokens: int | None = None):
    """A loaded verifiers Env for one split; ConfigError (with the fix) when it cannot be."""
    import verifiers.v1 as vf

    raw = env_config(env_id, harness, args, split, max_turns=max_turns, max_total_tokens=max_total_tokens)
    try:
        return vf.load_environment(vf.resolve_env_config(raw))
    except ModuleNotFoundError as e:
        raise ConfigError(f"cannot load environment {env_id!r} with harness {harness!r}: {e}") from e
    except ValueError as e:  # pydantic ValidationError is a ValueError: bad environment.args
        raise ConfigError(f"environment {env_id!r}: invalid config {raw['taskset']}: {e}") from e
