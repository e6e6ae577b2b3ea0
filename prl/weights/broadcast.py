"""`weights.transport: broadcast`: as `memory`, but the servers behind on a step get it together, by broadcast.

    trainer        the memory transport's feeds, each also serving broadcast groups (a rendezvous store on its
                   node; every stage bounded by `weights.group_timeout_s`, recorded with the step)
    orchestrator   the servers behind on a step from memory form one group per place (`requests`): the workers
                   that keep the same slices (`/prl/live`'s places), a random token each, a world of 1 + those
                   workers; a server whose worker count is not known yet reads the feeds, as one whose group
                   fails does at once (prl/orchestrator)
    each worker    joins its own group (the request's `groups[rank]`); each feed's header
                   comes over the feed's keyed protocol, its tensors by broadcast from the feed's rank
                   (prl/weights/collective.py): a gloo tree, so the trainer's node sends each byte
                   ceil(log2(world)) times instead of once per worker

With `weights.delta` a group gets the delta only if every member kept the feed's previous step.
"""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

from prl.run.api import Group, GroupBackend, WeightsRequest
from prl.run.rundir import RunDir
from prl.weights.layout import UpdateRefused
from prl.weights.memory import Memory
from prl.weights.transport import Behind, Offer, register


@dataclass(frozen=True)
class GroupOffer(Offer):
    """A step the feeds hold and also broadcast, each stage of a group bounded by `timeout` seconds, over
    `backend`."""

    timeout: float = 60.0
    backend: GroupBackend = "gloo"


class Broadcast(Memory):
    name = "broadcast"
    summary = ("each trainer rank broadcasts its share to the workers of every server behind, a group per place, "
               "the rest pull as under memory; disk at checkpoint steps")
    groups = True

    def group_timeout(self, weights) -> Optional[float]:
        return weights.group_timeout_s

    def group_backend(self, weights, gpus: bool) -> GroupBackend:
        """`weights.backend`; `auto`: nccl where the processes run on GPUs and keep no deltas' base, else gloo."""
        if weights.backend != "auto":
            return weights.backend
        return "nccl" if gpus and not weights.delta else "gloo"

    def check(self, topo, fail, gpus: bool = False) -> None:
        """As `memory`'s; nccl only where the processes have GPUs, and without deltas (a worker rebuilds a delta on
        the previous step it keeps in host memory; over nccl the step arrives in GPU memory, and keeping a base
        there would cost a model's worth of it)."""
        super().check(topo, fail, gpus)
        if topo.weights.backend == "nccl" and not gpus:
            raise fail(("weights", "backend"), "weights.backend: nccl broadcasts between GPUs, and this cluster's "
                                               "roles run on CPUs (gpu_node.gpus: 0, or env PRL_DEVICE: cpu): use "
                                               "backend: gloo (or auto)")
        if topo.weights.backend == "nccl" and topo.weights.delta:
            raise fail(("weights", "backend"), "weights.backend: nccl receives each step into GPU memory, where no "
                                               "previous step is kept to apply a delta to: remove weights.delta, or "
                                               "use backend: gloo (auto picks gloo with deltas)")

    def offer(self, run: RunDir) -> Optional[Offer]:
        offer = super().offer(run)
        held = run.read_weights_feed() if offer is not None and not offer.request.durable else None
        if held is None or held.group_timeout is None or held.step != offer.step:
            return offer
        return GroupOffer(offer.step, offer.request, held.group_timeout, held.backend)

    def requests(self, offer: Offer, behind: Sequence[Behind]) -> dict[str, WeightsRequest]:
        """One group per place: the workers of every server behind that keep the same slices (`/prl/live`'s
        places; where a server's workers all take the whole step, they share the whole step's group). A server
        whose worker count is not known yet reads the feeds."""
        members = [b for b in behind if b.workers and (b.places is None or len(b.places) == b.workers)]
        if not isinstance(offer, GroupOffer) or not members:
            return super().requests(offer, behind)
        places = {b.url: list(b.places) if b.places is not None else [None] * b.workers for b in members}
        sizes = Counter(p for server in places.values() for p in server)
        tokens = {p: secrets.token_hex(16) for p in sizes}
        # Ranks rotate from place to place: a group's broadcast is a binomial tree (gloo's `broadcast`), where a
        # member forwards in every round after the one it received in, so the lower its rank the more often
        # (rank 1: ceil(log2 world) - 1 times). In one order for every place the first server's workers would
        # forward every place's slices and its node's link would bound the update (docs/weights.md, moe-1t).
        offset = {p: i for i, p in enumerate(sizes)}
        seen: Counter = Counter()
        out = super().requests(offer, behind)
        for b in members:
            groups = []
            for p in places[b.url]:
                rank = (seen[p] + offset[p]) % sizes[p] + 1
                seen[p] += 1
                groups.append(Group(token=tokens[p], world=1 + sizes[p], rank=rank, timeout=offer.timeout,
                                    backend=offer.backend))
            out[b.url] = WeightsRequest(transport=self.name, step=offer.step, feeds=offer.request.feeds,
                                        groups=groups)
        return out

    def check_groups(self, groups: Optional[list[Group]], workers: int) -> None:
        """A group for every worker of this server, none at the feed's rank 0."""
        if groups is not None and len(groups) != workers:
            raise UpdateRefused(400, f'"groups" names {len(groups)} groups for this server\'s {workers} workers '
                                     "(one per worker, in rank order)")
        if groups is not None and any(g.rank == 0 for g in groups):
            raise UpdateRefused(400, '"groups": rank 0 is the feed\'s own; a worker\'s rank is 1 and up')

    def member(self, groups: Optional[list[Group]], rank: int) -> Optional[Group]:
        return None if groups is None else groups[rank]


BROADCAST = register(Broadcast())
