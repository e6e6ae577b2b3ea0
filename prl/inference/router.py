"""`python -m prl.inference.router`: the proxy in front of prefill/decode-disaggregated servers.

    python -m prl.inference.router --port P [--host H] [--api-key-env VAR] \
        --prefill http://p0:8000 [--prefill ...] --decode http://d0:8000 [--decode ...]

For a generation request (`/v1/completions`, `/v1/chat/completions`,
`/inference/v1/generate`) it first sends a copy to a prefill server with the
output limited to one token (the prefill server computes the prompt's KV and
its KV connector ships it), then sends the original request to a decode
server (whose connector loads that KV instead of recomputing it) and relays
its answer, streamed or not, with its status code. Servers are picked round
robin. The KV hand-off itself is the connector's business (`ExampleConnector`
through shared storage on CPU, `NixlConnector` on GPU clusters).

`GET /health` is 200 when every backend's `/health` is, else 503 with each
backend's state. `GET /prl/live` gathers every backend's; `POST /prl/weights`,
`/prl/pause` and `/prl/resume` go to every backend (prefill and decode must
serve the same weights) and fail if any backend fails. Other paths
(`/v1/models`, ...) go to a decode server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import sys

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("prl.inference.router")

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
FANOUT_PATHS = ("/prl/weights", "/prl/pause", "/prl/resume")
FORWARD_HEADERS = ("authorization", "content-type", "x-session-id", "x-request-id", "accept")


def prefill_body(path: str, body: dict) -> dict:
    """The request a prefill server gets: same prompt, one output token, no streaming."""
    body = dict(body)
    if path == "/inference/v1/generate":
        body["sampling_params"] = {**body.get("sampling_params", {}), "max_tokens": 1, "min_tokens": 0}
    else:
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body.pop("min_tokens", None)
    body["stream"] = False
    body.pop("stream_options", None)
    return body


def build_app(prefill: list[str], decode: list[str], api_key: str | None = None,
              timeout: float = 3600.0) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await client.aclose()

    app = FastAPI(lifespan=lifespan)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=httpx.Limits(max_connections=None))
    next_prefill, next_decode = itertools.cycle(prefill), itertools.cycle(decode)
    backends = [*prefill, *decode]

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
        headers = headers_of(request)
        p = await client.post(next(next_prefill) + path, json=prefill_body(path, body), headers=headers)
        if p.status_code != 200:  # the prompt is bad or the prefill server is: say so, skip decode
            return Response(p.content, status_code=p.status_code, media_type=p.headers.get("content-type"))
        req = client.build_request("POST", next(next_decode) + path, content=raw, headers=headers)
        resp = await client.send(req, stream=True)
        if body.get("stream"):
            async def relay():
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()

            return StreamingResponse(relay(), status_code=resp.status_code,
                                     media_type=resp.headers.get("content-type"))
        content = await resp.aread()
        await resp.aclose()
        return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    for path in GENERATE_PATHS:
        app.add_api_route(path, route(disaggregated, path), methods=["POST"])

    @app.api_route("/{rest:path}", methods=["GET", "POST"])
    async def passthrough(request: Request, rest: str):
        r = await client.request(request.method, next(next_decode) + "/" + rest, content=await request.body(),
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
    args = ap.parse_args(argv)
    key = os.environ.get(args.api_key_env, "") if args.api_key_env else ""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="(prl-router) %(levelname)s %(asctime)s %(message)s")
    app = build_app([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode], key or None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=False)


if __name__ == "__main__":
    main(sys.argv[1:])
