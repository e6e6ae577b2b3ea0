"""`python -m prl.inference.router`: the proxy in front of prefill/decode-disaggregated servers.

    python -m prl.inference.router --port P [--host H] [--api-key-env VAR] \
        [--policy cache_aware|round_robin] \
        --prefill http://p0:8000 [--prefill ...] --decode http://d0:8000 [--decode ...]

A generation request (`/v1/completions`, `/v1/chat/completions`,
`/inference/v1/generate`) follows vLLM's disaggregation protocol (its
reference proxy, `tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`):

1. a copy goes to a prefill server with one output token, no streaming, and
   `kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false,
   "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
   "remote_port": null}`; the prefill server computes the prompt's KV, keeps
   it for a decode server and answers with the `kv_transfer_params` a decode
   server needs to fetch it (engine id, block ids, host, port);
2. the client's request, plus those `kv_transfer_params`, goes to a decode
   server, whose connector pulls the KV instead of recomputing the prompt;
   its answer is relayed, streamed or not, with its status code.

Connectors that return no params (`ExampleConnector` shares KV through
storage) get the client's request unchanged. Servers are chosen by
`prl.inference.routing` (`cache_aware`, the default: a rollout's
`X-Session-ID`, else its prompt prefix, keeps to one server, under a load
bound) or `round_robin`.

`GET /health` is 200 when every backend's `/health` is, else 503 with each
backend's state. `GET /prl/live` gathers every backend's; `POST /prl/weights`,
`/prl/pause` and `/prl/resume` go to every backend (prefill and decode must
serve the same weights) and fail if any backend fails. `GET /prl/router`:
requests sent to and in flight on each backend. Other paths (`/v1/models`,
...) go to a decode server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import sys

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prl.inference import routing
from prl.log import get_logger, init_logging

log = get_logger("prl.inference.router")

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
FANOUT_PATHS = ("/prl/weights", "/prl/pause", "/prl/resume")
FORWARD_HEADERS = ("authorization", "content-type", "x-session-id", "x-request-id", "accept")
POLICIES = ("cache_aware", "round_robin")

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""The prefill request's `kv_transfer_params` (vLLM's reference proxy): keep the KV for a decode server."""


def prefill_body(path: str, body: dict) -> dict:
    """The request a prefill server gets: same prompt, one output token, no streaming, KV kept for decode."""
    body = dict(body)
    if path == "/inference/v1/generate":
        params = {**body.get("sampling_params", {}), "max_tokens": 1}
        params.pop("min_tokens", None)
        body["sampling_params"] = params
    else:
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body.pop("min_tokens", None)
        body.pop("min_completion_tokens", None)  # not supported on the prefill side
    body["stream"] = False
    body.pop("stream_options", None)
    body["kv_transfer_params"] = dict(REMOTE_DECODE)
    return body


def decode_body(body: dict, prefill_answer: object) -> dict | None:
    """The client's request plus the prefill answer's `kv_transfer_params`; None when it has none."""
    params = prefill_answer.get("kv_transfer_params") if isinstance(prefill_answer, dict) else None
    return {**body, "kv_transfer_params": params} if params else None


class Balancer:
    """Picks prefill and decode servers and counts what each has been sent and holds."""

    def __init__(self, prefill: list[str], decode: list[str], policy: str = "cache_aware"):
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: use one of {', '.join(POLICIES)}")
        self.prefill, self.decode, self.policy = prefill, decode, policy
        self.in_flight = {u: 0 for u in [*prefill, *decode]}
        self.sent = dict.fromkeys(self.in_flight, 0)
        self._cycles = {"prefill": itertools.cycle(prefill), "decode": itertools.cycle(decode)}

    def pick(self, kind: str, key: str | None) -> str:
        """A `kind` ("prefill" or "decode") server for a request with routing `key`."""
        if self.policy == "round_robin":
            return next(self._cycles[kind])
        return routing.choose(key, self.prefill if kind == "prefill" else self.decode, self.in_flight)

    def acquire(self, url: str) -> str:
        """Count one more request on `url`; pair with `release`."""
        self.in_flight[url] += 1
        self.sent[url] += 1
        return url

    def release(self, url: str) -> None:
        self.in_flight[url] -= 1

    @contextlib.contextmanager
    def holding(self, url: str):
        """Count a request on `url` while the block runs."""
        try:
            yield self.acquire(url)
        finally:
            self.release(url)

    def stats(self) -> dict:
        return {"policy": self.policy, "sent": dict(self.sent), "in_flight": dict(self.in_flight)}


