"""The weight feed: one trainer rank's published tensors, served over plain TCP to inference workers.

    server = FeedServer("10.0.0.5", 29600, key)     # on a trainer rank
    server.publish(7, [(hf_name, cpu_tensor), ...])  # replaces the snapshot it serves
    for name, tensor in fetch(server.address, 7, key, timeout=60):   # in a vLLM worker
        ...

A snapshot is what that rank would have written to RUN/weights/step_N in a sharded publish: HF
checkpoint names, contiguous CPU tensors in the published dtype. The filesystem stays the durable
record; a feed holds only the newest step, in memory.

Protocol (one connection, one step):

    server -> client   prl-feed 1 <nonce hex>\\n
    client -> server   {"step": N, "mac": hex HMAC-SHA256(key, nonce hex), "nonce": the reader's hex[, "base": id]
                        [, "group": {"token": hex, "world": W, "rank": R, "timeout": s}]}\\n
    server -> client   {"error": "authentication failed: wrong key"}\\n     (then closes)
                   or  {"proof": hex HMAC-SHA256(key, "prl-feed proof <reader's nonce> <port>")}\\n (`feed_proof`:
                       the reader checks it before it reads on, so only the run's feed serves it tensors), then
    server -> client   {"error": "..."[, "step": held]}\\n            (not step N, ...; then closes)
                   or  {"step": N, "id": id, "deltas": bool, "tensors": [[name, dtype, shape, nbytes], ...]}\\n
                       the tensors' raw bytes, in header order
                   or  {"step": N, "id": id, "base": base id, "deltas": true,
                        "tensors": [[name, dtype, shape, nbytes, changed, form], ...]}\\n
                       per tensor, in header order: `changed` = -1, its raw bytes; else where the
                       `changed` elements are (form "index": their int32 flat indices; "mask": a bit per
                       element, numpy's packbits order), then their values
                   or, asked with "group" (`weights.transport: broadcast`, a feed made with `groups`):
                       one of the two headers above, then {"store": "host:port"}\\n; the buffers it
                       announces then come by broadcast over that group (prl/weights/collective.py), each
                       in a broadcast of its own, and the connection closes

Groups: the first reader that names a group starts the feed's sender for it (rank 0 of `world`, on the
step the feed held then); the others of the group get the same answer, that step's, even once the feed
holds a newer one (a group forming when the trainer publishes still completes). A group is sent once: a
reader naming a group that ended, or the same token with another step or world, is refused. A group
gets the delta only if every member names the base (they wait for each other at the feed, within the
group timeout); one member without it, and the whole group gets the whole step.

Deltas (`FeedServer(..., delta=True)`, `weights.delta`): each publish also encodes what changed since the
feed's previous snapshot, element by element (prl/weights/delta.py), a tensor sent whole where its delta would
not be smaller. A reader holding the
previous snapshot's tensors (it names that snapshot's `id`, which is random per publish, so a
restarted trainer's step 7 is never taken for the old one's) gets the delta and rebuilds each tensor
on its own copy; any other reader gets the whole step. `deltas` tells a reader whether keeping this
step's tensors will pay off.

The key is the run's API key, so only the run's own servers read its weights. A reader gets the
snapshot that was current when it asked, whole: `publish` swaps in a new snapshot and never writes
into the old one's tensors (the caller hands over tensors it no longer changes). Torch is imported
only when a feed is used: the control plane imports this module without it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import socket
import socketserver
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Optional

import msgspec

from prl.errors import FeedError
from prl.log import Throttled, get_logger
from prl.run.api import DEFAULT_GROUP_TIMEOUT_S, Group, GroupBackend
from prl.weights.delta import FORMS, BadDelta, encode as encode_change, narrow_change, positions, rebuild, where_bytes
from prl.weights.slices import Dims, Worker, narrow, slices

log = get_logger(__name__)

PROTOCOL = b"prl-feed 1"
MAX_LINE_BYTES = 64 * 1024 * 1024
"""Longest protocol line (the header names every tensor: ~100 bytes each)."""
MAX_REQUEST_BYTES = 4096
"""Longest client answer a server reads (a step and a mac)."""
MAX_GROUPS_KEPT = 64
"""Groups a feed remembers (to refuse a token used again)."""
SEND_TIMEOUT_S = 600.0
"""How long a server waits on an authenticated client's socket: a worker reads at most READ_AHEAD_BYTES ahead
of its reload, so a connection may idle while the reload catches up."""
AUTH_TIMEOUT_S = 10.0
"""How long a connection has, from its accept, to send its whole request line (whatever pace its bytes
come at); then it is closed. Before it proves the key a connection costs the feed a thread: this bounds how
long a peer that does not speak holds one."""
MAX_PENDING = 64
"""Connections a feed holds at once that have not proven the key; more are closed at accept (no thread)."""
MAX_CONNECTIONS = 4096
"""Connections a feed holds at once (a thread each): every worker of every server reading at the same time
fits; more are closed at accept."""
LISTEN_BACKLOG = 4096
"""The listening socket's accept queue (the kernel caps it at net.core.somaxconn). socketserver's default of
5 overflows when many workers connect at once; Linux then drops the handshake's last ACK, and a client
whose SYN-ACK retries run out believes it is connected and waits for a greeting that never comes."""
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
          "float8_e4m3fn", "float8_e5m2")
"""Tensor dtypes a feed carries (torch names)."""


def mac(key: bytes, nonce: bytes) -> str:
    return hmac.new(key, nonce, hashlib.sha256).hexdigest()


def feed_proof(key: bytes, nonce: str, port: int) -> str:
    """The feed's proof to a reader that sent `nonce`: bound to the port the reader connected to, so a process on
    a dead rank's port cannot pass on another live feed's proof (and never equal to a reader's `mac`)."""
    return mac(key, f"prl-feed proof {nonce} {port}".encode())


class FeedRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """A reader's request line: the step it wants and the proof that it holds the run's key."""

    step: int
    mac: str
    """hex HMAC-SHA256(key, the server's nonce)."""
    base: Optional[str] = None
    """The snapshot id the reader holds (a delta from it is welcome)."""
    group: Optional[Group] = None
    """The broadcast group the reader receives by (its own rank)."""
    worker: Optional[Worker] = None
    """The reader's place in its server: the feed then sends it its slices only (`Snapshot.view`)."""
    nonce: Optional[Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32,128}$")]] = None
    """The reader's own nonce: the feed answers `{"proof": feed_proof(...)}` first, proving it holds the key."""


def read_request(line: bytes) -> FeedRequest | None:
    """A request line as a FeedRequest; None for anything else (too deep, not JSON, another shape)."""
    try:
        return msgspec.json.decode(line, type=FeedRequest)
    except (msgspec.DecodeError, RecursionError):
        return None


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    changed: int = -1
    """In a delta: how many elements changed (where, then their values, follow); -1: all bytes follow."""
    form: str = ""
    """How a delta says where: "index" (int32 flat indices) or "mask" (a bit per element)."""
    dim: int = -1
    """A slice (the feed sends a worker its slices): the dimension it cuts (-1: the tensor whole)."""
    start: int = 0
    """Where the slice begins along `dim`."""
    full: int = 0
    """The whole tensor's size along `dim`."""

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The checkpoint tensor's shape (`shape` is its slice's)."""
        if self.dim < 0:
            return self.shape
        return tuple(self.full if i == self.dim else n for i, n in enumerate(self.shape))


@dataclass(frozen=True)
class Snapshot:
    step: int
    id: str
    """Random per publish: what a reader names as its base."""
    header: bytes
    """The header line, encoded once per publish."""
    tensors: tuple
    """The published (name, tensor) pairs; never written after publish."""
    base: str | None = None
    """The id of the snapshot `delta` is relative to (None: no delta)."""
    delta_header: bytes = b""
    delta: tuple = ()
    """Per tensor, in header order: (form, where, values) where they are smaller than the tensor, else None."""
    plan: str = ""
    """A worker's view of a snapshot: that worker's place (`Worker`, JSON), its tensors the worker's slices
    ("": the whole step)."""
    views: dict = field(default_factory=dict, compare=False, repr=False)
    """The views made of this snapshot so far, by plan (`view`)."""
    lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def view(self, worker: Worker | None, config: Mapping | None) -> Snapshot:
        """What `worker` keeps of this step, its slices (prl/weights/slices.py), made once per plan and kept
        while the snapshot is served; the snapshot itself for no worker, or one that keeps every tensor whole."""
        if worker is None or config is None:
            return self
        key = plan_key(worker)
        with self.lock:
            if key not in self.views:
                self.views[key] = sliced(self, worker, config, key)
            return self.views[key]

    def parts(self, delta: bool):
        """The non-empty tensors whose bytes follow the header (the delta's or the whole step's), in order."""
        for (_, t), change in zip(self.tensors, self.delta if delta else (None,) * len(self.tensors)):
            for part in change[1:] if change is not None else (t,):
                if part.numel():
                    yield part

    def payload(self, delta: bool):
        """The raw byte buffers after the header, in order."""
        return map(_bytes_of, self.parts(delta))


@dataclass
class _Round:
    """One group a feed is sending to: the snapshot it was formed on and whether it gets the delta."""
    held: Snapshot
    asked: int = 0
    """Members that asked so far."""
    delta: bool | None = None
    """None until decided: the delta once every member asked naming the snapshot's base, else the whole step."""


