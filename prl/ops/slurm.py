"""The one module that runs Slurm commands; everything else gets parsed rows.

Every command goes through `RUNNER` (argv list, no shell). Unit tests swap it
for a fake (`monkeypatch.setattr(slurm, "RUNNER", fake)`); integration tests
use the real cluster from scripts/slurm-cluster.sh.

Two failure kinds, both from `prl.errors`:

- `SlurmError`: Slurm answered and refused (bad option, invalid account...).
  The message carries the command's own stderr.
- `SlurmUnavailable`: Slurm could not be asked (binary missing, controller or
  slurmdbd unreachable, timeout). Transient: status shows UNKNOWN, not FAILED.

Job ids. A heterogeneous job's components are separate Slurm jobs (123, 124)
that Slurm prints as `123+0`, `123+1`. Rows are keyed by that printed form
(`JobRow.key`); a plain job's key is its id. Every query takes any number of
job ids and runs a number of commands that does not grow with the number of
het components.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Mapping, Protocol, Sequence

from prl.errors import SlurmError, SlurmUnavailable
from prl.states import TERMINAL_STATES, JobState

DEFAULT_TIMEOUT = 60.0
"""Seconds a Slurm command may take; a busy controller can be slow."""

# ASCII unit separator: cannot occur in a job name typed on a command line,
# unlike "|" (sacct's default), which can.
SEP = "\x1f"


# --------------------------------------------------------------------------- runner


class Runner(Protocol):
    def __call__(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]: ...


def subprocess_runner(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run one command, capture text output, never raise on a non-zero exit."""
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )


RUNNER: Runner = subprocess_runner
"""The function every Slurm command goes through; tests replace it."""

_commands_run = 0


def commands_run() -> int:
    """Slurm commands this process has run so far (`prl status` reports how many one refresh took)."""
    return _commands_run


# Slurm's words for "could not reach the daemon", as opposed to "refused".
_UNREACHABLE = re.compile(
    r"Unable to contact slurm controller|Socket timed out|Connection refused|"
    r"Connection timed out|Zero Bytes were transmitted|Unable to establish "
    r"connection|Problem talking to the database|persistent connection|"
    r"Munge encode failed|Invalid authentication credential|"
    r"Communication connection failure|Transport endpoint is not connected",
    re.IGNORECASE,
)


