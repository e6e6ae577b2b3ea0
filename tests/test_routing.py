"""Routing without vLLM: the hashing rule (`prl.inference.routing`) and the router's protocol.

The router tests run `prl.inference.router` in process against stub backends
(test doubles that answer like vLLM's KV connectors: a prefill request marked
`do_remote_decode` gets `kv_transfer_params` back, a decode request echoes
what it received), so the hand-off, streaming, session affinity and admin
fan-out are checked in well under a second.
"""

from __future__ import annotations

import collections
import json
import random
import subprocess
import sys

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from prl.inference import routing
from prl.inference.router import REMOTE_DECODE, build_app, decode_body, prefill_body

SERVERS = [f"http://d{i}:8000" for i in range(8)]


# ---------------------------------------------------------------- hashing


def test_choice_is_stable_across_processes():
    """blake2b, not Python's salted hash: another interpreter maps keys the same way."""
    keys = [f"session:{i}" for i in range(50)]
    here = [routing.choose(k, SERVERS, {}) for k in keys]
    code = ("import json, sys; from prl.inference import routing; "
            f"print(json.dumps([routing.choose(k, {SERVERS!r}, {{}}) for k in {keys!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin", "PYTHONPATH": sys.path[0]})
    assert json.loads(out.stdout) == here
    assert here == [routing.choose(k, list(reversed(SERVERS)), {}) for k in keys], "order of servers matters"


def test_keys_spread_evenly():
    counts = collections.Counter(routing.choose(f"k{i}", SERVERS, {}) for i in range(20000))
    mean = 20000 / len(SERVERS)
    assert set(counts) == set(SERVERS)
    assert max(counts.values()) < 1.1 * mean and min(counts.values()) > 0.9 * mean, counts


def test_load_stays_bounded_under_a_hot_key():
    """Every request has one key: it fills its first server to the bound, then spills in preference order."""
    load: dict[str, int] = {}
    for n in range(200):
        s = routing.choose("hot", SERVERS, load)
        assert load.get(s, 0) < routing.capacity(n, len(SERVERS)), (n, load)
        load[s] = load.get(s, 0) + 1
    first = routing.preference("hot", tuple(SERVERS))
    assert load[first[0]] == routing.capacity(199, len(SERVERS)) == 32 + routing.DEFAULT_SLACK
    assert set(load) == set(first[:len(load)]) and 5 <= len(load) < len(SERVERS)


def test_a_small_group_stays_together_and_the_bound_holds_under_churn():
    """Eight rollouts of one prompt in flight at low load share a server; with many sessions in flight
    (Zipf-distributed, random completions), no choice ever exceeds the bound."""
    load: dict[str, int] = {}
    for _ in range(8):
        s = routing.choose("task:7", SERVERS, load)
        load[s] = load.get(s, 0) + 1
    assert list(load.values()) == [8]
    rng = random.Random(0)
    load = {s: 0 for s in SERVERS}
    active: list[str] = []
    for _ in range(5000):
        total = sum(load.values())
        s = routing.choose(f"session:{int(rng.paretovariate(1.2))}", SERVERS, load)
        assert load[s] < routing.capacity(total, len(SERVERS))
        load[s] += 1
        active.append(s)
        if len(active) > 256:  # 256 requests in flight; a random one finishes
            load[active.pop(rng.randrange(len(active)))] -= 1
    assert max(load.values()) <= routing.capacity(256, len(SERVERS))


def test_removing_a_server_moves_only_its_keys():
    keys = [f"k{i}" for i in range(5000)]
    before = {k: routing.choose(k, SERVERS, {}) for k in keys}
    gone = SERVERS[3]
    after = {k: routing.choose(k, [s for s in SERVERS if s != gone], {}) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == gone for k in moved)
    assert all(after[k] == before[k] for k in keys if before[k] != gone)
    added = {k: routing.choose(k, [*SERVERS, "http://d8:8000"], {}) for k in keys}
    assert all(added[k] in (before[k], "http://d8:8000") for k in keys)
    assert 0.07 < sum(added[k] != before[k] for k in keys) / len(keys) < 0.16  # about 1/9 move


