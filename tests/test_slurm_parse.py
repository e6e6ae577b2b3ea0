"""prl.ops.slurm parsing, with a fake runner. Outputs are copied from Slurm 22.05.8
on the local test cluster; the real-cluster tests are in test_slurm_cluster.py."""

from __future__ import annotations

import subprocess

import pytest

from prl.ops import slurm
from prl.errors import PrlError, SlurmError, SlurmUnavailable
from prl.states import TERMINAL_STATES, JobState

S = slurm.SEP


class FakeRunner:
    """Answers each command by its name; records every argv."""

    def __init__(self, **answers: tuple[int, str, str] | Exception):
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        answer = self.answers[argv[0]]
        if isinstance(answer, Exception):
            raise answer
        rc, out, err = answer
        return subprocess.CompletedProcess(argv, rc, out, err)


@pytest.fixture
def fake(monkeypatch):
    def install(**answers):
        runner = FakeRunner(**answers)
        monkeypatch.setattr(slurm, "RUNNER", runner)
        return runner

    return install


def squeue_line(*fields: str) -> str:
    return "".join(f + S for f in fields)


# ---------------------------------------------------------------- sbatch


@pytest.mark.parametrize("out, want", [("123\n", 123), ("456;lab\n", 456), ("warn\n789\n", 789)])
def test_sbatch_parses_parsable_output(fake, out, want):
    runner = fake(sbatch=(0, out, ""))
    assert slurm.sbatch("/run/job.sbatch", extra_args=["--hold"]) == want
    assert runner.calls == [["sbatch", "--parsable", "--hold", "/run/job.sbatch"]]


def test_sbatch_error_carries_slurms_message(fake):
    err = "sbatch: error: Batch job submission failed: Requested node configuration is not available\n"
    fake(sbatch=(1, "", err))
    with pytest.raises(SlurmError) as e:
        slurm.sbatch("job.sbatch")
    assert "Requested node configuration is not available" in str(e.value)
    assert "sbatch: error:" not in str(e.value)
    assert not isinstance(e.value, SlurmUnavailable)
    assert isinstance(e.value, PrlError) and e.value.exit_code == 1


def test_sbatch_without_job_id_is_an_error(fake):
    fake(sbatch=(0, "Submitted batch job 12\n", ""))
    with pytest.raises(SlurmError, match="no job id"):
        slurm.sbatch("job.sbatch")


def test_missing_binary_is_unavailable(fake):
    fake(sbatch=FileNotFoundError("sbatch"))
    with pytest.raises(SlurmUnavailable, match="command not found"):
        slurm.sbatch("job.sbatch")


def test_timeout_is_unavailable(fake):
    fake(squeue=subprocess.TimeoutExpired(["squeue"], 5))
    with pytest.raises(SlurmUnavailable, match="did not answer"):
        slurm.squeue_jobs([1])


def test_unreachable_controller_is_unavailable(fake):
    err = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"
    fake(squeue=(1, "", err))
    with pytest.raises(SlurmUnavailable, match="Unable to contact slurm controller"):
        slurm.squeue_jobs([1])


# ---------------------------------------------------------------- squeue


def test_squeue_het_components_in_one_call(fake):
    # -O JobID prints each component's own id (12, 13): the key comes from HetJobID+offset.
    out = (
        squeue_line("12", "12", "0", "run", "RUNNING", "None", "0:02", "n1", "0", "0", "0", "2026-11-30T15:19:42", "NONE")
        + "\n"
        + squeue_line("13", "12", "1", "run", "PENDING", "Resources", "0:00", "", "0", "0", "0", "N/A", "N/A")
        + "\n"
    )  # fmt: skip
    runner = fake(squeue=(0, out, ""))
    rows = slurm.squeue_jobs(["12", "12+1", 12])
    assert len(runner.calls) == 1
    argv = runner.calls[0]
    assert "--jobs=12" in argv and "--states=all" in argv
    assert list(rows) == ["12+0", "12+1"]
    r0, r1 = rows["12+0"], rows["12+1"]
    assert (r0.job_id, r0.het_offset, r0.state, r0.nodes, r0.elapsed) == ("12", 0, "RUNNING", "n1", 2)
    assert r0.exit_code is None and r0.reason == "" and r0.restarts == 0 and r0.source == "squeue"
    assert (r1.state, r1.reason, r1.nodes, r1.start) == ("PENDING", "Resources", "", "")


