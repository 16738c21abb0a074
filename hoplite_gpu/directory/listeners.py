"""The directory's listening sockets: TCP on its address, and a local socket for the processes
of its own host (a request and its reply cost a caller channel about twice as much over TCP
loopback as over a Unix socket: bench/pages/small-operations.md#local-channels).
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
from typing import Any

from ..protocol import local_socket_name

log = logging.getLogger("hoplite_gpu.directory")

#: Kernel backlog of connections not accepted yet.
LISTEN_BACKLOG = 128


def listen_tcp(infos: list[Any], port: int) -> list[socket.socket]:
    """Listening sockets on every address of ``infos`` (``getaddrinfo`` results): non-blocking,
    all on the port the first got when ``port`` is 0."""
    sockets: list[socket.socket] = []
    seen: set[tuple[int, Any]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # each family on its own socket
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:  # that family is not enabled here (as asyncio)
                    sockets.pop().close()
                    continue
                raise OSError(exc.errno, f"cannot listen on {address!r}: {exc.strerror}") from None
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    if not sockets:
        raise OSError(f"no address to listen on for port {port}")
    return sockets


def listen_local(directory_id: str) -> list[socket.socket]:
    """The directory's local socket (:func:`~hoplite_gpu.protocol.local_socket_name`), listening
    and non-blocking; none where it cannot be bound (not Linux, or the name is taken)."""
    if not sys.platform.startswith("linux"):
        return []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(local_socket_name(directory_id))
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        log.warning("no local socket for the directory (%s): the nodes of its host use TCP", exc)
        sock.close()
        return []
    return [sock]


def connection_host(address: Any) -> str:
    """Where an accepted connection comes from: its IP address, or ``local`` (the local socket,
    whose peers have no address)."""
    return str(address[0]) if isinstance(address, tuple) else "local"
