"""`weights.transport: broadcast`: as `memory`, but the servers behind on a step get it together, by broadcast.

    trainer        the memory transport's feeds, each also serving broadcast groups (a rendezvous store on its
                   node; every stage bounded by `weights.group_timeout_s`, recorded with the step)
    orchestrator   the servers behind on a step from memory form one group (`requests`): a random token, a world
                   of 1 + every worker of theirs, each server's workers at the next ranks; a server whose worker
                   count is not known yet reads the feeds, as one whose group fails does at once (prl/orchestrator)
    each worker    joins the group at its server's first rank + its own rank in the server; each feed's header
                   comes over the feed's keyed protocol, its tensors by broadcast from the feed's rank
                   (prl/weights/collective.py): a gloo tree, so the trainer's node sends each byte
                   ceil(log2(world)) times instead of once per worker

With `weights.delta` a group gets the delta only if every member kept the feed's previous step.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Optional, Sequence

from prl.run.api import Group, WeightsRequest
from prl.run.rundir import RunDir
from prl.weights.layout import UpdateRefused
from prl.weights.memory import Memory
from prl.weights.transport import Behind, Offer, register


@dataclass(frozen=True)
class GroupOffer(Offer):
    """A step the feeds hold and also broadcast, each stage of a group bounded by `timeout` seconds."""

    timeout: float = 60.0


class Broadcast(Memory):
    name = "broadcast"
    summary = ("each trainer rank broadcasts its share to every server behind (gloo), the rest pull as under "
               "memory; disk at checkpoint steps")

    def group_timeout(self, weights) -> Optional[float]:
        return weights.group_timeout_s

    def offer(self, run: RunDir) -> Optional[Offer]:
        offer = super().offer(run)
        held = run.read_weights_feed() if offer is not None and not offer.request.durable else None
        if held is None or held.group_timeout is None or held.step != offer.step:
            return offer
        return GroupOffer(offer.step, offer.request, held.group_timeout)

    def requests(self, offer: Offer, behind: Sequence[Behind]) -> dict[str, WeightsRequest]:
        """One group of every server behind whose worker count is known; the others read the feeds."""
        members = [b for b in behind if b.workers]
        if not isinstance(offer, GroupOffer) or not members:
            return super().requests(offer, behind)
        token, world, rank = secrets.token_hex(16), 1 + sum(b.workers for b in members), 1
        out = super().requests(offer, behind)
        for b in members:
            group = Group(token=token, world=world, rank=rank, timeout=offer.timeout)
            out[b.url] = WeightsRequest(transport=self.name, step=offer.step, feeds=offer.request.feeds, group=group)
            rank += b.workers
        return out

    def check_group(self, group: Optional[Group], workers: int) -> None:
        """A group holds every worker of this server, none at the feed's rank 0."""
        if group is not None and group.rank == 0:
            raise UpdateRefused(400, '"group": rank 0 is the feed\'s own; a server\'s first worker is rank 1 and up')
        if group is not None and group.rank + workers > group.world:
            raise UpdateRefused(400, f'"group": this server\'s {workers} workers from rank {group.rank} do not fit '
                                     f"in a world of {group.world}")

    def member(self, group: Optional[Group], rank: int) -> Optional[Group]:
        if group is None:
            return None
        return Group(token=group.token, world=group.world, rank=group.rank + rank, timeout=group.timeout)


BROADCAST = register(Broadcast())
