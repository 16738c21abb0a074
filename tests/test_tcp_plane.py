"""The TCP data plane on its own: two planes in this process, real sockets on loopback.

What a pull must do whatever the node around it does: land the bytes it was sent and keep them
when it stops (abort, stall, a peer that dies), serve a partial copy as it grows, reuse an idle
connection, and say what went wrong with a typed error.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu.config import Config
from hoplite_gpu.dataplane import TcpDataPlane
from hoplite_gpu.iothread import IOThread
from hoplite_gpu.memory.buffers import Buffer
from hoplite_gpu.memory.store import LocalObject, LocalStore
from tests.procs import MARGIN

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
TOKEN = "a-token-of-sixteen-chars"


def _object(
    size: int, fill: np.ndarray[Any, Any] | None = None, oid: hg.ObjectID | None = None
) -> LocalObject:
    data = np.empty(size, np.uint8) if fill is None else fill
    obj = LocalObject(oid or hg.ObjectID.random(), size, "|u1", (size,), b"", Buffer.wrap(data))
    if fill is not None:
        obj.advance(size)
    return obj


def _source(size: int, seed: int = 3) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _until(condition: Any, timeout: float = 10.0) -> None:
    """Poll ``condition`` until it holds (a deadline, not a sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.005)


class Pair:
    """A serving plane and a pulling plane, started on the I/O thread's loop."""

    def __init__(self, served: Config, pulling: Config) -> None:
        self.served: list[tuple[int, int, int, bool]] = []
        self.store = LocalStore(1 << 30)
        self.server = TcpDataPlane(self.store, TOKEN, served, on_served=lambda *a: self.served.append(a))
        self.client = TcpDataPlane(LocalStore(1 << 30), TOKEN, pulling)
        self.port = self.run(self.server.start("127.0.0.1"))

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return IOThread.get().run(coro, timeout=timeout)

    def hold(self, obj: LocalObject) -> LocalObject:
        async def add() -> LocalObject:
            return self.store.add(obj)

        return self.run(add())

    def close(self) -> None:
        self.run(self.client.close())
        self.run(self.server.close())


@pytest.fixture
def pair() -> Iterator[Pair]:
    both = Pair(Config(chunk_bytes=MiB), Config(chunk_bytes=MiB, adaptive_chunks=False))
    yield both
    both.close()


def test_a_pull_lands_every_byte_and_reuses_its_connection(pair: Pair) -> None:
    src = _source(9 * MiB + 123)
    held = pair.hold(_object(src.size, src.copy()))
    for _ in range(2):
        into = _object(src.size, oid=held.object_id)
        pair.run(pair.client.pull("127.0.0.1", pair.port, into, transfer_id=7))
        assert into.complete and np.array_equal(into.buffer.view(0, src.size), src)
    assert len(pair.server._open) == 1  # the second pull took the idle connection
    _until(lambda: len(pair.served) == 2)  # the holder reports once it has read the ack
    assert [s[1:] for s in pair.served] == [(src.size, 0, False)] * 2


def test_a_partial_copy_is_served_as_it_grows(pair: Pair) -> None:
    src = _source(4 * MiB)
    holder = _object(src.size, oid=hg.ObjectID.random())
    holder.buffer.view(0, src.size)[:] = src
    pair.hold(holder)
    into = _object(src.size, oid=holder.object_id)
    pulling = IOThread.get().submit(pair.client.pull("127.0.0.1", pair.port, into, transfer_id=1))

    async def grow() -> None:
        for k in range(1, 5):
            while into.progress < (k - 1) * MiB:  # the reader has what the holder had
                await asyncio.sleep(0.005)
            holder.advance(k * MiB)

    pair.run(grow())
    pulling.result(30)
    assert np.array_equal(into.buffer.view(0, src.size), src)
    _until(lambda: len(pair.served) == 1)
    ((_, sent, while_incomplete, failed),) = pair.served
    assert (sent, failed) == (src.size, False) and while_incomplete >= 3 * MiB