def snapshot(step: int, tensors: Sequence[tuple[str, "torch.Tensor"]], deltas: bool = False,  # noqa: F821
             previous: Snapshot | None = None) -> Snapshot:
    """A step's tensors as a servable snapshot: checked names and dtypes, contiguous CPU tensors; with
    `previous`, also the delta from it. `deltas`: the feed computes deltas (said in the header)."""
    kept, metas, names = [], [], set()
    for name, t in tensors:
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {dtype} is not one a feed carries ({', '.join(DTYPES)})")
        if name in names:
            raise ValueError(f"{name} published twice in step {step}")
        names.add(name)
        t = t.detach().to("cpu").contiguous()
        kept.append((name, t))
        metas.append([name, dtype, list(t.shape), t.numel() * t.element_size()])
    ident = os.urandom(8).hex()
    header = _header({"step": step, "id": ident, "deltas": deltas, "tensors": metas})
    if previous is None:
        return Snapshot(step, ident, header, tuple(kept))
    before = dict(previous.tensors)
    delta = tuple(encode_change(before.get(name), t) for name, t in kept)
    entries = [meta + ([-1, ""] if d is None else [d[2].numel(), d[0]]) for meta, d in zip(metas, delta)]
    delta_header = _header({"step": step, "id": ident, "base": previous.id, "deltas": True, "tensors": entries})
    return Snapshot(step, ident, header, tuple(kept), previous.id, delta_header, delta)


