"""`weights.transport: memory`: each trainer rank serves its share of a step over TCP to every server's workers.

    trainer        FeedSender: a weight feed (prl/weights/feed.py) per rank on its node, started with the ranks;
                   a step that is not durable goes to the writer ranks' feeds (the tensors a sharded publish
                   would write to each one's file), then rank 0 records it (state/weights_feed.json: the step,
                   the writers' feeds)
    orchestrator   the newer of the newest published step and the recorded one (disk on a tie):
                   WeightsRequest(transport="memory", step=N, feeds=[host:port, ...])
    server         FeedTarget: checked for its form here, its layout by every worker before it loads; loaded
                   through vLLM's weight-transfer API (start_weight_update / update_weights /
                   finish_weight_update, which stamps vLLM's weight version) into the "prl" engine
                   (prl/inference/weight_engine.py)
    each worker    `receive`: opens every feed with the run's key (a Reception), checks that their headers
                   together name each served tensor once, then streams them, every feed read by a thread of
                   its own (`read_concurrently`), into vLLM's layerwise reload

`weights.delta`: the feeds also encode what changed since their previous step; a worker that kept that step's
tensors (`kept`, by feed address) names it and gets only the change (prl/weights/delta.py). A feed serves its
newest step only: a request for an older one is refused (502 at the server), and the orchestrator asks for the
newer one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from prl.run.api import GroupBackend, Group, WeightsRequest
from prl.run.records import FeedRecord
from prl.run.rundir import RunDir
from prl.weights.feed import Base, FeedReader, FeedServer, read_concurrently
from prl.weights.layout import UpdateRefused
from prl.weights.slices import Worker
from prl.weights.transport import Offer, Sender, Target, Transport, register

FEED_TIMEOUT_S = 120.0
"""Longest silence of a feed before a worker's update fails (a lost trainer rank must not hang the engine)."""
REPORT_RPC = "prl_transfer_report"
END_RPC = "prl_end_weight_update"
"""Worker methods (prl/inference/worker.py): the last update's report, and closing a session a failure left open."""


class FeedSender(Sender):
    """This trainer rank's weight feed, and every rank's address (by global rank)."""

    def __init__(self, run: RunDir, feed: FeedServer, addresses: Sequence[str], rank: int,
                 group_timeout: Optional[float], backend: GroupBackend = "gloo"):
        self.run, self.feed, self.addresses, self.rank = run, feed, tuple(addresses), rank
        self.group_timeout, self.backend = group_timeout, backend

    def send(self, step: int, tensors, writers: Sequence[int]) -> None:
        import torch.distributed as dist

        self.feed.publish(step, tensors)
        dist.barrier()
        if self.rank == 0:
            self.run.write_weights_feed(FeedRecord(step=step, feeds=[self.addresses[r] for r in writers],
                                                   time=time.time(), group_timeout=self.group_timeout,
                                                   backend=self.backend))

    def close(self) -> None:
        self.feed.close()


@dataclass(frozen=True)
class FeedTarget(Target):
    """A step to load from the trainer ranks' weight feeds."""

    step: int
    request: WeightsRequest
    """The request, forwarded to every worker (its feeds, and a group's this server's first rank)."""

    @property
    def feeds(self) -> list[str]:
        return list(self.request.feeds or ())

    @property
    def origin(self) -> str:
        return f"memory:step_{self.step}"

    def describe(self) -> str:
        return f"{len(self.feeds)} trainer feeds{' by broadcast' if self.request.groups else ''}"

    async def load(self, engine) -> tuple[float, dict]:
        import msgspec
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await engine.start_weight_update()
        await engine.update_weights(WeightTransferUpdateRequest(msgspec.to_builtins(self.request)))
        await engine.finish_weight_update(weight_version=str(self.step))
        reports = await engine.collective_rpc(REPORT_RPC)
        return max(r["seconds"] for r in reports), {"received_bytes": max(r["received"] for r in reports),
                                                     "worker_bytes": [r["received"] for r in reports],
                                                     "delta": all(r["delta"] for r in reports),
                                                     "group": all(r["group"] for r in reports)}

    async def untouched(self, engine) -> bool:
        """Closes the weight-transfer session the failure left open first, so the next update can start; True
        (keep serving) only when every worker says its engine never began loading."""
        try:
            await engine.collective_rpc(END_RPC)
        except Exception:  # noqa: BLE001 - a worker that cannot answer fails the rollback that follows, named
            pass
        try:
            reports = await engine.collective_rpc(REPORT_RPC)
        except Exception:  # noqa: BLE001 - unknown: assume the worst and roll back
            return False
        return not any(r.get("touched", True) for r in reports)


