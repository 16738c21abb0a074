"""API behaviour in one process (embedded directory): bad input, typed errors, auth, CLI."""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu import protocol as p
from hoplite_gpu.config import Config
from hoplite_gpu.dataplane import make_data_plane
from hoplite_gpu.memory.buffers import Buffer
from hoplite_gpu.memory.store import LocalObject, LocalStore

pytestmark = pytest.mark.timeout(60)


def test_object_id_forms() -> None:
    a = hg.ObjectID.from_name("weights/step-7")
    assert a == hg.ObjectID.from_name("weights/step-7") != hg.ObjectID.from_name("weights/step-8")
    assert hg.ObjectID.from_bytes(a.binary()) == a == hg.ObjectID.from_hex(a.hex())
    assert pickle.loads(pickle.dumps(a)) == a
    assert hg.ObjectID.random() != hg.ObjectID.random()
    with pytest.raises(hg.InvalidArgumentError):
        hg.ObjectID.from_bytes(b"short")


def test_errors_pickle_with_fields() -> None:
    err = hg.HopliteTimeoutError("late", operation="get", timeout=1.5, object_id="ab")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, hg.HopliteTimeoutError) and isinstance(back, TimeoutError)
    assert (back.operation, back.timeout, str(back)) == ("get", 1.5, "late")


def test_put_get_local_roundtrip_and_readonly(owner: Any) -> None:
    arr = np.arange(100_000, dtype=np.float64).reshape(100, 1000)
    oid = owner.put(arr, hg.ObjectID.from_name("local-roundtrip"))
    got = owner.get(oid, timeout=5)
    assert got.dtype == arr.dtype and got.shape == arr.shape and np.array_equal(got, arr)
    with pytest.raises(ValueError):
        got[0, 0] = 1.0
    out = np.empty_like(arr)
    assert owner.get(oid, out=out) is out and np.array_equal(out, arr)
    with pytest.raises(hg.InvalidArgumentError):
        owner.get(oid, out=np.empty((3,), np.float64))
    owner.delete(oid)


@pytest.mark.parametrize("n", [1000, 3 << 20])  # small, and above the chunked-copy size
def test_a_put_without_a_copy_keeps_the_callers_memory_unless_it_must_copy(owner: Any, n: int) -> None:
    arr = np.arange(n, dtype=np.float32)
    oid = owner.put(arr, copy=False)  # this suite's nodes have no shared memory: nothing to map
    got = owner.get(oid, timeout=5)
    assert np.shares_memory(got, arr) and np.array_equal(got, arr)
    strided = np.arange(2 * n, dtype=np.float32)[::2]  # not contiguous: copied all the same
    other = owner.put(strided, copy=False)
    kept = owner.get(other, timeout=5)
    assert not np.shares_memory(kept, strided) and np.array_equal(kept, strided)
    owner.delete(oid)
    owner.delete(other)


def test_unknown_object_times_out_typed(owner: Any) -> None:
    with pytest.raises(hg.HopliteTimeoutError) as info:
        owner.get(hg.ObjectID.random(), timeout=0.3)
    assert info.value.operation == "get"


def test_get_async_twin(owner: Any) -> None:
    arr = np.arange(50_000, dtype=np.int32)

    async def flow() -> np.ndarray[Any, Any]:
        oid = await owner.put_async(arr)
        return await owner.get_async(oid, timeout=5)  # type: ignore[no-any-return]

    assert np.array_equal(asyncio.run(flow()), arr)


def test_put_conflicting_content_is_typed(owner: Any) -> None:
    oid = hg.ObjectID.from_name("conflict")
    owner.put(np.zeros(1000, np.float32), oid)
    owner.put(np.zeros(1000, np.float32), oid)  # same content: idempotent
    with pytest.raises(hg.ObjectExistsError):
        owner.put(np.ones(1000, np.float32), oid)
    other = hg.connect(owner.directory_address, token=owner.token)
    try:
        with pytest.raises(hg.ObjectExistsError):
            other.put(np.ones(1000, np.float32), oid)  # detected by the directory
    finally:
        other.close()
    owner.delete(oid)


def test_bad_puts_are_typed(owner: Any) -> None:
    with pytest.raises(hg.InvalidArgumentError):
        owner.put([1, 2, 3])
    with pytest.raises(hg.InvalidArgumentError):
        owner.put(np.array([object()], dtype=object))
    with pytest.raises(hg.InvalidArgumentError):
        owner.get("not-an-id")
    small = hg.connect(owner.directory_address, token=owner.token, max_object_bytes=1024)
    try:
        with pytest.raises(hg.ObjectTooLargeError):
            small.put(np.zeros(2048, np.uint8))
    finally:
        small.close()