def build_app(prefill: list[str], decode: list[str], api_key: str | None = None,
              timeout: float = 3600.0, policy: str = "cache_aware", kv_handoff: bool = True,
              transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The router app. `kv_handoff=False` drops the prefill answer's `kv_transfer_params` (decode then
    recomputes the prompt): for measuring what the hand-off saves, never for serving. `transport`:
    httpx's, to reach in-process backends (tests)."""
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await client.aclose()

    app = FastAPI(lifespan=lifespan)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=httpx.Limits(max_connections=None),
                               transport=transport)
    balancer = Balancer(prefill, decode, policy)
    backends = [*prefill, *decode]
    app.state.balancer = balancer

    def headers_of(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}

    if api_key:
        from prl.inference.server import BearerAuth

        app.add_middleware(BearerAuth, key=api_key)

    @app.get("/health")
    async def health():
        async def one(url: str) -> str:
            try:
                r = await client.get(url + "/health", timeout=5)
                return "ok" if r.status_code == 200 else f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                return f"unreachable: {type(e).__name__}"

        states = dict(zip(backends, await asyncio.gather(*(one(u) for u in backends))))
        healthy = all(s == "ok" for s in states.values())
        return JSONResponse({"ok": healthy, "backends": states}, status_code=200 if healthy else 503)

    @app.get("/prl/live")
    async def live(request: Request):
        async def one(url: str):
            try:
                r = await client.get(url + "/prl/live", headers=headers_of(request), timeout=10)
                return r.json()
            except (httpx.HTTPError, ValueError) as e:
                return {"ok": False, "error": f"{type(e).__name__}: {e}"}

        lives = dict(zip(backends, await asyncio.gather(*(one(u) for u in backends))))
        steps = {v.get("weights_step") for v in lives.values()}
        ok = all(v.get("ok") for v in lives.values()) and len(steps) == 1
        return JSONResponse({"ok": ok, "weights_step": steps.pop() if len(steps) == 1 else None,
                             "paused": any(v.get("paused") for v in lives.values()), "backends": lives},
                            status_code=200 if ok else 503)

    @app.get("/prl/router")
    async def router_stats():
        return balancer.stats()

    async def fanout(request: Request, path: str):
        body = await request.body()

        async def one(url: str):
            r = await client.post(url + path, content=body, headers=headers_of(request))
            try:
                return r.status_code, r.json()
            except ValueError:
                return r.status_code, r.text

        results = await asyncio.gather(*(one(u) for u in backends))
        worst = max(code for code, _ in results)
        return JSONResponse({"backends": {u: out for u, (_, out) in zip(backends, results)}},
                            status_code=worst if worst >= 400 else 200)

    def route(handler, path: str):
        async def endpoint(request: Request):
            return await handler(request, path)

        return endpoint

    for path in FANOUT_PATHS:
        app.add_api_route(path, route(fanout, path), methods=["POST"])

    async def disaggregated(request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return JSONResponse({"error": "body is not JSON"}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": "body must be a JSON object"}, status_code=400)
        headers = headers_of(request)
        key = routing.request_key(request.headers, body)
        with balancer.holding(balancer.pick("prefill", key)) as url:
            p = await client.post(url + path, json=prefill_body(path, body), headers=headers)
        if p.status_code != 200:  # the prompt is bad or the prefill server is: say so, skip decode
            return Response(p.content, status_code=p.status_code, media_type=p.headers.get("content-type"))
        try:
            handed = decode_body(body, p.json()) if kv_handoff else None
        except ValueError:
            handed = None
        content = raw if handed is None else json.dumps(handed).encode()
        if handed is not None:
            headers = {**headers, "content-type": "application/json"}
        return await relay_decode(path, key, content, headers, stream=bool(body.get("stream")))

    async def relay_decode(path: str, key: str | None, content: bytes, headers: dict, stream: bool):
        """Send the decode request and relay its answer (streamed when the client streams)."""
        url = balancer.acquire(balancer.pick("decode", key))
        try:
            resp = await client.send(client.build_request("POST", url + path, content=content, headers=headers),
                                     stream=True)
        except BaseException:
            balancer.release(url)
            raise
        if stream:
            async def chunks():
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()
                    balancer.release(url)

            return StreamingResponse(chunks(), status_code=resp.status_code,
                                     media_type=resp.headers.get("content-type"))
        try:
            data = await resp.aread()
        finally:
            await resp.aclose()
            balancer.release(url)
        return Response(data, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    for path in GENERATE_PATHS:
        app.add_api_route(path, route(disaggregated, path), methods=["POST"])

    @app.api_route("/{rest:path}", methods=["GET", "POST"])
    async def passthrough(request: Request, rest: str):
        url = balancer.pick("decode", None)
        r = await client.request(request.method, url + "/" + rest, content=await request.body(),
                                 headers=headers_of(request), params=request.query_params)
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m prl.inference.router", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", action="append", required=True, help="a prefill server's base URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="a decode server's base URL (repeatable)")
    ap.add_argument("--api-key-env", default=None, help="env var with the key clients must send (and backends get)")
    ap.add_argument("--policy", choices=POLICIES, default="cache_aware",
                    help="how servers are picked (default: cache_aware, see prl.inference.routing)")
    ap.add_argument("--no-kv-handoff", action="store_true",
                    help="do not pass kv_transfer_params to decode (it recomputes the prompt): for measurements")
    args = ap.parse_args(argv)
    key = os.environ.get(args.api_key_env, "") if args.api_key_env else ""
    import uvicorn

    init_logging("router")
    app = build_app([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode], key or None,
                    policy=args.policy, kv_handoff=not args.no_kv_handoff)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=False)


if __name__ == "__main__":
    main(sys.argv[1:])
