"""What every data plane promises (:class:`hoplite_gpu.dataplane.base.DataPlane`), held to each of
them: the TCP plane and the UCX one, two planes in this process on loopback, real sockets (or UCX
endpoints) and nothing of the transport stubbed.

A pull lands every byte of an object, from the start or from the bytes the receiver holds already,
also while the holder is still filling it; a failed pull says why with a typed error and keeps the
bytes it landed; the counters the node reports move; close is safe to repeat. The UCX plane's
tests skip, saying why, where ucxx cannot run here.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu.config import Config
from hoplite_gpu.dataplane import DataPlane, TcpDataPlane, UcxDataPlane, make_data_plane
from hoplite_gpu.errors import AuthenticationError, ObjectNotFoundError, PeerLostError, TransportError
from hoplite_gpu.iothread import IOThread
from hoplite_gpu.memory.buffers import Buffer
from hoplite_gpu.memory.store import LocalObject, LocalStore

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
TOKEN = "a-token-of-sixteen-chars"
PLANES: dict[str, type[Any]] = {"tcp": TcpDataPlane, "ucx": UcxDataPlane}


def _ucx_problem() -> str:
    """Why the UCX plane cannot run here ("" where it can): ucxx must import and listen."""
    try:
        from hoplite_gpu.dataplane.ucx.loading import ucxx_module

        ucxx = ucxx_module()

        async def listen() -> None:
            listener = ucxx.create_listener(lambda ep: None, port=0)
            listener.close()

        IOThread.get().run(listen(), timeout=30)
    except Exception as exc:
        return f"the UCX plane cannot run here: {type(exc).__name__}: {exc}"
    return ""


_problems: dict[str, str] = {}


def _usable(kind: str) -> None:
    """Skip the test, with the reason, where the ``kind`` plane cannot run."""
    if kind == "ucx":
        if "ucx" not in _problems:
            _problems["ucx"] = _ucx_problem()
        if _problems["ucx"]:
            pytest.skip(_problems["ucx"])


def _object(
    size: int, fill: np.ndarray[Any, Any] | None = None, oid: hg.ObjectID | None = None
) -> LocalObject:
    data = np.zeros(size, np.uint8) if fill is None else fill
    obj = LocalObject(oid or hg.ObjectID.random(), size, "|u1", (size,), b"", Buffer.wrap(data))
    if fill is not None:
        obj.advance(size)
    return obj


def _source(size: int, seed: int = 5) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _until(condition: Any, timeout: float = 10.0) -> None:
    """Poll ``condition`` until it holds (a deadline, not a sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.005)


def _run(coro: Any, timeout: float = 30) -> Any:
    return IOThread.get().run(coro, timeout=timeout)


class Pair:
    """A serving plane and a pulling plane of one kind, the server started on the I/O thread."""

    def __init__(self, kind: str, served: Config, pulling: Config, token: str = TOKEN) -> None:
        self.kind = kind
        cls = PLANES[kind]
        self.served: list[tuple[int, int, int, bool]] = []
        self.store = LocalStore(1 << 30)
        self.server: DataPlane = cls(self.store, TOKEN, served, on_served=lambda *a: self.served.append(a))
        self.client: DataPlane = cls(LocalStore(1 << 30), token, pulling)
        assert self.server.port == 0  # nothing listens before start
        self.port = _run(self.server.start("127.0.0.1"))

    def hold(self, obj: LocalObject) -> LocalObject:
        async def add() -> LocalObject:
            return self.store.add(obj)

        return _run(add())

    def pull(self, into: LocalObject, transfer_id: int = 1, timeout: float = 30) -> None:
        _run(self.client.pull("127.0.0.1", self.port, into, transfer_id), timeout=timeout)

    def close(self) -> None:
        _run(self.client.close())
        _run(self.server.close())


def _pair(kind: str, served: Config | None = None, pulling: Config | None = None, token: str = TOKEN) -> Pair:
    _usable(kind)
    chunks = Config(chunk_bytes=MiB, adaptive_chunks=False, connect_timeout=5)
    return Pair(kind, served or chunks, pulling or chunks, token)


@pytest.fixture(params=sorted(PLANES))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pair(kind: str) -> Iterator[Pair]:
    both = _pair(kind)
    yield both
    both.close()


# ---------------------------------------------------------------- the protocol itself
def _members() -> tuple[set[str], dict[str, inspect.Signature]]:
    """The protocol's attributes and its methods with their signatures."""
    attributes = set(DataPlane.__annotations__)
    methods = {
        name: inspect.signature(value)
        for name, value in vars(DataPlane).items()
        if not name.startswith("_") and callable(value)
    }
    return attributes, methods


def test_the_protocol_names_what_the_node_uses() -> None:
    attributes, methods = _members()
    assert set(methods) == {"start", "close", "pull"}
    assert {"port", "auth_failures", "stale_messages", "stale_bytes"} <= attributes
    assert {"staged_sent", "staged_received", "connections_opened"} <= attributes


