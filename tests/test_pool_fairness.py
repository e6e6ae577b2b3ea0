"""A pool server's adapter updates are fair across attached runs: one run's burst of updates delays another
run's single update by about one load, not by the whole burst (prl.inference.admin.AdminState.tenant_turn)."""

from __future__ import annotations

import asyncio
import time

import pytest

from prl.inference.admin import TENANT_UPDATES_WAITING, AdminState
from prl.run.rundir import RunDir
from prl.weights.layout import UpdateRefused

LOAD_S = 0.05


async def _load(state: AdminState, name: str, loads: list[str]) -> None:
    async with state.tenant_turn(name):
        loads.append(name)
        await asyncio.sleep(LOAD_S)  # a stand-in for the engine's add_lora


async def _burst_then_one(state: AdminState) -> tuple[float, list]:
    loads: list[str] = []
    burst = [asyncio.create_task(_load(state, "a", loads)) for _ in range(TENANT_UPDATES_WAITING)]
    await asyncio.sleep(0)  # the burst is queued first
    t0 = time.perf_counter()
    await _load(state, "b", loads)
    waited = time.perf_counter() - t0 - LOAD_S
    await asyncio.gather(*burst)
    return waited, loads


def test_one_runs_burst_delays_another_runs_update_by_about_one_load(tmp_path):
    state = AdminState(run=RunDir(tmp_path), model_name="m", weights_path=str(tmp_path), layout=None)
    waited, loads = asyncio.run(_burst_then_one(state))
    # Behind the whole burst, b would wait TENANT_UPDATES_WAITING loads; in turn, one (a's first) at most.
    assert waited < 2.5 * LOAD_S, (waited, loads)
    assert loads.index("b") <= 2, loads


def test_a_run_past_its_bound_of_updates_in_flight_is_refused_429(tmp_path):
    state = AdminState(run=RunDir(tmp_path), model_name="m", weights_path=str(tmp_path), layout=None)

    async def flood():
        tasks = [asyncio.create_task(_load(state, "a", [])) for _ in range(TENANT_UPDATES_WAITING + 1)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return [r for r in results if isinstance(r, UpdateRefused)]

    refused = asyncio.run(flood())
    assert len(refused) == 1 and refused[0].status == 429 and "run a" in str(refused[0])
    assert state.tenant_waiting["a"] == 0
