"""The UCX data plane: with :mod:`.loading` and :mod:`.waits`, the only code that talks to ``ucxx``.

A node on UCX runs one :class:`UcxDataPlane`: a UCX listener that serves pulls of local objects
(complete or still filling), and a cache of authenticated endpoints to peers for its own pulls.

Per endpoint, the connecting side (the receiver) and the listener (the sender) first run the HMAC
challenge-response of :mod:`hoplite_gpu.auth`; a peer that fails it is dropped before any request is
read. Then the receiver sends fixed-size pull requests (:data:`protocol.PULL_REQUEST`), each answered
by a status header and the object's bytes from the requested offset, in chunks, each on a tag of its
own (:func:`protocol.chunk_tag`), with ``chunks_in_flight`` chunks posted ahead on both sides.
Several transfers share an endpoint concurrently. Every UCX error becomes a
:class:`~hoplite_gpu.errors.TransportError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any

import numpy as np

from ... import auth
from ... import protocol as p
from ...config import Config
from ...errors import (
    AuthenticationError,
    HopliteError,
    PeerLostError,
)
from ...faults import INJECTOR
from ...iothread import forget
from ...memory import LocalObject, LocalStore
from ...object_id import ObjectID
from ..base import ChunkCallback
from ..shared import PlaneBase, ServeCallback, pull_status, refusal, unreachable
from .loading import check_features, ucxx_module
from .settings import ucx_cuda
from .waits import as_transport_error, failure_of, landed, timed

log = logging.getLogger("hoplite_gpu.transport")

#: Bytes sent once per new endpoint after authentication: the first large message on a fresh UCX
#: TCP endpoint was measured to take 0.2-1.2 s, after a 4 MiB exchange it took milliseconds.
WARMUP_BYTES = 4 * 1024 * 1024


class _Peer:
    """An authenticated endpoint to one peer's listener."""

    def __init__(self, ep: Any, address: str) -> None:
        self.ep = ep
        self.address = address
        self.request_lock = asyncio.Lock()


