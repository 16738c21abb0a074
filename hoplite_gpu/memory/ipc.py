"""Same-host device objects through CUDA IPC: readers copy device to device from the holder's memory.

A device object the store keeps in its own allocation (:meth:`DeviceBackend.empty_shared
<hoplite_gpu.memory.backend.DeviceBackend.empty_shared>`) is *exported*: the holder writes the
allocation's inter-process handle into a small *ticket*, a shared-memory segment of
:mod:`hoplite_gpu.memory.shm` published under the object's ID, and tells the directory its name (``ipc:``
followed by the segment's name, in the copy's ``segment`` field). A reader on the same host that
can open device memory (``LookupRequest.device_ipc``) is answered with the ticket like a
shared-memory segment; it reads the ticket under the ticket's lock (:func:`shm.read_locked`: one
``pread``, fewer system calls than a mapping), opens the handle (``cudaIpcOpenMemHandle``) and
copies the bytes device to device: for a ``get``, straight into the array it returns; for a reduce
vertex, into a store copy of its own (exported in turn).

The ticket is the lifetime guard, as for shared-memory segments: a reader holds a shared lock on
it for as long as it has the holder's memory open (:func:`open_ticket`), the holder marks it
retired when it drops the object and lets the memory go only once no reader holds the lock
(:meth:`Ticket.retire`; until then the memory is kept in a draining list, checked again at every
later retirement and export). A ticket whose process is gone, whose object is another, or whose
handle does not open here yields None, and the reader pulls over the data plane instead.

Memory let go goes to the process's :data:`POOL` (:class:`DevicePool`), which hands it to the next
device copy of the same size on the same device: a training loop that puts same-sized gradients
every step allocates once, rather than paying ``cudaMalloc`` at every put and ``cudaFree`` (which
waits for the whole device) at every delete, and its readers see the same allocation again. The
retired ticket goes with the allocation and names it for its next object (published again
under that object's ID): no new segment and no new handle per put, and no unlink per delete.

Readers keep what they opened: opening a handle maps the holder's whole allocation and closing it
unmaps it again, a fixed cost of every read. A reader keeps up to :data:`MAX_MAPPINGS` mappings
open after reading (:func:`open_ticket`) and uses one again when a later ticket names the same
allocation. CUDA leaves undefined what happens when an exporter frees memory another process still
has open, so each exported allocation has a *pin*: an empty shared-memory segment its tickets
name. A reader holds a shared lock on the pin while it keeps the mapping; the holder retires the
pin before it frees the allocation, and frees it only once it can take the lock exclusively (until
then it stays referenced, checked again at every :func:`reap`). Readers close the mappings of
retired pins, and of processes that are gone, at their next open and at every :func:`sweep` (each
node calls both once per heartbeat interval).

Record layout (the ticket's payload, little-endian)::

    0   8s   device backend name ("cupy", "sim")
    8   I    device ordinal of the allocation
    12  I    exporting process id
    16  Q    byte offset of the object in the allocation
    24  Q    object size in bytes
    32  H    handle length
    34  ...  handle (at most HANDLE_BYTES)
    162 H    pin name length (0: none; the reader then closes what it opened after reading)
    164 ...  pin name (at most PIN_BYTES)
    228 16s  dtype of the object (wire form; empty: not described)
    244 B    number of dimensions (at most MAX_DIMS)
    245 ...  shape, one Q per dimension

Readers of the same cluster find the ticket of an object its owner put without asking the
directory (:func:`open_indexed`): once the directory has registered the put, the owner links the
ticket under a name derived from the ObjectID and a key of the cluster (:meth:`Ticket.index`,
:func:`hoplite_gpu.memory.shm.index_name`); the record's dtype and shape give the reader what a lookup
would have. The link goes when the ticket is retired (the object deleted), and with its process.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..protocol import IPC_SEGMENT_PREFIX
from . import device, shm

log = logging.getLogger("hoplite_gpu")

#: What a ticket's name starts with in a copy's ``segment`` (a shared-memory segment's has none).
PREFIX = IPC_SEGMENT_PREFIX
#: The longest handle a ticket holds (a CUDA IPC handle is 64 bytes).
HANDLE_BYTES = 128
_RECORD = struct.Struct("<8sIIQQH")
#: The longest pin name a ticket holds.
PIN_BYTES = 64
_PIN = struct.Struct("<H")
_PIN_AT = _RECORD.size + HANDLE_BYTES
#: The most dimensions a ticket describes (an object of more is not indexed).
MAX_DIMS = 32
_META = struct.Struct("<16sB")
_META_AT = _PIN_AT + _PIN.size + PIN_BYTES
_SHAPE_AT = _META_AT + _META.size
#: Payload bytes of a ticket.
RECORD_BYTES = _SHAPE_AT + 8 * MAX_DIMS
#: What a pin is published as (it stands for an allocation, not an object).
_PIN_ID = bytes(20)
#: How many holders' allocations a process keeps open after reading them (0: none).
MAX_MAPPINGS = 16

_draining: list[Ticket] = []  # retired tickets whose memory a reader may still read
_draining_lock = threading.Lock()
_pinned: list[tuple[Any, shm.Segment]] = []  # allocations let go that a reader still keeps open
_pinned_lock = threading.Lock()


def _new_pin() -> shm.Segment | None:
    """A published pin for a new exported allocation (None when ``/dev/shm`` has no room)."""
    buf = shm.create(0)
    pin = None if buf is None else shm.segment_of(buf)
    if pin is not None:
        pin.publish(_PIN_ID)
    return pin


def _let_go(array: Any, pin: shm.Segment | None) -> None:
    """Free an exported allocation no object uses any more: now, or (when a reader keeps it open)
    once the reader has closed it, which it does when it sees the retired pin."""
    if pin is None:
        return  # ``array`` goes with its last reference
    pin.retire()
    if pin.mapped_elsewhere():
        with _pinned_lock:
            _pinned.append((array, pin))
    else:
        pin.unlink()


def cluster_key(token: str, directory_address: str) -> str:
    """The key every node of one cluster derives alike for index links (16 hex digits of a hash of
    the cluster's token and its directory's address: two clusters on one host never share one)."""
    digest = hashlib.sha256(b"hoplite-index\0" + token.encode() + b"\0" + directory_address.encode())
    return digest.hexdigest()[:16]


def is_ticket(segment: str) -> bool:
    """Whether a copy's ``segment`` names a device ticket (not a shared-memory segment)."""
    return segment.startswith(PREFIX)


