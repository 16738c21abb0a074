"""Same-host device objects through CUDA IPC: readers copy device to device from the holder's memory.

A device object the store keeps in its own allocation (:meth:`DeviceBackend.empty_shared
<hoplite_gpu.device.DeviceBackend.empty_shared>`) is *exported*: the holder writes the
allocation's inter-process handle into a small *ticket*, a shared-memory segment of
:mod:`hoplite_gpu.shm` published under the object's ID, and tells the directory its name (``ipc:``
followed by the segment's name, in the copy's ``segment`` field). A reader on the same host that
can open device memory (``LookupRequest.device_ipc``) is answered with the ticket like a
shared-memory segment; it maps the ticket, opens the handle (``cudaIpcOpenMemHandle``) and copies
the bytes device to device: for a ``get``, straight into the array it returns; for a reduce
vertex, into a store copy of its own (exported in turn).

The ticket is the lifetime guard, as for shared-memory segments: a reader holds a shared lock on
it for as long as it has the holder's memory open (:func:`open_ticket`), the holder marks it
retired when it drops the object and frees the memory only once no reader holds the lock
(:meth:`Ticket.retire`; until then the memory is kept in a draining list, checked again at every
later retirement and export). A ticket whose process is gone, whose object is another, or whose
handle does not open here yields None, and the reader pulls over the data plane instead.

Record layout (the ticket's payload, little-endian)::

    0   8s   device backend name ("cupy", "sim")
    8   I    device ordinal of the allocation
    12  I    exporting process id
    16  Q    byte offset of the object in the allocation
    24  Q    object size in bytes
    32  H    handle length
    34  ...  handle (at most HANDLE_BYTES)
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import device, shm
from .protocol import IPC_SEGMENT_PREFIX

log = logging.getLogger("hoplite_gpu")

#: What a ticket's name starts with in a copy's ``segment`` (a shared-memory segment's has none).
PREFIX = IPC_SEGMENT_PREFIX
#: The longest handle a ticket holds (a CUDA IPC handle is 64 bytes).
HANDLE_BYTES = 128
_RECORD = struct.Struct("<8sIIQQH")
#: Payload bytes of a ticket.
RECORD_BYTES = _RECORD.size + HANDLE_BYTES

_draining: list[Ticket] = []  # retired tickets whose memory a reader may still read
_draining_lock = threading.Lock()


def is_ticket(segment: str) -> bool:
    """Whether a copy's ``segment`` names a device ticket (not a shared-memory segment)."""
    return segment.startswith(PREFIX)


class Ticket:
    """The holder's export of one device buffer: the published record and the memory it names
    (referenced until the ticket is retired and no reader holds it)."""

    def __init__(self, record: np.ndarray[Any, Any], array: Any) -> None:
        segment = shm.segment_of(record)
        assert segment is not None
        self._segment: shm.Segment | None = segment
        self._array: Any = array
        self._retired = False
        self.name = PREFIX + segment.name

    def publish(self, object_id: bytes) -> str:
        """Declare the memory to hold ``object_id`` (complete); the name for the directory ("" once
        retired: a dropped copy is never offered again)."""
        if self._retired or self._segment is None:
            return ""
        self._segment.publish(object_id)
        return self.name

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
        if self._segment is None:
            return True
        if self._segment.mapped_elsewhere():
            return False
        self._segment.unlink()
        self._segment = self._array = None
        _local.pop(self.name, None)
        return True

    @property
    def held(self) -> bool:
        """Whether the memory is still referenced (not yet let go)."""
        return self._array is not None


def reap() -> int:
    """Free the memory of retired tickets no reader holds any more; how many are still held.
    Called at every export and retirement (a reader letting go is not seen before that)."""
    with _draining_lock:
        _draining[:] = [t for t in _draining if not t._release()]
        return len(_draining)


def export(array: Any) -> Ticket | None:
    """A ticket for the flat device ``array`` (not published yet), or None when its backend
    cannot share it with other processes or ``/dev/shm`` has no room."""
    backend = device.backend_for(array)
    if backend is None:
        return None
    exported = backend.export(array)
    if exported is None:
        return None
    handle, offset = exported
    if len(handle) > HANDLE_BYTES or len(backend.name) > 8:
        return None
    record = shm.create(RECORD_BYTES)
    if record is None:
        return None
    _RECORD.pack_into(
        record.data,
        0,
        backend.name.encode(),
        backend.device_of(array),
        os.getpid(),
        offset,
        int(array.nbytes),
        len(handle),
    )
    record[_RECORD.size : _RECORD.size + len(handle)] = np.frombuffer(handle, np.uint8)
    ticket = Ticket(record, array)
    with _draining_lock:
        _local[ticket.name] = ticket
    reap()
    return ticket


