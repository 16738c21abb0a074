"""Connections of the TCP data plane handed over to a library's own stream (the collective's
ring on the caller's thread, :mod:`hoplite_gpu.collective.wire`): one node opens an authenticated
connection to another's data plane and sends a request with :data:`~hoplite_gpu.protocol.WIRE_MAGIC`
and a key (an :class:`~hoplite_gpu.object_id.ObjectID`); the listener answers it and leaves the
socket, blocking, in its :class:`Handed` under that key until the library takes it. Either side
then owns the socket: the data plane neither reads it again nor closes it."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

from .. import protocol as p
from ..errors import TransportError
from ..object_id import ObjectID
from .sockets import recv_async, shut

#: Most handed sockets a node keeps untaken (a peer cannot fill its memory with them).
MAX_HANDED = 256


class Handed:
    """Sockets peers handed to this node, by key, until taken (:meth:`take`); a newer one of a key
    replaces (and closes) the older. Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._socks: dict[ObjectID, socket.socket] = {}

    def put(self, key: ObjectID, sock: socket.socket) -> None:
        with self._cond:
            old = self._socks.pop(key, None)
            if len(self._socks) >= MAX_HANDED:
                shut(self._socks.pop(next(iter(self._socks))))  # the oldest
            self._socks[key] = sock
            self._cond.notify_all()
        if old is not None:
            shut(old)

    def take(self, key: ObjectID, timeout: float) -> socket.socket | None:
        """The socket handed under ``key``, waiting up to ``timeout`` seconds; None if none came."""
        with self._cond:
            self._cond.wait_for(lambda: key in self._socks, timeout)
            return self._socks.pop(key, None)

    def drop(self, keys: list[ObjectID]) -> None:
        """Close the sockets handed under ``keys`` that were not taken."""
        with self._cond:
            socks = [s for s in (self._socks.pop(k, None) for k in keys) if s is not None]
        for sock in socks:
            shut(sock)


async def hand_over(plane: Any, host: str, port: int, key: ObjectID) -> socket.socket:
    """A new authenticated connection to the TCP data plane at ``host:port``, handed over there
    under ``key``: the caller owns it (blocking, no time-outs set). Raises ``PeerLostError`` where
    the peer cannot be reached, ``TransportError`` where it refuses."""
    address = f"{host}:{port}"
    sock: socket.socket = await plane._connection(host, port, address)
    loop = asyncio.get_running_loop()
    try:
        request = p.PULL_REQUEST.pack(p.WIRE_MAGIC, p.PROTOCOL_VERSION, 0, 0, 0, key.binary())
        await asyncio.wait_for(loop.sock_sendall(sock, request), plane.config.connect_timeout)
        answer = bytearray(p.PULL_RESPONSE.size)
        await asyncio.wait_for(recv_async(loop, sock, answer), plane.config.connect_timeout)
        status, _, _ = p.PULL_RESPONSE.unpack(answer)
        if status != p.PULL_OK:
            raise TransportError(f"{address} did not take the connection (status {status})", peer=address)
    except BaseException:
        plane._forget(sock)
        raise
    plane._open.discard(sock)
    sock.setblocking(True)
    return sock