def test_squeue_decodes_raw_wait_status(fake):
    # squeue's exit_code is a wait status: 1792 = exit 7, 9 = killed by signal 9.
    out = (
        squeue_line("5", "N/A", "N/A", "wrap", "FAILED", "NonZeroExitCode", "0:00", "n3", "1792", "0", "0", "x", "y")
        + "\n"
        + squeue_line("6", "N/A", "N/A", "wrap", "FAILED", "JobLaunchFailure", "0:00", "n3", "9", "0", "0", "x", "y")
        + "\n"
    )  # fmt: skip
    fake(squeue=(0, out, ""))
    rows = slurm.squeue_jobs([5, 6])
    assert (rows["5"].het_offset, rows["5"].exit_code, rows["5"].signal) == (None, 7, 0)
    assert (rows["6"].exit_code, rows["6"].signal) == (0, 9)


def test_squeue_empty_for_finished_jobs(fake):
    fake(squeue=(0, "", ""))
    assert slurm.squeue_jobs([3, 4]) == {}


def test_squeue_single_forgotten_job_is_empty(fake):
    fake(squeue=(1, "", "slurm_load_jobs error: Invalid job id specified\n"))
    assert slurm.squeue_jobs([999]) == {}


def test_squeue_keeps_separators_inside_names(fake):
    out = squeue_line("1", "N/A", "N/A", "a name|with pipe", "RUNNING", "None", "1-02:03:04", "n1", "0", "0", "2", "", "")  # fmt: skip
    fake(squeue=(0, out + "\n", ""))
    row = slurm.squeue_jobs([1])["1"]
    assert row.name == "a name|with pipe"
    assert row.elapsed == 86400 + 2 * 3600 + 3 * 60 + 4
    assert row.restarts == 2


def test_bad_job_id_is_rejected():
    with pytest.raises(ValueError, match="not a Slurm job id"):
        slurm.squeue_jobs(["12; rm -rf /"])


# ---------------------------------------------------------------- sacct

SACCT = (
    "1|a name|CANCELLED by 0|0:0|0:0|00:00:17|n1|2026-11-30T15:19:36|2026-11-30T15:19:53|None\n"
    "3+0|hettest|COMPLETED|0:0|0:0|00:00:03|n1|2026-11-30T15:19:42|2026-11-30T15:19:45|None\n"
    "3+1|hettest|COMPLETED|0:0|3:0|00:00:03|n3|2026-11-30T15:19:42|2026-11-30T15:19:45|None\n"
    "5|wrap|FAILED|7:0|0:0|00:00:00|n3|2026-11-30T15:19:42|2026-11-30T15:19:42|None\n"
    "6|wrap|FAILED|0:9|0:0|00:00:00|n3|2026-11-30T15:19:42|2026-11-30T15:19:42|None\n"
    "7|wrap|CANCELLED+|0:15|0:0|00:01:00|n2|2026-11-30T15:19:42|2026-11-30T15:20:42|None\n"
    "8|wrap|PENDING|0:0|0:0|00:00:00|None assigned|Unknown|Unknown|Priority\n"
    "9|wrap|OUT_OF_ME+|0:125|0:0|00:00:10|n1|x|y|None\n"
    "3+0.batch|batch|COMPLETED|0:0||00:00:03|n1|x|y|\n"
).replace("|", S)