def run_slurm(
    argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT, *, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a Slurm command through `RUNNER`.

    Raises SlurmUnavailable when the binary is missing, the command times out
    or its stderr says a daemon could not be reached; with `check`, raises
    SlurmError with the command's own message for any other non-zero exit.
    """
    global _commands_run
    argv = [str(a) for a in argv]
    _commands_run += 1
    try:
        proc = RUNNER(argv, timeout)
    except FileNotFoundError as e:
        raise SlurmUnavailable(
            f"{argv[0]}: command not found; run this on a Slurm login node "
            "or start the test cluster (scripts/slurm-cluster.sh start)"
        ) from e
    except subprocess.TimeoutExpired as e:
        raise SlurmUnavailable(
            f"`{_show(argv)}` did not answer within {timeout:g}s; the controller may be overloaded"
        ) from e
    if proc.returncode != 0 and _UNREACHABLE.search(proc.stderr or ""):
        raise SlurmUnavailable(f"`{_show(argv)}`: {_message(proc)}")
    if check and proc.returncode != 0:
        raise SlurmError(f"`{_show(argv)}` failed (exit {proc.returncode}): {_message(proc)}")
    return proc


def _show(argv: Sequence[str]) -> str:
    return " ".join(a if a and " " not in a else repr(a) for a in argv[:6]) + (
        " ..." if len(argv) > 6 else ""
    )


def _message(proc: subprocess.CompletedProcess[str]) -> str:
    """Slurm's own stderr, minus the `sbatch: error: ` prefixes."""
    lines = [
        re.sub(r"^\S+: (error|fatal): ", "", line).strip()
        for line in (proc.stderr or "").splitlines()
    ]
    text = "; ".join(line for line in lines if line)
    return text or (proc.stdout or "").strip() or "no message"


# --------------------------------------------------------------------------- rows

# Slurm's other names for the states prl knows (prl.states.JobState), by the state they mean.
_ALIASES_OF = {
    JobState.PENDING: ("PD", "CF", "RD", "CONFIGURING", "RESV_DEL_HOLD"),
    JobState.RUNNING: ("R", "SI", "RS", "SIGNALING", "RESIZING"),
    JobState.COMPLETING: ("CG", "SO", "STAGE_OUT"),
    JobState.COMPLETED: ("CD",),
    JobState.FAILED: ("F", "SE", "SPECIAL_EXIT"),
    JobState.CANCELLED: ("CA", "RV", "REVOKED"),
    JobState.TIMEOUT: ("TO", "DL", "DEADLINE"),
    JobState.NODE_FAIL: ("NF", "BF", "BOOT_FAIL"),
    JobState.OUT_OF_MEMORY: ("OOM",),
    JobState.PREEMPTED: ("PR",),
    JobState.REQUEUED: ("RQ", "RH", "RF", "REQUEUE_HOLD", "REQUEUE_FED"),
    JobState.SUSPENDED: ("S", "ST", "STOPPED"),
}
_STATE_ALIASES = {alias: state for state, aliases in _ALIASES_OF.items() for alias in aliases}
_KNOWN = frozenset(_ALIASES_OF)
"""The states Slurm prints under prl's own names (prl's STOPPED is not one: Slurm's STOPPED is SUSPENDED)."""


def normalize_state(raw: str) -> tuple[JobState, int | None]:
    """Slurm's state text -> (normalized state, uid that cancelled or None).

    Handles `CANCELLED by 1000`, `CANCELLED+` (sacct cuts long names to its
    column width and marks the cut with +), short squeue codes and flags
    like `RUNNING+REQUEUED` or `PENDING,RESV_DEL_HOLD` (first word wins).
    """
    text = (raw or "").strip().upper()
    cancelled_by = None
    m = re.match(r"^CANCELLED\s+BY\s+(\d+)", text)
    if m:
        text, cancelled_by = JobState.CANCELLED.value, int(m.group(1))
    word = re.split(r"[\s+,]", text, maxsplit=1)[0] if text else ""
    if not word:
        return JobState.UNKNOWN, cancelled_by
    if word in _KNOWN:
        return JobState(word), cancelled_by
    if word in _STATE_ALIASES:
        return _STATE_ALIASES[word], cancelled_by
    # A width-truncated name: the one known state it is a prefix of.
    matches = {s for s in (*map(str, _KNOWN), *_STATE_ALIASES) if len(word) >= 3 and s.startswith(word)}
    resolved = {_STATE_ALIASES.get(s) or JobState(s) for s in matches}
    if len(resolved) == 1:
        return resolved.pop(), cancelled_by
    return JobState.UNKNOWN, cancelled_by


@dataclass(frozen=True)
class JobRow:
    """One job, or one component of a heterogeneous job, as Slurm reported it."""

    job_id: str
    """The job id without het suffix: the het leader's id for a component."""
    het_offset: int | None
    """Component index in a heterogeneous job (the N in 123+N); None for a plain job."""
    state: JobState
    """Normalized: a TERMINAL_STATES member, PENDING, RUNNING, COMPLETING, REQUEUED, SUSPENDED or UNKNOWN."""
    raw_state: str = ""
    """The state exactly as Slurm printed it (`CANCELLED by 0`)."""
    reason: str = ""
    """Slurm's reason (`Resources`, `NonZeroExitCode`, ...); empty when `None`."""
    exit_code: int | None = None
    """The batch script's (or allocation's) exit code; None while it runs or when unknown."""
    signal: int | None = None
    """The signal that ended it (0 = none); None when unknown."""
    derived_exit_code: int | None = None
    """Highest exit code of the job's steps (a failed srun in a job that exited 0)."""
    elapsed: int | None = None
    """Seconds run so far, or in all."""
    nodes: str = ""
    """Compressed node list (`n[1-2]`); empty while pending."""
    cancelled_by: int | None = None
    """Uid that cancelled it (from sacct's `CANCELLED by UID`)."""
    name: str = ""
    start: str = ""
    """Start time as Slurm prints it (ISO-like, local time); empty if not started."""
    end: str = ""
    """End time; empty while it runs."""
    restarts: int | None = None
    """How often it was requeued (squeue/scontrol only)."""
    source: str = ""
    """Which command reported it: squeue, sacct or scontrol."""

    @property
    def key(self) -> str:
        """`123+1` for a het component, `123` for a plain job."""
        return self.job_id if self.het_offset is None else f"{self.job_id}+{self.het_offset}"

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES


# --------------------------------------------------------------------------- field parsers


def split_job_key(text: str) -> tuple[str, int | None]:
    """`123+1` -> ("123", 1); `123` -> ("123", None)."""
    base, plus, offset = text.strip().partition("+")
    if plus and offset.isdigit():
        return base, int(offset)
    return text.strip(), None


def parse_exit_code(text: str) -> tuple[int | None, int | None]:
    """`1:0` -> (1, 0); `0:9` -> (0, 9): Slurm's `code:signal`. Empty -> (None, None)."""
    text = (text or "").strip()
    m = re.fullmatch(r"(\d+):(\d+)", text)
    if m:
        return int(m.group(1)), int(m.group(2))
    if text.isdigit():
        return int(text), 0
    return None, None


def parse_wait_status(text: str) -> tuple[int | None, int | None]:
    """squeue's exit_code/DerivedEC: a raw wait status (1792 = exit 7, 9 = signal 9)."""
    text = (text or "").strip()
    if not text.isdigit():
        return parse_exit_code(text)
    status = int(text)
    return (status >> 8) & 0xFF, status & 0x7F


def parse_duration(text: str) -> int | None:
    """Slurm durations -> seconds: `45`, `1:02`, `01:02:03`, `2-03:04:05`, `1:02.345`."""
    text = (text or "").strip()
    if not text or text.upper() in {"INVALID", "UNLIMITED", "N/A", "NONE"}:
        return None
    days = 0
    if "-" in text:
        d, _, text = text.partition("-")
        if not d.isdigit():
            return None
        days = int(d)
    parts = text.split(":")
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        return None
    if len(nums) > 3:
        return None
    if days and len(nums) == 1:  # "2-03" is days-hours
        nums = [nums[0], 0, 0]
    while len(nums) < 3:
        nums.insert(0, 0.0)
    h, m, s = nums
    return int(days * 86400 + h * 3600 + m * 60 + s)


def _clean(text: str) -> str:
    text = (text or "").strip()
    return "" if text in {"None", "(null)", "None assigned", "Unknown", "N/A", "NONE"} else text


def _int_or_none(text: str) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None


# --------------------------------------------------------------------------- sbatch


def sbatch(
    script_path: str | Path,
    *,
    extra_args: Sequence[str] = (),
    timeout: float = DEFAULT_TIMEOUT,
) -> int:
    """Submit a batch script; return the job id (a het job's leader id).

    Raises SlurmError with sbatch's own message when Slurm refuses the job.
    """
    proc = run_slurm(["sbatch", "--parsable", *extra_args, str(script_path)], timeout)
    return parse_sbatch_output(proc.stdout)


def parse_sbatch_output(stdout: str) -> int:
    """`--parsable` prints `123` or `123;cluster` (federations) on the last line."""
    for line in reversed((stdout or "").strip().splitlines()):
        m = re.fullmatch(r"(\d+)(;\S+)?", line.strip())
        if m:
            return int(m.group(1))
    raise SlurmError(f"sbatch printed no job id: {stdout.strip()!r}")


# --------------------------------------------------------------------------- squeue

# squeue -O field names, in order. `JobID` prints a component's own id (124),
# so the het form comes from HetJobID + HetJobOffset. `:0` = no padding and
# no truncation; the suffix after the width is the separator.
_SQUEUE_FIELDS = (
    "JobID", "HetJobID", "HetJobOffset", "Name", "State", "Reason", "TimeUsed",
    "NodeList", "exit_code", "DerivedEC", "RestartCnt", "StartTime", "EndTime",
)  # fmt: skip
SQUEUE_FORMAT = ",".join(f"{f}:0{SEP}" for f in _SQUEUE_FIELDS)


def squeue_jobs(job_ids: Iterable[str | int], *, timeout: float = DEFAULT_TIMEOUT) -> dict[str, JobRow]:
    """Rows the controller still holds for these jobs (all het components),
    keyed by `JobRow.key`. One squeue call.

    `-t all` includes jobs that ended less than MinJobAge ago, with their exit
    codes. A job the controller has forgotten is simply absent.
    """
    ids = _id_list(job_ids)
    if not ids:
        return {}
    proc = run_slurm(
        ["squeue", "--noheader", "--states=all", f"--jobs={','.join(ids)}", f"--Format={SQUEUE_FORMAT}"],
        timeout,
        check=False,
    )
    if proc.returncode != 0:
        # A single id the controller no longer knows is an error for squeue.
        if "Invalid job id" in (proc.stderr or ""):
            return {}
        raise SlurmError(f"squeue failed (exit {proc.returncode}): {_message(proc)}")
    return parse_squeue(proc.stdout)


def parse_squeue(stdout: str) -> dict[str, JobRow]:
    rows: dict[str, JobRow] = {}
    n = len(_SQUEUE_FIELDS)
    for line in (stdout or "").splitlines():
        if not line.strip():
            continue
        f = dict(zip(_SQUEUE_FIELDS, line.split(SEP)[:n]))
        if len(f) < n:
            raise SlurmError(f"unexpected squeue line (want {n} fields): {line!r}")
        het_offset = _int_or_none(f["HetJobOffset"])
        job_id = f["HetJobID"].strip() if het_offset is not None else f["JobID"].strip()
        state, cancelled_by = normalize_state(f["State"])
        code, sig = parse_wait_status(f["exit_code"]) if state in TERMINAL_STATES else (None, None)
        derived, _ = parse_wait_status(f["DerivedEC"]) if state in TERMINAL_STATES else (None, None)
        row = JobRow(
            job_id=job_id,
            het_offset=het_offset,
            state=state,
            raw_state=f["State"].strip(),
            reason=_clean(f["Reason"]),
            exit_code=code,
            signal=sig,
            derived_exit_code=derived,
            elapsed=parse_duration(f["TimeUsed"]),
            nodes=_clean(f["NodeList"]),
            cancelled_by=cancelled_by,
            name=f["Name"],
            start=_clean(f["StartTime"]),
            end=_clean(f["EndTime"]),
            restarts=_int_or_none(f["RestartCnt"]),
            source="squeue",
        )
        rows[row.key] = row
    return rows


# --------------------------------------------------------------------------- sacct

_SACCT_FIELDS = (
    "JobID", "JobName", "State", "ExitCode", "DerivedExitCode", "Elapsed",
    "NodeList", "Start", "End", "Reason",
)  # fmt: skip


def sacct_jobs(
    job_ids: Iterable[str | int], *, timeout: float = DEFAULT_TIMEOUT
) -> dict[str, JobRow] | None:
    """Accounting rows for these jobs' allocations (all het components),
    keyed by `JobRow.key`; None when the cluster keeps no accounting.
    One sacct call.

    `-X` keeps allocation rows only (no `.batch`/`.0` steps). Without
    `--duplicates` sacct reports a requeued job's latest run.
    Raises SlurmUnavailable when slurmdbd cannot be reached.
    """
    ids = _id_list(job_ids)
    if not ids:
        return {}
    out = _sacct([f"--jobs={','.join(ids)}"], timeout)
    return None if out is None else parse_sacct(out)


def sacct_runs(job_id: str | int, *, timeout: float = DEFAULT_TIMEOUT) -> list[dict[str, JobRow]] | None:
    """Every run of a job, oldest first (a requeued job runs again under the same id): each run's component
    rows keyed by `JobRow.key`. One `sacct --duplicates` call; None when the cluster keeps no accounting."""
    out = _sacct(["--duplicates", f"--jobs={job_id}"], timeout)
    return None if out is None else parse_sacct_runs(out)


def _sacct(args: list[str], timeout: float) -> str | None:
    """sacct's allocation rows (our fields, SEP-delimited) for `args`; None when accounting is disabled."""
    proc = run_slurm(
        ["sacct", "--noheader", "--parsable2", f"--delimiter={SEP}", "--allocations", *args,
         f"--format={','.join(_SACCT_FIELDS)}"],
        timeout,
        check=False,
    )
    if proc.returncode != 0:
        if "accounting storage is disabled" in (proc.stderr or "").lower():
            return None
        raise SlurmError(f"sacct failed (exit {proc.returncode}): {_message(proc)}")
    return proc.stdout


def parse_sacct_runs(stdout: str) -> list[dict[str, JobRow]]:
    """`sacct --duplicates` rows grouped into runs: the components of one run started together."""
    runs: dict[str, dict[str, JobRow]] = {}
    for line in (stdout or "").splitlines():
        row = _sacct_row(line)
        if row is not None:
            runs.setdefault(row.start or "", {})[row.key] = row
    return [runs[start] for start in sorted(runs, key=lambda s: (s == "", s))]


def parse_sacct(stdout: str) -> dict[str, JobRow]:
    rows: dict[str, JobRow] = {}
    for line in (stdout or "").splitlines():
        row = _sacct_row(line)
        if row is not None:
            rows[row.key] = row
    return rows


def _sacct_row(line: str) -> JobRow | None:
    """One allocation row of sacct's output (None for a blank line or a step row)."""
    n = len(_SACCT_FIELDS)
    if not line.strip():
        return None
    # -P output with the default "|" delimiter is accepted too (fakes, old callers).
    parts = line.split(SEP) if SEP in line else line.split("|")
    if len(parts) < n:
        raise SlurmError(f"unexpected sacct line (want {n} fields): {line!r}")
    f = dict(zip(_SACCT_FIELDS, parts))
    key = f["JobID"].strip()
    if "." in key:  # a step row (123.batch, 123+0.0): -X should have dropped it
        return None
    job_id, het_offset = split_job_key(key)
    state, cancelled_by = normalize_state(f["State"])
    terminal = state in TERMINAL_STATES
    code, sig = parse_exit_code(f["ExitCode"]) if terminal else (None, None)
    derived, _ = parse_exit_code(f["DerivedExitCode"]) if terminal else (None, None)
    return JobRow(
        job_id=job_id,
        het_offset=het_offset,
        state=state,
        raw_state=f["State"].strip(),
        reason=_clean(f["Reason"]),
        exit_code=code,
        signal=sig,
        derived_exit_code=derived,
        elapsed=parse_duration(f["Elapsed"]),
        nodes=_clean(f["NodeList"]),
        cancelled_by=cancelled_by,
        name=f["JobName"],
        start=_clean(f["Start"]),
        end=_clean(f["End"]),
        source="sacct",
    )


# --------------------------------------------------------------------------- scontrol

# `scontrol show job -o` prints Key=Value pairs separated by spaces, but a few
# values (Reason, Command, Comment, WorkDir with spaces) contain spaces. A new
# pair starts only where a space is followed by a key and "=".
_SCONTROL_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/.\-]*)=")