class Ticket:
    """The holder's export of one device buffer: the published record and the memory it names
    (referenced until the ticket is retired and no reader holds it; then offered to :data:`POOL`
    when ``pooled``)."""

    def __init__(
        self,
        record: np.ndarray[Any, Any],
        array: Any,
        backend: device.DeviceBackend,
        pooled: bool,
        pin: shm.Segment | None,
    ) -> None:
        segment = shm.segment_of(record)
        assert segment is not None
        self._segment: shm.Segment | None = segment
        self._record: np.ndarray[Any, Any] | None = record  # the segment's payload
        self._array: Any = array
        self._backend = backend
        self._pooled = pooled
        self._pin = pin
        self._retired = False
        self.name = PREFIX + segment.name

    def publish(self, object_id: bytes, dtype: str = "", shape: tuple[int, ...] = ()) -> str:
        """Declare the memory to hold ``object_id`` (complete), of ``dtype`` (wire form) and
        ``shape``; the name for the directory ("" once retired: a dropped copy is never offered
        again)."""
        if self._retired or self._segment is None:
            return ""
        self._segment.begin_write()
        described = len(dtype.encode()) <= 16 and len(shape) <= MAX_DIMS
        name = dtype.encode() if described else b""
        dims = shape if described else ()
        _META.pack_into(self._segment, shm.HEADER_BYTES + _META_AT, name, len(dims))
        struct.pack_into(f"<{len(dims)}Q", self._segment, shm.HEADER_BYTES + _SHAPE_AT, *dims)
        self._segment.publish(object_id)
        return self.name

    def index(self, cluster: str, object_id: bytes) -> bool:
        """Link the published ticket under ``object_id``'s index name in ``cluster`` (see the
        module docstring); whether readers find it there (not when another live holder's is)."""
        if self._retired or self._segment is None or not self._segment.published:
            return False
        return self._segment.link(shm.index_name(cluster, object_id))

    def retire(self) -> None:
        """The object is dropped: readers reject the ticket from now on, and the memory is let go
        as soon as no reader has it open. Idempotent."""
        if self._retired or self._segment is None:
            return
        self._retired = True
        self._segment.retire()
        with _draining_lock:
            _draining.append(self)
        reap()

    def _release(self) -> bool:
        """Let go if no reader holds the ticket; whether it did."""
        segment = self._segment
        if segment is None:
            return True
        if segment.mapped_elsewhere():
            return False
        array, record = self._array, self._record
        self._segment = self._array = self._record = None
        _local.pop(self.name, None)
        if self._pooled:
            # The ticket goes with its allocation, retired: the allocation's next object is
            # published in it again (no new segment, and no new handle, for each put).
            POOL.give(self._backend, array, self._pin, record)
        else:
            segment.unlink()
            _let_go(array, self._pin)
        return True

    @property
    def held(self) -> bool:
        """Whether the memory is still referenced (not yet let go)."""
        return self._array is not None


