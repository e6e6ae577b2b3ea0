"""A weight feed's snapshot broadcast to every inference worker at once, over a torch.distributed group.

    group = Group(token="9f2c...", world=5, rank=3)   # the orchestrator names it (prl.run.api.Group); worker 3 of 4
    pg = join(group, bind_host, "host:port", key)     # every member (the feed's sender: rank 0, its own store)
    send(pg, buffers, device(group.backend))           # one broadcast per buffer, in header order
    receive(pg, torch.empty(n, dtype=torch.uint8, device=device(group.backend)))

`weights.transport: broadcast`: the orchestrator gives the workers of one place (the same slices) in every
server behind on a step one group (a random token, the world size: 1 sender + those workers, each its rank).
Each worker asks the feed for the step over the feed's keyed protocol (prl/weights/feed.py), naming the
group; the feed answers with the step's header and the address of its rendezvous store, and the first
member to ask starts the feed's sender. Each side then forms a gloo process group of its own, on its
own store prefix (the token), independent of any default group a trainer rank or a vLLM worker
already has, and the payload goes out as broadcasts from rank 0: the step's tensors, or (`weights.delta`,
when every member holds the feed's previous step) the delta's buffers, the same ones a pull reads.
Gloo's broadcast is a binomial tree (members pass each buffer on): the trainer's node sends each byte
ceil(log2(world)) times instead of once per worker (3 times for 4 workers, 6 for 32), in as many rounds.
One group per feed: a sharded trainer's writer ranks each broadcast their own share, and a worker
receives from all of them at once.

Every stage of it is bounded by the group's `timeout`: forming the group (a member that never comes), each
broadcast (a member that died, a sender that died). A group that fails is dropped on every side; what
the members do then is theirs (a worker's update fails, the orchestrator pulls the step instead).

The backend is the group's (`Group.backend`, `weights.backend`): gloo over TCP on host memory, or NCCL on
the members' GPUs (the processes have GPUs: the trainer's ranks and vLLM's workers of a GPU cluster), where
each buffer the sender holds in host memory is staged to its GPU before its broadcast and each member receives
into its GPU's memory, which the worker's loader then copies from on the device. Every line but the process
group's constructor and the buffers' device is the one the CPU suite runs on gloo. Gloo binds to the address
each side reaches the other with (never a wildcard); NCCL picks its interfaces itself (the cluster profile's
`network.env`: NCCL_SOCKET_IFNAME, NCCL_IB_HCA), its rendezvous through the same store. Like torch.distributed's
own groups, the store and the gloo connections carry no key, and a TCPStore answers anyone who can reach
its port (lists, reads, writes and deletes keys). So what a store holds is useless to such a process: the
token never goes there (it travels only over the feed's keyed protocol); a group's keys sit under a prefix
derived from the run's key and the token (`store_prefix`, an HMAC: it tells nothing of either), and every
value a member writes carries a MAC under a key derived the same way, over the store key and the value
(`keyed`): a member reads only values of at most MAX_STORE_VALUE bytes that carry a valid MAC, and refuses
any other (`StoreRefused`: a process that is not a member wrote there) instead of connecting where it says.
What a keyless store still lets such a process do is deny service: delete a member's key or write over it (the
group then fails within its timeout and the servers pull the step) and fill the feed's memory with values.
A group's shape (token, world, rank, timeout) is the typed `prl.run.api.Group` that requests carry.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import socket
from collections.abc import Iterable

from prl.run.api import Group

MAX_STORE_VALUE = 64 * 1024
"""The most bytes a member takes from one value of a group's store (gloo's rendezvous values, a member's
address, and NCCL's unique id are a few hundred bytes each); a longer one is refused."""
TAG_BYTES = hashlib.sha256().digest_size


class StoreRefused(RuntimeError):
    """A value in a group's store that no member wrote (no valid MAC under the run's key, or over the bound)."""


def _derived(key: bytes, purpose: str, token: str) -> bytes:
    return hmac.new(key, f"prl-weights {purpose} {token}".encode(), hashlib.sha256).digest()


def store_prefix(key: bytes, token: str) -> str:
    """Where a group's keys sit in a store: an HMAC of the token under the run's key, so that listing a store's
    keys tells neither."""
    return f"prl-weights/{_derived(key, 'store prefix', token).hex()[:32]}"


def tag(mac_key: bytes, name: str, value: bytes) -> bytes:
    """The MAC a member appends to `value` stored under `name` (the whole store key, the group's prefix
    included: a value moved to another key or group does not verify)."""
    named = name.encode()
    return hmac.new(mac_key, len(named).to_bytes(8, "big") + named + value, hashlib.sha256).digest()


def verified(mac_key: bytes, name: str, stored: bytes) -> bytes:
    """The value a member wrote under `name`, from what the store holds there; raises StoreRefused where no
    member wrote it."""
    if len(stored) > MAX_STORE_VALUE + TAG_BYTES:
        raise StoreRefused(f"the value under {name!r} in the group's rendezvous store is {len(stored)} bytes, "
                           f"over the {MAX_STORE_VALUE} a member writes: refused (a process that is not a "
                           f"member wrote it)")
    value, mac = stored[:-TAG_BYTES], stored[-TAG_BYTES:]
    if len(stored) < TAG_BYTES or not hmac.compare_digest(mac, tag(mac_key, name, value)):
        raise StoreRefused(f"the value under {name!r} in the group's rendezvous store carries no valid MAC under "
                           f"the run's key: refused (a process that is not a member wrote it)")
    return value


