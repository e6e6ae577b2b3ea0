"""The weight feed (prl/run/feed.py): a trainer rank's tensors over TCP, no vLLM, no Slurm."""

from __future__ import annotations

import json
import pickle
import socket
import threading

import pytest
import torch

from prl.errors import FeedError
from prl.run.feed import FeedServer, fetch

KEY = b"run-key"


@pytest.fixture
def feed():
    with FeedServer("127.0.0.1", 0, KEY) as server:
        yield server


def sample_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 5, generator=gen).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(5, generator=gen)),
        ("half", torch.randn(3, 2, generator=gen).to(torch.float16)),
        ("scalar", torch.tensor(3.5, dtype=torch.float64)),
        ("empty", torch.empty(0, 4)),
        ("ids", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
        ("mask", torch.tensor([True, False, True])),
        ("strided", torch.arange(12, dtype=torch.float32).reshape(3, 4).t()),  # not contiguous
    ]


def test_round_trip_keeps_names_dtypes_shapes_and_values(feed):
    sent = sample_tensors()
    feed.publish(4, sent)
    got = list(fetch(feed.address, 4, KEY, timeout=10))
    assert [n for n, _ in got] == [n for n, _ in sent]
    for (name, a), (_, b) in zip(sent, got):
        assert b.dtype == a.dtype and b.shape == a.shape, name
        assert torch.equal(a, b), name
        assert b.is_contiguous()


def test_each_tensor_has_fresh_storage(feed):
    feed.publish(1, [("a", torch.ones(4)), ("b", torch.ones(4))])
    a, b = (t for _, t in fetch(feed.address, 1, KEY, timeout=10))
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


def test_a_wrong_key_is_refused(feed):
    feed.publish(1, sample_tensors())
    with pytest.raises(FeedError, match="authentication failed") as caught:
        list(fetch(feed.address, 1, b"another-key", timeout=10))
    assert caught.value.address == feed.address and feed.address in str(caught.value)


def test_a_step_not_held_is_refused_naming_the_held_step(feed):
    with pytest.raises(FeedError, match="holds no step yet, not step 2"):
        list(fetch(feed.address, 2, KEY, timeout=10))
    feed.publish(3, sample_tensors())
    with pytest.raises(FeedError, match="holds step 3, not step 2"):
        list(fetch(feed.address, 2, KEY, timeout=10))


def test_nothing_listening_is_a_feed_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = "127.0.0.1:%d" % s.getsockname()[1]
    with pytest.raises(FeedError, match="cannot connect"):
        fetch(address, 1, KEY, timeout=5)
    with pytest.raises(FeedError, match="not a host:port"):
        fetch("nohost", 1, KEY, timeout=5)


def fake_feed(behave) -> tuple[str, threading.Thread]:
    """A one-connection server that runs `behave(conn)` after reading the client's answer."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        with conn, listener:
            conn.sendall(b"prl-feed 1 abcd\n")
            conn.makefile("rb").readline()
            behave(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return "127.0.0.1:%d" % listener.getsockname()[1], thread


def test_a_server_closing_mid_stream_raises():
    header = {"step": 1, "tensors": [["a", "float32", [4], 16], ["b", "float32", [1000], 4000]]}

    def half(conn):
        conn.sendall(json.dumps(header).encode() + b"\n" + bytes(16) + bytes(100))

    address, thread = fake_feed(half)
    got = []
    with pytest.raises(FeedError, match=r"closed the stream during tensor 2 of 2 \(b\) \(100 of 4000 bytes\)"):
        for name, _ in fetch(address, 1, KEY, timeout=10):
            got.append(name)
    assert got == ["a"]
    thread.join(5)


def test_a_stalled_server_times_out_instead_of_hanging():
    stop = threading.Event()
    header = {"step": 1, "tensors": [["a", "float32", [4], 16]]}

    def stall(conn):
        conn.sendall(json.dumps(header).encode() + b"\n" + bytes(8))
        stop.wait(10)

    address, thread = fake_feed(stall)
    with pytest.raises(FeedError, match="reading tensor 1 of 1 \\(a\\)"):
        list(fetch(address, 1, KEY, timeout=0.5))
    stop.set()
    thread.join(5)


def test_a_header_whose_sizes_disagree_is_refused():
    header = {"step": 1, "tensors": [["a", "float32", [4], 15]]}
    address, thread = fake_feed(lambda conn: conn.sendall(json.dumps(header).encode() + b"\n"))
    with pytest.raises(FeedError, match="15 bytes do not make a float32 tensor of shape \\[4\\]"):
        fetch(address, 1, KEY, timeout=5)
    thread.join(5)


def test_a_snapshot_replaced_during_a_read_is_not_torn(feed):
    """A reader that started on step 1 gets step 1 whole, though step 2 was published meanwhile."""
    old = [(f"t{i}", torch.full((64 * 1024,), float(i))) for i in range(8)]  # 2 MiB: more than socket buffers
    feed.publish(1, old)
    stream = fetch(feed.address, 1, KEY, timeout=10)
    first = next(stream)
    feed.publish(2, [(n, torch.full_like(t, -1.0)) for n, t in old])
    rest = list(stream)
    for (name, want), (got_name, got) in zip(old, [first, *rest]):
        assert got_name == name and torch.equal(got, want)
    assert [t[0].item() for _, t in fetch(feed.address, 2, KEY, timeout=10)] == [-1.0] * 8


def test_publish_refuses_what_a_feed_cannot_carry(feed):
    with pytest.raises(ValueError, match="published twice"):
        feed.publish(1, [("a", torch.ones(1)), ("a", torch.ones(1))])
    with pytest.raises(ValueError, match="complex64"):
        feed.publish(1, [("a", torch.ones(1, dtype=torch.complex64))])
    assert feed.step is None


def test_feed_error_survives_pickling():
    e = pickle.loads(pickle.dumps(FeedError("h:1", "gone")))
    assert str(e) == "weight feed h:1: gone" and e.address == "h:1"
