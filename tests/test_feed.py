"""The weight feed (prl/weights/feed.py): a trainer rank's tensors over TCP, no vLLM, no Slurm."""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time

import msgspec
import pytest
import torch

from prl.errors import FeedError
from prl.weights.feed import Base, FeedReader, FeedServer, feed_proof, fetch, read_concurrently

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


def fake_feed(behave, key: bytes | None = KEY) -> tuple[str, threading.Thread]:
    """A one-connection server that runs `behave(conn)` after reading the client's answer and, holding `key`,
    proving it (`feed_proof`); without a key it proves nothing."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        conn, _ = listener.accept()
        with conn, listener:
            conn.sendall(b"prl-feed 1 abcd\n")
            request = json.loads(conn.makefile("rb").readline())
            if key is not None:
                conn.sendall(json.dumps({"proof": feed_proof(key, request["nonce"], port)}).encode() + b"\n")
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


def test_a_feed_that_cannot_prove_the_run_s_key_serves_nothing(feed):
    """A process on a dead rank's feed port: one that holds no key, or one that relays a live feed of the run
    (whose proof names that feed's port, not the one the reader asked)."""
    header = {"step": 1, "tensors": [["a", "float32", [4], 16]]}
    for key in (None, b"another run's key"):
        address, thread = fake_feed(lambda conn: conn.sendall(json.dumps(header).encode() + b"\n" + bytes(16)), key)
        with pytest.raises(FeedError, match="did not prove it holds the run's key"):
            fetch(address, 1, KEY, timeout=5)
        thread.join(5)
    feed.publish(1, sample_tensors())
    relay = socket.create_server(("127.0.0.1", 0))

    def pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the reader gave up on the relay: what it should do

    def serve():
        conn, _ = relay.accept()
        upstream = socket.create_connection(feed.address.split(":"), timeout=5)
        threading.Thread(target=pipe, args=(upstream, conn), daemon=True).start()
        pipe(conn, upstream)

    threading.Thread(target=serve, daemon=True).start()
    with relay, pytest.raises(FeedError, match="did not prove it holds the run's key"):
        fetch("127.0.0.1:%d" % relay.getsockname()[1], 1, KEY, timeout=5)


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


def test_a_reader_that_stops_or_dies_mid_stream_holds_up_neither_publish_nor_other_readers(feed):
    """An inference worker hung (SIGSTOP) or killed in the middle of a step: its connection stalls with the socket
    buffers full, then resets. The trainer's next publish and every other reader go on meanwhile."""
    old = [(f"t{i}", torch.full((256 * 1024,), float(i))) for i in range(8)]  # 8 MiB: more than socket buffers
    feed.publish(1, old)
    stuck = FeedReader(feed.address, 1, KEY, timeout=10)
    stream = iter(stuck)
    next(stream)  # one tensor read, then this reader stops reading
    published = threading.Thread(target=feed.publish, args=(2, [(n, t + 1) for n, t in old]))
    published.start()
    published.join(5)
    assert not published.is_alive(), "publish waited for a stalled reader"
    assert [t[0].item() for _, t in fetch(feed.address, 2, KEY, timeout=5)] == [i + 1.0 for i in range(8)]
    stuck._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    stuck.close()  # dies: with SO_LINGER 0 the close is a reset, as when the kernel reaps a killed process
    feed.publish(3, old)
    assert [t[0].item() for _, t in fetch(feed.address, 3, KEY, timeout=5)] == [float(i) for i in range(8)]


def test_publish_refuses_what_a_feed_cannot_carry(feed):
    with pytest.raises(ValueError, match="published twice"):
        feed.publish(1, [("a", torch.ones(1)), ("a", torch.ones(1))])
    with pytest.raises(ValueError, match="complex64"):
        feed.publish(1, [("a", torch.ones(1, dtype=torch.complex64))])
    assert feed.step is None


def test_feed_error_survives_pickling():
    e = pickle.loads(pickle.dumps(FeedError("h:1", "gone")))
    assert str(e) == "weight feed h:1: gone" and e.address == "h:1"


def test_read_concurrently_hands_over_every_feed_whole_each_in_its_order():
    parts = [[(f"f{i}.t{j}", torch.full((100 + j,), float(10 * i + j))) for j in range(6)] for i in range(3)]
    servers = [FeedServer("127.0.0.1", 0, KEY) for _ in parts]
    try:
        for server, tensors in zip(servers, parts):
            server.publish(2, tensors)
        readers = [FeedReader(s.address, 2, KEY, timeout=10) for s in servers]
        # a bound smaller than one tensor: the pumps hand over one tensor at a time and still finish
        got = list(read_concurrently(readers, ahead_bytes=16))
    finally:
        for server in servers:
            server.close()
    assert sorted(n for n, _ in got) == sorted(n for tensors in parts for n, _ in tensors)
    for i, tensors in enumerate(parts):
        assert [n for n, _ in got if n.startswith(f"f{i}.")] == [n for n, _ in tensors]
    sent = dict(t for tensors in parts for t in tensors)
    assert all(torch.equal(sent[n], t) for n, t in got)


def test_read_concurrently_raises_a_cut_feed_and_stops_the_others():
    header = {"step": 1, "tensors": [["a", "float32", [4], 16], ["b", "float32", [1000], 4000]]}
    address, thread = fake_feed(lambda conn: conn.sendall(json.dumps(header).encode() + b"\n" + bytes(16) + bytes(100)))
    with FeedServer("127.0.0.1", 0, KEY) as healthy:
        healthy.publish(1, [(f"big{j}", torch.zeros(50_000)) for j in range(40)])
        readers = [FeedReader(address, 1, KEY, timeout=10), FeedReader(healthy.address, 1, KEY, timeout=10)]
        before = threading.active_count()
        with pytest.raises(FeedError, match=r"closed the stream during tensor 2 of 2 \(b\)"):
            for _ in read_concurrently(readers, ahead_bytes=400_000):
                pass
        # every pump thread has ended: nothing keeps reading the healthy feed
        assert threading.active_count() <= before
    thread.join(5)


def test_leaving_read_concurrently_early_closes_every_reader():
    with FeedServer("127.0.0.1", 0, KEY) as a, FeedServer("127.0.0.1", 0, KEY) as b:
        for server in (a, b):
            server.publish(3, [(f"{server.address}.{j}", torch.zeros(100_000)) for j in range(20)])
        readers = [FeedReader(s.address, 3, KEY, timeout=10) for s in (a, b)]
        before = threading.active_count()
        stream = read_concurrently(readers, ahead_bytes=400_000)
        next(stream)
        stream.close()
        assert threading.active_count() <= before
        assert all(r._sock.fileno() == -1 for r in readers)


def read_step(feed: FeedServer, step: int, base: Base | None = None) -> tuple[FeedReader, dict[str, torch.Tensor]]:
    reader = FeedReader(feed.address, step, KEY, timeout=10, base=base)
    return reader, dict(reader)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def delta_steps() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two steps whose tensors changed in every way a delta must carry (bitwise changes, whole tensors, masks)."""
    gen = torch.Generator().manual_seed(1)
    step1 = {"w": torch.randn(256, 64, generator=gen).to(torch.bfloat16), "norm": torch.zeros(64),
             "same": torch.randn(32, generator=gen), "ids": torch.arange(10), "mask": torch.tensor([True, False] * 8),
             "dense": torch.randn(1000, generator=gen)}
    step2 = {name: t.clone() for name, t in step1.items()}
    step2["w"].view(-1)[torch.tensor([0, 77, 16383])] = torch.tensor([1.5, -2.0, 3.0], dtype=torch.bfloat16)
    step2["norm"][3] = -0.0                      # bitwise a change, numerically equal
    step2["norm"][5] = float("nan")
    step2["ids"] = torch.arange(10) * 7 + 1      # all changed: sent whole
    step2["mask"][1] = True
    step2["dense"][::3] += 1.0                   # a third changed: a bit mask is smaller than the indices
    return step1, step2


def test_a_reader_holding_the_previous_step_gets_only_what_changed():
    step1, step2 = delta_steps()
    with FeedServer("127.0.0.1", 0, KEY, delta=True) as feed:
        feed.publish(1, sorted(step1.items()))
        first, got1 = read_step(feed, 1)
        assert first.keep and not first.delta
        base = Base(first.id, got1)
        feed.publish(2, sorted(step2.items()))
        whole, _ = read_step(feed, 2)
        second, got2 = read_step(feed, 2, base)
    assert second.delta and not whole.delta
    assert set(got2) == set(step2) and all(same_bits(got2[n], step2[n]) for n in step2)
    assert all(same_bits(got1[n], step1[n]) for n in step1)        # the base was copied, never written
    changed = {m.name: (m.changed, m.form) for m in second.tensors}
    assert changed == {"w": (3, "index"), "norm": (2, "index"), "same": (0, "index"), "ids": (-1, ""),
                       "mask": (1, "mask"), "dense": (334, "mask")}
    assert second.received < whole.received / 20


def test_a_reader_whose_base_is_not_the_feeds_previous_snapshot_gets_the_whole_step():
    with FeedServer("127.0.0.1", 0, KEY, delta=True) as feed:
        feed.publish(1, [("a", torch.zeros(1000))])
        old, got = read_step(feed, 1)
        feed.publish(2, [("a", torch.ones(1000))])
        feed.publish(3, [("a", torch.ones(1000))])
        reader, got3 = read_step(feed, 3, Base(old.id, got))      # holds step 1; the delta is from step 2
        assert not reader.delta and torch.equal(got3["a"], torch.ones(1000))
        restarted = Base("not-this-feeds", {"a": torch.ones(1000)})  # another trainer attempt's "step 2"
        assert not read_step(feed, 3, restarted)[0].delta


def test_a_feed_without_deltas_ignores_a_base():
    with FeedServer("127.0.0.1", 0, KEY) as feed:
        feed.publish(1, [("a", torch.zeros(10))])
        first, got = read_step(feed, 1)
        feed.publish(2, [("a", torch.zeros(10))])
        second, _ = read_step(feed, 2, Base(first.id, got))
    assert not first.keep and not second.keep and not second.delta


def test_a_delta_for_a_tensor_the_reader_does_not_hold_is_refused():
    with FeedServer("127.0.0.1", 0, KEY, delta=True) as feed:
        feed.publish(1, [("a", torch.zeros(100)), ("b", torch.zeros(100))])
        first, got = read_step(feed, 1)
        feed.publish(2, [("a", torch.zeros(100)), ("b", torch.zeros(100))])
        with pytest.raises(FeedError, match="b: a delta for a tensor this reader does not hold as float32 \\[100\\]"):
            FeedReader(feed.address, 2, KEY, timeout=10, base=Base(first.id, {"a": got["a"]}))


def group_of(world: int, rank: int, token: str | None = None, timeout: float = 10.0):
    import os

    from prl.run.api import Group

    return Group(token=token or os.urandom(16).hex(), world=world, rank=rank, timeout=timeout)


def read_in_threads(address: str, step: int, groups: list, bases: list | None = None) -> list:
    """Each group member's reader in a thread of its own (as the workers of servers): its tensors, or its error."""
    got: list = [None] * len(groups)
    bases = bases or [None] * len(groups)

    def member(i: int) -> None:
        try:
            got[i] = list(FeedReader(address, step, KEY, 30, base=bases[i], group=groups[i]))
        except Exception as e:  # noqa: BLE001 - the test looks at it
            got[i] = e

    threads = [threading.Thread(target=member, args=(i,)) for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got


def test_a_group_gets_the_step_by_broadcast_and_is_sent_once():
    """`weights.transport: broadcast`: every member of a group gets every tensor whole from the feed's one
    sender; a feed without groups, a token used again and the same token with another world are refused."""
    tensors = sample_tensors()
    with FeedServer("127.0.0.1", 0, KEY, groups=True, group_timeout=10) as feed:
        feed.publish(4, tensors)
        first = group_of(3, 1)
        got = read_in_threads(feed.address, 4, [first, group_of(3, 2, first.token)])
        for member in got:
            assert [name for name, _ in member] == [name for name, _ in tensors]
            for (_, a), (_, b) in zip(member, tensors):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        assert [(r["step"], r["world"], r.get("error")) for r in feed.group_log] == [(4, 3, None)]
        assert feed.group_log[0]["bytes"] == sum(t.numel() * t.element_size() for _, t in tensors)
        with pytest.raises(FeedError, match="has ended"):
            FeedReader(feed.address, 4, KEY, 30, group=group_of(3, 1, first.token))
        other = msgspec.structs.replace(group_of(2, 1), backend="nccl")  # refused before any GPU is asked for
        with pytest.raises(FeedError, match="this feed's groups are gloo, not nccl"):
            FeedReader(feed.address, 4, KEY, 30, group=other)
    with FeedServer("127.0.0.1", 0, KEY) as plain:
        plain.publish(4, tensors)
        with pytest.raises(FeedError, match="sends to no groups"):
            FeedReader(plain.address, 4, KEY, 30, group=group_of(2, 1))


def test_a_group_whose_members_all_hold_the_previous_step_gets_the_delta_by_broadcast():
    """`weights.delta` with `broadcast`: the group is sent only what changed when every member kept the feed's
    previous step; one member without it (a restarted server), and every member gets the whole step."""
    step1, step2 = delta_steps()
    step3 = {name: t.clone() for name, t in step2.items()}
    step3["w"].view(-1)[5] = 9.0
    with FeedServer("127.0.0.1", 0, KEY, delta=True, groups=True, group_timeout=20) as feed:
        feed.publish(1, sorted(step1.items()))
        first = group_of(3, 1)
        got1 = read_in_threads(feed.address, 1, [first, group_of(3, 2, first.token)])
        bases = [Base(feed._snapshot.id, dict(member)) for member in got1]
        feed.publish(2, sorted(step2.items()))
        second = group_of(3, 1)
        got2 = read_in_threads(feed.address, 2, [second, group_of(3, 2, second.token)], bases)
        kept = Base(feed._snapshot.id, dict(got2[0]))
        feed.publish(3, sorted(step3.items()))
        third = group_of(3, 1)
        got3 = read_in_threads(feed.address, 3, [third, group_of(3, 2, third.token)], [kept, None])
    for step, got in ((step2, got2), (step3, got3)):
        for member in got:
            assert not isinstance(member, Exception), member
            assert dict(member).keys() == step.keys() and all(same_bits(dict(member)[n], step[n]) for n in step)
    whole = sum(t.numel() * t.element_size() for t in step1.values())
    log = [(r["step"], r["delta"], r.get("error")) for r in feed.group_log]
    assert log == [(1, False, None), (2, True, None), (3, False, None)]
    assert feed.group_log[0]["bytes"] == feed.group_log[2]["bytes"] == whole
    assert feed.group_log[1]["bytes"] < whole / 20
    assert all(same_bits(bases[0].tensors[n], step1[n]) for n in step1)  # a base is copied, never written


def test_a_group_forming_when_the_trainer_publishes_still_gets_the_step_it_began_on():
    """The trainer may publish step 5 while a group for step 4 forms: its late member still gets step 4 (the
    group completes rather than stalling its first members for the timeout); a new group or a pull is refused."""
    step4, step5 = sample_tensors(), [(name, t + 1) for name, t in sample_tensors()]
    with FeedServer("127.0.0.1", 0, KEY, groups=True, group_timeout=20) as feed:
        feed.publish(4, step4)
        early = group_of(3, 1)
        got: list = [None, None]
        first = threading.Thread(target=lambda: got.__setitem__(0, read_in_threads(feed.address, 4, [early])[0]))
        first.start()
        sender = f"prl-feed-group-{early.token[:8]}"
        deadline = time.monotonic() + 20
        while not any(t.name == sender for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)
        feed.publish(5, step5)
        late = group_of(3, 2, early.token)
        got[1] = read_in_threads(feed.address, 4, [late])[0]
        first.join(60)
        for member in got:
            assert [(name, torch.equal(a, b)) for (name, a), (_, b) in zip(member, step4)] == [
                (name, True) for name, _ in step4]
        with pytest.raises(FeedError, match="holds step 5, not step 4"):
            FeedReader(feed.address, 4, KEY, 30, group=group_of(2, 1))
        assert [(r["step"], r.get("error")) for r in feed.group_log] == [(4, None)]


def test_a_group_a_member_never_joins_fails_on_every_side_within_its_bound():
    with FeedServer("127.0.0.1", 0, KEY, groups=True, group_timeout=8) as feed:
        feed.publish(1, sample_tensors())
        waiting = group_of(3, 1, timeout=3)  # the member gives up first; the feed's sender 5 s later
        start = time.monotonic()
        got = read_in_threads(feed.address, 1, [waiting])
        assert isinstance(got[0], FeedError) and "did not form within 3 s" in str(got[0])
        with pytest.raises(FeedError, match="is sending step 1 to 3 members, not step 1 to 4"):
            FeedReader(feed.address, 1, KEY, 30, group=group_of(4, 1, waiting.token))
        while not feed.group_log:
            assert time.monotonic() - start < 30, "the feed's sender is still waiting"
            time.sleep(0.1)
        assert "error" in feed.group_log[0] and feed.group_log[0]["bytes"] == 0


def test_members_waiting_for_the_rest_of_a_delta_group_give_up_at_the_feeds_bound():
    """Members holding the base wait at the feed for the others before it tells them delta or whole: a member
    that never comes fails them within the group timeout, with the reason."""
    step1, step2 = delta_steps()
    with FeedServer("127.0.0.1", 0, KEY, delta=True, groups=True, group_timeout=3) as feed:
        feed.publish(1, sorted(step1.items()))
        base = Base(feed._snapshot.id, step1)
        feed.publish(2, sorted(step2.items()))
        start = time.monotonic()
        got = read_in_threads(feed.address, 2, [group_of(3, 1)], [base])
        assert isinstance(got[0], FeedError) and "not all 2 members asked within 3 s" in str(got[0])
        assert time.monotonic() - start < 15
        while not feed.group_log:
            assert time.monotonic() - start < 30, "the feed's sender is still waiting"
            time.sleep(0.1)
        assert "error" in feed.group_log[0] and feed.group_log[0]["bytes"] == 0


MEMBER_THAT_DIES = """
import os, sys
from prl.run.api import Group
from prl.weights.feed import FeedReader
reader = FeedReader(sys.argv[1], 1, b"run-key", 30, group=Group(token=sys.argv[2], world=3, rank=2, timeout=5.0))
for i, _ in enumerate(reader):
    if i == 1:
        os._exit(3)
"""


def test_a_member_that_dies_mid_broadcast_fails_the_others_within_the_bound():
    """A server's worker killed in the middle of a broadcast: the feed's sender and the other member end with an
    error within the group's timeout, never hang (their update fails; the orchestrator then reads the feeds)."""
    import subprocess
    import sys

    tensors = [(f"t{i}", torch.full((1 << 20,), float(i))) for i in range(8)]
    with FeedServer("127.0.0.1", 0, KEY, groups=True, group_timeout=5) as feed:
        feed.publish(1, tensors)
        survivor = group_of(3, 1, timeout=5)
        dying = subprocess.Popen([sys.executable, "-c", MEMBER_THAT_DIES, feed.address, survivor.token])
        start = time.monotonic()
        got = read_in_threads(feed.address, 1, [survivor])
        assert dying.wait(60) == 3
        assert isinstance(got[0], FeedError) and survivor.token[:8] in str(got[0]), got[0]
        assert time.monotonic() - start < 60
        while not feed.group_log:
            assert time.monotonic() - start < 60, "the feed's sender is still sending"
            time.sleep(0.1)
        assert "error" in feed.group_log[0]


def outsider(address: str):
    """A process that reaches a feed's rendezvous store and holds no key: a plain TCPStore client."""
    import datetime

    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10))