def test_no_key_means_least_loaded():
    assert routing.choose(None, SERVERS[:3], {SERVERS[0]: 2, SERVERS[1]: 0, SERVERS[2]: 1}) == SERVERS[1]
    with pytest.raises(ValueError):
        routing.choose("k", [], {})


def test_request_keys():
    sys_msg = {"role": "system", "content": "You are terse."}
    turn1 = {"messages": [sys_msg, {"role": "user", "content": "hi"}]}
    turn2 = {"messages": [*turn1["messages"], {"role": "assistant", "content": "yo"},
                          {"role": "user", "content": "more"}]}
    assert routing.request_key({}, turn1) == routing.request_key({}, turn2)  # one conversation, one key
    assert routing.request_key({}, turn1) != routing.request_key({}, {"messages": [sys_msg, {"role": "user",
                                                                                                  "content": "x"}]})
    assert routing.request_key({"x-session-id": "s1"}, turn1) == "session:s1"
    long = list(range(1000))
    assert routing.request_key({}, {"token_ids": long}) == routing.request_key({}, {"token_ids": long + [5]})
    assert routing.request_key({}, {"prompt": long}) == routing.request_key({}, {"token_ids": long[:300]})
    assert routing.request_key({}, {"prompt": "a" * 5000}) == routing.request_key({}, {"prompt": ["a" * 2000]})
    assert routing.request_key({}, {}) is None


def test_server_pool_uses_the_same_rule():
    from prl.orchestrator.sync import LiveServer, ServerPool

    servers = [LiveServer(u) for u in SERVERS[:4]]
    pool = ServerPool(generate=servers, admin=servers)
    for i in range(20):
        key = f"task:{i}"
        assert pool.pick(0, key=key).url == routing.choose(key, SERVERS[:4], {})
    chosen = pool.pick(0, key="task:0")
    chosen.inflight = 20  # over its share (bound: 5 + slack 8 for 20 in flight on 4): the key spills
    assert pool.pick(0, key="task:0") is not chosen
    assert pool.pick(0, avoid=chosen, key="task:0") is not chosen


def test_generator_keeps_a_group_on_its_tasks_server():
    """The orchestrator's rollouts pick servers with the group's key (its task), as the router would: every
    episode of a group lands on the server `routing.choose` gives that task, not on the least busy one."""
    import asyncio

    from prl.orchestrator.rollouts import Generator, routing_key
    from prl.orchestrator.sync import LiveServer, ServerPool

    class Task:
        def __init__(self, key: str):
            self.key = key

    class Env:
        """Records which server's context ran each task; episodes fail (rollout_from_episode handles them)."""

        def __init__(self):
            self.ran: list[tuple[str, str]] = []

        async def run_slot(self, slot, ctx):
            self.ran.append((slot.task.key, ctx))
            await asyncio.sleep(0.001)
            return type("Episode", (), {"ok": False, "traces": [], "errors": []})()

    servers = [LiveServer(u) for u in SERVERS[:4]]
    env = Env()
    gen = Generator(env, ServerPool(generate=servers, admin=servers), lambda s: s.url, max_concurrent=64,
                    retries=0, need_tokens=False)
    tasks = [Task(f"t{i}") for i in range(12)]

    async def groups():
        return await asyncio.gather(*(gen.group(t, 4, 0) for t in tasks))

    asyncio.run(groups())
    by_task = collections.defaultdict(set)
    for key, url in env.ran:
        by_task[key].add(url)
    assert len(env.ran) == 48
    assert {k: urls for k, urls in by_task.items()} == {
        t.key: {routing.choose(routing_key(t), SERVERS[:4], {})} for t in tasks}
    assert len(set().union(*by_task.values())) > 1, "every task on one server: the keys do not spread"


# ---------------------------------------------------------------- the protocol


