"""The trainer tests' rank zygote (testkit/rank_zygote.py) starts ranks that train as torchrun's do, stops the rest
when one fails, and leaves no rank behind a launch that runs past its timeout."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from testkit import rank_zygote
from prl.run.rundir import is_stable
from tests.helpers import processes
from tests.test_trainer_parallel import _files_state, _vocab
from tests.tiny_model import build_tiny_model
from testkit.trainer_helpers import launch, setup_run


def test_the_first_rank_to_fail_stops_the_others(monkeypatch):
    monkeypatch.setattr(rank_zygote, "GRACE_S", 0.2)
    pids = []
    for exit_code in (3, None):
        pid = os.fork()
        if pid == 0:  # a rank that fails, and one that would wait for it forever (and ignores SIGTERM)
            os.setpgid(0, 0)
            if exit_code is None:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                time.sleep(60)
            os._exit(exit_code or 0)
        pids.append(pid)
    started = time.monotonic()
    assert rank_zygote.reap(pids) == [3, -signal.SIGKILL]
    assert time.monotonic() - started < 30


@pytest.mark.slow  # a torchrun launch (~8 s) beside the forked ones
def test_forked_ranks_train_and_publish_as_torchrun_s_and_a_timeout_leaves_none_behind(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    runs = {name: setup_run(tmp_path / name, model, range(1, 4), _vocab(model), max_steps=3, checkpoint_interval=2)
            for name in ("late", "torchrun", "forked")}
    with pytest.raises(TimeoutError):
        launch(runs["late"], 2, resume="none", timeout=0.5)
    assert not is_stable(runs["late"].weights(3))  # killed, not waited for
    left = [pid for pid, _, cmd in processes() if str(runs["late"].root) in cmd]
    assert not left, left  # (a forked rank's command line is the zygote's: its environment names the run)
    assert not [pid for pid in zygote_children() if str(runs["late"].root).encode() in environ(pid)]

    launch(runs["torchrun"], 2, resume="none", torchrun=True)
    out = launch(runs["forked"], 2, resume="none").stdout
    assert "[prl trainer.0]" in out and "[prl trainer.1]" in out, out
    a, b = (runs[name].read_metrics("trainer") for name in ("torchrun", "forked"))
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in a] == [(m["step"], m["loss"], m["grad_norm"]) for m in b]
    wa, wb = (_files_state(runs[name].weights(3)) for name in ("torchrun", "forked"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def zygote_children() -> list[int]:
    zygote = rank_zygote._zygote
    assert zygote is not None and zygote.proc.poll() is None
    return [pid for pid, ppid, _ in processes() if ppid == zygote.proc.pid]


def environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""
