"""Asyncio service hosting :class:`~hoplite_gpu.directory.state.DirectoryState` over TCP.

The service is a thin shell: it authenticates connections, decodes frames into events, feeds them to
the state machine with the current monotonic time, and writes the resulting instructions to the
right connections. A request that is too large or fails its checks is answered with an
``ErrorReply`` (``InvalidArgumentError``); a connection that fails authentication, or sends another
malformed or oversized frame, is closed and logged; everyone else keeps being served.
Admitting and authenticating a connection is :mod:`.handshake`'s; the connections and the caller
channels a reply goes back on are :mod:`.channels`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import socket
import ssl
import time
import uuid
from typing import Any

from .. import protocol as p
from ..config import Config
from ..errors import HopliteError, ProtocolError
from .channels import Channels, Conn
from .config import DirectoryConfig
from .events import (
    AuthFailed,
    ContinueReduce,
    Disconnect,
    Event,
    NodeLeft,
    Request,
    Resume,
    Send,
    Tick,
)
from .frames import FrameReader, Refusal
from .handshake import HANDSHAKE_TIMEOUT, Admission, Greeter
from .listeners import connection_host, listen_local, listen_tcp
from .state import DirectoryState

log = logging.getLogger("hoplite_gpu.directory")

#: First and longest pauses before accepting again after an accept failed for want of descriptors
#: or memory (the connections wait in the kernel's backlog meanwhile).
ACCEPT_BACKOFF = (0.01, 1.0)


async def _closed(writer: asyncio.StreamWriter) -> None:
    """Wait until ``writer``'s connection is closed (how it ended does not matter here)."""
    with contextlib.suppress(Exception):
        await writer.wait_closed()


#: Bytes a connection's handler reads at a time: every request they hold is handled before the
#: replies go out (:meth:`DirectoryService._serve`).
READ_BYTES = 1 << 16
#: Bytes of replies a batch holds for one connection before it writes them all the same.
HELD_BYTES = 1 << 20
#: Caller channels a node may hold open (:mod:`hoplite_gpu.node.channel`); one more is refused
#: and its thread goes through the node's own connection.
MAX_CHANNELS_PER_NODE = 64