def reap() -> int:
    """Free the memory of retired tickets no reader holds any more, and allocations let go that no
    reader keeps open any more; how many tickets are still held. Called at every export and
    retirement and by each node once per heartbeat interval (a reader letting go is not seen
    before that)."""
    with _pinned_lock:
        kept = []
        for array, pin in _pinned:
            if pin.mapped_elsewhere():
                kept.append((array, pin))
            else:
                pin.unlink()  # and ``array`` goes with its last reference
        _pinned[:] = kept
    with _draining_lock:
        _draining[:] = [t for t in _draining if not t._release()]
        return len(_draining)


def _drop_record(record: np.ndarray[Any, Any] | None) -> None:
    """Remove a retired ticket that names no allocation any more."""
    segment = None if record is None else shm.segment_of(record)
    if segment is not None:
        segment.unlink()


def export(
    array: Any,
    pooled: bool = False,
    pin: shm.Segment | None = None,
    record: np.ndarray[Any, Any] | None = None,
) -> Ticket | None:
    """A ticket for the flat device ``array`` (not published yet), or None when its backend
    cannot share it with other processes or ``/dev/shm`` has no room. With ``pooled`` the memory
    goes to :data:`POOL` once let go (only for memory nothing else owns: :func:`allocate`'s).
    ``pin``: the allocation's, from an earlier export (a new one is made without). ``record``:
    the payload of the retired ticket that named this very allocation last (:class:`Spare`),
    which names it again as it is."""
    backend = device.backend_for(array)
    if backend is None:
        _drop_record(record)
        _let_go(array, pin)
        return None
    if record is None:
        written = _new_record(backend, array, pin)
        if written is None:
            _let_go(array, pin)
            return None
        record, pin = written
    ticket = Ticket(record, array, backend, pooled, pin)
    with _draining_lock:
        _local[ticket.name] = ticket
    reap()
    return ticket


def _new_record(
    backend: device.DeviceBackend, array: Any, pin: shm.Segment | None
) -> tuple[np.ndarray[Any, Any], shm.Segment | None] | None:
    """A new ticket's payload naming the flat device ``array`` and its pin (a new pin where
    ``pin`` is None), or None when the backend cannot share ``array`` or ``/dev/shm`` has no
    room."""
    exported = None if len(backend.name) > 8 else backend.export(array)
    if exported is None or len(exported[0]) > HANDLE_BYTES:
        return None
    record = shm.create(RECORD_BYTES)
    if record is None:
        return None
    handle, offset = exported
    pin = pin or _new_pin()
    pin_name = b"" if pin is None else pin.name.encode()
    _RECORD.pack_into(
        record.data,
        0,
        backend.name.encode(),
        backend.device_of(array),
        shm.own_pid(),
        offset,
        int(array.nbytes),
        len(handle),
    )
    record[_RECORD.size : _RECORD.size + len(handle)] = np.frombuffer(handle, np.uint8)
    _PIN.pack_into(record.data, _PIN_AT, len(pin_name))
    record[_PIN_AT + _PIN.size : _PIN_AT + _PIN.size + len(pin_name)] = np.frombuffer(pin_name, np.uint8)
    return record, pin


