"""What the libraries built on the node need below its object API: the process's I/O thread, a
barrier that deletes objects as it passes, receiving into the caller's array while serving it,
withdrawing objects served from memory the caller takes back, and a hook on a directory restart.
:mod:`hoplite_gpu.collective` and :mod:`hoplite_gpu.weights` use them; they are
:class:`~hoplite_gpu.node.Node` methods."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any

from .. import protocol as p
from ..config import Config
from ..dataplane.base import ChunkCallback, DataPlane
from ..errors import (
    HopliteError,
    HopliteTimeoutError,
    InvalidArgumentError,
    ObjectDeletedError,
    TransportError,
)
from ..iothread import IOThread
from ..memory import LocalObject, LocalStore, write_at
from ..object_id import ObjectID
from .arguments import route_of
from .channel import Channels
from .fetch import Fetcher, check_out, receivable
from .puts import Putter
from .session import DirectorySession
from .vertex import VertexRunner


class Primitives:
    """The methods of :class:`~hoplite_gpu.node.Node` for libraries built on it (a part of it)."""

    config: Config
    _io: IOThread
    _session: DirectorySession
    _store: LocalStore
    _fetcher: Fetcher
    _putter: Putter
    _channels: Channels
    _rejoin_callbacks: set[Callable[[], None]]
    _vertices: VertexRunner
    _data: DataPlane

    def _check_open(self) -> None:  # (the node's)
        raise NotImplementedError

    def _resolve_timeout(self, timeout: float | None) -> float | None:  # (the node's)
        raise NotImplementedError

    async def get_async(
        self,
        object_id: ObjectID,
        timeout: float | None = None,
        out: Any = None,
        *,
        direct: bool = False,
        via: ObjectID | None = None,
    ) -> Any:  # (the node's)
        raise NotImplementedError

    @property
    def io(self) -> IOThread:
        """The process's I/O thread, which runs all of this node's network work: ``io.run(coro)``
        runs a coroutine there and waits for it (from any other thread), ``io.submit(coro)``
        schedules it (a :class:`concurrent.futures.Future`), ``await io.run_async(coro)`` awaits it
        from another event loop; ``io.in_thread()`` tells whether the caller runs there. A
        library's own coroutines run there may await the node's ``*_async`` methods."""
        return self._io

    def barrier(
        self,
        barrier_id: ObjectID,
        rank: int,
        count: int,
        timeout: float | None = None,
        release: Sequence[ObjectID] = (),
    ) -> None:
        """Member ``rank`` of ``count`` reached barrier ``barrier_id`` (fresh for each barrier, the
        same on every member): returns once all ``count`` have. One message per member, on the
        calling thread's own directory connection where it has one. ``release``: objects this node
        put (not reductions it requested, see :meth:`requested_reduction`; at most
        :data:`~hoplite_gpu.protocol.MAX_BARRIER_RELEASE`) that the directory deletes once every
        member has come, and this node's copies with them: a group's objects that every member is
        past, deleted with no message of their own.

        Raises:
            InvalidArgumentError: bad arguments.
            HopliteTimeoutError: members did not come within ``timeout`` (None:
                ``Config.default_get_timeout``, 0 there: forever); ``waiting_for_ranks`` names the
                first of them, ``waiting`` counts them all. Nothing is released.
        """
        self._check_open()
        bid, freed = _barrier_arguments(barrier_id, rank, count, release)
        wait = self._resolve_timeout(timeout)
        reply = self._channels.barrier(bid, rank, count, wait, freed)
        reply = reply or self._io.run(self._session.barrier(bid, rank, count, wait, freed))
        _passed(barrier_id, count, reply, wait)
        if freed:
            self._putter.drop_released(freed, self._io)

    async def barrier_async(
        self,
        barrier_id: ObjectID,
        rank: int,
        count: int,
        timeout: float | None = None,
        release: Sequence[ObjectID] = (),
    ) -> None:
        """Async twin of :meth:`barrier`."""
        self._check_open()
        bid, freed = _barrier_arguments(barrier_id, rank, count, release)
        wait = self._resolve_timeout(timeout)
        reply = await self._io.run_async(self._session.barrier(bid, rank, count, wait, freed))
        _passed(barrier_id, count, reply, wait)
        if freed:
            self._putter.drop_released(freed, self._io)

    def requested_reduction(self, reduction_id: ObjectID) -> bool:
        """Whether this node requested the reduction ``reduction_id`` and keeps its request (to
        send it again to a restarted directory) until it deletes it with :meth:`delete`."""
        return self._session.requested(reduction_id.binary())

    async def receive_into_async(
        self,
        object_id: ObjectID,
        out: Any,
        received: list[LocalObject],
        timeout: float | None = None,
        *,
        direct: bool = False,
        via: ObjectID | None = None,
    ) -> Any:
        """``get_async(object_id, timeout, out, direct=direct, via=via)``, except that a copy
        pulled over the data plane into a C-contiguous NumPy ``out`` is received straight into it
        and appended to ``received``: it stays in this node's store, served to other readers from
        ``out``'s memory, until :meth:`withdraw`, which must come before ``out`` changes (the
        results of a sharded allreduce, read along a ring while being received)."""
        self._check_open()
        if not receivable(check_out(out)) or self._fetcher.indexed(object_id) is not None:
            return await self.get_async(object_id, timeout=timeout, out=out, direct=direct, via=via)
        wait = self._resolve_timeout(timeout)
        fetch = self._fetcher.get_into(object_id, wait, out, route_of(direct, via), received)
        return await self._io.run_async(fetch)

    def withdraw(
        self,
        object_ids: Sequence[ObjectID],
        copies: Sequence[LocalObject] = (),
        error: HopliteError | None = None,
    ) -> list[LocalObject]:
        """Stop serving memory the caller takes back, now: this node's copies of ``object_ids``
        and ``copies`` (received in place, :meth:`receive_into_async`) fail with ``error`` (None:
        :class:`~hoplite_gpu.errors.ObjectDeletedError`) and leave the local store. Pulls of them
        stop at their next chunk; the directory learns they are gone from the next reader they are
        offered to (delete those this node put, too), and so do the results reduce vertices here
        wrote over ``object_ids`` put ``consumable``. Call it on the I/O thread (:attr:`io`).
        Returns the objects withdrawn: ``await obj.wait_unserved(seconds)`` waits for their pulls."""
        held = [obj for obj in map(self._store.get, object_ids) if obj is not None] + list(copies)
        held += [obj for obj in self._vertices.outputs_over(list(object_ids)) if obj not in held]
        for obj in held:
            oid = obj.object_id
            obj.fail(error or ObjectDeletedError(f"object {oid} was withdrawn", object_id=oid.hex()))
            if self._store.get(oid) is obj:
                self._store.remove(oid)
        return held

    def keep_served(self, copies: Sequence[LocalObject]) -> list[LocalObject]:
        """Move these copies (received or computed in place, in memory the caller takes back)
        into the store's own memory, where they stay and are served to readers that still need
        them; returns those moved: one served right now is not (withdraw it). Call it on the I/O
        thread (:attr:`io`)."""
        kept = []
        for obj in copies:
            if obj.serving or obj.error is not None or self._store.get(obj.object_id) is not obj:
                continue
            memory = self._store.memory
            buffer = memory.host(obj.size, populate=False)
            write_at(buffer.host, 0, obj.buffer.host)
            old, obj.buffer = obj.buffer, buffer
            memory.release(old)
            kept.append(obj)
        return kept

    @property
    def host_key(self) -> str:
        """What sets this node's host's shared memory apart (see :func:`hoplite_gpu.memory.shm.host_key`):
        two nodes with the same non-empty key map each other's segments; "" without shared memory."""
        return self._session._host_key

    @property
    def data_plane_kind(self) -> str:
        """The data plane this node runs (``Config.data_plane``): ``tcp`` (the kernel's sockets)
        or ``ucx``."""
        from ..dataplane.tcp import TcpDataPlane

        return "tcp" if isinstance(self._data, TcpDataPlane) else "ucx"

    def lend_unlisted(self, obj: LocalObject) -> None:
        """Serve ``obj`` (memory the caller owns, filling or complete) to pulls that name its id
        (:meth:`pull_unlisted`), without telling the directory: no reader finds it by a lookup
        and nothing of it is ever repaired. Take it back with :meth:`withdraw`. Call it on the
        I/O thread (:attr:`io`)."""
        self._store.add(obj)

    async def pull_unlisted(
        self,
        host: str,
        port: int,
        obj: LocalObject,
        on_chunk: ChunkCallback | None = None,
        chunk_bytes: int = 0,
    ) -> None:
        """Fill ``obj`` (not in this node's store) from the node whose data plane is at
        ``host:port``, which holds an object of that id (listed or lent unlisted), as its bytes
        come, advancing ``obj``'s progress (``on_chunk`` sees each chunk first, on the thread
        that received it: see :data:`~hoplite_gpu.dataplane.base.ChunkCallback`); the directory
        hears nothing of it; ``chunk_bytes`` as that method's. Raises as
        :meth:`hoplite_gpu.dataplane.base.DataPlane.pull` does. Call it on the I/O thread."""
        await self._data.pull(host, port, obj, 0, on_chunk=on_chunk, chunk_bytes=chunk_bytes)

    def hand_over(self, host: str, port: int, key: ObjectID) -> socket.socket:
        """A new connection to the TCP data plane at ``host:port`` (another node's), authenticated
        with this node's token and handed over there under ``key``, for a library's own stream
        (:mod:`hoplite_gpu.dataplane.wire`): the caller owns it (blocking) and closes it; the
        other node's library takes it with :meth:`take_handed`. Call it off the I/O thread.
        Raises ``PeerLostError`` (unreachable) or ``TransportError`` (not taken, or this node
        runs UCX)."""
        from ..dataplane.tcp import TcpDataPlane
        from ..dataplane.wire import hand_over

        if not isinstance(self._data, TcpDataPlane):
            raise TransportError("connections are handed over by the TCP data plane only")
        return self.io.run(hand_over(self._data, host, port, key))

    def take_handed(self, key: ObjectID, timeout: float) -> socket.socket | None:
        """The connection another node handed over to this one under ``key`` (:meth:`hand_over`),
        waiting up to ``timeout`` seconds for it; None if none came (or this node runs UCX). The
        caller owns it."""
        handed = getattr(self._data, "handed", None)
        return None if handed is None else handed.take(key, timeout)

    def drop_handed(self, keys: list[ObjectID]) -> None:
        """Close the connections handed over to this node under ``keys`` not taken yet."""
        handed = getattr(self._data, "handed", None)
        if handed is not None:
            handed.drop(keys)

    def add_rejoin_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever this node rejoins a restarted directory, on the I/O thread
        (it must not block), before the node tells the directory which copies it holds: a
        library withdraws there what the restarted directory must not rebuild from."""
        self._rejoin_callbacks.add(callback)

    def remove_rejoin_callback(self, callback: Callable[[], None]) -> None:
        """Stop calling ``callback`` (see :meth:`add_rejoin_callback`); no-op if it is not there."""
        self._rejoin_callbacks.discard(callback)


def _barrier_arguments(
    barrier_id: Any,
    rank: Any,
    count: Any,
    release: Sequence[ObjectID],
) -> tuple[bytes, list[bytes]]:
    if not isinstance(barrier_id, ObjectID):
        raise InvalidArgumentError("barrier_id must be an ObjectID", argument="barrier_id")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= p.MAX_BARRIER_MEMBERS:
        raise InvalidArgumentError(f"count must be an int in 1..{p.MAX_BARRIER_MEMBERS}", argument="count")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < count:
        raise InvalidArgumentError(f"rank must be an int in 0..{count - 1}", argument="rank")
    if len(release) > p.MAX_BARRIER_RELEASE:
        raise InvalidArgumentError(f"at most {p.MAX_BARRIER_RELEASE} ids to release", argument="release")
    return barrier_id.binary(), [oid.binary() for oid in release]


def _passed(barrier_id: ObjectID, count: int, reply: p.BarrierReply, timeout: float | None) -> None:
    """Raise unless the directory's ``reply`` says every member came."""
    if reply.status != "ok":
        named = f" (the first {len(reply.missing)} named)" if reply.waiting > len(reply.missing) else ""
        raise HopliteTimeoutError(
            f"barrier {barrier_id.hex()[:12]}: {reply.waiting} of {count} members did not come "
            f"within {timeout} s{named}",
            operation="barrier",
            timeout=timeout,
            waiting_for_ranks=list(reply.missing),
            waiting=reply.waiting,
        )
