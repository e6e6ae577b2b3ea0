"""`prl plan` as a user runs it: a real subprocess, real files, exit codes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prl.planner.model import Plan
from prl.planner.plan import SHARED_ORCHESTRATOR_CPUS
from prl.planner.prepare import prepare
from prl.run.rundir import RunDir
from tests.helpers import REPO, SHIPPED, stand_in_source_run


def prl(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prl.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60)


@pytest.mark.parametrize("name", SHIPPED)
def test_plan_writes_the_run_directory(name, tmp_path):
    run = tmp_path / "run"
    source = stand_in_source_run(name, tmp_path / "cwd")
    key = "inference.attach" if "attach:" in (REPO / "configs" / f"{name}.yaml").read_text() else "model.from_run"
    result = prl("plan", f"configs/{name}.yaml", f"run_dir={run}", *([f"{key}={source}"] if source else []))
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and str(run) in result.stdout
    plan = Plan.read(RunDir(run))  # as every role reads it
    assert plan.run_dir == str(run) and plan.name == name
    assert (run / "topology.yaml").exists()
    for step in plan.launches:
        script = run / step.script
        assert script.exists() and script.stat().st_mode & 0o111
    assert (run / "scripts" / "job.sbatch").exists() == plan.slurm
    assert not (run / "job.json").exists(), "plan must not submit"


SHARED_ORCHESTRATOR = [name for name in SHIPPED
                       if re.search(r"^orchestrator:\n  placement: (trainer|inference)", (REPO / "configs" / f"{name}.yaml")
                                    .read_text(), re.M)]


@pytest.mark.parametrize("name", SHARED_ORCHESTRATOR)
def test_defaults_that_refuse_none_on_the_profile_the_topology_names(name, tmp_path):
    """Left unset, `orchestrator.cpus` on a shared node fits that node: a 2-core local profile plans every shipped
    topology that shares one (each sets cpus: 1 today; the default must not refuse what the user never asked)."""
    source = stand_in_source_run(name, tmp_path / "cwd")
    key = "inference.attach" if "attach:" in (REPO / "configs" / f"{name}.yaml").read_text() else "model.from_run"
    prepared = prepare(REPO / "configs" / f"{name}.yaml", ["orchestrator.cpus=null", f"run_dir={tmp_path / 'run'}",
                                                           *([f"{key}={source}"] if source else [])], cwd=REPO)
    assert prepared.plan.orchestrator.cpus == min(SHARED_ORCHESTRATOR_CPUS, prepared.cluster.gpu_node.cpus)


def test_plan_json_output(tmp_path):
    result = prl("plan", "configs/moe-1t.yaml", f"run_dir={tmp_path}/r", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["totals"]["gpus"] == 1024 and out["totals"]["nodes"] == 129
    assert out["trainer"]["mesh"] == {"dp_replicate": 2, "dp_shard": 128, "cp": 2, "ep": 32, "world_size": 512}
    assert len(out["written"]) == len(list(Path(f"{tmp_path}/r").rglob("*.*")))


def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    result = prl("plan", "configs/lab.yaml", f"run_dir={run}", "trainer.ep=3")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "(trainer.ep)" in lines[0], result.stderr
    assert "override 'trainer.ep=3'" in lines[0]
    assert not run.exists()


def test_missing_file_and_unknown_override(tmp_path):
    result = prl("plan", "nope.yaml")
    assert result.returncode == 2 and result.stderr.strip() == "error: nope.yaml: no such file"
    result = prl("plan", "configs/lab.yaml", f"run_dir={tmp_path}/r", "trainer.nodez=2")
    assert result.returncode == 2 and "(trainer.nodez): unknown field" in result.stderr


def test_refuses_a_run_directory_that_holds_a_job(tmp_path):
    run = tmp_path / "run"
    assert prl("plan", "configs/lab.yaml", f"run_dir={run}").returncode == 0
    (run / "job.json").write_text("{}")
    before = (run / "plan.json").read_text()
    result = prl("plan", "configs/lab.yaml", f"run_dir={run}", "trainer.nodes=1")
    assert result.returncode == 2 and "holds a submitted job" in result.stderr
    assert (run / "plan.json").read_text() == before
    assert prl("plan", "configs/lab.yaml", f"run_dir={run}", "trainer.nodes=1", "--force").returncode == 0


def test_relative_paths_resolve_from_the_working_directory(tmp_path):
    result = prl("plan", str(REPO / "configs" / "local-tiny.yaml"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "runs" / "prl-runs" / "local-tiny" / "plan.json").exists()
