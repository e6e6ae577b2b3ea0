"""Router replay (`training.router_replay`): the trainer routes each token to the experts the server chose.

- trainer side (prl/trainer/replay.py), every MoE family of tests/tiny_model.py: replaying the routers' own
  choice changes nothing; replaying other experts hands exactly those to the experts module, weighted by the
  trainer's own scores at them (the router still gets a gradient); tokens under mask 0 keep their own routes;
- the batch format carries the routes (prl/run/batch.py) and refuses misshapen ones;
- against a real vLLM server (prl/inference/worker.py `RouteCapture`): the routes the generate route returns
  for concurrent completions are, token for token, the experts transformers picks for the same sequence in
  fp32, and with a bf16 server (whose routing flips on near-ties) replay brings the trainer's logprobs to the
  server's.
"""

from __future__ import annotations

import base64
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from prl.errors import ConfigError
from prl.run.batch import BatchError, Sample, read_batch, to_arrays, write_batch
from prl.trainer.replay import forced_topk, install, set_routes
from tests.tiny_model import MOE_FAMILIES, build_tiny_moe


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay-models")
    return {f: build_tiny_moe(root / f, family=f) for f in MOE_FAMILIES}


def _own_routes(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """[T, layers, k] experts the model's routers pick for `ids` (recorded from what each experts module is
    handed), and the logits."""
    from prl.trainer.moe import expert_modules

    layers = model.config.get_text_config().num_hidden_layers
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    experts = expert_modules(model)
    for name, m in model.named_modules():
        if m in experts:
            layer = int(name.split("layers.")[1].split(".")[0])
            hooks.append(m.register_forward_pre_hook(lambda mod, args, layer=layer: seen.__setitem__(layer, args[1])))
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0]
    for h in hooks:
        h.remove()
    k = next(iter(seen.values())).shape[1]
    routes = torch.zeros((ids.shape[0], layers, k), dtype=torch.long)
    for layer, idx in seen.items():
        routes[:, layer] = idx
    return routes, {"logits": logits, "layers": sorted(seen)}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replay_routes_tokens_to_the_given_experts_in_every_family(family_dirs, family):
    model = _load(family_dirs[family])
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (23,), generator=torch.Generator().manual_seed(1))
    own, ref = _own_routes(model, ids)
    state = install(model)
    # The routers' own choice, replayed: the same logits (the weights are the scores at the same experts).
    set_routes(model, own, torch.ones(ids.shape[0], dtype=torch.bool))
    with torch.no_grad():
        same = model(input_ids=ids[None]).logits[0]
    assert state.replayed == len(ref["layers"])
    torch.testing.assert_close(same, ref["logits"], rtol=0, atol=1e-5)

    # Other experts: each experts module is handed exactly them; tokens under mask 0 keep their own.
    experts = int(next(m for m in model.modules() if hasattr(m, "num_experts") and hasattr(m, "down_proj")).num_experts)
    other = (own + 1) % experts
    mask = torch.arange(ids.shape[0]) % 3 != 0
    set_routes(model, other, mask)
    got, _ = _own_routes(model, ids)
    for layer in ref["layers"]:
        assert torch.equal(got[mask, layer].sort(-1).values, other[mask, layer].sort(-1).values), f"layer {layer}"
    # Unmasked tokens route themselves: in the first MoE layer (later ones see the replayed layers' outputs)
    # as without replay.
    first = ref["layers"][0]
    assert torch.equal(got[~mask, first].sort(-1).values, own[~mask, first].sort(-1).values)

    # The router trains through the weights at the replayed experts.
    model.zero_grad()
    out = model(input_ids=ids[None]).logits[0]
    out.float().logsumexp(-1).sum().backward()
    routers = [p for n, p in model.named_parameters() if any(s in n for s in (".gate.weight", ".router.weight"))]
    assert routers and all(p.grad is not None and p.grad.abs().sum() > 0 for p in routers)
    set_routes(model, None, None)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids[None]).logits[0], ref["logits"], rtol=0, atol=1e-5)