class DirectoryService:
    """The directory, served on ``host:port`` (port 0 picks a free one).

    Args:
        token: Shared secret every node must prove it knows.
        host: Interface to bind.
        port: TCP port (0: any free port).
        config: The directory's settings (:class:`~.config.DirectoryConfig`; the defaults if
            None). With ``validate``, the state's invariants are checked after every event and a
            broken one is logged as an error and recorded as an ``invariant_violated`` event (see
            :attr:`Config.validate_directory`); the service goes on serving.
        tls: Serve over TLS with this context (see :attr:`Config.tls_cert_file`); None: plain TCP.
    """

    def __init__(
        self,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        config: DirectoryConfig | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if not token:
            raise HopliteError("the directory needs a non-empty token")
        self.token = token
        self.host = host
        self.port = port
        self.config = config = config or DirectoryConfig()
        # The service checks the invariants itself (it logs a broken one and goes on serving).
        self.state = DirectoryState(dataclasses.replace(config, validate=False))
        self.tls = tls
        self.dropped_unread = 0
        self.refused_requests = 0  # refused with an ErrorReply (too large, or failing checks)
        self._warned: dict[str, tuple[float, int]] = {}  # warning kind -> (last logged, suppressed)
        self.violations = 0
        self.directory_id = uuid.uuid4().hex
        self.admission = Admission(config)
        self.greeter = Greeter(
            token, self.directory_id, config.inline_threshold_bytes, self._warn, self._auth_failed
        )
        self._conns: dict[str, Conn] = {}
        self.channels = Channels()
        self._channels = self.channels.by_node  # node id -> its caller channels
        self.accept_errors = 0
        self._listeners: list[socket.socket] = []
        self._accepting: list[asyncio.Task[None]] = []
        self._ticker: asyncio.Task[None] | None = None
        self._stopping = False
        self._wake = asyncio.Event()
        self._armed = math.inf  # the deadline the timer waits for (inf: none)
        self._batching = False  # a batch of a node's requests is being handled (see _serve)
        self._held: list[Conn] = []  # connections with frames held until the batch ends
        self._handlers: set[asyncio.Task[Any]] = set()

    @classmethod
    def from_config(cls, token: str, host: str, port: int, config: Config) -> DirectoryService:
        """A service with ``config``'s directory settings (:meth:`DirectoryConfig.from_config
        <.config.DirectoryConfig.from_config>`) and TLS context."""
        return cls(
            token, host=host, port=port, config=DirectoryConfig.from_config(config), tls=config.server_tls()
        )

    @property
    def handshaking(self) -> int:
        """Connections still authenticating."""
        return self.admission.handshaking

    @property
    def refused_handshakes(self) -> int:
        """Connections closed at once: they passed a cap of those still authenticating."""
        return self.admission.refused

    @property
    def auth_failures(self) -> int:
        """Connections that failed authentication."""
        return self.greeter.failures

    @property
    def address(self) -> str:
        """``host:port`` the service listens on."""
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Bind and start serving.

        Connections are accepted as plain TCP and counted against the caps of connections still
        authenticating (``Config.directory_max_handshakes``, ``..._per_address``) before any
        TLS: one beyond a cap is closed at once, and TLS must then finish within
        :data:`~.handshake.HANDSHAKE_TIMEOUT` with the rest of the handshake. (Served by asyncio with TLS,
        a connection was counted only after its TLS handshake, whose timeout is 60 s: idle ones
        used up the descriptors and no node could join.)
        """
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            self.host or None, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        self._listeners = listen_tcp(infos, self.port)
        self.port = self._listeners[0].getsockname()[1]
        if self.tls is None:  # (with TLS every connection is TLS's)
            self._listeners += listen_local(self.directory_id)
        self._accepting = [asyncio.create_task(self._accept_loop(sock)) for sock in self._listeners]
        self._ticker = asyncio.create_task(self._tick_loop())
        log.info("directory %s listening on %s", self.directory_id, self.address)

    async def stop(self) -> None:
        """Stop serving and close every connection, telling each node first (``Goodbye``), so
        that nodes tell a normal shutdown from a lost directory."""
        for task in self._accepting:
            task.cancel()
        await asyncio.gather(*self._accepting, return_exceptions=True)
        for sock in self._listeners:
            sock.close()
        self._stopping = True
        if self._ticker is not None:
            self._ticker.cancel()
        closing = []
        for conn in self.channels.every():
            conn.writer.close()
            closing.append(asyncio.ensure_future(_closed(conn.writer)))
        for conn in list(self._conns.values()):
            if not conn.writer.is_closing():
                conn.writer.write(p.encode(p.Goodbye()))
            conn.writer.close()
            closing.append(asyncio.ensure_future(_closed(conn.writer)))
        if closing:  # the goodbyes leave before this process may exit (bounded: a peer may not read)
            _, late = await asyncio.wait(closing, timeout=1.0)
            for task in late:
                task.cancel()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._ticker is not None:  # (its cancellation may be lost in a wait_for: it also stops)
            self._wake.set()
            await asyncio.wait({self._ticker}, timeout=1.0)

    # ------------------------------------------------------------ connections
    async def _accept_loop(self, listener: socket.socket) -> None:
        """Accept connections on ``listener`` for as long as the service runs. Out of
        descriptors or memory, it backs off (up to a second) instead of retrying at once: the
        connections wait in the kernel's backlog, and asyncio's own loop logged an error for
        each try (62,779 in 6 s in the issue's test)."""
        loop = asyncio.get_running_loop()
        pause = ACCEPT_BACKOFF[0]
        while True:
            try:
                sock, address = await loop.sock_accept(listener)
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue  # a peer that gave up before it was accepted
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM
                self.accept_errors += 1
                self._warn("accept", "cannot accept a connection (%s); trying again in %.2f s", exc, pause)
                await asyncio.sleep(pause)  # backoff, not synchronisation
                pause = min(2 * pause, ACCEPT_BACKOFF[1])
                continue
            pause = ACCEPT_BACKOFF[0]
            self._admit(sock, address)

    def _admit(self, sock: socket.socket, address: Any) -> None:
        """Count a connection just accepted against the caps of those still authenticating
        (closed at once beyond one), and start its handshake."""
        host = connection_host(address)
        if not self.admission.admit(host):
            self._warn(
                "handshakes",
                "closing connections at once: %d are still authenticating, %d of them from %s",
                self.admission.handshaking,
                self.admission.waiting_from(host),
                host,
            )
            sock.close()
            return
        task = asyncio.create_task(self._on_connection(sock, address))
        self._handlers.add(task)

    async def _open(self, sock: socket.socket) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Streams over an accepted socket, after a TLS handshake of at most
        :data:`~.handshake.HANDSHAKE_TIMEOUT` if the service has TLS."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(reader)
        timeout = HANDSHAKE_TIMEOUT if self.tls is not None else None
        transport, _ = await loop.connect_accepted_socket(
            lambda: protocol, sock, ssl=self.tls, ssl_handshake_timeout=timeout
        )
        return reader, asyncio.StreamWriter(transport, protocol, reader, loop)

    async def _on_connection(self, sock: socket.socket, address: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        host = connection_host(address)
        peer = ":".join(str(x) for x in address[:2]) if isinstance(address, tuple) else host
        node_id: str | None = None
        writer: asyncio.StreamWriter | None = None
        conn: Conn | None = None
        try:
            try:
                reader, writer = await self._open(sock)
                conn = await self._handshake(reader, writer, peer, deadline)
            finally:
                self.admission.done(host)
            if conn is None:
                return
            node_id = conn.node_id
            await self._serve(reader, conn)
        except ProtocolError as exc:
            log.warning("closing connection from %s (node %s): %s", peer, node_id, exc)
        except ssl.SSLError as exc:  # before OSError: it is one
            self._warn("tls", "dropping %s: TLS failed (%s)", peer, exc)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, asyncio.TimeoutError):
            pass  # (TimeoutError: TLS did not finish in time)
        except asyncio.CancelledError:
            pass
        finally:
            self._handlers.discard(task)
            if conn is not None and conn.channel:
                self._channel_closed(conn)
            elif node_id is not None and self._conns.get(node_id) is conn:
                del self._conns[node_id]
                self.channels.close_all(node_id)
                self._apply(NodeLeft(node_id, time.monotonic()))
            if writer is not None:
                writer.close()
            else:
                sock.close()

    async def _serve(self, reader: asyncio.StreamReader, conn: Conn) -> None:
        """Handle an authenticated node's requests until its connection ends: what arrived is
        read at once and handled in order (:class:`~.frames.FrameReader`), and the replies of the
        batch go out after it, one write per connection. Raises :class:`ProtocolError` for what
        cannot be answered (the connection is then closed). A reply to a request that came on a
        caller channel goes back on it (:meth:`.channels.Channels.route`)."""
        frames = FrameReader(self.config.max_message_bytes)
        node_id = conn.node_id
        while True:
            data = await reader.read(READ_BYTES)
            if not data:
                raise asyncio.IncompleteReadError(b"", None)
            items, error = frames.feed(data)
            self._batching = True
            try:
                for item in items:
                    if isinstance(item, Refusal):
                        self._refuse(conn, item)
                        continue
                    if conn.channel:
                        self.channels.route(conn, getattr(item, "request_id", 0))
                    self._apply(Request(node_id, item, time.monotonic()))
            finally:
                self._batching = False
                self._flush(conn)
            if error is not None:
                raise error

    def _channel_closed(self, conn: Conn) -> None:
        """A caller channel closed: forget it, and withdraw what it waited on (a lookup, a barrier
        arrival)."""
        rid = self.channels.closed(conn)
        if rid and conn.node_id in self._conns:
            self._apply(Request(conn.node_id, p.CancelLookup(request_id=rid), time.monotonic()))

    def _write(self, conn: Conn, frame: bytes) -> None:
        """Send ``frame`` to ``conn``'s node: at once, or after the batch being handled (at once
        too once the batch holds :data:`HELD_BYTES` for it: a node whose small requests ask for
        large replies must meet the bound on unread replies as it did)."""
        if self._batching:
            if not conn.out:
                self._held.append(conn)
            conn.out.append(frame)
            conn.held += len(frame)
            if conn.held >= HELD_BYTES:
                self._written(conn, conn.take())
            return
        self._written(conn, frame)

    def _flush(self, requester: Conn) -> None:
        """Send what a batch held, one write per connection, the connection the batch came on
        last: the others' replies answer requests that waited (the gets of a put just handled),
        and on a host with few cores each write's reader takes a core the next one's may need
        (bench/pages/small-operations.md#caller-channels)."""
        held, self._held = self._held, []
        if len(held) > 1 and requester in held:
            held.remove(requester)
            held.append(requester)
        for conn in held:
            data = conn.take()
            if data and not conn.writer.is_closing():
                self._written(conn, data)

    def _written(self, conn: Conn, data: bytes) -> None:
        conn.writer.write(data)
        unread = conn.writer.transport.get_write_buffer_size()
        if unread > self.config.max_unread_bytes:
            # Not reading its replies: drop it (its handler then reports it as left) rather than
            # hold its backlog in memory.
            log.warning("dropping node %s: %d bytes of replies unread", conn.node_id[:8], unread)
            self.dropped_unread += 1
            conn.writer.transport.abort()

    def _refuse(self, conn: Conn, refusal: Refusal) -> None:
        """Answer a request the directory will not handle with an ``InvalidArgumentError``."""
        kind, why, node_id = refusal.kind, refusal.why, conn.node_id
        self.refused_requests += 1
        self._warn("refused", "refused a %s request from node %s: %s", kind, node_id[:8], why)
        self.state.record(time.monotonic(), "request_refused", node=node_id, request=kind, reason=why[:500])
        text = f"the directory refused this {kind} request: {why}"
        reply = p.ErrorReply(request_id=refusal.request_id, kind="InvalidArgumentError", message=text)
        if not conn.writer.is_closing():
            self._write(conn, p.encode(reply))

    def _warn(self, kind: str, text: str, *args: Any) -> None:
        """Log a warning of this kind at most once a second (a flood of bad connections must not
        become a flood of log lines), with how many were left out since the last one."""
        now = time.monotonic()
        last, suppressed = self._warned.get(kind, (-math.inf, 0))
        if now - last < 1.0:
            self._warned[kind] = (last, suppressed + 1)
            return
        self._warned[kind] = (now, 0)
        if suppressed:
            text += f" ({suppressed} more like this in the last second not logged)"
        log.warning(text, *args)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str, deadline: float
    ) -> Conn | None:
        """Authenticate a connection (:class:`~.handshake.Greeter`): the node's (it joins), or
        one of its caller channels (``Hello.channel``: only while the node itself is connected,
        up to :data:`MAX_CHANNELS_PER_NODE`); None if refused."""
        greeted = await self.greeter.hello(reader, writer, peer, deadline)
        if greeted is None:
            return None
        hello, nonce = greeted
        if hello.channel:
            if not self._channel_fits(hello.node_id, peer):
                return None
        elif hello.node_id in self._conns:
            log.warning("dropping %s: node id %s already connected", peer, hello.node_id)
            return None
        await self.greeter.welcome(writer, hello, nonce)
        if hello.channel:
            if not self._channel_fits(hello.node_id, peer):  # (again: others came meanwhile)
                return None
            conn = Conn(hello.node_id, writer, peer, channel=True)
            self.channels.add(conn)
            return conn
        conn = Conn(hello.node_id, writer, peer)
        self._conns[hello.node_id] = conn
        self._apply(self.greeter.joined(hello))
        return conn

    def _auth_failed(self, peer: str) -> None:
        self._apply(AuthFailed(peer, time.monotonic()))

    def _channel_fits(self, node_id: str, peer: str) -> bool:
        """Whether ``node_id`` may open one more caller channel: it is connected, with fewer than
        :data:`MAX_CHANNELS_PER_NODE`."""
        if node_id in self._conns and self.channels.fits(node_id, MAX_CHANNELS_PER_NODE):
            return True
        log.debug("refusing a channel of node %s from %s", node_id[:8], peer)
        return False

    # ------------------------------------------------------------ state machine glue
    def _apply(self, event: Event) -> None:
        instructions = self.state.handle(event)
        if self.config.validate:
            self._check(event)
        for instr in instructions:
            if isinstance(instr, Resume):
                # After the callbacks ready now (other connections' requests): a large reduction
                # is placed a slice at a time between them.
                asyncio.get_running_loop().call_soon(self._continue, instr.reduction_id)
                continue
            conn = self._conns.get(instr.node_id)
            if conn is None or conn.writer.is_closing():
                continue
            if isinstance(instr, Send):
                if self.channels.routes:  # a reply to a request a caller channel waits on goes there
                    request_id = getattr(instr.message, "request_id", 0)
                    conn = self.channels.reply_on(instr.node_id, request_id) or conn
                try:
                    frame = p.encode(instr.message)
                except Exception:  # a bug; the node's other messages still go (it times out this one)
                    what = instr.message.TYPE
                    log.exception("could not encode a %s for node %s; dropped", what, instr.node_id[:8])
                    continue
                self._write(conn, frame)
            elif isinstance(instr, Disconnect):
                log.warning("declaring node %s dead: %s", instr.node_id[:8], instr.reason)
                del self._conns[instr.node_id]
                self.channels.close_all(instr.node_id)
                if conn.out:  # what the batch held for it goes first, as it would have
                    conn.writer.write(conn.take())
                conn.writer.close()
        deadline = self.state.next_deadline()
        if deadline is not None and deadline < self._armed:
            # Only an earlier deadline re-arms the timer (a wake and a new timeout per event cost
            # more than the event itself); a later one is found when the armed one fires.
            self._wake.set()

    def _continue(self, reduction_id: bytes) -> None:
        self._apply(ContinueReduce(reduction_id, time.monotonic()))

    def _check(self, event: Event) -> None:
        problems = self.state.problems()
        if problems:
            self.violations += 1
            log.error("directory invariants broken after %s: %s", type(event).__name__, "; ".join(problems))
            self.state.record(event.now, "invariant_violated", after=type(event).__name__, problems=problems)
            path = self.config.violation_log
            if path:
                with contextlib.suppress(OSError), open(path, "a") as report:
                    report.write(f"pid {os.getpid()} after {type(event).__name__}: {'; '.join(problems)}\n")

    async def _tick_loop(self) -> None:
        """Send the state machine a Tick at its next deadline (or when woken), for as long as the
        service runs: an error in one round is logged and the loop goes on, since without it no
        timeout fires and no silent node is ever declared dead."""
        while not self._stopping:
            try:
                await self._tick_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the directory's timer failed; it goes on")
                await asyncio.sleep(0.1)  # back off before the next round, not synchronisation

    async def _tick_once(self) -> None:
        deadline = self.state.next_deadline()
        self._wake.clear()
        self._armed = math.inf if deadline is None else deadline
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        woken = False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)
            woken = True
        now = time.monotonic()
        if woken and (deadline is None or now < deadline):
            # Woken by an event, not a deadline: nothing is due yet (the next round recomputes
            # the deadline). A Tick walks every pending lookup, so one per event made each
            # request cost 38 ms with 40,000 lookups pending.
            return
        # How late this loop woke: a directory that was itself stalled renews leases.
        lag = 0.0 if woken or deadline is None else max(0.0, now - deadline)
        self._apply(Tick(now, lag))
