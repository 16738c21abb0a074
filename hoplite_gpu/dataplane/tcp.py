"""The TCP data plane: authenticated sockets whose bytes the kernel moves on a worker thread.

Where UCX offers only TCP (every host here, and any cluster without RDMA), this plane replaces the
UCX one of :mod:`hoplite_gpu.dataplane.ucx.plane` (``Config.data_plane``). Why: over TCP, UCX copies
every received segment once more in user space and ucxx costs a Python future per chunk, while a
socket ``recv_into`` with ``MSG_WAITALL`` lands a whole chunk in the object's memory in one system
call with the GIL released: no Python per byte and one Python step per chunk (bench/pages/collectives.md,
"The TCP data plane"). It also listens only on the node's address and buffers nothing for a peer
that has not authenticated, and no UCX worker listens at all (SECURITY.md: UCX's TCP transport
serves a UCT put to any peer).

The wire contract is the UCX plane's in a byte stream. The listener opens each connection with
:data:`HELLO` and a nonce, and runs the HMAC challenge-response of :mod:`hoplite_gpu.auth`; a peer
that fails it is dropped before any request is read. Then the receiver sends a fixed-size pull
request (:data:`protocol.PULL_REQUEST`), answered by a status header and the object's bytes from the
requested offset (as far as the holder has them: a partial copy is served as it grows), and the
receiver acks the last byte. One transfer at a time per connection; a receiver keeps idle
connections to a peer for its next pulls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from typing import Any

import numpy as np

from .. import auth
from .. import protocol as p
from ..config import Config
from ..errors import AuthenticationError, HopliteError, PeerLostError, TransportError
from ..faults import INJECTOR
from ..memory import LocalObject, LocalStore, through_file, write_at
from ..object_id import ObjectID
from .base import ChunkCallback
from .shared import MIN_WIRE_CHUNK, PlaneBase, ServeCallback, pull_status, refusal, unreachable
from .sockets import (
    WORKERS,
    Closed,
    blocking_with_timeouts,
    flat,
    recv_async,
    recv_exact,
    send_all,
    shut,
    stale,
    tune,
)
from .wire import Handed

log = logging.getLogger("hoplite_gpu.transport")

#: The listener's first bytes on every connection: this plane and its version, so a peer speaking
#: another data plane (``Config.data_plane`` set differently) is told so instead of failing auth.
HELLO = b"HGTCP\x01"
#: Connections that have not finished authenticating, beyond which new ones are closed at once
#: (each has ``Config.connect_timeout`` to finish), in all and from one address, so that one
#: address cannot take every slot.
MAX_HANDSHAKES = 128
MAX_HANDSHAKES_PER_ADDRESS = 32
#: Idle authenticated connections a receiver keeps per peer.
MAX_IDLE_PER_PEER = 8

#: Most bytes a receiver lands before it advances the object's progress: readers of a partial
#: copy (relays, reduce vertices, 1 MiB a step) wait no longer than this for the next bytes, at one
#: wake-up of the I/O loop per step (bench/pages/collectives.md#the-tcp-data-plane).
MAX_STEP = 2 * 1024 * 1024


class TcpDataPlane(PlaneBase):
    """TCP listener plus idle-connection cache of one node; same interface as
    :class:`~hoplite_gpu.dataplane.ucx.plane.UcxDataPlane` (both implement
    :class:`~hoplite_gpu.dataplane.base.DataPlane`).

    Args:
        store: The node's local store, read when serving.
        token: Shared secret for peer authentication.
        config: Chunk size, timeouts, rate limit.
        on_served: Callback after each served transfer: (transfer_id, bytes_sent,
            bytes_sent_while_incomplete, failed).
    """

    def __init__(
        self, store: LocalStore, token: str, config: Config, on_served: ServeCallback | None = None
    ) -> None:
        super().__init__(store, token, config, on_served)
        self._listener: socket.socket | None = None
        self._idle: dict[str, list[socket.socket]] = {}
        self._open: set[socket.socket] = set()  # every connection, for close()
        self._handshakes = 0
        self._handshakes_by_address: dict[str, int] = {}
        self._refused_at = 0.0  # when a refused peer was last logged
        self._refused_since = 0  # refused peers not logged yet
        self.handed = Handed()  # connections peers handed over (dataplane.wire)

    # ------------------------------------------------------------ lifecycle
    async def start(self, host: str = "") -> int:
        """Listen on ``host`` ("" for every interface); returns the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        lsock = socket.create_server((host, 0), family=family, backlog=1024)
        lsock.setblocking(False)
        self._listener = lsock
        self.port = int(lsock.getsockname()[1])
        self._spawn(self._accept(lsock))
        return self.port

    async def close(self, grace: float = 0.0) -> None:
        """Close the listener and every connection; transfers being served get up to ``grace``
        seconds to finish first."""
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            self._listener = None
        if grace > 0 and self._serving:
            await asyncio.wait(set(self._serving), timeout=grace)
        self._closed = True
        for sock in list(self._open):
            shut(sock)
        self._open.clear()
        self._idle.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _forget(self, sock: socket.socket) -> None:
        self._open.discard(sock)
        shut(sock)

    # ------------------------------------------------------------ serving side
    async def _accept(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            try:
                sock, peer = await loop.sock_accept(lsock)
            except asyncio.CancelledError:
                raise
            except OSError as exc:
                if self._listener is None:
                    return
                log.debug("data plane: accept failed: %s", exc)
                await asyncio.sleep(0.01)  # out of descriptors: let some close
                continue
            host = str(peer[0]) if isinstance(peer, tuple) else ""
            by_address = self._handshakes_by_address.get(host, 0)
            if self._closed or self._handshakes >= MAX_HANDSHAKES or by_address >= MAX_HANDSHAKES_PER_ADDRESS:
                sock.close()
                self._refused()
                continue
            self._handshakes += 1
            self._handshakes_by_address[host] = by_address + 1
            sock.setblocking(False)
            self._open.add(sock)
            self._spawn(self._serve_connection(sock, host))

    def _refused(self) -> None:
        """Count a peer dropped before it authenticated; log them at most once a second."""
        self.auth_failures += 1
        self._refused_since += 1
        now = time.monotonic()
        if now - self._refused_at >= 1.0:
            log.warning(
                "data plane: dropped %d peer(s) that did not authenticate (wrong token, or too many "
                "connections that have not)",
                self._refused_since,
            )
            self._refused_at, self._refused_since = now, 0

    async def _serve_connection(self, sock: socket.socket, host: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            try:
                tune(sock, self.config.tcp_congestion)
                ok = await asyncio.wait_for(
                    self._authenticate_server(loop, sock), self.config.connect_timeout
                )
            except asyncio.TimeoutError:
                ok = False  # held a slot without answering
            except (OSError, Closed) as exc:
                # Gone before it answered: a peer killed while connecting, or a port scan.
                log.debug("data plane: a peer left during authentication: %s", exc)
                return
            finally:
                self._handshakes -= 1
                left = self._handshakes_by_address[host] - 1
                if left:
                    self._handshakes_by_address[host] = left
                else:
                    del self._handshakes_by_address[host]
            if not ok:
                self._refused()
                return
            request = bytearray(p.PULL_REQUEST.size)
            while not self._closed:
                await recv_async(loop, sock, request)  # no time-out: an idle connection is fine
                magic, version, transfer_id, offset, chunk, oid_raw = p.PULL_REQUEST.unpack(request)
                if magic == p.WIRE_MAGIC and version == p.PROTOCOL_VERSION:  # (dataplane.wire)
                    await loop.sock_sendall(sock, p.PULL_RESPONSE.pack(p.PULL_OK, 0, 0))
                    self._open.discard(sock)
                    sock.setblocking(True)
                    self.handed.put(ObjectID(oid_raw), sock)
                    return
                if magic != p.PULL_MAGIC or version != p.PROTOCOL_VERSION:
                    log.warning("data plane: malformed pull request; closing the connection")
                    return
                serve = self._serve_one(loop, sock, transfer_id, offset, chunk, ObjectID(oid_raw))
                if not await self._spawn_served(serve):
                    return
        except (asyncio.CancelledError, Closed, OSError):
            pass
        finally:
            if sock in self._open:  # (not one handed over)
                self._forget(sock)

    async def _authenticate_server(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bool:
        nonce = auth.new_nonce()
        await loop.sock_sendall(sock, HELLO + nonce)
        answer = bytearray(auth.NONCE_BYTES + auth.MAC_BYTES)
        await recv_async(loop, sock, answer)
        client_nonce = bytes(answer[: auth.NONCE_BYTES])
        if not auth.verify(self.token, b"client", nonce, client_nonce, bytes(answer[auth.NONCE_BYTES :])):
            return False
        await loop.sock_sendall(sock, auth.mac(self.token, b"server", nonce, client_nonce))
        return True

    async def _serve_one(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        transfer_id: int,
        offset: int,
        chunk: int,
        oid: ObjectID,
    ) -> bool:
        """Serve one pull; whether the connection can take the next request."""
        cfg = self.config
        obj = await self.store.wait_for(oid, cfg.stall_timeout)
        status = pull_status(obj, offset, chunk)
        # The header's second field says whether the copy was complete: only such a pull measures
        # the link (one from a partial copy waits on its holder), see LinkRates.record.
        whole = int(obj is not None and obj.complete)
        header = p.PULL_RESPONSE.pack(status, whole, obj.size if obj is not None else 0)
        if status != p.PULL_OK or obj is None:
            await asyncio.wait_for(loop.sock_sendall(sock, header), cfg.stall_timeout)
            return True
        try:
            with obj.being_served():
                sent, while_incomplete = await WORKERS.run(
                    lambda: self._send(sock, header, obj, offset, chunk)
                )
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                log.debug("serving %s (transfer %d) stopped: %s", oid, transfer_id, exc)
            shut(sock)  # the receiver sees the cut at once and resumes elsewhere
            if self.on_served is not None:
                self.on_served(transfer_id, 0, 0, True)
            return False
        if self.on_served is not None:
            self.on_served(transfer_id, sent, while_incomplete, False)
        return True

    def _send(
        self,
        sock: socket.socket,
        header: bytes,
        obj: LocalObject,
        pos: int,
        chunk: int,
    ) -> tuple[int, int]:
        """On a worker thread: the header, the bytes from ``pos`` as they are present, the ack."""
        cfg = self.config
        blocking_with_timeouts(sock, cfg.stall_timeout)
        sent = 0
        while_incomplete = 0
        started = time.monotonic()
        faults = INJECTOR.armed
        oid_hex = obj.object_id.hex()
        send_all(sock, header)
        while pos < obj.size:
            end = min(pos + chunk, obj.size, obj.buffer.piece_end(pos))
            if faults:
                INJECTOR.check("serve", oid_hex, pos, obj.size)
                cut = INJECTOR.next_offset("serve", oid_hex, pos, obj.size)
                end = end if cut is None else min(end, cut)
            if obj.progress <= pos:
                # A partial copy: wait for more of the bytes this node is receiving (or
                # computing), then send what it has (a relay forwards as it receives).
                need = min(pos + MIN_WIRE_CHUNK, end)
                obj.wait_progress_from_thread(need, cfg.stall_timeout)
            if not obj.complete:
                end = min(end, obj.progress)
                while_incomplete += end - pos
            if obj.error is not None:
                raise obj.error
            if cfg.send_rate_limit:
                ahead = (sent + end - pos) / cfg.send_rate_limit - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)  # traffic shaping, not synchronisation
            if obj.buffer.on_device:
                data = obj.buffer.host_chunk(pos, end)
                self.staged_sent += end - pos
            else:
                data = obj.buffer.view(pos, end)
            send_all(sock, data)
            sent += end - pos
            pos = end
        if faults:
            INJECTOR.check("serve", oid_hex, pos, obj.size)
        # The receiver's ack says it has the bytes, so closing this node afterwards cannot cut the
        # transfer short.
        ack = bytearray(p.ACK.size)
        recv_exact(sock, memoryview(ack))
        sock.setblocking(False)
        return sent, while_incomplete

    # ------------------------------------------------------------ receiving side
    async def _connection(self, host: str, port: int, address: str) -> socket.socket:
        """An idle authenticated connection to the peer, or a new one."""
        idle = self._idle.get(address)
        while idle:
            sock = idle.pop()
            if not stale(sock):
                return sock
            self._forget(sock)
        if self._closed:
            raise TransportError("the data plane is closed", peer=address)
        loop = asyncio.get_running_loop()
        timeout = self.config.connect_timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        self._open.add(sock)
        self.connections_opened += 1
        try:
            try:
                tune(sock, self.config.tcp_congestion)
                await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout)
            except (OSError, asyncio.TimeoutError) as exc:
                raise unreachable(address, exc) from exc
            try:
                await asyncio.wait_for(self._authenticate_client(loop, sock, address), timeout)
            except asyncio.TimeoutError:
                raise PeerLostError(
                    f"auth with {address} made no progress for {timeout} s", peer=address, cause="stalled"
                ) from None
            except (OSError, Closed) as exc:
                raise PeerLostError(
                    f"auth with {address} failed: {type(exc).__name__}: {exc}",
                    peer=address,
                    cause=f"{type(exc).__name__}: {exc}",
                ) from exc
        except BaseException:
            self._forget(sock)
            raise
        return sock

    async def _connection_unless(
        self, host: str, port: int, address: str, obj: LocalObject, abort: asyncio.Future[None] | None
    ) -> socket.socket:
        """:meth:`_connection`, given up as soon as the object fails or ``abort`` does (raising
        that error): a stopped peer's kernel still accepts connections, and its handshake would
        otherwise hold the pull for ``connect_timeout`` after the directory said it was lost (the
        soak measured it: a receiver's typed error came a connect timeout after the others')."""
        failed = obj.failure()
        stops = [failed] if abort is None else [failed, abort]
        connecting = asyncio.ensure_future(self._connection(host, port, address))
        try:
            waits: list[asyncio.Future[Any]] = [connecting, *stops]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._give_up(connecting)
            raise
        finally:
            obj.forget_failure(failed)
        if connecting.done():
            return connecting.result()
        self._give_up(connecting)
        for fut in stops:
            if fut.done() and not fut.cancelled() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]
        raise PeerLostError(f"pull from {address} was stopped", peer=address, cause="aborted")

    def _give_up(self, connecting: asyncio.Future[socket.socket]) -> None:
        """Cancel a connection nobody waits for; one that ends anyway (a cancellation that lands
        as the connect finishes) is closed, and its error retrieved (the soak saw "Task
        exception was never retrieved")."""

        def discard(task: asyncio.Future[socket.socket]) -> None:
            if not task.cancelled() and task.exception() is None:
                self._forget(task.result())

        connecting.cancel()
        connecting.add_done_callback(discard)

    async def _authenticate_client(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, address: str
    ) -> None:
        hello = bytearray(len(HELLO) + auth.NONCE_BYTES)
        await recv_async(loop, sock, hello)
        if bytes(hello[: len(HELLO)]) != HELLO:
            raise TransportError(
                f"peer {address} does not speak hoplite_gpu's TCP data plane (is its "
                "HOPLITE_DATA_PLANE set differently from this node's?)",
                peer=address,
                cause="hello",
            )
        nonce = bytes(hello[len(HELLO) :])
        mine = auth.new_nonce()
        await loop.sock_sendall(sock, mine + auth.mac(self.token, b"client", nonce, mine))
        theirs = bytearray(auth.MAC_BYTES)
        try:
            await recv_async(loop, sock, theirs)
        except (OSError, Closed) as exc:
            raise AuthenticationError(
                f"peer {address} closed the connection during authentication: it does not accept our "
                "token (or it died)",
                peer=address,
                cause="closed",
            ) from exc
        if not auth.verify(self.token, b"server", nonce, mine, bytes(theirs)):
            raise AuthenticationError(
                f"peer {address} failed authentication: it does not know our token", peer=address
            )

    async def pull(
        self,
        host: str,
        port: int,
        obj: LocalObject,
        transfer_id: int,
        abort: asyncio.Future[None] | None = None,
        on_chunk: ChunkCallback | None = None,
        chunk_bytes: int = 0,
    ) -> None:
        """The contract of :meth:`hoplite_gpu.dataplane.base.DataPlane.pull`, on a worker
        thread (``on_chunk`` too): progress advances by steps of at most :data:`MAX_STEP`;
        ``abort`` failing (or the object failing) shuts the socket, which ends the worker's
        receive at once."""
        cfg = self.config
        address = f"{host}:{port}"
        sock = await self._connection_unless(host, port, address, obj, abort)
        loop = asyncio.get_running_loop()
        start = obj.progress
        chunk = min(self.chunk_size(address, chunk_bytes), MAX_STEP)
        request = p.PULL_REQUEST.pack(
            p.PULL_MAGIC, p.PROTOCOL_VERSION, transfer_id, start, chunk, obj.object_id.binary()
        )
        failed = obj.failure()
        stops = [failed] if abort is None else [failed, abort]
        stopped: list[asyncio.Future[None]] = []

        def stop(fut: asyncio.Future[None]) -> None:
            stopped.append(fut)
            shut(sock)  # the worker's receive returns at once

        for fut in stops:
            fut.add_done_callback(stop)
        if INJECTOR.armed:
            INJECTOR.check("receive", obj.object_id.hex(), start, obj.size)
        started = time.monotonic()
        reusable = False
        work = WORKERS.run(lambda: self._receive(loop, sock, request, obj, start, chunk, on_chunk))
        try:
            try:
                status, whole, size = await asyncio.shield(work)
            except asyncio.CancelledError:
                # Every byte landed (a reduce vertex reading them is done, and let go of its fetch):
                # the worker only acknowledges them. Let it, and keep the connection: cut, the next
                # pull from this peer would open and authenticate a new one (each vertex of an
                # allreduce ended so, every round: bench/pages/collectives.md, "Connections kept").
                landed = obj.progress >= obj.size
                if not landed:
                    shut(sock)
                with contextlib.suppress(BaseException):
                    status, _, size = await work
                    reusable = landed and status == p.PULL_OK and size == obj.size
                raise
            except HopliteError:
                raise
            except Exception as exc:
                for fut in stopped:
                    if not fut.cancelled() and fut.exception() is not None:
                        raise fut.exception() from None  # type: ignore[misc]
                if isinstance(exc, TimeoutError):
                    raise PeerLostError(
                        f"receive with {address} made no progress for {cfg.stall_timeout} s",
                        peer=address,
                        cause="stalled",
                    ) from None
                raise PeerLostError(
                    f"receive with {address} failed: {type(exc).__name__}: {exc}",
                    peer=address,
                    cause=f"{type(exc).__name__}: {exc}",
                ) from exc
            refused = refusal(status, size, obj, address)
            if refused is not None:
                reusable = status == p.PULL_NOT_FOUND  # answered in full: the connection is sound
                raise refused
            reusable = True
            if whole:
                self.rates.record(address, obj.size - start, time.monotonic() - started)
        finally:
            for fut in stops:
                fut.remove_done_callback(stop)
            obj.forget_failure(failed)
            if reusable and not stopped and not self._closed:
                idle = self._idle.setdefault(address, [])
                if len(idle) < MAX_IDLE_PER_PEER:
                    idle.append(sock)
                else:
                    self._forget(sock)
            else:
                self._forget(sock)

    def _receive(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        request: bytes,
        obj: LocalObject,
        pos: int,
        chunk: int,
        on_chunk: ChunkCallback | None,
    ) -> tuple[int, int, int]:
        """On a worker thread: the request, the header, the bytes into the object (``on_chunk``
        called and the progress advanced as each chunk lands), the ack. Returns the header's
        three fields."""
        blocking_with_timeouts(sock, self.config.stall_timeout)
        send_all(sock, request)
        header = bytearray(p.PULL_RESPONSE.size)
        recv_exact(sock, memoryview(header))
        status, whole, size = p.PULL_RESPONSE.unpack(header)
        if status != p.PULL_OK or size != obj.size:
            sock.setblocking(False)
            return status, whole, size
        buffer = obj.buffer
        backend = buffer.backend if buffer.on_device else None
        # New shared memory is filled through its file: received into scratch memory, then written
        # (cheaper than a page fault per page; see Segment.write_file).
        bounce = np.empty(chunk, np.uint8) if backend is None and through_file(buffer.array) else None
        oid_hex = obj.object_id.hex()
        while pos < obj.size:
            end = min(pos + chunk, obj.size, buffer.piece_end(pos))
            if bounce is not None:
                recv_exact(sock, flat(bounce[: end - pos]))
                write_at(buffer.array, pos, bounce[: end - pos])
            elif backend is None:
                recv_exact(sock, flat(buffer.view(pos, end)))
            else:
                staged = backend.staging(end - pos)
                recv_exact(sock, flat(staged))
                backend.from_host(buffer.view(pos, end), staged)
                self.staged_received += end - pos
            if on_chunk is None:
                loop.call_soon_threadsafe(obj.advance, end)
            else:  # the caller works on the thread: no wake-up of the loop per chunk
                on_chunk(pos, end)
                obj.advance_from_thread(end, loop)
            if INJECTOR.armed:
                INJECTOR.check("receive", oid_hex, end, obj.size)
            pos = end
        send_all(sock, p.ACK.pack(pos))
        sock.setblocking(False)
        return status, whole, size


__all__ = ["HELLO", "TcpDataPlane"]