def test_sacct_rows(fake):
    runner = fake(sacct=(0, SACCT, ""))
    rows = slurm.sacct_jobs([1, 3, 5, 6, 7, 8, 9])
    assert len(runner.calls) == 1
    argv = runner.calls[0]
    assert "--allocations" in argv and "--parsable2" in argv and f"--delimiter={S}" in argv
    assert "--jobs=1,3,5,6,7,8,9" in argv
    assert set(rows) == {"1", "3+0", "3+1", "5", "6", "7", "8", "9"}  # the .batch step is dropped
    assert (rows["1"].state, rows["1"].cancelled_by, rows["1"].raw_state) == ("CANCELLED", 0, "CANCELLED by 0")
    assert (rows["3+1"].job_id, rows["3+1"].het_offset, rows["3+1"].derived_exit_code) == ("3", 1, 3)
    assert (rows["5"].state, rows["5"].exit_code, rows["5"].signal) == ("FAILED", 7, 0)
    assert (rows["6"].exit_code, rows["6"].signal) == (0, 9)
    assert (rows["7"].state, rows["7"].cancelled_by, rows["7"].signal) == ("CANCELLED", None, 15)
    assert (rows["8"].state, rows["8"].nodes, rows["8"].start, rows["8"].exit_code) == ("PENDING", "", "", None)
    assert rows["8"].reason == "Priority"
    assert rows["9"].state == "OUT_OF_MEMORY"
    assert rows["1"].elapsed == 17 and rows["1"].source == "sacct"


def test_sacct_accepts_default_pipe_delimiter(fake):
    fake(sacct=(0, "5|wrap|FAILED|7:0|0:0|00:00:00|n3|x|y|None\n", ""))
    assert slurm.sacct_jobs([5])["5"].exit_code == 7


def test_sacct_disabled_returns_none(fake):
    fake(sacct=(1, "", "sacct: error: Slurm accounting storage is disabled\n"))
    assert slurm.sacct_jobs([1]) is None


def test_sacct_without_slurmdbd_is_unavailable(fake):
    err = (
        "sacct: error: slurm_persist_conn_open_without_init: failed to open persistent "
        "connection to host:localhost:6819: Connection refused\n"
    )
    fake(sacct=(1, "", err))
    with pytest.raises(SlurmUnavailable):
        slurm.sacct_jobs([1])


# ---------------------------------------------------------------- scontrol

SCONTROL = (
    "JobId=7 HetJobId=7 HetJobOffset=0 JobName=het test HetJobIdSet=7-8 UserId=root(0) "
    "JobState=RUNNING Reason=None Requeue=1 Restarts=2 ExitCode=0:0 RunTime=00:01:05 "
    "StartTime=2026-11-30T15:20:00 EndTime=Unknown AllocNode:Sid=localhost:1944 NodeList=n1 "
    "Command=/runs/my run/job.sbatch --flag WorkDir=/work/main StdOut=/work/main/slurm-7.out Power=\n"
    "JobId=8 HetJobId=7 HetJobOffset=1 JobName=het test JobState=FAILED "
    "Reason=launch failed requeued held ExitCode=3:0 DerivedExitCode=3:0 RunTime=00:00:03 NodeList=n[2-3] Power=\n"
)


def test_scontrol_show_job_splits_components(fake):
    runner = fake(scontrol=(0, SCONTROL, ""))
    recs = slurm.scontrol_show_job(7)
    assert runner.calls == [["scontrol", "show", "job", "--oneliner", "7"]]
    assert len(recs) == 2
    r0, r1 = recs
    assert r0["JobName"] == "het test"
    assert r0["Command"] == "/runs/my run/job.sbatch --flag"
    assert r0["AllocNode:Sid"] == "localhost:1944"
    assert r0["Power"] == ""
    assert r1["Reason"] == "launch failed requeued held"
    rows = slurm.scontrol_rows(recs)
    assert list(rows) == ["7+0", "7+1"]
    assert (rows["7+0"].state, rows["7+0"].restarts, rows["7+0"].elapsed, rows["7+0"].end) == ("RUNNING", 2, 65, "")
    assert (rows["7+1"].state, rows["7+1"].exit_code, rows["7+1"].nodes) == ("FAILED", 3, "n[2-3]")


def test_scontrol_invalid_job_is_none(fake):
    fake(scontrol=(1, "", "slurm_load_jobs error: Invalid job id specified\n"))
    assert slurm.scontrol_show_job(999) is None


