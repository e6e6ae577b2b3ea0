"""`prl plot` and `prl wandb`: metrics.jsonl joined by step, drawn as a PNG, logged as one W&B run."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from prl.ops.metrics import series, step_rows
from prl.run.rundir import RunDir
from testkit.plans import local_plan, write_plan

REPO = Path(__file__).resolve().parents[1]


def records(steps: int, reward_slope: float = 0.1) -> list[dict]:
    out = []
    for step in range(1, steps + 1):
        out.append({"role": "orchestrator", "step": step, "time": 1.0 * step, "reward_mean": reward_slope * step,
                    "reward_min": 0.0, "reward_max": 1.0, "policy_lag_mean": 1.0, "first_error": "text is skipped"})
        out.append({"role": "trainer", "step": step, "time": 1.0 * step, "loss": 1.0 / step, "tokens_per_s": 100.0,
                    "step_s": 0.5})
        for server, seconds in (("a:1", 0.1), ("b:2", 0.3)):
            out.append({"role": "inference", "step": step, "event": "weights_loaded", "server": server,
                        "weight_update_s": seconds, "time": 1.0})
        if step % 2 == 0:
            out.append({"role": "orchestrator", "step": step, "eval": True, "reward_mean": 0.5, "time": 1.0})
    return out


def make_run(tmp_path: Path, tiny_model_dir: Path, name: str, recs: list[dict]) -> RunDir:
    run = write_plan(RunDir(tmp_path / name), local_plan(tmp_path / name, tiny_model_dir))
    for rec in recs:
        run.append_metrics(rec)
    return run


def test_rows_join_roles_by_step_and_keep_a_redone_steps_last_record():
    recs = records(3)
    recs.append({"role": "trainer", "step": 2, "loss": 9.0, "time": 5.0})  # a requeued attempt redid step 2
    rows = step_rows(recs)
    assert list(rows) == [1, 2, 3]
    assert rows[2]["trainer/loss"] == 9.0 and "trainer/tokens_per_s" not in rows[2]
    assert rows[1]["orchestrator/reward_mean"] == pytest.approx(0.1)
    assert rows[2]["eval/reward_mean"] == 0.5 and "eval/reward_mean" not in rows[1]
    assert rows[1]["inference/weight_update_s"] == pytest.approx(0.2)
    assert rows[1]["inference/weight_update_s_max"] == pytest.approx(0.3)
    assert not any(k.endswith(("/first_error", "/time", "/step", "/event")) for row in rows.values() for k in row)
    assert series(rows, "eval/reward_mean") == ([2], [0.5])


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG, after checking its signature and the IHDR chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR"
    body = data[16:16 + length]
    (crc,) = struct.unpack(">I", data[16 + length:20 + length])
    assert zlib.crc32(kind + body) == crc
    return struct.unpack(">II", body[:8])


def test_prl_plot_writes_a_png_that_follows_the_data(tmp_path, tiny_model_dir):
    rising = make_run(tmp_path, tiny_model_dir, "rising", records(6, 0.1))
    falling = make_run(tmp_path, tiny_model_dir, "falling", records(6, -0.1))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "prl.cli", "plot", str(rising.root)], capture_output=True,
                         text=True, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    first = rising.progress_png.read_bytes()
    width, height = png_size(first)
    assert width > 400 and height > 300
    assert oct(rising.progress_png.stat().st_mode & 0o777) == "0o600"

    from prl.ops.plot import plot

    other = plot(falling, [], None).read_bytes()
    assert other != first  # different data, different picture
    both = tmp_path / "both.png"
    plot(rising, [falling], both)
    assert both.read_bytes() not in (first, other)


def test_prl_plot_draws_an_sft_runs_loss(tmp_path, tiny_model_dir):
    """An SFT run records trainer metrics only: its loss curve is what the picture must show."""
    from prl.ops.plot import plot

    def sft(name: str, slope: float) -> bytes:
        recs = [{"role": "trainer", "step": s, "loss": 5.0 - slope * s, "entropy": 2.0, "tokens_per_s": 100.0,
                 "step_s": 0.5} for s in range(1, 7)]
        return plot(make_run(tmp_path, tiny_model_dir, name, recs), [], tmp_path / f"{name}.png").read_bytes()

    assert sft("learns", 0.5) != sft("stalls", 0.0)


def test_prl_plot_of_a_run_without_metrics_is_one_line_and_exit_2(tmp_path, tiny_model_dir):
    run = make_run(tmp_path, tiny_model_dir, "empty", [])
    out = subprocess.run([sys.executable, "-m", "prl.cli", "plot", str(run.root)], capture_output=True, text=True,
                         cwd=REPO)
    assert out.returncode == 2
    assert out.stderr.strip() == f"error: {run.root}: no metrics yet ({run.metrics_jsonl} is empty or missing)"
    assert not run.progress_png.exists()


@pytest.mark.parametrize(("command", "module", "extra"), [("plot", "matplotlib", "plot"), ("wandb", "wandb", "wandb")])
def test_a_missing_extra_is_one_line_naming_it(tmp_path, tiny_model_dir, monkeypatch, capsys, command, module, extra):
    from prl.cli import main

    run = make_run(tmp_path, tiny_model_dir, "run", records(2))
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ModuleNotFoundError
    argv = [command, str(run.root)] + (["--project", "p"] if command == "wandb" else [])
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: prl {command} needs the {module} package: pip install 'prl[{extra}]'"


def wandb_history(run_file: Path) -> list[dict] | None:
    """The history rows of an offline W&B run: its .wandb file is a LevelDB-style log of protobuf Records.
    None while the file has no exit record yet: W&B's service process writes it after wandb.finish() returns."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, rows, exited = 32768, 7, b"", [], False
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (length == 0 and kind == 0) or pos + 7 + length > len(data):  # the end, or a record still being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
            exited |= record.WhichOneof("record_type") == "exit"
    return rows if exited else None


