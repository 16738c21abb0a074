"""Shared-memory files by name: what segments and index links are called, opening one safely,
who this process is, whether a file's creator still runs, and removing what killed processes left.

:mod:`.shm` maps, writes and reads the segments themselves (and re-exports the public names here).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import stat
import struct

log = logging.getLogger("hoplite_gpu")

#: Where segments live.
SHM_DIR = "/dev/shm"
#: What a segment's name starts with: ``hoplite-<pid namespace>-<pid>-<n>-<random>``.
PREFIX = "hoplite-"
#: The id of the process that created a segment, at this offset of its header.
CREATOR = struct.Struct("<I")
CREATOR_AT = 36
#: A segment's name (pid namespace and creator's pid in its groups).
SEGMENT_NAME = re.compile(r"hoplite-(\d+)-(\d+)-\d+-[0-9a-f]+")
#: What an index name starts with (see :func:`index_name`).
INDEX_PREFIX = "hoplite-i-"
#: An index name (pid namespace in its group).
INDEX_NAME = re.compile(r"hoplite-i-(\d+)-[0-9a-f]{16}-[0-9a-f]{40}")

_identity: tuple[int, int, int] | None = None  # (pid, pid namespace, effective uid): _whoami


def _whoami() -> tuple[int, int, int]:
    """This process's id, pid namespace (0 where it cannot be told) and effective user id, looked
    up once per process (a forked child looks again): the same-host read paths ask for them at
    every read, and each lookup is a system call (costly where system calls are intercepted, as
    in gVisor). A process that changes its effective user later keeps the old one here:
    :func:`open_regular` then reads only the segments and index links of the user it started
    as, and refuses its new user's (the reader pulls or asks the directory instead)."""
    global _identity
    if _identity is None:
        try:
            ns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            ns = 0
        _identity = (os.getpid(), ns, os.geteuid())
    return _identity


def _forget_identity() -> None:
    global _identity
    _identity = None


os.register_at_fork(after_in_child=_forget_identity)


def own_pid() -> int:
    """This process's id (``os.getpid()`` without a system call each time)."""
    return _whoami()[0]


def pid_namespace() -> int:
    """This process's pid namespace (0 where it cannot be told)."""
    return _whoami()[1]


def available() -> bool:
    """Whether this host has a writable ``/dev/shm``."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def host_key(tag: str = "") -> str:
    """Identifies the shared-memory namespace: two processes with the same key can map each
    other's segments (same boot, same ``/dev/shm`` mount). Empty when there is none. A ``tag``
    (``Config.host_tag``) sets the key apart from those of the same namespace with other tags."""
    if not available():
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "?"
    st = os.stat(SHM_DIR)
    return f"{boot}:{st.st_dev}:{st.st_ino}" + (f"/{tag}" if tag else "")


def socket_path() -> str:
    """A new path for a listening Unix socket of this process in ``/dev/shm``, named like a
    segment (:func:`sweep_orphans` removes it if the process is killed)."""
    return os.path.join(SHM_DIR, f"{PREFIX}{pid_namespace()}-{own_pid()}-0-{secrets.token_hex(8)}")


def unlink_quietly(path: str) -> None:
    """Unlink ``path``; nothing if it is gone already."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def open_segment(name: str) -> int:
    """Open a segment read-only without following a link or blocking on a FIFO (the name may come
    off the network, and anyone on the host can create files in ``/dev/shm``)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW
    return os.open(os.path.join(SHM_DIR, name), flags)


def open_regular(name: str) -> tuple[int, int, int] | None:
    """A read-only descriptor of segment ``name`` (the caller closes it), the file's size and its
    inode, or None when the name is not one of ours, nothing is there, it is not a regular file (a FIFO or
    device under a segment's name is never read), or it is not this user's: under an index name
    anyone may have made it, and under a name from the directory another user may have made it
    anew once its holder removed it (and could then truncate it under a reader's mapping: SIGBUS).
    (A segment's size is fixed when it is created, so the size stays right while it is open.)"""
    if not valid_name(name):
        return None
    try:
        fd = open_segment(name)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == _whoami()[2]:
            return fd, st.st_size, st.st_ino
    except OSError:
        pass
    os.close(fd)
    return None


def valid_name(name: str) -> bool:
    """Whether ``name`` looks like one of our segments, or an index name (it comes off the
    network)."""
    return bool(SEGMENT_NAME.fullmatch(name) or INDEX_NAME.fullmatch(name))


def index_name(cluster: str, object_id: bytes) -> str:
    """The name under which a holder of ``cluster`` (a key of 16 hex digits every node of one
    cluster derives alike) indexes the segment of ``object_id``, in this pid namespace."""
    return f"{INDEX_PREFIX}{pid_namespace()}-{cluster}-{object_id.hex()}"


def unlink_if(path: str, inode: int) -> None:
    """Unlink ``path`` if it still is the file ``inode`` (an index link, not a later holder's)."""
    with contextlib.suppress(OSError):
        if os.stat(path, follow_symlinks=False).st_ino == inode:
            os.unlink(path)


def creator_alive(name: str) -> bool:
    """Whether the process that created segment (or index link) ``name`` (its header says) still
    runs (True when that cannot be read: it is left alone)."""
    try:
        fd = open_segment(name)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        raw = os.pread(fd, CREATOR.size, CREATOR_AT)
    except OSError:
        return True
    finally:
        os.close(fd)
    return len(raw) < CREATOR.size or _alive(CREATOR.unpack(raw)[0])


def exporter_alive(name: str, known: dict[int, bool] | None = None) -> bool:
    """Whether the process that created segment ``name`` still runs (True when it is of another
    pid namespace: that cannot be told from here); ``known``: see :func:`alive`."""
    m = SEGMENT_NAME.fullmatch(name)
    if m is None:
        return False
    return int(m.group(1)) != pid_namespace() or alive(int(m.group(2)), known)


def alive(pid: int, known: dict[int, bool] | None = None) -> bool:
    """Whether process ``pid`` (of this pid namespace) still runs. ``known``: answers already
    found during the same read, used instead of asking again and added to (one system call per
    process and read, however many segments of it the read checks)."""
    if known is not None and pid in known:
        return known[pid]
    found = _alive(pid)
    if known is not None:
        known[pid] = found
    return found


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
    ns, uid, removed = pid_namespace(), os.getuid(), 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        path = os.path.join(SHM_DIR, name)
        index = INDEX_NAME.fullmatch(name)
        if index is not None:  # an index link: its header names its creator
            if int(index.group(1)) != ns or creator_alive(name):
                continue
        else:
            m = SEGMENT_NAME.fullmatch(name)
            if m is None or int(m.group(1)) != ns or _alive(int(m.group(2))):
                continue
        with contextlib.suppress(OSError):
            if os.stat(path).st_uid == uid:
                os.unlink(path)
                removed += 1
    if removed:
        log.info("removed %d shared-memory segments left by killed processes", removed)
    return removed
