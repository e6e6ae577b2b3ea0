"""The real RL loop as one heterogeneous Slurm job on the lab cluster: vLLM on n1, the
orchestrator on n2, the 2-node FSDP2 trainer (gloo across nodes) on n3-n4; the same with P/D servers and a
teacher; and an inference pool job with two LoRA runs attached to it as jobs of their own."""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO, prl_cli as prl, run_to_the_end, wait_for
from tests.tiny_model import build_tiny_model, build_tiny_teacher

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, pytest.mark.slow]


def test_lab_hetjob_runs_the_rl_loop(tmp_path, env, slurm_cluster):
    model = build_tiny_model(tmp_path / "model")
    run = tmp_path / "run"
    prl(env, "submit", "configs/lab.yaml", f"run_dir={run}", f"model.path={model}", "training.max_steps=3",
        "training.max_off_policy_steps=0")  # synchronous: every step waits for the trained weights
    final = run_to_the_end(env, run)
    assert final["state"] == "COMPLETED", (final, prl(env, "logs", run, "-n", "40", check=False).stdout)
    assert [r["exit_code"] for r in final["roles"]] == [0, 0, 0]
    assert final["progress"]["trainer_step"] == 3
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["role"] == "trainer"] == [1, 2, 3]
    assert any(r.get("event") == "weights_loaded" for r in records), "the server never loaded trained weights"
    # weights.transport: broadcast: step 1 (not a checkpoint step) came from both trainer nodes' feeds by broadcast.
    assert any(r.get("event") == "weights_loaded" and r["step"] == 1 and r.get("group") for r in records), records
    # The orchestrator reached the server on its planned port; the endpoint is withdrawn once the server stopped.
    orchestrator_log = prl(env, "logs", run, "--role", "orchestrator", "-n", "500").stdout
    assert ":18000 loaded weights step 1" in orchestrator_log, orchestrator_log[-2000:]
    assert not (run / "state" / "endpoints" / "inference.0.json").exists()
    # Each role ran on its own het component's nodes.
    nodes = {r["role"]: r["nodes"] for r in final["roles"]}
    assert len({nodes["inference"], nodes["orchestrator"], nodes["trainer"]}) == 3, nodes


def pd_topology(tmp_path, model, connector: str, teacher) -> tuple:
    """configs/lab.yaml split into a prefill node and a decode node (router on the prefill node), a one-node
    trainer with the orchestrator beside it, and a distillation teacher (the `teacher` model directory) on a
    fourth node with `distill_coef: 1` beside the reward. On a copy of the lab profile with one (count-only)
    GPU per node, so each inference node runs one server."""
    import yaml

    cluster = yaml.safe_load((REPO / "clusters" / "lab.yaml").read_text())
    cluster.update(name="lab-1gpu", gpu_node={**cluster["gpu_node"], "gpus": 1})
    (tmp_path / "lab-1gpu.yaml").write_text(yaml.safe_dump(cluster))
    topo = yaml.safe_load((REPO / "configs" / "lab.yaml").read_text())
    unified = topo.pop("inference")
    server = {"nodes": 1, "extra_args": unified["extra_args"], "env": unified["env"]}
    topo.update(name="lab-pd", cluster=str(tmp_path / "lab-1gpu.yaml"), run_dir=str(tmp_path / "run"),
                model={**topo["model"], "path": str(model)}, trainer={**topo["trainer"], "nodes": 1},
                inference={"prefill": server, "decode": server, "kv_connector": {"name": connector}},
                orchestrator={"placement": "trainer"},
                teacher={"path": str(teacher), "nodes": 1, "dtype": "float32", **server})
    topo["training"]["loss"] = {"distill_coef": 1.0}
    (tmp_path / "lab-pd.yaml").write_text(yaml.safe_dump(topo, sort_keys=False))
    return tmp_path / "lab-pd.yaml", tmp_path / "run"


def test_lab_pd_hetjob_runs_the_rl_loop(tmp_path, env, slurm_cluster):
    """Prefill and decode servers on their own nodes, the router in front, through `prl submit` and the
    launcher: every step trains exactly once on real completions, both servers load every update. The same job
    distills from a teacher on a node of its own (the student after a little SFT, `build_tiny_teacher`): the
    teacher scores every P/D-made sample and the trainer reads its logprobs.

    ExampleConnector, not NIXL: on these two shared cores the decode server's first NIXL handshakes (it
    asks the prefill server's side channel for its block layout; vLLM waits 5 s) timed out for all of
    step 1's requests, which vLLM then ended with no tokens; later steps moved KV by NIXL but decoded at
    0.1-0.3 rollouts/s against about 3 here (docs/inference.md). tests/test_pd.py runs NIXL for real.
    The letters prompts are shorter than one 128-token KV block: ExampleConnector stores none of them."""
    model = build_tiny_model(tmp_path / "model")
    topo, run = pd_topology(tmp_path, model, "ExampleConnector", build_tiny_teacher(tmp_path / "teacher", model))
    prl(env, "submit", topo, "training.max_steps=3", "training.max_off_policy_steps=0")
    final = run_to_the_end(env, run, timeout=900)
    assert final["state"] == "COMPLETED", (final, prl(env, "logs", run, "-n", "40", check=False).stdout)
    roles = {r["role"]: r for r in final["roles"]}
    assert set(roles) == {"prefill", "decode", "router", "teacher", "orchestrator", "trainer"}, roles
    assert all(r["exit_code"] == 0 for r in roles.values()), roles
    assert len({roles[r]["nodes"] for r in ("prefill", "decode", "teacher", "trainer")}) == 4, roles
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["role"] == "trainer"] == [1, 2, 3]
    generated = [r for r in records if r["role"] == "orchestrator" and "completion_len_mean" in r]
    assert [r["step"] for r in generated] == [1, 2, 3]
    assert all(r["completion_len_mean"] > 0 and r["failed_rollouts"] == 0 for r in generated), generated
    loaded = {(r["server"].rsplit(":", 1)[1], r["step"]) for r in records if r.get("event") == "weights_loaded"}
    want = {(port, step) for port in ("18000", "18001") for step in (1, 2)}  # prefill, decode (single_host ports)
    assert want <= loaded, f"prefill and decode must each load the weights of steps 1 and 2: {sorted(loaded)}"
    broadcast = {(r["server"].rsplit(":", 1)[1], r["step"]) for r in records
                 if r.get("event") == "weights_loaded" and r.get("group")}
    assert {("18000", 1), ("18001", 1)} <= broadcast, f"step 1 reaches both servers in one group: {sorted(broadcast)}"
    teacher_scored(run, generated, [r for r in records if r["role"] == "trainer"])