def test_an_abort_stops_a_pull_at_once_and_keeps_the_bytes_it_landed() -> None:
    both = Pair(Config(send_rate_limit=4 * MiB), Config(chunk_bytes=256 << 10, adaptive_chunks=False))
    try:
        src = _source(8 * MiB)
        held = both.hold(_object(src.size, src.copy()))
        into = _object(src.size, oid=held.object_id)

        async def pull_then_abort() -> float:
            abort: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            task = asyncio.ensure_future(both.client.pull("127.0.0.1", both.port, into, 2, abort))
            while into.progress < MiB:
                await asyncio.sleep(0.01)
            started = time.monotonic()
            abort.set_exception(hg.ObjectLostError("aborted by the test"))
            with pytest.raises(hg.ObjectLostError, match="aborted by the test"):
                await task
            return time.monotonic() - started

        assert both.run(pull_then_abort()) < 1.0  # not the 2 s the rest would take
        got = into.progress
        assert MiB <= got < src.size
        assert np.array_equal(into.buffer.view(0, got), src[:got])
        both.run(both.client.pull("127.0.0.1", both.port, into, 3))  # resumes where it stopped
        assert into.complete and np.array_equal(into.buffer.view(0, src.size), src)
    finally:
        both.close()


def test_a_stalled_sender_is_a_peer_lost_error_after_the_stall_timeout() -> None:
    both = Pair(Config(), Config(stall_timeout=1.0, chunk_bytes=MiB, adaptive_chunks=False))
    try:
        src = _source(4 * MiB)
        holder = _object(src.size, oid=hg.ObjectID.random())
        holder.buffer.view(0, src.size)[:] = src
        both.hold(holder)
        both.run(_advance(holder, MiB))  # a partial copy that never grows
        into = _object(src.size, oid=holder.object_id)
        started = time.monotonic()
        with pytest.raises(hg.PeerLostError, match=r"no progress for 1\.0 s"):
            both.run(both.client.pull("127.0.0.1", both.port, into, 4))
        assert time.monotonic() - started < 1.0 + MARGIN
        assert into.progress == MiB and np.array_equal(into.buffer.view(0, MiB), src[:MiB])
    finally:
        both.close()


async def _advance(obj: LocalObject, progress: int) -> None:
    obj.advance(progress)


@pytest.fixture
def rogue() -> Iterator[tuple[int, list[bytes]]]:
    """A listener that greets each connection with ``greeting[0]`` (nothing: it closes at once)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    greeting: list[bytes] = [b""]
    stop = threading.Event()

    def serve() -> None:
        lsock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                if greeting[0]:
                    conn.sendall(greeting[0])
                    conn.settimeout(5)
                    with __import__("contextlib").suppress(OSError):
                        conn.recv(1024)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield lsock.getsockname()[1], greeting
    stop.set()
    lsock.close()
    thread.join(5)


def test_a_peer_that_dies_while_connecting_is_lost_not_a_wrong_token(rogue: tuple[int, list[bytes]]) -> None:
    port, _ = rogue
    plane = TcpDataPlane(LocalStore(1 << 20), TOKEN, Config(connect_timeout=5))
    into = _object(MiB)
    try:
        with pytest.raises(hg.PeerLostError):
            IOThread.get().run(plane.pull("127.0.0.1", port, into, 1), timeout=30)
    finally:
        IOThread.get().run(plane.close(), timeout=30)


def test_a_peer_speaking_another_data_plane_is_named(rogue: tuple[int, list[bytes]]) -> None:
    port, greeting = rogue
    greeting[0] = b"\x00" * 64  # not HELLO: a UCX listener, or anything else
    plane = TcpDataPlane(LocalStore(1 << 20), TOKEN, Config(connect_timeout=5))
    into = _object(MiB)
    try:
        with pytest.raises(hg.TransportError, match="HOPLITE_DATA_PLANE"):
            IOThread.get().run(plane.pull("127.0.0.1", port, into, 1), timeout=30)
    finally:
        IOThread.get().run(plane.close(), timeout=30)


def test_a_connection_given_up_that_ends_anyway_is_closed_and_its_error_retrieved() -> None:
    # Found by tests/test_soak.py ("Task exception was never retrieved"): a pull stopped while
    # connecting cancels the connection, and a cancellation that lands as the connect finishes
    # is lost on Python < 3.12 (asyncio.wait_for): the task ends with the connect's error, or
    # with a socket nobody uses.
    plane = TcpDataPlane(LocalStore(1 << 20), TOKEN, Config(connect_timeout=5))
    unused, peer = socket.socketpair()

    async def finishing_anyway(outcome: Any) -> socket.socket:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if isinstance(outcome, BaseException):
                raise outcome from None
        return outcome  # type: ignore[no-any-return]

    async def give_up_both() -> list[dict[str, Any]]:
        unhandled: list[dict[str, Any]] = []
        loop = asyncio.get_running_loop()
        previous = loop.get_exception_handler()
        loop.set_exception_handler(lambda _, context: unhandled.append(context))
        try:
            tasks = [
                asyncio.ensure_future(finishing_anyway(o)) for o in (hg.TransportError("refused"), unused)
            ]
            await asyncio.sleep(0)  # both wait in their connect
            for task in tasks:
                plane._give_up(task)
            await asyncio.wait(tasks)
            del tasks
            gc.collect()  # an unretrieved exception is reported when its task is collected
            return unhandled
        finally:
            loop.set_exception_handler(previous)

    try:
        assert IOThread.get().run(give_up_both(), timeout=30) == []
        assert unused.fileno() == -1 or peer.recv(1) == b""  # the unused connection was closed
    finally:
        IOThread.get().run(plane.close(), timeout=30)
        peer.close()


def _congestion(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()


def test_connections_use_the_configured_congestion_control(pair: Pair) -> None:
    """Cubic on both ends by default (BBR starts a kept connection's next transfer at the rate it
    measured the round before); "" leaves the host's."""
    src = _source(MiB)
    held = pair.hold(_object(src.size, src.copy()))
    pair.run(pair.client.pull("127.0.0.1", pair.port, _object(src.size, oid=held.object_id), transfer_id=1))
    ends = [*pair.client._open, *pair.server._open]
    assert len(ends) == 2 and {_congestion(s) for s in ends} == {"cubic"}
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        host = f.read().strip()
    kept = Pair(Config(tcp_congestion=""), Config(tcp_congestion=""))
    try:
        held = kept.hold(_object(src.size, src.copy()))
        kept.run(
            kept.client.pull("127.0.0.1", kept.port, _object(src.size, oid=held.object_id), transfer_id=1)
        )
        assert {_congestion(s) for s in [*kept.client._open, *kept.server._open]} == {host}
    finally:
        kept.close()


