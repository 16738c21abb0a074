"""Same-host fast path: object buffers in POSIX shared memory that peers on the host copy directly.

A node on the same host as a complete copy does not need the data plane at all: it maps the
holder's segment (a file under ``/dev/shm``) read-only and copies the bytes, with no round trip to
the holder. Measured on the 2-core development machine, process to process: attach + copy moved
5-8 GB/s (16-256 MiB), a plain Python TCP socket 2.8 GB/s, UCX over its own shared-memory
transport 4-5 GB/s after a request/response round trip of about 1 ms in thread progress mode.

Each segment starts with a 64-byte header written only by the holder:

====== ====== =====================================================================
offset bytes  field
====== ====== =====================================================================
0      8      sequence number: odd while the buffer is being written or is retired
8      8      payload size
16     20     ObjectID of the published payload
====== ====== =====================================================================

A reader checks, seqlock style, that the sequence number is even and the ObjectID is the one it
wants, copies, and checks that neither changed; otherwise it falls back to the data plane. The
holder makes the number odd before it reuses or drops the buffer, so a reader never accepts bytes
of another object. (Python on x86-64 and ARM64 orders these stores as written: the GIL release and
acquire between the copy and the re-check are full barriers.)

Segments are named ``hoplite-<pid namespace>-<pid>-<n>-<random>``; a file is unlinked when its
buffer leaves the store's pool, when its last mapping in the holder goes away, and, for processes
that were killed, by :func:`sweep_orphans` in the next node that starts on the host.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import re
import secrets
import struct
import threading
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

log = logging.getLogger("hoplite_gpu")

SHM_DIR = "/dev/shm"
PREFIX = "hoplite-"
HEADER_BYTES = 64
_OID = slice(16, 36)
_WORD = struct.Struct("<Q")
_HEADER = struct.Struct("<QQ")
_NAME = re.compile(r"^hoplite-(\d+)-(\d+)-\d+-[0-9a-f]+$")
_counter = itertools.count()


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def available() -> bool:
    """Whether this host has a writable ``/dev/shm``."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def host_key() -> str:
    """Identifies the shared-memory namespace: two processes with the same key can map each
    other's segments (same boot, same ``/dev/shm`` mount). Empty when there is none."""
    if not available():
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "?"
    st = os.stat(SHM_DIR)
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Segment(mmap.mmap):
    """The holder's writable mapping of one segment (header + payload)."""

    name: str
    _finalizer: weakref.finalize

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
        """The store no longer holds this payload as an object (readers reject it)."""
        self.begin_write()

    def unlink(self) -> None:
        """Remove the file now (mappings, ours and readers', stay valid until closed)."""
        self._finalizer()

    @property
    def published(self) -> bool:
        """Whether the payload is published (sequence number even)."""
        return not _WORD.unpack_from(self, 0)[0] % 2


