"""Admin endpoints of the inference server: liveness and weight updates. Pausing and resuming are vLLM's own
RL API routes, which every prl server mounts behind the run's key (`POST /pause?mode=keep|wait|abort`,
`POST /resume`, `GET /is_paused`, `GET /weight_info`: prl.inference.server.RL_API_ROUTES).

    GET  /prl/engine   200 when the engine itself answers (vLLM's /health asks only the API process), 503 not
    GET  /prl/live     LiveAnswer: {"ok", "weights_step", "weights_path", "disk_step", "paused", "model", "updates",
                       ...} (an inference pool's: "tenants" too; an attached run's: its own adapter's)
    POST /prl/weights  WeightsRequest: {"step": N} | {"path": "/abs/dir"} | {"transport": "memory", "step": N,
                       "feeds": ["host:port", ...]} | ... [, "mode": "keep"|"wait"|"abort"]
                       -> WeightsAnswer: {"step", "path", "seconds", "load_seconds", "pause_seconds", ...}
    POST /prl/detach   a run attached to an inference pool: its adapter unloaded here (docs/inference.md,
                       Inference pools; an attached run's /prl/weights loads its own adapter: `tenant_update`)

The bodies are the typed structs of prl/run/api.py, decoded with a size bound. A weight update is validated
completely before any weight is touched: the request names a registered weight transport (prl/weights,
`"transport"`, default `filesystem`), whose `target` checks what it names (a directory under RUN/weights/ and
published, its tensors the served names and shapes; the form of a step from memory); then: pause generation (default "keep": in-flight requests
freeze and continue on the new weights; a multimodal model's finish first, "wait", since vLLM 0.32 cannot
resume a preempted request with pictures), load in every worker, drop every KV
computed with the old weights (`invalidate_kv`: the prefix cache, the KV
connector's cache, and `ExampleConnector`'s storage, which vLLM does not
reset), resume (unless the server was paused before the update). Updates are
serialized.

The target loads itself in every worker (`Target.load`: the filesystem's through prl/inference/worker.py,
a step from memory through vLLM's weight-transfer RPCs into the "prl" engine, prl/inference/weight_engine.py);
`/prl/live` then reports where the weights came from (a directory, or `memory:step_N`) and how many workers
the server has ("workers": the members a broadcast group needs) and, where they keep different slices, each
one's place ("places": the workers of one place in every server behind share a group). A load that fails before any worker touched a
weight (`Target.untouched`: a feed that refuses, a step whose tensors are not the served ones, a group that
does not form) is answered 502 and the old weights keep serving. If loading fails part-way, the last weights
the server loaded from disk are loaded again (and reported); if that fails too, `/prl/live` answers 503 with
`"ok": false` so the launcher replaces the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from prl import weights
from prl.log import get_logger
from prl.run import api
from prl.run.api import ErrorAnswer, LiveAnswer, WeightsAnswer, WeightsRequest, Worker
from prl.run.rundir import RunDir, step_of
from prl.run.tenants import Registry, Tenant
from prl.states import Role
from prl.weights.filesystem import WeightsTarget
from prl.weights.layout import UpdateRefused, checkpoint_layout

router = APIRouter()
log = get_logger(__name__)

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
TENANT_UPDATES_WAITING = 8
"""How many of one attached run's adapter updates may wait at once on a pool server; past it, 429."""
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
    workers: int = 1
    """Its vLLM workers (tensor x pipeline x data-parallel ranks of this server): a broadcast group's members."""
    places: list[Worker] | None = None
    """Each worker's place, in rank order, where they keep different slices (prl.weights.slices.served_places)."""
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
    tenant_locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    """A pool's attached runs' own update locks: each run queues behind its own updates, never another's."""
    tenant_waiting: dict[str, int] = field(default_factory=dict)
    """How many of each attached run's updates are in `tenant_turn` (waiting or loading)."""

    @contextlib.asynccontextmanager
    async def tenant_turn(self, name: str):
        """One attached run's turn at the engine: its updates wait on its own lock (at most
        TENANT_UPDATES_WAITING of them, UpdateRefused(429) past it), so the pool-wide `lock`, which is FIFO, has
        at most one waiter per run and takes the runs in turn: another run's update waits at most one load per
        run ahead of it, however many updates one run sends at once."""
        own = self.tenant_locks.setdefault(name, asyncio.Lock())
        if self.tenant_waiting.get(name, 0) >= TENANT_UPDATES_WAITING:
            raise UpdateRefused(429, f"run {name} already has {TENANT_UPDATES_WAITING} adapter updates in flight "
                                     f"on this server; send the next when one ends")
        self.tenant_waiting[name] = self.tenant_waiting.get(name, 0) + 1
        try:
            async with own, self.lock:
                yield
        finally:
            self.tenant_waiting[name] -= 1


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
    return JSONResponse(api.encode(ErrorAnswer(error=message, status=status)), status_code=status)


async def _body(request: Request) -> WeightsRequest:
    """The request's `WeightsRequest` (its defaults for an empty body); UpdateRefused(413/400) otherwise."""
    try:
        return api.decode(await request.body(), WeightsRequest, empty_ok=True)
    except api.BodyError as e:
        raise UpdateRefused(e.status, str(e)) from None


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
    live = LiveAnswer(
        ok=state.broken is None, weights_step=state.weights_step, weights_path=state.weights_path,
        disk_step=state.disk[1] if state.disk else None, paused=await _engine(request).is_paused(),
        model=state.model_name, updates=state.updates, last_update=state.last_update, updating=state.lock.locked(),
        workers=state.workers, places=state.places, error=state.broken)
    if state.tenants is not None:
        state.tenants.refresh()
        live.tenants = {name: state.adapters.get(name, {}).get("step") for name in state.tenants.names()}
    return JSONResponse(api.encode(live), status_code=200 if state.broken is None else 503)