def store(host: str, timeout: float):
    """A rendezvous store served on `host` only, on a free port (`.port`): a feed's, for every group it sends to.
    (Given a port alone, TCPStore listens on every interface: it is handed a socket bound to `host` instead.)"""
    import torch.distributed as dist

    listener = socket.create_server((host, 0), backlog=1024)
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, is_master=True, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False, master_listen_fd=listener.detach())


def keyed(served, key: bytes, token: str):
    """`served` (a store) as the members of group `token` use it: each value set carries its MAC (`tag`), each
    value got is `verified`. A refusal is also kept in `.refusals`: torch.distributed's error for it names only
    the store call that failed."""
    import torch.distributed as dist

    mac_key = _derived(key, "store mac", token)

    class Keyed(dist.Store):
        def __init__(self, inner, refusals: list):
            super().__init__()
            self.inner, self.refusals = inner, refusals

        def set(self, name, value):
            value = value.encode() if isinstance(value, str) else bytes(value)
            self.inner.set(name, value + tag(mac_key, name, value))

        def get(self, name):
            try:
                return verified(mac_key, name, self.inner.get(name))
            except StoreRefused as e:
                self.refusals.append(e)
                raise

        def wait(self, names, timeout=None):
            return self.inner.wait(names) if timeout is None else self.inner.wait(names, timeout)

        def check(self, names):
            return self.inner.check(names)

        def add(self, name, amount):  # a counter: no member's rendezvous reads one as an address
            return self.inner.add(name, amount)

        def num_keys(self):
            return self.inner.num_keys()

        def delete_key(self, name):
            return self.inner.delete_key(name)

        def clone(self):
            return Keyed(self.inner.clone(), self.refusals)

        def has_extended_api(self):
            return False  # multi_get and the like go through get, so through the MAC

    return Keyed(served, [])


def join(group: Group, bind_host: str, rendezvous, key: bytes):
    """This member's gloo process group for `group`, formed through `rendezvous`: the "host:port" of a feed's
    store, or (on the side that serves it) the store itself; connections bound to `bind_host`; what the store
    holds written and checked under the run's `key` (`keyed`). Raises StoreRefused for a value no member wrote,
    and otherwise when the other members do not all come within the group's timeout."""
    import torch.distributed as dist

    limit = datetime.timedelta(seconds=group.timeout)
    served = rendezvous
    if isinstance(rendezvous, str):
        host, _, port = rendezvous.rpartition(":")
        served = dist.TCPStore(host, int(port), is_master=False, timeout=limit)
    checked = keyed(served, key, group.token)
    prefixed = dist.PrefixStore(store_prefix(key, group.token), checked)
    try:
        pg = _process_group(dist, group, bind_host, prefixed, limit)
    except Exception:
        if checked.refusals:
            raise checked.refusals[0] from None
        raise
    _STORES[id(pg)] = (pg, checked)  # the store's Python half must live as long as the group that calls it
    return pg


_STORES: dict = {}
"""id(process group) -> (the group, its keyed store), until `close` (a torch.distributed group takes no
attribute to hold it by)."""


def _process_group(dist, group: Group, bind_host: str, store, limit):
    if group.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = limit
        return dist.ProcessGroupNCCL(store, group.rank, group.world, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    options._timeout = limit
    return dist.ProcessGroupGloo(store, group.rank, group.world, options)


def device(backend: str):
    """Where a member's buffers live under `backend`: this process's current GPU under NCCL; None under gloo
    (host memory, where the tensors already are)."""
    if backend != "nccl":
        return None
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def _broadcast(pg, buffer) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    pg.broadcast([buffer], options).wait()


def send(pg, buffers: Iterable, on=None) -> int:
    """Broadcast each contiguous tensor from rank 0 in order (never written: a root's buffer is only read), each
    staged to device `on` first where it is elsewhere (`device(backend)`; None: where it is); the bytes sent. The
    members receive the same sequence, each buffer's size known from the step's header."""
    import torch

    sent = 0
    for tensor in buffers:
        if tensor.numel():
            flat = tensor.reshape(-1).view(torch.uint8)
            _broadcast(pg, flat if on is None or flat.device == on else flat.to(on))
            sent += tensor.numel() * tensor.element_size()
    return sent


def receive(pg, raw) -> None:
    """The next broadcast from rank 0 into `raw` (a uint8 tensor of the size the header gave, on the group's
    device)."""
    _broadcast(pg, raw)


def close(pg) -> None:
    """Drop a group (after its last broadcast, or a failure): its connections close."""
    try:
        pg.shutdown()
    except Exception:  # noqa: BLE001 - already broken: nothing left to close
        pass
    finally:
        _STORES.pop(id(pg), None)
