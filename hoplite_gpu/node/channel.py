"""A caller thread's own connection to the directory, for small blocking requests.

Through the node's connection, a blocking ``put`` or ``get`` hops from the caller's thread to the
node's I/O thread and its reply hops back: two of the four thread wakes on a small put + get's
path, 30-80 us each on a 2-core machine (bench/pages/small-operations.md#caller-channels). On its channel, the
caller's thread sends the request and reads the reply itself. The directory sends on a channel
only the replies to the requests that came on it (``Hello.channel``); everything it pushes goes
to the node's connection.

A channel serves what needs no I/O thread: a put of an object the directory stores inline, the
first lookup of a get (its inline answer goes to the caller, ``LookupRequest.keep``; any other is
handed to the I/O thread), a delete of an object whose copy here can leave the store from the
caller's thread, and a group's barrier (with the objects it releases). Anything else, and any
request on a channel that is lost or cannot be opened, goes through the node's connection as
before (:class:`ChannelLost`), which also waits for a directory that restarts. A channel is
opened on a thread's first small request and closed with the node, or when the node loses its
directory. Where the directory is on this host (in this network namespace) and serves without
TLS, a channel goes over its local socket (``Config.local_channels``), not TCP.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from .. import auth
from .. import protocol as p
from ..errors import DirectoryUnavailableError, ProtocolError, from_kind
from ..iothread import IOThread
from .control import parse_address
from .session import DirectorySession

log = logging.getLogger("hoplite_gpu")

#: Seconds a thread whose channel could not be opened goes through the node's connection before
#: it tries again (a directory that refuses channels costs a connection attempt a second at most).
REOPEN_PAUSE = 1.0

#: Bytes a channel asks the socket for at a time (a frame larger than this is read in parts).
READ_BYTES = 65536


def _connect_local(directory_id: str, timeout: float) -> socket.socket | None:
    """A connection to the directory's local socket (:func:`~hoplite_gpu.protocol.local_socket_name`),
    where this process is on its host (in its network namespace); None where it is not reached."""
    if not hasattr(socket, "AF_UNIX"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(p.local_socket_name(directory_id))
    except OSError:
        sock.close()
        return None
    return sock


class ChannelLost(Exception):
    """No channel for this request (lost, refused, or the node is not connected): make it through
    the node's connection. Whether a request sent before the loss was handled is unknown, so it
    must be one that can be made twice."""


class Channel:
    """One open channel: blocking, used by one thread, one request at a time.

    Args:
        sock: The authenticated connection.
        limit: Largest frame accepted from the directory.
    """

    def __init__(self, sock: socket.socket, limit: int) -> None:
        self.sock = sock
        self.limit = limit
        self._received = b""  # read from the socket, not yet returned
        self._timeout = sock.gettimeout()

    def settimeout(self, timeout: float | None) -> None:
        """The socket's timeout for what follows (a system call only when it changes)."""
        if timeout != self._timeout:
            self.sock.settimeout(timeout)
            self._timeout = timeout

    def _fill(self, n: int) -> None:
        """Read until at least ``n`` bytes are received: as much as the socket holds each time,
        so a small frame is one receive, header and body together."""
        have = len(self._received)
        if have >= n:
            return
        parts = [self._received]
        while have < n:
            more = self.sock.recv(max(READ_BYTES, n - have))
            if not more:
                raise ConnectionError("the directory closed the channel")
            parts.append(more)
            have += len(more)
        self._received = b"".join(parts)  # (joined once: a large frame comes in many parts)

    def read(self) -> p.Message:
        """The next message (raises OSError, ProtocolError)."""
        head = p.FRAME_HEADER.size
        self._fill(head)
        end = head + p.frame_length(self._received[:head], self.limit)
        self._fill(end)
        payload, self._received = self._received[head:end], self._received[end:]
        return p.decode(payload)

    def __del__(self) -> None:  # its thread ended
        with contextlib.suppress(Exception):
            self.sock.close()

    def shut(self) -> None:
        """End its connection from any thread: a thread blocked reading it wakes up with an error.
        Its descriptor stays its own until its thread closes it: closed under a thread's read, its
        number could go to the next socket opened, and the read would go on there."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """End it and free its descriptor (its own thread only, see :meth:`shut`)."""
        self.shut()
        with contextlib.suppress(OSError):
            self.sock.close()


class Channels:
    """The channels of one node's threads.

    Args:
        session: The node's directory link (its address, id counter and connection state).
        token: Shared secret.
        io: The node's I/O thread, which never uses a channel (it must not block).
        enabled: Whether threads use channels at all (``Config.caller_channels``).
    """

    def __init__(self, session: DirectorySession, token: str, io: IOThread, enabled: bool = True) -> None:
        self._session = session
        self._token = token
        self._io = io
        self._enabled = enabled
        self._config = session.config
        self._local = threading.local()
        self._lock = threading.Lock()
        # Held by their threads (a thread's end closes its channel, see Channel.__del__).
        self._open: weakref.WeakSet[Channel] = weakref.WeakSet()
        self._closed = False

    def usable(self) -> bool:
        """Whether this thread may use a channel (not the I/O thread; channels are on)."""
        return self._enabled and not self._closed and not self._io.in_thread()

    def ask(self, make: Callable[[int], p.Message], guard: float | None) -> p.Message:
        """Send ``make(request_id)`` on this thread's channel and return its reply, waiting at
        most ``guard`` s (None: as long as the channel lives).

        Raises:
            ChannelLost: no channel: make the request through the node's connection.
            DirectoryUnavailableError: no reply within ``guard``.
            HopliteError: the directory refused the request (its ``ErrorReply``).
        """
        chan = self._channel()
        rid = self._session.next_id()
        try:
            chan.settimeout(guard)
            chan.sock.sendall(p.encode(make(rid)))
            while True:
                reply = chan.read()
                if getattr(reply, "request_id", None) == rid:
                    break  # (a reply its thread gave up on earlier is skipped)
        except TimeoutError:
            self._drop(chan)  # the directory withdraws what it waited on once it closes
            raise DirectoryUnavailableError(
                f"the directory at {self._session.address} did not answer a request in {guard} s",
                peer=self._session.address,
                cause="timeout",
            ) from None
        except (OSError, ProtocolError) as exc:
            self._drop(chan)
            raise ChannelLost(str(exc)) from None
        except BaseException:  # e.g. KeyboardInterrupt in the middle of a reply
            self._drop(chan)
            raise
        if isinstance(reply, p.ErrorReply):
            raise from_kind(reply.kind, reply.message)
        return reply

    def barrier(
        self, barrier_id: bytes, rank: int, count: int, timeout: float | None, release: Sequence[bytes] = ()
    ) -> p.BarrierReply | None:
        """:meth:`DirectorySession.barrier <hoplite_gpu.node.session.DirectorySession.barrier>` on
        this thread's channel; None without one (an arrival the channel lost is withdrawn by the
        directory as the channel closes: ask through the node's connection)."""
        if not self.usable():
            return None
        guard = None if timeout is None else timeout + self._config.request_timeout
        request = functools.partial(
            p.BarrierRequest,
            barrier_id=barrier_id,
            rank=rank,
            count=count,
            timeout=p.wire_timeout(timeout),
            release=list(release),
        )
        try:
            reply = self.ask(lambda rid: request(request_id=rid), guard)
        except ChannelLost:
            return None
        if not isinstance(reply, p.BarrierReply):
            raise ProtocolError(f"unexpected reply to barrier: {reply.TYPE}")
        return reply

    def _channel(self) -> Channel:
        """This thread's channel, opened if need be (raises :class:`ChannelLost`)."""
        chan: Channel | None = getattr(self._local, "channel", None)
        if chan is not None:
            return chan
        if not self.usable():
            raise ChannelLost("no channel here")
        if time.monotonic() < getattr(self._local, "retry_at", 0.0):
            raise ChannelLost("no channel for now")
        control = self._session.control
        if control.lost or not control.directory_id:
            raise ChannelLost("not connected")
        try:
            chan = self._connect(control.directory_id, control.limit)
        except (OSError, ProtocolError, DirectoryUnavailableError) as exc:
            log.debug("no channel to the directory (%s); going through the node's connection", exc)
            self._local.retry_at = time.monotonic() + REOPEN_PAUSE
            raise ChannelLost(str(exc)) from None
        with self._lock:
            if self._closed:
                chan.close()
                raise ChannelLost("the node closed")
            self._open.add(chan)
        self._local.channel = chan
        return chan

    def _connect(self, directory_id: str, limit: int) -> Channel:
        """An authenticated channel to the directory instance ``directory_id`` (``limit``: its
        largest frame accepted after the handshake)."""
        session = self._session
        host, port = parse_address(session.address)
        timeout = self._config.connect_timeout
        local = self._config.local_channels and session.tls is None  # (TLS: its connections only)
        sock = _connect_local(directory_id, timeout) if local else None
        if sock is None:
            sock = socket.create_connection((host, port), timeout)
        try:
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if session.tls is not None:
                sock = session.tls.wrap_socket(sock, server_hostname=host)
            chan = Channel(sock, 4096)  # the handshake's frames are small
            challenge = chan.read()
            if not isinstance(challenge, p.Challenge):
                raise ProtocolError(f"expected a challenge, got {challenge.TYPE}")
            mine = auth.new_nonce()
            proof = auth.mac(self._token, b"client", challenge.nonce, mine)
            sock.sendall(p.encode(session.channel_hello(mine, proof)))
            welcome = chan.read()
            if not isinstance(welcome, p.Welcome) or not auth.verify(
                self._token, b"server", challenge.nonce, mine, welcome.proof
            ):
                raise ProtocolError("the directory did not prove it knows our token")
            if welcome.directory_id != directory_id:
                raise ProtocolError("another directory instance answered (it restarted)")
        except (OSError, ssl.SSLError, ProtocolError):
            sock.close()
            raise
        chan.limit = limit
        return chan

    def _drop(self, chan: Channel) -> None:
        """Close this thread's channel (the next request opens another)."""
        chan.close()
        self._local.channel = None
        with self._lock:
            self._open.discard(chan)

    def reset(self) -> None:
        """End every channel (the node lost its directory): threads waiting on one go through
        the node's connection, which waits for the directory to come back. Each thread closes its
        own on its next request, or as it ends (:meth:`Channel.shut`)."""
        with self._lock:
            chans, self._open = list(self._open), weakref.WeakSet()
        for chan in chans:
            chan.shut()

    def close(self) -> None:
        """End every channel and open no more (the node closes); this thread's is closed too."""
        self._closed = True
        self.reset()
        chan = getattr(self._local, "channel", None)
        if chan is not None:
            self._drop(chan)
