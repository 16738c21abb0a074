"""Where an object's bytes live: the :class:`Buffer` that travels with an object, and the pool that
recycles host memory.

An object's bytes are a :class:`Buffer`: a flat ``uint8`` array and where it lives
(:class:`BufferKind`): private process memory, a shared-memory segment this process owns (same-host
readers map it), a read-only mapping of another process's segment, pinned host memory, or CUDA
device memory (with its backend, worked out once when the buffer is made). The buffer also carries
what ties its memory to other processes: the ticket that exports it, or the lease on another
process's memory it reads in place. Code that moves or reads an object's bytes goes through the
buffer (``view`` for a byte range, ``host`` where a host view exists, ``digest``), so a new kind of
memory is a new kind here, not a change in every caller. :class:`BufferPool` recycles private
memory and segments.
"""

from __future__ import annotations

import bisect
import enum
import gc
import itertools
import mmap
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ..errors import InvalidArgumentError
from . import device, shm
from .backend import DeviceBackend

if TYPE_CHECKING:
    from .ipc import Opened
    from .tickets import Ticket


class BufferKind(enum.Enum):
    """Where an object's bytes live."""

    PRIVATE = "private"  # this process's memory
    SEGMENT = "segment"  # a shared-memory segment this process owns (same-host readers map it)
    MAPPED = "mapped"  # a read-only mapping of another process's segment (:func:`shm.map_view`)
    PINNED = "pinned"  # page-locked host memory (CUDA copies to and from it run asynchronously)
    DEVICE = "device"  # CUDA device memory: no host view


#: The kinds whose bytes this process can read as a NumPy array.
HOST_KINDS = frozenset({BufferKind.PRIVATE, BufferKind.SEGMENT, BufferKind.MAPPED, BufferKind.PINNED})


def buffer_kind(data: Any, backend: DeviceBackend | None = None) -> BufferKind:
    """Where ``data`` (a flat store buffer: a NumPy array, or a device array of ``backend``, which
    is :func:`~hoplite_gpu.memory.device.backend_for` ``data`` when not given) lives."""
    if (backend or device.backend_for(data)) is not None:
        return BufferKind.DEVICE
    if not isinstance(data, np.ndarray):
        raise InvalidArgumentError(f"not a store buffer: {type(data).__name__}", argument="data")
    if shm.segment_of(data) is not None:
        return BufferKind.SEGMENT
    if isinstance(data.base, mmap.mmap):
        return BufferKind.MAPPED
    return BufferKind.PINNED if _is_pinned(data) else BufferKind.PRIVATE


