"""How a node puts an object: the local copy, then the directory's record, with large copies made
while receivers already stream the object.

A large contiguous array is registered with the directory first; its bytes are then copied into the
store's buffer on a worker thread in :data:`PUT_COPY_BYTES` steps, each advancing the object's
progress, so a receiver that was waiting in ``get`` pulls behind the copy (a pull serves only bytes
already present). ``put`` returns once the copy is done (the caller may then reuse its array); the
shared-memory segment is announced with ``CopyAdded`` then, so same-host readers map a complete copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import protocol as p
from ..config import Config
from ..dtypes import dtype_to_wire
from ..errors import (
    InvalidArgumentError,
    ObjectExistsError,
    ObjectTooLargeError,
    ProtocolError,
    as_hoplite_error,
    from_kind,
)
from ..iothread import IOThread
from ..memory import (
    MEMORY_DEVICE,
    Buffer,
    BufferKind,
    CallerArray,
    LocalObject,
    LocalStore,
    digest_of,
    write_at,
)
from ..object_id import ObjectID
from .channel import ChannelLost, Channels
from .session import DirectorySession

#: Bytes a put copies at a time when it copies after publishing (see :meth:`Putter.prepare`).
PUT_COPY_BYTES = 2 << 20


def _copy_advancing(
    loop: asyncio.AbstractEventLoop, src: np.ndarray[Any, Any], obj: LocalObject, stop: threading.Event
) -> None:
    """Copy ``src`` into ``obj.buffer`` chunk by chunk (on a worker thread), advancing ``obj``'s
    progress on ``loop`` after each chunk; stops early once ``stop`` is set or ``obj`` is dropped."""
    pos = 0
    while pos < obj.size and not stop.is_set() and obj.error is None:
        end = min(pos + PUT_COPY_BYTES, obj.size)
        write_at(obj.buffer.host, pos, src[pos:end])
        loop.call_soon_threadsafe(obj.advance, end)
        pos = end


def _check_reply(oid: ObjectID, reply: p.Message) -> None:
    """Raise what the directory's reply to the put of ``oid`` says went wrong."""
    if not isinstance(reply, p.PutReply):
        raise ProtocolError(f"unexpected reply to put: {reply.TYPE}")
    if reply.error:
        raise from_kind(reply.error_kind, reply.error, object_id=oid.hex())


