"""A run's metrics.jsonl as per-step rows: what `prl plot` draws and `prl wandb` logs.

Each role appends its own records (prl.run.rundir.RunDir.append_metrics): the orchestrator one
per step and one per evaluation (`"eval": true`), the trainer one per step, each inference
server one per weight update. Here they are joined by step under prefixed keys:

    orchestrator/reward_mean   trainer/loss   eval/reward_mean   inference/weight_update_s

A step written twice (a requeued attempt redid it) keeps its last record; records of several
inference servers for one step are averaged (and `inference/weight_update_s_max` kept).
Only numbers travel: strings (errors, event names) stay in the file.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable

from prl.states import Role

SKIP = frozenset({"role", "step", "time", "eval", "server", "event"})


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in record.items():
        if key in SKIP or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def prefix(record: dict[str, Any]) -> str:
    return "eval" if record.get("eval") else str(record.get("role", "unknown"))


def step_rows(records: Iterable[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """step -> {"role/key": value}, steps in increasing order."""
    last: dict[tuple[str, int], dict[str, float]] = {}
    servers: dict[int, dict[Any, dict[str, float]]] = defaultdict(dict)
    for record in records:
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            continue
        if record.get("role") == Role.INFERENCE:
            servers[step][record.get("server")] = _numbers(record)
        else:
            last[(prefix(record), step)] = _numbers(record)
    rows: dict[int, dict[str, float]] = defaultdict(dict)
    for (name, step), values in last.items():
        rows[step].update({f"{name}/{k}": v for k, v in values.items()})
    for step, by_server in servers.items():
        for key in sorted({k for values in by_server.values() for k in values}):
            found = [values[key] for values in by_server.values() if key in values]
            rows[step][f"inference/{key}"] = sum(found) / len(found)
            rows[step][f"inference/{key}_max"] = max(found)
    return {step: rows[step] for step in sorted(rows)}


def series(rows: dict[int, dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    """The (steps, values) of one key, over the steps that have it."""
    steps = [s for s, row in rows.items() if key in row]
    return steps, [rows[s][key] for s in steps]