def _header(fields: dict) -> bytes:
    return json.dumps(fields, separators=(",", ":")).encode() + b"\n"


def plan_key(worker: Worker | None) -> str:
    """How a snapshot's views are told apart: the worker's place, as JSON ("" for none)."""
    return "" if worker is None else msgspec.json.encode(worker).decode()


def sliced(held: Snapshot, worker: Worker, config: Mapping, key: str) -> Snapshot:
    """`held` as `worker` keeps it: each tensor's slice (a contiguous copy; whole where it keeps it whole), each
    delta narrowed to the slice (`narrow_change`); `held` itself when every tensor stays whole."""
    plan = slices({name: tuple(t.shape) for name, t in held.tensors}, Dims.of(config), worker)
    cuts = [plan[name] for name, _ in held.tensors]
    if all(c is None for c in cuts):
        return held
    pieces, metas, entries, changes = [], [], [], []
    for (name, t), cut, change in zip(held.tensors, cuts, held.delta or (None,) * len(cuts)):
        piece = narrow(t, cut).contiguous()
        where = [-1, 0, 0] if cut is None else [cut.dim, cut.start, t.shape[cut.dim]]
        meta = [name, str(t.dtype).removeprefix("torch."), list(piece.shape), piece.numel() * piece.element_size()]
        d = None if change is None else change if cut is None else narrow_change(change, tuple(t.shape), cut.dim,
                                                                                   cut.start, cut.end)
        pieces.append((name, piece))
        metas.append(meta + where)
        entries.append(meta + ([-1, ""] if d is None else [d[2].numel(), d[0]]) + where)
        changes.append(d)
    header = _header({"step": held.step, "id": held.id, "deltas": json.loads(held.header)["deltas"],
                      "sliced": True, "tensors": metas})
    delta_header = b"" if held.base is None else _header({"step": held.step, "id": held.id, "base": held.base,
                                                           "deltas": True, "sliced": True, "tensors": entries})
    return Snapshot(held.step, held.id, header, tuple(pieces), held.base, delta_header,
                    tuple(changes) if held.base is not None else (), plan=key)


