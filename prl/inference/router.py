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
storage) get the client's request unchanged. A client's own
`kv_transfer_params` (top level, in `vllm_xargs` or in
`sampling_params.extra_args`, where vLLM reads them too) never reach a
server: they would point a decode server's connector at any host.

A JSON body is refused with 400 and a one-line reason when it is not JSON,
not an object, nests deeper than MAX_DEPTH, or holds a field the router
reads with the wrong type (`sampling_params` not an object, `stream` not a
boolean); bodies over `prl.inference.server.MAX_BODY_BYTES` get 413 before
they are read. Servers are chosen by
`prl.inference.routing` (`cache_aware`, the default: a rollout's
`X-Session-ID`, else its prompt prefix, keeps to one server, under a load
bound) or `round_robin`.

`GET /health` (open: the launcher's readiness probe) is 200 when every
backend's `/health` is, else 503, and says nothing more; `GET /prl/health`
(with the key) adds each backend's state. `GET /prl/live` gathers every backend's; `POST /prl/weights`,
`/pause` and `/resume` (vLLM's RL API, with their query) go to every backend (prefill and decode must
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
import signal
import sys

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prl.inference import routing
from prl.errors import run_entry
from prl.log import get_logger, init_logging
from prl.run.api import GENERATE_PATHS
from prl.states import Role

log = get_logger(__name__)

FANOUT_PATHS = ("/prl/weights", "/pause", "/resume")
FORWARD_HEADERS = ("authorization", "content-type", "x-session-id", "x-request-id", "accept")
POLICIES = ("cache_aware", "round_robin")
MAX_DEPTH = 64
"""Deepest nesting of lists and objects a request body may have (chat messages with tool schemas need far less)."""

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
        self._cycles = {Role.PREFILL: itertools.cycle(prefill), Role.DECODE: itertools.cycle(decode)}

    def pick(self, kind: str, key: str | None) -> str:
        """A `kind` ("prefill" or "decode") server for a request with routing `key`."""
        if self.policy == "round_robin":
            return next(self._cycles[kind])
        return routing.choose(key, self.prefill if kind == Role.PREFILL else self.decode, self.in_flight)

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
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=httpx.Limits(max_connections=None),
                               transport=transport)
    proxy = Proxy(client, Balancer(prefill, decode, policy), kv_handoff)
    app = FastAPI(lifespan=closing(client))
    app.state.balancer = proxy.balancer
    app.add_exception_handler(httpx.HTTPError, backend_unreachable)
    from prl.inference.server import BearerAuth, BodyLimit

    app.add_middleware(BodyLimit)
    if api_key:
        app.add_middleware(BearerAuth, key=api_key)
    app.add_api_route("/health", proxy.health, methods=["GET"])
    app.add_api_route("/prl/health", proxy.health_detail, methods=["GET"])
    app.add_api_route("/prl/live", proxy.live, methods=["GET"])
    app.add_api_route("/prl/router", proxy.stats, methods=["GET"])
    for path in FANOUT_PATHS:
        app.add_api_route(path, on_path(proxy.fanout, path), methods=["POST"])
    for path in sorted(GENERATE_PATHS):
        app.add_api_route(path, on_path(proxy.disaggregated, path), methods=["POST"])
    app.add_api_route("/{rest:path}", proxy.passthrough, methods=["GET", "POST"])  # last: it matches every path
    return app


async def backend_unreachable(request: Request, exc: Exception) -> JSONResponse:
    """A backend that cannot be reached (or dropped the connection) is the gateway's error, not the router's."""
    where = getattr(getattr(exc, "request", None), "url", None) if isinstance(exc, httpx.RequestError) else None
    return JSONResponse({"error": f"backend {where or ''} unreachable: {type(exc).__name__}: {exc}".replace("  ", " ")},
                        status_code=502)


def closing(client: httpx.AsyncClient):
    """A FastAPI lifespan that closes `client` at shutdown."""
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await client.aclose()

    return lifespan


def on_path(handler, path: str):
    """An endpoint that calls `handler(request, path)`: one handler serves several fixed paths."""
    async def endpoint(request: Request):
        return await handler(request, path)

    return endpoint


def forwarded_headers(request: Request) -> dict[str, str]:
    """The client's headers a backend gets (key, content type, session and request ids)."""
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}


