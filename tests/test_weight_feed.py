"""Weights in memory: a real vLLM server loads a step from weight feeds (prl/weights/feed.py) through the
"prl" weight-transfer engine (prl/inference/weight_engine.py), and what it then serves matches
transformers on the same weights; feeds that refuse, or a step that is not the served layout, change
nothing; a stream cut part-way rolls back to the last weights on disk, and the next step from memory loads.

Feed servers run in the test process, as trainer ranks would; the tiny model's tensors, perturbed,
are split over two feeds as a sharded publish splits them over two ranks.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from prl.weights.feed import FeedServer, feed_proof, mac
from prl.run.rundir import API_KEY_VAR, RunDir
from tests.helpers import engine_of
from tests.test_inference import assert_serves, prompts_for, publish_perturbed, served
from tests.vllm_fixtures import HTTPFailure, http_json, server_fixture, start_inference


def iter_safetensors(path):
    """The worker's reader, imported when a test runs: prl.inference.worker imports vLLM, which collecting
    this module (in every xdist worker, and in the inner loop) would otherwise pay for."""
    from prl.inference.worker import iter_safetensors as read

    return read(path)


KEY = "feed-test-key"


class KeyedServer:
    """An InferenceServer's requests with the run's bearer key (the helpers of test_inference call get/post)."""

    def __init__(self, server):
        self.server, self.url, self.run_dir, self.model_dir = server, server.url, server.run_dir, server.model_dir
        self.headers = {"Authorization": f"Bearer {KEY}"}

    def get(self, path: str, timeout: float = 60) -> dict:
        return http_json("GET", self.url + path, headers=self.headers, timeout=timeout)

    def post(self, path: str, body: dict | None = None, timeout: float = 300) -> dict:
        return http_json("POST", self.url + path, body or {}, headers=self.headers, timeout=timeout)


def keyed(tmp_path_factory, model_dir):
    """A server with the run's key (the feed engine authenticates with it), on an empty run of its own."""
    run = RunDir(tmp_path_factory.mktemp("feed-run") / "run").create()
    with start_inference(run.root, model_dir, extra_args=["--api-key-env", API_KEY_VAR],
                         env={API_KEY_VAR: KEY}) as server:
        yield KeyedServer(server)


@server_fixture(scope="module")
def keyed_server(tmp_path_factory, tiny_model_dir):
    yield from keyed(tmp_path_factory, tiny_model_dir)


@server_fixture(scope="module")
def second_server(tmp_path_factory, tiny_model_dir):
    """Another keyed server: a broadcast group's second member."""
    yield from keyed(tmp_path_factory, tiny_model_dir)


def perturbed(tmp_path: Path, model_dir: Path, step: int) -> Path:
    """`model_dir` with noise on every weight, as a reference directory outside the served run."""
    return publish_perturbed(RunDir(tmp_path / f"ref-{step}").create(), step, model_dir)


def feeds_of(ref: Path, step: int, ranks: int = 2, key: str = KEY, delta: bool = False) -> list[FeedServer]:
    """`ranks` feeds holding `ref`'s tensors as `step`, dealt round-robin as ranks own them."""
    feeds = [FeedServer("127.0.0.1", 0, key.encode(), delta) for _ in range(ranks)]
    deal(feeds, step, ref)
    return feeds


def deal(feeds: list[FeedServer], step: int, ref: Path) -> list[str]:
    """Publish `ref`'s tensors as `step`, round-robin over `feeds`; their addresses."""
    tensors = list(iter_safetensors(ref))
    for rank, feed in enumerate(feeds):
        feed.publish(step, tensors[rank::len(feeds)])
    return [f.address for f in feeds]