def parse_scontrol_line(line: str) -> dict[str, str]:
    """One `scontrol show job -o` line -> {key: value}."""
    line = line.strip()
    matches = list(_SCONTROL_KEY.finditer(line))
    out: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    return out


def scontrol_show_job(job_id: str | int, *, timeout: float = DEFAULT_TIMEOUT) -> list[dict[str, str]] | None:
    """Every component of a job as {key: value} (one dict per het component,
    in offset order); None when the controller does not know the job (never
    existed, or ended more than MinJobAge ago). One scontrol call.
    """
    proc = run_slurm(["scontrol", "show", "job", "--oneliner", str(job_id)], timeout, check=False)
    if proc.returncode != 0:
        if "Invalid job id" in (proc.stderr or ""):
            return None
        raise SlurmError(f"scontrol show job {job_id} failed (exit {proc.returncode}): {_message(proc)}")
    return [parse_scontrol_line(line) for line in proc.stdout.splitlines() if line.strip()]


def scontrol_rows(records: Iterable[Mapping[str, str]]) -> dict[str, JobRow]:
    """`scontrol_show_job` dicts -> JobRows keyed like squeue's."""
    rows: dict[str, JobRow] = {}
    for r in records:
        het_offset = _int_or_none(r.get("HetJobOffset", ""))
        job_id = r.get("HetJobId", "") if het_offset is not None else r.get("JobId", "")
        state, cancelled_by = normalize_state(r.get("JobState", ""))
        terminal = state in TERMINAL_STATES
        code, sig = parse_exit_code(r.get("ExitCode", "")) if terminal else (None, None)
        derived, _ = parse_exit_code(r.get("DerivedExitCode", "")) if terminal else (None, None)
        row = JobRow(
            job_id=job_id,
            het_offset=het_offset,
            state=state,
            raw_state=r.get("JobState", ""),
            reason=_clean(r.get("Reason", "")),
            exit_code=code,
            signal=sig,
            derived_exit_code=derived,
            elapsed=parse_duration(r.get("RunTime", "")),
            nodes=_clean(r.get("NodeList", "")),
            cancelled_by=cancelled_by,
            name=r.get("JobName", ""),
            start=_clean(r.get("StartTime", "")),
            end=_clean(r.get("EndTime", "")),
            restarts=_int_or_none(r.get("Restarts", "")),
            source="scontrol",
        )
        rows[row.key] = row
    return rows


