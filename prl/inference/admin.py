"""Admin endpoints of the inference server: liveness and weight updates. Pausing and resuming are vLLM's own
RL API routes, which every prl server mounts behind the run's key (`POST /pause?mode=keep|wait|abort`,
`POST /resume`, `GET /is_paused`, `GET /weight_info`: prl.inference.server.RL_API_ROUTES).

    GET  /prl/engine   200 when the engine itself answers (vLLM's /health asks only the API process), 503 not
    GET  /prl/live     {"ok", "weights_step", "weights_path", "disk_step", "paused", "model", "updates", ...}
                       (an inference pool's: "tenants" too; an attached run's: its own adapter's)
    POST /prl/weights  {"step": N} | {"path": "/abs/dir"} | {"step": N, "feeds": ["host:port", ...]
                       [, "group": {"token", "world", "rank", "timeout"}]} [, "mode": "keep"|"wait"|"abort"]
                       -> {"step", "path", "seconds", "load_seconds", "pause_seconds", "kv_storage_cleared"}
    POST /prl/detach   a run attached to an inference pool: its adapter unloaded here (docs/inference.md,
                       Inference pools; an attached run's /prl/weights loads its own adapter: `tenant_update`)

A weight update is validated completely before any weight is touched (the
directory is under RUN/weights/ and published, its tensors have the served
names and shapes); then: pause generation (default "keep": in-flight requests
freeze and continue on the new weights; a multimodal model's finish first, "wait", since vLLM 0.32 cannot
resume a preempted request with pictures), load in every worker, drop every KV
computed with the old weights (`invalidate_kv`: the prefix cache, the KV
connector's cache, and `ExampleConnector`'s storage, which vLLM does not
reset), resume (unless the server was paused before the update). Updates are
serialized.

With "feeds", the step comes from the trainer ranks' weight feeds, in memory,
through vLLM's weight-transfer RPCs (`start_weight_update`, `update_weights`,
`finish_weight_update`, which stamps vLLM's weight version with the step) and
the "prl_feed" engine (prl/inference/feed_engine.py); `/prl/live` then
reports `"weights_path": "memory:step_N"`. A feed that refuses (wrong key,
another step) or a step whose tensors are not the served ones is refused
before any weight is touched: 502, the old weights keep serving. With "group"
(`weights.transport: broadcast`), the server's workers take ranks `rank`,
`rank + 1`, ... of each feed's broadcast group (`/prl/live` says how many
workers: "workers"); a group that does not form is refused the same way.

If loading fails part-way, the last weights the server loaded from disk are
loaded again (and reported); if that fails too, `/prl/live` answers 503 with
`"ok": false` so the launcher replaces the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from prl.inference.checks import (
    FeedTarget,
    UpdateRefused,
    WeightsTarget,
    checkpoint_layout,
    compare_layouts,
    resolve_feeds,
    resolve_weights_dir,
)
from prl.log import get_logger
from prl.run.rundir import RunDir, step_of
from prl.run.tenants import Registry, Tenant

router = APIRouter()
log = get_logger(__name__)

PAUSE_MODES = ("keep", "wait", "abort")
MAX_BODY_BYTES = 64 * 1024
"""Largest admin request body (they are a few small fields)."""

KV_RESET_TIMEOUT_S = 90.0
"""How long an update waits at least for KV blocks held for another server (a NIXL prefill server
keeps a prompt's blocks until its decode server pulls them, or their lease runs out)."""
NIXL_LEASE_S = 30
"""NixlConnector's default `kv_lease_duration` (seconds)."""
ENGINE_PROBE_S = 10.0
"""How long `/prl/engine` waits for the engine to answer a utility call."""
ENGINE_ANSWER_KEPT_S = 1.0
"""How long an engine's answer stands for `/prl/engine` (the route is open: callers share one utility call at a
time and at most one a second, however many they are)."""
UPDATE_BOUND_S = 600.0
"""How long a weight update may hold the engine and still count as healthy (the engine answers nothing else
while it loads; the weight watcher gives a push as long)."""


class KVResetFailed(RuntimeError):
    """The old weights' KV could not be dropped: serving would reuse it."""


@dataclass
class AdminState:
    """What the admin endpoints share (one per server process)."""

    run: RunDir
    model_name: str
    weights_path: str
    """Directory of the weights being served (the --model dir at start), or memory:step_N."""
    layout: dict[str, tuple[int, ...]] | None
    """Tensor names and shapes an update must match (None: --model is not a local dir)."""
    weights_step: int | None = None
    disk: tuple[str, int | None] | None = None
    """The last weights loaded from disk (directory, step): what a failed update rolls back to."""
    updates: int = 0
    last_update: dict | None = None
    broken: str | None = None
    """Why the served weights are unknown after a failed update and a failed rollback."""
    lora: bool = False
    """Started with `--enable-lora`: updates are adapters (`model.lora`), served under the model's name."""
    tenants: Registry | None = None
    """A pool (`--tenants`): the attached runs, each loading its adapter under its own name (prl/run/tenants.py);
    the base model itself never changes."""
    adapters: dict[str, dict] = field(default_factory=dict)
    """A pool's attached runs' adapters, by run name: {"step", "path", "lora_id", "updates", "last_update"}."""
    lora_ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    """vLLM's LoRA ids, one per adapter version loaded (a new id: no KV or cached weights of an older one reused)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    updating_since: float | None = None
    """When the update holding `lock` began (time.monotonic())."""
    engine_answered: float = float("-inf")
    """When the engine last answered `/prl/engine`'s utility call (time.monotonic())."""
    engine_probe: asyncio.Future | None = None
    """That call while it runs, shared by every caller."""


def _state(request: Request) -> AdminState:
    return request.app.state.prl_admin


def _engine(request: Request):
    return request.app.state.engine_client


def _tenant(request: Request) -> Tenant | None:
    """The attached run making this request (its key matched a pool record: prl.inference.server.PoolAuth)."""
    state = _state(request)
    name = request.scope.get("state", {}).get("prl_tenant")
    return state.tenants.get(name) if state.tenants is not None and name else None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message, "status": status}, status_code=status)