def allocate(
    backend: device.DeviceBackend, nbytes: int, dev: int, share: bool = True
) -> tuple[Any, Ticket | None]:
    """Device memory for a store copy of ``nbytes`` on device ``dev``, and its ticket (None where
    it cannot be shared, or without ``share``: the store then serves it over the data plane only).
    Shared memory comes from :data:`POOL` where it holds an allocation of that size."""
    if not share:
        return backend.empty(nbytes, dev), None
    spare = POOL.take(backend, nbytes, dev)
    if spare is None:
        array = backend.empty_shared(nbytes, dev)
        return array, export(array, pooled=True)
    return spare.array, export(spare.array, pooled=True, pin=spare.pin, record=spare.record)


def allocate_here(nbytes: int, share: bool) -> tuple[Any, Ticket | None]:
    """:func:`allocate` with this process's default backend, on its current device (a reader's
    copy of another node's device object)."""
    backend = device.default_backend()
    return allocate(backend, nbytes, backend.current_device(), share)


_local: dict[str, Ticket] = {}  # this process's tickets by name (a process cannot open its own)


@dataclass(slots=True)
class Spare:
    """An allocation :class:`DevicePool` holds: its memory (a flat ``uint8`` array of its
    backend), its pin (see the module docstring), and the payload of the retired ticket that
    named it last (its next object's ticket, written for this allocation already)."""

    backend: device.DeviceBackend
    device: int
    array: Any
    pin: shm.Segment | None
    record: np.ndarray[Any, Any] | None = None


class DevicePool:
    """Recycles the exported device allocations of dropped objects for new device copies of the
    same size on the same device (puts, received copies, reduce outputs).

    An allocation is handed out again only once nothing refers to it any more
    (:meth:`DeviceBackend.references <hoplite_gpu.memory.backend.DeviceBackend.references>` against the
    count of an allocation only the pool holds, measured once per backend): a transfer still
    sending from it or a vertex still reading it keeps it out of use. Beyond ``max_bytes`` the
    oldest are freed. Process-wide like the tickets: every node of a process shares it, sized by
    the largest ``Config.device_pool_bytes`` of the nodes open (:meth:`attach`; 0 without any).
    Thread-safe.
    """

    def __init__(self) -> None:
        self.held_bytes = 0
        self.reused = 0
        self._sizes: dict[str, int] = {}
        self._spares: list[Spare] = []
        self._unreferenced: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    @property
    def users(self) -> int:
        """How many nodes are attached."""
        return len(self._sizes)

    @property
    def max_bytes(self) -> int:
        """Bytes the pool keeps at most."""
        return max(self._sizes.values(), default=0)

    def attach(self, user: str, max_bytes: int) -> None:
        """A node opened: ``user`` (its ID) wants up to ``max_bytes`` kept."""
        with self._lock:
            self._sizes[user] = max_bytes

    def detach(self, user: str) -> None:
        """A node closed: what it asked for no longer counts (spares beyond the rest are freed)."""
        with self._lock:
            self._sizes.pop(user, None)
            self._trim()

    def __len__(self) -> int:
        return len(self._spares)

    def take(self, backend: device.DeviceBackend, nbytes: int, dev: int) -> Spare | None:
        """An unreferenced allocation of exactly ``nbytes`` on ``dev`` of ``backend``, or None."""
        with self._lock:
            if not self._spares:
                return None
            unreferenced = self._baseline(backend, dev)
            for i, spare in enumerate(self._spares):
                if (
                    spare.backend is backend
                    and spare.device == dev
                    and spare.array.nbytes == nbytes
                    and _not_above(backend.references(spare.array), unreferenced)
                ):
                    del self._spares[i]
                    self.held_bytes -= nbytes
                    self.reused += 1
                    return spare
        return None

    def give(
        self,
        backend: device.DeviceBackend,
        array: Any,
        pin: shm.Segment | None = None,
        record: np.ndarray[Any, Any] | None = None,
    ) -> None:
        """Offer an allocation no object uses any more (it may still be referenced elsewhere),
        with its pin and its last ticket's payload (retired)."""
        nbytes = int(array.nbytes)
        if not 0 < nbytes <= self.max_bytes:
            _drop_record(record)
            _let_go(array, pin)
            return
        with self._lock:
            self._spares.append(Spare(backend, backend.device_of(array), array, pin, record))
            self.held_bytes += nbytes
            self._trim()

    def clear(self) -> None:
        """Free every held allocation (once readers that keep one open have closed it)."""
        with self._lock:
            for spare in self._spares:
                _drop_record(spare.record)
                _let_go(spare.array, spare.pin)
            self._spares.clear()
            self.held_bytes = 0

    def _trim(self) -> None:
        limit = self.max_bytes
        while self.held_bytes > limit:
            spare = self._spares.pop(0)
            self.held_bytes -= int(spare.array.nbytes)
            _drop_record(spare.record)
            _let_go(spare.array, spare.pin)

    def _baseline(self, backend: device.DeviceBackend, dev: int) -> tuple[int, ...]:
        """What :meth:`DeviceBackend.references` says of an allocation only a pool entry holds,
        seen from :meth:`take`'s loop (measured on a one-byte allocation of the backend's own)."""
        known = self._unreferenced.get(backend.name)
        if known is None:
            probe = [Spare(backend, dev, backend.empty_shared(1, dev), None)]
            for spare in probe:  # the same shape as take's loop
                known = self._unreferenced[backend.name] = backend.references(spare.array)
            assert known is not None
        return known