def test_a_process_reaching_a_group_s_store_learns_no_token_and_the_group_still_forms():
    """The store answers anyone: listed, its keys and values name neither the token nor anything the run's key
    does not hide (an HMAC prefix, MAC'd addresses), while the group forms through it as before."""
    tensors = sample_tensors()
    with FeedServer("127.0.0.1", 0, KEY, groups=True, group_timeout=10) as feed:
        feed.publish(4, tensors)
        first = group_of(3, 1)
        got = read_in_threads(feed.address, 4, [first, group_of(3, 2, first.token)])
        assert all([name for name, _ in member] == [name for name, _ in tensors] for member in got), got
        seen = outsider(feed.store_address)
        names = [name for name in seen.list_keys() if name.startswith("prl-weights/")]
        assert len(names) >= 3, names  # every member's rendezvous value is there to read
        held = b"".join(name.encode() + seen.get(name) for name in names)
        assert first.token.encode() not in held and first.token[:8].encode() not in held, names


@pytest.mark.parametrize("forge", ["an address", "a member's own value moved", "a flood"])
def test_a_value_no_member_wrote_is_refused_with_the_reason(forge):
    """A process writes where a member reads the feed's address: the member refuses it, within moments and with
    the reason, and never connects where it says (gloo would otherwise dial it)."""
    from prl.weights import collective

    store = collective.store("127.0.0.1", 10)
    member = group_of(2, 1, timeout=10)
    seen = outsider(f"127.0.0.1:{store.port}")
    result: list = []
    joining = threading.Thread(target=lambda: result.append(_join_or_error(member, store.port)))
    joining.start()
    prefix = collective.store_prefix(KEY, member.token)
    deadline = time.monotonic() + 10
    while not (mine := [n for n in seen.list_keys() if n.startswith(prefix)]):
        assert time.monotonic() < deadline, "the member never wrote its address"
        time.sleep(0.02)
    feeds_key = mine[0][:-1] + "0"  # gloo's key of rank 0's address, beside rank 1's
    forged = {"an address": b"127.0.0.1:9", "a member's own value moved": seen.get(mine[0]),
              "a flood": b"x" * (1 << 20)}[forge]
    seen.set(feeds_key, forged)
    joining.join(30)
    assert isinstance(result[0], collective.StoreRefused), result
    assert repr(feeds_key) in str(result[0]) and "a process that is not a member wrote it" in str(result[0])
    assert ("over the 65536" if forge == "a flood" else "no valid MAC under the run's key") in str(result[0])