@pytest.mark.parametrize("cls", [TcpDataPlane, UcxDataPlane], ids=["tcp", "ucx"])
def test_each_plane_implements_the_protocol(cls: type[Any]) -> None:
    """Every attribute is an int on a new plane, and every method is a coroutine function taking
    the protocol's parameters with its defaults (mypy checks the types where make_data_plane
    returns either as a DataPlane)."""
    attributes, methods = _members()
    plane = cls(LocalStore(1 << 20), TOKEN, Config())
    for name in attributes:
        assert isinstance(getattr(plane, name), int), name
    for name, wanted in methods.items():
        method = getattr(plane, name)
        assert inspect.iscoroutinefunction(method), name
        got = inspect.signature(method)
        shape = [(p.name, p.kind, p.default) for p in got.parameters.values()]
        assert shape == [
            (p.name, p.kind, p.default) for p in wanted.parameters.values() if p.name != "self"
        ], name


def test_the_config_chooses_the_plane_a_node_builds() -> None:
    store = LocalStore(1 << 20)
    assert isinstance(make_data_plane(store, TOKEN, Config(data_plane="tcp")), TcpDataPlane)
    assert isinstance(make_data_plane(store, TOKEN, Config(data_plane="ucx")), UcxDataPlane)
    for kind in ("tcp", "ucx"):
        assert isinstance(make_data_plane(store, TOKEN, Config(data_plane=kind)), DataPlane)
    assert not isinstance(store, DataPlane)
    from hoplite_gpu.dataplane import ucx

    assert ucx.UcxDataPlane is UcxDataPlane  # where the UCX plane's package offers it


# ---------------------------------------------------------------- pulls
def test_start_returns_the_port_it_listens_on(pair: Pair) -> None:
    assert 0 < pair.port == pair.server.port


def test_a_pull_lands_a_whole_object_and_the_holder_reports_it(pair: Pair) -> None:
    src = _source(3 * MiB + 123)
    held = pair.hold(_object(src.size, src.copy()))
    for transfer_id in (1, 2):  # the second pull reuses what the first set up
        into = _object(src.size, oid=held.object_id)
        pair.pull(into, transfer_id)
        assert into.complete and into.progress == src.size
        assert np.array_equal(into.buffer.view(0, src.size), src)
    _until(lambda: len(pair.served) == 2)  # once the holder has the receiver's ack
    assert sorted(pair.served) == [(1, src.size, 0, False), (2, src.size, 0, False)]
    assert pair.server.auth_failures == pair.client.auth_failures == 0
    assert pair.client.staged_received == pair.server.staged_sent == 0  # host memory: no staging


def test_a_pull_resumes_after_the_bytes_the_receiver_holds(pair: Pair) -> None:
    src = _source(4 * MiB)
    held = pair.hold(_object(src.size, src.copy()))
    into = _object(src.size, oid=held.object_id)
    into.buffer.view(0, MiB)[:] = src[:MiB]
    into.advance(MiB)
    pair.pull(into)
    assert into.complete and np.array_equal(into.buffer.view(0, src.size), src)
    _until(lambda: len(pair.served) == 1)
    assert pair.served == [(1, 3 * MiB, 0, False)]  # only the bytes after the offset crossed


def test_a_copy_still_filling_is_served_as_it_grows(pair: Pair) -> None:
    src = _source(4 * MiB)
    holder = _object(src.size)
    holder.buffer.view(0, src.size)[:] = src
    holder.advance(MiB)
    pair.hold(holder)
    into = _object(src.size, oid=holder.object_id)
    pulling = IOThread.get().submit(pair.client.pull("127.0.0.1", pair.port, into, 1))

    async def grow() -> None:
        for k in range(2, 5):
            await into.wait_progress((k - 1) * MiB, 20)  # the reader has what the holder had
            assert not holder.complete
            holder.advance(k * MiB)

    _run(grow())
    pulling.result(30)
    assert np.array_equal(into.buffer.view(0, src.size), src)
    _until(lambda: len(pair.served) == 1)
    ((_, sent, while_incomplete, failed),) = pair.served
    assert (sent, failed) == (src.size, False) and while_incomplete >= 3 * MiB


# ---------------------------------------------------------------- failures, typed
def test_a_missing_object_is_object_not_found(pair: Pair) -> None:
    gone = pair.hold(_object(MiB, _source(MiB)))

    async def drop() -> None:
        pair.store.remove(gone.object_id)  # a holder that deleted it answers at once

    _run(drop())
    into = _object(MiB, oid=gone.object_id)
    with pytest.raises(ObjectNotFoundError):
        pair.pull(into)
    assert into.progress == 0
    src = _source(MiB)  # the plane is still sound for the next pull
    held = pair.hold(_object(MiB, src.copy()))
    again = _object(MiB, oid=held.object_id)
    pair.pull(again, 2)
    assert np.array_equal(again.buffer.view(0, MiB), src)


