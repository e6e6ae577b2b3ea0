"""Typed plans for tests, made the way users make them: a shipped topology plus overrides, through the planner."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from prl.planner.model import Plan
from prl.planner.prepare import prepare
from prl.run.rundir import RunDir, atomic_write_text

REPO = Path(__file__).resolve().parents[1]


def local_plan(run_dir: str | Path, model_dir: str | Path, overrides: Sequence[str] = (),
               topology: str = "local-tiny") -> Plan:
    """The plan of configs/TOPOLOGY.yaml with `run_dir`, `model.path` and `overrides` applied. Weights go through
    the filesystem unless `overrides` say otherwise: these plans drive roles directly, without `prl submit` and
    the run key a weight feed needs (local-tiny itself moves them in memory)."""
    items = [f"run_dir={run_dir}", f"model.path={model_dir}", "weights.transport=filesystem", "weights.delta=false", *overrides]
    return prepare(REPO / "configs" / f"{topology}.yaml", items, cwd=REPO).plan


def write_plan(run: RunDir, plan: Plan) -> RunDir:
    """Put `plan` where every role reads it (RUN/plan.json)."""
    run.create()
    atomic_write_text(run.plan_json, plan.to_json())
    return run