def _join_or_error(group, port: int):
    from prl.weights import collective

    try:
        return collective.join(group, "127.0.0.1", f"127.0.0.1:{port}", KEY)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return e


def test_the_fanout_benchmark_delivers_the_whole_step_or_each_receivers_slices():
    """bench/bench_weight_fanout.py checks that every receiver got the step's bytes, pulled and by a group, and
    its own slices' bytes when it names its place, pulled and by its place's group."""
    import subprocess
    import sys

    from tests.helpers import REPO

    done = subprocess.run([sys.executable, "bench/bench_weight_fanout.py", "--mb", "4", "--receivers", "2",
                           "--repeats", "1"], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    row = [fields for fields in map(str.split, done.stdout.splitlines()) if fields[:1] == ["2"] and len(fields) == 10]
    assert len(row) == 1 and all(r.endswith("x") and float(r[:-1]) > 0 for r in row[0][5:8]), done.stdout
    whole_mb, slice_mb = int(row[0][8]), int(row[0][9])
    assert slice_mb < 0.75 * whole_mb, done.stdout  # tp 2: each receiver took about half


# ---------------------------------------------------------------- slices: a worker gets what it keeps

CONFIG = {"model_type": "qwen3_moe", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_size": 32, "vocab_size": 100,
          "num_experts": 4}


def model_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """A layer of a Qwen3-MoE-shaped checkpoint: attention, experts, norms, the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (100, 32), "model.layers.0.self_attn.q_proj.weight": (32, 32),
              "model.layers.0.self_attn.k_proj.weight": (16, 32), "model.layers.0.self_attn.o_proj.weight": (32, 32),
              "model.layers.0.mlp.gate.weight": (4, 32), "model.norm.weight": (32,),
              **{f"model.layers.0.mlp.experts.{e}.{p}.weight": (8, 32) if p != "down_proj" else (32, 8)
                 for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}}
    return [(name, torch.randn(shape, generator=gen)) for name, shape in shapes.items()]


def sliced_read(feed: FeedServer, step: int, worker, base=None) -> FeedReader:
    reader = FeedReader(feed.address, step, KEY, 10, base, worker=worker)
    reader.got = dict(reader)
    return reader


@pytest.mark.parametrize("worker", [dict(tp=2, tp_rank=1), dict(tp=4, tp_rank=2), dict(tp=2, tp_rank=0, dp=2,
                                    dp_rank=1, expert_parallel=True)])
def test_a_worker_that_names_its_place_receives_its_slices_each_in_a_tensor_of_the_checkpoint_s_shape(worker):
    from prl.weights.slices import Worker, narrow, slice_plan, worker_numel

    place = Worker(**worker)
    tensors = model_tensors()
    layout = {n: tuple(t.shape) for n, t in tensors}
    plan = slice_plan(CONFIG, layout, place)
    with FeedServer("127.0.0.1", 0, KEY, config=CONFIG) as feed:
        feed.publish(1, tensors)
        reader = sliced_read(feed, 1, place)
    assert reader.received == 4 * worker_numel(plan, layout) < 4 * sum(t.numel() for _, t in tensors)
    for name, t in tensors:
        got = reader.got[name]
        assert got.shape == t.shape, name  # vLLM's loaders take checkpoint shapes
        assert torch.equal(narrow(got, plan[name]), narrow(t, plan[name])), name
    if place.expert_parallel:  # ep over dp 2 x tp 2: rank 2 of 4 holds expert 2 only, whole
        sent = {m.name: m.shape for m in reader.tensors}
        assert [sent[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] for e in range(4)] == [
            (0, 32), (0, 32), (8, 32), (0, 32)]


def test_a_sliced_delta_rebuilds_the_worker_s_slices_from_the_slices_it_kept():
    from prl.weights.slices import Worker, narrow, slice_plan

    place = Worker(tp=2, tp_rank=1)
    first = model_tensors()
    second = [(n, t.clone()) for n, t in first]
    for _, t in second:
        t.view(-1)[::7] += 1  # a sparse update, as bf16 RL steps are
    with FeedServer("127.0.0.1", 0, KEY, delta=True, config=CONFIG) as feed:
        feed.publish(1, first)
        one = sliced_read(feed, 1, place)
        feed.publish(2, second)
        two = sliced_read(feed, 2, place, base=Base(one.id, one.pieces))
        whole = sliced_read(feed, 2, place)  # a worker without the base: the slices whole
    assert two.delta and two.received < whole.received
    plan = slice_plan(CONFIG, {n: tuple(t.shape) for n, t in second}, place)
    for name, t in second:
        assert torch.equal(narrow(two.got[name], plan[name]), narrow(t, plan[name])), name
        assert torch.equal(two.pieces[name], whole.pieces[name]), name


def test_a_group_sends_its_members_their_slices_and_refuses_a_member_of_another_place():
    from prl.weights.slices import Worker, narrow, slice_plan

    place, other = Worker(tp=2, tp_rank=1), Worker(tp=2, tp_rank=0)
    tensors = model_tensors()
    plan = slice_plan(CONFIG, {n: tuple(t.shape) for n, t in tensors}, place)
    with FeedServer("127.0.0.1", 0, KEY, groups=True, group_timeout=10, config=CONFIG) as feed:
        feed.publish(1, tensors)
        group = group_of(2, 1)
        reader = FeedReader(feed.address, 1, KEY, 10, group=group, worker=place)
        with pytest.raises(FeedError, match="sends other slices than this reader keeps"):
            FeedReader(feed.address, 1, KEY, 10, group=group_of(2, 1, token=group.token), worker=other)
        got = dict(reader)
    for name, t in tensors:
        assert torch.equal(narrow(got[name], plan[name]), narrow(t, plan[name])), name
    assert feed.group_log[-1]["bytes"] == reader.received


# -- connections before authentication: bounded in number, time and log lines

def _greeting(sock: socket.socket) -> bytes:
    return sock.makefile("rb").readline()


def test_workers_connecting_at_once_while_the_feed_cannot_accept_all_get_their_greeting(feed):
    feed.publish(1, sample_tensors())
    feed._server.shutdown()  # the accept loop stops, the socket still listens: what a busy feed looks like
    host, port = feed.address.split(":")
    socks = [socket.create_connection((host, int(port)), timeout=2) for _ in range(64)]  # the accept queue holds them
    try:
        again = threading.Thread(target=feed._server.serve_forever, daemon=True)
        again.start()
        for s in socks:
            s.settimeout(10)
            assert _greeting(s).startswith(b"prl-feed 1 ")
    finally:
        for s in socks:
            s.close()
    assert [n for n, _ in fetch(feed.address, 1, KEY)] == [n for n, _ in sample_tensors()]
    feed._server.shutdown()
    feed._thread = again  # what close() joins


def test_peers_that_never_authenticate_hold_few_threads_for_a_short_time(feed, monkeypatch, prl_caplog):
    from prl.weights import feed as feed_module

    monkeypatch.setattr(feed_module, "AUTH_TIMEOUT_S", 1.0)
    monkeypatch.setattr(feed_module, "MAX_PENDING", 8)
    feed.publish(1, sample_tensors())
    host, port = feed.address.split(":")
    before = threading.active_count()
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(40)]
    slow = socket.create_connection((host, int(port)), timeout=5)
    try:
        time.sleep(0.3)
        assert threading.active_count() - before <= 8, "a thread per idle connection, past MAX_PENDING"
        greeted = [s for s in idle if s.recv(1)]  # the ones past the cap were closed at accept: no greeting
        assert len(greeted) <= 8
        start = time.monotonic()
        for _ in range(10):  # a byte at a time never ends its line: the deadline is the whole line's
            try:
                slow.sendall(b" ")
            except OSError:
                break
            time.sleep(0.2)
        for s in [*greeted, slow]:
            s.settimeout(5)
            while True:
                try:
                    if not s.recv(4096):
                        break
                except ConnectionResetError:
                    break
        assert time.monotonic() - start < 4, "closed at the authentication deadline, not SEND_TIMEOUT_S"
    finally:
        for s in [*idle, slow]:
            s.close()
    assert [n for n, _ in fetch(feed.address, 1, KEY)] == [n for n, _ in sample_tensors()]
    warnings = [r for r in prl_caplog.records if r.name == "prl.weights.feed"]
    assert 1 <= len(warnings) <= 2, [r.getMessage() for r in warnings]


@pytest.mark.parametrize("line", [json.dumps({"step": 1, "mac": "é" * 64}, ensure_ascii=False).encode(),
                                  b"[" * 100_000, b'{"step": 1, "mac": "' + b"0" * 64 + b'", "group": ' + b"[" * 4000,
                                  b"\xff\xfe"], ids=["non-ascii mac", "deep", "deep in a field", "not utf-8"])
def test_a_malformed_request_is_answered_and_logged_once_for_many(feed, prl_caplog, capfd, line):
    feed.publish(1, sample_tensors())
    host, port = feed.address.split(":")
    for _ in range(20):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            _greeting(s)
            s.sendall(line[:4000] + b"\n")
            assert json.loads(s.makefile("rb").readline()) == {"error": "authentication failed: wrong key"}
    assert "Traceback" not in capfd.readouterr().err
    assert len([r for r in prl_caplog.records if r.name == "prl.weights.feed"]) == 1


def test_an_error_a_connection_raises_is_one_log_line_not_a_traceback_each(feed, monkeypatch, prl_caplog, capfd):
    from prl.weights import feed as feed_module

    def broken(line):
        raise KeyError("a bug in the request parser")

    monkeypatch.setattr(feed_module, "read_request", broken)
    host, port = feed.address.split(":")
    for _ in range(20):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            _greeting(s)
            s.sendall(b"{}\n")
            assert s.recv(100) == b""
    time.sleep(0.2)
    assert "Traceback" not in capfd.readouterr().err
    [line] = [r.getMessage() for r in prl_caplog.records if r.name == "prl.weights.feed"]
    assert "failed: KeyError" in line
