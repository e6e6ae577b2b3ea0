"""The real RL loop as one heterogeneous Slurm job on the lab cluster: vLLM on n1, the
orchestrator on n2, the 2-node FSDP2 trainer (gloo across nodes) on n3-n4."""

from __future__ import annotations

import json

import pytest

from tests.helpers import prl_cli as prl, wait_for
from tests.tiny_model import build_tiny_model

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, pytest.mark.slow]


def test_lab_hetjob_runs_the_rl_loop(tmp_path, env, slurm_cluster):
    model = build_tiny_model(tmp_path / "model")
    run = tmp_path / "run"
    prl(env, "submit", "configs/lab.yaml", f"run_dir={run}", f"model.path={model}", "training.max_steps=3",
        "training.max_off_policy_steps=0")  # synchronous: every step waits for the trained weights
    try:
        final = wait_for("the job to end", lambda: (s := json.loads(prl(env, "status", run, "--json").stdout))[
            "state"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and s, timeout=600, interval=3)
    finally:
        prl(env, "cancel", run, check=False)
    assert final["state"] == "COMPLETED", (final, prl(env, "logs", run, "-n", "40", check=False).stdout)
    assert [r["exit_code"] for r in final["roles"]] == [0, 0, 0]
    assert final["progress"]["trainer_step"] == 3
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["role"] == "trainer"] == [1, 2, 3]
    assert any(r.get("event") == "weights_loaded" for r in records), "the server never loaded trained weights"
    endpoint = json.loads((run / "state" / "endpoints" / "inference.0.json").read_text())
    assert endpoint["url"].endswith(":18000")
    # Each role ran on its own het component's nodes.
    nodes = {r["role"]: r["nodes"] for r in final["roles"]}
    assert len({nodes["inference"], nodes["orchestrator"], nodes["trainer"]}) == 3, nodes