def _is_pinned(data: np.ndarray[Any, Any]) -> bool:
    """Whether ``data`` views CuPy pinned memory (only looked for when CuPy is already loaded)."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return False
    base: Any = data
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    return isinstance(base, cupy.cuda.pinned_memory.PinnedMemoryPointer)


@dataclass(eq=False, slots=True)
class Buffer:
    """An object's bytes: a flat ``uint8`` array, where it lives, and who may recycle it.

    ``array`` is a NumPy array for the host kinds and an array of a
    :class:`~hoplite_gpu.memory.backend.DeviceBackend` for :attr:`BufferKind.DEVICE` (a CuPy array,
    or a simulated one; ``device`` is then its device ordinal, ``device_backend`` its backend).
    ``pooled`` says the array came from the store's :class:`BufferPool` and goes back to it when the
    object is removed. ``unpin``: host memory page-locked for this object (``put(...,
    pinned=True)``), undone by :meth:`release_pin` before the memory goes back. ``ticket``: the
    export of device memory the store allocated itself (:mod:`hoplite_gpu.memory.ipc`), published
    with the complete copy and retired with it. ``lease``: another process's device memory this
    buffer reads in place (a lent copy, outside the store), closed by whoever read it. Build one
    with :meth:`wrap`, which works out the kind.
    """

    array: Any
    kind: BufferKind
    pooled: bool = False
    device: int | None = None
    unpin: Callable[[], None] | None = None
    device_backend: DeviceBackend | None = None
    ticket: Ticket | None = None
    lease: Opened | None = None
    # A buffer made of pieces (:meth:`joined`): their arrays in order and where each ends in it.
    pieces: tuple[Any, ...] = ()
    ends: tuple[int, ...] = ()

    @classmethod
    def joined(cls, pieces: Sequence[np.ndarray[Any, Any]]) -> Buffer:
        """One buffer whose bytes are those of ``pieces`` (non-empty flat ``uint8`` host arrays,
        any memory) back to back, in place: what the data planes stream from or into several
        arrays as one object. A range they move lies within one piece (:meth:`piece_end`);
        :attr:`array` is empty, so code that reads a whole buffer fails instead of reading it."""
        if not pieces or any(p.ndim != 1 or p.dtype != np.uint8 or not p.nbytes for p in pieces):
            raise InvalidArgumentError("pieces must be non-empty flat uint8 arrays", argument="pieces")
        ends = tuple(itertools.accumulate(int(p.nbytes) for p in pieces))
        return cls(np.empty(0, np.uint8), BufferKind.PRIVATE, pieces=tuple(pieces), ends=ends)

    def piece_end(self, pos: int) -> int:
        """Where the piece holding byte ``pos`` ends (the buffer's end but for :meth:`joined`)."""
        if not self.pieces:
            return self.nbytes
        return self.ends[bisect.bisect_right(self.ends, pos)]

    @classmethod
    def wrap(
        cls,
        array: Any,
        *,
        pooled: bool = False,
        ticket: Ticket | None = None,
        lease: Opened | None = None,
    ) -> Buffer:
        """The buffer of a flat ``uint8`` ``array`` (NumPy, or a device backend's array)."""
        backend = device.backend_for(array)
        kind = buffer_kind(array, backend)
        if array.ndim != 1 or array.dtype != np.uint8:
            raise InvalidArgumentError(
                f"a buffer is a flat uint8 array, got shape {array.shape} of {array.dtype}", argument="array"
            )
        dev = None if backend is None else backend.device_of(array)
        return cls(array, kind, pooled, dev, device_backend=backend, ticket=ticket, lease=lease)

    @classmethod
    def pinned(cls, nbytes: int) -> Buffer:
        """A new buffer of ``nbytes`` of pinned host memory (needs CuPy and a CUDA driver)."""
        import cupy

        mem = cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
        return cls(np.frombuffer(mem, np.uint8, nbytes), BufferKind.PINNED)

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.ends[-1] if self.pieces else int(self.array.nbytes)

    @property
    def page_locked(self) -> bool:
        """Whether the bytes are in page-locked host memory (pinned: allocated so, or registered
        with CUDA by ``put(..., pinned=True)``)."""
        return self.kind is BufferKind.PINNED or self.unpin is not None

    def release_pin(self) -> None:
        """Undo a registration of the memory as page-locked (before it is freed or reused);
        idempotent."""
        unpin, self.unpin = self.unpin, None
        if unpin is not None:
            unpin()

    def close_lease(self) -> None:
        """Close the other process's memory this buffer reads in place, if any (a lent copy,
        once read); idempotent."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.close()

    @property
    def on_device(self) -> bool:
        """Whether the bytes are in GPU memory."""
        return self.kind is BufferKind.DEVICE

    @property
    def backend(self) -> DeviceBackend:
        """The device backend of a device buffer (raises for host memory)."""
        backend = self.device_backend
        if backend is None:
            raise InvalidArgumentError(f"a {self.kind.value} buffer is host memory", argument="buffer")
        return backend

    @property
    def host(self) -> np.ndarray[Any, Any]:
        """The bytes as a flat NumPy ``uint8`` array (raises for device memory: see :meth:`to_host`)."""
        if self.kind not in HOST_KINDS:
            raise InvalidArgumentError(
                f"a {self.kind.value} buffer has no host view; copy it with Buffer.to_host()",
                argument="buffer",
            )
        return self.array  # type: ignore[no-any-return]

    def view(self, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` as an array of the same memory (what a transfer sends or fills;
        within one piece of a :meth:`joined` buffer)."""
        if self.pieces:
            i = bisect.bisect_right(self.ends, start)
            base = self.ends[i - 1] if i else 0
            if end > self.ends[i]:
                raise InvalidArgumentError(f"bytes {start}..{end} span two pieces", argument="end")
            return self.pieces[i][start - base : end - base]
        return self.array[start:end]

    def host_chunk(self, start: int, end: int) -> np.ndarray[Any, Any]:
        """Bytes ``[start, end)`` in host memory: a view of host memory, or a new host copy of
        that chunk of device memory (what the data plane sends: it runs UCX's TCP transport,
        which sends host memory only; its window of chunks in flight keeps the copies of the next
        chunks running while earlier ones are on the wire)."""
        if self.kind in HOST_KINDS:
            return self.view(start, end)  # type: ignore[no-any-return]
        return self.backend.host_copy(self.array[start:end])

    def to_host(self) -> np.ndarray[Any, Any]:
        """The bytes in host memory: the host view itself, or a copy of device memory."""
        if self.kind in HOST_KINDS:
            return self.array  # type: ignore[no-any-return]
        return self.backend.host_copy(self.array)

    def digest(self) -> bytes:
        """:func:`digest_of` the bytes (device memory is hashed from a host copy)."""
        return digest_of(self.to_host())

    def typed(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> Any:
        """The bytes viewed as ``dtype`` and ``shape``, read-only where the array type allows."""
        if self.on_device:
            return self.backend.typed(self.array, dtype, shape)
        view = self.array.view(dtype).reshape(shape)
        if isinstance(view, np.ndarray):
            view.flags.writeable = False
        return view


def digest_of(buf: np.ndarray[Any, Any]) -> bytes:
    """128-bit xxh3 digest of a contiguous byte buffer (about 10 GB/s)."""
    return xxhash.xxh3_128_digest(memoryview(buf).cast("B"))  # type: ignore[arg-type]


def _baseline_refcount() -> int:
    """``sys.getrefcount`` of a buffer referenced only by a pool's list, seen from its scan loop."""
    free = deque([np.empty(1, np.uint8)])
    for _, buf in enumerate(free):  # the same loop shape as BufferPool.allocate
        return sys.getrefcount(buf)
    raise AssertionError("unreachable")


_UNSHARED_REFS = _baseline_refcount()


#: Smallest buffer :func:`private_pages` maps itself.
PRIVATE_PAGES_MIN_BYTES = 1 << 20


def private_pages(nbytes: int) -> np.ndarray[Any, Any]:
    """New private memory of ``nbytes`` for the pool of a node alone on its host (in place of a
    segment). A large one is anonymous pages nobody asked to be huge: NumPy asks
    (``madvise(MADV_HUGEPAGE)``) for every large array, and with that memory first-round
    reduces of 64 MiB among 4 processes stalled at 0.8-1.0 s against 0.22-0.37 s (later runs
    of the same kind saw no compaction: the cause is open; bench/pages/defaults.md, "New buffers
    of a node alone on its host"). The kernel still backs them with huge pages where its policy is
    ``always``."""
    if nbytes < PRIVATE_PAGES_MIN_BYTES:
        return np.empty(nbytes, np.uint8)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (default: shared)
    return np.frombuffer(memoryview(pages), np.uint8)  # (through a view: not a MAPPED buffer)


#: Smallest allocation for which a pool holding a buffer of that size that something still refers
#: to runs the garbage collector's young generations before it allocates new memory.
COLLECT_MIN_BYTES = 8 << 20


class BufferPool:
    """Recycles the byte buffers of removed objects for new objects of the same size.

    Writing into freshly allocated memory costs a page fault per page: a 64 MiB receive into a
    new buffer took 20 ms, into a recycled one 12 ms (``bench/p2p.py``). A removed object's
    buffer is kept (oldest dropped first beyond ``max_bytes``) and handed out again only once
    nothing else refers to it: an array returned by ``get`` is a view that keeps its buffer
    referenced, as does a transfer still using it, and such a buffer is never reused under them.
    Where a buffer of the size wanted (at least :data:`COLLECT_MIN_BYTES`) is still referred to,
    the garbage collector's young generations are collected once before new memory is taken: a
    reference cycle (an exception's traceback holding a cancelled transfer's frames) is often
    the only other holder. Thread-safe (``put`` copies on the caller's thread).

    With ``shared_min_bytes`` > 0, buffers of at least that many bytes live in shared-memory
    segments (:mod:`hoplite_gpu.memory.shm`) that processes on the same host copy from directly; a
    segment is retired (readers reject it) as soon as it is released, reused only once no other
    process maps it (:func:`hoplite_gpu.memory.shm.map_view`), and unlinked when the pool lets go of it.
    With :attr:`private` set (its node is alone on its host) new buffers are private memory
    (:func:`private_pages`), cheaper to fault in than a new segment, and a free buffer of either
    kind is reused.
    """

    def __init__(self, max_bytes: int, shared_min_bytes: int = 0) -> None:
        self.max_bytes = max_bytes
        self.shared_min_bytes = shared_min_bytes
        self.private = False  # see the class docstring
        self.held_bytes = 0
        self.reused = 0
        self.collections = 0
        self._free: deque[np.ndarray[Any, Any]] = deque()
        self._lock = threading.Lock()

    def shares(self, nbytes: int) -> bool:
        """Whether a buffer of ``nbytes`` goes in a shared-memory segment (where ``/dev/shm`` has
        room) when it is new."""
        return 0 < self.shared_min_bytes <= nbytes and not self.private

    def allocate(self, nbytes: int, populate: bool = True) -> np.ndarray[Any, Any]:
        """A flat uint8 buffer of ``nbytes`` (recycled when an unreferenced one fits exactly).
        ``populate=False``: a new segment's pages are not mapped yet, for a caller that fills it
        whole with :func:`write_at`; a recycled segment's are mapped as it is handed out, and
        :func:`write_at` then writes in place (:meth:`hoplite_gpu.memory.shm.Segment.populate`)."""
        shared = self.shares(nbytes)
        kind = None if self.private else shared  # (alone on its host: a free buffer of either kind)
        buf, pinned = self._take(nbytes, kind)
        if buf is None and pinned and nbytes >= COLLECT_MIN_BYTES:
            # Often the only other holder is a reference cycle, such as an exception's traceback
            # that still holds the frames of a cancelled transfer. The young generations are
            # collected in about 1 ms, which is less than new memory costs (bench/pages/defaults.md,
            # "Reduces that missed the pool").
            gc.collect(1)
            self.collections += 1
            buf, _ = self._take(nbytes, kind)
        if buf is not None:
            seg = shm.segment_of(buf)
            if seg is not None:
                seg.populate()  # (its pages exist: written in place from now on)
            return buf
        created = shm.create(nbytes, populate) if shared else None
        if created is not None:
            return created
        return private_pages(nbytes) if self.private else np.empty(nbytes, np.uint8)

    def _take(self, nbytes: int, shared: bool | None) -> tuple[np.ndarray[Any, Any] | None, bool]:
        """A free buffer of ``nbytes`` nothing else refers to (a segment or not as ``shared``
        says, None: either), removed from the pool (or None), and whether one of that size is
        held but still referred to."""
        pinned = False
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes != nbytes:
                    continue
                seg = shm.segment_of(buf)
                if shared is not None and (seg is not None) != shared:
                    continue
                if sys.getrefcount(buf) > _UNSHARED_REFS:
                    pinned = True
                    continue
                if seg is not None and seg.mapped_elsewhere():
                    continue
                del self._free[i]
                self.held_bytes -= nbytes
                self.reused += 1
                return buf, pinned
        return None, pinned

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


def through_file(dst: np.ndarray[Any, Any]) -> bool:
    """Whether :func:`write_at` writes into ``dst`` through its segment's file (a segment created
    without its pages mapped): a writer then fills a scratch buffer of its own and writes that,
    rather than writing ``dst`` in place."""
    seg = shm.segment_of(dst)
    return seg is not None and not seg.populated


def write_at(dst: np.ndarray[Any, Any], pos: int, src: np.ndarray[Any, Any]) -> None:
    """Copy the contiguous bytes ``src`` into the flat uint8 ``dst`` at ``pos``: through the file
    where ``dst`` is a segment created without its pages mapped (:meth:`Segment.write_file
    <hoplite_gpu.memory.shm.Segment.write_file>`), else through memory."""
    seg = shm.segment_of(dst)
    if seg is not None and not seg.populated and seg.write_file(_payload_offset(seg, dst) + pos, src):
        return  # through_file
    np.copyto(dst[pos : pos + src.nbytes], src.reshape(-1).view(np.uint8))


def _payload_offset(seg: shm.Segment, buf: np.ndarray[Any, Any]) -> int:
    """Where ``buf`` starts in ``seg``'s payload."""
    start = np.frombuffer(seg, np.uint8, count=1, offset=shm.HEADER_BYTES)
    return int(buf.__array_interface__["data"][0] - start.__array_interface__["data"][0])


def _drop(buf: np.ndarray[Any, Any]) -> None:
    """Let go of a buffer: a shared-memory segment's file is unlinked now (its memory is freed
    once no array uses it any more)."""
    seg = shm.segment_of(buf)
    if seg is not None:
        seg.unlink()