# --------------------------------------------------------------------------- actions


def scancel(job_id: str | int, *, signal: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Cancel a job (all its het components), or send it `signal` (e.g. "TERM")."""
    argv = ["scancel"]
    if signal:
        argv.append(f"--signal={signal}")
    run_slurm([*argv, str(job_id)], timeout)


def scontrol_requeue(job_id: str | int, *, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Requeue a job: its steps are killed and it goes back to PENDING."""
    run_slurm(["scontrol", "requeue", str(job_id)], timeout)


# --------------------------------------------------------------------------- merging

# Which source to believe for a component. A live job: the controller
# (squeue, then scontrol). An ended one: accounting has the exit code and
# keeps it after the controller forgets, so sacct wins among terminal rows.
_LIVE_ORDER = {"squeue": 0, "scontrol": 1, "sacct": 2}
_DONE_ORDER = {"sacct": 0, "squeue": 1, "scontrol": 2}


def merge_rows(*sources: Mapping[str, JobRow] | None) -> dict[str, JobRow]:
    """Combine squeue/sacct/scontrol results (None = source unavailable) into
    one row per component. A terminal row beats a live one (the job ended
    between two queries); among equals the order above decides.
    """
    by_key: dict[str, list[JobRow]] = {}
    for source in sources:
        for key, row in (source or {}).items():
            by_key.setdefault(key, []).append(row)
    merged: dict[str, JobRow] = {}
    for key, candidates in by_key.items():
        done = [r for r in candidates if r.terminal]
        if done:
            best = min(done, key=lambda r: _DONE_ORDER.get(r.source, 9))
            # squeue/scontrol know the restart count; sacct does not.
            restarts = next((r.restarts for r in candidates if r.restarts is not None), None)
            merged[key] = replace(best, restarts=restarts)
        else:
            merged[key] = min(candidates, key=lambda r: _LIVE_ORDER.get(r.source, 9))
    return dict(sorted(merged.items(), key=lambda kv: _sort_key(kv[1])))


# The state that describes a het job as a whole: the worst component. A failed
# component dooms the job even while others still run.
_SEVERITY = (
    JobState.NODE_FAIL, JobState.OUT_OF_MEMORY, JobState.FAILED, JobState.TIMEOUT, JobState.CANCELLED,
    JobState.PREEMPTED, JobState.REQUEUED, JobState.UNKNOWN, JobState.SUSPENDED, JobState.RUNNING,
    JobState.COMPLETING, JobState.PENDING, JobState.COMPLETED,
)  # fmt: skip


def merge_state(rows: Iterable[JobRow]) -> JobState:
    """One state for a job from its components' rows (UNKNOWN if there are none).

    Worst first: a failure of any component, then running, then pending;
    COMPLETED only when every component completed.
    """
    states = {r.state for r in rows}
    if not states:
        return JobState.UNKNOWN
    for state in _SEVERITY:
        if state in states:
            return state
    return JobState.UNKNOWN


def query_jobs(job_ids: Iterable[str | int], *, timeout: float = DEFAULT_TIMEOUT) -> dict[str, JobRow]:
    """Best current rows for these jobs: squeue, then sacct for what the
    controller no longer shows, then scontrol only if sacct is disabled.

    At most 2 commands, plus one `scontrol show job` per job id without
    accounting; never one per het component. Raises SlurmUnavailable if the
    controller cannot be reached. A job nobody knows is absent.
    """
    ids = _id_list(job_ids)
    live = squeue_jobs(ids, timeout=timeout)
    if all(any(_base(k) == i for k in live) for i in ids) and not any(r.terminal for r in live.values()):
        return merge_rows(live)
    try:
        acct = sacct_jobs(ids, timeout=timeout)
    except SlurmUnavailable:
        # slurmdbd unreachable: what the controller still holds is the truth we have.
        if live:
            return merge_rows(live)
        raise
    if acct is not None:
        return merge_rows(live, acct)
    found: dict[str, JobRow] = {}
    for i in ids:
        if any(_base(k) == i for k in live):
            continue
        records = scontrol_show_job(i, timeout=timeout)
        found.update(scontrol_rows(records or []))
    return merge_rows(live, found)


# --------------------------------------------------------------------------- helpers


def _id_list(job_ids: Iterable[str | int]) -> list[str]:
    """Unique base ids in order; `123+1` asks for job 123 (all components)."""
    out: list[str] = []
    for j in job_ids:
        base = _base(str(j))
        if not re.fullmatch(r"\d+(_\d+)?", base):
            raise ValueError(f"not a Slurm job id: {j!r}")
        if base not in out:
            out.append(base)
    return out


def _base(key: str) -> str:
    return split_job_key(key)[0]


def _sort_key(row: JobRow) -> tuple[int, str, int]:
    return (int(row.job_id) if row.job_id.isdigit() else 0, row.job_id, row.het_offset or 0)