class BadBody(ValueError):
    """A request body the router refuses (400); the message says why in one line."""


class NotJSON(BadBody):
    """A body that is not JSON at all (a form, a file): only generation requests must be JSON."""


def json_object(raw: bytes) -> dict:
    """The body as a JSON object nested at most MAX_DEPTH deep, with the fields the router reads of the
    right type and without the client's `kv_transfer_params`; BadBody (or NotJSON) otherwise."""
    try:
        body = json.loads(raw)
    except RecursionError:  # the parser recurses per level: far past MAX_DEPTH
        raise BadBody(f"body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError:
        raise NotJSON("body is not JSON") from None
    if not isinstance(body, dict):
        raise BadBody("body must be a JSON object")
    if nesting(body) > MAX_DEPTH:
        raise BadBody(f"body nests deeper than {MAX_DEPTH} levels")
    for name, kind, what in (("sampling_params", dict, "an object"), ("stream", bool, "true or false")):
        if name in body and not isinstance(body[name], kind):
            raise BadBody(f"{name} must be {what}, got {type(body[name]).__name__}")
    return without_client_kv(body)


def nesting(value: object) -> int:
    """How deep lists and objects nest in `value` (0 for a scalar); iterative, one pass per level."""
    level, deepest = [value], 0
    while level := [v for v in level if isinstance(v, (dict, list))]:
        deepest += 1
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v)]
    return deepest


def without_client_kv(body: dict) -> dict:
    """`body` without `kv_transfer_params` wherever vLLM reads them (top level, `vllm_xargs`,
    `sampling_params.extra_args`): only a prefill server's answer may give a decode server its params."""
    body.pop("kv_transfer_params", None)
    for holder in (body.get("vllm_xargs"), (body.get("sampling_params") or {}).get("extra_args")):
        if isinstance(holder, dict):
            holder.pop("kv_transfer_params", None)
    return body


def relayed(r: httpx.Response, content: bytes | None = None) -> Response:
    """A backend's answer as the router's, with its status code and content type."""
    return Response(r.content if content is None else content, status_code=r.status_code,
                    media_type=r.headers.get("content-type"))