def tenant_live(state: AdminState, tenant: Tenant) -> dict:
    """`/prl/live` as an attached run sees it: its own adapter (weights_step null: the base model serves it)."""
    loaded = state.adapters.get(tenant.name, {})
    step = loaded.get("step")
    return api.encode(LiveAnswer(ok=state.broken is None, model=tenant.name, weights_step=step, disk_step=step,
                                 weights_path=loaded.get("path"), updates=loaded.get("updates", 0),
                                 last_update=loaded.get("last_update"), updating=state.lock.locked()))


def checked_target(state: AdminState, request: WeightsRequest) -> weights.Target:
    """What a `/prl/weights` request names, checked by its transport before the model is touched (UpdateRefused
    if not): a directory inside the run's weights, STABLE, readable and laid out as the served model is; a step
    from memory for its form (each worker checks its layout before loading)."""
    return weights.get(request.transport).target(state.run, request, layout=state.layout, lora=state.lora,
                                                 workers=state.workers)


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


async def update_served(request: Request, state: AdminState, body: WeightsRequest):
    """`/prl/weights` of a run's own server: its model's weights (or its run's adapter), by the request's transport."""
    engine = _engine(request)
    t0 = time.perf_counter()
    mode = body.mode
    try:
        target = checked_target(state, body)
    except UpdateRefused as e:
        return _error(e.status, e.message)

    async with state.lock:
        if state.broken:
            return _error(503, f"server is broken, refusing updates: {state.broken}")
        # Logged before the engine is asked anything: an update that never ends shows where it began.
        log.info("weights update begins: step %s from %s (pause %s)", target.step, target.describe(), mode)
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
                if target.adapter:
                    load_seconds = await load_adapter(request, state, target)
                else:
                    load_seconds, transfer = await target.load(engine)
            except Exception as e:  # noqa: BLE001 - any worker failure: roll back, then report
                return await recover(state, engine, target,
                                     f"loading {target.origin} failed: {type(e).__name__}: {e}")
            finally:
                # KV computed with the old weights must not serve new requests; in-flight ones recompute.
                try:
                    cleared = await invalidate_kv(engine)
                except KVResetFailed as e:
                    state.broken = f"after loading {target.origin}: {e}"
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
    return api.encode(WeightsAnswer(step=target.step, path=target.origin, seconds=seconds,
                                    pause_seconds=pause_seconds, load_seconds=state.last_update["load_seconds"],
                                    kv_storage_cleared=cleared, **transfer))


def served(state: AdminState, target: weights.Target, **numbers) -> None:
    """Record an update the server now serves (`/prl/live` and the next metrics line read it)."""
    state.weights_path, state.weights_step = target.origin, target.step
    if target.durable and not target.adapter:
        state.disk = (target.origin, target.step)
    state.updates += 1
    state.last_update = {"step": target.step, "path": target.origin, **numbers, "time": time.time()}


async def tenant_update(request: Request, state: AdminState, tenant: Tenant | None, body: WeightsRequest) -> dict:
    """An attached run's `/prl/weights`: a published adapter step of its own run directory, loaded under its
    name (requests running keep the version they started with; no pause, no KV dropped: each version has a new
    LoRA id). UpdateRefused for the pool's own key, a whole model, or a step outside the run."""
    from vllm.lora.request import LoRARequest

    if tenant is None:
        raise UpdateRefused(409, "this server is an inference pool: its base model does not change; attached runs "
                                 "load their adapters with their own keys")
    # The attached run's own run directory, checked by its transport as this server serves adapters (whole models
    # and steps from memory are refused: an adapter comes from the run directory).
    target = weights.get(body.transport).target(RunDir(tenant.run_dir), body, layout=None, lora=True,
                                                workers=state.workers)
    t0 = time.perf_counter()
    async with state.tenant_turn(tenant.name):
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


async def recover(state: AdminState, engine, target: weights.Target, error: str) -> JSONResponse:
    """The answer to a failed load. One that touched no weight (`Target.untouched`: a step from memory refused
    before any worker began, an adapter the engine refused whole) keeps the old weights (502); otherwise the
    last disk weights are loaded again, or the server is marked broken."""
    if await target.untouched(engine):
        return _error(502, f"{error}; nothing was loaded, still serving {state.weights_path}")
    if state.disk is None:
        state.broken = f"{error}; the server has no weights on disk to roll back to"
        return _error(500, state.broken)
    path, step = state.disk
    try:
        await WeightsTarget(Path(path), step).load(engine)  # as the directory was loaded, and stamped
    except Exception as e:  # noqa: BLE001
        state.broken = f"{error}; rollback to {path} failed too: {type(e).__name__}: {e}"
        return _error(500, state.broken)
    state.weights_path, state.weights_step = path, step
    return _error(500, f"{error}; rolled back to {path}")


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
            "role": Role.INFERENCE, "step": u.get("step"), "event": "weights_loaded",
            "server": f"{socket.gethostname()}:{request.url.port}",
            "weight_update_s": round(u.get("seconds", 0.0), 4), "weights_path": u.get("path"), "time": u.get("time"),
            **{k: u[k] for k in ("received_bytes", "worker_bytes", "delta", "group") if k in u},
        })
    except OSError:
        pass


def initial_state(run: RunDir, model: str, model_name: str, lora: bool = False,
                  tenants: Registry | None = None, workers: int = 1, places: list[Worker] | None = None
                  ) -> AdminState:
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
                      disk=(weights_path, step) if path.is_dir() else None, lora=lora, tenants=tenants,
                      workers=workers, places=places)
