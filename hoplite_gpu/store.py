"""A node's local object store: buffers with progress counters.

A partial copy is readable up to its progress, which is how a node forwards the chunks of an object
it is still receiving. The store is used only from the node's event-loop thread.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from . import shm
from .errors import (
    HopliteError,
    HopliteTimeoutError,
    InvalidArgumentError,
    ObjectDeletedError,
    StoreFullError,
)
from .object_id import ObjectID

_SPECIAL_DTYPES = ("bfloat16",)


def dtype_to_wire(dtype: np.dtype[Any]) -> str:
    """Text form of a dtype that :func:`dtype_from_wire` turns back into it."""
    if dtype.hasobject:
        raise InvalidArgumentError(
            "object arrays cannot be stored (their bytes are pointers); convert to a numeric dtype",
            argument="array",
        )
    if dtype.name in _SPECIAL_DTYPES:
        return dtype.name
    return dtype.str if dtype.fields is None else np.lib.format.dtype_to_descr(dtype).__repr__()


def dtype_from_wire(text: str) -> np.dtype[Any]:
    """Inverse of :func:`dtype_to_wire`."""
    if text in _SPECIAL_DTYPES:
        import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)
    if text.startswith("["):
        import ast

        return np.dtype(ast.literal_eval(text))
    return np.dtype(text)


def digest_of(buf: np.ndarray[Any, Any]) -> bytes:
    """128-bit xxh3 digest of a contiguous byte buffer (about 10 GB/s)."""
    return xxhash.xxh3_128_digest(memoryview(buf).cast("B"))  # type: ignore[arg-type]


@dataclass(eq=False, slots=True)
class LocalObject:
    """One object in the local store (complete, or partial and filling)."""

    object_id: ObjectID
    size: int
    dtype: str
    shape: tuple[int, ...]
    digest: bytes
    data: np.ndarray[Any, Any]  # flat uint8 view of the bytes
    progress: int = 0
    owner: bool = False
    pooled: bool = False  # ``data`` came from the store's BufferPool and may go back to it
    error: HopliteError | None = None
    # The reduction computing it (an intermediate, or a result still being computed): a copy the
    # directory's restart makes void. Empty for ordinary objects and finished results.
    reduction: bytes = b""
    _waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """All bytes are present."""
        return self.progress >= self.size and self.error is None

    def array(self) -> np.ndarray[Any, Any]:
        """Read-only typed view of the complete object."""
        view = self.data.view(dtype_from_wire(self.dtype)).reshape(self.shape)
        view.flags.writeable = False
        return view

    def advance(self, progress: int) -> None:
        """Record that bytes ``[0, progress)`` are present and wake the waiters they satisfy."""
        if progress <= self.progress:
            return
        self.progress = min(progress, self.size)
        keep = []
        for need, fut in self._waiters:
            if need <= self.progress:
                if not fut.done():
                    fut.set_result(None)
            elif not fut.done():
                keep.append((need, fut))
        self._waiters = keep

    def fail(self, error: HopliteError) -> None:
        """Mark the object unusable and fail every waiter with ``error``."""
        self.error = error
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(error)
        self._waiters = []

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

    async def wait_progress(self, need: int, timeout: float | None) -> None:
        """Wait until ``need`` bytes are present (raises on failure or timeout)."""
        if self.error is not None:
            raise self.error
        if self.progress >= min(need, self.size):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((min(need, self.size), fut))
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise HopliteTimeoutError(
                f"object {self.object_id} made no progress for {timeout} s "
                f"({self.progress}/{self.size} bytes present)",
                operation="wait_progress",
                timeout=timeout,
                object_id=self.object_id.hex(),
            ) from None
        finally:
            self._waiters = [(n, f) for n, f in self._waiters if f is not fut]


def _baseline_refcount() -> int:
    """``sys.getrefcount`` of a buffer referenced only by a pool's list, seen from its scan loop."""
    free = deque([np.empty(1, np.uint8)])
    for _, buf in enumerate(free):  # the same loop shape as BufferPool.allocate
        return sys.getrefcount(buf)
    raise AssertionError("unreachable")


_UNSHARED_REFS = _baseline_refcount()