def test_closed_node_raises() -> None:
    node = hg.init()
    node.close()
    node.close()  # idempotent
    with pytest.raises(hg.NodeClosedError):
        node.put(np.zeros(4))


def test_calls_waiting_on_a_node_that_closes_fail_as_closed(owner: Any) -> None:
    """A get and a collective waiting in other threads when their node closes raise
    NodeClosedError, not the directory connection's error."""
    node = hg.connect(owner.directory_address, token=owner.token)
    group = hg.collective.Group(node, 0, 2, "closing", timeout=30)
    failed: dict[str, BaseException] = {}

    def wait(name: str, call: Any) -> None:
        try:
            call()
        except BaseException as exc:
            failed[name] = exc

    threads = [
        threading.Thread(
            target=wait, args=("get", lambda: node.get(hg.ObjectID.from_name("never"), timeout=30))
        ),
        threading.Thread(target=wait, args=("barrier", lambda: hg.collective.barrier(group))),
    ]
    for t in threads:
        t.start()
    deadline, never = time.monotonic() + 20, hg.ObjectID.from_name("never").hex()
    while not ((now := owner.directory_summary())["barriers"] and never in now["lookups"]):
        assert time.monotonic() < deadline, "the calls never reached the directory"
    node.close()
    for t in threads:
        t.join(20)
    assert {k: type(v) for k, v in failed.items()} == {
        "get": hg.NodeClosedError,
        "barrier": hg.NodeClosedError,
    }


def test_wrong_token_refused_and_directory_keeps_serving(owner: Any) -> None:
    with pytest.raises(hg.AuthenticationError):
        hg.connect(owner.directory_address, token="not-the-token")
    events = owner.event_log()
    assert any(e["kind"] == "auth_failed" for e in events)
    oid = owner.put(np.arange(10))
    assert np.array_equal(owner.get(oid, timeout=5), np.arange(10))


def test_malformed_and_oversized_frames_close_only_that_connection(owner: Any) -> None:
    host, port = owner.directory_address.rsplit(":", 1)
    for payload in (b"\xff" * 64, struct.pack(">I", 1 << 30) + b"x"):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.recv(4096)  # the challenge
            s.sendall(payload)
            s.settimeout(5)
            assert s.recv(4096) == b""  # closed by the directory
    oid = owner.put(np.arange(20))
    assert np.array_equal(owner.get(oid, timeout=5), np.arange(20))


def test_data_plane_refuses_wrong_token(owner: Any) -> None:
    from hoplite_gpu.iothread import IOThread

    host, port = owner.data_address.rsplit(":", 1)
    before = owner.stats()["data_auth_failures"]

    async def attempt() -> None:
        plane = make_data_plane(LocalStore(1 << 20), "wrong-token", Config(connect_timeout=5))
        obj = LocalObject(hg.ObjectID.random(), 8, "<i8", (1,), b"", Buffer.wrap(np.empty(8, np.uint8)))
        try:
            await plane.pull(host, int(port), obj, transfer_id=1)
        finally:
            await plane.close()

    with pytest.raises(hg.AuthenticationError):
        IOThread.get().run(attempt(), timeout=30)
    assert owner.stats()["data_auth_failures"] == before + 1


def test_protocol_rejects_bad_messages() -> None:
    import msgpack

    with pytest.raises(hg.ProtocolError):
        p.decode(msgpack.packb([p.PROTOCOL_VERSION, "lookup", {"request_id": "x"}]))
    with pytest.raises(hg.ProtocolError):
        p.decode(msgpack.packb([99, "lookup", {}]))
    with pytest.raises(hg.ProtocolError):
        p.frame_length(struct.pack(">I", 10_000), limit=100)
    msg = p.LookupRequest(request_id=1, object_id=b"a" * 20, timeout=1.5)
    assert p.decode(p.encode(msg)[4:]) == msg


def test_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOPLITE_CHUNK_BYTES", "1048576")
    monkeypatch.setenv("HOPLITE_VERIFY_DIGEST", "true")
    cfg = Config.from_env(chunks_in_flight=2)
    assert (cfg.chunk_bytes, cfg.verify_digest, cfg.chunks_in_flight) == (1 << 20, True, 2)
    with pytest.raises(hg.InvalidArgumentError):
        Config(chunk_bytes=0)


