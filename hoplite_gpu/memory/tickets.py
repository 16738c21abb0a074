"""A device object's ticket: the small shared-memory record that names its device memory to the
processes of its host, from the holder's side (:class:`Ticket`) and the reader's (:func:`read`).

The holder writes the allocation's inter-process handle into a *ticket*, a shared-memory segment
of :mod:`~hoplite_gpu.memory.shm` published under the object's ID, and tells the directory its name
(:data:`PREFIX` followed by the segment's name, in the copy's ``segment`` field). A reader reads
the ticket under the ticket's shared lock (:func:`~hoplite_gpu.memory.shm.read_locked`: one
``pread``) and keeps the lock for as long as it has the holder's memory open
(:class:`~hoplite_gpu.memory.ipc.Opened`):
the holder marks the ticket retired when it drops the object and lets the memory go only once no
reader holds the lock. What a process does with tickets (exporting, draining, opening, keeping
mappings) is :mod:`hoplite_gpu.memory.ipc`'s.

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
    501 32s  seal: HMAC-SHA256 of the ObjectID and bytes 0-500, keyed by :func:`ticket_key`

A ticket may also be linked under a name every node of the cluster derives from the ObjectID
(:meth:`Ticket.index`, :func:`~hoplite_gpu.memory.shm.index_name`, keyed by :func:`cluster_key`), so
same-host readers find it without asking the directory; the record's dtype and shape give them what
a lookup would have.

Anyone on the host can create files in ``/dev/shm``, and a root process in another container that
shares it can create them as any user. So the holder *seals* each publication (:meth:`Ticket.publish`):
an HMAC, keyed by a key derived from the cluster's token (:func:`ticket_key`), over the ObjectID it
is published as and the whole record. Every reader checks the seal before it trusts a word of the
record (:func:`read`): a ticket made without the token is never opened (the reader asks the
directory, or pulls). The seal costs no system call.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..protocol import IPC_SEGMENT_PREFIX
from . import shm
from .backend import DeviceBackend

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
_SEAL_AT = _SHAPE_AT + 8 * MAX_DIMS
_SEAL_BYTES = 32  # HMAC-SHA256
#: Payload bytes of a ticket.
RECORD_BYTES = _SEAL_AT + _SEAL_BYTES
_SEAL_DOMAIN = b"hoplite-ticket-seal\0"
#: What a pin is published as (it stands for an allocation, not an object).
PIN_ID = bytes(20)


def cluster_key(token: str, directory_id: str) -> str:
    """The key every node of one cluster derives alike for index links: 16 hex digits of a hash of
    the cluster's token and the id of the directory instance its nodes joined (a random id each
    directory makes at start, sent in its ``Welcome``): two clusters on one host never share one,
    even with one token and one directory address (two network namespaces), and a restarted
    directory starts a new set of names. "" (no index links) without a directory id."""
    if not directory_id:
        return ""
    digest = hashlib.sha256(b"hoplite-index\0" + token.encode() + b"\0" + directory_id.encode())
    return digest.hexdigest()[:16]


def ticket_key(token: str) -> bytes:
    """The key that seals the tickets of holders of ``token`` (see the module docstring): a hash
    of the token under a domain of its own (the token itself is used for nothing else here)."""
    return hashlib.sha256(b"hoplite-ticket-key\0" + token.encode()).digest()


def _seal(key: bytes, object_id: bytes, payload: Any) -> bytes:
    """The seal of a record ``payload`` (its bytes before the seal) published as ``object_id``."""
    return hmac.digest(key, _SEAL_DOMAIN + object_id + bytes(payload[:_SEAL_AT]), "sha256")


def sealed(key: bytes, object_id: bytes, payload: bytes) -> bool:
    """Whether a ticket's ``payload`` carries the seal of ``key`` for ``object_id`` (never with an
    empty key: a reader that knows no token trusts no ticket)."""
    if not key or len(payload) < RECORD_BYTES:
        return False
    return hmac.compare_digest(_seal(key, object_id, payload), payload[_SEAL_AT:RECORD_BYTES])


def is_ticket(segment: str) -> bool:
    """Whether a copy's ``segment`` names a device ticket (not a shared-memory segment)."""
    return segment.startswith(PREFIX)


def new_pin() -> shm.Segment | None:
    """A published pin for a new exported allocation: an empty segment a reader that keeps the
    allocation open holds a shared lock on (None when ``/dev/shm`` has no room)."""
    buf = shm.create(0)
    pin = None if buf is None else shm.segment_of(buf)
    if pin is not None:
        pin.publish(PIN_ID)
    return pin


def drop_record(record: np.ndarray[Any, Any] | None) -> None:
    """Remove a retired ticket that names no allocation any more."""
    segment = None if record is None else shm.segment_of(record)
    if segment is not None:
        segment.unlink()