def _not_above(counts: tuple[int, ...], limits: tuple[int, ...]) -> bool:
    return len(counts) == len(limits) and all(c <= limit for c, limit in zip(counts, limits, strict=True))


#: The process's pool of device allocations (see :class:`DevicePool`); sized by its nodes.
POOL = DevicePool()


class Opened:
    """A holder's device memory, open for reading: ``array`` (flat ``uint8``, of this process's
    default backend) until :meth:`close`, which also lets go of the ticket's lock."""

    __slots__ = ("_close", "_ticket", "array")

    def __init__(self, array: Any, close: Callable[[], None], ticket: shm.Locked) -> None:
        self.array = array
        self._close: Callable[[], None] | None = close
        self._ticket: shm.Locked | None = ticket

    def close(self) -> None:
        """Close the memory and let go of the ticket (the holder may then free it); idempotent."""
        close, self._close = self._close, None
        ticket, self._ticket = self._ticket, None
        self.array = None
        try:
            if close is not None:
                _close_mapping(close)
        finally:
            if ticket is not None:
                ticket.close()  # the ticket's lock goes now


def _close_mapping(close: Callable[[], None]) -> None:
    """Call a mapping's ``close`` (from :meth:`DeviceBackend.open_export
    <hoplite_gpu.memory.backend.DeviceBackend.open_export>`), logging a failure."""
    try:
        close()
    except Exception as exc:  # a CUDA error while closing: nothing more to do than say so
        log.warning("closing a device IPC mapping failed: %s", exc)


@dataclass(frozen=True, slots=True)
class Record:
    """What a ticket says (see the module docstring for its layout)."""

    backend: str
    device: int
    pid: int
    offset: int
    nbytes: int
    handle: bytes
    pin: str
    dtype: str = ""  # wire form; "" where the holder did not describe the object
    shape: tuple[int, ...] = ()


def _map(segment: str, object_id: bytes, nbytes: int) -> tuple[shm.Locked, Record] | None:
    """The ticket, read under its shared lock (held until the first item is closed), and its
    record, or None when it is gone, retired, of another object or of another size."""
    if not is_ticket(segment):
        return None
    mapped = _map_name(segment[len(PREFIX) :], object_id)
    if mapped is not None and mapped[1].nbytes != nbytes:
        mapped[0].close()
        return None
    return mapped


def _map_name(name: str, object_id: bytes) -> tuple[shm.Locked, Record] | None:
    """:func:`_map` of the segment (or index link) ``name``, whatever the object's size."""
    ticket = shm.read_locked(name, object_id, RECORD_BYTES)
    if ticket is None:
        return None
    record = _parse(ticket.payload)
    if record is None:
        ticket.close()
        return None
    return ticket, record