def test_scancel_and_requeue_errors(fake):
    runner = fake(scancel=(0, "", ""), scontrol=(1, "", "Requested operation is presently disabled for job 5\n"))
    slurm.scancel(5, signal="TERM")
    assert runner.calls[-1] == ["scancel", "--signal=TERM", "5"]
    with pytest.raises(SlurmError, match="presently disabled"):
        slurm.scontrol_requeue(5)


# ---------------------------------------------------------------- states and merging


@pytest.mark.parametrize(
    "raw, want",
    [
        ("RUNNING", ("RUNNING", None)),
        ("CANCELLED by 1000", ("CANCELLED", 1000)),
        ("CANCELLED+", ("CANCELLED", None)),
        ("OUT_OF_ME+", ("OUT_OF_MEMORY", None)),
        ("NODE_FAIL", ("NODE_FAIL", None)),
        ("PD", ("PENDING", None)),
        ("CG", ("COMPLETING", None)),
        ("REQUEUE_HOLD", ("REQUEUED", None)),
        ("BOOT_FAIL", ("NODE_FAIL", None)),
        ("CONFIGURING", ("PENDING", None)),
        ("", ("UNKNOWN", None)),
        ("SOMETHING_NEW", ("UNKNOWN", None)),
    ],
)
def test_normalize_state(raw, want):
    got = slurm.normalize_state(raw)
    assert got == want and isinstance(got[0], JobState)


# Every job state Slurm documents (squeue(1), JOB STATE CODES): short code, long name.
SLURM_STATES = [
    ("BF", "BOOT_FAIL"), ("CA", "CANCELLED"), ("CD", "COMPLETED"), ("CF", "CONFIGURING"), ("CG", "COMPLETING"),
    ("DL", "DEADLINE"), ("F", "FAILED"), ("NF", "NODE_FAIL"), ("OOM", "OUT_OF_MEMORY"), ("PD", "PENDING"),
    ("PR", "PREEMPTED"), ("R", "RUNNING"), ("RD", "RESV_DEL_HOLD"), ("RF", "REQUEUE_FED"), ("RH", "REQUEUE_HOLD"),
    ("RQ", "REQUEUED"), ("RS", "RESIZING"), ("RV", "REVOKED"), ("SI", "SIGNALING"), ("SE", "SPECIAL_EXIT"),
    ("SO", "STAGE_OUT"), ("ST", "STOPPED"), ("S", "SUSPENDED"), ("TO", "TIMEOUT"),
]
ENDED = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "TIMEOUT", "REVOKED", "SPECIAL_EXIT"}
"""The states after which Slurm runs nothing more of the job (until a requeue)."""


@pytest.mark.parametrize("code, name", SLURM_STATES)
def test_every_slurm_state_maps_to_a_job_state(code, name):
    state, _ = slurm.normalize_state(name)
    assert isinstance(state, JobState) and state is not JobState.UNKNOWN
    assert slurm.normalize_state(code) == (state, None), "the short code means the same"
    assert state not in {JobState.PLANNED, JobState.STOPPING, JobState.STOPPED}, "prl's own states, not Slurm's"
    assert (state in TERMINAL_STATES) == (name in ENDED)
    assert row("1", state, "squeue").terminal == (name in ENDED)


@pytest.mark.parametrize(
    "text, want",
    [("1:0", (1, 0)), ("0:9", (0, 9)), ("", (None, None)), ("2", (2, 0))],
)
def test_parse_exit_code(text, want):
    assert slurm.parse_exit_code(text) == want


@pytest.mark.parametrize(
    "text, want",
    [("45", 45), ("1:02", 62), ("01:02:03", 3723), ("2-03:04:05", 183845), ("2-03", 183600), ("INVALID", None)],
)
def test_parse_duration(text, want):
    assert slurm.parse_duration(text) == want


def row(key: str, state: str, source: str, **kw) -> slurm.JobRow:
    job_id, off = slurm.split_job_key(key)
    return slurm.JobRow(job_id=job_id, het_offset=off, state=JobState(state), source=source, **kw)