@dataclass
class Reception:
    """One worker's reading of one step from every feed: `layout` is known before any weight is touched."""

    readers: list[FeedReader]
    layout: dict[str, tuple[int, ...]]
    """Every tensor the feeds together send, and its (checkpoint) shape."""
    delta: bool
    """Some feed sends only what changed since the step this worker kept."""

    def tensors(self):
        """(name, tensor), every feed read by a thread of its own while the caller loads what arrived."""
        return read_concurrently(self.readers)

    def kept(self) -> dict[str, Base]:
        """By feed address, the step just read (this worker's slices of it), where the feed sends deltas: the base
        of the next."""
        return {r.address: Base(r.id, dict(r.pieces)) for r in self.readers if r.keep}

    @property
    def received(self) -> int:
        return sum(r.received for r in self.readers)

    def close(self) -> None:
        for reader in self.readers:
            reader.close()


class Memory(Transport):
    name = "memory"
    summary = "each trainer rank serves its share over TCP, each worker reads it; disk at checkpoint steps"
    feeds = True

    def check(self, topo, fail, gpus: bool = False) -> None:
        """A step from memory is the whole model, into servers of the run's own."""
        why = ("an inference pool's model never changes" if topo.pool is not None
               else "an SFT topology (sft:) has no inference servers to send weights to" if topo.sft is not None
               else "model.lora sends only the adapter, through the run directory (a few MB)"
               if topo.model.lora is not None else None)
        if why:
            raise fail(("weights", "transport"), f"{why}: remove weights.transport: {topo.weights.transport}")

    def forget(self, run: RunDir) -> None:
        run.clear_weights_feed()  # a replaced attempt's feeds are gone with it

    def sender(self, run: RunDir, weights, host: str, ports: Sequence[int], config: Mapping | None = None,
               backend: GroupBackend = "gloo") -> FeedSender:
        import torch.distributed as dist

        rank, timeout = dist.get_rank(), self.group_timeout(weights)
        feed = FeedServer(host, ports[rank], run.read_api_key().encode(), weights.delta, groups=timeout is not None,
                          group_timeout=timeout or 0.0, config=config, backend=backend)
        addresses: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(addresses, feed.address)
        return FeedSender(run, feed, addresses, rank, timeout, backend)

    def group_timeout(self, weights) -> Optional[float]:
        """The feeds also send to broadcast groups, each stage bounded so (None: they only serve readers)."""
        return None

    def offer(self, run: RunDir) -> Optional[Offer]:
        disk, held = super().offer(run), run.read_weights_feed()
        if held is not None and (disk is None or held.step > disk.step):
            return Offer(held.step, WeightsRequest(transport=self.name, step=held.step, feeds=list(held.feeds)))
        return disk

    def target(self, run: RunDir, request: WeightsRequest, *, layout, lora: bool, workers: int = 1) -> FeedTarget:
        if request.step is None or request.feeds is None or request.path is not None:
            raise UpdateRefused(400, 'a memory update names "step" and "feeds" (and no "path"): '
                                     '{"transport": "memory", "step": N, "feeds": ["host:port", ...]}')
        if lora:
            raise UpdateRefused(409, "this server serves adapters (--enable-lora): they come from the run directory")
        self.check_groups(request.groups, workers)
        return FeedTarget(request.step, request)

    def check_groups(self, groups: Optional[list[Group]], workers: int) -> None:
        if groups is not None:
            raise UpdateRefused(400, '"groups": a memory update is read from the feeds (weights.transport: '
                                     'broadcast sends groups)')

    def receive(self, request: WeightsRequest, key: bytes, rank: int, kept: dict, place: Worker | None = None
                ) -> Reception:
        """Every feed opened (authenticated, its header read; naming the worker's `place`, each sends only its
        slices) and their layouts checked to name each tensor once; UpdateRefused(422) / FeedError before anything
        is loaded."""
        group = self.member(request.groups, rank)
        readers: list[FeedReader] = []
        try:
            for address in request.feeds:
                readers.append(FeedReader(address, request.step, key, FEED_TIMEOUT_S, kept.get(address), group,
                                          place))
            layout: dict[str, tuple[int, ...]] = {}
            for reader in readers:
                for meta in reader.tensors:
                    if meta.name in layout:
                        raise UpdateRefused(422, f"step {request.step}: {meta.name} is in more than one feed "
                                                 f"({reader.address} and another)")
                    layout[meta.name] = meta.full_shape
        except BaseException:
            for reader in readers:
                reader.close()
            raise
        return Reception(readers, layout, any(r.delta for r in readers))

    def member(self, groups: Optional[list[Group]], rank: int) -> Optional[Group]:
        """This worker's member of a request's group (None: it reads the feeds)."""
        return None


MEMORY = register(Memory())