def _copy_bytes(dst: np.ndarray[Any, Any], host: np.ndarray[Any, Any]) -> None:
    """Copy ``host``'s bytes, item by item in C order, into the flat ``uint8`` ``dst``: every byte
    of each item, a structured dtype's padding included (an assignment of the array copies field
    by field and leaves the padding as ``dst`` had it: a removed object's bytes, in a recycled
    buffer). Works for any strides: each item is viewed as ``itemsize`` bytes of its own."""
    items = host[..., np.newaxis].view(np.uint8)  # shape + (itemsize,): a length-1 axis may change size
    np.copyto(dst.reshape(items.shape), items)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A put ready to publish: the local object, the caller's bytes still to copy into it (None:
    copied already, or kept without a copy), and whether ``put`` returns before that copy ends
    (``copy=False`` into a segment)."""

    obj: LocalObject
    pending: np.ndarray[Any, Any] | None
    detached: bool = False


class Putter:
    """The put side of a node.

    Args:
        store: The node's local store (and through it the node's memory).
        config: Limits and timeouts.
        session: The node's directory link.
        delete: Deletes an object (a put published, then failed, is withdrawn).
        in_background: Runs a coroutine nobody waits for (its failure is only logged).
    """

    def __init__(
        self,
        store: LocalStore,
        config: Config,
        session: DirectorySession,
        delete: Callable[[ObjectID], Coroutine[Any, Any, bool]],
        in_background: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self._store = store
        self._memory = store.memory
        self._config = config
        self._session = session
        self._delete = delete
        self._in_background = in_background

    def prepare(
        self,
        array: Any,
        object_id: ObjectID | None,
        copy: bool,
        pinned: bool = False,
        digest: bool = True,
        borrow: bool = False,
        consumable: bool = False,
    ) -> Prepared:
        """The local object for a put, and the bytes still to copy into it.

        A large contiguous array is copied after the put is published (:meth:`put`), so receivers
        start while the copy runs; its digest is taken from the caller's array first. Without
        ``copy``, on a node with shared memory, a large contiguous array is copied into a segment
        all the same, after ``put`` returned (:attr:`Prepared.detached`): processes on this host
        then map it instead of pulling it over the data plane (async SGD's gradients, read by a
        parameter server on the same machine); not where the directory said no other node is on
        this host (:attr:`Memory.shared_with_others <hoplite_gpu.memory.Memory.shared_with_others>`).
        With ``pinned``, a host array's copy (always made) is in page-locked memory
        (:meth:`Memory.page_locked <hoplite_gpu.memory.Memory.page_locked>`).
        Without ``digest`` the object carries none (as device objects do): for ids that are never
        put twice, such as a group's, where hashing every byte on the I/O thread buys nothing.
        ``borrow`` (with ``copy`` False) keeps a contiguous array itself or copies it before the
        put returns, never after: nothing reads the caller's array once the object is withdrawn
        but the pulls being served (a collective's inputs, see ``collective.operations._sharded_allreduce``).
        ``consumable`` marks a host object a reduce vertex here may write its output over
        (:attr:`LocalObject.consumable <hoplite_gpu.memory.LocalObject.consumable>`).
        """
        if object_id is not None and not isinstance(object_id, ObjectID):
            raise InvalidArgumentError(
                f"object_id must be an ObjectID, got {type(object_id).__name__}", argument="object_id"
            )
        if not isinstance(pinned, bool):
            raise InvalidArgumentError(f"pinned must be a bool, got {pinned!r}", argument="pinned")
        if not isinstance(consumable, bool):
            raise InvalidArgumentError(
                f"consumable must be a bool, got {consumable!r}", argument="consumable"
            )
        entered = CallerArray.of(array)
        if entered.on_device:
            # Borrowed on a node that shares: copied device to device into memory same-host
            # readers open (CUDA IPC), as a host array is copied into a segment; kept, they
            # would pull it staged through host memory at a few GB/s (bench/pages/gpu.md).
            copy = copy or (borrow and self._memory.shared_with_others)
            return Prepared(self._device_object(entered, object_id, copy), None)
        if pinned:
            self._memory.check_page_locking()
        copy = copy or pinned
        host = entered.host()
        dtype = dtype_to_wire(host.dtype)
        nbytes = int(host.nbytes)
        self._check_size(nbytes)
        contiguous = host.flags.c_contiguous
        shared = self._memory.pool.shared_min_bytes
        # (Alone on its host, protocol.HostPeers, the node has nobody to map a copy: none made.)
        others = self._memory.shared_with_others
        detached = not copy and contiguous and others and nbytes >= max(shared, 2 * PUT_COPY_BYTES)
        if detached and borrow:
            copy, detached = True, False
        flat: Any = host.reshape(-1).view(np.uint8) if contiguous else None
        pending: np.ndarray[Any, Any] | None = None
        if copy or not contiguous or detached:
            later = contiguous and nbytes >= 2 * PUT_COPY_BYTES  # copied after publishing, whole
            if pinned:
                buffer = self._memory.page_locked(nbytes)
            else:
                buffer = self._memory.host(nbytes, populate=not later)
            if detached and buffer.kind is not BufferKind.SEGMENT:  # /dev/shm is full: keep the caller's
                self._memory.release(buffer)
                buffer, detached = Buffer.wrap(flat), False
            elif later:
                pending = flat
            elif nbytes:
                _copy_bytes(buffer.array, host)
        else:
            buffer = Buffer.wrap(flat)
        obj = LocalObject(
            object_id=object_id or ObjectID.random(),
            size=nbytes,
            dtype=dtype,
            shape=tuple(int(s) for s in host.shape),
            digest=digest_of(buffer.array if pending is None else pending) if digest else b"",
            buffer=buffer,
            progress=nbytes if pending is None else 0,
            owner=True,
            consumable=consumable,
        )
        return Prepared(obj, pending, detached)

    def _device_object(self, array: CallerArray, object_id: ObjectID | None, copy: bool) -> LocalObject:
        """The local object of a device array: its bytes stay in device memory (copied device to
        device, or kept as they are with ``copy=False`` when contiguous). Its digest is left
        empty: hashing would copy every byte to host, and the directory compares content only
        where both sides know a digest."""
        dt, shape = array.describe()
        dtype = dtype_to_wire(dt)
        nbytes = dt.itemsize * math.prod(shape)
        self._check_size(nbytes)
        buffer = self._memory.keep_device(array, copy)
        return LocalObject(
            object_id=object_id or ObjectID.random(),
            size=nbytes,
            dtype=dtype,
            shape=tuple(int(s) for s in shape),
            digest=b"",
            buffer=buffer,
            progress=nbytes,
            owner=True,
            memory=MEMORY_DEVICE,
        )

    def _check_size(self, nbytes: int) -> None:
        if nbytes > self._config.max_object_bytes:
            raise ObjectTooLargeError(
                f"object of {nbytes} bytes exceeds Config.max_object_bytes={self._config.max_object_bytes}",
                size=nbytes,
                limit=self._config.max_object_bytes,
            )

    async def put(self, prepared: Prepared) -> ObjectID:
        """Publish the object; with bytes pending, copy them into it meanwhile (on a worker
        thread, advancing its progress chunk by chunk, so pulls of it stream behind the copy) and
        return once both are done (once it is published, if detached). Its shared-memory segment
        is announced once the copy is done."""
        obj, pending = prepared.obj, prepared.pending
        oid = obj.object_id
        existing = self._store.get(oid)
        if existing is not None:
            # This copy is not kept: nor its page-locking, nor its export (its pooled memory is the
            # caller's array or goes with it).
            self._memory.drop(obj.buffer)
            same = existing.digest == obj.digest or not (existing.digest and obj.digest)
            if same and existing.dtype == obj.dtype and existing.shape == obj.shape:
                if existing.owner and not existing.complete:  # the same put, still copying
                    await existing.wait_progress(existing.size, self._config.request_timeout)
                if existing.complete:
                    return oid
            raise ObjectExistsError(
                f"object {oid} already exists on this node with different content; use a new "
                "ObjectID or delete it first",
                object_id=oid.hex(),
            )
        inline = obj.buffer.to_host().tobytes() if obj.size <= self._session.inline_threshold_bytes else None
        self._store.add(obj)
        stop = threading.Event()
        copying = None
        registered = False
        if pending is not None:
            loop = asyncio.get_running_loop()
            copying = loop.run_in_executor(None, _copy_advancing, loop, pending, obj, stop)
            segment = self._memory.segment_name(obj.buffer)  # published once the copy is done
        else:
            segment = self._publish(obj)
        try:
            await self._register(obj, inline, segment, copying is not None and bool(segment))
            registered = True
            self._memory.index(obj.buffer, oid.binary())
            if copying is not None and prepared.detached:
                self._in_background(self._copied(obj, copying, stop))
                return oid
            if copying is not None:
                await asyncio.shield(copying)  # the caller may reuse its array once put returns
        except BaseException as exc:
            await self._failed(obj, copying, stop, exc, registered)
            raise
        if copying is not None:
            self._announce(obj)
        return oid

    def _request(
        self, obj: LocalObject, inline: bytes | None, segment: str, copying: bool
    ) -> Callable[[int], p.PutRequest]:
        """The put request of ``obj``, given its request id."""
        return lambda rid: p.PutRequest(
            request_id=rid,
            object_id=obj.object_id.binary(),
            size=obj.size,
            dtype=obj.dtype,
            shape=list(obj.shape),
            digest=obj.digest,
            inline=inline,
            segment=segment,
            copying=copying,
            memory=obj.memory,
        )

    async def _register(
        self, obj: LocalObject, inline: bytes | None, segment: str = "", copying: bool = False
    ) -> None:
        """Record ``obj`` in the directory (raises what it refused)."""
        reply = await self._session.request(
            self._request(obj, inline, segment, copying), self._config.request_timeout
        )
        _check_reply(obj.object_id, reply)

    # ------------------------------------------------------------ on a caller's channel
    def put_on_channel(self, prepared: Prepared, channels: Channels, io: IOThread) -> ObjectID | None:
        """:meth:`put` from the caller's thread, on its channel (:mod:`.channel`), of a host
        object the directory stores inline; None for any other, or one already here or awaited
        here (put it with :meth:`put`). The object enters the store before the request leaves, as
        in :meth:`put`. A put the channel lost on the way is made again through the node's
        connection."""
        obj = prepared.obj
        oid = obj.object_id
        if (
            not channels.usable()
            or prepared.pending is not None
            or obj.memory == MEMORY_DEVICE
            or obj.size > self._session.inline_threshold_bytes
        ):
            return None
        inline = obj.buffer.to_host().tobytes()
        if not self._store.add_from_caller(obj):
            return None
        try:
            try:
                reply = channels.ask(self._request(obj, inline, "", False), self._config.request_timeout)
            except ChannelLost:
                io.run(self._register(obj, inline))
            else:
                _check_reply(oid, reply)
        except BaseException as exc:
            # As put does on failure: one that may have been recorded as the reply was lost is not
            # withdrawn either.
            withdrawn = io.submit(self._failed(obj, None, None, exc, registered=False))
            if isinstance(exc, Exception):  # (not on an interrupt) gone from the store on return
                withdrawn.result(self._config.request_timeout)
            raise
        return oid

    def delete_on_channel(self, oid: ObjectID, channels: Channels, io: IOThread) -> bool | None:
        """``Node.delete`` from the caller's thread, on its channel (:mod:`.channel`), of an
        object whose local copy, if any, can leave the store from this thread
        (:meth:`LocalStore.remove_from_caller`) and that is not a reduction this node requested;
        None for any other, or when the channel is lost (delete it through the node's
        connection: a delete made twice answers ``deleted`` False the second time)."""
        if not channels.usable() or self._session.requested(oid.binary()):
            return None
        if not self._store.removable_from_caller(oid):
            return None
        try:
            request = functools.partial(p.DeleteRequest, object_id=oid.binary())
            reply = channels.ask(lambda rid: request(request_id=rid), self._config.request_timeout)
        except ChannelLost:
            return None
        if not isinstance(reply, p.DeleteReply):
            raise ProtocolError(f"unexpected reply to delete: {reply.TYPE}")
        if not reply.kept and not self._store.remove_from_caller(oid):
            io.run(self._remove(oid))  # it changed meanwhile (e.g. a pull of it began): on the loop
        return reply.deleted

    async def _remove(self, *oids: ObjectID) -> None:
        for oid in oids:
            self._store.remove(oid)

    def drop_released(self, oids: Sequence[bytes], io: IOThread) -> None:
        """Drop the local copies of objects a barrier released (the directory deleted them): from
        this thread where they can leave the store from it, the others on the loop, unawaited."""
        rest = [oid for oid in map(ObjectID, oids) if not self._store.remove_from_caller(oid)]
        if rest:
            io.submit(self._remove(*rest))

    async def _copied(self, obj: LocalObject, copying: asyncio.Future[None], stop: threading.Event) -> None:
        """The end of a detached put's copy."""
        try:
            await asyncio.shield(copying)
        except BaseException as exc:
            await self._failed(obj, copying, stop, exc, registered=True)
            raise
        self._announce(obj)

    def _announce(self, obj: LocalObject) -> None:
        """The copy into ``obj``'s segment is done: same-host readers may map it."""
        if obj.error is None:
            segment = self._publish(obj)
            if segment:
                self._session.send(p.CopyAdded(object_id=obj.object_id.binary(), segment=segment))

    async def _failed(
        self,
        obj: LocalObject,
        copying: asyncio.Future[None] | None,
        stop: threading.Event | None,
        exc: BaseException,
        registered: bool,
    ) -> None:
        """Undo a put that failed (or was cancelled): stop its copy (if any), drop the local
        object, and withdraw it from the directory if it was published."""
        if stop is not None:
            stop.set()
        if copying is not None:
            with contextlib.suppress(BaseException):
                await asyncio.shield(copying)
        oid = obj.object_id
        if self._store.get(oid) is obj:
            self._store.remove(oid, as_hoplite_error(exc, oid))
        if registered:
            self._in_background(self._delete(oid))

    def _publish(self, obj: LocalObject) -> str:
        """Publish a complete copy for same-host readers; the name they open, or ""."""
        return self._memory.publish(obj.buffer, obj.object_id.binary(), obj.dtype, obj.shape)
