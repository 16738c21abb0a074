"""Caller channels (:mod:`hoplite_gpu.node.channel`): a blocking put or get of an object the
directory stores inline goes on the caller thread's own connection, and everything else (large
objects, a lost channel, a restarted directory) through the node's connection as before."""

from __future__ import annotations

import shutil
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu.auth import new_token
from hoplite_gpu.directory import DirectoryProcess
from hoplite_gpu.directory import service as service_module
from tests.procs import start_workers, wait_for_events

pytestmark = pytest.mark.timeout(120)

SMALL = np.arange(256, dtype=np.float32)  # 1 KiB: stored inline


def _open_channels(node: Any) -> int:
    return len(node._channels._open)


def _pending(node: Any) -> int:
    return sum(len(q) for q in node._embedded.state.lookups.pending.values())


def _until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``condition`` until it holds (fails after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.01)  # polling a condition with a deadline, not synchronisation


def _in_thread(work: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = work()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.fixture
def node() -> Iterator[Any]:
    n = hg.init()
    yield n
    n.close()


@pytest.fixture
def other(node: Any) -> Iterator[Any]:
    """A second node on ``node``'s directory."""
    n = hg.connect(node.directory_address, token=node.token)
    yield n
    n.close()


def test_a_small_put_and_get_go_on_the_callers_channel(node: Any, other: Any) -> None:
    oid = node.put(SMALL)
    assert node.contains(oid)  # in the store by the time put returns
    assert _open_channels(node) == 1
    got = other.get(oid, timeout=10)
    assert np.array_equal(got, SMALL) and not got.flags.writeable
    assert _open_channels(other) == 1
    out = np.zeros_like(SMALL)
    assert other.get(oid, timeout=10, out=out) is out and np.array_equal(out, SMALL)
    kinds = [e["kind"] for e in node.event_log()]
    assert kinds.count("lookup_inline") == 2
    assert node.delete(oid)
    assert not node.contains(oid)
    with pytest.raises(hg.ObjectDeletedError):
        other.get(oid, timeout=10)


def test_a_get_waits_on_its_channel_for_a_later_put(node: Any) -> None:
    oid = hg.ObjectID.random()
    thread, out = _in_thread(lambda: (node.get(oid, timeout=30), _open_channels(node)))
    wait_for_events(node, lambda evs: any(e["kind"] == "lookup" for e in evs))
    node.put(SMALL * 2, oid)
    thread.join(30)
    got, channels = out["value"]
    assert np.array_equal(got, SMALL * 2)
    assert channels == 2  # one per thread


def test_a_get_on_a_channel_times_out_with_the_directorys_reason(node: Any) -> None:
    oid = hg.ObjectID.random()
    with pytest.raises(hg.HopliteTimeoutError, match=r"within 0\.3 s: no node has put it"):
        node.get(oid, timeout=0.3)
    assert _pending(node) == 0


def test_a_large_object_is_pulled_through_the_nodes_connection(node: Any, other: Any) -> None:
    big = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: not inline
    oid = node.put(big)
    assert np.array_equal(other.get(oid, timeout=30), big)
    assert other.contains(oid)  # pulled into its store
    kinds = [e["kind"] for e in node.event_log()]
    # One lookup, on the channel; its answer (a pull) is carried out by the I/O thread.
    assert kinds.count("lookup") == 1 and "transfer_start" in kinds
    assert _open_channels(other) == 1


def test_a_conflicting_put_on_a_channel_is_refused_and_not_kept(node: Any, other: Any) -> None:
    oid = node.put(SMALL)
    assert node.put(SMALL, oid) == oid  # the same put again
    with pytest.raises(hg.ObjectExistsError):
        other.put(SMALL + 1, oid)
    assert not other.contains(oid)
    assert np.array_equal(other.get(oid, timeout=10), SMALL)


def test_without_caller_channels_every_request_goes_through_the_node(node: Any) -> None:
    plain = hg.connect(node.directory_address, token=node.token, caller_channels=False)
    try:
        oid = plain.put(SMALL)
        assert np.array_equal(plain.get(oid, timeout=10), SMALL)
        assert np.array_equal(node.get(oid, timeout=10), SMALL)
        assert _open_channels(plain) == 0
    finally:
        plain.close()


def test_a_channel_closed_under_a_waiting_get_hands_it_to_the_node(node: Any) -> None:
    oid = hg.ObjectID.random()
    thread, out = _in_thread(lambda: node.get(oid, timeout=60))
    wait_for_events(node, lambda evs: any(e["kind"] == "lookup" for e in evs))
    node._channels.reset()  # as when the node loses its directory
    # The directory withdraws the channel's lookup; the get asks again through the node.
    wait_for_events(node, lambda evs: sum(e["kind"] == "lookup" for e in evs) == 2)
    _until(lambda: _pending(node) == 1)
    node.put(SMALL, oid)
    thread.join(30)
    assert np.array_equal(out["value"], SMALL)


def test_channels_beyond_a_nodes_share_are_refused(node: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service_module, "MAX_CHANNELS_PER_NODE", 1)
    oid = node.put(SMALL)
    thread, out = _in_thread(lambda: node.get(oid, timeout=10))
    thread.join(30)
    assert np.array_equal(out["value"], SMALL)  # through the node's connection
    assert _open_channels(node) == 1


def test_a_get_waiting_on_a_channel_survives_a_directory_restart() -> None:
    directory = DirectoryProcess(new_token())
    directory.start()
    try:
        node = hg.connect(directory.address, token=directory.token)
        putter = start_workers(directory.address, directory.token, 1)[0]
        try:
            oid = hg.ObjectID.random()
            thread, out = _in_thread(lambda: node.get(oid, timeout=90))
            wait_for_events(node, lambda evs: any(e["kind"] == "lookup" for e in evs))
            directory.kill()
            directory.start()
            putter.call("put_array", SMALL, oid.hex())
            thread.join(90)
            assert "error" not in out, out.get("error")
            assert np.array_equal(out["value"], SMALL)
            assert np.array_equal(node.get(oid, timeout=30), SMALL)  # on a new channel
        finally:
            putter.kill()
            node.close()
    finally:
        directory.kill()


def test_a_threads_channel_closes_when_the_thread_ends(node: Any) -> None:
    oid = node.put(SMALL)
    thread, out = _in_thread(lambda: node.get(oid, timeout=10))
    thread.join(30)
    assert np.array_equal(out["value"], SMALL)
    service = node._embedded
    _until(lambda: _open_channels(node) == 1)  # the main thread's
    _until(lambda: len(service._channels.get(node.node_id, [])) == 1)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_channels_to_a_tls_directory_use_tls(tmp_path: Any) -> None:
    from tests.test_hardening import _self_signed

    cert, key = _self_signed(tmp_path, "directory")
    node = hg.init(tls_cert_file=cert, tls_key_file=key, tls_ca_file=cert)
    try:
        oid = node.put(SMALL)
        assert _open_channels(node) == 1
        assert np.array_equal(node.get(oid, timeout=10), SMALL)
        chan = next(iter(node._channels._open))
        assert isinstance(chan.sock, ssl.SSLSocket)
    finally:
        node.close()


def test_a_channel_to_a_directory_of_this_host_takes_its_local_socket(node: Any) -> None:
    tcp = hg.connect(node.directory_address, token=node.token, local_channels=False)
    try:
        oid = node.put(SMALL)
        assert next(iter(node._channels._open)).sock.family == socket.AF_UNIX
        assert np.array_equal(tcp.get(oid, timeout=10), SMALL)
        assert next(iter(tcp._channels._open)).sock.family == socket.AF_INET
        assert len(node._embedded._channels[node.node_id]) == 1
    finally:
        tcp.close()


def test_the_local_socket_authenticates_as_tcp_does(node: Any) -> None:
    from hoplite_gpu import protocol as p

    service = node._embedded
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(p.local_socket_name(service.directory_id))
        assert sock.recv(4096)  # the challenge
        sock.sendall(b"\x00\x00\x00\x03abc")  # not a hello
        assert sock.recv(4096) == b""  # closed
    finally:
        sock.close()
    assert service.auth_failures == 1 and service.handshaking == 0


def test_a_delete_from_a_callers_thread_goes_on_its_channel(
    node: Any, other: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    oid = node.put(SMALL)
    assert np.array_equal(other.get(oid, timeout=10), SMALL)
    through_io: list[Any] = []
    real = node._io.run
    monkeypatch.setattr(node._io, "run", lambda *a, **k: (through_io.append(a), real(*a, **k))[1])
    assert node.delete(oid) is True
    assert through_io == [] and not node.contains(oid)
    assert node.delete(oid) is False  # (made twice: gone already)
    with pytest.raises(hg.ObjectDeletedError):
        other.get(oid, timeout=10)
    # A copy that cannot leave the store from this thread (shared memory) is removed on the
    # node's loop, through its connection.
    large = node.put(np.arange(1 << 18, dtype=np.float32))
    assert node.delete(large) is True and not node.contains(large)
    assert len(through_io) == 1


def test_a_get_on_a_channel_is_not_recorded_as_a_copy(node: Any, other: Any) -> None:
    oid = node.put(SMALL)
    assert np.array_equal(other.get(oid, timeout=10), SMALL)
    assert not other.contains(oid)
    # The reader is not on record as a holder: the owner's delete sends it nothing.
    assert other.node_id not in node._embedded.state.catalog.objects[oid.binary()].locations
    other._io.run(other._fetcher.get(oid, 10.0))  # through the node's connection: kept
    assert other.contains(oid)
    assert other.node_id in node._embedded.state.catalog.objects[oid.binary()].locations


def test_a_barrier_releases_the_objects_of_earlier_collectives(node: Any, other: Any) -> None:
    from hoplite_gpu import collective as coll

    groups = [coll.Group(n, r, 2, "release", timeout=30) for r, n in enumerate((node, other))]
    out = np.zeros_like(SMALL)
    thread, result = _in_thread(lambda: (coll.broadcast(out, 0, groups[1]), coll.barrier(groups[1])))
    coll.broadcast(SMALL.copy(), 0, groups[0])
    [(_, oid)] = groups[0]._owned
    coll.barrier(groups[0])
    # Deleted by the directory before it answered the barrier (not by a request after it),
    # and the root's copy gone when the barrier returns.
    assert oid.binary() not in node._embedded.state.catalog.objects
    assert not node.contains(oid) and groups[0]._owned == []
    thread.join(30)
    assert "error" not in result and np.array_equal(out, SMALL)
    kinds = [e["kind"] for e in node.event_log()]
    assert kinds.count("delete") == 1


def test_a_get_of_an_object_held_here_asks_no_one(node: Any, other: Any) -> None:
    def lookups() -> int:
        return sum(e["kind"].startswith("lookup") for e in node.event_log())

    small, big = SMALL, np.arange(1 << 20, dtype=np.float32)  # 4 MiB: not inline
    ids = [node.put(small), node.put(big)]
    assert lookups() == 0
    assert np.array_equal(node.get(ids[0]), small)
    out = np.zeros_like(big)
    assert node.get(ids[1], out=out) is out and np.array_equal(out, big)
    assert lookups() == 0  # both complete in the store: delivered from the caller's thread
    assert np.array_equal(other.get(ids[1], timeout=10), big)
    assert lookups() == 1
    assert np.array_equal(other.get(ids[1], timeout=10), big)  # its copy is kept: no second lookup
    assert lookups() == 1
    assert node.delete(ids[1])
    _until(lambda: not other.contains(ids[1]))  # its copy there is dropped too
    with pytest.raises(hg.ObjectDeletedError):
        other.get(ids[1], timeout=10)


def test_an_object_at_the_inline_threshold_comes_whole_over_a_channel(
    node: Any, other: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hoplite_gpu.node import channel

    monkeypatch.setattr(channel, "READ_BYTES", 1000)  # a frame over 1000 bytes takes two receives or more
    largest = np.random.default_rng(7).integers(0, 255, node.config.inline_threshold_bytes, np.uint8)
    ids = [node.put(largest), node.put(SMALL)]
    assert _open_channels(node) == 1
    for _ in range(3):  # (a reader keeps no copy of an inline object: it asks each time)
        assert np.array_equal(other.get(ids[0], timeout=10), largest)
        assert np.array_equal(other.get(ids[1], timeout=10), SMALL)
    kinds = [e["kind"] for e in node.event_log()]
    assert kinds.count("lookup_inline") == 6