def teacher_scored(run, generated: list[dict], trained: list[dict]) -> None:
    """The teacher scored every step's samples; its logprobs reached the trainer, whose `teacher_kl` (the reverse
    KL on the sampled tokens) reads a peaked teacher against a near-uniform student."""
    import math

    import numpy as np

    from prl.run.batch import read_batch
    from prl.run.rundir import RunDir

    assert all(r["teacher_tokens_per_s"] > 0 for r in generated), generated
    assert all(math.isfinite(r["teacher_kl"]) and r["teacher_kl"] > 0.5 for r in trained), trained
    newest = RunDir(run).latest_stable("rollouts")  # the cleanup keeps the newest step's batch
    arrays = read_batch(RunDir(run).rollouts(newest)).arrays
    mask = arrays["loss_mask"].astype(bool)
    teacher, sampled = arrays["teacher_logprobs"], arrays["inference_logprobs"]
    assert mask.any() and np.all(teacher[~mask] == 0) and np.all(teacher[mask] < 0), (newest, teacher)
    assert np.abs(teacher[mask] - sampled[mask]).mean() > 0.1, (newest, teacher[mask], sampled[mask])


def test_lab_pool_serves_two_lora_runs_each_its_own_adapter(tmp_path, env, slurm_cluster):
    """An inference pool as a Slurm job of its own (one server on one node) and two LoRA runs as two other jobs
    attached to it, each a trainer with its orchestrator on a node of its own: both complete, each served with
    its own adapter at every step (mismatch_kl as low as a run with its own server: the other run's adapter or
    the base model would part them), and both detach at their end."""
    import yaml

    from prl.trainer.tiny_model import LORA_EMBED_SCALE

    model = build_tiny_model(tmp_path / "model", embed_scale=LORA_EMBED_SCALE)
    cluster = yaml.safe_load((REPO / "clusters" / "lab.yaml").read_text())
    cluster.update(name="lab-1gpu", gpu_node={**cluster["gpu_node"], "gpus": 1})
    (tmp_path / "lab-1gpu.yaml").write_text(yaml.safe_dump(cluster))
    lab = yaml.safe_load((REPO / "configs" / "lab.yaml").read_text())
    model_section = {"path": str(model), "dtype": "float32", "max_model_len": 1024}
    pool = {"name": "lab-pool", "cluster": str(tmp_path / "lab-1gpu.yaml"), "run_dir": str(tmp_path / "pool"),
            "model": model_section, "inference": lab["inference"], "pool": {"max_loras": 2, "max_lora_rank": 8}}
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool, sort_keys=False))
    prl(env, "submit", tmp_path / "pool.yaml")
    runs = {name: tmp_path / name for name in ("lab-a", "lab-b")}
    try:
        wait_for("the pool's server", lambda: (tmp_path / "pool" / "state" / "endpoints" / "inference.0.json").exists(),
                 timeout=600, interval=2)
        for i, (name, run) in enumerate(runs.items()):
            topo = {**lab, "name": name, "cluster": str(tmp_path / "lab-1gpu.yaml"), "run_dir": str(run),
                    "model": {**model_section, "lora": {"rank": 8, "alpha": 16}},
                    "inference": {"attach": str(tmp_path / "pool")}, "trainer": {**lab["trainer"], "nodes": 1},
                    "orchestrator": {"placement": "trainer"}, "weights": {"transport": "filesystem"},
                    "training": {**lab["training"], "max_steps": 3, "max_off_policy_steps": 0, "lr": 1e-2}}
            (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(topo, sort_keys=False))
            # The lab's nodes share one host: each job's trainer needs ports of its own.
            prl(env, "submit", tmp_path / f"{name}.yaml", f"cluster.port_base={19000 + 500 * i}")
        for name, run in runs.items():
            final = run_to_the_end(env, run, timeout=900)
            assert final["state"] == "COMPLETED", (final, prl(env, "logs", run, "-n", "40", check=False).stdout)
            assert final["pool"] == str(tmp_path / "pool")
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            trainer = [r for r in records if r["role"] == "trainer"]
            assert [r["step"] for r in trainer] == [1, 2, 3]
            assert all(r["mismatch_kl"] < 1e-4 for r in trainer), (name, trainer)
        shown = json.loads(prl(env, "status", tmp_path / "pool", "--json").stdout)
        assert shown["state"] == "RUNNING" and shown["attached"] == [], shown
    finally:
        prl(env, "cancel", tmp_path / "pool", check=False)
    log = "\n".join(p.read_text() for p in (tmp_path / "pool" / "logs").rglob("rank_0.log"))
    for name in runs:
        assert f"adapter update begins: run {name}," in log and f"run {name} detached" in log, name