class FeedServer:
    """A threaded TCP server handing its newest snapshot to every authenticated reader."""

    def __init__(self, host: str, port: int, key: bytes, delta: bool = False, groups: bool = False,
                 group_timeout: float = DEFAULT_GROUP_TIMEOUT_S, config: Mapping | None = None,
                 backend: GroupBackend = "gloo"):
        """`delta`: each publish also encodes what changed since the previous one, for readers that
        hold the previous step (the cost: comparing every element at publish, and the delta's bytes).
        `groups`: also broadcast steps to groups of readers (a rendezvous store on `host`), each group
        bounded by `group_timeout` s per stage, over `backend` (nccl: from this thread's current GPU, each
        buffer staged there from the snapshot in host memory). `config`: the model's config.json, which says what
        each worker keeps of each tensor: a reader that names its place gets its slices (None: every reader the
        whole step)."""
        if not key:
            raise ValueError("a weight feed needs a non-empty key")
        self._key = key
        self._delta = delta
        self._config = config
        self._snapshot: Snapshot | None = None
        self._lock = threading.Lock()
        self._decided = threading.Condition(self._lock)
        self._group_timeout = group_timeout
        self._backend = backend
        self._device = None
        """Where the groups' buffers go out from (None: host memory, gloo)."""
        self._groups: dict[str, tuple[int, int, str]] = {}
        """token -> (step, world, "sending" | "sent" | "failed"), the newest MAX_GROUPS_KEPT."""
        self._sending: dict[str, _Round] = {}
        """token -> a group still sending: the snapshot it was formed on (its late members get that step)."""
        self.group_log: deque[dict] = deque(maxlen=MAX_GROUPS_KEPT)
        """What each ended group did: {"token", "step", "world", "delta", "bytes", "seconds"[, "error"]}."""
        self._store = None
        if groups:
            from prl.weights import collective

            self._store = collective.store(host, group_timeout)
            if backend == "nccl":  # the constructing thread's GPU (a trainer rank's); the sender threads' is 0
                self._device = collective.device(backend)
        self._admission = _Admission()
        self._refusals = Throttled(log)
        self._server = _Listener((host, port), self)
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"prl-feed-{port}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    @property
    def step(self) -> int | None:
        """The step being served (None before the first publish)."""
        held = self._snapshot
        return held.step if held else None

    def publish(self, step: int, tensors: Sequence[tuple[str, "torch.Tensor"]]) -> None:  # noqa: F821
        """Serve `tensors` as `step` from now on; readers already streaming finish on the old snapshot."""
        new = snapshot(step, tensors, self._delta, self._snapshot if self._delta else None)
        with self._lock:
            self._snapshot = new

    @property
    def store_address(self) -> str | None:
        """host:port of the groups' rendezvous store (None: this feed sends to no groups)."""
        return None if self._store is None else f"{self._server.server_address[0]}:{self._store.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
        self._store = None  # its listening socket closes with it (a sender still running holds its own reference)

    def __enter__(self) -> FeedServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _serve(self, sock: socket.socket) -> None:
        deadline = time.monotonic() + AUTH_TIMEOUT_S
        sock.settimeout(AUTH_TIMEOUT_S)
        nonce = os.urandom(16).hex().encode()
        try:
            sock.sendall(PROTOCOL + b" " + nonce + b"\n")
            line = _request_line(sock, deadline)
            request = read_request(line)
            if request is None or not request.mac.isascii() or not hmac.compare_digest(request.mac,
                                                                                        mac(self._key, nonce)):
                self._refused(sock, "no request line" if not line else "a malformed request" if request is None
                              else "a wrong key")
                return _send_line(sock, {"error": "authentication failed: wrong key"})
            self._admission.authenticated(sock)
            sock.settimeout(SEND_TIMEOUT_S)
            if request.nonce is not None:
                _send_line(sock, {"proof": feed_proof(self._key, request.nonce, sock.getsockname()[1])})
            asked = request.group
            with self._lock:
                held = self._snapshot
                if asked is not None and asked.token in self._sending:
                    held = self._sending[asked.token].held  # its members all get the step it began on
            if held is None or request.step != held.step:
                have = "no step yet" if held is None else f"step {held.step}"
                return _send_line(sock, {"error": f"holds {have}, not step {request.step}",
                                         "step": held.step if held else None})
            if not held.plan:  # a group's round may hold its members' view already
                held = held.view(request.worker, self._config)
            elif held.plan != plan_key(request.worker):
                return _send_line(sock, {"error": f"group {asked.token[:8]} sends other slices than this reader "
                                                  "keeps (its members are the workers of one place in their servers)"})
            if asked is not None:
                return self._join(sock, asked, held, request.base)
            delta = held.base is not None and request.base == held.base
            sock.sendall(held.delta_header if delta else held.header)
            for view in held.payload(delta):
                sock.sendall(view)
        except TimeoutError:
            if sock in self._admission:
                self._refused(sock, f"no request line within {AUTH_TIMEOUT_S:g} s")
        except (OSError, ValueError):
            return  # the reader went away or spoke nonsense: its fetch reports it

    def _refused(self, sock: socket.socket, why: str) -> None:
        try:
            peer = sock.getpeername()[0]
        except OSError:
            peer = "a peer that left"
        self._refusals.warning("weight feed %s: refused a connection from %s: %s", self.address, peer, why)

    def _join(self, sock: socket.socket, group: Group, held: Snapshot, base: str | None) -> None:
        """A reader of a group: the step's header (the delta's where every member holds its base) and the store;
        the group's sender starts with its first."""
        if self._store is None:
            return _send_line(sock, {"error": "this feed sends to no groups (weights.transport: broadcast)"})
        if group.rank == 0:
            return _send_line(sock, {"error": "bad group: rank 0 is the feed's own (a reader's rank is 1 and up)"})
        if group.backend != self._backend:
            return _send_line(sock, {"error": f"this feed's groups are {self._backend}, not {group.backend}"})
        with self._lock:
            known = self._groups.get(group.token)
            sending = self._sending.get(group.token)
            if sending is not None and sending.held is not held:
                return _send_line(sock, {"error": f"group {group.token[:8]} sends other slices than this reader "
                                                  "keeps (its members are the workers of one place in their servers)"})
            if known is None:
                self._groups[group.token] = (held.step, group.world, "sending")
                self._sending[group.token] = _Round(held)
                while len(self._groups) > MAX_GROUPS_KEPT:
                    del self._groups[next(iter(self._groups))]
                threading.Thread(target=self._send_group, args=(group.token, group.world, held),
                                 name=f"prl-feed-group-{group.token[:8]}", daemon=True).start()
            sent = self._sending.get(group.token)
        if known is not None and known != (held.step, group.world, "sending"):
            step, world, state = known
            why = ("has ended" if state != "sending" else f"is sending step {step} to {world} members, not step "
                   f"{held.step} to {group.world}")
            return _send_line(sock, {"error": f"group {group.token[:8]} {why}"})
        delta = self._delta_for(sent, group.world, base)
        if delta is None:
            return _send_line(sock, {"error": f"group {group.token[:8]}: not all {group.world - 1} members asked "
                                              f"within {self._group_timeout:g} s"})
        sock.sendall(held.delta_header if delta else held.header)
        _send_line(sock, {"store": self.store_address})

    def _delta_for(self, sent: _Round, world: int, base) -> bool | None:
        """Whether the group gets its step as the delta: only if every member names the snapshot's base, so the
        members that do wait for the others (at most the group timeout; None if they do not all come). A feed
        without deltas, or a member without that base, decides at once: the whole step, for every member."""
        deadline = time.monotonic() + self._group_timeout
        with self._decided:
            sent.asked += 1
            if sent.held.base is None or base != sent.held.base:
                sent.delta = False
            elif sent.delta is None and sent.asked >= world - 1:
                sent.delta = True
            self._decided.notify_all()
            while sent.delta is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._decided.wait(left)
            return sent.delta

    def _send_group(self, token: str, world: int, held: Snapshot) -> None:
        """Rank 0 of a group: form it, broadcast `held` (or its delta, as the members were told), drop it;
        bounded by the group timeout at each stage."""
        from prl.weights import collective

        start = time.perf_counter()
        record: dict = {"token": token, "step": held.step, "world": world, "delta": False, "bytes": 0}
        try:
            if self._device is not None:
                import torch

                torch.cuda.set_device(self._device)
            pg = collective.join(Group(token=token, world=world, rank=0, timeout=self._group_timeout,
                                       backend=self._backend), self._server.server_address[0], self._store,
                                 self._key)
            try:
                # Every member was answered before it joined: the group formed, so the choice is made.
                record["delta"] = self._sending[token].delta is True
                record["bytes"] = collective.send(pg, held.parts(record["delta"]), self._device)
            finally:
                collective.close(pg)
        except Exception as e:  # noqa: BLE001 - the members see it too: their update fails, they pull instead
            record["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        record["seconds"] = time.perf_counter() - start
        if "error" in record:
            log.warning("weight feed %s: the broadcast of step %d to group %s (%d members) failed after %.1f s: %s",
                        self.address, held.step, token[:8], world, record["seconds"], record["error"])
        with self._lock:
            self._sending.pop(token, None)
            if token in self._groups:
                self._groups[token] = (held.step, world, "failed" if "error" in record else "sent")
            self.group_log.append(record)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        self.server.feed._serve(self.request)


class _Listener(socketserver.ThreadingTCPServer):
    """A feed's accept loop: a thread per connection it admits (`_Admission`), the rest closed at accept."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], feed: FeedServer):
        self.feed = feed
        super().__init__(address, _Handler)

    def process_request(self, request, client_address):
        feed = self.feed
        if not feed._admission.admit(request):
            feed._refusals.warning("weight feed %s: closed a connection from %s at once: %s", feed.address,
                                   client_address[0], feed._admission.full())
            return self.shutdown_request(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            feed._admission.done(request)  # no thread started (the server shuts the socket)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.feed._admission.done(request)

    def handle_error(self, request, client_address):  # not socketserver's traceback per connection
        e = sys.exception()
        self.feed._refusals.warning("weight feed %s: a connection from %s failed: %s: %s", self.feed.address,
                                    client_address[0], type(e).__name__, str(e)[:200])


class _Admission:
    """The connections a feed holds: how many (MAX_CONNECTIONS) and which have not proven the key (MAX_PENDING)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._pending: set[socket.socket] = set()

    def admit(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._open >= MAX_CONNECTIONS or len(self._pending) >= MAX_PENDING:
                return False
            self._open += 1
            self._pending.add(sock)
            return True

    def full(self) -> str:
        return (f"{len(self._pending)} connections not yet authenticated (MAX_PENDING {MAX_PENDING}), "
                f"{self._open} in all (MAX_CONNECTIONS {MAX_CONNECTIONS})")

    def authenticated(self, sock: socket.socket) -> None:
        with self._lock:
            self._pending.discard(sock)

    def done(self, sock: socket.socket) -> None:
        with self._lock:
            self._open -= 1
            self._pending.discard(sock)

    def __contains__(self, sock: socket.socket) -> bool:
        with self._lock:
            return sock in self._pending


def _request_line(sock: socket.socket, deadline: float) -> bytes:
    """The client's request line (at most MAX_REQUEST_BYTES, up to its newline), read by `deadline`
    (time.monotonic) however slowly its bytes come: TimeoutError past it; short for a client that closed."""
    data = b""
    while b"\n" not in data and len(data) < MAX_REQUEST_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no request line within {AUTH_TIMEOUT_S:g} s")
        sock.settimeout(left)
        chunk = sock.recv(MAX_REQUEST_BYTES - len(data))
        if not chunk:
            break
        data += chunk
    end = data.find(b"\n")
    return data if end < 0 else data[:end + 1]


def _send_line(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _bytes_of(t) -> memoryview:
    """A tensor's storage as bytes, without a copy (bfloat16 has no numpy dtype: view it as uint8)."""
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class Base:
    """What a reader already holds from a feed: a snapshot's id and its tensors (by name)."""
    id: str
    tensors: Mapping[str, "torch.Tensor"]  # noqa: F821


class FeedReader:
    """One open, authenticated connection to a feed, its header read; iterate it for the tensors.

    With `base` (what this reader kept of the feed's previous snapshot), a feed that computes deltas
    sends only what changed, and each tensor is rebuilt on a copy of the base's: `delta` says whether it
    did. `id` is the snapshot's, `keep` whether the feed computes deltas (keeping what was read pays off),
    `received` the bytes read off the socket so far.

    With `group` (prl/weights/collective.py) the reader joins that broadcast group instead (the delta if every
    member holds the base, else the whole step): the group is formed before the constructor returns, so a
    member that does not come fails it before the caller touches anything; the group's timeout bounds each
    stage."""

    def __init__(self, address: str, step: int, key: bytes, timeout: float, base: Base | None = None,
                 group=None, worker: Worker | None = None):
        self.address = address
        self.received = 0
        self.worker = worker
        self.pieces: dict[str, "torch.Tensor"] = {}  # noqa: F821
        """What was read of each tensor (its slice), kept where the feed sends deltas: the next step's base."""
        self._base = base
        self._group = group
        self._pg = None
        self._device = None
        """Where a group's broadcasts arrive (the constructing thread's GPU under nccl; None: host memory)."""
        self._receiving = False
        host, sep, port = address.rpartition(":")
        if not (sep and host and port.isdigit()):
            raise FeedError(address, "not a host:port address")
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=timeout)
        except OSError as e:
            raise FeedError(address, f"cannot connect: {e}") from None
        self._sock.settimeout(timeout)
        self._file = self._sock.makefile("rb")
        try:
            self.tensors = self._handshake(step, key)
            if group is not None:
                from prl.weights import collective

                self._device = collective.device(group.backend)
                self._pg = self._join_group(key)
        except BaseException:
            self.close()
            raise
        self.step = step

    def _join_group(self, key: bytes):
        from prl.weights import collective

        answer = self._json(self._line())
        store = answer.get("store")
        if not isinstance(store, str) or not store.rpartition(":")[2].isdigit():
            raise FeedError(self.address, f"named no rendezvous store for group {self._group.token[:8]}: {answer}")
        try:
            return collective.join(self._group, self._sock.getsockname()[0], store, key)
        except collective.StoreRefused as e:
            raise FeedError(self.address, f"group {self._group.token[:8]}: {e}") from None
        except Exception as e:  # noqa: BLE001 - torch.distributed raises several kinds
            raise FeedError(self.address, f"group {self._group.token[:8]} of {self._group.world} did not form "
                                          f"within {self._group.timeout:g} s: {type(e).__name__}: {str(e)[:200]}") from None

    def _handshake(self, step: int, key: bytes) -> list[TensorMeta]:
        greeting = self._line()
        proto, _, nonce = greeting.rstrip(b"\n").rpartition(b" ")
        if proto != PROTOCOL or not nonce:
            raise FeedError(self.address, f"not a prl weight feed (it said {greeting[:40]!r})")
        mine = os.urandom(16).hex()
        request = FeedRequest(step=step, mac=mac(key, nonce), base=None if self._base is None else self._base.id,
                              group=self._group, worker=self.worker, nonce=mine)
        self._send(msgspec.to_builtins(request))
        proof = self._json(self._line())
        if "error" in proof:
            raise FeedError(self.address, str(proof["error"])[:300])
        if not isinstance(proof.get("proof"), str) or not hmac.compare_digest(
                proof["proof"], feed_proof(key, mine, self._sock.getpeername()[1])):
            raise FeedError(self.address, "did not prove it holds the run's key: not this run's feed (a process "
                                          "on a planned port?); nothing was read from it")
        header = self._json(self._line())
        if "error" in header:
            raise FeedError(self.address, str(header["error"])[:300])
        if header.get("step") != step or not isinstance(header.get("tensors"), list):
            raise FeedError(self.address, f"answered step {header.get('step')!r} without a tensor list")
        self.id = str(header.get("id", ""))
        self.keep = header.get("deltas") is True
        self.delta = header.get("base") is not None
        self.sliced = header.get("sliced") is True
        if self.delta and (self._base is None or header["base"] != self._base.id):
            raise FeedError(self.address, f"sent a delta from snapshot {header['base']!r}, which this reader "
                                          "does not hold")
        return [self._meta(entry) for entry in header["tensors"]]

    def _meta(self, entry) -> TensorMeta:
        try:
            name, dtype, shape, nbytes, *rest = entry
            changed, form = rest[:2] if self.delta else (-1, "")
            dim, start, full = rest[2 * self.delta:] if self.sliced else (-1, 0, 0)
            shape = tuple(shape)
            ok = (isinstance(name, str) and dtype in DTYPES and isinstance(nbytes, int)
                  and all(isinstance(n, int) and n >= 0 for n in shape)
                  and len(rest) == 2 * self.delta + 3 * self.sliced
                  and isinstance(changed, int) and -1 <= changed <= math.prod(shape)
                  and (form == "" if changed < 0 else form in FORMS)
                  and all(isinstance(n, int) for n in (dim, start, full))
                  and (dim == -1 or 0 <= dim < len(shape) and 0 <= start and start + shape[dim] <= full))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise FeedError(self.address, f"malformed tensor entry in the header: {str(entry)[:200]}")
        import torch

        if nbytes != math.prod(shape) * getattr(torch, dtype).itemsize:
            raise FeedError(self.address, f"{name}: {nbytes} bytes do not make a {dtype} tensor of shape "
                                          f"{list(shape)}")
        if changed >= 0:
            held = self._base.tensors.get(name)
            if held is None or tuple(held.shape) != shape or str(held.dtype).removeprefix("torch.") != dtype:
                raise FeedError(self.address, f"{name}: a delta for a tensor this reader does not hold as "
                                              f"{dtype} {list(shape)}")
        return TensorMeta(name, dtype, shape, nbytes, changed, form, dim, start, full)

    def __iter__(self) -> Iterator[tuple[str, "torch.Tensor"]]:  # noqa: F821
        """Each tensor in fresh storage (never a reused buffer: vLLM's layerwise reload keeps what it is
        handed until the layer is complete; a delta is applied to a copy of the base's tensor), in its checkpoint
        shape: a slice comes placed in a tensor of the whole one's shape whose rest is never written (vLLM's
        loaders read only the slice; the rest's pages are never touched); FeedError if the stream ends or stalls
        early (in a group: a broadcast fails or times out)."""
        import torch

        if self._group is not None and self._pg is None:
            raise FeedError(self.address, f"group {self._group.token[:8]}: the reader was closed")
        self._receiving = self._group is not None
        try:
            for i, meta in enumerate(self.tensors):
                piece = self._piece(meta, f"tensor {i + 1} of {len(self.tensors)} ({meta.name})")
                if self.keep and self._device is None:  # a base in GPU memory would cost a model's worth there
                    self.pieces[meta.name] = piece
                if meta.dim < 0:
                    yield meta.name, piece
                    continue
                whole = torch.empty(meta.full_shape, dtype=piece.dtype, device=piece.device)
                whole.narrow(meta.dim, meta.start, meta.shape[meta.dim]).copy_(piece)
                yield meta.name, whole
        finally:
            self._receiving = False
            self.close()

    def _piece(self, meta: TensorMeta, what: str) -> "torch.Tensor":  # noqa: F821
        """The next tensor (or slice) of the stream: its bytes, or its delta applied to a copy of the base's."""
        import torch

        dtype = getattr(torch, meta.dtype)
        if meta.changed < 0:
            return self._read(meta.nbytes, what).view(dtype).view(meta.shape)
        numel = math.prod(meta.shape)
        raw = self._read(where_bytes(meta.form, numel, meta.changed), what)
        try:
            where = positions(meta.form, raw, numel, meta.changed)
        except BadDelta as e:
            raise FeedError(self.address, f"{what}: {e}") from None
        values = self._read(meta.nbytes // max(1, numel) * meta.changed, what).view(dtype)
        return rebuild(self._base.tensors[meta.name], where, values)

    def _read(self, nbytes: int, what: str) -> "torch.Tensor":  # noqa: F821
        """The next `nbytes` of the payload, off the socket or (in a group) by broadcast, in fresh storage."""
        import torch

        raw = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        if not nbytes:
            return raw
        if self._group is None:
            self._read_into(memoryview(raw.numpy()), what)
            return raw
        from prl.weights import collective

        try:
            collective.receive(self._pg, raw)
        except Exception as e:  # noqa: BLE001 - a member or the sender died, or a broadcast timed out
            raise FeedError(self.address, f"group {self._group.token[:8]}, {what}: "
                                          f"{type(e).__name__}: {str(e)[:200]}") from None
        self.received += nbytes
        return raw

    def close(self) -> None:
        """Safe from another thread: a read blocked on this connection fails at once (a broadcast blocked in
        a group, at the group's timeout)."""
        if self._pg is not None and not self._receiving:  # a broadcast in flight is not torn down under it
            from prl.weights import collective

            pg, self._pg = self._pg, None
            collective.close(pg)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed, or never connected
        self._file.close()
        self._sock.close()

    def _read_into(self, view: memoryview, what: str) -> None:
        got = 0
        while got < len(view):
            try:
                n = self._file.readinto(view[got:])
            except OSError as e:
                raise FeedError(self.address, f"reading {what}: {type(e).__name__}: {e or 'timed out'}") from None
            if not n:
                raise FeedError(self.address, f"closed the stream during {what} ({got} of {len(view)} bytes)")
            got += n
            self.received += n

    def _line(self) -> bytes:
        try:
            line = self._file.readline(MAX_LINE_BYTES)
        except OSError as e:
            raise FeedError(self.address, f"no answer: {type(e).__name__}: {e or 'timed out'}") from None
        if not line.endswith(b"\n"):
            raise FeedError(self.address, "closed the connection" if not line else "sent an over-long line")
        return line

    def _json(self, line: bytes) -> dict:
        try:
            value = json.loads(line)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise FeedError(self.address, f"sent a line that is not a JSON object: {line[:80]!r}")
        return value

    def _send(self, message: dict) -> None:
        try:
            _send_line(self._sock, message)
        except OSError as e:
            raise FeedError(self.address, f"cannot send: {e}") from None


READ_AHEAD_BYTES = 512 * 1024 * 1024
"""How many bytes `read_concurrently` holds that its caller has not taken yet (one tensor more when a
single tensor is larger): the bound on the memory the overlap costs."""


def read_concurrently(readers: Sequence[FeedReader],
                      ahead_bytes: int = READ_AHEAD_BYTES) -> Iterator[tuple[str, "torch.Tensor"]]:  # noqa: F821
    """Every reader's tensors, each reader streamed by a thread of its own while the caller works on
    what arrived: the socket reads overlap the caller's (a worker's reload) and each other, where
    reading the feeds one after another leaves the reload waiting on the socket and the sockets on the
    reload. Tensors come in arrival order (each feed's in its header order). The first error of any
    reader is raised as soon as it happens (the update fails anyway); leaving the loop early, or an error,
    closes every reader, which stops its thread."""
    pending: deque[tuple[str, object, int]] = deque()
    state = {"held": 0, "running": len(readers), "stop": False}
    errors: list[BaseException] = []
    changed = threading.Condition()

    def pump(reader: FeedReader) -> None:
        try:
            for name, tensor in reader:
                size = tensor.numel() * tensor.element_size()
                with changed:
                    while state["held"] and state["held"] + size > ahead_bytes and not state["stop"]:
                        changed.wait()
                    if state["stop"]:
                        return
                    pending.append((name, tensor, size))
                    state["held"] += size
                    changed.notify_all()
        except BaseException as e:
            with changed:
                errors.append(e)
        finally:
            with changed:
                state["running"] -= 1
                changed.notify_all()

    threads = [threading.Thread(target=pump, args=(r,), name=f"prl-feed-read-{r.address}", daemon=True)
               for r in readers]
    for t in threads:
        t.start()
    try:
        while True:
            with changed:
                while not pending and not errors and state["running"]:
                    changed.wait()
                if errors:
                    raise errors[0]
                if not pending:
                    return
                name, tensor, size = pending.popleft()
                state["held"] -= size
                changed.notify_all()
            yield name, tensor
    finally:
        with changed:
            state["stop"] = True
            changed.notify_all()
        for reader in readers:
            reader.close()
        for t in threads:
            t.join(timeout=10)


def fetch(address: str, step: int, key: bytes, timeout: float = 60.0) -> Iterator[tuple[str, "torch.Tensor"]]:  # noqa: F821
    """(name, tensor) of `step` from the feed at `address`, each in fresh storage; FeedError naming the
    address and the reason (refused key, another step held, a stream cut or stalled for `timeout` s)."""
    return iter(FeedReader(address, step, key, timeout))