def _parse(raw: bytes) -> Record | None:
    """A ticket's record from its payload (None when it makes no sense)."""
    backend_name, dev, pid, offset, size, length = _RECORD.unpack_from(raw, 0)
    (pin_length,) = _PIN.unpack_from(raw, _PIN_AT)
    dtype_name, ndim = _META.unpack_from(raw, _META_AT)
    if length > HANDLE_BYTES or ndim > MAX_DIMS:
        return None
    try:
        backend = backend_name.rstrip(b"\0").decode("ascii")
        dtype = dtype_name.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        return None
    handle = raw[_RECORD.size : _RECORD.size + length]
    try:
        pin = raw[_PIN_AT + _PIN.size : _PIN_AT + _PIN.size + min(pin_length, PIN_BYTES)].decode()
    except UnicodeDecodeError:
        pin = ""
    shape = struct.unpack_from(f"<{ndim}Q", raw, _SHAPE_AT)
    pin = pin if shm.valid_name(pin) else ""
    return Record(backend, dev, pid, offset, size, handle, pin, dtype, tuple(shape))


def read_ticket(segment: str, object_id: bytes, nbytes: int) -> Record | None:
    """The record of a published ticket (None: see :func:`open_ticket`), without opening it."""
    mapped = _map(segment, object_id, nbytes)
    if mapped is None:
        return None
    mapped[0].close()
    return mapped[1]


def open_ticket(segment: str, object_id: bytes, nbytes: int) -> Opened | None:
    """Open the device memory a same-host holder published as ``object_id`` under ``segment``
    (from the directory), for reading it with this process's default backend; None when the
    ticket is gone, retired, of another object or size, of another backend, or when the handle
    does not open here (its process is gone, no peer access). Close it once read."""
    mapped = _map(segment, object_id, nbytes)
    if mapped is None:
        return None
    ticket, record = mapped
    if record.pid == shm.own_pid():
        if record.backend == device.default_backend().name:
            with _draining_lock:
                mine = _local.get(segment)
            if mine is not None and mine._array is not None:
                return Opened(mine._array[:nbytes], lambda: None, ticket)
        ticket.close()
        return None
    known: dict[int, bool] = {}
    if not shm.exporter_alive(segment[len(PREFIX) :], known):
        ticket.close()
        return None  # its process is gone: its memory with it (CUDA would refuse the handle)
    return _open_record(ticket, record, known)


def open_indexed(cluster: str, object_id: bytes) -> tuple[Opened, Record] | None:
    """Open the device memory of ``object_id`` that its owner in ``cluster`` put on this host and
    indexed (:meth:`Ticket.index`), without asking the directory: the memory open for reading
    (close it once read) and the ticket's record, whose ``dtype`` and ``shape`` describe the
    object. None when there is no such index link, or the ticket is retired, undescribed, of this
    process, of a process that is gone, or does not open here: the caller asks the directory."""
    mapped = _map_name(shm.index_name(cluster, object_id), object_id)
    if mapped is None:
        return None
    ticket, record = mapped
    known: dict[int, bool] = {}
    if not record.dtype or record.pid == shm.own_pid() or not shm.alive(ticket.creator, known):
        ticket.close()
        return None
    opened = _open_record(ticket, record, known)
    if opened is None:
        return None
    with _mappings_lock:
        _counts["indexed"] += 1
    return opened, record


def _open_record(ticket: shm.Locked, record: Record, known: dict[int, bool]) -> Opened | None:
    """Open the memory of another process's ticket (read under its lock, which the result holds;
    closed here when the memory does not open) with this process's default backend; None when it
    does not open here. ``known``: the processes found alive during this read (:func:`shm.alive`)."""
    backend = device.default_backend()
    try:
        if record.backend != backend.name or not backend.available():
            ticket.close()
            return None
        array, close = _open(backend, record, backend.current_device(), known)
    except Exception as exc:  # DeviceIpcError, or the driver's own error
        log.debug("cannot open device memory of pid %d: %s", record.pid, exc)
        ticket.close()
        return None
    return Opened(array, close, ticket)


