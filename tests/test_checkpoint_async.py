"""Background checkpoints (`training.checkpoint_async`) with the real trainer on 2 gloo ranks.

- a resume from a background checkpoint equals a resume from a blocking one (the files themselves, then the
  resumed steps' losses and weights);
- at most one write in flight: the next checkpoint step waits for it; retention keeps the newest STABLE
  checkpoint meanwhile; STABLE only once the write is done;
- SIGTERM during a write: the trainer waits for it and publishes it; killed while it waits (a requeue's kill),
  the checkpoint stays unmarked and the resume starts from the one before;
- a write that fails (a full disk under checkpoints/): no STABLE, the run fails naming the checkpoint.

A write is held in flight by a test-only wrapper around DCP's own file writer (`GATED_TRAINER`): it waits while
GATES/hold_N exists, then writes as DCP does. Everything else is the trainer as the job runs it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from prl.run.batch import publish_batch
from prl.run.rundir import RunDir, is_stable
from tests.tiny_model import build_tiny_model
from testkit.ports import free_port
from testkit.trainer_helpers import REPO, launch, make_samples, setup_run

pytestmark = pytest.mark.slow  # torchrun on 2 CPU ranks, ~15 s a run

GATED_TRAINER = textwrap.dedent("""
    import os, re, sys, time
    from pathlib import Path
    from torch.distributed.checkpoint import filesystem

    gates = Path(os.environ["PRL_TEST_GATES"])
    write_data = filesystem._FileSystemWriter.write_data

    def held(self, plan, planner):
        step = re.search(r"step_(\\d+)", str(self.path)).group(1)
        while (gates / f"hold_{step}").exists():
            time.sleep(0.05)
        return write_data(self, plan, planner)

    filesystem._FileSystemWriter.write_data = held
    from prl.trainer.train import main
    sys.exit(main(sys.argv[1], sys.argv[2]))
""")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    return path, json.loads((path / "config.json").read_text())["vocab_size"]


def _gated(run: RunDir, gates: Path, resume: str) -> subprocess.Popen:
    """The trainer under torchrun on 2 ranks, its DCP writes held while GATES/hold_N exists."""
    script = gates / "gated_trainer.py"
    script.write_text(GATED_TRAINER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PRL_TEST_GATES": str(gates)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), str(run.root), resume]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _until(proc: subprocess.Popen, what: str, probe, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        assert proc.poll() is None, f"trainer exited ({proc.returncode}) before {what}:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _writing(run: RunDir, step: int) -> bool:
    """Step `step`'s checkpoint is being written: its temporary dir exists, unpublished."""
    parent = run.checkpoints(step, "trainer").parent
    return any(parent.glob(".trainer.tmp-*")) and not is_stable(run.checkpoints(step, "trainer"))


def _steps_recorded(run: RunDir) -> list[int]:
    return [m["step"] for m in run.read_metrics("trainer")]


def _dcp_state(path: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path / "dcp"), str(tmp))
    return torch.load(tmp, weights_only=False)


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix, obj


