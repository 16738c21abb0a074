"""How a node gets an object: ask the directory, fill the local copy from the source it names,
report the copy.

:meth:`Fetcher.get` is a short loop: a lookup (:meth:`DirectorySession.lookup`), the reply's status
checked, then the source (:mod:`hoplite_gpu.sources`) that fills the local copy; a source that
asks for another one sends the loop round again, with the bytes it already holds. The copy is
reported when complete (:meth:`Fetcher.completed`), so later readers can pull from it, and is
visible in the local store while it fills, so they can pull from it even then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import protocol as p
from . import sources
from .config import Config
from .dtypes import dtype_from_wire
from .errors import (
    HopliteError,
    HopliteTimeoutError,
    InvalidArgumentError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    from_kind,
)
from .memory import buffers, device, ipc, shm
from .memory.buffers import Buffer, BufferKind
from .memory.store import MEMORY_DEVICE, LocalObject, LocalStore
from .object_id import ObjectID
from .session import DirectorySession
from .transport import DataPlane
from .vertex import ObjectReset

log = logging.getLogger("hoplite_gpu")

#: Bytes a ``get`` into ``out`` copies at a time while the object arrives.
STREAM_COPY_BYTES = 4 << 20


def check_out(out: Any) -> None:
    """Raise :class:`InvalidArgumentError` unless ``out`` is None or an array ``get`` can write
    (a writable NumPy array, or a CuPy array); its dtype and shape are checked on arrival."""
    if out is None:
        return
    kind = buffers.kind_of(out)
    if kind not in (buffers.ArrayKind.NUMPY, buffers.ArrayKind.CUPY, buffers.ArrayKind.SIM):
        raise InvalidArgumentError(
            f"out must be a NumPy or CuPy array, got {type(out).__name__}", argument="out"
        )
    if kind is buffers.ArrayKind.NUMPY and not out.flags.writeable:
        raise InvalidArgumentError("out is read-only", argument="out")


def streamable(out: Any) -> bool:
    """Whether ``get`` can copy into ``out`` while the object arrives (a writable C-contiguous
    NumPy array of at least a few chunks; others get one copy at the end)."""
    return (
        isinstance(out, np.ndarray)
        and out.flags.c_contiguous
        and out.flags.writeable
        and out.nbytes >= 2 * STREAM_COPY_BYTES
    )


async def _follow(source: LocalObject, dst: np.ndarray[Any, Any]) -> LocalObject:
    """Copy ``source``'s bytes into ``dst`` as they arrive; return ``source`` once all are copied
    (raises if the copy is dropped or reset meanwhile: the caller then copies the final object)."""
    copied = 0
    while copied < source.size:
        await source.wait_progress(min(copied + STREAM_COPY_BYTES, source.size), None)
        end = source.progress
        dst[copied:end] = source.buffer.host[copied:end]
        copied = end
    return source


def deliver(obj: LocalObject, out: Any) -> Any:
    """``obj``'s array, or ``out`` (any array kind, checked against it) filled with it.

    Without ``out``: an object put from host memory is a read-only NumPy view of the store's
    copy; one put from device memory is a new array on the caller's current device (CuPy; a
    bfloat16 object as uint16 where CuPy lacks bfloat16), or a host copy where this process has no usable
    device. A lent copy (another process's device memory) is closed once read.
    """
    if obj.lease is not None:
        try:
            return _deliver(obj, out)
        finally:
            obj.lease.close()
    return _deliver(obj, out)


def _deliver(obj: LocalObject, out: Any) -> Any:
    dtype = dtype_from_wire(obj.dtype)
    if out is None:
        if obj.memory == MEMORY_DEVICE:
            result = device.device_result(obj.buffer.array, dtype, obj.shape)
            if result is not None:
                return result
        if obj.buffer.on_device:  # a host copy of device bytes (read-only, like the store's views)
            host = _host_copy(obj, dtype)
            host.flags.writeable = False
            return host
        return obj.array()
    bits = dtype.name == "bfloat16" and buffers.on_device(out) and np.dtype(out.dtype) == np.uint16
    if tuple(out.shape) != obj.shape or (np.dtype(out.dtype) != dtype and not bits):
        raise InvalidArgumentError(
            f"out has dtype {out.dtype} and shape {tuple(out.shape)}, the object "
            f"{obj.object_id} has dtype {dtype} and shape {obj.shape}",
            argument="out",
        )
    # Device bytes go to a host ``out`` as ``dtype`` (bfloat16 may be viewed as uint16 on a device).
    host_out = obj.buffer.on_device and not buffers.on_device(out)
    buffers.copy_into(out, _host_copy(obj, dtype) if host_out else obj.array())
    return out


def _host_copy(obj: LocalObject, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """A host copy of a device object's bytes, typed."""
    return obj.buffer.to_host().view(dtype).reshape(obj.shape)


def _segment(obj: LocalObject) -> shm.Segment | None:
    """The shared-memory segment holding a pooled object's bytes (None: private memory)."""
    return shm.segment_of(obj.buffer.array) if obj.buffer.kind is BufferKind.SEGMENT else None


def segment_name(obj: LocalObject) -> str:
    """The name of the segment holding ``obj``'s bytes, not published yet ("" if private; device
    objects are published complete, never announced before)."""
    seg = _segment(obj)
    return "" if seg is None else seg.name


def publish(obj: LocalObject) -> str:
    """Publish a complete pooled copy in its shared-memory segment, or a device copy in its
    ticket (:mod:`hoplite_gpu.memory.ipc`); the name same-host readers open, or ""."""
    if obj.ticket is not None:
        return obj.ticket.publish(obj.object_id.binary(), obj.dtype, obj.shape)
    seg = _segment(obj)
    if seg is None:
        return ""
    seg.publish(obj.object_id.binary())
    return seg.name


def _lookup_error(oid: ObjectID, reply: p.LookupReply) -> HopliteError:
    """The error a lookup of ``oid`` answered with (status ``"error"``)."""
    culprit = reply.error_object_id.hex() if reply.error_object_id else None
    return from_kind(
        reply.error_kind, reply.error, object_id=culprit, reduction_id=oid.hex(), cause=reply.error
    )


class Fetcher:
    """The get side of a node.

    Args:
        store: The node's local store.
        data: The node's data plane (pulls).
        config: Limits and timeouts.
        session: The node's directory link.
        shared_memory: Whether this node may map same-host segments.
        computes: Whether a reduce vertex on this node computes an object (its output).
        index: The cluster's key for index links (:func:`hoplite_gpu.memory.ipc.open_indexed`; "": none).
    """

    def __init__(
        self,
        store: LocalStore,
        data: DataPlane,
        config: Config,
        session: DirectorySession,
        shared_memory: bool,
        computes: Callable[[ObjectID], bool],
        index: str = "",
    ) -> None:
        self._store = store
        self._index = index
        self._config = config
        self._session = session
        self._shm = shared_memory
        self._computes = computes
        ctx = sources.Context(store, data, config, session.send, self.completed, self.abandon)
        self._inline = sources.InlineSource(ctx)
        self._mapped = sources.SharedMemorySource(ctx)
        self._device = sources.DeviceIpcSource(ctx)
        self._pull = sources.PullSource(ctx)

    def abort(self, transfer_id: int, error: HopliteError) -> None:
        """The directory says a transfer's sender died: stop pulling from it."""
        self._pull.abort(transfer_id, error)

    def indexed(self, oid: ObjectID) -> LocalObject | None:
        """A device object another process on this host put, found through its index link and
        open in place (a lent copy, as :meth:`get` with ``lend`` returns; close its lease once
        read), with no lookup and no hop to the I/O thread; None when there is none (or this
        node holds the object, or this process works with no device memory yet): then ask the
        directory. Called from the caller's thread."""
        if not self._index or self._store.get(oid) is not None or not device.default_backend().in_use():
            return None
        found = ipc.open_indexed(self._index, oid.binary())
        if found is None:
            return None
        opened, record = found
        try:
            dtype, shape = sources.check_meta(oid, record.dtype, record.shape, record.nbytes, "ticket")
        except HopliteError:
            opened.close()
            return None
        obj = LocalObject(
            oid,
            record.nbytes,
            dtype,
            shape,
            b"",
            Buffer.wrap(opened.array),
            progress=record.nbytes,
            memory=MEMORY_DEVICE,
        )
        obj.lease = opened
        return obj

    async def get(
        self,
        oid: ObjectID,
        timeout: float | None,
        started: asyncio.Future[LocalObject] | None = None,
        direct: bool = False,
        lend: bool = False,
    ) -> LocalObject:
        """Fetch ``oid`` into the local store; ``started`` (if given) is resolved with the local
        object as soon as it exists, while it is still filling.

        ``lend``: the caller reads the object once and lets go (a ``get`` copying it into the
        array it returns), so a device copy of another process on this host may be returned
        open in place, outside the store: close its :attr:`~LocalObject.lease` once read.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return await self._fetch(sources.Attempt(oid, timeout, deadline), started, direct, lend)
            except ObjectReset:
                log.debug("partial copy of %s was reset (its reduction is rebuilt); starting again", oid)

    async def get_into(self, oid: ObjectID, timeout: float | None, out: Any, direct: bool) -> Any:
        """:meth:`get` into a NumPy ``out``, copying the bytes into it as they arrive rather than
        all at the end (for a large object the last copy would otherwise add to its latency)."""
        started: asyncio.Future[LocalObject] = asyncio.get_running_loop().create_future()
        fetch = asyncio.ensure_future(self.get(oid, timeout, started=started, direct=direct))
        follower: asyncio.Future[LocalObject] | None = None
        try:
            await asyncio.wait([fetch, started], return_when=asyncio.FIRST_COMPLETED)
            if started.done() and not fetch.done():
                source = started.result()
                dtype = dtype_from_wire(source.dtype)
                same = tuple(out.shape) == tuple(source.shape) and np.dtype(out.dtype) == dtype
                if same and not source.buffer.on_device:
                    follower = asyncio.ensure_future(_follow(source, out.reshape(-1).view(np.uint8)))
            obj = await fetch
            if follower is not None and started.result() is obj:
                # obj is complete: the follower copies what is left at once (or failed earlier, if
                # the copy was reset; obj is then another object, copied whole below)
                with contextlib.suppress(HopliteError):
                    if await follower is obj:
                        return out  # every byte was copied as it came
        finally:
            fetch.cancel()
            if follower is not None and not follower.done():
                follower.cancel()
        return deliver(obj, out)

    async def _fetch(
        self,
        attempt: sources.Attempt,
        started: asyncio.Future[LocalObject] | None,
        direct: bool,
        lend: bool = False,
    ) -> LocalObject:
        """One attempt of :meth:`get` (raises :class:`ObjectReset` if its copy was voided)."""
        oid = attempt.object_id

        async def filled(obj: LocalObject) -> LocalObject:
            try:
                await obj.wait_progress(obj.size, attempt.remaining())
            except HopliteTimeoutError:
                raise attempt.timed_out(
                    f"this node is still filling it (another get or a reduce here), {obj.progress} of "
                    f"{obj.size} bytes so far"
                ) from None
            return obj

        local = self._store.get(oid)
        if local is not None and local.progress < local.size:
            # Another get in this process (or a reduce vertex here, or a put still copying) is
            # filling it: wait for that.
            return await filled(local)
        if local is not None and local.complete:
            return local
        while True:
            left = attempt.remaining()
            if left is not None and left <= 0:
                raise attempt.timed_out()
            have = local.progress if local is not None else 0
            same_host = self._shm and local is None
            # Same-host device copies are opened (CUDA IPC) once this process works with device
            # memory; until then it receives them like host objects.
            device_ipc = same_host and device.default_backend().in_use()
            # ``local`` exists only after an answer of this get, so the object was known then.
            resume = local is not None
            reply = await self._session.lookup(oid, left, have, same_host, direct, device_ipc, resume)
            generation = self._session.generation  # a copy finished under a later one is restored
            if local is not None and local.error is not None:
                # Dropped while we asked (lost, deleted, or reset): this answer is for void bytes.
                if reply.transfer_id:
                    self._session.send(p.TransferDone(transfer_id=reply.transfer_id, ok=False, progress=0))
                if isinstance(local.error, ObjectReset) and reply.status == "error":
                    # Reset by a repair, then failed or deleted: starting again would wait for an
                    # object that will never come.
                    raise _lookup_error(oid, reply)
                raise local.error
            if reply.status in ("timeout", "error"):
                error = (
                    attempt.timed_out(reply.error) if reply.status == "timeout" else _lookup_error(oid, reply)
                )
                if local is not None:
                    self.abandon(local, 0, error)
                raise error
            if reply.status == "inline":
                stored = await self._inline.fill(local, reply, attempt, generation)
                assert stored is not None  # inline data always fills the copy
                return await filled(stored)
            if reply.status == "local":
                existing = self._store.get(oid)
                if existing is None and self._computes(oid):
                    # A vertex placed here just now is still setting its output up.
                    wait = self._config.request_timeout if left is None else left
                    existing = await self._store.wait_for(oid, wait, coming=True)
                if existing is not None and existing.error is None:
                    return await filled(existing)  # complete, or a reduce vertex here computes it
                raise ObjectNotFoundError(f"object {oid} vanished from this node", object_id=oid.hex())
            appeared = self._store.get(oid) if local is None else None
            if appeared is not None:
                # It appeared while we asked: a reduce vertex on this node computes it (it was
                # placed here meanwhile). Wait for that instead of pulling a second copy.
                if reply.transfer_id:
                    self._session.send(p.TransferDone(transfer_id=reply.transfer_id, ok=False, progress=0))
                return await filled(appeared)
            if reply.status == "shm" and local is None and ipc.is_ticket(reply.segment):
                if lend:
                    lent = self._device.lend(reply, attempt)
                    if lent is not None:
                        return lent
                else:
                    copied = await self._device.fill(None, reply, attempt, generation)
                    if copied is not None:
                        return await filled(copied)
            elif reply.status == "shm" and local is None:
                mapped = await self._mapped.fill(None, reply, attempt, generation)
                if mapped is not None:
                    return await filled(mapped)
            if local is None:
                local = self._new_partial(oid, reply)
                if started is not None and not started.done():
                    started.set_result(local)
            if reply.status == "shm":
                continue  # ``local`` exists now, so the next lookup asks for a data-plane source
            pulled = await self._pull.fill(local, reply, attempt, generation)
            if pulled is not None:
                return pulled

    def _new_partial(self, oid: ObjectID, reply: p.LookupReply) -> LocalObject:
        meta = sources.checked_meta(oid, reply)
        if reply.size > self._config.max_object_bytes:
            raise ObjectTooLargeError(
                f"object {oid} of {reply.size} bytes exceeds Config.max_object_bytes",
                size=reply.size,
                limit=self._config.max_object_bytes,
            )
        self._store.reserve(reply.size)
        if reply.memory == MEMORY_DEVICE and device.default_backend().in_use():
            # A device object is received into this process's device memory, chunk by chunk as
            # it lands (see DataPlane.pull): readers here then copy device to device, and
            # same-host processes open it through CUDA IPC once it is complete.
            data, ticket = ipc.allocate_here(reply.size, self._store.shares)
            return self._store.add(sources.from_reply(oid, reply, meta, data, progress=0, ticket=ticket))
        data = self._store.pool.allocate(reply.size)
        return self._store.add(sources.from_reply(oid, reply, meta, data, progress=0, pooled=True))

    # ------------------------------------------------------------ reports (see sources.Context)
    def completed(self, local: LocalObject, generation: int, transfer_id: int) -> None:
        """Tell the directory about a complete copy this node now holds: the transfer that
        filled it, or a copy added (a mapping); restored instead if the directory restarted since
        ``generation``."""
        if generation != self._session.generation:
            self.restore(local)  # the directory restarted meanwhile: it never heard of the copy
        elif transfer_id:
            self._session.send(
                p.TransferDone(transfer_id=transfer_id, ok=True, progress=local.size, segment=publish(local))
            )
        else:
            self._session.send(p.CopyAdded(object_id=local.object_id.binary(), segment=publish(local)))

    def abandon(self, local: LocalObject, transfer_id: int, exc: HopliteError) -> None:
        """Give up a partial copy (and the transfer filling it, if any)."""
        if transfer_id:
            self._session.send(
                p.TransferDone(transfer_id=transfer_id, ok=False, progress=local.progress, reason=str(exc))
            )
        if self._store.get(local.object_id) is local:
            self._store.remove(local.object_id, exc)

    def restore(self, obj: LocalObject) -> None:
        """Tell a restarted directory about a complete copy this node holds."""
        inline = obj.buffer.to_host().tobytes() if obj.size <= self._session.inline_threshold_bytes else None
        self._session.send(
            p.Restore(
                object_id=obj.object_id.binary(),
                size=obj.size,
                dtype=obj.dtype,
                shape=list(obj.shape),
                digest=obj.digest,
                owner=obj.owner,
                inline=inline,
                segment=publish(obj),
                memory=obj.memory,
            )
        )