async def _body(request: Request) -> dict:
    """The request's JSON object ({} for an empty body); UpdateRefused(413/400) otherwise."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise UpdateRefused(413, f"body of {len(raw)} bytes; admin requests take at most {MAX_BODY_BYTES}")
    if not raw.strip():
        return {}
    try:
        body = await request.json()
    except (ValueError, RecursionError) as e:
        raise UpdateRefused(400, f"body is not JSON: {str(e)[:200]}") from e
    if not isinstance(body, dict):
        raise UpdateRefused(400, f"body must be a JSON object, got {type(body).__name__}")
    return body


def _mode(body: dict, default: str) -> str:
    mode = body.get("mode", default)
    if not isinstance(mode, str) or mode not in PAUSE_MODES:
        raise UpdateRefused(400, f'"mode" must be one of {", ".join(PAUSE_MODES)}, got {str(mode)[:40]!r}')
    return mode


@router.get("/prl/engine")
async def engine_health(request: Request):
    """Whether the engine answers, for the role runner's hang probe: vLLM's /health answers as long as the API
    process runs, so an engine core that is stopped or deadlocked passed it while every rollout waited. 200
    when a utility call comes back within ENGINE_PROBE_S, or while a weight update younger than UPDATE_BOUND_S
    holds the engine (it answers nothing else until the load ends); 503 otherwise."""
    state, engine = _state(request), _engine(request)
    if engine.errored:
        return _error(503, "the engine died")
    if state.updating_since is not None:
        held = time.monotonic() - state.updating_since
        if held < UPDATE_BOUND_S:
            return {"ok": True, "updating_s": round(held, 1)}
        return _error(503, f"a weight update has held the engine for {held:.0f} s (bound {UPDATE_BOUND_S:.0f} s)")
    if not await _engine_answers(state, engine):
        return _error(503, f"the engine did not answer within {ENGINE_PROBE_S:.0f} s")
    return {"ok": True}


async def _engine_answers(state: AdminState, engine) -> bool:
    """Whether the engine answers a utility call within ENGINE_PROBE_S: one call at a time, shared by every
    caller, and an answer stands for ENGINE_ANSWER_KEPT_S."""
    if time.monotonic() - state.engine_answered < ENGINE_ANSWER_KEPT_S:
        return True
    if state.engine_probe is None or state.engine_probe.done():
        state.engine_probe = asyncio.ensure_future(asyncio.wait_for(engine.is_paused(), ENGINE_PROBE_S))
    try:
        await asyncio.shield(state.engine_probe)
    except Exception:  # noqa: BLE001 - timed out, or the engine is gone: it did not answer
        return False
    state.engine_answered = time.monotonic()
    return True


@router.get("/prl/live")
async def live(request: Request):
    state = _state(request)
    if (tenant := _tenant(request)) is not None:
        return tenant_live(state, tenant)
    paused = await _engine(request).is_paused()
    body = {
        "ok": state.broken is None,
        "weights_step": state.weights_step,
        "weights_path": state.weights_path,
        "disk_step": state.disk[1] if state.disk else None,
        "paused": paused,
        "model": state.model_name,
        "updates": state.updates,
        "last_update": state.last_update,
        "updating": state.lock.locked(),
        "workers": _engine(request).vllm_config.parallel_config.world_size,
    }
    if state.broken:
        body["error"] = state.broken
    if state.tenants is not None:
        state.tenants.refresh()
        body["tenants"] = {name: state.adapters.get(name, {}).get("step") for name in state.tenants.names()}
    return JSONResponse(body, status_code=200 if state.broken is None else 503)


def tenant_live(state: AdminState, tenant: Tenant) -> dict:
    """`/prl/live` as an attached run sees it: its own adapter (weights_step null: the base model serves it)."""
    loaded = state.adapters.get(tenant.name, {})
    step = loaded.get("step")
    return {"ok": state.broken is None, "model": tenant.name, "weights_step": step, "disk_step": step,
            "weights_path": loaded.get("path"), "updates": loaded.get("updates", 0),
            "last_update": loaded.get("last_update"), "updating": state.lock.locked()}


def checked_target(state, body: dict) -> tuple[WeightsTarget | FeedTarget, str]:
    """The weights step a `/prl/weights` body names and the pause mode, checked before the model is touched:
    inside the run's weights, STABLE, readable, and laid out as the served model is (UpdateRefused if not).
    A step from feeds is checked here for its form only; the worker checks its layout before loading."""
    mode = _mode(body, "keep")
    body = {k: v for k, v in body.items() if k != "mode"}
    if "feeds" in body:
        return resolve_feeds(body), mode
    target = resolve_weights_dir(state.run, body)
    if target.adapter != state.lora:
        raise UpdateRefused(409, f"{target.path} is {'a LoRA adapter' if target.adapter else 'a whole model'}; this "
                                 f"server {'serves adapters (--enable-lora)' if state.lora else 'runs without --enable-lora'}")
    if state.layout is not None and not target.adapter:
        compare_layouts(state.layout, checkpoint_layout(target.path), target.path)
    else:
        checkpoint_layout(target.path)  # at least readable safetensors (vLLM checks an adapter's names as it loads)
    return target, mode


@router.post("/prl/weights")
async def update_weights(request: Request):
    state = _state(request)
    try:
        body = await _body(request)
        if state.tenants is not None:  # an inference pool: adapters of the attached runs
            return await tenant_update(request, state, _tenant(request), body)
    except UpdateRefused as e:
        return _error(e.status, e.message)
    return await update_served(request, state, body)


async def update_served(request: Request, state: AdminState, body: dict):
    """`/prl/weights` of a run's own server: its model's weights (or its run's adapter) from disk or feeds."""
    engine = _engine(request)
    t0 = time.perf_counter()
    try:
        target, mode = checked_target(state, body)
        check_group(engine, target)
    except UpdateRefused as e:
        return _error(e.status, e.message)

    async with state.lock:
        if state.broken:
            return _error(503, f"server is broken, refusing updates: {state.broken}")
        # Logged before the engine is asked anything: an update that never ends shows where it began.
        source = (f"{len(target.feeds)} trainer feeds{' by broadcast' if target.group else ''}"
                  if isinstance(target, FeedTarget) else str(target.path))
        log.info("weights update begins: step %s from %s (pause %s)", target.step, source, mode)
        outcome, state.updating_since = "failed", time.monotonic()  # "failed": the answer says why
        try:
            was_paused = await engine.is_paused()
            t_pause = time.perf_counter()
            if mode == "keep" and is_multimodal(engine):
                mode = "wait"  # its in-flight requests finish first: they cannot be preempted (invalidate_kv)
            await engine.pause_generation(mode=mode, clear_cache=False)
            pause_seconds = time.perf_counter() - t_pause
            try:
                transfer = {}
                if isinstance(target, WeightsTarget) and target.adapter:
                    load_seconds = await load_adapter(request, state, target)
                else:
                    load_seconds, transfer = await load(engine, target)
            except Exception as e:  # noqa: BLE001 - any worker failure: roll back, then report
                return await recover(state, engine, target, f"loading {target.path} failed: {type(e).__name__}: {e}")
            finally:
                # KV computed with the old weights must not serve new requests; in-flight ones recompute.
                try:
                    cleared = await invalidate_kv(engine)
                except KVResetFailed as e:
                    state.broken = f"after loading {target.path}: {e}"
                finally:
                    if not was_paused:
                        await engine.resume_generation()
            if state.broken:
                return _error(500, state.broken)

            seconds = time.perf_counter() - t0
            served(state, target, seconds=seconds, pause_seconds=pause_seconds, load_seconds=load_seconds,
                   kv_storage_cleared=cleared, **transfer)
            outcome = f"served in {seconds:.2f} s"
        finally:  # with the line above, a begin without an end in the log is an update still in flight
            state.updating_since = None
            log.info("weights update ends: step %s, %s", target.step, outcome)
    _record_metrics(state, request)
    return {"step": target.step, "path": str(target.path), "seconds": seconds,
            "pause_seconds": pause_seconds, "load_seconds": state.last_update["load_seconds"],
            "kv_storage_cleared": cleared, **transfer}


def check_group(engine, target: WeightsTarget | FeedTarget) -> None:
    """A broadcast group holds every worker of this server (UpdateRefused 400 if its ranks run past it)."""
    group = getattr(target, "group", None)
    workers = engine.vllm_config.parallel_config.world_size
    if group is not None and group.rank + workers > group.world:
        raise UpdateRefused(400, f'"group": this server\'s {workers} workers from rank {group.rank} do not fit in '
                                 f"a world of {group.world}")


def served(state: AdminState, target: WeightsTarget | FeedTarget, **numbers) -> None:
    """Record an update the server now serves (`/prl/live` and the next metrics line read it)."""
    state.weights_path, state.weights_step = str(target.path), target.step
    if isinstance(target, WeightsTarget) and not target.adapter:
        state.disk = (str(target.path), target.step)
    state.updates += 1
    state.last_update = {"step": target.step, "path": str(target.path), **numbers, "time": time.time()}


async def tenant_update(request: Request, state: AdminState, tenant: Tenant | None, body: dict) -> dict:
    """An attached run's `/prl/weights`: a published adapter step of its own run directory, loaded under its
    name (requests running keep the version they started with; no pause, no KV dropped: each version has a new
    LoRA id). UpdateRefused for the pool's own key, a whole model, or a step outside the run."""
    from vllm.lora.request import LoRARequest

    if tenant is None:
        raise UpdateRefused(409, "this server is an inference pool: its base model does not change; attached runs "
                                 "load their adapters with their own keys")
    body = {k: v for k, v in body.items() if k != "mode"}
    target = resolve_weights_dir(RunDir(tenant.run_dir), body)
    if not target.adapter:
        raise UpdateRefused(409, f"{target.path} is a whole model; a run attached to an inference pool loads "
                                 f"LoRA adapters only (model.lora)")
    checkpoint_layout(target.path)  # readable safetensors (vLLM checks the adapter's names as it loads)
    t0 = time.perf_counter()
    async with state.lock:
        log.info("adapter update begins: run %s, step %s from %s", tenant.name, target.step, target.path)
        lora = LoRARequest(tenant.name, next(state.lora_ids), str(target.path))
        try:
            await _engine(request).add_lora(lora)
        except Exception as e:  # noqa: BLE001 - the engine refused it whole: the old version serves
            raise UpdateRefused(502, f"loading {target.path} failed: {type(e).__name__}: {e}; still serving "
                                     f"{state.adapters.get(tenant.name, {}).get('path') or 'the base model'}") from e
        request.app.state.openai_serving_models.lora_requests[tenant.name] = lora
        seconds = time.perf_counter() - t0
        held = state.adapters.setdefault(tenant.name, {"updates": 0})
        held.update(step=target.step, path=str(target.path), lora_id=lora.lora_int_id, updates=held["updates"] + 1,
                    last_update={"step": target.step, "path": str(target.path), "seconds": seconds,
                                 "time": time.time()})
    return {"step": target.step, "path": str(target.path), "seconds": seconds, "load_seconds": seconds}


@router.post("/prl/detach")
async def detach(request: Request):
    """An attached run leaves the pool: its adapter is unloaded from this server, which forgets it. The run then
    removes its record (prl.run.tenants.detach) once every server of the pool has unloaded it; from then on
    its key is refused."""
    state = _state(request)
    tenant = _tenant(request)
    if tenant is None:
        return _error(400, "only a run attached to this inference pool detaches, with its own key")
    async with state.lock:
        held = state.adapters.pop(tenant.name, None)
        request.app.state.openai_serving_models.lora_requests.pop(tenant.name, None)
        if held is not None:
            with contextlib.suppress(Exception):  # not in the engine's cache any more: nothing to unload
                await _engine(request).remove_lora(held["lora_id"])
        state.tenants.forget(tenant.name)
    log.info("run %s detached%s", tenant.name, " (its adapter unloaded)" if held else "")
    return {"unloaded": [tenant.name] if held else [], "run": tenant.name}


async def load(engine, target: WeightsTarget | FeedTarget) -> tuple[float, dict]:
    """Load `target` in every worker: the slowest worker's seconds and, from feeds, what moved
    (`received_bytes` off one worker's sockets, `delta`: every worker got only what changed)."""
    if isinstance(target, WeightsTarget):
        results = await engine.collective_rpc("prl_load_weights", args=(str(target.path),))
        await engine.update_weight_version(str(target.step or 0))  # vLLM's stamp on outputs, as a feed update sets it
        return max(r["seconds"] for r in results), {}
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    info = {"step": target.step, "feeds": list(target.feeds)}
    if target.group is not None:
        info["group"] = dataclasses.asdict(target.group)
    await engine.start_weight_update()
    await engine.update_weights(WeightTransferUpdateRequest(info))
    await engine.finish_weight_update(weight_version=str(target.step))
    reports = await engine.collective_rpc("prl_feed_report")
    return max(r["seconds"] for r in reports), {"received_bytes": max(r["received"] for r in reports),
                                                 "delta": all(r["delta"] for r in reports),
                                                 "group": all(r["group"] for r in reports)}


async def load_adapter(request: Request, state: AdminState, target: WeightsTarget) -> float:
    """Load a published LoRA adapter under the served model's name: every request for that name (OpenAI routes
    and prl's generate route) then runs with it. Each version gets a new LoRA id, so no KV or cached adapter of
    an older one is reused; requests already running keep the adapter they started with."""
    from vllm.lora.request import LoRARequest

    t0 = time.perf_counter()
    lora = LoRARequest(state.model_name, state.updates + 1, str(target.path))
    await _engine(request).add_lora(lora)
    request.app.state.openai_serving_models.lora_requests[state.model_name] = lora
    return time.perf_counter() - t0


async def recover(state: AdminState, engine, target: WeightsTarget | FeedTarget, error: str) -> JSONResponse:
    """The answer to a failed load. A feed update refused before any worker touched its model keeps the
    old weights (502); otherwise the last disk weights are loaded again, or the server is marked broken. A
    weight-transfer session the failure left open is closed first, so the next feed update can start."""
    if isinstance(target, FeedTarget):
        with contextlib.suppress(Exception):  # a worker that cannot answer fails the rollback below, named
            await engine.collective_rpc("prl_end_weight_update")
    if isinstance(target, FeedTarget) and not await _feed_touched(engine):
        return _error(502, f"{error}; nothing was loaded, still serving {state.weights_path}")
    if isinstance(target, WeightsTarget) and target.adapter:  # the engine refused it whole: the old one serves
        return _error(502, f"{error}; still serving {state.weights_path}")
    if state.disk is None:
        state.broken = f"{error}; the server has no weights on disk to roll back to"
        return _error(500, state.broken)
    path, step = state.disk
    try:
        await engine.collective_rpc("prl_load_weights", args=(path,))
    except Exception as e:  # noqa: BLE001
        state.broken = f"{error}; rollback to {path} failed too: {type(e).__name__}: {e}"
        return _error(500, state.broken)
    state.weights_path, state.weights_step = path, step
    await engine.update_weight_version(str(step or 0))
    return _error(500, f"{error}; rolled back to {path}")


async def _feed_touched(engine) -> bool:
    """Whether any worker's feed engine began loading in the failed update (True when it cannot tell)."""
    try:
        reports = await engine.collective_rpc("prl_feed_report")
    except Exception:  # noqa: BLE001 - unknown: assume the worst and roll back
        return True
    return any(r.get("touched", True) for r in reports)


def is_multimodal(engine) -> bool:
    """Whether the engine serves a model that takes pictures (its updates drain requests: `invalidate_kv`)."""
    return bool(getattr(engine.vllm_config.model_config, "is_multimodal_model", False))


async def invalidate_kv(engine, timeout: float | None = None) -> int:
    """Drop all KV of the old weights; return how many stored KV entries were deleted.

    Clears connector storage vLLM does not reset, then resets the prefix cache
    and the connector (`reset_prefix_cache(reset_running_requests=True,
    reset_connector=True)`: running requests are preempted and recompute).
    The reset fails while blocks are held for a transfer (a NIXL prefill
    server's blocks not yet pulled by a decode server); the engine keeps
    stepping for those even while paused and releases them once pulled or
    when their lease ends, so the reset is retried until then.
    KVResetFailed after `timeout` seconds (default: `reset_timeout`).
    """
    config = engine.vllm_config.kv_transfer_config
    timeout = reset_timeout(config) if timeout is None else timeout
    cleared = clear_connector_storage(config)
    deadline = time.monotonic() + timeout
    # A multimodal engine's requests are not preempted: vLLM 0.32 resumes a preempted request with pictures
    # without its encoder outputs and its engine core dies ("Encoder cache miss"). Its updates pause with
    # "wait" instead of "keep", so none is running by now.
    multimodal = is_multimodal(engine)
    while True:
        try:
            if await engine.reset_prefix_cache(reset_running_requests=not multimodal, reset_connector=True):
                if multimodal:
                    await engine.reset_encoder_cache()  # features of the old weights' vision tower
                return cleared
            why = "some KV blocks are still in use"
        except Exception as e:  # noqa: BLE001 - the engine's RuntimeError arrives as a plain Exception
            why = str(e)
        if time.monotonic() > deadline:
            raise KVResetFailed(f"could not reset the prefix cache in {timeout:.0f} s: {why}")
        await asyncio.sleep(0.5)


def connector_configs(kv_transfer_config) -> list[dict]:
    """The connector's config as dicts: itself, and each connector inside a `MultiConnector`."""
    if kv_transfer_config is None:
        return []
    top = {"kv_connector": kv_transfer_config.kv_connector,
           "kv_connector_extra_config": kv_transfer_config.kv_connector_extra_config or {}}
    return [top, *(top["kv_connector_extra_config"].get("connectors") or [])]


def reset_timeout(kv_transfer_config) -> float:
    """How long an update may wait for held KV blocks: KV_RESET_TIMEOUT_S, or a NIXL lease + 30 s."""
    leases = [float(c.get("kv_connector_extra_config", {}).get("kv_lease_duration", NIXL_LEASE_S))
              for c in connector_configs(kv_transfer_config) if c.get("kv_connector") == "NixlConnector"]
    return max([KV_RESET_TIMEOUT_S, *(lease + 30 for lease in leases)])


def connector_storage(kv_transfer_config) -> list[Path]:
    """Directories where the KV connector keeps KV outside the engine and never resets it.

    That is `ExampleConnector`'s `shared_storage_path` (its `reset_cache` is
    vLLM's no-op default), also inside a `MultiConnector`. NIXL keeps KV only
    in the engine's blocks; the offloading connectors reset their own tiers.
    """
    return [Path(c.get("kv_connector_extra_config", {}).get("shared_storage_path", "/tmp"))
            for c in connector_configs(kv_transfer_config) if c.get("kv_connector") == "ExampleConnector"]


def clear_connector_storage(kv_transfer_config) -> int:
    """Delete every KV entry in `connector_storage`; return how many.

    An entry is what ExampleConnector writes: a directory named by a hex
    digest of the prompt, holding only `.safetensors` files (one per layer).
    Anything else is left alone, so a storage path shared with other files
    (vLLM's default is /tmp) loses nothing else. Tolerates a concurrent clear
    (the prefill and decode servers share the directory and both clear it).
    """
    removed = 0
    for root in connector_storage(kv_transfer_config):
        for entry in root.iterdir() if root.is_dir() else ():
            if _is_kv_entry(entry):
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
    return removed


def _is_kv_entry(path: Path) -> bool:
    name = path.name
    if len(name) < 16 or any(c not in "0123456789abcdef" for c in name):
        return False
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        return all(f.suffix == ".safetensors" and f.is_file() for f in path.iterdir())
    except OSError:  # cleared by the other server meanwhile
        return False


def _record_metrics(state: AdminState, request: Request) -> None:
    """One metrics.jsonl line per update; best effort (a full disk must not fail an applied update)."""
    u = state.last_update or {}
    try:
        state.run.append_metrics({
            "role": "inference", "step": u.get("step"), "event": "weights_loaded",
            "server": f"{socket.gethostname()}:{request.url.port}",
            "weight_update_s": round(u.get("seconds", 0.0), 4), "weights_path": u.get("path"), "time": u.get("time"),
            **{k: u[k] for k in ("received_bytes", "delta", "group") if k in u},
        })
    except OSError:
        pass


def initial_state(run: RunDir, model: str, model_name: str, lora: bool = False,
                  tenants: Registry | None = None) -> AdminState:
    """AdminState for a server that just loaded `model` (a local dir or a hub id)."""
    path = Path(model)
    layout = None
    if path.is_dir():
        try:
            layout = checkpoint_layout(path)
        except UpdateRefused:
            layout = None  # e.g. a GGUF or .bin model: updates are then checked for readability only
    # A restarted server starts on a published step (prl/job/runtimes.py): it reports that step, not the base.
    step = step_of(path) if path.is_dir() and path.resolve().parent == run.weights_root() else None
    weights_path = str(path.resolve()) if path.is_dir() else model
    return AdminState(run=run, model_name=model_name, weights_path=weights_path, layout=layout, weights_step=step,
                      disk=(weights_path, step) if path.is_dir() else None, lora=lora, tenants=tenants)