class UcxDataPlane(PlaneBase):
    """UCX listener plus endpoint cache of one node (arguments: :class:`~.shared.PlaneBase`)."""

    def __init__(
        self, store: LocalStore, token: str, config: Config, on_served: ServeCallback | None = None
    ) -> None:
        super().__init__(store, token, config, on_served)
        self._listener: Any = None
        self._peers: dict[str, _Peer] = {}
        self._connecting: dict[str, asyncio.Future[_Peer]] = {}
        self._server_eps: set[Any] = set()
        # Device chunks go to UCX as they are (its cuda_copy transport), else staged through host.
        self._device_wire = ucx_cuda()

    # ------------------------------------------------------------ lifecycle
    async def start(self, host: str = "") -> int:
        """Start listening; returns the port.

        Args:
            host: The address this node was told to listen on ("" for none): UCX is limited to
                its interface (see :func:`.loading.ucxx_module`), so peers arriving on other interfaces
                are refused.
        """
        ucxx = ucxx_module(host)
        check_features(ucxx)  # before listening: no peer may reach a context serving RMA
        self._listener = ucxx.create_listener(self._on_endpoint, port=0)
        self.port = int(self._listener.port)
        self._spawn(self._sweep_unexpected())
        return self.port

    async def _sweep_unexpected(self) -> None:
        """Free messages that have waited unreceived for a whole sweep interval.

        UCX keeps a tagged message that arrives before its receive is posted (an "unexpected"
        message) until someone receives it: a peer that sends before authenticating, or a chunk
        that arrives after its transfer was given up, would otherwise hold that memory for the
        node's life. Every ``stall_timeout`` seconds this sends a marker message to its own
        worker; at the next round every message queued ahead of the marker has waited at least
        one interval without a receive (a transfer waiting that long has failed anyway), and is
        received into a scratch buffer and dropped. UCX keeps the freed buffers in its pools, so
        repeated floods reuse the same memory instead of adding to it.
        """
        ucxx = ucxx_module()
        interval = self.config.stall_timeout
        own: Any = None
        marker: int | None = None
        strays: set[int] = set()  # markers of failed rounds: dropped when met, never counted
        loop = asyncio.get_running_loop()
        next_round = loop.time() + interval
        while not self._closed:
            await asyncio.sleep(max(0.0, next_round - loop.time()))  # a timer, not a synchronisation
            next_round = loop.time() + interval
            try:
                if own is None:
                    address = ucxx.get_worker_address()
                    connecting = ucxx.create_endpoint_from_worker_address(address)
                    own = await timed(connecting, self.config.connect_timeout, "self", "connect")
                if (
                    marker is not None
                    and not await self._drop_until(own, marker, strays)
                    and len(strays) < 1024
                ):
                    strays.add(marker)  # not arrived yet (a loaded machine): met by a later round
                marker = secrets.randbits(64)
                sending = own.send(np.zeros(1, np.uint8), tag=marker, force_tag=True)
                await timed(sending, self.config.connect_timeout, "self", "marker")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the next round starts over with a new endpoint
                log.debug("data plane: sweep of unexpected messages failed: %s", exc)
                if marker is not None and len(strays) < 1024:
                    strays.add(marker)  # it may still arrive (a slow send): not a peer's message
                if own is not None:
                    with contextlib.suppress(Exception):
                        own.abort()
                own, marker = None, None
        if own is not None:
            with contextlib.suppress(Exception):
                own.abort()

    async def _drop_until(self, own: Any, marker: int, strays: set[int]) -> bool:
        """Receive and drop every unexpected message queued ahead of ``marker`` (and the marker),
        if the marker has arrived; ``own`` is the endpoint to this node's own worker. Markers of
        earlier rounds that failed or were overtaken (``strays``) are dropped too but not counted
        as stale. Returns whether the marker had arrived."""
        from ucxx._lib.libucxx import UCXXTag, UCXXTagMask

        # ucxx 0.52 exposes the worker object (the one whose probe takes a tag mask) only here.
        worker = ucxx_module().core._get_ctx().worker
        if not worker.tag_probe(UCXXTag(marker)).matched:
            return False  # not arrived yet (or taken by another node's sweep in this process)
        count = nbytes = 0
        while True:
            # The oldest unexpected message of any tag, left in the queue: a receive of its tag
            # then takes it (the oldest of that tag), with UCX assembling a message of several
            # fragments as usual (taking it by the probe's handle hung on such messages).
            found = worker.tag_probe(UCXXTag(0), UCXXTagMask(0), remove=False)
            if not found.matched:
                break
            tag, length = int(found.sender_tag.value), int(found.length)
            receiving = own.recv(np.empty(max(1, length), np.uint8), tag=tag, force_tag=True)
            try:
                await timed(receiving, self.config.stall_timeout, "self", "drop")
            except HopliteError:
                # Its last fragments never came (its sender was cut off): the receive posted for
                # it keeps it out of the queue, so go on with the next one.
                log.debug("data plane: a %d-byte stale message did not complete; skipped", length)
            if tag == marker:
                break
            if tag in strays:
                strays.discard(tag)
                continue
            count += 1
            nbytes += length
        self.stale_messages += count
        self.stale_bytes += nbytes
        if count:
            log.warning(
                "data plane: dropped %d messages (%d bytes) that no receive asked for within %.0f s "
                "(sent by a peer before it authenticated, or chunks of transfers given up)",
                count,
                nbytes,
                self.config.stall_timeout,
            )
        return True

    async def close(self, grace: float = 0.0) -> None:
        """Close the listener, every endpoint and every serving task.

        Transfers being served get up to ``grace`` seconds to finish first, so receivers
        downstream of this node are not cut off by an orderly shutdown.
        """
        if grace > 0 and self._serving:
            await asyncio.wait(set(self._serving), timeout=grace)
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for peer in list(self._peers.values()):
            with contextlib.suppress(Exception):
                peer.ep.abort()
        for ep in list(self._server_eps):
            with contextlib.suppress(Exception):
                ep.abort()
        self._peers.clear()
        self._server_eps.clear()
        if self._listener is not None:
            with contextlib.suppress(Exception):
                self._listener.close()
            self._listener = None

    # ------------------------------------------------------------ serving side
    async def _on_endpoint(self, ep: Any) -> None:
        if self._closed:
            ep.abort()
            return
        self._server_eps.add(ep)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            if not await self._authenticate_server(ep):
                return
            await self._serve_requests(ep)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # peer went away: nothing to do but drop it
            log.debug("data-plane endpoint closed: %s", exc)
        finally:
            self._server_eps.discard(ep)
            with contextlib.suppress(Exception):
                ep.abort()
            if task is not None:
                self._tasks.discard(task)

    async def _authenticate_server(self, ep: Any) -> bool:
        timeout = self.config.connect_timeout
        nonce = auth.new_nonce()
        await timed(ep.send(np.frombuffer(nonce, np.uint8).copy(), tag=p.TAG_AUTH), timeout, "peer", "auth")
        answer = np.empty(auth.NONCE_BYTES + auth.MAC_BYTES, np.uint8)
        try:
            await timed(ep.recv(answer, tag=p.TAG_AUTH), timeout, "peer", "auth")
        except HopliteError:
            self.auth_failures += 1
            log.warning("data plane: dropping a peer that sent no authentication")
            return False
        client_nonce = answer[: auth.NONCE_BYTES].tobytes()
        proof = answer[auth.NONCE_BYTES :].tobytes()
        if not auth.verify(self.token, b"client", nonce, client_nonce, proof):
            self.auth_failures += 1
            log.warning("data plane: dropping a peer that failed authentication (wrong token?)")
            return False
        mine = auth.mac(self.token, b"server", nonce, client_nonce)
        await timed(ep.send(np.frombuffer(mine, np.uint8).copy(), tag=p.TAG_AUTH), timeout, "peer", "auth")
        warm = np.zeros(WARMUP_BYTES, np.uint8)
        await timed(ep.send(warm, tag=p.TAG_WARMUP), timeout, "peer", "warmup")
        return True

    async def _serve_requests(self, ep: Any) -> None:
        while not self._closed:
            raw = np.empty(p.PULL_REQUEST.size, np.uint8)
            await ep.recv(raw, tag=p.TAG_REQUEST)  # no timeout: an idle endpoint is fine
            magic, version, transfer_id, offset, chunk, oid_raw = p.PULL_REQUEST.unpack(raw.tobytes())
            if magic != p.PULL_MAGIC or version != p.PROTOCOL_VERSION:
                log.warning("data plane: malformed pull request; closing the endpoint")
                return
            self._spawn_served(self._serve_one(ep, transfer_id, offset, chunk, ObjectID(oid_raw)))

    async def _serve_one(self, ep: Any, transfer_id: int, offset: int, chunk: int, oid: ObjectID) -> None:
        cfg = self.config
        obj = await self.store.wait_for(oid, cfg.stall_timeout)
        status = pull_status(obj, offset, chunk)
        size = obj.size if obj is not None else 0
        header = np.frombuffer(p.PULL_RESPONSE.pack(status, 0, size), np.uint8).copy()
        try:
            sending = asyncio.ensure_future(ep.send(header, tag=(p.TAG_RESPONSE, transfer_id)))
            if status != p.PULL_OK or obj is None:
                await timed(sending, cfg.stall_timeout, "peer", "serve")
                return
            # The first chunks follow the header without waiting for its send to complete (one
            # event-loop wake-up less per pull: 128 KiB pulls took 3-5 ms before, see bench/p2p.py).
            with obj.being_served():
                sent, while_incomplete = await self._stream(ep, obj, transfer_id, offset, chunk, sending)
        except asyncio.CancelledError:
            return
        except HopliteError as exc:
            log.debug("serving %s (transfer %d) stopped: %s", oid, transfer_id, exc)
            if self.on_served is not None and status == p.PULL_OK:
                self.on_served(transfer_id, 0, 0, True)
            return
        if self.on_served is not None:
            self.on_served(transfer_id, sent, while_incomplete, False)

    async def _stream(
        self,
        ep: Any,
        obj: LocalObject,
        transfer_id: int,
        offset: int,
        chunk: int,
        header: asyncio.Future[Any],
    ) -> tuple[int, int]:
        cfg = self.config
        window: set[asyncio.Future[Any]] = {header}
        sent = 0
        while_incomplete = 0
        started = time.monotonic()
        pos = offset
        faults = INJECTOR.armed
        try:
            while pos < obj.size:
                end = min(pos + chunk, obj.size, obj.buffer.piece_end(pos))
                if faults:
                    INJECTOR.check("serve", obj.object_id.hex(), pos, obj.size)
                    cut = INJECTOR.next_offset("serve", obj.object_id.hex(), pos, obj.size)
                    end = end if cut is None else min(end, cut)
                if obj.progress < end:
                    await obj.wait_progress(end, cfg.stall_timeout)
                    while_incomplete += end - pos
                elif not obj.complete:
                    if obj.error is not None:
                        raise obj.error  # withdrawn: not one more chunk of it
                    while_incomplete += end - pos
                if cfg.send_rate_limit:
                    ahead = (sent + end - pos) / cfg.send_rate_limit - (time.monotonic() - started)
                    if ahead > 0:
                        await asyncio.sleep(ahead)  # traffic shaping, not synchronisation
                while len(window) >= cfg.chunks_in_flight:
                    done, window = await timed(
                        asyncio.wait(window, return_when=asyncio.FIRST_COMPLETED),
                        cfg.stall_timeout,
                        "peer",
                        "send",
                    )
                    for fut in done:
                        fut.result()
                tag = p.chunk_tag(transfer_id, pos, end)
                if obj.buffer.on_device and not self._device_wire:
                    data = obj.buffer.host_chunk(pos, end)  # copied out while earlier chunks fly
                    self.staged_sent += end - pos
                else:
                    data = obj.buffer.view(pos, end)  # host memory, or device memory for cuda_copy
                window.add(asyncio.ensure_future(ep.send(data, tag=tag)))
                sent += end - pos
                pos = end
            if window:
                await timed(asyncio.gather(*window), cfg.stall_timeout, "peer", "send")
                window = set()
            if faults:
                INJECTOR.check("serve", obj.object_id.hex(), pos, obj.size)
            # Eager sends complete once buffered locally; the receiver's ack says it has the bytes,
            # so closing this node afterwards cannot cut the transfer short.
            ack = np.empty(p.ACK.size, np.uint8)
            await timed(ep.recv(ack, tag=(p.TAG_ACK, transfer_id)), cfg.stall_timeout, "peer", "ack")
        except Exception as exc:
            raise as_transport_error(exc, "peer", "send") from exc
        finally:
            for fut in window:
                forget(fut)
        return sent, while_incomplete

    # ------------------------------------------------------------ receiving side
    async def _peer(self, host: str, port: int) -> _Peer:
        address = f"{host}:{port}"
        peer = self._peers.get(address)
        if peer is not None and not peer.ep.closed:
            return peer
        pending = self._connecting.get(address)
        if pending is None:
            # Its own task: a pull that gives up (cancelled) never interrupts ucxx's endpoint set-up
            # half way (a cancelled create_endpoint was seen to crash the process later, in the
            # garbage collector); it ends within connect_timeout either way, and others share it.
            pending = asyncio.ensure_future(self._connect(host, port, address))
            self._connecting[address] = pending
            pending.add_done_callback(lambda done: self._connected(address, done))
        return await asyncio.shield(pending)

    def _connected(self, address: str, done: asyncio.Future[_Peer]) -> None:
        if self._connecting.get(address) is done:
            del self._connecting[address]
        if done.cancelled():
            return
        if done.exception() is None:
            peer = done.result()
            if self._closed:
                with contextlib.suppress(Exception):
                    peer.ep.abort()
            else:
                self._peers[address] = peer

    async def _connect(self, host: str, port: int, address: str) -> _Peer:
        ucxx = ucxx_module()
        timeout = self.config.connect_timeout
        self.connections_opened += 1
        try:
            ep = await asyncio.wait_for(ucxx.create_endpoint(host, port), timeout)
        except Exception as exc:
            raise unreachable(address, exc) from exc
        try:
            nonce = np.empty(auth.NONCE_BYTES, np.uint8)
            await timed(ep.recv(nonce, tag=p.TAG_AUTH), timeout, address, "auth")
            mine = auth.new_nonce()
            proof = auth.mac(self.token, b"client", nonce.tobytes(), mine)
            answer = np.frombuffer(mine + proof, np.uint8).copy()
            await timed(ep.send(answer, tag=p.TAG_AUTH), timeout, address, "auth")
            theirs = np.empty(auth.MAC_BYTES, np.uint8)
            try:
                await timed(ep.recv(theirs, tag=p.TAG_AUTH), timeout, address, "auth")
            except PeerLostError as exc:
                raise AuthenticationError(
                    f"peer {address} closed the connection during authentication: it does not "
                    "accept our token (or it died)",
                    peer=address,
                    cause="closed",
                ) from exc
            if not auth.verify(self.token, b"server", nonce.tobytes(), mine, theirs.tobytes()):
                raise AuthenticationError(
                    f"peer {address} failed authentication: it does not know our token", peer=address
                )
            warm = np.empty(WARMUP_BYTES, np.uint8)
            await timed(ep.recv(warm, tag=p.TAG_WARMUP), timeout, address, "warmup")
        except BaseException:
            with contextlib.suppress(Exception):
                ep.abort()
            raise
        return _Peer(ep, address)

    async def _send_ack(self, peer: _Peer, ack: np.ndarray[Any, Any], transfer_id: int) -> None:
        try:
            await timed(
                peer.ep.send(ack, tag=(p.TAG_ACK, transfer_id)),
                self.config.stall_timeout,
                peer.address,
                "ack",
            )
        except HopliteError as exc:
            log.debug("ack of transfer %d to %s failed: %s", transfer_id, peer.address, exc)
            self._evict(peer)

    def _evict(self, peer: _Peer) -> None:
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        with contextlib.suppress(Exception):
            peer.ep.abort()

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
        """Stream ``obj`` from a peer into ``obj.buffer``, starting at ``obj.progress``.

        Advances ``obj.progress`` as chunks land (in order), so this node can serve the bytes it has
        to others while it is still receiving (``on_chunk`` sees each first, on the loop). Raises
        :class:`TransportError` subclasses on failure (the bytes already received stay valid and a
        later pull resumes after them). Failing ``abort`` stops it with that error.
        """
        cfg = self.config
        peer = await self._peer(host, port)
        address = peer.address
        ep = peer.ep
        start = obj.progress
        chunk = self.chunk_size(address, chunk_bytes)
        request = p.PULL_REQUEST.pack(
            p.PULL_MAGIC, p.PROTOCOL_VERSION, transfer_id, start, chunk, obj.object_id.binary()
        )
        header = np.empty(p.PULL_RESPONSE.size, np.uint8)
        window: list[tuple[int, asyncio.Future[Any]]] = []
        # Chunks of a copy in device memory land in host buffers first (UCX's TCP transport
        # receives into host memory), each copied to the device as it lands, while later chunks
        # are still on the wire: by chunk end, its start and its host buffer. With UCX's CUDA
        # transports (HOPLITE_UCX_CUDA), UCX receives into the device memory itself.
        staged: dict[int, tuple[int, np.ndarray[Any, Any]]] = {}
        backend = obj.buffer.backend if obj.buffer.on_device and not self._device_wire else None
        pos = start
        failed = obj.failure()
        stops = [failed] if abort is None else [failed, abort]
        if INJECTOR.armed:
            INJECTOR.check("receive", obj.object_id.hex(), start, obj.size)

        def post_chunks() -> None:
            nonlocal pos
            while pos < obj.size and len(window) < cfg.chunks_in_flight:
                end = min(pos + chunk, obj.size, obj.buffer.piece_end(pos))
                tag = p.chunk_tag(transfer_id, pos, end)
                if backend is None:
                    target = obj.buffer.view(pos, end)
                else:
                    target = backend.staging(end - pos)
                    staged[end] = (pos, target)
                window.append((end, asyncio.ensure_future(ep.recv(target, tag=tag))))
                pos = end

        sending: asyncio.Future[Any] | None = None
        try:
            resp = asyncio.ensure_future(ep.recv(header, tag=(p.TAG_RESPONSE, transfer_id)))
            window.append((0, resp))
            # The response is awaited at once: the request's send completes meanwhile (a failed
            # send fails the wait through ``send_failed``).
            sending = asyncio.ensure_future(
                ep.send(np.frombuffer(request, np.uint8).copy(), tag=p.TAG_REQUEST)
            )
            send_failed = failure_of(sending)
            try:
                await landed(resp, [*stops, send_failed], cfg.stall_timeout, address, "pull response")
            finally:
                forget(send_failed)
            window.clear()
            await sending  # complete: the response to it arrived
            status, _, size = p.PULL_RESPONSE.unpack(header.tobytes())
            refused = refusal(status, size, obj, address)
            if refused is not None:
                raise refused
            # Chunks are posted only after an OK: posting them with the request would save a round
            # trip, but a refusal would then leave receives posted that ucxx cannot cancel short
            # of closing the endpoint (and reconnecting costs far more than the round trip).
            post_chunks()
            data_started = time.monotonic()
            while window:
                end, fut = window[0]
                await landed(fut, stops, cfg.stall_timeout, address, "receive")
                window.pop(0)
                if backend is not None:
                    begin, host_bytes = staged.pop(end)
                    backend.from_host(obj.buffer.view(begin, end), host_bytes)
                    self.staged_received += end - begin
                if on_chunk is not None:
                    on_chunk(obj.progress, end)
                obj.advance(end)
                if INJECTOR.armed:
                    INJECTOR.check("receive", obj.object_id.hex(), obj.progress, obj.size)
                post_chunks()
            self.rates.record(address, obj.size - start, time.monotonic() - data_started)
            # The get does not wait for the ack to be sent: a lost ack only makes the sender
            # report a failed serve after its stall timeout, never a wrong result here.
            ack = np.frombuffer(p.ACK.pack(obj.progress), np.uint8).copy()
            self._spawn_served(self._send_ack(peer, ack, transfer_id))
        except HopliteError as exc:
            if isinstance(exc, PeerLostError):
                self._evict(peer)
            raise
        except Exception as exc:
            self._evict(peer)
            raise as_transport_error(exc, address, "receive") from exc
        finally:
            obj.forget_failure(failed)
            if sending is not None:
                forget(sending)
            if window:
                # An endpoint with abandoned posted receives cannot be reused safely.
                self._evict(peer)
                for _, fut in window:
                    fut.cancel()
                await asyncio.gather(*(f for _, f in window), return_exceptions=True)


__all__ = ["WARMUP_BYTES", "UcxDataPlane"]