def test_prefill_body_follows_vllms_reference_proxy():
    body = {"prompt": "x", "max_tokens": 50, "max_completion_tokens": 50, "min_tokens": 3,
            "min_completion_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    p = prefill_body("/v1/completions", body)
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None,
                                       "remote_host": None, "remote_port": None}
    assert (p["max_tokens"], p["max_completion_tokens"], p["stream"]) == (1, 1, False)
    assert not {"min_tokens", "min_completion_tokens", "stream_options"} & set(p)
    assert body["max_tokens"] == 50 and "kv_transfer_params" not in body  # the client's body is untouched
    g = prefill_body("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 9,
                                                                                       "min_tokens": 2}})
    assert g["sampling_params"] == {"max_tokens": 1} and g["kv_transfer_params"] == REMOTE_DECODE
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "e"}
    assert decode_body(body, {"kv_transfer_params": params}) == {**body, "kv_transfer_params": params}
    assert decode_body(body, {"kv_transfer_params": None}) is None
    assert decode_body(body, ["not", "a", "dict"]) is None


# ---------------------------------------------------------------- the router against stub backends


def stub_backend(name: str, seen: list):
    """A test double of a vLLM server behind the router: records requests, answers like a connector."""
    app = FastAPI()

    @app.post("/{path:path}")
    async def any_post(path: str, request: Request):
        body = await request.json() if await request.body() else {}
        seen.append({"server": name, "path": "/" + path, "body": body, "headers": dict(request.headers)})
        kv = body.get("kv_transfer_params") if isinstance(body, dict) else None
        answer = {"server": name, "got_kv": kv, "choices": [{"text": "ok", "token_ids": [1]}]}
        if kv and kv.get("do_remote_decode"):
            answer["kv_transfer_params"] = {"do_remote_prefill": True, "remote_engine_id": name,
                                            "remote_block_ids": [[7]], "remote_host": "h", "remote_port": 1}
        if body.get("stream"):
            chunks = [f"data: {json.dumps({'server': name, 'got_kv': kv, 'i': i})}\n\n" for i in range(3)]
            return StreamingResponse(iter([*chunks, "data: [DONE]\n\n"]), media_type="text/event-stream")
        return answer

    @app.get("/health")
    async def health():
        return {}

    return app


def stub_router(seen: list, prefill: list[str], decode: list[str], down: tuple[str, ...] = (), **kwargs):
    """The router app in front of stub backends at the given URLs (all recording into `seen`); those in
    `down` refuse connections."""
    import httpx

    stubs = {u: httpx.ASGITransport(app=stub_backend(u, seen)) for u in [*prefill, *decode] if u not in down}

    class Stubs(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            stub = stubs.get(f"{request.url.scheme}://{request.url.host}")
            if stub is None:  # a server that is down
                raise httpx.ConnectError("connection refused", request=request)
            return await stub.handle_async_request(request)

    return build_app(prefill, decode, transport=Stubs(), **kwargs)


@pytest.fixture
def routed():
    """A router (TestClient) in front of stub prefill p0 and decode d0, d1, and the requests they saw."""
    from starlette.testclient import TestClient

    seen: list = []
    app = stub_router(seen, ["http://p0"], ["http://d0", "http://d1"], api_key="k")
    with TestClient(app, headers={"Authorization": "Bearer k"}) as client:
        yield client, seen


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/inference/v1/generate"])
def test_router_hands_kv_params_from_prefill_to_decode(routed, path):
    client, seen = routed
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 5}} if "generate" in path else \
        {"prompt": "hello", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0.7}
    r = client.post(path, json=body, headers={"X-Session-ID": "s-1"})
    assert r.status_code == 200, r.text
    prefill, decode = seen
    assert prefill["server"] == "http://p0" and prefill["body"]["kv_transfer_params"] == REMOTE_DECODE
    assert decode["server"].startswith("http://d") and decode["path"] == path
    assert decode["body"]["kv_transfer_params"]["remote_engine_id"] == "http://p0"
    assert r.json()["got_kv"]["remote_block_ids"] == [[7]]
    assert {k: v for k, v in decode["body"].items() if k != "kv_transfer_params"} == body  # 0.7 stays 0.7
    assert decode["headers"]["x-session-id"] == "s-1" and decode["headers"]["authorization"] == "Bearer k"


