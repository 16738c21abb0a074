"""Same-host device objects through CUDA IPC: readers copy device to device from the holder's memory.

Everything a process keeps for this lives in one object, :data:`PROCESS` (:class:`ProcessIpc`): the
tickets it exported, the retired ones a reader still holds, the allocations it let go that a reader
still keeps open, the mappings of other processes' memory it keeps, and its
:class:`~hoplite_gpu.memory.device_pool.DevicePool`. Every node of the process shares it.

A device object the store keeps in its own allocation (:meth:`DeviceBackend.empty_shared
<hoplite_gpu.memory.backend.DeviceBackend.empty_shared>`) is *exported* (:meth:`ProcessIpc.export`):
its :class:`~hoplite_gpu.memory.tickets.Ticket` names it to the processes of the host. A reader on
the same host that can open device memory (``LookupRequest.device_ipc``) is answered with the
ticket like a shared-memory segment; it opens the handle (``cudaIpcOpenMemHandle``,
:meth:`ProcessIpc.open_ticket`) and copies the bytes device to device: for a ``get``, straight into
the array it returns; for a reduce vertex, into a store copy of its own (exported in turn).

The ticket is the lifetime guard, as for shared-memory segments: a reader holds a shared lock on
it for as long as it has the holder's memory open, the holder marks it retired when it drops the
object and lets the memory go only once no reader holds the lock (until then the ticket is kept
in a draining list, checked again at every later retirement and export, :meth:`ProcessIpc.reap`).
A ticket whose process is gone, whose object is another, or whose handle does not open here yields
None, and the reader pulls over the data plane instead. Memory let go goes to the pool, with its
retired ticket, which names it for its next object: no new segment and no new handle per put, and
no unlink per delete.

Readers keep what they opened: opening a handle maps the holder's whole allocation and closing it
unmaps it again, a fixed cost of every read. A reader keeps up to :data:`MAX_MAPPINGS` mappings
open after reading and uses one again when a later ticket names the same allocation. CUDA leaves
undefined what happens when an exporter frees memory another process still has open, so each
exported allocation has a *pin*: an empty shared-memory segment its tickets name. A reader holds a
shared lock on the pin while it keeps the mapping; the holder retires the pin before it frees the
allocation, and frees it only once it can take the lock exclusively (until then it stays
referenced, checked again at every :meth:`ProcessIpc.reap`). Readers close the mappings of retired
pins, and of processes that are gone, at their next open and at every :meth:`ProcessIpc.sweep`
(each node calls both once per heartbeat interval).

Readers of the same cluster find the ticket of an object its owner put without asking the
directory (:meth:`ProcessIpc.open_indexed`): once the directory has registered the put, the owner
links the ticket under a name derived from the ObjectID and a key of the cluster.

Every ticket a reader opens, whether its name came from the directory or from an index link, must
carry the seal of the cluster's token (:func:`~hoplite_gpu.memory.tickets.read`): the reader is
given the key (:func:`~hoplite_gpu.memory.tickets.ticket_key`) by its node, and a ticket anyone
else wrote in ``/dev/shm`` is refused before its record is used.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import device, shm
from .backend import DeviceBackend
from .device_pool import DevicePool, Spare
from .tickets import PIN_ID, PREFIX, Record, Ticket, drop_record, read, read_segment, write

log = logging.getLogger("hoplite_gpu")

#: How many holders' allocations a process keeps open after reading them (0: none).
MAX_MAPPINGS = 16

_MappingKey = tuple[str, bytes, int, int, int]


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
                close_mapping(close)
        finally:
            if ticket is not None:
                ticket.close()  # the ticket's lock goes now


def close_mapping(close: Callable[[], None]) -> None:
    """Call a mapping's ``close`` (from :meth:`DeviceBackend.open_export
    <hoplite_gpu.memory.backend.DeviceBackend.open_export>`), logging a failure."""
    try:
        close()
    except Exception as exc:  # a CUDA error while closing: nothing more to do than say so
        log.warning("closing a device IPC mapping failed: %s", exc)


@dataclass(eq=False, slots=True)
class _Mapping:
    """Another process's allocation this process keeps open (see the module docstring)."""

    key: _MappingKey
    backend: DeviceBackend
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


class ProcessIpc:
    """This process's CUDA IPC state: what it exported and what it opened of others (see the module
    docstring). Thread-safe; one per process (:data:`PROCESS`)."""

    def __init__(self) -> None:
        self.pool = DevicePool(self.discard)
        self._exports_lock = threading.Lock()
        self._local: dict[str, Ticket] = {}  # this process's tickets by name (it cannot open its own)
        self._draining: list[Ticket] = []  # retired tickets whose memory a reader may still read
        self._pinned_lock = threading.Lock()
        self._pinned: list[tuple[Any, shm.Segment]] = []  # let go while a reader keeps it open
        self._mappings_lock = threading.Lock()
        self._mappings: OrderedDict[_MappingKey, _Mapping] = OrderedDict()
        self._counts = {"opened": 0, "reused": 0, "indexed": 0, "refused": 0}

    # ------------------------------------------------------------ the holder's side
    def allocate(
        self, backend: DeviceBackend, nbytes: int, dev: int, share: bool = True
    ) -> tuple[Any, Ticket | None]:
        """Device memory for a store copy of ``nbytes`` on device ``dev``, and its ticket (None
        where it cannot be shared, or without ``share``: the store then serves it over the data
        plane only). Shared memory comes from the pool where it holds an allocation of that size."""
        if not share:
            return backend.empty(nbytes, dev), None
        spare = self.pool.take(backend, nbytes, dev)
        if spare is None:
            array = backend.empty_shared(nbytes, dev)
            return array, self.export(array, pooled=True)
        return spare.array, self.export(spare.array, pooled=True, pin=spare.pin, record=spare.record)

    def export(
        self,
        array: Any,
        pooled: bool = False,
        pin: shm.Segment | None = None,
        record: np.ndarray[Any, Any] | None = None,
    ) -> Ticket | None:
        """A ticket for the flat device ``array`` (not published yet), or None when its backend
        cannot share it with other processes or ``/dev/shm`` has no room. With ``pooled`` the
        memory goes to the pool once let go (only for memory nothing else owns: :meth:`allocate`'s).
        ``pin``: the allocation's, from an earlier export (a new one is made without). ``record``:
        the payload of the retired ticket that named this very allocation last (a pool
        :class:`~hoplite_gpu.memory.device_pool.Spare`'s), which names it again as it is."""
        backend = device.backend_for(array)
        if backend is None:
            self.let_go(array, pin, record)
            return None
        if record is None:
            written = write(backend, array, pin)
            if written is None:
                self.let_go(array, pin)
                return None
            record, pin = written
        ticket = Ticket(record, array, backend, pooled, pin)
        with self._exports_lock:
            self._local[ticket.name] = ticket
        self.reap()
        return ticket

    def retire(self, ticket: Ticket) -> None:
        """The object of one of this process's tickets is dropped: readers reject the ticket from
        now on, and its memory goes once no reader holds it (now, or at a later :meth:`reap`).
        Idempotent."""
        if not ticket.retire():
            return
        with self._exports_lock:
            self._draining.append(ticket)
        self.reap()

    def _release(self, ticket: Ticket) -> bool:
        """Let go of a retired ticket's memory if no reader holds the ticket; whether it did."""
        if not ticket.held:
            return True
        record = ticket.release()
        if record is None:
            return False
        array, ticket.array = ticket.array, None
        self._local.pop(ticket.name, None)
        if ticket.pooled:
            # The ticket goes with its allocation, retired: the allocation's next object is
            # published in it again (no new segment, and no new handle, for each put).
            self.pool.give(ticket.backend, array, ticket.pin, record)
        else:
            self.let_go(array, ticket.pin, record)
        return True

    def discard(self, spare: Spare) -> None:
        """Free an allocation the pool does not keep (:meth:`let_go`)."""
        self.let_go(spare.array, spare.pin, spare.record)

    def let_go(self, array: Any, pin: shm.Segment | None, record: np.ndarray[Any, Any] | None = None) -> None:
        """Free an exported allocation no object uses any more, with its last ticket's ``record``:
        now, or (when a reader keeps it open) once the reader has closed it, which it does when it
        sees the retired pin."""
        drop_record(record)
        if pin is None:
            return  # ``array`` goes with its last reference
        pin.retire()
        if pin.mapped_elsewhere():
            with self._pinned_lock:
                self._pinned.append((array, pin))
        else:
            pin.unlink()

    def reap(self) -> int:
        """Free the memory of retired tickets no reader holds any more, and allocations let go
        that no reader keeps open any more; how many tickets are still held. Called at every
        export and retirement and by each node once per heartbeat interval (a reader letting go
        is not seen before that)."""
        with self._pinned_lock:
            kept = []
            for array, pin in self._pinned:
                if pin.mapped_elsewhere():
                    kept.append((array, pin))
                else:
                    pin.unlink()  # and ``array`` goes with its last reference
            self._pinned[:] = kept
        with self._exports_lock:
            self._draining[:] = [t for t in self._draining if not self._release(t)]
            return len(self._draining)

    def pinned(self, pin: shm.Segment) -> bool:
        """Whether ``pin``'s allocation is let go but still kept open by a reader."""
        with self._pinned_lock:
            return any(kept is pin for _, kept in self._pinned)

    # ------------------------------------------------------------ the reader's side
    def read_ticket(self, segment: str, object_id: bytes, nbytes: int, key: bytes) -> Record | None:
        """The record of a published ticket (None: see :meth:`open_ticket`), without opening it."""
        found = read_segment(segment, object_id, nbytes, key, self._refused)
        if found is None:
            return None
        found[0].close()
        return found[1]

    def open_ticket(self, segment: str, object_id: bytes, nbytes: int, key: bytes) -> Opened | None:
        """Open the device memory a same-host holder published as ``object_id`` under ``segment``
        (from the directory), for reading it with this process's default backend; None when the
        ticket is gone, retired, of another object or size, not sealed with ``key`` (the
        cluster's :func:`~hoplite_gpu.memory.tickets.ticket_key`), of another backend, or when the
        handle does not open here (its process is gone, no peer access). Close it once read."""
        found = read_segment(segment, object_id, nbytes, key, self._refused)
        if found is None:
            return None
        ticket, record = found
        if record.pid == shm.own_pid():
            if record.backend == device.default_backend().name:
                with self._exports_lock:
                    mine = self._local.get(segment)
                    array = None if mine is None else mine.array
                if array is not None:
                    return Opened(array[:nbytes], lambda: None, ticket)
            ticket.close()
            return None
        known: dict[int, bool] = {}
        if not shm.exporter_alive(segment[len(PREFIX) :], known):
            ticket.close()
            return None  # its process is gone: its memory with it (CUDA would refuse the handle)
        return self._open_record(ticket, record, known)

    def open_indexed(self, cluster: str, object_id: bytes, key: bytes) -> tuple[Opened, Record] | None:
        """Open the device memory of ``object_id`` that its owner in ``cluster`` put on this host and
        indexed (:meth:`Ticket.index`), without asking the directory: the memory open for
        reading (close it once read) and the ticket's record, whose ``dtype`` and ``shape``
        describe the object. None when there is no such index link, or the ticket is not sealed
        with ``key`` (anyone may create the name: see :func:`~hoplite_gpu.memory.tickets.read`),
        retired, undescribed, of this process, of a process that is gone, or does not open here:
        the caller asks the directory."""
        name = shm.index_name(cluster, object_id)
        found = read(name, object_id, key, self._refused)
        if found is None:
            return None
        ticket, record = found
        known: dict[int, bool] = {}
        # The sealed record names its exporter (the header's creator is not sealed): the
        # holder in this pid namespace (the index name is of this one) that must still run.
        if not record.dtype or record.pid == shm.own_pid() or not shm.alive(record.pid, known):
            ticket.close()
            return None
        opened = self._open_record(ticket, record, known)
        if opened is None:
            return None
        with self._mappings_lock:
            self._counts["indexed"] += 1
        return opened, record

    def _refused(self) -> None:
        """A ticket without the cluster's seal was refused (counted: someone without the token
        wrote it, or a holder of another token)."""
        with self._mappings_lock:
            self._counts["refused"] += 1

    def _open_record(self, ticket: shm.Locked, record: Record, known: dict[int, bool]) -> Opened | None:
        """Open the memory of another process's ticket (read under its lock, which the result
        holds; closed here when the memory does not open) with this process's default backend;
        None when it does not open here. ``known``: the processes found alive during this read
        (:func:`shm.alive`)."""
        backend = device.default_backend()
        try:
            if record.backend != backend.name or not backend.available():
                ticket.close()
                return None
            array, close = self._open(backend, record, backend.current_device(), known)
        except Exception as exc:  # DeviceIpcError, or the driver's own error
            log.debug("cannot open device memory of pid %d: %s", record.pid, exc)
            ticket.close()
            return None
        return Opened(array, close, ticket)

    # ------------------------------------------------------------ mappings a reader keeps
    def stats(self) -> dict[str, int]:
        """This process's reads of other processes' device memory: how many mappings it opened,
        how many reads used one it kept, how many found the memory through an index link rather
        than the directory (:meth:`open_indexed`), how many tickets it refused for want of the
        cluster's seal, and how many mappings it keeps now."""
        with self._mappings_lock:
            return {**self._counts, "kept": len(self._mappings)}

    def _open(
        self, backend: DeviceBackend, record: Record, dev: int, known: dict[int, bool] | None = None
    ) -> tuple[Any, Callable[[], None]]:
        """The memory ``record`` names, open on ``dev``, and what to call once it is read: from a
        mapping this process keeps where it has one of that allocation, or a new mapping (kept
        when the ticket names a pin that is still published). ``known``: see :func:`shm.alive`."""
        known = {} if known is None else known
        self.sweep(known=known)
        key = (record.pin, record.handle, record.offset, record.nbytes, dev)
        with self._mappings_lock:
            entry = self._mappings.get(key)
            if entry is not None and entry.backend is backend and entry.valid(known):
                self._mappings.move_to_end(key)
                entry.users += 1
                self._counts["reused"] += 1
                return entry.array, functools.partial(self._read, entry)
        pin = shm.map_view(record.pin, PIN_ID, 0) if record.pin and MAX_MAPPINGS > 0 else None
        array, close = backend.open_export(record.handle, record.offset, record.nbytes, dev)
        closing: list[_Mapping] = []
        with self._mappings_lock:
            self._counts["opened"] += 1
            if pin is None:  # no pin, or being let go: open for this read only
                return array, close
            entry = _Mapping(key, backend, dev, array, close, pin, users=1)
            old = self._mappings.get(key)
            if old is not None:
                self._drop_locked(old, closing)
            self._mappings[key] = entry
            while len(self._mappings) > MAX_MAPPINGS:
                idle = next((m for m in self._mappings.values() if not m.users), None)
                if idle is None:
                    break
                self._drop_locked(idle, closing)
        for m in closing:
            _close(m)
        return array, functools.partial(self._read, entry)

    def _drop_locked(self, entry: _Mapping, closing: list[_Mapping]) -> None:
        """Stop keeping ``entry`` (under the mappings' lock): into ``closing`` if nobody reads it
        now, else closed by its last reader."""
        del self._mappings[entry.key]
        entry.stale = True
        if not entry.users:
            closing.append(entry)

    def _read(self, entry: _Mapping) -> None:
        """A reader is done with a kept mapping (its copies out of it are complete)."""
        entry.backend.synchronize(entry.device)
        with self._mappings_lock:
            entry.users -= 1
            done = entry.stale and not entry.users
        if done:
            _close(entry)

    def sweep(self, everything: bool = False, known: dict[int, bool] | None = None) -> int:
        """Close the kept mappings whose holder is letting the allocation go or is gone (with
        ``everything``, every one not being read); how many stay open. ``known``: see
        :func:`shm.alive` (one liveness check per holder process, however many mappings of it are
        kept)."""
        known = {} if known is None else known
        closing: list[_Mapping] = []
        with self._mappings_lock:
            for entry in list(self._mappings.values()):
                if everything or not entry.valid(known):
                    self._drop_locked(entry, closing)
            left = len(self._mappings)
        for entry in closing:
            _close(entry)
        return left


def _close(entry: _Mapping) -> None:
    """Close a kept mapping and let go of its pin (the holder may then free the allocation)."""
    close_mapping(entry.close)
    entry.array = entry.pin = None


#: This process's CUDA IPC state (see :class:`ProcessIpc`).
PROCESS = ProcessIpc()
