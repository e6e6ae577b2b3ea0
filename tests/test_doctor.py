"""`prl doctor` on this machine (what each command needs, and the fix), the foreground progress of
`prl submit --local` (prl/ops/progress.py), and `model.build_tiny`'s refusals. The run itself, with the
tiny model built by `prl submit`: tests/test_quickstart.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prl.ops.progress import MetricsTail, Progress
from prl.ops.submit import build_tiny_model
from prl.config.topology import Model
from prl.run.rundir import RunDir
from tests.helpers import REPO, prl_cli


def broken_package(root: Path, name: str, version: str) -> Path:
    """An installed distribution `name` whose import fails, as torchvision built for another torch does."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("raise ImportError('undefined symbol: _ZN3c104cuda9SetDevice')\n")
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


def test_doctor_says_what_this_machine_has_for_each_command(env):
    done = prl_cli(env, "doctor")
    for name in ("python", "msgspec", "slurm", "torch", "transformers", "vllm", "verifiers", "prl_letters"):
        assert f"] {name}" in done.stdout, done.stdout
    assert "2.13.0" in done.stdout  # torch's version, as prl pins it


def test_doctor_finds_a_package_that_does_not_load_beside_torch_and_names_the_fix(tmp_path, env):
    site = broken_package(tmp_path / "site", "torchvision", "0.28.0")
    done = prl_cli({**env, "PYTHONPATH": str(site)}, "doctor", check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "torchvision      0.28.0 does not load beside torch" in done.stdout, done.stdout
    assert "undefined symbol" in done.stdout
    assert "fix: pip uninstall -y torchvision torchaudio torchcodec" in done.stdout


def test_doctor_with_a_topology_says_what_it_lacks_here(env):
    done = prl_cli(env, "doctor", "configs/local-tiny.yaml", "environment.id=prl_nowhere", check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "environment      prl_nowhere is not importable" in done.stdout
    assert "1 problem(s)" in done.stdout
    ok = prl_cli(env, "doctor", "configs/local-tiny.yaml", "model.path=/nonexistent/tiny")
    assert "not built yet: prl submit builds it (model.build_tiny: dense)" in ok.stdout


def test_doctor_checks_a_teacher_and_a_reference_model_like_the_students(env, tmp_path):
    (tmp_path / "teacher").mkdir()
    scored = ["reference.nodes=1", "training.loss.kl_ref_coef=0.1", "model.path=/nonexistent/tiny"]
    done = prl_cli(env, "doctor", "configs/local-distill.yaml", f"teacher.path={tmp_path / 'teacher'}", *scored,
                   check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"teacher          {tmp_path / 'teacher'} has no config.json" in done.stdout, done.stdout
    assert "fix: set teacher.path to a Hugging Face model directory" in done.stdout
    assert "reference        serves the student's initial model (no path)" in done.stdout
    (tmp_path / "teacher" / "config.json").write_text("{}")
    ok = prl_cli(env, "doctor", "configs/local-distill.yaml", f"teacher.path={tmp_path / 'teacher'}", *scored)
    assert f"[     ok] teacher          {tmp_path / 'teacher'}" in ok.stdout, ok.stdout


def test_a_teacher_task_s_preflight_checks_the_teacher_s_own_model(tmp_path):
    """On the node (`prl doctor RUN --role teacher`, what `--preflight` runs): a scoring server loads its own
    model, so its preflight checks that directory, not the student's; a reference without a path loads the
    student's."""
    from prl.job.preflight import failed, preflight
    from testkit.plans import local_plan, write_plan

    student, teacher = tmp_path / "student", tmp_path / "teacher"
    for d in (student, teacher):
        d.mkdir()
    (student / "config.json").write_text("{}")
    plan = local_plan(tmp_path / "run", student, [f"teacher.path={teacher}", "reference.nodes=1",
                                                   "training.loss.kl_ref_coef=0.1"], topology="local-distill")
    run = write_plan(RunDir(tmp_path / "run"), plan)
    models = {role: [c for c in preflight(run, plan, role, 0, strict=False) if c.name == "model"]
              for role in ("teacher", "reference", "trainer")}
    assert [c.level for c in models["teacher"]] == ["error"] and str(teacher) in models["teacher"][0].detail
    assert failed(models["teacher"])
    assert [c.level for c in models["reference"]] == ["ok"] and str(student) in models["reference"][0].detail
    assert [c.level for c in models["trainer"]] == ["ok"]
    (teacher / "config.json").write_text("{}")
    assert [c.level for c in preflight(run, plan, "teacher", 0, strict=False) if c.name == "model"] == ["ok"]


def test_doctor_refuses_a_role_without_a_run_and_a_run_without_a_role(env, tmp_path):
    done = prl_cli(env, "doctor", "--role", "trainer", check=False)
    assert done.returncode == 2 and "--role goes with a run directory" in done.stderr


def test_progress_joins_a_steps_records_into_one_line():
    lines = []
    p = Progress(20, lines.append)
    p.add({"role": "orchestrator", "step": 1, "reward_mean": 0.0625, "policy_lag_max": 1})
    p.add({"role": "inference", "step": 1, "event": "weights_loaded"})
    p.add({"role": "trainer", "step": 1, "loss": -0.018, "max_policy_lag": 1, "step_s": 62.2})
    p.add({"role": "orchestrator", "step": 1, "eval": True, "reward_mean": 0.5})
    p.add({"role": "trainer", "step": 2, "loss": 2.5})  # an SFT step: no reward
    assert lines == ["step 1/20  reward 0.062  lag 1  loss -0.0180  62.2 s/step", "eval at step 1: reward 0.500",
                     "step 2/20  loss 2.5000"]
    for step, reward in enumerate([0.1, 0.1, 0.1, 0.1, 0.3, 0.5, 0.5, 0.5], start=2):
        p.add({"role": "orchestrator", "step": step, "reward_mean": reward})
    assert p.summary() == "reward 0.091 -> 0.450 (mean of the first and last 4 steps of 9)"
    assert Progress(3, lines.append).summary() is None


def test_metrics_tail_reads_whole_lines_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == []  # no file yet
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "lo')  # the second line is being written
    assert tail.read() == [{"step": 1}]
    with path.open("a") as f:
        f.write('ss": 0.5}\n')
    assert tail.read() == [{"step": 2, "loss": 0.5}] and tail.read() == []


def test_progress_applies_a_resumes_truncation_as_read_metrics_does(tmp_path):
    """A requeue resumes from step 2: the roles drop their records of steps 3-4 (a truncation line each) and
    record steps 3-4 again. The foreground view ends as `read_metrics` reads the file: the old attempt's
    rewards are not in the summary, and the steps trained again are shown again."""
    run = RunDir(tmp_path / "run").create()
    tail, lines = MetricsTail(run.metrics_jsonl), []
    progress = Progress(4, lines.append)

    def attempt(steps, reward):
        for step in steps:
            run.append_metrics({"role": "orchestrator", "step": step, "reward_mean": reward})
            run.append_metrics({"role": "trainer", "step": step, "loss": 1.0})
        for record in tail.read():
            progress.add(record)

    attempt([1, 2, 3, 4], 0.0)
    assert run.drop_metrics_after("orchestrator", 2) == 2 and run.drop_metrics_after("trainer", 2) == 2
    run.append_metrics({"role": "orchestrator", "step": 3, "reward_mean": 1.0})  # the new attempt
    run.append_metrics({"role": "trainer", "step": 3, "loss": 1.0})
    attempt([], 0.0)
    assert progress.rewards == {r["step"]: r["reward_mean"] for r in run.read_metrics("orchestrator")}
    assert progress.rewards == {1: 0.0, 2: 0.0, 3: 1.0} and progress.trained == [1, 2, 3]
    assert lines[-1] == "step 3/4  reward 1.000  loss 1.0000"
    assert progress.summary() == "reward 0.333 -> 0.333 (mean of the first and last 3 steps of 3)"


def test_build_tiny_leaves_an_existing_model_and_a_run_to_start_from(tmp_path):
    (tmp_path / "m").mkdir()
    # Something is there already: never overwritten.
    assert build_tiny_model(Model(path=str(tmp_path / "m"), build_tiny="dense")) is False
    assert build_tiny_model(Model(from_run=str(tmp_path / "run"), build_tiny="dense")) is False


@pytest.mark.parametrize("name", ["local-tiny", "local-moe", "tiny-guess", "sft-tiny"])
def test_shipped_local_topologies_build_their_model(name):
    import yaml

    model = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())["model"]
    assert model["build_tiny"] in ("dense", "moe") and not Path(model["path"]).is_absolute(), model