def test_router_streams_the_decode_answer(routed):
    client, seen = routed
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert [json.loads(e[6:])["i"] for e in events] == [0, 1, 2]
    assert json.loads(events[0][6:])["got_kv"]["do_remote_prefill"] is True
    assert seen[0]["body"]["stream"] is False and seen[1]["body"]["stream"] is True
    assert client.get("/prl/router").json()["in_flight"] == {"http://p0": 0, "http://d0": 0, "http://d1": 0}


def test_router_keeps_a_session_on_one_decode_server(routed):
    client, seen = routed
    for i in range(12):
        client.post("/v1/completions", json={"prompt": f"p{i}"}, headers={"X-Session-ID": f"s{i % 3}"})
    decodes = [(s["headers"]["x-session-id"], s["server"]) for s in seen if s["server"] != "http://p0"]
    by_session = collections.defaultdict(set)
    for session, server in decodes:
        by_session[session].add(server)
    assert all(len(servers) == 1 for servers in by_session.values()), by_session
    assert by_session["s0"] == {routing.choose("session:s0", ["http://d0", "http://d1"], {})}
    assert client.get("/prl/router").json()["sent"]["http://p0"] == 12


def test_router_fans_admin_out_and_checks_the_key(routed):
    client, seen = routed
    r = client.post("/prl/weights", json={"step": 3})
    assert r.status_code == 200 and set(r.json()["backends"]) == {"http://p0", "http://d0", "http://d1"}
    assert all(s["body"] == {"step": 3} and "kv_transfer_params" not in s["body"] for s in seen)
    wrong_key = {"Authorization": "Bearer no"}
    assert client.post("/v1/completions", json={"prompt": "x"}, headers=wrong_key).status_code == 401


def test_router_without_handoff_sends_the_clients_body():
    """The negative control the P/D test uses: with the hand-off off, decode gets no params."""
    from starlette.testclient import TestClient

    seen: list = []
    with TestClient(stub_router(seen, ["http://p0"], ["http://d0"], kv_handoff=False)) as client:
        assert client.post("/v1/completions", json={"prompt": "x"}).json()["got_kv"] is None
    assert seen[0]["body"]["kv_transfer_params"] == REMOTE_DECODE and "kv_transfer_params" not in seen[1]["body"]


def test_router_refuses_bad_bodies_and_passes_other_paths_to_decode(routed):
    client, seen = routed
    assert client.post("/v1/completions", content=b"{not json").json() == {"error": "body is not JSON"}
    r = client.post("/inference/v1/generate", json=[1, 2])
    assert (r.status_code, r.json()) == (400, {"error": "body must be a JSON object"})
    assert seen == []  # neither reached a backend
    r = client.post("/v1/models?x=1", json={"probe": 1})
    assert r.status_code == 200 and r.json()["server"].startswith("http://d") and seen[0]["path"] == "/v1/models"


def nested(levels: int) -> object:
    """A value `levels` lists deep."""
    value: object = "x"
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(("body", "says"), [
    (b"[" * 100_000 + b"]" * 100_000, "body nests deeper than 64 levels"),
    (json.dumps({"prompt": "x", "x": nested(64)}).encode(), "body nests deeper than 64 levels"),  # not the parser's
    (json.dumps({"token_ids": [1], "sampling_params": [1]}).encode(), "sampling_params must be an object, got list"),
    (json.dumps({"token_ids": [1], "sampling_params": None}).encode(), "sampling_params must be an object, got NoneType"),
    (json.dumps({"prompt": "x", "stream": "yes"}).encode(), "stream must be true or false, got str"),
    (b"\xff\xfe{", "body is not JSON"),
    (b"7", "body must be a JSON object"),
])
@pytest.mark.parametrize("path", ["/inference/v1/generate", "/v1/completions"])
def test_router_refuses_malformed_bodies_with_400_and_one_line(routed, body, says, path):
    client, seen = routed
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert (r.status_code, r.json()) == (400, {"error": says})
    assert seen == []
    if says != "body is not JSON":  # other paths check JSON bodies alike; a body that is not JSON goes as it is
        r = client.post("/v1/responses", content=body, headers={"content-type": "application/json"})
        assert (r.status_code, r.json()) == (400, {"error": says}) and seen == []


