"""Same-host fast path: object buffers in POSIX shared memory that peers on the host map directly.

A node on the same host as a complete copy does not need the data plane at all, nor a copy: it
maps the holder's segment (a file under ``/dev/shm``) read-only and uses the bytes in place, with
no round trip to the holder (:func:`map_view`). A ``get`` of such an object returns a view of the
holder's segment.

Each segment starts with a 64-byte header written only by the holder:

====== ====== =====================================================================
offset bytes  field
====== ====== =====================================================================
0      8      sequence number: odd while the buffer is being written or is retired
8      8      payload size
16     20     ObjectID of the published payload
36     4      id of the process that created the segment
====== ====== =====================================================================

A reader takes a shared ``flock`` on the segment, checks that the sequence number is even and
the ObjectID is the one it wants, and keeps the lock for as long as it maps the payload (the
lock belongs to the mapping's file descriptor, so the kernel drops it when the reader dies). The
holder makes the number odd when it drops the object, and reuses the buffer for another object
only if it can take the lock exclusively: a reader never sees bytes of another object, and the
holder never reuses memory under a reader.

Segments are named ``hoplite-<pid namespace>-<pid>-<n>-<random>``; a file is unlinked when its
buffer leaves the store's pool, when its last mapping in the holder goes away, and, for processes
that were killed, by :func:`sweep_orphans` in the next node that starts on the host.

A segment may also be *indexed*: hard-linked under a name that readers of the same cluster can
derive from an ObjectID alone (:func:`index_name`: ``hoplite-i-<pid namespace>-<cluster
key>-<ObjectID>``), so they find it without asking the directory (:meth:`Segment.link`). The link
is the same file, so the header, the published ObjectID and the lock are those of the segment. Its
holder removes the link when it retires or unlinks the segment; links of killed processes go in
:func:`sweep_orphans` (the header says who created the file).

Anyone may create files in ``/dev/shm``: only regular files of this process's user are read, under
an index name or a name from the directory (:func:`~.shm_files.open_regular`), and what a device object's
ticket says is trusted only with its cluster's seal (:mod:`hoplite_gpu.memory.tickets`).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import secrets
import struct
import threading
import weakref
from typing import Any

import numpy as np

# Names, identity and liveness of the files; the public ones are part of this module's API too.
from .shm_files import (
    CREATOR,
    CREATOR_AT,
    INDEX_NAME,
    creator_alive,
    open_regular,
    open_segment,
    pid_namespace,
    unlink_if,
    unlink_quietly,
)
from .shm_files import INDEX_PREFIX as INDEX_PREFIX
from .shm_files import PREFIX as PREFIX
from .shm_files import SHM_DIR as SHM_DIR
from .shm_files import alive as alive
from .shm_files import available as available
from .shm_files import exporter_alive as exporter_alive
from .shm_files import host_key as host_key
from .shm_files import index_name as index_name
from .shm_files import own_pid as own_pid
from .shm_files import sweep_orphans as sweep_orphans
from .shm_files import valid_name as valid_name

log = logging.getLogger("hoplite_gpu")

HEADER_BYTES = 64
#: ``madvise`` advice that maps a range's pages for writing (Linux 5.14; not in :mod:`mmap` before
#: Python 3.13).
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_OID = slice(16, 36)
_WORD = struct.Struct("<Q")
_HEADER = struct.Struct("<QQ")
_counter = itertools.count()


class Segment(mmap.mmap):
    """The holder's writable mapping of one segment (header + payload)."""

    name: str
    _finalizer: weakref.finalize
    _inode: int
    _links: dict[str, weakref.finalize]
    #: Whether the payload's pages are mapped into this process: when it was created
    #: (:func:`create`), or when it was handed out again (:meth:`populate`); if not, writes go
    #: through the file (:meth:`write_file`).
    populated: bool

    def populate(self) -> None:
        """Map the pages of a segment written before into this process (``MADV_POPULATE_WRITE``,
        Linux 5.14 on), so that later writes go through the mapping: into pages that exist, a
        write through the file costs about 4x one through the mapping (16 MiB: 4.0 against 1.1 ms
        of CPU, once 3.5 ms to map them; bench/pages/defaults.md, "Reused segments written in
        place"). Where the kernel cannot, writes keep going through the file."""
        if self.populated:
            return
        try:
            self.madvise(MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            return
        self.populated = True

    def _bump(self) -> None:
        _WORD.pack_into(self, 0, _WORD.unpack_from(self, 0)[0] + 1)

    def begin_write(self) -> None:
        """Mark the payload as changing (readers reject it until :meth:`publish`)."""
        if not _WORD.unpack_from(self, 0)[0] % 2:
            self._bump()

    def publish(self, object_id: bytes) -> None:
        """Declare the payload complete as ``object_id``."""
        self.begin_write()
        self[_OID] = object_id
        self._bump()

    def retire(self) -> None:
        """The store no longer holds this payload as an object (readers reject it); its index
        links go."""
        self.begin_write()
        self.unlink_links()

    def unlink(self) -> None:
        """Remove the file now, and its index links (mappings, ours and readers', stay valid until
        closed)."""
        self.unlink_links()
        self._finalizer()

    def link(self, name: str) -> bool:
        """Hard-link the segment under the index name ``name`` (:func:`index_name`); whether it
        is there now. A link left by a process that is gone is replaced; a live one is kept (its
        holder has the same object: readers find that one), and so is whatever this process may
        not remove (anyone can create the name first). Never raises: an index link only saves
        readers a lookup."""
        if not INDEX_NAME.fullmatch(name) or name in self._links:
            return name in self._links
        path = os.path.join(SHM_DIR, name)
        for _ in range(2):
            try:
                os.link(os.path.join(SHM_DIR, self.name), path)
            except FileExistsError:
                if creator_alive(name):
                    return False
                try:
                    unlink_quietly(path)  # a killed holder's: replace it
                except OSError as exc:
                    # Not ours to remove (another user's, in sticky /dev/shm): the name stays
                    # taken and readers ask the directory; the put itself goes on.
                    log.debug("cannot replace %s to index segment %s: %s", name, self.name, exc)
                    return False
                continue
            except OSError as exc:
                log.debug("cannot link segment %s as %s: %s", self.name, name, exc)
                return False
            self._links[name] = weakref.finalize(self, unlink_if, path, self._inode)
            return True
        return False

    def unlink_links(self) -> None:
        """Remove the segment's index links (each only while it still is this segment's)."""
        links, self._links = self._links, {}
        for finalizer in links.values():
            finalizer()

    def mapped_elsewhere(self) -> bool:
        """Whether a reader still maps the payload (:func:`map_view`): then it must not be reused."""
        try:
            fd = open_segment(self.name)
        except FileNotFoundError:
            return False  # unlinked: it is never reused
        except OSError:
            return True  # cannot tell: do not reuse it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)  # releases the lock, if taken
        return False

    @property
    def published(self) -> bool:
        """Whether the payload is published (sequence number even)."""
        return not _WORD.unpack_from(self, 0)[0] % 2

    def write_file(self, offset: int, data: np.ndarray[Any, Any]) -> bool:
        """Write the contiguous ``data`` at payload ``offset`` through the file (``pwrite``), not
        the mapping: into pages this process has not mapped, that skips a write fault per page
        (a new 64 MiB segment filled in 26 ms, against about 50 ms mapped and populated first; see
        bench/pages/defaults.md, "Putting into new shared memory"). False where the file is not this
        segment's any more (unlinked): the caller writes through the mapping."""
        try:
            fd = os.open(os.path.join(SHM_DIR, self.name), os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            if os.fstat(fd).st_ino != self._inode:
                return False  # removed, and the name made again by someone else
            view = data.reshape(-1).view(np.uint8).data
            pos = HEADER_BYTES + offset
            if pos + len(view) > len(self):
                raise ValueError(f"{len(view)} bytes at {offset} overrun the payload")
            while view:
                written = os.pwrite(fd, view, pos)
                view, pos = view[written:], pos + written
        finally:
            os.close(fd)
        return True


def create(nbytes: int, populate: bool = True) -> np.ndarray[Any, Any] | None:
    """A flat uint8 buffer of ``nbytes`` in a new segment, marked as being written.

    With ``populate``, its pages are mapped into this process now (writes through the array then
    take no page faults); without, they are mapped as used, and a writer that fills it whole
    should write through the file instead (:meth:`Segment.write_file`). Returns None when ``/dev/shm``
    has no room (the space is reserved up front, so a full ``/dev/shm`` never turns into a SIGBUS
    on a later write).
    """
    name = f"{PREFIX}{pid_namespace()}-{own_pid()}-{next(_counter)}-{secrets.token_hex(4)}"
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        log.debug("cannot create shared-memory segment %s: %s", path, exc)
        return None
    try:
        os.posix_fallocate(fd, 0, HEADER_BYTES + nbytes)
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        seg = Segment(fd, HEADER_BYTES + nbytes, flags=flags)
        seg._inode = os.fstat(fd).st_ino
    except OSError as exc:
        unlink_quietly(path)
        log.debug("no room for a %d-byte shared-memory segment: %s", nbytes, exc)
        return None
    finally:
        os.close(fd)
    seg.name = name
    seg.populated = populate
    seg._finalizer = weakref.finalize(seg, unlink_quietly, path)
    seg._links = {}
    _WORD.pack_into(seg, 8, nbytes)
    CREATOR.pack_into(seg, CREATOR_AT, own_pid())
    seg.begin_write()
    return np.ndarray((nbytes,), np.uint8, buffer=seg, offset=HEADER_BYTES)


def segment_of(buf: np.ndarray[Any, Any]) -> Segment | None:
    """The segment a buffer from :func:`create` lives in (None for ordinary memory)."""
    base = buf.base
    return base if isinstance(base, Segment) else None


class _Mapping:
    """A segment this process maps for reading (:func:`map_view`), kept mapped between reads: its
    own descriptor (which takes and drops the shared lock), inode, mapping and live views."""

    __slots__ = ("fd", "inode", "mm", "pid", "views")

    def __init__(self, fd: int, inode: int, mm: mmap.mmap) -> None:
        self.fd, self.inode, self.mm, self.pid, self.views = fd, inode, mm, own_pid(), 0

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)  # drops the lock, if held


#: Segments kept mapped for reading, by inode, least recently read first. A holder recycles the
#: segments of objects it deleted for new ones, and mapping one anew costs a page fault per page
#: (about 4 ms for 48 MiB here, as much as MAP_POPULATE): a reader that keeps its mapping reads the
#: next object in it for an open, a lock and a look at the header (bench/pages/defaults.md, "Mappings
#: kept between reads"). Unlocked while no view uses it, so the holder may reuse it.
_MAPPED: collections.OrderedDict[int, _Mapping] = collections.OrderedDict()
_MAPPED_LOCK = threading.RLock()  # a view's finalizer may run in a collection under it
#: At most this many segments, and bytes, stay mapped with no view using them (a kept segment
#: whose holder let it go is unmapped at the next read or release).
MAPPED_KEPT = 16
MAPPED_KEPT_BYTES = 512 << 20


def map_view(name: str, object_id: bytes, nbytes: int) -> np.ndarray[Any, Any] | None:
    """A read-only view of the payload published as ``object_id`` in segment ``name`` (flat uint8,
    ``nbytes`` long), or None when the segment is gone, has another size, does not hold
    ``object_id``, or is being rewritten.

    The segment's shared lock is held for as long as any array uses a view of it (the lock goes
    with the mapping's file descriptor, so also when this process dies): the holder does not reuse
    a segment a reader still maps (:meth:`Segment.mapped_elsewhere`), and a view outlives the
    holder's unlink or death (the memory stays until the last mapping goes). Once no view uses it,
    the lock is dropped and the mapping kept for the next read of the same segment (``_MAPPED``).
    """
    opened = open_regular(name)
    if opened is None:
        return None
    fd, size, inode = opened
    with _MAPPED_LOCK:
        kept = _MAPPED.get(inode)
        if kept is not None and not _unlinked(kept.fd):  # the same file (an inode may be reused)
            os.close(fd)  # the kept mapping's own descriptor takes the lock
            return _view(kept, object_id, nbytes)
        if kept is not None:
            _MAPPED.pop(inode)
            if not kept.views:
                kept.close()
        try:
            # Lock before reading the header: a holder that reuses the segment first takes the
            # lock exclusively, and it marked the payload retired before that, so a reader that
            # sees a published header under the lock keeps valid bytes until it lets go.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            if size != HEADER_BYTES + nbytes:
                raise OSError("another size")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        except OSError:
            os.close(fd)
            return None
        return _view(_Mapping(fd, inode, mm), object_id, nbytes, locked=True)


def _view(
    mapping: _Mapping, object_id: bytes, nbytes: int, locked: bool = False
) -> np.ndarray[Any, Any] | None:
    """A view of ``mapping``'s payload if it holds ``object_id`` under the shared lock (taken here
    unless ``locked`` or a view holds it already), else None (and the lock dropped if no view
    holds it). ``mapping`` is kept, as the most recently read. Under ``_MAPPED_LOCK``."""
    try:
        if not locked and not mapping.views:
            fcntl.flock(mapping.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        held = len(mapping.mm) == HEADER_BYTES + nbytes and _holds(mapping.mm, object_id, nbytes)
    except OSError:
        held = False
    _MAPPED.pop(mapping.inode, None)
    _MAPPED[mapping.inode] = mapping
    if not held:
        _unused(mapping)
        return None
    mapping.views += 1
    view = np.ndarray((nbytes,), np.uint8, buffer=mapping.mm, offset=HEADER_BYTES)
    view.flags.writeable = False
    weakref.finalize(view, _released, mapping)  # arrays made from the view keep it alive (their base)
    return view


def _released(mapping: _Mapping) -> None:
    """A view of ``mapping`` is gone (with every array made from it)."""
    with _MAPPED_LOCK:
        mapping.views -= 1
        if not mapping.views:
            _unused(mapping)


def _unused(mapping: _Mapping) -> None:
    """No view uses ``mapping``: drop its lock and keep it mapped, unless it is not kept (or not
    this process's: a forked child's copy), or its file is gone; then trim what is kept. Under
    ``_MAPPED_LOCK``."""
    if mapping.views:
        return
    if mapping.pid != own_pid():
        return  # inherited across a fork: the parent's lock and descriptor, not ours to touch
    if _MAPPED.get(mapping.inode) is not mapping:
        mapping.close()
        return
    with contextlib.suppress(OSError):
        fcntl.flock(mapping.fd, fcntl.LOCK_UN)
    idle = [m for m in _MAPPED.values() if not m.views]  # least recently read first
    count, total = len(idle), sum(len(m.mm) for m in idle)
    for m in idle:
        if _unlinked(m.fd) or count > MAPPED_KEPT or total > MAPPED_KEPT_BYTES:
            _MAPPED.pop(m.inode, None)
            count, total = count - 1, total - len(m.mm)
            m.close()


def drop_kept_mappings() -> None:
    """Unmap the segments kept mapped for the next read that no view uses."""
    with _MAPPED_LOCK:
        for m in [m for m in _MAPPED.values() if not m.views]:
            _MAPPED.pop(m.inode, None)
            m.close()


def _forget_mappings() -> None:
    """In a forked child: the kept mappings are the parent's (its descriptors hold its locks)."""
    _MAPPED.clear()


os.register_at_fork(after_in_child=_forget_mappings)


def _unlinked(fd: int) -> bool:
    """Whether the file of ``fd`` has no name left (its holder let it go)."""
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


class Locked:
    """A published segment's payload, read (not mapped) under its shared lock (:func:`read_locked`):
    ``payload`` (bytes) and ``creator`` (the id of the process that created the segment). The
    lock is held until :meth:`close`, or until this object is garbage (or its process dies)."""

    __slots__ = ("_fd", "creator", "payload")

    def __init__(self, fd: int, creator: int, payload: bytes) -> None:
        self._fd = fd
        self.creator = creator
        self.payload = payload

    def close(self) -> None:
        """Let go of the lock; idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


def read_locked(name: str, object_id: bytes, nbytes: int) -> Locked | None:
    """:func:`map_view` for small payloads that are read once (IPC tickets): the ``nbytes`` of the
    payload published as ``object_id`` in segment ``name``, read with one ``pread`` under the
    segment's shared lock, which the result holds until it is closed; None as for :func:`map_view`.
    Five system calls (open, fstat, flock, pread, and the close), where a mapping takes nine."""
    opened = open_regular(name)
    if opened is None:
        return None
    fd, size, _ = opened
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # before the header: see map_view
        raw = os.pread(fd, HEADER_BYTES + nbytes, 0) if size == HEADER_BYTES + nbytes else b""
    except OSError:
        raw = b""
    if len(raw) != HEADER_BYTES + nbytes or not _holds(raw, object_id, nbytes):
        os.close(fd)
        return None
    return Locked(fd, CREATOR.unpack_from(raw, CREATOR_AT)[0], raw[HEADER_BYTES:])


def _holds(segment: Any, object_id: bytes, nbytes: int) -> bool:
    """Whether a segment's bytes (mapped, or read: at least its header) say it is published,
    holding ``object_id`` of ``nbytes``."""
    seq, size = _HEADER.unpack_from(segment, 0)
    return not seq % 2 and size == nbytes and segment[_OID] == object_id


def view_published(view: np.ndarray[Any, Any]) -> bool:
    """Whether the segment a :func:`map_view` view maps is still published (its holder has not
    retired or rewritten it since)."""
    mm = view.base
    return isinstance(mm, mmap.mmap) and not _WORD.unpack_from(mm, 0)[0] % 2


def map_payload(name: str, offset: int, nbytes: int) -> np.ndarray[Any, Any] | None:
    """A read-only view of ``nbytes`` at ``offset`` of segment ``name``'s payload, whatever its
    header says (simulated device memory, :class:`hoplite_gpu.memory.sim.SimBackend`, whose validity a
    separate published segment vouches for), or None when the segment is not there or too small."""
    opened = open_regular(name) if offset >= 0 and nbytes >= 0 else None
    if opened is None:
        return None
    fd, size, _ = opened
    try:
        if size < HEADER_BYTES + offset + nbytes:
            return None
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except OSError:
        return None
    finally:
        os.close(fd)
    view = np.ndarray((nbytes,), np.uint8, buffer=mm, offset=HEADER_BYTES + offset)
    view.flags.writeable = False
    return view


def map_whole(name: str, least: int) -> np.ndarray[Any, Any] | None:
    """A read-only view of segment ``name``'s whole payload, whatever its header says (a
    group's kept segment, :mod:`hoplite_gpu.collective.host`), or None when it is not there or
    holds fewer than ``least`` bytes."""
    opened = open_regular(name)
    if opened is None:
        return None
    fd, size, _ = opened
    os.close(fd)
    return map_payload(name, 0, size - HEADER_BYTES) if size - HEADER_BYTES >= least else None


def map_pages(buf: np.ndarray[Any, Any]) -> None:
    """Map the pages of the segment under ``buf`` (one :func:`create` made without) into this
    process, so that writes go through memory from now on (:meth:`Segment.populate`)."""
    seg = segment_of(buf)
    if seg is not None:
        seg.populate()


def segment_name(buf: np.ndarray[Any, Any]) -> str:
    """The name of the segment a buffer from :func:`create` lives in ("" for ordinary memory)."""
    seg = segment_of(buf)
    return seg.name if seg is not None else ""