def create(nbytes: int) -> np.ndarray[Any, Any] | None:
    """A flat uint8 buffer of ``nbytes`` in a new segment, marked as being written.

    Returns None when ``/dev/shm`` has no room (the space is reserved up front, so a full
    ``/dev/shm`` never turns into a SIGBUS on a later write).
    """
    name = f"{PREFIX}{_pid_namespace()}-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        log.debug("cannot create shared-memory segment %s: %s", path, exc)
        return None
    try:
        os.posix_fallocate(fd, 0, HEADER_BYTES + nbytes)
        seg = Segment(fd, HEADER_BYTES + nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    except OSError as exc:
        _unlink(path)
        log.debug("no room for a %d-byte shared-memory segment: %s", nbytes, exc)
        return None
    finally:
        os.close(fd)
    seg.name = name
    seg._finalizer = weakref.finalize(seg, _unlink, path)
    _WORD.pack_into(seg, 8, nbytes)
    seg.begin_write()
    return np.ndarray((nbytes,), np.uint8, buffer=seg, offset=HEADER_BYTES)


def segment_of(buf: np.ndarray[Any, Any]) -> Segment | None:
    """The segment a buffer from :func:`create` lives in (None for ordinary memory)."""
    base = buf.base
    return base if isinstance(base, Segment) else None


def valid_name(name: str) -> bool:
    """Whether ``name`` looks like one of our segments (it comes off the network)."""
    return bool(_NAME.match(name))


class _Mappings:
    """Read-only mappings of other processes' segments, kept for reuse.

    Holders recycle their segments (the store's buffer pool), so the same segment is read again
    for later objects; a kept mapping saves a page fault per 4 KiB page (copying 16 MiB took
    3 ms through a fresh mapping, 2 ms through a kept one). A kept mapping would also keep a
    segment's memory alive after its holder unlinked it, so every use first drops the mappings
    of unlinked files, and at most ``MAX_KEPT`` are kept. Thread-safe.
    """

    MAX_KEPT = 32

    def __init__(self) -> None:
        self._kept: OrderedDict[str, tuple[int, mmap.mmap]] = OrderedDict()
        self._lock = threading.Lock()

    def purge(self) -> None:
        """Drop the mappings of segments their holders have unlinked."""
        with self._lock:
            self._purge()

    def _purge(self) -> None:
        for kept, (fd, _) in list(self._kept.items()):
            try:
                gone = os.fstat(fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                self._drop(kept)

    def get(self, name: str, length: int) -> mmap.mmap | None:
        with self._lock:
            self._purge()
            entry = self._kept.get(name)
            if entry is not None:
                self._kept.move_to_end(name)
                return entry[1] if len(entry[1]) == length else None
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != length:
                os.close(fd)
                return None
            mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError:
            os.close(fd)
            return None
        with self._lock:
            if name in self._kept:
                self._drop(name)
            self._kept[name] = (fd, mm)
            while len(self._kept) > self.MAX_KEPT:
                self._drop(next(iter(self._kept)))
        return mm

    def _drop(self, name: str) -> None:
        fd, _ = self._kept.pop(name)
        os.close(fd)  # the mapping itself goes once no copy in progress uses it

    def clear(self) -> None:
        """Drop every kept mapping."""
        with self._lock:
            for name in list(self._kept):
                self._drop(name)


_mappings = _Mappings()


def forget_mappings(unlinked_only: bool = False) -> None:
    """Drop the kept read-only mappings of other processes' segments (only those of segments
    their holders have unlinked, with ``unlinked_only``)."""
    if unlinked_only:
        _mappings.purge()
    else:
        _mappings.clear()


def read_into(name: str, object_id: bytes, out: np.ndarray[Any, Any]) -> bool:
    """Copy the payload published as ``object_id`` in segment ``name`` into ``out`` (flat uint8).

    Returns False, leaving ``out`` in any state, when the segment is gone, has another size, or
    does not hold ``object_id`` from start to end of the copy.
    """
    if not valid_name(name):
        return False
    nbytes = out.nbytes
    mm = _mappings.get(name, HEADER_BYTES + nbytes)
    if mm is None:
        return False
    seq, size = _HEADER.unpack_from(mm, 0)
    if seq % 2 or size != nbytes or mm[_OID] != object_id:
        return False
    np.copyto(out, np.ndarray((nbytes,), np.uint8, buffer=mm, offset=HEADER_BYTES))
    return bool(_WORD.unpack_from(mm, 0)[0] == seq and mm[_OID] == object_id)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_orphans() -> int:
    """Unlink segments left by processes of this pid namespace that no longer exist (they were
    killed before they could clean up). Returns how many were removed."""
    if not available():
        return 0
    ns, uid, removed = _pid_namespace(), os.getuid(), 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        m = _NAME.match(name)
        if m is None or int(m.group(1)) != ns or _alive(int(m.group(2))):
            continue
        path = os.path.join(SHM_DIR, name)
        with contextlib.suppress(OSError):
            if os.stat(path).st_uid == uid:
                os.unlink(path)
                removed += 1
    if removed:
        log.info("removed %d shared-memory segments left by killed processes", removed)
    return removed