def test_forced_topk_leaves_other_topk_calls_alone():
    scores = torch.tensor([[0.1, 0.5, 0.3, 0.2], [0.4, 0.1, 0.2, 0.3]])
    ids = torch.tensor([[3, 0], [1, 2]])
    with forced_topk(ids, None, num_experts=4):
        values, chosen = torch.topk(scores, 2, dim=-1)
        groups = torch.topk(scores[:, :2], 1, dim=-1)  # [T, n_group]: a group selection, not the experts
        three = torch.topk(scores, 3)
    assert chosen.tolist() == [[3, 0], [1, 2]]
    torch.testing.assert_close(values, scores.gather(-1, ids))
    assert groups.indices.tolist() == [[1], [0]] and three.indices.tolist() == [[1, 2, 3], [0, 3, 2]]
    assert torch.topk is not None and torch.topk(scores, 2).indices.tolist() == [[1, 2], [0, 3]]


def test_install_refuses_a_dense_model(tmp_path):
    from tests.tiny_model import build_tiny_model

    with pytest.raises(ConfigError, match="router_replay needs an MoE model"):
        install(_load(build_tiny_model(tmp_path / "dense")))


def _sample(n, routes=None, adv=1.0):
    return Sample(list(range(1, n + 1)), [0] + [1] * (n - 1), [0.0] * n, adv, routed_experts=routes)


def test_batch_carries_routes_and_refuses_misshapen_ones(tmp_path):
    r1 = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2)
    samples = [_sample(5, r1), _sample(3)]
    write_batch(tmp_path, samples, step=1, dp_size=1, micro_batch_tokens=64)
    batch = read_batch(tmp_path)
    assert batch.arrays["routed_experts"].shape == (8, 2, 2)
    (mb,) = batch.micro_batches(0, 1, 64)
    by_sample = dict(zip(mb.sample_ids, np.split(np.arange(mb.num_tokens), np.cumsum([5, 3])[:-1])))
    assert np.array_equal(mb.routed_experts[by_sample[0]], r1) and mb.routed_mask[by_sample[0]].all()
    assert not mb.routed_mask[by_sample[1]].any()
    assert "routed_experts" not in to_arrays([_sample(4)])
    with pytest.raises(BatchError, match="sample 1: routed_experts uint8\\[3, 2, 3\\]"):
        to_arrays([_sample(5, r1), _sample(3, np.zeros((3, 2, 3), dtype=np.uint8))])
    arrays = to_arrays(samples)
    del arrays["routed_mask"]
    from prl.run.batch import validate

    with pytest.raises(BatchError, match="routed_experts without routed_mask"):
        validate(arrays)


def test_prepare_pads_and_splits_routes_for_cp():
    from prl.run.batch import MicroBatch
    from prl.trainer.engine import micro_batch_inputs
    from prl.trainer.parallel import Dist

    n = 7
    routes = np.arange(n * 2 * 2).reshape(n, 2, 2).astype(np.uint8)
    mb = MicroBatch([0], np.arange(n), np.arange(n), np.zeros(n, dtype=np.uint8), np.zeros(n, dtype=np.float32),
                    np.zeros(n, dtype=np.float32), routed_experts=routes, routed_mask=np.ones(n, dtype=np.uint8))
    parts = [micro_batch_inputs(mb, Dist(0, 2, 0, torch.device("cpu"), None, 1, cp=2, cp_rank=r)) for r in (0, 1)]
    assert [p["routed_experts"].shape for p in parts] == [(4, 2, 2), (4, 2, 2)]
    joined = torch.cat([p["routed_experts"] for p in parts])
    assert torch.equal(joined[:n], torch.from_numpy(routes).long())
    assert torch.cat([p["routed_mask"] for p in parts]).tolist() == [True] * n + [False]


