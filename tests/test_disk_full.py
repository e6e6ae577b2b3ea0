"""A full disk inside a real job (`prl submit --local`: real vLLM, orchestrator, trainer) whose run directory
is a 64 MiB tmpfs: once the run trains, the disk is filled to the last 16 KiB. Every step's weights go through
the disk (`weights.transport: filesystem`).

- the job fails, naming the first role that hit it and the full disk, and the launcher still records its end
  (it gives back a 4 MiB reserve to do so) and stops the other roles;
- no half-written step is ever accepted (every visible step is STABLE and complete);
- after making room, `prl submit --resume` finishes the run with every trainer and orchestrator step once.
"""

from __future__ import annotations

import json
import os

import pytest

from prl.run.rundir import RunDir, is_stable
from tests.helpers import prl_cli as prl, tmpfs, wait_for
from tests.tiny_model import build_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_full_disk_fails_the_run_clearly_and_resume_loses_no_step(tmp_path, env):
    model = build_tiny_model(tmp_path / "model")
    with tmpfs(tmp_path / "disk", "64m") as disk:
        run = disk / "run"
        args = ["configs/local-tiny.yaml", f"run_dir={run}", f"model.path={model}", "training.max_steps=6",
                "training.checkpoint_interval=2", "weights.transport=filesystem", "weights.delta=false", "cluster.port_base=19300"]
        prl(env, "submit", "--local", "--detach", *args)
        try:
            wait_for("trainer step 2", lambda: trained(run) >= 2, timeout=400, interval=1)
            st = os.statvfs(disk)
            with open(disk / "filler", "wb") as f:
                try:
                    f.write(bytes(st.f_bavail * st.f_frsize - 16 * 1024))
                except OSError:
                    pass  # the roles took some of it meanwhile: full all the same
            failed = wait_for("the job to fail", lambda: (s := status(env, run))["state"] in (
                "FAILED", "COMPLETED") and s, timeout=300, interval=2)
        finally:
            prl(env, "cancel", run, check=False)
        text = prl(env, "status", run, check=False).stdout
        assert failed["state"] == "FAILED", text
        assert failed["failure"]["role"] in ("trainer", "orchestrator"), failed["failure"]
        assert "the run directory's disk is full" in failed["failure"]["reason"], failed["failure"]
        assert any("disk is full" in n and "prl submit --resume" in n for n in failed["notes"]), failed["notes"]
        assert not any("died without recording" in n for n in failed["notes"]), failed["notes"]
        launcher = json.loads((run / "state" / "launcher.json").read_text())
        assert launcher["status"] == "failed" and launcher["disk_full"]["released_bytes"] == 4 << 20
        published = [*(run / "rollouts").glob("step_*"), *(run / "weights").glob("step_*"),
                     *(run / "checkpoints").glob("step_*/*")]
        assert published and all(is_stable(p) for p in published), [p for p in published if not is_stable(p)]
        before = trained(run)

        (disk / "filler").unlink()
        prl(env, "submit", "--local", "--resume", *args, timeout=900)
        done = status(env, run)
        assert done["state"] == "COMPLETED", prl(env, "logs", run, "-n", "30", check=False).stdout
        assert steps(run, "trainer") == list(range(1, 7)), (before, steps(run, "trainer"))
        assert steps(run, "orchestrator") == list(range(1, 7))


def status(env: dict, run) -> dict:
    return json.loads(prl(env, "status", run, "--json", check=False).stdout)


def steps(run, role: str) -> list[int]:
    out = []
    for record in RunDir(run).read_metrics(role):  # skips the line a full disk tore, applies a resume's truncation
        if not record.get("eval") and record.get("event") is None:
            out.append(record["step"])
    return out


def trained(run) -> int:
    return max(steps(run, "trainer"), default=0) if (run / "metrics.jsonl").exists() else 0