def write(
    backend: DeviceBackend, array: Any, pin: shm.Segment | None
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
    pin = pin or new_pin()
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


class Ticket:
    """The holder's export of one device buffer: the published record and the memory it names
    (referenced until the ticket is retired and no reader holds it; then let go by the process's
    :class:`~hoplite_gpu.memory.ipc.ProcessIpc`, which pools it when ``pooled``)."""

    def __init__(
        self,
        record: np.ndarray[Any, Any],
        array: Any,
        backend: DeviceBackend,
        pooled: bool,
        pin: shm.Segment | None,
    ) -> None:
        segment = shm.segment_of(record)
        assert segment is not None
        self._segment: shm.Segment | None = segment
        self._record: np.ndarray[Any, Any] | None = record  # the segment's payload
        self.array: Any = array
        self.backend = backend
        self.pooled = pooled
        self.pin = pin
        self._retired = False
        self.name = PREFIX + segment.name

    def publish(self, object_id: bytes, key: bytes, dtype: str = "", shape: tuple[int, ...] = ()) -> str:
        """Declare the memory to hold ``object_id`` (complete), of ``dtype`` (wire form) and
        ``shape``, sealed with ``key`` (:func:`ticket_key`; readers trust no ticket published
        without one); the name for the directory ("" once retired: a dropped copy is never offered
        again)."""
        if self._retired or self._segment is None:
            return ""
        segment = self._segment
        segment.begin_write()
        described = len(dtype.encode()) <= 16 and len(shape) <= MAX_DIMS
        name = dtype.encode() if described else b""
        dims = shape if described else ()
        _META.pack_into(segment, shm.HEADER_BYTES + _META_AT, name, len(dims))
        struct.pack_into(f"<{len(dims)}Q", segment, shm.HEADER_BYTES + _SHAPE_AT, *dims)
        with memoryview(segment)[shm.HEADER_BYTES : shm.HEADER_BYTES + RECORD_BYTES] as payload:
            payload[_SEAL_AT:] = _seal(key, object_id, payload) if key else bytes(_SEAL_BYTES)
        segment.publish(object_id)
        return self.name

    def index(self, cluster: str, object_id: bytes) -> bool:
        """Link the published ticket under ``object_id``'s index name in ``cluster`` (see the
        module docstring); whether readers find it there (not when another live holder's is)."""
        if self._retired or self._segment is None or not self._segment.published:
            return False
        return self._segment.link(shm.index_name(cluster, object_id))

    def unindex(self) -> None:
        """Remove the ticket's index links (its holder joined another directory instance: the
        names of the one it left are not kept)."""
        if self._segment is not None:
            self._segment.unlink_links()

    def retire(self) -> bool:
        """The object is dropped: readers reject the ticket from now on. Whether this call retired
        it (false when it was already); the memory is let go by :meth:`ProcessIpc.retire
        <hoplite_gpu.memory.ipc.ProcessIpc.retire>`, which calls this, once no reader has it open."""
        if self._retired or self._segment is None:
            return False
        self._retired = True
        self._segment.retire()
        return True

    def release(self) -> np.ndarray[Any, Any] | None:
        """Stop naming the memory if no reader holds the ticket: the retired record (its segment,
        which names this allocation still), or None while a reader holds it. Called by the owner
        only; the memory itself (:attr:`array`) is the owner's to free or pool."""
        segment = self._segment
        if segment is None or segment.mapped_elsewhere():
            return None
        record = self._record
        self._segment = self._record = None
        return record

    @property
    def held(self) -> bool:
        """Whether the memory is still referenced (not yet let go)."""
        return self._segment is not None


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


def parse(raw: bytes) -> Record | None:
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


def read(
    name: str, object_id: bytes, key: bytes, refused: Callable[[], None] | None = None
) -> tuple[shm.Locked, Record] | None:
    """The ticket in segment (or index link) ``name``, read under its shared lock (held until the
    first item is closed), and its record; None when it is gone, retired, of another object, or
    not sealed with ``key`` (:func:`ticket_key`: not made by a holder of the cluster's token; then
    ``refused`` is called too)."""
    ticket = shm.read_locked(name, object_id, RECORD_BYTES)
    if ticket is None:
        return None
    if not sealed(key, object_id, ticket.payload):
        log.debug("refused ticket %s: not sealed with this cluster's key", name)
        ticket.close()
        if refused is not None:
            refused()
        return None
    record = parse(ticket.payload)
    if record is None:
        ticket.close()
        return None
    return ticket, record


def read_segment(
    segment: str, object_id: bytes, nbytes: int, key: bytes, refused: Callable[[], None] | None = None
) -> tuple[shm.Locked, Record] | None:
    """:func:`read` of a copy's ``segment`` (a ticket's name from the directory), also None when
    it is not a ticket or names an object of another size."""
    if not is_ticket(segment):
        return None
    found = read(segment[len(PREFIX) :], object_id, key, refused)
    if found is not None and found[1].nbytes != nbytes:
        found[0].close()
        return None
    return found
