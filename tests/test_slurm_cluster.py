"""prl.ops.slurm against the real local cluster (scripts/slurm-cluster.sh).

Every test submits real jobs; they are small (1 CPU, seconds) and cancelled
on failure.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from prl.ops import slurm
from prl.errors import SlurmError
from prl.states import JobState
from tests.slurm_fixtures import SlurmCluster
from tests.helpers import wait_for

pytestmark = pytest.mark.slurm


@pytest.fixture
def submit(tmp_path: Path, slurm_cluster: SlurmCluster):
    """Write a batch script, submit it with prl.ops.slurm.sbatch, cancel leftovers at the end."""
    submitted: list[int] = []

    def _submit(body: str, *extra_args: str, name: str = "job") -> int:
        script = tmp_path / f"{name}.sbatch"
        script.write_text("#!/bin/bash\n" + body.lstrip())
        job_id = slurm.sbatch(
            script,
            extra_args=[f"--partition={slurm_cluster.partition}", f"--chdir={tmp_path}", *extra_args],
        )
        submitted.append(job_id)
        return job_id

    yield _submit
    for job_id in submitted:
        subprocess.run(["scancel", str(job_id)], capture_output=True, check=False)


class CountingRunner:
    """Wraps the real runner to count Slurm commands."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv, timeout):
        self.calls.append(argv)
        return slurm.subprocess_runner(argv, timeout)


def _final(job_id: int, components: int):
    """Rows once every component reached a terminal state."""
    rows = slurm.query_jobs([job_id])
    if len(rows) == components and all(r.terminal for r in rows.values()):
        return rows
    return None


HETJOB = """
#SBATCH --job-name=prl-het
#SBATCH --output=het-%j.out
#SBATCH --ntasks=1 --cpus-per-task=1
#SBATCH hetjob
#SBATCH --ntasks=1 --cpus-per-task=1
srun --het-group=0 --output=comp0.out bash -c 'echo "$SLURMD_NODENAME $SLURM_HET_SIZE"; sleep {sleep}' &
srun --het-group=1 --output=comp1.out bash -c 'echo "$SLURMD_NODENAME"; sleep {sleep}; exit {code}' &
wait -n; rc=$?
wait -n; rc2=$?
exit $(( rc > rc2 ? rc : rc2 ))
"""


def test_hetjob_components_run_then_complete(submit, tmp_path, slurm_cluster, monkeypatch):
    job_id = submit(HETJOB.format(sleep=4, code=0), name="het")
    counter = CountingRunner()
    monkeypatch.setattr(slurm, "RUNNER", counter)

    running = wait_for(
        "both het components RUNNING",
        lambda: (rows := slurm.squeue_jobs([job_id]))
        and all(r.state == JobState.RUNNING for r in rows.values())
        and rows,
        timeout=30,
    )
    assert set(running) == {f"{job_id}+0", f"{job_id}+1"}
    assert all(r.job_id == str(job_id) and r.nodes for r in running.values())
    # One squeue per poll, whatever the number of components.
    assert all(c[0] == "squeue" for c in counter.calls)

    rows = wait_for("the het job to finish", lambda: _final(job_id, 2), timeout=60)
    assert {r.state for r in rows.values()} == {JobState.COMPLETED}
    assert all(r.exit_code == 0 for r in rows.values())
    assert slurm.merge_state(rows.values()) == JobState.COMPLETED

    acct = slurm.sacct_jobs([job_id])
    if slurm_cluster.accounting:
        assert set(acct) == {f"{job_id}+0", f"{job_id}+1"}
        assert all(r.state == JobState.COMPLETED and r.exit_code == 0 and r.elapsed is not None for r in acct.values())
    else:
        assert acct is None

    node0, het_size = (tmp_path / "comp0.out").read_text().split()
    assert het_size == "2" and node0.startswith("n")
    assert (tmp_path / "comp1.out").read_text().strip().startswith("n")


def test_failing_component_shows_failed_with_code(submit, slurm_cluster):
    job_id = submit(HETJOB.format(sleep=1, code=3), name="het-fail")
    rows = wait_for("the het job to fail", lambda: _final(job_id, 2), timeout=60)
    # The batch script exits with the component's code: both components FAILED 3:0.
    assert {r.state for r in rows.values()} == {JobState.FAILED}
    assert rows[f"{job_id}+0"].exit_code == 3
    assert rows[f"{job_id}+1"].derived_exit_code == 3  # the srun step that failed ran there
    assert slurm.merge_state(rows.values()) == JobState.FAILED


def test_scancel_gives_cancelled(submit, slurm_cluster):
    job_id = submit("sleep 300\n", "--output=/dev/null", name="sleeper")
    wait_for("the job to run", lambda: slurm.squeue_jobs([job_id]).get(str(job_id), None), timeout=30)
    slurm.scancel(job_id)
    rows = wait_for("the job to be cancelled", lambda: _final(job_id, 1), timeout=30)
    row = rows[str(job_id)]
    assert row.state == JobState.CANCELLED
    if slurm_cluster.accounting:
        assert slurm.sacct_jobs([job_id])[str(job_id)].cancelled_by == 0  # root


def test_gpus_per_node_job_schedules(submit, tmp_path, slurm_cluster):
    job_id = submit(
        'srun bash -c \'echo "$SLURMD_NODENAME $CUDA_VISIBLE_DEVICES"\'\n',
        "--nodes=2", "--gpus-per-node=2", "--ntasks-per-node=1", "--output=gpu.out",
        name="gpus",
    )  # fmt: skip
    rows = wait_for("the GPU job to finish", lambda: _final(job_id, 1), timeout=60)
    assert rows[str(job_id)].state == JobState.COMPLETED
    lines = sorted((tmp_path / "gpu.out").read_text().split("\n"))
    lines = [line for line in lines if line]
    assert len(lines) == 2 and all(line.split()[1] == "0,1" for line in lines)


def test_gres_request_beyond_a_node_is_refused_with_slurms_words(submit, slurm_cluster):
    with pytest.raises(SlurmError, match="Requested node configuration is not available"):
        submit("true\n", "--gres=gpu:3", name="too-many-gpus")


@pytest.mark.slow
def test_requeue_restarts_the_job(submit, tmp_path, slurm_cluster):
    job_id = submit(
        'echo "start $SLURM_RESTART_COUNT"; sleep 300\n', "--requeue", "--open-mode=append", "--output=rq.out",
        name="requeue",
    )  # fmt: skip
    key = str(job_id)
    wait_for("the job to run", lambda: (r := slurm.squeue_jobs([job_id]).get(key)) and r.state == JobState.RUNNING, 30)
    slurm.scontrol_requeue(job_id)
    # Requeued jobs wait out the credential lifetime (cred_expire=10 here) before starting again.
    row = wait_for(
        "the job to run again",
        lambda: (r := slurm.squeue_jobs([job_id]).get(key)) and r.state == JobState.RUNNING and r.restarts == 1 and r,
        timeout=60,
    )
    assert row.restarts == 1
    wait_for("the second start in the log", lambda: "start 1" in (tmp_path / "rq.out").read_text(), 15)
    slurm.scancel(job_id)


def test_unknown_job_is_absent(slurm_cluster):
    assert slurm.squeue_jobs([99999999]) == {}
    assert slurm.scontrol_show_job(99999999) is None
    assert slurm.query_jobs([99999999]) == {}
