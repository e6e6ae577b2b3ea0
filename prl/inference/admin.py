"""Admin endpoints of the inference server: liveness, pause/resume, weight updates.

    GET  /prl/live     {"ok", "weights_step", "weights_path", "paused", "model", "updates", ...}
    POST /prl/pause    {"mode": "keep"|"wait"|"abort"} (default "wait") -> {"paused": true, "mode"}
    POST /prl/resume   -> {"paused": false}
    POST /prl/weights  {"step": N} | {"path": "/abs/dir"} [, "mode": "keep"|"wait"|"abort"]
                       -> {"step", "path", "seconds", "load_seconds", "pause_seconds"}

A weight update is validated completely before any weight is touched (the
directory is under RUN/weights/ and published, its tensors have the served
names and shapes); then: pause generation (default "keep": in-flight requests
freeze and continue on the new weights), load in every worker, reset the
prefix cache (KV computed with the old weights must not be reused), resume
(unless the server was paused before the update). Updates are serialized.
If loading fails part-way, the previously served weights are loaded again;
if that fails too, `/prl/live` answers 503 with `"ok": false` so the
launcher replaces the server.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from prl.inference.checks import (
    UpdateRefused,
    checkpoint_layout,
    compare_layouts,
    resolve_weights_dir,
)
from prl.run.rundir import RunDir

router = APIRouter()

PAUSE_MODES = ("keep", "wait", "abort")


@dataclass
class AdminState:
    """What the admin endpoints share (one per server process)."""

    run: RunDir
    model_name: str
    weights_path: str
    """Directory of the weights being served (the --model dir at start)."""
    layout: dict[str, tuple[int, ...]] | None
    """Tensor names and shapes an update must match (None: --model is not a local dir)."""
    weights_step: int | None = None
    updates: int = 0
    last_update: dict | None = None
    broken: str | None = None
    """Why the served weights are unknown after a failed update and a failed rollback."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _state(request: Request) -> AdminState:
    return request.app.state.prl_admin


def _engine(request: Request):
    return request.app.state.engine_client


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message, "status": status}, status_code=status)


async def _body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        return await request.json()
    except ValueError as e:
        raise UpdateRefused(400, f"body is not JSON: {e}") from e


def _mode(body: Any, default: str) -> str:
    mode = body.get("mode", default) if isinstance(body, dict) else default
    if mode not in PAUSE_MODES:
        raise UpdateRefused(400, f'"mode" must be one of {", ".join(PAUSE_MODES)}, got {mode!r}')
    return mode


@router.get("/prl/live")
async def live(request: Request):
    state = _state(request)
    paused = await _engine(request).is_paused()
    body = {
        "ok": state.broken is None,
        "weights_step": state.weights_step,
        "weights_path": state.weights_path,
        "paused": paused,
        "model": state.model_name,
        "updates": state.updates,
        "last_update": state.last_update,
        "updating": state.lock.locked(),
    }
    if state.broken:
        body["error"] = state.broken
    return JSONResponse(body, status_code=200 if state.broken is None else 503)


@router.post("/prl/pause")
async def pause(request: Request):
    try:
        mode = _mode(await _body(request), "wait")
    except UpdateRefused as e:
        return _error(e.status, e.message)
    # A pause is not a weight change: keep the prefix cache.
    await _engine(request).pause_generation(mode=mode, clear_cache=False)
    return {"paused": True, "mode": mode}


@router.post("/prl/resume")
async def resume(request: Request):
    await _engine(request).resume_generation()
    return {"paused": False}


@router.post("/prl/weights")
async def update_weights(request: Request):
    state = _state(request)
    engine = _engine(request)
    t0 = time.perf_counter()
    try:
        body = await _body(request)
        mode = _mode(body, "keep")
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if k != "mode"}
        target = resolve_weights_dir(state.run, body)
        if state.layout is not None:
            compare_layouts(state.layout, checkpoint_layout(target.path), target.path)
        else:
            checkpoint_layout(target.path)  # at least readable safetensors
    except UpdateRefused as e:
        return _error(e.status, e.message)

    async with state.lock:
        if state.broken:
            return _error(503, f"server is broken, refusing updates: {state.broken}")
        was_paused = await engine.is_paused()
        t_pause = time.perf_counter()
        await engine.pause_generation(mode=mode, clear_cache=False)
        pause_seconds = time.perf_counter() - t_pause
        try:
            results = await engine.collective_rpc("prl_load_weights", args=(str(target.path),))
        except Exception as e:  # noqa: BLE001 - any worker failure: roll back, then report
            error = f"loading {target.path} failed: {type(e).__name__}: {e}"
            try:
                await engine.collective_rpc("prl_load_weights", args=(state.weights_path,))
            except Exception as e2:  # noqa: BLE001
                state.broken = f"{error}; rollback to {state.weights_path} failed too: {type(e2).__name__}: {e2}"
                return _error(500, state.broken)
            return _error(500, f"{error}; rolled back to {state.weights_path}")
        finally:
            # KV computed with the old weights must not serve new requests; in-flight ones recompute.
            await engine.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
            if not was_paused:
                await engine.resume_generation()

        seconds = time.perf_counter() - t0
        state.weights_path, state.weights_step = str(target.path), target.step
        state.updates += 1
        state.last_update = {
            "step": target.step,
            "path": str(target.path),
            "seconds": seconds,
            "pause_seconds": pause_seconds,
            "load_seconds": max(r["seconds"] for r in results),
            "time": time.time(),
        }
    _record_metrics(state, request)
    return {"step": target.step, "path": str(target.path), "seconds": seconds,
            "pause_seconds": pause_seconds, "load_seconds": state.last_update["load_seconds"]}


def _record_metrics(state: AdminState, request: Request) -> None:
    """One metrics.jsonl line per update; best effort (a full disk must not fail an applied update)."""
    u = state.last_update or {}
    try:
        state.run.append_metrics({
            "role": "inference", "step": u.get("step"), "event": "weights_loaded",
            "server": f"{socket.gethostname()}:{request.url.port}",
            "weight_update_s": round(u.get("seconds", 0.0), 4), "time": u.get("time"),
        })
    except OSError:
        pass


def initial_state(run: RunDir, model: str, model_name: str) -> AdminState:
    """AdminState for a server that just loaded `model` (a local dir or a hub id)."""
    path = Path(model)
    layout = None
    if path.is_dir():
        try:
            layout = checkpoint_layout(path)
        except UpdateRefused:
            layout = None  # e.g. a GGUF or .bin model: updates are then checked for readability only
    return AdminState(run=run, model_name=model_name, weights_path=str(path.resolve()) if path.is_dir() else model,
                      layout=layout)