def test_advertised_data_address_follows_the_route_to_the_directory() -> None:
    assert Config().data_host("127.0.0.1:7070") == "127.0.0.1"  # loopback directory: loopback
    assert Config(listen_host="0.0.0.0").data_host("127.0.0.1:7070") == "127.0.0.1"  # wildcard: route
    assert Config(listen_host="10.9.9.9").data_host("127.0.0.1:7070") == "10.9.9.9"
    assert Config(listen_host="10.9.9.9", advertise_host="node7").data_host("127.0.0.1:7070") == "node7"
    assert Config().directory_host == "127.0.0.1"  # an embedded directory stays on loopback
    with pytest.raises(hg.DirectoryUnavailableError, match="HOPLITE_ADVERTISE_HOST"):
        hg.connect("no such host:7070", token="x" * 32)


def test_standalone_directory_command() -> None:
    env = dict(os.environ, HOPLITE_TOKEN="cli-token-0123456789")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hoplite_gpu.cli", "directory", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line
        address = line.rsplit(" ", 1)[1].strip()
        a = hg.connect(address, token="cli-token-0123456789")
        b = hg.connect(address, token="cli-token-0123456789")
        try:
            oid = a.put(np.arange(300_000, dtype=np.int64))  # 2.4 MB, through the data plane
            assert np.array_equal(b.get(oid, timeout=30), np.arange(300_000))
        finally:
            a.close()
            b.close()
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_event_log_longer_than_a_page_arrives_whole(owner: Any) -> None:
    from hoplite_gpu.protocol import EVENT_LOG_PAGE

    start = owner.event_log()[-1]["seq"]
    for i in range(EVENT_LOG_PAGE // 2 + 10):  # a put and a delete each log an event at least
        owner.delete(owner.put(np.full(2, i)))
    events = owner.event_log(start)
    assert len(events) > EVENT_LOG_PAGE
    assert [e["seq"] for e in events] == list(range(start, start + len(events)))


def test_the_methods_for_libraries_built_on_the_node(owner: Any) -> None:
    """The node's methods below its object API (:mod:`hoplite_gpu.node.primitives`), in one process."""
    lent = owner.put(np.arange(4.0), copy=False, borrow=True, digest=False)
    owner.barrier(hg.ObjectID.from_name("api/barrier/1"), 0, 1, release=[lent])
    assert owner.delete(lent) is False  # the directory deleted it as every member came
    with pytest.raises(hg.HopliteTimeoutError) as raised:
        owner.barrier(hg.ObjectID.from_name("api/barrier/2"), 0, 2, timeout=0.2)
    assert raised.value.waiting == 1 and raised.value.waiting_for_ranks == [1]
    with pytest.raises(hg.InvalidArgumentError):
        owner.barrier(hg.ObjectID.from_name("api/barrier/3"), 2, 2)
    with pytest.raises(hg.InvalidArgumentError):
        owner.barrier(b"not an id", 0, 1)

    a, b = owner.put(np.ones(4)), owner.put(np.ones(4))
    rid = owner.reduce([a, b])
    assert owner.requested_reduction(rid) and not owner.requested_reduction(a)
    np.testing.assert_array_equal(owner.get(rid, timeout=10), np.full(4, 2.0))

    async def withdraw() -> list[Any]:
        return owner.withdraw([a, hg.ObjectID.random()])

    [withdrawn] = owner.io.run(withdraw())
    assert isinstance(withdrawn.error, hg.ObjectDeletedError) and not owner.contains(a)
    for oid in (rid, a, b):
        owner.delete(oid)
    calls: list[int] = []

    def rejoined() -> None:
        calls.append(1)

    owner.add_rejoin_callback(rejoined)  # (not called: the directory does not restart here)
    owner.remove_rejoin_callback(rejoined)
    owner.remove_rejoin_callback(rejoined)  # no-op
    assert calls == []


def test_host_torch_tensors_in_bfloat16_are_put_and_reduced_and_float8_refused(owner: Any) -> None:
    """NumPy has no bfloat16: a host torch tensor of it is put as ml_dtypes' bfloat16 over the
    same bytes (a non-contiguous one too), and reduced as such; a dtype NumPy cannot hold at all
    is refused typed."""
    torch = pytest.importorskip("torch")
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t().to(torch.bfloat16)
    got = owner.get(owner.put(t), timeout=10)
    assert got.dtype == bf16 and got.shape == (4, 3)
    assert np.array_equal(got.astype(np.float32), t.float().numpy())
    ids = [owner.put(torch.full((5,), float(k), dtype=torch.bfloat16)) for k in (1, 2, 3)]
    total = owner.get(owner.reduce(ids), timeout=10)
    assert total.dtype == bf16 and np.array_equal(total.astype(np.float32), np.full(5, 6.0, np.float32))
    if hasattr(torch, "float8_e4m3fn"):
        with pytest.raises(hg.InvalidArgumentError, match="float8"):
            owner.put(torch.ones(3, dtype=torch.float8_e4m3fn))