def test_tcp_congestion_must_be_a_name() -> None:
    for bad in ("c u b i c", "x" * 16, "cubic\n"):
        with pytest.raises(hg.InvalidArgumentError, match="tcp_congestion"):
            Config(tcp_congestion=bad)
    assert Config(tcp_congestion="").tcp_congestion == ""


def test_data_plane_must_be_a_known_one() -> None:
    with pytest.raises(hg.InvalidArgumentError, match="data_plane"):
        Config(data_plane="rdma")


@pytest.mark.multiprocess
def test_a_node_on_the_tcp_plane_loads_no_ucx() -> None:
    """No UCX worker, so no port of UCX's for a peer to write through (SECURITY.md)."""
    import os
    import subprocess
    import sys

    script = (
        "import sys, hoplite_gpu as hg\n"
        "node = hg.init(data_plane='tcp', shared_memory=False)\n"
        "print('UCXX', 'ucxx' in sys.modules, flush=True)\n"
        "node.close()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=dict(os.environ)
    )
    assert "UCXX False" in done.stdout, (done.stdout, done.stderr)


def test_one_address_cannot_take_every_handshake_slot(pair: Pair) -> None:
    """Idle connections that never authenticate, from one address: beyond the per-address cap they
    are closed at once, and a peer elsewhere still pulls."""
    from hoplite_gpu.dataplane.tcp import HELLO, MAX_HANDSHAKES_PER_ADDRESS

    idle = []
    try:
        for _ in range(MAX_HANDSHAKES_PER_ADDRESS + 8):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.settimeout(10)
            s.connect(("127.0.0.1", pair.port))
            idle.append(s)
        greeted = 0
        for s in idle:
            first = s.recv(len(HELLO))
            greeted += first == HELLO
            assert first in (HELLO, b"")  # greeted, or closed at once
        assert greeted == MAX_HANDSHAKES_PER_ADDRESS
        src = _source(2 * MiB)
        held = pair.hold(_object(src.size, src.copy()))
        into = _object(src.size, oid=held.object_id)
        pair.run(pair.client.pull("127.0.0.1", pair.port, into, transfer_id=9), timeout=10)
        assert np.array_equal(into.buffer.view(0, src.size), src)
        assert pair.server.auth_failures >= 8
    finally:
        for s in idle:
            s.close()
