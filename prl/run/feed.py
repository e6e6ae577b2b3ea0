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
    client -> server   {"step": N, "mac": hex HMAC-SHA256(key, nonce hex)}\\n
    server -> client   {"error": "..."[, "step": held]}\\n            (wrong mac, or not step N; then closes)
                   or  {"step": N, "tensors": [[name, dtype, shape, nbytes], ...]}\\n
                       the tensors' raw bytes, in header order

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
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prl.errors import FeedError

PROTOCOL = b"prl-feed 1"
MAX_LINE_BYTES = 64 * 1024 * 1024
"""Longest protocol line (the header names every tensor: ~100 bytes each)."""
MAX_REQUEST_BYTES = 4096
"""Longest client answer a server reads (a step and a mac)."""
SEND_TIMEOUT_S = 600.0
"""How long a server waits on one client's socket: a worker reads its feeds one after another, so a
connection may idle while the feeds before it stream."""
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
          "float8_e4m3fn", "float8_e5m2")
"""Tensor dtypes a feed carries (torch names)."""


def mac(key: bytes, nonce: bytes) -> str:
    return hmac.new(key, nonce, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Snapshot:
    step: int
    header: bytes
    """The header line, encoded once per publish."""
    tensors: tuple
    """The published (name, tensor) pairs; never written after publish."""


def snapshot(step: int, tensors: Sequence[tuple[str, "torch.Tensor"]]) -> Snapshot:  # noqa: F821
    """A step's tensors as a servable snapshot: checked names and dtypes, contiguous CPU tensors."""
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
    header = json.dumps({"step": step, "tensors": metas}, separators=(",", ":")).encode() + b"\n"
    return Snapshot(step, header, tuple(kept))


class FeedServer:
    """A threaded TCP server handing its newest snapshot to every authenticated reader."""

    def __init__(self, host: str, port: int, key: bytes):
        if not key:
            raise ValueError("a weight feed needs a non-empty key")
        self._key = key
        self._snapshot: Snapshot | None = None
        self._lock = threading.Lock()
        feed = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                feed._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
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
        new = snapshot(step, tensors)
        with self._lock:
            self._snapshot = new

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FeedServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(SEND_TIMEOUT_S)
        nonce = os.urandom(16).hex().encode()
        try:
            sock.sendall(PROTOCOL + b" " + nonce + b"\n")
            with sock.makefile("rb") as reader:
                line = reader.readline(MAX_REQUEST_BYTES)
            request = json.loads(line)
            if not (isinstance(request, dict) and isinstance(request.get("mac"), str)
                    and hmac.compare_digest(request["mac"], mac(self._key, nonce))):
                return _send_line(sock, {"error": "authentication failed: wrong key"})
            with self._lock:
                held = self._snapshot
            if held is None or request.get("step") != held.step:
                have = "no step yet" if held is None else f"step {held.step}"
                return _send_line(sock, {"error": f"holds {have}, not step {request.get('step')}",
                                         "step": held.step if held else None})
            sock.sendall(held.header)
            for _, t in held.tensors:
                if t.numel():
                    sock.sendall(_bytes_of(t))
        except (OSError, ValueError):
            return  # the reader went away or spoke nonsense: its fetch reports it


def _send_line(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _bytes_of(t) -> memoryview:
    """A tensor's storage as bytes, without a copy (bfloat16 has no numpy dtype: view it as uint8)."""
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class FeedReader:
    """One open, authenticated connection to a feed, its header read; iterate it for the tensors."""

    def __init__(self, address: str, step: int, key: bytes, timeout: float):
        self.address = address
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
        except BaseException:
            self.close()
            raise
        self.step = step

    def _handshake(self, step: int, key: bytes) -> list[TensorMeta]:
        greeting = self._line()
        proto, _, nonce = greeting.rstrip(b"\n").rpartition(b" ")
        if proto != PROTOCOL or not nonce:
            raise FeedError(self.address, f"not a prl weight feed (it said {greeting[:40]!r})")
        self._send({"step": step, "mac": mac(key, nonce)})
        header = self._json(self._line())
        if "error" in header:
            raise FeedError(self.address, str(header["error"])[:300])
        if header.get("step") != step or not isinstance(header.get("tensors"), list):
            raise FeedError(self.address, f"answered step {header.get('step')!r} without a tensor list")
        return [self._meta(entry) for entry in header["tensors"]]

    def _meta(self, entry) -> TensorMeta:
        try:
            name, dtype, shape, nbytes = entry
            shape = tuple(shape)
            ok = (isinstance(name, str) and dtype in DTYPES and isinstance(nbytes, int)
                  and all(isinstance(n, int) and n >= 0 for n in shape))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise FeedError(self.address, f"malformed tensor entry in the header: {str(entry)[:200]}")
        import torch

        if nbytes != math.prod(shape) * getattr(torch, dtype).itemsize:
            raise FeedError(self.address, f"{name}: {nbytes} bytes do not make a {dtype} tensor of shape "
                                          f"{list(shape)}")
        return TensorMeta(name, dtype, shape, nbytes)

    def __iter__(self) -> Iterator[tuple[str, "torch.Tensor"]]:  # noqa: F821
        """Each tensor in fresh storage (never a reused buffer: vLLM's layerwise reload keeps what it is
        handed until the layer is complete); FeedError if the stream ends or stalls early."""
        import torch

        try:
            for i, meta in enumerate(self.tensors):
                raw = torch.empty(meta.nbytes, dtype=torch.uint8)
                if meta.nbytes:
                    self._read_into(memoryview(raw.numpy()), f"tensor {i + 1} of {len(self.tensors)} ({meta.name})")
                yield meta.name, raw.view(getattr(torch, meta.dtype)).view(meta.shape)
        finally:
            self.close()

    def close(self) -> None:
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


def fetch(address: str, step: int, key: bytes, timeout: float = 60.0) -> Iterator[tuple[str, "torch.Tensor"]]:  # noqa: F821
    """(name, tensor) of `step` from the feed at `address`, each in fresh storage; FeedError naming the
    address and the reason (refused key, another step held, a stream cut or stalled for `timeout` s)."""
    return iter(FeedReader(address, step, key, timeout))