class Proxy:
    """The router's endpoints over one HTTP client and one balancer."""

    def __init__(self, client: httpx.AsyncClient, balancer: Balancer, kv_handoff: bool):
        self.client, self.balancer, self.kv_handoff = client, balancer, kv_handoff
        self.backends = [*balancer.prefill, *balancer.decode]

    async def health(self) -> JSONResponse:
        """200 when every backend's /health is, else 503; no backend's address or error (it is open)."""
        healthy = all(s == "ok" for s in await self.backend_states())
        return JSONResponse({"ok": healthy}, status_code=200 if healthy else 503)

    async def health_detail(self) -> JSONResponse:
        """/health with each backend's state (behind the key)."""
        states = dict(zip(self.backends, await self.backend_states()))
        healthy = all(s == "ok" for s in states.values())
        return JSONResponse({"ok": healthy, "backends": states}, status_code=200 if healthy else 503)

    async def backend_states(self) -> list[str]:
        return await asyncio.gather(*(self.backend_health(u) for u in self.backends))

    async def backend_health(self, url: str) -> str:
        try:
            r = await self.client.get(url + "/health", timeout=5)
            return "ok" if r.status_code == 200 else f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            return f"unreachable: {type(e).__name__}"

    async def live(self, request: Request) -> JSONResponse:
        """Every backend's /prl/live; ok when all are and serve one weights step."""
        headers = forwarded_headers(request)
        answers = await asyncio.gather(*(self.backend_live(u, headers) for u in self.backends))
        lives = dict(zip(self.backends, answers))
        steps = {v.get("weights_step") for v in lives.values()}
        ok = all(v.get("ok") for v in lives.values()) and len(steps) == 1
        return JSONResponse({"ok": ok, "weights_step": steps.pop() if len(steps) == 1 else None,
                             "paused": any(v.get("paused") for v in lives.values()), "backends": lives},
                            status_code=200 if ok else 503)

    async def backend_live(self, url: str, headers: dict[str, str]) -> dict:
        try:
            r = await self.client.get(url + "/prl/live", headers=headers, timeout=10)
            return r.json()
        except (httpx.HTTPError, ValueError) as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}

    async def stats(self) -> dict:
        return self.balancer.stats()

    async def fanout(self, request: Request, path: str) -> JSONResponse:
        """POST to every backend; the worst status code (200 when none is an error) and each answer."""
        body, headers = await request.body(), forwarded_headers(request)
        query = f"?{request.url.query}" if request.url.query else ""  # vLLM's /pause takes its mode there
        results = await asyncio.gather(*(self.post_one(u + path + query, body, headers) for u in self.backends))
        worst = max(code for code, _ in results)
        return JSONResponse({"backends": {u: out for u, (_, out) in zip(self.backends, results)}},
                            status_code=worst if worst >= 400 else 200)

    async def post_one(self, url: str, body: bytes, headers: dict[str, str]) -> tuple[int, object]:
        r = await self.client.post(url, content=body, headers=headers)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    async def disaggregated(self, request: Request, path: str) -> Response:
        """Prefill with one output token, then decode with the prefill's `kv_transfer_params`."""
        try:
            body = json_object(await request.body())
        except BadBody as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        headers = {**forwarded_headers(request), "content-type": "application/json"}
        key = routing.request_key(request.headers, body)
        with self.balancer.holding(self.balancer.pick(Role.PREFILL, key)) as url:
            p = await self.client.post(url + path, json=prefill_body(path, body), headers=headers)
        if p.status_code != 200:  # the prompt is bad or the prefill server is: say so, skip decode
            return relayed(p)
        decode = self.handed_over(body, p) or body
        return await self.relay_decode(path, key, json.dumps(decode).encode(), headers,
                                       stream=body.get("stream", False))

    def handed_over(self, body: dict, prefill: httpx.Response) -> dict | None:
        """The decode request with the prefill's `kv_transfer_params`; None to send the client's body as is."""
        if not self.kv_handoff:
            return None
        try:
            return decode_body(body, prefill.json())
        except ValueError:
            return None

    async def relay_decode(self, path: str, key: str | None, content: bytes, headers: dict, stream: bool) -> Response:
        """Send the decode request and relay its answer (streamed when the client streams)."""
        url = self.balancer.acquire(self.balancer.pick(Role.DECODE, key))
        try:
            request = self.client.build_request("POST", url + path, content=content, headers=headers)
            resp = await self.client.send(request, stream=True)
        except BaseException:
            self.balancer.release(url)
            raise
        if stream:
            return StreamingResponse(self.chunks(resp, url), status_code=resp.status_code,
                                     media_type=resp.headers.get("content-type"))
        try:
            data = await resp.aread()
        finally:
            await resp.aclose()
            self.balancer.release(url)
        return relayed(resp, data)

    async def chunks(self, resp: httpx.Response, url: str):
        """A streamed decode answer, chunk by chunk; `url` counts the request until the stream ends."""
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:
            await resp.aclose()
            self.balancer.release(url)

    async def passthrough(self, request: Request, rest: str) -> Response:
        """Any other path (`/v1/models`, ...): to a decode server. A JSON body is checked as a generation
        request's is (`/v1/responses` and others take `kv_transfer_params` too); another body goes as it is."""
        content = await request.body()
        if content.strip():
            try:
                content = json.dumps(json_object(content)).encode()
            except NotJSON:
                pass
            except BadBody as e:
                return JSONResponse({"error": str(e)}, status_code=400)
        url = self.balancer.pick(Role.DECODE, None)
        r = await self.client.request(request.method, url + "/" + rest, content=content,
                                      headers=forwarded_headers(request), params=request.query_params)
        return relayed(r)


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
    from prl.inference.server import api_key

    key = api_key(args.api_key_env)  # fails closed: no key, no router
    import uvicorn

    init_logging(Role.ROUTER)
    app = build_app([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode], key or None,
                    policy=args.policy, kv_handoff=not args.no_kv_handoff)
    # After a graceful shutdown uvicorn re-raises the SIGTERM/SIGINT it stopped on, with the handler it found
    # installed: a stop is how the router ends, so it exits 0 (as the inference servers do), not 143.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stopped)
    from prl.inference.http_limits import BoundedHTTP

    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=False, http=BoundedHTTP)


def stopped(signum: int, _frame) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    sys.exit(run_entry("prl router", lambda: main(sys.argv[1:])))