def allocate(
    backend: device.DeviceBackend, nbytes: int, dev: int, share: bool = True
) -> tuple[Any, Ticket | None]:
    """Device memory for a store copy of ``nbytes`` on device ``dev``, and its ticket (None where
    it cannot be shared, or without ``share``: the store then serves it over the data plane only)."""
    if not share:
        return backend.empty(nbytes, dev), None
    array = backend.empty_shared(nbytes, dev)
    return array, export(array)


def allocate_here(nbytes: int, share: bool) -> tuple[Any, Ticket | None]:
    """:func:`allocate` with this process's default backend, on its current device (a reader's
    copy of another node's device object)."""
    backend = device.default_backend()
    return allocate(backend, nbytes, backend.current_device(), share)


_local: dict[str, Ticket] = {}  # this process's tickets by name (a process cannot open its own)


class Opened:
    """A holder's device memory, open for reading: ``array`` (flat ``uint8``, of this process's
    default backend) until :meth:`close`, which also lets go of the ticket's lock."""

    __slots__ = ("_close", "_record", "array")

    def __init__(self, array: Any, close: Callable[[], None], record: np.ndarray[Any, Any]) -> None:
        self.array = array
        self._close: Callable[[], None] | None = close
        self._record: np.ndarray[Any, Any] | None = record

    def close(self) -> None:
        """Close the memory and let go of the ticket (the holder may then free it); idempotent."""
        close, self._close = self._close, None
        self.array = None
        try:
            if close is not None:
                close()
        except Exception as exc:  # a CUDA error while closing: nothing more to do than say so
            log.warning("closing a device IPC mapping failed: %s", exc)
        finally:
            self._record = None  # the ticket's mapping, and with it its lock, goes now


@dataclass(frozen=True, slots=True)
class Record:
    """What a ticket says (see the module docstring for its layout)."""

    backend: str
    device: int
    pid: int
    offset: int
    nbytes: int
    handle: bytes


def _map(segment: str, object_id: bytes, nbytes: int) -> tuple[np.ndarray[Any, Any], Record] | None:
    """The ticket's mapping (holding its shared lock while referenced) and record, or None when it
    is gone, retired, of another object or of another size."""
    if not is_ticket(segment):
        return None
    view = shm.map_view(segment[len(PREFIX) :], object_id, RECORD_BYTES)
    if view is None:
        return None
    name, dev, pid, offset, size, length = _RECORD.unpack_from(view.data, 0)
    if size != nbytes or length > HANDLE_BYTES:
        return None
    try:
        backend = name.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        return None
    handle = bytes(view[_RECORD.size : _RECORD.size + length])
    return view, Record(backend, dev, pid, offset, size, handle)


def read_ticket(segment: str, object_id: bytes, nbytes: int) -> Record | None:
    """The record of a published ticket (None: see :func:`open_ticket`), without opening it."""
    mapped = _map(segment, object_id, nbytes)
    return None if mapped is None else mapped[1]


def open_ticket(segment: str, object_id: bytes, nbytes: int) -> Opened | None:
    """Open the device memory a same-host holder published as ``object_id`` under ``segment``
    (from the directory), for reading it with this process's default backend; None when the
    ticket is gone, retired, of another object or size, of another backend, or when the handle
    does not open here (its process is gone, no peer access). Close it once read."""
    mapped = _map(segment, object_id, nbytes)
    if mapped is None:
        return None
    view, record = mapped
    backend = device.default_backend()
    if record.backend != backend.name:
        return None
    if record.pid == os.getpid():
        with _draining_lock:
            mine = _local.get(segment)
        if mine is None or mine._array is None:
            return None
        return Opened(mine._array[:nbytes], lambda: None, view)
    if not shm.exporter_alive(segment[len(PREFIX) :]):
        return None  # its process is gone: its memory with it (CUDA would refuse the handle)
    try:
        if not backend.available():
            return None
        opened = backend.open_export(record.handle, record.offset, nbytes, backend.current_device())
    except Exception as exc:  # DeviceIpcError, or the driver's own error
        log.debug("cannot open device memory %s of pid %d: %s", segment, record.pid, exc)
        return None
    return Opened(opened[0], opened[1], view)
