"""`model.from_run`: an RL (or SFT) topology starts from another prl run's published weights, resolved and
checked when planned (tests/test_sft.py runs SFT -> RL end to end)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prl.errors import ConfigError
from prl.planner.prepare import prepare, write_run_files
from prl.run.rundir import RunDir
from tests.helpers import REPO, prl_cli as prl
from tests.tiny_model import build_tiny_model


def _earlier_run(tmp_path: Path, steps=(2, 4)) -> RunDir:
    """A run directory (its plan.json) that published the tiny model's files as weights `steps`."""
    model = build_tiny_model(tmp_path / "model")
    write_run_files(prepare(REPO / "configs" / "sft-tiny.yaml", [f"run_dir={tmp_path / 'sft'}", f"model.path={model}"]))
    run = RunDir(tmp_path / "sft")

    def copy(tmp: Path) -> None:
        for f in model.iterdir():
            (tmp / f.name).write_bytes(f.read_bytes())

    for step in steps:
        run.publish_dir(run.weights(step), copy, step=step)
    return run


def _plan(tmp_path: Path, *overrides: str):
    return prepare(REPO / "configs" / "local-tiny.yaml", [f"run_dir={tmp_path / 'rl'}", *overrides], cwd=REPO).plan


def test_from_run_resolves_to_the_newest_published_weights_or_the_step_asked(tmp_path):
    run = _earlier_run(tmp_path)
    model = _plan(tmp_path, "model.path=null", f"model.from_run={run.root}").settings().model
    assert (model.path, model.from_run, model.from_step) == (str(run.weights(4)), None, None)
    assert _plan(tmp_path, "model.path=null", f"model.from_run={run.root}",
                 "model.from_step=2").settings().model.path == str(run.weights(2))
    # A half-published step (no STABLE marker) is not a candidate.
    (run.weights(6)).mkdir()
    assert _plan(tmp_path, "model.path=null", f"model.from_run={run.root}").settings().model.path == str(run.weights(4))


@pytest.mark.parametrize("overrides, field, says", [
    (["model.from_run=/nonexistent/run"], "(model.from_run)", "is not a prl run directory"),
    (["model.from_step=3"], "(model.from_step)", "no published weights step 3 (published: 2, 4)"),
    (["model.path=/m"], "(model", "set one of model.path"),
    (["model.from_run=null", "model.from_step=2", "model.path=/m"], "(model.from_step)", "from_run, which is not set"),
])
def test_bad_from_run_is_refused_naming_the_field(tmp_path, overrides, field, says):
    run = _earlier_run(tmp_path)
    with pytest.raises(ConfigError) as info:
        _plan(tmp_path, "model.path=null", f"model.from_run={run.root}", *overrides)
    assert field in str(info.value) and says in str(info.value), str(info.value)


def test_a_run_without_published_weights_is_refused_in_one_line(tmp_path, env):
    run = _earlier_run(tmp_path, steps=())
    out = prl(env, "plan", "configs/local-tiny.yaml", f"run_dir={tmp_path / 'rl'}", "model.path=null",
              f"model.from_run={run.root}", check=False)
    assert out.returncode == 2 and "has published no weights yet" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "rl").exists()