def sparsely_changed(ref: Path, dest: Path, fraction: float, seed: int) -> Path:
    """A copy of the model directory `ref` with `fraction` of every tensor's elements moved (what a small
    bf16 update leaves changed), the rest bit for bit the same."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(ref, dest)
    gen = torch.Generator().manual_seed(seed)
    for path in dest.glob("*.safetensors"):
        tensors = load_file(path)
        for t in tensors.values():
            flat = t.view(-1)
            picked = torch.rand(flat.numel(), generator=gen) < fraction
            flat[picked] += 0.5 * float(flat.float().std()) * torch.randn(int(picked.sum()), generator=gen).to(t.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return dest


def refused(server, body: dict) -> HTTPFailure:
    with pytest.raises(HTTPFailure) as caught:
        server.post("/prl/weights", body)
    return caught.value


def test_a_step_from_memory_is_served_and_bad_feeds_change_nothing(keyed_server, tmp_path):
    server = keyed_server
    run = RunDir(server.run_dir)
    prompts = prompts_for(server.model_dir)

    # A disk update first: the rollback target, and the time to compare with.
    on_disk = publish_perturbed(run, 1, server.model_dir)
    disk = server.post("/prl/weights", {"step": 1})
    assert_serves(server, on_disk, prompts)

    ref = perturbed(tmp_path, server.model_dir, 2)
    feeds = feeds_of(ref, 2)
    try:
        addresses = [f.address for f in feeds]
        memory = server.post("/prl/weights", {"transport": "memory", "step": 2, "feeds": addresses})
        assert memory["step"] == 2 and memory["path"] == "memory:step_2"
        print(f"\ntiny model update: disk {disk['seconds']:.3f} s (load {disk['load_seconds']:.3f} s), "
              f"memory {memory['seconds']:.3f} s (load {memory['load_seconds']:.3f} s)")
        live = server.get("/prl/live")
        assert (live["weights_step"], live["weights_path"], live["ok"]) == (2, "memory:step_2", True)
        assert live["disk_step"] == 1  # what a failed update would roll back to
        after = assert_serves(server, ref, prompts)

        # A feed with another key: refused before any weight is touched, named in the answer.
        with FeedServer("127.0.0.1", 0, b"another run's key") as stranger:
            stranger.publish(3, list(iter_safetensors(ref)))
            e = refused(server, {"transport": "memory", "step": 3, "feeds": [stranger.address]})
        assert e.status == 502 and stranger.address in e.body["error"] and "authentication failed" in e.body["error"]
        assert "nothing was loaded" in e.body["error"]

        # A step the feeds do not hold, and a step without some served tensors: refused the same way.
        e = refused(server, {"transport": "memory", "step": 3, "feeds": addresses})
        assert e.status == 502 and "holds step 2, not step 3" in e.body["error"]
        e = refused(server, {"transport": "memory", "step": 2, "feeds": addresses[:1]})
        assert e.status == 502 and "tensors missing" in e.body["error"]
        e = refused(server, {"transport": "memory", "step": 2, "feeds": ["no-port"]})
        assert e.status == 400

        live = server.get("/prl/live")
        assert (live["weights_step"], live["weights_path"], live["ok"]) == (2, "memory:step_2", True)
        assert [served(server, p)[1] for p in prompts] == after, "a refused update changed the served weights"
    finally:
        for feed in feeds:
            feed.close()


def test_the_engine_backs_large_allocations_with_huge_pages(keyed_server):
    """prl.inference sets torch's THP_MEM_ALLOC_ENABLE on a CPU host (`cpu_engine_setup`): the engine core, where
    updates write the model into fresh memory, inherits it, and its large tensors (the 1 GiB KV cache here) sit
    on transparent huge pages where the kernel offers them (`madvise` or `always`)."""
    server = keyed_server
    engine = engine_of(server.run_dir, int(server.url.rsplit(":", 1)[1]))
    if "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        pytest.skip("this kernel has transparent huge pages off")
    rollup = Path(f"/proc/{engine}/smaps_rollup").read_text()
    huge_kb = int(next(line.split()[1] for line in rollup.splitlines() if line.startswith("AnonHugePages:")))
    assert huge_kb >= 512 * 1024, f"only {huge_kb} kB of the engine's memory is on huge pages:\n{rollup}"


def cut_feed(ref: Path, step: int, after_bytes: int) -> tuple[str, threading.Thread]:
    """A feed that authenticates, sends the full header of `ref`, then closes after `after_bytes` of data."""
    tensors = list(iter_safetensors(ref))
    header = {"step": step, "tensors": [[n, str(t.dtype).removeprefix("torch."), list(t.shape),
                                         t.numel() * t.element_size()] for n, t in tensors]}
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        with conn, listener:
            conn.sendall(b"prl-feed 1 0123abcd\n")
            answer = json.loads(conn.makefile("rb").readline())
            assert answer["mac"] == mac(KEY.encode(), b"0123abcd")
            proof = {"proof": feed_proof(KEY.encode(), answer["nonce"], conn.getsockname()[1])}
            conn.sendall(json.dumps(proof).encode() + b"\n" + json.dumps(header).encode() + b"\n" + bytes(after_bytes))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return "127.0.0.1:%d" % listener.getsockname()[1], thread


def test_a_stream_cut_part_way_rolls_back_to_the_disk_weights(keyed_server, tmp_path):
    server = keyed_server
    run = RunDir(server.run_dir)
    step = (run.latest_stable("weights") or 0) + 1
    on_disk = publish_perturbed(run, step, server.model_dir)
    server.post("/prl/weights", {"step": step})

    address, thread = cut_feed(perturbed(tmp_path, server.model_dir, 9), 9, after_bytes=200_000)
    start = time.monotonic()
    e = refused(server, {"transport": "memory", "step": 9, "feeds": [address]})
    thread.join(10)
    assert e.status == 500 and address in e.body["error"] and f"rolled back to {os.path.realpath(on_disk)}" in e.body["error"]
    assert time.monotonic() - start < 60
    live = server.get("/prl/live")
    assert (live["weights_step"], live["weights_path"], live["ok"]) == (step, os.path.realpath(on_disk), True)
    assert_serves(server, on_disk, prompts_for(server.model_dir))

    # The failed update left no weight-transfer session open: the next step from memory loads and serves.
    ref = perturbed(tmp_path, server.model_dir, 10)
    feeds = feeds_of(ref, 10)
    try:
        body = {"transport": "memory", "step": 10, "feeds": [f.address for f in feeds]}
        assert server.post("/prl/weights", body)["step"] == 10
        assert_serves(server, ref, prompts_for(server.model_dir))
    finally:
        for feed in feeds:
            feed.close()


def test_deltas_move_only_what_changed_and_serve_what_whole_steps_would(keyed_server, tmp_path):
    """`weights.delta`: the first step from feeds comes whole and the workers keep it; the next comes as the
    elements that changed, rebuilt on the kept step, and serves exactly what transformers computes on
    the whole step. A disk update between two steps from memory changes nothing of that: the delta
    applies to the kept step, not to what is served."""
    server = keyed_server
    prompts = prompts_for(server.model_dir)
    ref20 = perturbed(tmp_path, server.model_dir, 20)
    ref21 = sparsely_changed(ref20, tmp_path / "ref-21", fraction=0.01, seed=21)
    ref22 = sparsely_changed(ref21, tmp_path / "ref-22", fraction=0.01, seed=22)
    feeds = feeds_of(ref20, 20, delta=True)
    try:
        addresses = [f.address for f in feeds]
        whole = server.post("/prl/weights", {"transport": "memory", "step": 20, "feeds": addresses})
        assert whole["delta"] is False and whole["received_bytes"] > 0
        assert_serves(server, ref20, prompts)

        deal(feeds, 21, ref21)
        delta = server.post("/prl/weights", {"transport": "memory", "step": 21, "feeds": addresses})
        print(f"\ndelta update: {delta['received_bytes']} bytes received against {whole['received_bytes']} whole")
        assert delta["delta"] is True and delta["received_bytes"] < whole["received_bytes"] / 5
        assert server.get("/prl/live")["weights_path"] == "memory:step_21"
        assert_serves(server, ref21, prompts)

        run = RunDir(server.run_dir)
        on_disk = publish_perturbed(run, (run.latest_stable("weights") or 0) + 1, server.model_dir)
        server.post("/prl/weights", {"step": run.latest_stable("weights")})
        assert_serves(server, on_disk, prompts)
        deal(feeds, 22, ref22)
        after_disk = server.post("/prl/weights", {"transport": "memory", "step": 22, "feeds": addresses})
        assert after_disk["delta"] is True
        assert_serves(server, ref22, prompts)
    finally:
        for feed in feeds:
            feed.close()


def group_update(servers: list, step: int, addresses: list[str], world: int | None = None,
                 timeout: float = 30, token: str | None = None) -> list:
    """`POST /prl/weights` with one broadcast group to every worker of every server at once (servers of one
    worker each: one place), each worker at the next rank; each server's answer, or its HTTPFailure."""
    workers = [s.get("/prl/live")["workers"] for s in servers]
    token = token or os.urandom(16).hex()
    world = world or 1 + sum(workers)
    answers: list = [None] * len(servers)

    def post(i: int) -> None:
        groups = [{"token": token, "world": world, "rank": 1 + sum(workers[:i]) + r, "timeout": timeout}
                  for r in range(workers[i])]
        try:
            answers[i] = servers[i].post("/prl/weights", {"transport": "broadcast", "step": step, "feeds": addresses,
                                                          "groups": groups})
        except HTTPFailure as e:
            answers[i] = e

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(servers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 120)
    return answers


