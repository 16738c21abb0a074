"""Blocking and asyncio socket helpers of the TCP data plane (:mod:`.tcp`): worker threads for
blocking transfers, kernel time-outs, exact receives, and waking a thread blocked on a socket."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import select
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any


class Closed(Exception):
    """The peer closed the connection, or it was shut down here (abort, close)."""


class Workers:
    """Daemon threads that run blocking transfers, one each, started as needed and kept while idle
    (daemons: an interpreter exiting with a transfer blocked is not held up by it)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run ``fn`` on a worker; a future of the running loop gives its result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if fut.done():
                return
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

        def job() -> None:
            try:
                result = (True, fn())
            except BaseException as exc:  # handed to the awaiting coroutine, without its frames:
                # they hold the object's buffer, which the pool could then never hand out again
                result = (False, exc.with_traceback(None))
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle, *result)

        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        self._jobs.put(job)
        if start:
            threading.Thread(target=self._work, name="hoplite-data", daemon=True).start()
        return fut

    def _work(self) -> None:
        while True:
            self._jobs.get()()
            with self._lock:
                self._idle += 1


WORKERS = Workers()


def blocking_with_timeouts(sock: socket.socket, seconds: float) -> None:
    """Blocking mode with kernel time-outs (``SO_RCVTIMEO``/``SO_SNDTIMEO``): ``MSG_WAITALL``
    then fills a whole chunk per call, and a stalled peer ends the call after ``seconds``."""
    sock.setblocking(True)
    whole = int(seconds)
    tv = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from a blocking socket (see :func:`blocking_with_timeouts`)."""
    got = 0
    n = len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        except BlockingIOError:
            raise TimeoutError("no bytes arrived within the stall timeout") from None
        if k == 0:
            raise Closed("the peer closed the connection")
        got += k


def flat(array: Any) -> memoryview:
    """The bytes of a contiguous host array, as a writable byte view."""
    return memoryview(array).cast("B")


def send_all(sock: socket.socket, data: Any) -> None:
    try:
        sock.sendall(data)
    except BlockingIOError:
        raise TimeoutError("the peer took no bytes within the stall timeout") from None


def tune(sock: socket.socket, congestion: str = "") -> None:
    """No Nagle delay for requests, headers and acks; ``congestion`` as the connection's congestion
    control (``Config.tcp_congestion``; "", or one the kernel refuses: the host's). Buffer sizes
    stay the kernel's: a size set by hand turns off its autotuning, which grows them to the path's
    bandwidth-delay product."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if congestion:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())


def shut(sock: socket.socket) -> None:
    """Wake any thread blocked on ``sock`` and free it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def stale(sock: socket.socket) -> bool:
    """Whether an idle connection has something to read: its peer closed it (or sent what it
    should not have)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


async def recv_async(loop: asyncio.AbstractEventLoop, sock: socket.socket, buf: bytearray) -> None:
    """Fill ``buf`` from a non-blocking socket on the loop."""
    view = memoryview(buf)
    got = 0
    while got < len(buf):
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise Closed("the peer closed the connection")
        got += k


__all__ = [
    "WORKERS",
    "Closed",
    "Workers",
    "blocking_with_timeouts",
    "flat",
    "recv_async",
    "recv_exact",
    "send_all",
    "shut",
    "stale",
    "tune",
]
