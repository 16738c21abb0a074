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
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import protocol as p
from .config import Config
from .dtypes import dtype_to_wire
from .errors import InvalidArgumentError, ObjectExistsError, ObjectTooLargeError, ProtocolError, from_kind
from .fetch import publish, segment_name
from .memory import buffers, device, ipc, shm
from .memory.buffers import Buffer, digest_of
from .memory.store import MEMORY_DEVICE, LocalObject, LocalStore
from .object_id import ObjectID
from .session import DirectorySession
from .sources import as_hoplite_error

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
        np.copyto(obj.buffer.host[pos:end], src[pos:end])
        loop.call_soon_threadsafe(obj.advance, end)
        pos = end


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
        store: The node's local store.
        config: Limits and timeouts.
        session: The node's directory link.
        delete: Deletes an object (a put published, then failed, is withdrawn).
        in_background: Runs a coroutine nobody waits for (its failure is only logged).
        index: The cluster's key for index links: a device object put here is linked under it
            once the directory registered it (:meth:`hoplite_gpu.memory.ipc.Ticket.index`; "": never).
    """

    def __init__(
        self,
        store: LocalStore,
        config: Config,
        session: DirectorySession,
        delete: Callable[[ObjectID], Coroutine[Any, Any, bool]],
        in_background: Callable[[Coroutine[Any, Any, Any]], None],
        index: str = "",
    ) -> None:
        self._store = store
        self._index = index
        self._config = config
        self._session = session
        self._delete = delete
        self._in_background = in_background

    def prepare(self, array: Any, object_id: ObjectID | None, copy: bool, pinned: bool = False) -> Prepared:
        """The local object for a put, and the bytes still to copy into it.

        A large contiguous array is copied after the put is published (:meth:`put`), so receivers
        start while the copy runs; its digest is taken from the caller's array first. Without
        ``copy``, on a node with shared memory, a large contiguous array is copied into a segment
        all the same, after ``put`` returned (:attr:`Prepared.detached`): processes on this host
        then map it instead of pulling it over the data plane (async SGD's gradients, read by a
        parameter server on the same machine). With ``pinned``, a host array's copy (always made)
        is in page-locked memory, through this process's device backend (:meth:`_page_locked`).
        """
        if object_id is not None and not isinstance(object_id, ObjectID):
            raise InvalidArgumentError(
                f"object_id must be an ObjectID, got {type(object_id).__name__}", argument="object_id"
            )
        if not isinstance(pinned, bool):
            raise InvalidArgumentError(f"pinned must be a bool, got {pinned!r}", argument="pinned")
        if buffers.on_device(array):
            return Prepared(self._device_object(array, object_id, copy), None)
        backend = device.default_backend() if pinned else None
        if backend is not None and not backend.available():
            raise InvalidArgumentError(
                "put(..., pinned=True) needs CuPy and a CUDA device in this process", argument="pinned"
            )
        copy = copy or pinned
        host = buffers.to_host(array)
        dtype = dtype_to_wire(host.dtype)
        nbytes = int(host.nbytes)
        self._check_size(nbytes)
        contiguous = host.flags.c_contiguous
        shared = self._store.pool.shared_min_bytes
        detached = not copy and contiguous and shared > 0 and nbytes >= max(shared, 2 * PUT_COPY_BYTES)
        pooled = copy or not contiguous or detached
        pending: np.ndarray[Any, Any] | None = None
        unpin = None
        if pooled:
            if backend is None:
                data = self._store.pool.allocate(nbytes)
            else:
                data, pooled, unpin = self._page_locked(nbytes, backend)
            if detached and shm.segment_of(data) is None:  # /dev/shm is full: keep the caller's
                self._store.pool.release(data)
                data, pooled, detached = host.reshape(-1).view(np.uint8), False, False
            elif contiguous and nbytes >= 2 * PUT_COPY_BYTES:
                pending = host.reshape(-1).view(np.uint8)
            elif nbytes:
                data.view(host.dtype).reshape(host.shape)[...] = host
        else:
            data = host.reshape(-1).view(np.uint8)
        oid = object_id or ObjectID.random()
        buffer = Buffer.wrap(data, pooled=pooled)
        buffer.unpin = unpin
        obj = LocalObject(
            object_id=oid,
            size=nbytes,
            dtype=dtype,
            shape=tuple(int(s) for s in host.shape),
            digest=digest_of(data if pending is None else pending),
            buffer=buffer,
            progress=nbytes if pending is None else 0,
            owner=True,
        )
        return Prepared(obj, pending, detached)

    def _page_locked(
        self, nbytes: int, backend: device.DeviceBackend
    ) -> tuple[np.ndarray[Any, Any], bool, Callable[[], None]]:
        """Page-locked memory for a pinned put's copy of ``nbytes``: the store's shared-memory
        segment for it, registered where it is (its pages are its own), or else new page-locked
        memory (private memory of the pool, registered in place, could share a page with memory
        registered already). The memory, whether it is the pool's, and what undoes the locking."""
        pool = self._store.pool
        if pool.shares(nbytes):
            data = pool.allocate(nbytes)
            if shm.segment_of(data) is not None:
                try:
                    return data, True, backend.register_host(data)
                except BaseException:
                    pool.release(data)
                    raise
            pool.release(data)  # /dev/shm had no room: private memory, not the pool's
        locked, release = backend.page_locked(nbytes)
        return locked, False, release

    def _device_object(self, array: Any, object_id: ObjectID | None, copy: bool) -> LocalObject:
        """The local object of a device array: its bytes stay in device memory (copied device to
        device, or kept as they are with ``copy=False`` when contiguous). Its digest is left
        empty: hashing would copy every byte to host, and the directory compares content only
        where both sides know a digest."""
        backend = device.backend_for(array)
        assert backend is not None
        dt, shape = backend.describe(array)
        dtype = dtype_to_wire(dt)
        flat = backend.flat_bytes(array)
        nbytes = int(flat.nbytes)
        self._check_size(nbytes)
        dev = backend.device_of(flat)
        backend.settle(dev)  # the caller's last writes to it are done
        ticket = None
        if copy:  # into memory same-host readers can open (the caller's is not ours to share)
            data, ticket = ipc.allocate(backend, nbytes, dev, self._store.shares)
            backend.copy(data, flat)
            flat = data
        return LocalObject(
            object_id=object_id or ObjectID.random(),
            size=nbytes,
            dtype=dtype,
            shape=tuple(int(s) for s in shape),
            digest=b"",
            buffer=Buffer.wrap(flat),
            progress=nbytes,
            owner=True,
            memory=MEMORY_DEVICE,
            ticket=ticket,
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
            obj.buffer.release_pin()  # this copy is not kept: nor its page-locking, nor its export
            if obj.ticket is not None:
                obj.ticket.retire()
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
            segment = segment_name(obj)  # published once the copy is done
        else:
            segment = publish(obj)
        try:
            reply = await self._session.request(
                lambda rid: p.PutRequest(
                    request_id=rid,
                    object_id=oid.binary(),
                    size=obj.size,
                    dtype=obj.dtype,
                    shape=list(obj.shape),
                    digest=obj.digest,
                    inline=inline,
                    segment=segment,
                    copying=copying is not None and bool(segment),
                    memory=obj.memory,
                ),
                self._config.request_timeout,
            )
            if not isinstance(reply, p.PutReply):
                raise ProtocolError(f"unexpected reply to put: {reply.TYPE}")
            if reply.error:
                raise from_kind(reply.error_kind, reply.error, object_id=oid.hex())
            registered = True
            if obj.ticket is not None and self._index:
                obj.ticket.index(self._index, oid.binary())
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
            segment = publish(obj)
            if segment:
                self._session.send(p.CopyAdded(object_id=obj.object_id.binary(), segment=segment))

    async def _failed(
        self,
        obj: LocalObject,
        copying: asyncio.Future[None] | None,
        stop: threading.Event,
        exc: BaseException,
        registered: bool,
    ) -> None:
        """Undo a put that failed (or was cancelled): stop its copy, drop the local object, and
        withdraw it from the directory if it was published."""
        stop.set()
        if copying is not None:
            with contextlib.suppress(BaseException):
                await asyncio.shield(copying)
        oid = obj.object_id
        if self._store.get(oid) is obj:
            self._store.remove(oid, as_hoplite_error(exc, oid))
        if registered:
            self._in_background(self._delete(oid))