# ---------------------------------------------------------------- mappings a reader keeps
@dataclass(eq=False, slots=True)
class _Mapping:
    """Another process's allocation this process keeps open (see the module docstring)."""

    key: tuple[str, bytes, int, int, int]
    backend: device.DeviceBackend
    device: int
    array: Any
    close: Callable[[], None]
    pin: np.ndarray[Any, Any] | None  # the pin's mapping, holding its shared lock
    users: int = 0
    stale: bool = False  # close once the last user is done

    def valid(self, known: dict[int, bool] | None = None) -> bool:
        """The holder still has the allocation and is not letting it go (``known``: see
        :func:`shm.alive`)."""
        return (
            not self.stale
            and self.pin is not None
            and shm.view_published(self.pin)
            and shm.exporter_alive(self.key[0], known)
        )


_mappings: OrderedDict[tuple[str, bytes, int, int, int], _Mapping] = OrderedDict()
_mappings_lock = threading.Lock()
_counts = {"opened": 0, "reused": 0, "indexed": 0}


def mapping_stats() -> dict[str, int]:
    """This process's reads of other processes' device memory: how many mappings it opened, how
    many reads used one it kept, how many found the memory through an index link rather than the
    directory (:func:`open_indexed`), and how many mappings it keeps now."""
    with _mappings_lock:
        return {**_counts, "kept": len(_mappings)}


def _open(
    backend: device.DeviceBackend, record: Record, dev: int, known: dict[int, bool] | None = None
) -> tuple[Any, Callable[[], None]]:
    """The memory ``record`` names, open on ``dev``, and what to call once it is read: from a
    mapping this process keeps where it has one of that allocation, or a new mapping (kept when
    the ticket names a pin that is still published). ``known``: see :func:`shm.alive`."""
    known = {} if known is None else known
    sweep(known=known)
    key = (record.pin, record.handle, record.offset, record.nbytes, dev)
    with _mappings_lock:
        entry = _mappings.get(key)
        if entry is not None and entry.backend is backend and entry.valid(known):
            _mappings.move_to_end(key)
            entry.users += 1
            _counts["reused"] += 1
            return entry.array, functools.partial(_read, entry)
    pin = shm.map_view(record.pin, _PIN_ID, 0) if record.pin and MAX_MAPPINGS > 0 else None
    array, close = backend.open_export(record.handle, record.offset, record.nbytes, dev)
    closing: list[_Mapping] = []
    with _mappings_lock:
        _counts["opened"] += 1
        if pin is None:  # no pin, or being let go: open for this read only
            return array, close
        entry = _Mapping(key, backend, dev, array, close, pin, users=1)
        old = _mappings.get(key)
        if old is not None:
            _drop_locked(old, closing)
        _mappings[key] = entry
        while len(_mappings) > MAX_MAPPINGS:
            idle = next((m for m in _mappings.values() if not m.users), None)
            if idle is None:
                break
            _drop_locked(idle, closing)
    for m in closing:
        _close(m)
    return array, functools.partial(_read, entry)


def _drop_locked(entry: _Mapping, closing: list[_Mapping]) -> None:
    """Stop keeping ``entry`` (under ``_mappings_lock``): into ``closing`` if nobody reads it now,
    else closed by its last reader."""
    del _mappings[entry.key]
    entry.stale = True
    if not entry.users:
        closing.append(entry)


def _read(entry: _Mapping) -> None:
    """A reader is done with a kept mapping (its copies out of it are complete)."""
    entry.backend.synchronize(entry.device)
    with _mappings_lock:
        entry.users -= 1
        done = entry.stale and not entry.users
    if done:
        _close(entry)


def _close(entry: _Mapping) -> None:
    """Close a kept mapping and let go of its pin (the holder may then free the allocation)."""
    _close_mapping(entry.close)
    entry.array = entry.pin = None


def sweep(everything: bool = False, known: dict[int, bool] | None = None) -> int:
    """Close the kept mappings whose holder is letting the allocation go or is gone (with
    ``everything``, every one not being read); how many stay open. ``known``: see
    :func:`shm.alive` (one liveness check per holder process, however many mappings of it are
    kept)."""
    known = {} if known is None else known
    closing: list[_Mapping] = []
    with _mappings_lock:
        for entry in list(_mappings.values()):
            if everything or not entry.valid(known):
                _drop_locked(entry, closing)
        left = len(_mappings)
    for entry in closing:
        _close(entry)
    return left