def test_a_resume_from_a_background_checkpoint_equals_one_from_a_blocking_checkpoint(tiny, tmp_path):
    from safetensors.torch import load_file

    model, vocab = tiny
    runs = {}
    for mode in ("blocking", "async"):
        runs[mode] = run = setup_run(tmp_path / mode, model, range(1, 5), vocab, max_steps=4,
                                     checkpoint_async=str(mode == "async").lower())
        launch(run, 2, resume="none")
    blocking, background = runs["blocking"], runs["async"]
    assert background.read_metrics("trainer")[1]["checkpoint_snapshot_mb"] > 0, "step 2 was written in the background"
    assert "checkpoint_snapshot_mb" not in blocking.read_metrics("trainer")[1]

    # The same files: model and AdamW state, every rank's RNG, the progress record.
    a, b = (run.checkpoints(2, "trainer") for run in (blocking, background))
    sa, sb = dict(_flat(_dcp_state(a, tmp_path / "a.pt"))), dict(_flat(_dcp_state(b, tmp_path / "b.pt")))
    assert sa.keys() == sb.keys() and any(k.startswith("optim.state.") for k in sa)
    for k, v in sa.items():
        assert torch.equal(v, sb[k]) if isinstance(v, torch.Tensor) else v == sb[k], k
    for rank in (0, 1):
        ra, rb = (load_file(str(p / "rng" / f"rank_{rank}.safetensors")) for p in (a, b))
        assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)
    pa, pb = (json.loads((p / "trainer_state.json").read_text()) for p in (a, b))
    assert {**pa, "time": 0} == {**pb, "time": 0}

    # Resumed from step 2, both redo steps 3 and 4 alike: same data, same losses, same weights.
    for run in runs.values():
        for s in (3, 4):  # retention removed them once checkpoint 4 stood; the orchestrator would publish them again
            run.remove_step("rollouts", s)
            publish_batch(run, s, make_samples(s, vocab), dp_size=2, micro_batch_tokens=64)
        launch(run, 2, resume="2")
        assert _steps_recorded(run) == [1, 2, 3, 4]
    assert [m["loss"] for m in blocking.read_metrics("trainer")] == [m["loss"] for m in background.read_metrics("trainer")]
    wa, wb = (load_file(str(next(run.weights(4).glob("*.safetensors")))) for run in (blocking, background))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_one_write_in_flight_retention_keeps_the_stable_one_and_sigterm_waits_for_the_write(tiny, tmp_path):
    model, vocab = tiny
    run = setup_run(tmp_path / "run", model, range(1, 6), vocab, max_steps=8, checkpoint_keep=1,
                    checkpoint_async="true")
    gates = tmp_path / "gates"
    gates.mkdir()
    (gates / "hold_4").touch()
    proc = _gated(run, gates, "none")
    try:
        _until(proc, "step 5 trained", lambda: 5 in _steps_recorded(run))
        # Step 4's write is held: no STABLE for it; the newest STABLE checkpoint (2) stays although keep is 1.
        assert _writing(run, 4) and run.stable_steps("checkpoints") == [2]
        publish_batch(run, 6, make_samples(6, vocab), dp_size=2, micro_batch_tokens=64)
        _until(proc, "weights of step 6", lambda: is_stable(run.weights(6)))
        time.sleep(2.0)
        # Step 6's checkpoint waits for step 4's: not begun, the step not finished.
        assert not run.checkpoints(6, "trainer").parent.exists() and 6 not in _steps_recorded(run)
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on; the ranks are inside the wait
        time.sleep(2.0)
        assert proc.poll() is None and not is_stable(run.checkpoints(4, "trainer"))
        (gates / "hold_4").unlink()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert run.read_state("trainer").exit_code == 128 + signal.SIGTERM, out
    # Step 6 began once 4 was published and the stop waited for it too: both whole and verified.
    assert run.stable_steps("checkpoints") == [4, 6], out
    assert all(run.verify_step("checkpoints", s, "trainer") for s in (4, 6))
    assert _steps_recorded(run) == [1, 2, 3, 4, 5, 6]
    for s in (7, 8):
        publish_batch(run, s, make_samples(s, vocab), dp_size=2, micro_batch_tokens=64)
    launch(run, 2, resume="latest")
    assert _steps_recorded(run) == list(range(1, 9))


def test_a_kill_while_sigterm_waits_for_a_write_leaves_it_unmarked_and_the_resume_starts_before_it(tiny, tmp_path):
    import psutil

    model, vocab = tiny
    run = setup_run(tmp_path / "run", model, range(1, 5), vocab, max_steps=6, checkpoint_async="true")
    gates = tmp_path / "gates"
    gates.mkdir()
    (gates / "hold_4").touch()
    proc = _gated(run, gates, "none")
    tree = [psutil.Process(proc.pid)]
    try:
        _until(proc, "step 4 trained", lambda: 4 in _steps_recorded(run))
        tree += tree[0].children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        time.sleep(3.0)
        # Still waiting for the held write: nothing that looks complete, then the kill a requeue sends.
        assert proc.poll() is None and _writing(run, 4) and run.stable_steps("checkpoints") == [2]
    finally:
        for p in tree:
            p.send_signal(signal.SIGKILL)
        proc.wait()
        psutil.wait_procs(tree, timeout=10)
    assert not is_stable(run.checkpoints(4, "trainer")) and run.stable_steps("checkpoints") == [2]
    for s in (5, 6):
        publish_batch(run, s, make_samples(s, vocab), dp_size=2, micro_batch_tokens=64)
    launch(run, 2, resume="latest")
    assert _steps_recorded(run) == list(range(1, 7)), "resumed after step 2, steps 3 and 4 redone once"
    assert run.stable_steps("checkpoints") == [4, 6]
    assert run.verify_step("checkpoints", 4, "trainer")


def test_a_background_write_that_fails_publishes_nothing_and_fails_the_run_naming_it(tiny, tmp_path):
    from tests.helpers import tmpfs

    model, vocab = tiny
    run = setup_run(tmp_path / "run", model, range(1, 5), vocab, max_steps=4, checkpoint_async="true")
    # Room for each rank's RNG file (synchronous, at the snapshot), not for the model and optimizer state.
    with tmpfs(run.root / "checkpoints", "128k"):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "prl.trainer",
                               "--run-dir", str(run.root), "--resume", "none"],
                              env=env, capture_output=True, text=True, timeout=240)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out
        assert "the checkpoint of step 2 could not be written" in out and "it was not published" in out, out
        assert run.stable_steps("checkpoints") == [] and not list(run.root.glob("checkpoints/**/STABLE"))
        assert not list((run.root / "checkpoints").glob("step_2/.trainer.tmp-*")), "the failed write was removed"
    state = run.read_state("trainer")
    assert state.status == "failed" and "checkpoint of step 2" in state.error, state