def _generate(url: str, model: str, ids: list[int], start: int | None = None) -> dict:
    sp = {"max_tokens": 20, "temperature": 1.0, "logprobs": 1, "seed": ids[0]}
    if start is not None:
        sp["routed_experts_prompt_start"] = start
    body = json.dumps({"model": model, "token_ids": ids, "sampling_params": sp}).encode()
    req = urllib.request.Request(url + "/inference/v1/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _routes(choice: dict) -> np.ndarray:
    r = choice["routed_experts"]
    return np.frombuffer(base64.b64decode(r["data"]), dtype=r["dtype"]).reshape(r["shape"])


def _completion_logprobs(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float()
    return logits.log_softmax(-1)[prompt_len - 1:-1].gather(-1, ids[prompt_len:, None])[:, 0]


@pytest.mark.vllm
def test_server_routes_are_the_experts_transformers_picks_and_replay_removes_routing_mismatch(tmp_path):
    """A 32-expert top-4 tiny GLM-4.5 (group-limited sigmoid routing) served in fp32 with --routed-experts, 8
    completions at once (so the capture splits shared steps among requests): every returned route is the set
    transformers picks for the same token. Then the trainer's score-correction bias moves, as DeepSeek-V3's and
    GLM-4.5's load balancing moves it between steps: it changes which experts are picked but not their weights,
    so routing is the only difference from the server, and replaying the server's routes brings the trainer's
    logprobs back to the served ones."""
    from prl.run.rundir import RunDir
    from tests.vllm_fixtures import start_inference

    model_dir = build_tiny_moe(tmp_path / "model", family="glm4_moe", num_experts=32, top_k=4)
    run = RunDir(tmp_path / "run").create()
    prompts = [[i + 1, (7 * i) % 300 + 3, 11, 13 + i, 17, 19] for i in range(8)]
    with start_inference(run.root, model_dir, extra_args=["--routed-experts"]) as server:
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: _generate(server.url, str(model_dir), p), prompts))
        later = _generate(server.url, str(model_dir), prompts[0], start=4)

    model = _load(model_dir)
    layers = model.config.num_hidden_layers
    sequences = []
    for prompt, answer in zip(prompts, answers):
        choice = answer["choices"][0]
        routes = _routes(choice)
        ids = torch.tensor(prompt + choice["token_ids"])
        # Every position but the last (no forward pass follows it), every layer (the dense first one's rows
        # unused), top-4 of 32 experts.
        assert routes.shape == (len(ids) - 1, layers, 4) and routes.dtype == np.uint8
        own, ref = _own_routes(model, ids)
        moe = ref["layers"]
        assert np.array_equal(np.sort(routes[:, moe], -1), np.sort(own[:-1, moe].numpy(), -1))
        served = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])
        sequences.append((ids, len(prompt), np.concatenate([routes, routes[-1:]]), served))
    assert later["choices"][0]["routed_experts"]["start"] == 4
    assert _routes(later["choices"][0]).shape[0] == len(prompts[0]) + len(later["choices"][0]["token_ids"]) - 1 - 4

    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn(b.shape, generator=torch.Generator().manual_seed(0)) * 0.1)
    flipped = own_gap = replay_gap = 0.0
    for ids, prompt_len, routes, served in sequences:
        own, _ = _own_routes(model, ids)
        flipped += float((np.sort(own[:, moe].numpy(), -1) != np.sort(routes[:, moe], -1)).any(-1).mean())
        own_gap = max(own_gap, float((_completion_logprobs(model, ids, prompt_len) - served).abs().max()))
        state = getattr(model, "_prl_replay", None) or install(model)
        set_routes(model, torch.from_numpy(routes.astype(np.int64)), torch.ones(len(ids), dtype=torch.bool))
        replay_gap = max(replay_gap, float((_completion_logprobs(model, ids, prompt_len) - served).abs().max()))
        set_routes(model, None, None)
    print(f"bias moved: {flipped / len(sequences):.1%} of token-layers routed elsewhere; max |trainer - served| "
          f"logprob {own_gap:.2e} own routing, {replay_gap:.2e} replayed")
    assert state.replayed > 0
    assert flipped / len(sequences) > 0.1, "the perturbed routers should route some tokens elsewhere"
    assert own_gap > 1e-2 and replay_gap < 1e-3, (own_gap, replay_gap)