def finished_history(run_file: Path, timeout: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while (rows := wandb_history(run_file)) is None:
        assert time.monotonic() < deadline, f"{run_file} has no exit record after {timeout:.0f} s"
        time.sleep(0.2)
    return rows


def test_prl_wandb_logs_one_row_per_step_and_continues_the_same_run(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from prl.ops.wandb_sync import sync

    from prl.run.records import RolloutRecord, RolloutSample, Turn

    run = make_run(tmp_path, tiny_model_dir, "run", records(3))
    run.write_rollout_sample(RolloutSample(step=2, rollouts=8, records=[
        RolloutRecord(group=0, index=i, env="e", reward=0.5 * i, fate="trained", advantage=0.1,
                      conversation=[Turn(role="user", text="hi"), Turn(role="assistant", text=f"reply {i}")])
        for i in range(2)]))
    assert sync(run, "prl-test", ended=lambda r: False) == 2  # step 3 may still get records
    first_id = run.read_wandb_cursor().id
    for rec in records(5)[len(records(3)):]:
        run.append_metrics(rec)
    assert sync(run, "prl-test", ended=lambda r: True) == 3  # steps 3..5, nothing twice
    assert (run.read_wandb_cursor().id, run.read_wandb_cursor().step) == (first_id, 5)

    files = sorted(run.wandb_dir.glob(f"offline-run-*-{first_id}/run-{first_id}.wandb"))
    assert len(files) == 2  # one W&B run id, synced twice
    rows = [row for f in files for row in finished_history(f)]
    assert [row["_step"] for row in rows] == [1, 2, 3, 4, 5]
    assert rows[1]["eval/reward_mean"] == 0.5 and "eval/reward_mean" not in rows[0]
    assert rows[4]["trainer/loss"] == pytest.approx(0.2)
    assert rows[0]["orchestrator/reward_mean"] == pytest.approx(0.1)
    assert rows[0]["inference/weight_update_s"] == pytest.approx(0.2)
    # step 2's sampled rollouts, as a table (a file of the run, its shape in the row)
    assert rows[1]["rollouts/_type"] == "table-file" and rows[1]["rollouts/nrows"] == 2
    assert "rollouts/_type" not in rows[0]
    table = json.loads(next(run.wandb_dir.glob("offline-run-*/files/" + rows[1]["rollouts/path"])).read_text())
    assert table["columns"][-1] == "conversation" and "[assistant] reply 1" in table["data"][1][-1]


def test_the_launcher_s_follower_ends_with_its_attempt(tmp_path, tiny_model_dir):
    from prl.ops.wandb_sync import attempt_ended
    from prl.run.records import LauncherRecord
    from prl.run.rundir import atomic_write_json
    from prl.states import LauncherStatus

    run = make_run(tmp_path, tiny_model_dir, "run", records(1))
    for status, ended in (("starting", False), ("running", False), ("stopping", False), ("completed", True),
                          ("failed", True), ("requeued", True), ("stopped", True)):
        atomic_write_json(run.launcher_state, LauncherRecord(attempt=2, status=LauncherStatus(status)))
        assert attempt_ended(run, 2) is ended, status
    atomic_write_json(run.launcher_state, LauncherRecord(attempt=3, status=LauncherStatus.RUNNING))
    assert attempt_ended(run, 2)  # the next attempt took over (its own follower continues the W&B run)