def test_a_peer_with_another_token_is_refused_and_counted(kind: str) -> None:
    both = _pair(kind, token="another-token-sixteen-chars")
    try:
        held = both.hold(_object(MiB, _source(MiB)))
        into = _object(MiB, oid=held.object_id)
        with pytest.raises(AuthenticationError):
            both.pull(into)
        assert into.progress == 0
        _until(lambda: both.server.auth_failures >= 1)
        assert both.served == []
    finally:
        both.close()


def test_a_peer_that_closes_mid_pull_is_lost_and_the_landed_bytes_stay(kind: str) -> None:
    slow = Config(chunk_bytes=256 << 10, adaptive_chunks=False, send_rate_limit=4 * MiB, connect_timeout=5)
    both = _pair(kind, served=slow, pulling=slow)
    try:
        src = _source(8 * MiB)
        held = both.hold(_object(src.size, src.copy()))
        into = _object(src.size, oid=held.object_id)

        async def pull_then_close() -> None:
            pulling = asyncio.ensure_future(both.client.pull("127.0.0.1", both.port, into, 1))
            await into.wait_progress(MiB, 20)
            await both.server.close()
            await pulling

        with pytest.raises(TransportError):
            _run(pull_then_close())
        landed = into.progress
        assert MiB <= landed < src.size
        assert np.array_equal(into.buffer.view(0, landed), src[:landed])
    finally:
        both.close()


def test_nothing_listening_is_a_transport_error(kind: str) -> None:
    both = _pair(kind, pulling=Config(connect_timeout=3))
    both.close()  # its port is free again: nothing answers there
    into = _object(MiB)
    with pytest.raises(TransportError):
        both.pull(into)
    assert into.progress == 0


def test_a_failed_abort_stops_a_pull_with_its_error(kind: str) -> None:
    slow = Config(chunk_bytes=256 << 10, adaptive_chunks=False, send_rate_limit=4 * MiB, connect_timeout=5)
    both = _pair(kind, served=slow, pulling=slow)
    try:
        src = _source(8 * MiB)
        held = both.hold(_object(src.size, src.copy()))
        into = _object(src.size, oid=held.object_id)
        reason = PeerLostError("the directory chose another source", cause="aborted")

        async def pull_then_abort() -> None:
            abort: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            pulling = asyncio.ensure_future(both.client.pull("127.0.0.1", both.port, into, 1, abort))
            await into.wait_progress(MiB, 20)
            abort.set_exception(reason)
            await pulling

        with pytest.raises(PeerLostError) as raised:
            _run(pull_then_abort())
        assert raised.value is reason
        landed = into.progress
        assert landed < src.size and np.array_equal(into.buffer.view(0, landed), src[:landed])
    finally:
        both.close()


# ---------------------------------------------------------------- closing
def test_close_is_idempotent_and_a_closed_plane_serves_nothing(kind: str) -> None:
    both = _pair(kind, pulling=Config(connect_timeout=3))
    held = both.hold(_object(MiB, _source(MiB)))
    _run(both.server.close(grace=1.0))
    _run(both.server.close())  # again: nothing more, no error
    into = _object(MiB, oid=held.object_id)
    with pytest.raises(TransportError):
        both.pull(into)
    _run(both.client.close())
    _run(both.client.close())


def test_a_pull_between_joined_pieces_sees_each_chunk_in_one_piece(kind: str) -> None:
    # What the direct ring streams: several arrays back to back as one object, on both sides,
    # chunks of the size the puller asks for (clipped at the pieces' ends), each seen by the
    # puller's callback before the progress covers it; a coroutine waiting for bytes wakes.
    both = _pair(kind)
    try:
        sizes = [MiB + 100, 96 * 1024 + 4, 2 * MiB]
        src = [_source(n, seed) for seed, n in enumerate(sizes)]
        total = sum(sizes)
        holder = LocalObject(hg.ObjectID.random(), total, "|u1", (total,), b"", Buffer.joined(src))
        holder.advance(total)
        both.hold(holder)
        dst = [np.zeros(n, np.uint8) for n in sizes]
        into = LocalObject(holder.object_id, total, "|u1", (total,), b"", Buffer.joined(dst))
        seen: list[tuple[int, int, int]] = []

        def on_chunk(start: int, end: int) -> None:
            seen.append((start, end, into.progress))

        async def pull_and_wait() -> None:
            pulling = asyncio.ensure_future(
                both.client.pull("127.0.0.1", both.port, into, 1, on_chunk=on_chunk, chunk_bytes=512 * 1024)
            )
            await into.wait_progress(sizes[0] + 1, 20)  # into the second piece
            await pulling

        _run(pull_and_wait())
        assert all(np.array_equal(d, s) for d, s in zip(dst, src, strict=True))
        ends = list(into.buffer.ends)
        assert [(a, b) for a, b, _ in seen] == _chunks(ends, 512 * 1024)
        assert all(progress <= a for a, _, progress in seen)  # seen before the progress covered it
        assert into.complete
    finally:
        both.close()


def _chunks(ends: list[int], chunk: int) -> list[tuple[int, int]]:
    out, pos = [], 0
    for end in ends:
        while pos < end:
            out.append((pos, min(pos + chunk, end)))
            pos = out[-1][1]
    return out