class BufferPool:
    """Recycles the byte buffers of removed objects for new objects of the same size.

    Writing into freshly allocated memory costs a page fault per page: a 64 MiB receive into a
    new buffer took 20 ms, into a recycled one 12 ms (``bench/p2p.py``). A removed object's
    buffer is kept (oldest dropped first beyond ``max_bytes``) and handed out again only once
    nothing else refers to it: an array returned by ``get`` is a view that keeps its buffer
    referenced, as does a transfer still using it, and such a buffer is never reused under them.
    Thread-safe (``put`` copies on the caller's thread).

    With ``shared_min_bytes`` > 0, buffers of at least that many bytes live in shared-memory
    segments (:mod:`hoplite_gpu.shm`) that processes on the same host copy from directly; a
    segment is retired (readers reject it) as soon as it is released, reused only once no other
    process maps it (:func:`hoplite_gpu.shm.map_view`), and unlinked when the pool lets go of it.
    """

    def __init__(self, max_bytes: int, shared_min_bytes: int = 0) -> None:
        self.max_bytes = max_bytes
        self.shared_min_bytes = shared_min_bytes
        self.held_bytes = 0
        self.reused = 0
        self._free: deque[np.ndarray[Any, Any]] = deque()
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> np.ndarray[Any, Any]:
        """A flat uint8 buffer of ``nbytes`` (recycled when an unreferenced one fits exactly)."""
        shared = 0 < self.shared_min_bytes <= nbytes
        with self._lock:
            for i, buf in enumerate(self._free):
                seg = shm.segment_of(buf)
                if (
                    buf.nbytes == nbytes
                    and sys.getrefcount(buf) <= _UNSHARED_REFS
                    and (seg is not None) == shared
                    and (seg is None or not seg.mapped_elsewhere())
                ):
                    del self._free[i]
                    self.held_bytes -= nbytes
                    self.reused += 1
                    return buf
        created = shm.create(nbytes) if shared else None
        return created if created is not None else np.empty(nbytes, np.uint8)

    def release(self, buf: np.ndarray[Any, Any]) -> None:
        """Offer a buffer the store no longer uses (it may still be referenced elsewhere)."""
        seg = shm.segment_of(buf)
        if seg is not None:
            seg.retire()
        if buf.nbytes == 0 or buf.nbytes > self.max_bytes:
            _drop(buf)
            return
        with self._lock:
            self._free.append(buf)
            self.held_bytes += buf.nbytes
            while self.held_bytes > self.max_bytes:
                old = self._free.popleft()
                self.held_bytes -= old.nbytes
                _drop(old)

    def clear(self) -> None:
        """Drop every held buffer."""
        with self._lock:
            for buf in self._free:
                _drop(buf)
            self._free.clear()
            self.held_bytes = 0


def _drop(buf: np.ndarray[Any, Any]) -> None:
    """Let go of a buffer: a shared-memory segment's file is unlinked now (its memory is freed
    once no array uses it any more)."""
    seg = shm.segment_of(buf)
    if seg is not None:
        seg.unlink()


#: How many removed ObjectIDs a store remembers (to refuse pulls of them at once).
REMEMBERED_REMOVALS = 4096


class LocalStore:
    """The objects this node holds, with a capacity limit and a pool of reusable buffers."""

    def __init__(self, capacity_bytes: int, pool_bytes: int = 0, shared_min_bytes: int = 0) -> None:
        self.capacity_bytes = capacity_bytes
        self.pool = BufferPool(pool_bytes, shared_min_bytes)
        self.used_bytes = 0
        self._objects: dict[ObjectID, LocalObject] = {}
        self._arrivals: dict[ObjectID, list[asyncio.Future[LocalObject]]] = {}
        self._removed: OrderedDict[ObjectID, None] = OrderedDict()  # recent removals, oldest first

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
        self.reserve(obj.size)
        self._objects[obj.object_id] = obj
        self._removed.pop(obj.object_id, None)
        self.used_bytes += obj.size
        for fut in self._arrivals.pop(obj.object_id, []):
            if not fut.done():
                fut.set_result(obj)
        return obj

    def remove(self, oid: ObjectID, error: HopliteError | None = None) -> LocalObject | None:
        """Remove an object, failing its waiters with ``error`` (default: ObjectDeletedError)."""
        obj = self._objects.pop(oid, None)
        if obj is None:
            return None
        self._removed[oid] = None
        while len(self._removed) > REMEMBERED_REMOVALS:
            self._removed.popitem(last=False)
        self.used_bytes -= obj.size
        if not obj.complete or obj._waiters:
            obj.fail(error or ObjectDeletedError(f"object {oid} was deleted", object_id=oid.hex()))
        if obj.pooled:
            self.pool.release(obj.data)
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
            return await asyncio.wait_for(fut, timeout)
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
        self.pool.clear()