def test_merge_prefers_terminal_then_sacct():
    live = {"3+0": row("3+0", "COMPLETING", "squeue", restarts=1), "3+1": row("3+1", "RUNNING", "squeue")}
    acct = {
        "3+0": row("3+0", "FAILED", "sacct", exit_code=3),
        "3+1": row("3+1", "PENDING", "sacct"),
    }
    merged = slurm.merge_rows(live, None, acct)
    assert merged["3+0"].state == "FAILED" and merged["3+0"].exit_code == 3
    assert merged["3+0"].restarts == 1  # kept from squeue
    assert merged["3+1"].state == "RUNNING" and merged["3+1"].source == "squeue"


@pytest.mark.parametrize(
    "states, want",
    [
        ([], "UNKNOWN"),
        (["COMPLETED", "COMPLETED"], "COMPLETED"),
        (["RUNNING", "COMPLETED"], "RUNNING"),
        (["RUNNING", "FAILED"], "FAILED"),
        (["PENDING", "RUNNING"], "RUNNING"),
        (["CANCELLED", "NODE_FAIL"], "NODE_FAIL"),
    ],
)
def test_merge_state_reports_the_worst_component(states, want):
    rows = [row(f"1+{i}", s, "sacct") for i, s in enumerate(states)]
    assert slurm.merge_state(rows) is JobState(want)


def test_query_jobs_falls_back_to_scontrol_without_accounting(fake):
    runner = fake(
        squeue=(0, "", ""),
        sacct=(1, "", "sacct: error: Slurm accounting storage is disabled\n"),
        scontrol=(0, SCONTROL, ""),
    )
    rows = slurm.query_jobs(["7"])
    assert [c[0] for c in runner.calls] == ["squeue", "sacct", "scontrol"]
    assert set(rows) == {"7+0", "7+1"}


def test_query_jobs_live_uses_one_command(fake):
    out = "".join(
        squeue_line(str(20 + i), "20", str(i), "r", "RUNNING", "None", "0:01", "n1", "0", "0", "0", "x", "")
        + "\n"
        for i in range(8)
    )  # fmt: skip
    runner = fake(squeue=(0, out, ""))
    rows = slurm.query_jobs([20])
    assert len(rows) == 8 and len(runner.calls) == 1


SACCT_RUNS = (
    "747+0|lab|NODE_FAIL|0:0|0:0|00:01:10|n1|2026-12-01T19:05:32|2026-12-01T19:06:42|None\n"
    "747+1|lab|NODE_FAIL|0:0|0:0|00:01:10|n2|2026-12-01T19:05:32|2026-12-01T19:06:42|None\n"
    "747+2|lab|NODE_FAIL|0:0|0:0|00:01:10|n[3-4]|2026-12-01T19:05:32|2026-12-01T19:06:42|None\n"
    "747+1|lab|RUNNING|0:0|0:0|00:00:40|n2|2026-12-01T19:07:14|Unknown|BeginTime\n"
    "747+0|lab|RUNNING|0:0|0:0|00:00:40|n1|2026-12-01T19:07:14|Unknown|BeginTime\n"
    "747+0.batch|batch|COMPLETED|0:0||00:00:03|n1|x|y|\n"
    "747+2|lab|RUNNING|0:0|0:0|00:00:40|n[3-4]|2026-12-01T19:07:14|Unknown|BeginTime\n"
).replace("|", S)


def test_sacct_runs_groups_a_requeued_job_s_runs_oldest_first(fake):
    runner = fake(sacct=(0, SACCT_RUNS, ""))
    runs = slurm.sacct_runs(747)
    assert "--duplicates" in runner.calls[0] and "--jobs=747" in runner.calls[0]
    assert [sorted(r) for r in runs] == [["747+0", "747+1", "747+2"]] * 2
    assert slurm.merge_state(runs[0].values()) == "NODE_FAIL" and runs[0]["747+2"].nodes == "n[3-4]"
    assert {r.state for r in runs[1].values()} == {"RUNNING"}
    fake(sacct=(1, "", "sacct: error: Slurm accounting storage is disabled\n"))
    assert slurm.sacct_runs(747) is None