def test_a_clients_kv_transfer_params_never_reach_a_server(routed):
    """Only a prefill server's answer gives a decode server its `kv_transfer_params`: a client's own (wherever
    vLLM reads them) would point the decode server's connector at any host."""
    client, seen = routed
    forged = {"do_remote_prefill": True, "remote_host": "attacker", "remote_port": 1, "remote_block_ids": [[0]]}
    body = {"token_ids": [1, 2], "kv_transfer_params": forged, "vllm_xargs": {"kv_transfer_params": forged, "a": 1},
            "sampling_params": {"max_tokens": 3, "extra_args": {"kv_transfer_params": forged, "b": 2}}}
    assert client.post("/inference/v1/generate", json=body).status_code == 200
    prefill, decode = seen
    assert prefill["body"]["kv_transfer_params"] == REMOTE_DECODE
    assert decode["body"]["kv_transfer_params"]["remote_engine_id"] == "http://p0"
    for sent in (prefill["body"], decode["body"]):
        assert sent["vllm_xargs"] == {"a": 1} and sent["sampling_params"]["extra_args"] == {"b": 2}
        assert "attacker" not in json.dumps(sent)
    seen.clear()
    assert client.post("/v1/responses", json={"input": "x", "kv_transfer_params": forged}).status_code == 200
    assert seen[0]["body"] == {"input": "x"}


def test_without_handoff_a_clients_kv_transfer_params_are_dropped_too():
    from starlette.testclient import TestClient

    seen: list = []
    with TestClient(stub_router(seen, ["http://p0"], ["http://d0"], kv_handoff=False)) as client:
        client.post("/v1/completions", json={"prompt": "x", "kv_transfer_params": {"remote_host": "attacker"}})
    assert seen[0]["body"]["kv_transfer_params"] == REMOTE_DECODE and "kv_transfer_params" not in seen[1]["body"]


def test_open_health_says_only_healthy_or_not():
    """/health is open (the launcher's probe): its status code and `ok`, never a backend's address or error;
    /prl/health, behind the key, has each backend's state."""
    from starlette.testclient import TestClient

    seen: list = []
    dead = "http://d-down"
    for decode, code in ((["http://d0"], 200), (["http://d0", dead], 503)):
        app = stub_router(seen, ["http://p0"], decode, down=(dead,), api_key="k")
        with TestClient(app, raise_server_exceptions=False) as client:
            health = client.get("/health")
            assert (health.status_code, health.json()) == (code, {"ok": code == 200})
            assert client.get("/prl/health").status_code == 401
            detail = client.get("/prl/health", headers={"Authorization": "Bearer k"})
            assert detail.status_code == code and detail.json()["backends"]["http://d0"] == "ok"
    assert detail.json()["backends"][dead] == "unreachable: ConnectError"



def test_an_unreachable_backend_is_a_502_with_its_address():
    """A dead server behind the router (its port closed) is the gateway's error, never a 500."""
    import socket

    from starlette.testclient import TestClient

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with TestClient(build_app([dead], [dead]), raise_server_exceptions=False) as client:
        for r in (client.post("/v1/completions", json={"prompt": "x"}), client.get("/v1/models"),
                  client.post("/prl/weights", json={"step": 1})):
            assert r.status_code == 502, (r.status_code, r.text)
            assert r.json()["error"].startswith(f"backend {dead}") and "unreachable: ConnectError" in r.json()["error"]


def test_router_process_exits_0_when_stopped():
    """The launcher stops the router with SIGTERM at the end of every run: that is a clean end, not a kill (143)."""
    import signal
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "prl.inference.router", "--port", str(port),
                             "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/prl/router", timeout=1).read()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read().decode()[-2000:]
    finally:
        proc.kill()