def test_route_capture_files_each_step_under_its_requests():
    """RouteCapture's bookkeeping on hand-made steps (the real runner's are in the vllm test above): rows split
    in the runner's order and put at their positions, a preempted request's recomputation overwriting its old
    rows, n completions found by vLLM's child ids, requests of other routes not kept, and the oldest untaken
    finished requests dropped beyond the bound."""
    from types import SimpleNamespace as NS

    from prl.inference import worker
    from prl.inference.worker import RouteCapture

    runner = NS(input_batch=NS(req_ids=[]))
    cap = RouteCapture(runner, layers=2, top_k=1, num_experts=8, max_tokens=16, device="cpu")

    def step(order, scheduled, starts, new=(), finished=()):
        runner.input_batch.req_ids = list(order)
        total = sum(scheduled.values())
        rows = torch.tensor([[int(f"{i}")] for i in range(total)])
        for layer in range(2):
            cap.capture(layer, rows + layer)
        cap.after_step(NS(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=total,
                          scheduled_new_reqs=[NS(req_id=r, num_computed_tokens=starts[r]) for r in new],
                          scheduled_cached_reqs=NS(req_ids=[r for r in scheduled if r not in new],
                                                   num_computed_tokens=[starts[r] for r in scheduled if r not in new]),
                          finished_req_ids=set(finished)))

    a, b, other = "prl-gen-a-abcdefgh", "0_prl-gen-b-12345678", "chatcmpl-x-abcdefgh"
    b1 = "1_prl-gen-b-12345678"
    step([a, b, b1, other], {a: 3, b: 2, b1: 2, other: 1}, {a: 0, b: 0, b1: 0, other: 0}, new=[a, b, b1, other])
    step([b, a, b1], {a: 1, b: 1, b1: 1}, {a: 3, b: 2, b1: 2})
    step([a], {a: 1}, {a: 4}, finished=[b, b1, other])
    assert other not in cap.rows
    (got,) = cap.take("prl-gen-a", 1, 0)
    rows = np.frombuffer(got["data"], dtype=got["dtype"]).reshape(got["shape"])
    assert rows[:, 0, 0].tolist() == [0, 1, 2, 1, 0] and rows[:, 1, 0].tolist() == [1, 2, 3, 2, 1]
    first, second = cap.take("prl-gen-b", 2, 1)
    assert first["start"] == 1
    assert np.frombuffer(first["data"], dtype="uint8").reshape(2, 2, 1)[:, 0, 0].tolist() == [4, 0]
    assert np.frombuffer(second["data"], dtype="uint8").reshape(2, 2, 1)[:, 0, 0].tolist() == [6, 2]
    assert cap.take("prl-gen-b", 1, 0) == [None] and not cap.rows  # taken once, then forgotten

    # Preempted and recomputed from 0: the new rows replace the old ones, and its length is where they end.
    c = "prl-gen-c-abcdefgh"
    step([c], {c: 4}, {c: 0}, new=[c])
    step([c], {c: 2}, {c: 0}, new=[c], finished=[c])
    (got,) = cap.take("prl-gen-c", 1, 0)
    assert got["shape"] == [2, 2, 1]

    # A step whose routers saw fewer rows than it scheduled (a layout the capture does not know): its requests
    # get no routes rather than wrong ones.
    d = "prl-gen-d-abcdefgh"
    runner.input_batch.req_ids = [d]
    cap.capture(0, torch.zeros((2, 1), dtype=torch.long))
    cap.after_step(NS(num_scheduled_tokens={d: 3}, total_num_scheduled_tokens=3,
                      scheduled_new_reqs=[NS(req_id=d, num_computed_tokens=0)],
                      scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]), finished_req_ids={d}))
    assert cap.take("prl-gen-d", 1, 0) == [None] and not cap.broken

    bound, worker.MAX_UNTAKEN_ROUTES = worker.MAX_UNTAKEN_ROUTES, 2
    try:
        ids = [f"prl-gen-{i}-abcdefgh" for i in range(3)]
        step(ids, dict.fromkeys(ids, 1), dict.fromkeys(ids, 0), new=ids, finished=ids)
        assert cap.dropped == 1 and len(cap.rows) == 2  # one step's finished requests come as a set
    finally:
        worker.MAX_UNTAKEN_ROUTES = bound
