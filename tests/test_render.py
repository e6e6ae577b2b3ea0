"""Rendered scripts: golden files for every shipped topology, bash -n, shellcheck, determinism.

A golden mismatch prints the diff; regenerate all goldens with

    PRL_REGEN_GOLDEN=1 python -m pytest tests/test_render.py
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from prl.planner.prepare import prepare
from tests.helpers import REPO, SHIPPED, stand_in_source_run

GOLDEN = REPO / "tests" / "golden"
# Shipped topologies with relative paths resolve against this fixed directory in the goldens.
CWD = Path("/home/user/prl")
REGEN = "PRL_REGEN_GOLDEN=1 python -m pytest tests/test_render.py"


def _rendered(name: str) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        if stand_in_source_run(name, Path(tmp)) is None:
            return prepare(REPO / "configs" / f"{name}.yaml", cwd=CWD).files
        # The earlier run it starts from exists only in a temporary directory: rendered as if under CWD.
        files = prepare(REPO / "configs" / f"{name}.yaml", cwd=Path(tmp)).files
        return {rel: text.replace(tmp, str(CWD)) for rel, text in files.items()}


@pytest.mark.parametrize("name", SHIPPED)
def test_golden(name):
    files = _rendered(name)
    folder = GOLDEN / name
    if os.environ.get("PRL_REGEN_GOLDEN"):
        shutil.rmtree(folder, ignore_errors=True)
        for rel, text in files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_text(text)
    expected = {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*") if p.is_file()}
    assert sorted(expected) == sorted(files), f"rendered files differ from {folder}; regenerate: {REGEN}"
    for rel, text in files.items():
        if text != expected[rel]:
            diff = "".join(difflib.unified_diff(expected[rel].splitlines(True), text.splitlines(True),
                                                f"golden/{name}/{rel}", "rendered"))
            pytest.fail(f"{rel} differs from its golden file; if the change is intended: {REGEN}\n{diff}")


@pytest.mark.parametrize("name", SHIPPED)
def test_rendering_is_deterministic(name):
    assert _rendered(name) == _rendered(name)


def _scripts(name: str, tmp_path: Path) -> list[Path]:
    paths = []
    for rel, text in _rendered(name).items():
        if rel.endswith((".sh", ".sbatch")):
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            paths.append(path)
    assert paths
    return paths


@pytest.mark.parametrize("name", SHIPPED)
def test_scripts_parse_in_bash(name, tmp_path):
    for path in _scripts(name, tmp_path):
        result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, f"{path.name}: {result.stderr}"


@pytest.mark.parametrize("name", SHIPPED)
def test_scripts_pass_shellcheck(name, tmp_path):
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: .ci/run installs it (apt-get install shellcheck)"
    paths = [str(p) for p in _scripts(name, tmp_path)]
    result = subprocess.run([shellcheck, "--shell=bash", *paths], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hetjob_has_one_component_per_group():
    text = _rendered("moe-1t")["scripts/job.sbatch"]
    assert text.count("#SBATCH hetjob") == 3  # prefill, decode, orchestrator, trainer
    assert "#SBATCH --gres=gpu:8" in text and "#SBATCH --segment=8" in text


def test_single_allocation_variant(tmp_path):
    """A profile without hetjobs gets one allocation; steps pick node ranges with --relative."""
    topo = (REPO / "configs" / "dense-8b.yaml").read_text().replace("cluster: h100-pyxis", "cluster: a100-modules")
    topo = topo.replace("run_dir: /lustre/fs1/prl/runs/${name}", "run_dir: /projects/ml-lab/scratch/${name}")
    path = tmp_path / "topo.yaml"
    path.write_text(topo)
    prepared = prepare(path, ["trainer.nodes=2"], cwd=tmp_path)
    job = prepared.files["scripts/job.sbatch"]
    assert "hetjob" not in job.replace("no hetjob", "")
    assert "#SBATCH --nodes=3" in job
    assert "module load cuda/12.4" in job and "source /projects/ml-lab/envs/prl/bin/activate" in job
    trainer = prepared.plan.launch("trainer")
    assert "--relative=1" in trainer.srun_args and "--nodes=2" in trainer.srun_args
    assert "--relative=0" in prepared.plan.launch("inference").srun_args
