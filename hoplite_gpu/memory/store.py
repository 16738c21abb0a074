"""A node's local object store: buffers with progress counters.

A partial copy is readable up to its progress, which is how a node forwards the chunks of an object
it is still receiving. The store is used only from the node's event-loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..dtypes import dtype_from_wire
from ..errors import (
    HopliteError,
    HopliteTimeoutError,
    InvalidArgumentError,
    ObjectDeletedError,
    StoreFullError,
)
from ..iothread import bounded
from ..object_id import ObjectID
from .arrays import CallerArray
from .buffers import Buffer, BufferKind
from .device import device_result
from .node_memory import Memory

#: :attr:`LocalObject.memory` of an object put from host memory (NumPy, CPU tensors).
MEMORY_HOST = ""
#: :attr:`LocalObject.memory` of an object put from device memory: readers get device arrays.
MEMORY_DEVICE = "device"


@dataclass(eq=False, slots=True)
class LocalObject:
    """One object in the local store (complete, or partial and filling)."""

    object_id: ObjectID
    size: int
    dtype: str
    shape: tuple[int, ...]
    digest: bytes
    buffer: Buffer  # the bytes, and where they live
    progress: int = 0
    owner: bool = False
    error: HopliteError | None = None
    # The reduction computing it (an intermediate, or a result still being computed): a copy the
    # directory's restart makes void. Empty for ordinary objects and finished results.
    reduction: bytes = b""
    # What kind of memory the object was put from (MEMORY_HOST or MEMORY_DEVICE), whatever this
    # copy's buffer is: a reader's get returns that kind (a device object received into host
    # memory is copied to the reader's device when read).
    memory: str = MEMORY_HOST
    # A reduce vertex on this node that takes the object as its input may write its output over
    # the object's memory (it then holds the bytes, and the object leaves the store): for inputs
    # that one reduction alone reads (put(consumable=True)).
    consumable: bool = False
    _waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)
    # Threads in wait_progress_from_thread, and what wakes them (advance and fail, on the loop).
    _thread_waits: int = 0
    _woken: threading.Condition = field(default_factory=threading.Condition)
    # Pulls this node serves from the object right now, and who waits for them to end.
    serving: int = 0
    served_whole: int = 0  # pulls served from it up to its end
    served_begun: int = 0  # pulls begun
    _unserved: list[asyncio.Future[None]] = field(default_factory=list)
    _served: list[asyncio.Future[None]] = field(default_factory=list)  # see wait_served

    @property
    def complete(self) -> bool:
        """All bytes are present."""
        return self.progress >= self.size and self.error is None

    def array(self) -> Any:
        """Typed view of the complete object's bytes (read-only for host memory; an array of the
        buffer's device backend for device memory)."""
        return self.buffer.typed(dtype_from_wire(self.dtype), self.shape)

    def deliver(self, out: CallerArray | None) -> Any:
        """The complete object's array for a caller, or ``out`` (any array kind, checked against
        it) filled with it.

        Without ``out``: an object put from host memory is a read-only NumPy view of the store's
        copy; one put from device memory is a new array on the caller's current device (CuPy; a
        bfloat16 object as uint16 where CuPy lacks bfloat16), or a host copy where this process
        has no usable device. A lent copy (another process's device memory) is closed once read.
        """
        try:
            return self._deliver(out)
        finally:
            self.buffer.close_lease()

    def _deliver(self, out: CallerArray | None) -> Any:
        dtype = dtype_from_wire(self.dtype)
        if out is None:
            if self.memory == MEMORY_DEVICE:
                result = device_result(self.buffer.array, dtype, self.shape)
                if result is not None:
                    return result
            if self.buffer.on_device:  # a host copy of device bytes (read-only, like the store's views)
                host = self._host_copy(dtype)
                host.flags.writeable = False
                return host
            return self.array()
        array = out.value
        bits = dtype.name == "bfloat16" and out.on_device and np.dtype(array.dtype) == np.uint16
        if tuple(array.shape) != self.shape or (np.dtype(array.dtype) != dtype and not bits):
            raise InvalidArgumentError(
                f"out has dtype {array.dtype} and shape {tuple(array.shape)}, the object "
                f"{self.object_id} has dtype {dtype} and shape {self.shape}",
                argument="out",
            )
        # Device bytes go to a host ``out`` as ``dtype`` (bfloat16 may be viewed as uint16 on a device).
        host_out = self.buffer.on_device and not out.on_device
        out.copy_from(self._host_copy(dtype) if host_out else self.array())
        return array

    def _host_copy(self, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
        """A host copy of a device object's bytes, typed."""
        return self.buffer.to_host().view(dtype).reshape(self.shape)

    def advance(self, progress: int) -> None:
        """Record that bytes ``[0, progress)`` are present and wake the waiters they satisfy."""
        if progress <= self.progress:
            return
        self.progress = min(progress, self.size)
        self._settle()

    def advance_from_thread(self, progress: int, loop: asyncio.AbstractEventLoop) -> None:
        """:meth:`advance` from a thread other than the loop's (a data-plane worker that landed
        the bytes): threads waiting are woken at once, and the loop only if a coroutine waits for
        these bytes (bench/pages/collectives.md#one-stream-per-round). For objects whose progress
        no code on the loop reads between its steps expecting it still; one thread advances an
        object at a time."""
        if progress <= self.progress:
            return
        self.progress = progress = min(progress, self.size)
        # Set before the waiters are read; wait_progress adds its waiter before it reads the
        # progress again, so one of the two sees the other.
        if any(need <= progress for need, _ in self._waiters):
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._settle)
        self._wake_threads()

    def _settle(self) -> None:
        """Wake the waiters that the progress satisfies."""
        keep = []
        for need, fut in self._waiters:
            if need <= self.progress:
                if not fut.done():
                    fut.set_result(None)
            elif not fut.done():
                keep.append((need, fut))
        self._waiters = keep
        self._wake_threads()

    def _wake_threads(self) -> None:
        """Wake the threads in :meth:`wait_progress_from_thread` to look again (progress is set
        before their count is read, and they count themselves before they look)."""
        if self._thread_waits:
            with self._woken:
                self._woken.notify_all()

    def fail(self, error: HopliteError) -> None:
        """Mark the object unusable and fail every waiter with ``error``."""
        self.error = error
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(error)
        self._waiters = []
        self._wake_threads()

    def failure(self) -> asyncio.Future[None]:
        """A future that fails with the object's error once it is failed (it never succeeds);
        hand it to :meth:`forget_failure` when no longer needed."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.error is not None:
            fut.set_exception(self.error)
        else:
            self._waiters.append((self.size + 1, fut))  # beyond any progress: only fail() ends it
        return fut

    def forget_failure(self, fut: asyncio.Future[None]) -> None:
        """Stop watching with a future from :meth:`failure`."""
        self._waiters = [(need, f) for need, f in self._waiters if f is not fut]
        if not fut.cancel() and not fut.cancelled():
            fut.exception()  # failed meanwhile: mark the error retrieved

    @contextlib.contextmanager
    def being_served(self) -> Iterator[None]:
        """Count a pull served from the object while the block runs (see :meth:`wait_unserved`)."""
        self.serving += 1
        self.served_begun += 1
        try:
            yield
            self.served_whole += 1
            for fut in self._served:
                if not fut.done():
                    fut.set_result(None)
            self._served = []
        finally:
            self.serving -= 1
            if not self.serving:
                for fut in self._unserved:
                    if not fut.done():
                        fut.set_result(None)
                self._unserved = []

    async def wait_served(self, timeout: float) -> bool:
        """Wait until a pull has been served from the object up to its end; False if none has
        after ``timeout`` (or the object failed first)."""
        if self.served_whole:
            return True
        if self.error is not None:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._served.append(fut)
        failed = self.failure()
        try:
            await bounded(asyncio.wait([fut, failed], return_when=asyncio.FIRST_COMPLETED), timeout)
        except asyncio.TimeoutError:
            return False
        finally:
            self.forget_failure(failed)
            if fut in self._served:
                self._served.remove(fut)
        return bool(self.served_whole)

    async def wait_unserved(self, timeout: float) -> bool:
        """Wait until no pull is served from the object; False if one still is after ``timeout``
        (a failed object's pulls stop at their next chunk)."""
        if not self.serving:
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._unserved.append(fut)
        try:
            await bounded(fut, timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def wait_progress_from_thread(self, need: int, timeout: float) -> None:
        """:meth:`wait_progress` for a thread other than the event loop's (a data-plane worker
        serving a partial copy): it blocks, and no task or future is made on the loop for it."""
        need = min(need, self.size)
        with self._woken:
            self._thread_waits += 1
            try:
                present = self._woken.wait_for(
                    lambda: self.progress >= need or self.error is not None, timeout
                )
            finally:
                self._thread_waits -= 1
        if self.error is not None:
            raise self.error
        if not present:
            raise self._stalled(timeout)

    def _stalled(self, timeout: float | None) -> HopliteTimeoutError:
        """The error of a wait that saw no progress for ``timeout`` seconds."""
        return HopliteTimeoutError(
            f"object {self.object_id} made no progress for {timeout} s "
            f"({self.progress}/{self.size} bytes present)",
            operation="wait_progress",
            timeout=timeout,
            object_id=self.object_id.hex(),
        )

    async def wait_progress(self, need: int, timeout: float | None) -> None:
        """Wait until ``need`` bytes are present (raises on failure or timeout)."""
        if self.error is not None:
            raise self.error
        if self.progress >= min(need, self.size):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((min(need, self.size), fut))
        if self.progress >= min(need, self.size):  # advanced from a thread meanwhile
            fut.set_result(None)
        try:
            await bounded(fut, timeout)
        except HopliteError:
            raise  # the object failed (a HopliteTimeoutError is an asyncio.TimeoutError too)
        except asyncio.TimeoutError:
            raise self._stalled(timeout) from None
        finally:
            self._waiters = [(n, f) for n, f in self._waiters if f is not fut]


#: How many removed ObjectIDs a store remembers (to refuse pulls of them at once).
REMEMBERED_REMOVALS = 4096


def _plain(obj: LocalObject) -> bool:
    """Whether ``obj`` can leave the store from any thread: complete, with no waiter (futures of
    the loop's), its bytes this process's private memory (no page-locking, export or lease to
    undo on the loop; not a shared-memory segment, which same-host readers may map)."""
    buf = obj.buffer
    return (
        obj.complete
        and not obj._waiters
        and buf.kind is BufferKind.PRIVATE
        and buf.unpin is None
        and buf.ticket is None
        and buf.lease is None
    )


class LocalStore:
    """The objects this node holds, with a capacity limit, and the node's :class:`Memory` their
    bytes come from and go back to (a private one without ``memory``)."""

    def __init__(self, capacity_bytes: int, memory: Memory | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.memory = memory or Memory()
        self.used_bytes = 0
        self._objects: dict[ObjectID, LocalObject] = {}
        self._arrivals: dict[ObjectID, list[asyncio.Future[LocalObject]]] = {}
        self._removed: OrderedDict[ObjectID, None] = OrderedDict()  # recent removals, oldest first
        # Objects enter from a caller's thread too (add_from_caller): the byte count changes under it.
        self._lock = threading.Lock()

    def __contains__(self, oid: ObjectID) -> bool:
        return oid in self._objects

    def __len__(self) -> int:
        return len(self._objects)

    def get(self, oid: ObjectID) -> LocalObject | None:
        """The local object, or None."""
        return self._objects.get(oid)

    def objects(self) -> list[LocalObject]:
        """Every local object (a snapshot)."""
        return list(self._objects.values())

    def reserve(self, nbytes: int) -> None:
        """Check that ``nbytes`` more fit in the store."""
        if self.used_bytes + nbytes > self.capacity_bytes:
            raise StoreFullError(
                f"storing {nbytes} bytes would exceed this node's store capacity "
                f"({self.used_bytes}/{self.capacity_bytes} bytes used); delete objects or raise "
                "Config.store_capacity_bytes",
                requested=nbytes,
                used=self.used_bytes,
                capacity=self.capacity_bytes,
            )

    def add(self, obj: LocalObject) -> LocalObject:
        """Insert an object (its bytes count against the capacity)."""
        with self._lock:
            self.reserve(obj.size)
            self._insert(obj)
        for fut in self._arrivals.pop(obj.object_id, []):
            if not fut.done():
                fut.set_result(obj)
        return obj

    def add_from_caller(self, obj: LocalObject) -> bool:
        """:meth:`add` from a thread other than the event loop's, of an object nothing waits for
        yet; False (nothing added) if the id is here, awaited (:meth:`wait_for`), or does not fit:
        then add it on the loop."""
        oid = obj.object_id
        with self._lock:
            if (
                oid in self._objects
                or oid in self._arrivals
                or self.used_bytes + obj.size > self.capacity_bytes
            ):
                return False
            self._insert(obj)
        return True

    def removable_from_caller(self, oid: ObjectID) -> bool:
        """Whether :meth:`remove_from_caller` can remove ``oid`` (or it is not here)."""
        obj = self._objects.get(oid)
        return obj is None or _plain(obj)

    def remove_from_caller(self, oid: ObjectID) -> bool:
        """:meth:`remove` from a thread other than the event loop's, of an object that needs
        nothing of the loop (:func:`_plain`: complete, awaited by nothing, in private or pooled
        host memory); False (nothing removed) for any other: remove it on the loop."""
        with self._lock:
            obj = self._objects.get(oid)
            if obj is None:
                return True
            if not _plain(obj):
                return False
            del self._objects[oid]
            self._forget(obj)
        self.memory.release(obj.buffer)
        return True

    def _forget(self, obj: LocalObject) -> None:
        """Remember ``obj`` as removed and stop counting its bytes (the caller holds the lock)."""
        self._removed[obj.object_id] = None
        while len(self._removed) > REMEMBERED_REMOVALS:
            self._removed.popitem(last=False)
        self.used_bytes -= obj.size

    def _insert(self, obj: LocalObject) -> None:
        """Put ``obj`` in the store and count its bytes (the caller holds the lock)."""
        self._objects[obj.object_id] = obj
        self._removed.pop(obj.object_id, None)
        self.used_bytes += obj.size

    def remove(self, oid: ObjectID, error: HopliteError | None = None) -> LocalObject | None:
        """Remove an object, failing its waiters with ``error`` (default: ObjectDeletedError)."""
        with self._lock:
            obj = self._objects.pop(oid, None)
            if obj is None:
                return None
            self._forget(obj)
        if not obj.complete or obj._waiters:
            obj.fail(error or ObjectDeletedError(f"object {oid} was deleted", object_id=oid.hex()))
        self.memory.release(obj.buffer)
        return obj

    def hand_over(self, oid: ObjectID) -> LocalObject | None:
        """Remove a complete object whose buffer another object takes over (a reduce vertex's
        output written over its input): its memory is neither released nor pooled again here."""
        with self._lock:
            obj = self._objects.get(oid)
            if obj is None or not obj.complete or obj._waiters or obj.serving:
                return None
            del self._objects[oid]
            self._forget(obj)
        return obj

    async def wait_for(self, oid: ObjectID, timeout: float, coming: bool = False) -> LocalObject | None:
        """The object, waiting up to ``timeout`` for it to be added (None if it never is, or if it
        was removed recently: a peer sent here by the directory just before this node's delete
        reached it must learn at once that the copy is gone, not after ``timeout``; unless the
        caller knows it is ``coming`` back)."""
        obj = self._objects.get(oid)
        if obj is not None:
            return obj
        if oid in self._removed and not coming:
            return None
        fut: asyncio.Future[LocalObject] = asyncio.get_running_loop().create_future()
        self._arrivals.setdefault(oid, []).append(fut)
        try:
            obj = self._objects.get(oid)  # added from a caller's thread just before it was awaited
            if obj is not None:
                return obj
            return await bounded(fut, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            waiting = self._arrivals.get(oid)
            if waiting is not None:
                waiting[:] = [f for f in waiting if f is not fut]
                if not waiting:
                    del self._arrivals[oid]

    def clear(self, error: HopliteError) -> None:
        """Drop everything (node shutdown)."""
        for oid in list(self._objects):
            self.remove(oid, error)
        for futs in self._arrivals.values():
            for fut in futs:
                if not fut.done():
                    fut.cancel()
        self._arrivals.clear()
        self.memory.clear()