def test_a_step_broadcast_to_two_servers_serves_on_both_and_a_group_that_cannot_form_changes_nothing(
        keyed_server, second_server, tmp_path):
    """`weights.transport: broadcast`: two trainer feeds each broadcast their share to the workers of two real
    servers at once; both serve what transformers computes. A group one member short fails on every side
    within its timeout, before any weight is touched; a group is never sent twice."""
    servers = [keyed_server, second_server]
    prompts = prompts_for(keyed_server.model_dir)
    ref = perturbed(tmp_path, keyed_server.model_dir, 30)
    feeds = [FeedServer("127.0.0.1", 0, KEY.encode(), groups=True, group_timeout=30) for _ in range(2)]
    try:
        addresses = deal(feeds, 30, ref)
        token = os.urandom(16).hex()
        answers = group_update(servers, 30, addresses, token=token)
        for answer in answers:
            assert isinstance(answer, dict), answer
            assert answer["group"] is True and answer["received_bytes"] > 0 and answer["path"] == "memory:step_30"
        for feed in feeds:
            assert [(r["step"], r.get("error")) for r in feed.group_log] == [(30, None)] and feed.group_log[0]["bytes"]
        after = [assert_serves(server, ref, prompts) for server in servers]

        # One member never comes: every member gives up within the timeout, nothing is loaded anywhere.
        deal(feeds, 31, perturbed(tmp_path, keyed_server.model_dir, 31))
        start = time.monotonic()
        answers = group_update(servers, 31, addresses, world=4, timeout=3)
        assert time.monotonic() - start < 60
        for answer in answers:
            assert isinstance(answer, HTTPFailure) and answer.status == 502, answer
            assert "did not form within 3 s" in answer.body["error"] and "nothing was loaded" in answer.body["error"]
        # A group already sent is not sent again.
        e = group_update(servers[:1], 31, addresses, world=3, token=token)[0]
        assert isinstance(e, HTTPFailure) and e.status == 502 and "has ended" in e.body["error"]
        for server, held in zip(servers, after):
            live = server.get("/prl/live")
            assert (live["weights_step"], live["weights_path"], live["ok"]) == (30, "memory:step_30", True)
            assert [served(server, p)[1] for p in prompts] == held
    finally:
        for feed in feeds:
            feed.close()
