"""What the rest of the package asks of memory, through one object per node (:class:`Memory`).

- **allocate**: a buffer for an object's bytes, in host memory (:meth:`Memory.host`, recycled by the
  pool; in a shared-memory segment where the node shares), page-locked host memory
  (:meth:`Memory.page_locked`), or device memory that same-host processes can open
  (:meth:`Memory.device`, :meth:`Memory.keep_device`);
- **publish** a complete copy for same-host readers (:meth:`Memory.publish`, :meth:`Memory.index`);
- **open** what another process on this host published (:meth:`Memory.open_segment`,
  :meth:`Memory.open_device`, :meth:`Memory.open_indexed`);
- **release** a buffer the store no longer holds (:meth:`Memory.release`).

Which of shared-memory segments, CUDA IPC tickets, pools and device backends does the work is
decided here and below; callers hold :class:`~hoplite_gpu.memory.buffers.Buffer` objects.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from ..errors import InvalidArgumentError
from . import device, shm
from .arrays import CallerArray
from .buffers import Buffer, BufferKind, BufferPool
from .ipc import PROCESS
from .tickets import Record, cluster_key, is_ticket, ticket_key

#: Buffers at least this large are set up (allocated, or mapped from another process's segment,
#: page faults included) on a worker thread, so the event loop keeps serving transfers meanwhile.
THREAD_COPY_BYTES = 1 << 20


def shared_memory_available() -> bool:
    """Whether this host has a writable ``/dev/shm`` (a node may then share its copies)."""
    return shm.available()


def host_key(tag: str = "") -> str:
    """Identifies this host's shared-memory namespace (see :func:`hoplite_gpu.memory.shm.host_key`)."""
    return shm.host_key(tag)


def sweep_orphans() -> int:
    """Remove what killed processes of this host left in ``/dev/shm``; how many files went."""
    return shm.sweep_orphans()


def device_in_use() -> bool:
    """Whether this process works with device memory already (then same-host device copies are
    opened through CUDA IPC and device objects are received into device memory)."""
    return device.default_backend().in_use()


class Memory:
    """A node's memory (see the module docstring).

    Args:
        pool_bytes: Bytes of removed objects' host buffers kept for reuse.
        shared_min_bytes: Host buffers of at least this many bytes live in shared-memory segments
            that processes of this host map (0: the node does not share).
        index: The cluster's key for index links (:func:`cluster_key`): device objects put here are
            linked under it, and found there by same-host readers; "" for none (until
            :meth:`rekey`: the key depends on the directory instance joined).
        seal: The cluster's key for device memory tickets (:func:`ticket_key`): tickets published
            here are sealed with it, and a ticket another process published is opened only with
            its seal; b"" for none (nothing published here is opened elsewhere, and nothing of
            another process is opened here).
    """

    def __init__(
        self, pool_bytes: int = 0, shared_min_bytes: int = 0, index: str = "", seal: bytes = b""
    ) -> None:
        self.pool = BufferPool(pool_bytes, shared_min_bytes)
        self.index_key = index
        self.seal_key = seal
        self._host_peers: int | None = None

    @staticmethod
    def cluster_key(token: str, directory_id: str) -> str:
        """The key a node of the cluster of ``token`` indexes under while it is joined to the
        directory instance ``directory_id`` (from its ``Welcome``)."""
        return cluster_key(token, directory_id)

    @staticmethod
    def ticket_key(token: str) -> bytes:
        """The key that seals the device memory tickets of the cluster of ``token``."""
        return ticket_key(token)

    def rekey(self, index: str, buffers: Iterable[Buffer]) -> None:
        """The node joined a directory instance whose index key is ``index``: index under it from
        now on. Where it differs from the key before (another instance: a restarted directory),
        the index links of ``buffers`` (the store's) made under the old key are removed; their
        objects are found through the directory until put again."""
        if index == self.index_key:
            return
        old, self.index_key = self.index_key, index
        if old:
            for buffer in buffers:
                if buffer.ticket is not None:
                    buffer.ticket.unindex()

    @property
    def shares(self) -> bool:
        """Whether processes on this host read this node's copies in place (shared-memory segments,
        device memory tickets)."""
        return self.pool.shared_min_bytes > 0

    @property
    def host_peers(self) -> int | None:
        """Other nodes on this host, as the directory last said (:class:`protocol.HostPeers
        <hoplite_gpu.protocol.HostPeers>`); None: not told yet (as if there were some). Told
        none, a node that shares puts its new host buffers in private memory
        (:attr:`BufferPool.private <hoplite_gpu.memory.buffers.BufferPool.private>`)."""
        return self._host_peers

    @host_peers.setter
    def host_peers(self, peers: int | None) -> None:
        self._host_peers = peers
        self.pool.private = peers == 0

    @property
    def shared_with_others(self) -> bool:
        """Whether another node on this host may read this node's copies in place: it
        :attr:`shares` and the directory did not say it is alone on its host. A lent array is
        copied into shared memory only then (:meth:`Puts.prepare <hoplite_gpu.node.puts.Puts.prepare>`)."""
        return self.shares and self.host_peers != 0

    # ------------------------------------------------------------ allocate
    def host(self, nbytes: int, populate: bool = True) -> Buffer:
        """A pooled host buffer of ``nbytes`` (a shared-memory segment where the node shares and
        ``/dev/shm`` has room; ``populate=False``: for a caller that fills it whole with
        :func:`~hoplite_gpu.memory.buffers.write_at`)."""
        return Buffer.wrap(self.pool.allocate(nbytes, populate), pooled=True)

    async def host_async(self, nbytes: int, populate: bool = True) -> Buffer:
        """:meth:`host`, set up (page faults) on a worker thread when large, so the event loop
        keeps serving transfers meanwhile."""
        if nbytes < THREAD_COPY_BYTES:
            return self.host(nbytes, populate)
        return await asyncio.get_running_loop().run_in_executor(None, self.host, nbytes, populate)

    def device(self, nbytes: int, like: Buffer | None = None) -> Buffer:
        """Device memory of ``nbytes`` for a store copy, exported where the node shares: on
        ``like``'s device and backend (a reduce vertex computes where its input is), else on this
        process's current device of its default backend (a reader's copy)."""
        if like is not None and like.on_device:
            backend, dev = like.backend, like.device or 0
        else:
            backend = device.default_backend()
            dev = backend.current_device()
        array, ticket = PROCESS.allocate(backend, nbytes, dev, self.shares)
        return Buffer(array, BufferKind.DEVICE, device=dev, device_backend=backend, ticket=ticket)

    def keep_device(self, src: CallerArray, copy: bool) -> Buffer:
        """The buffer of a device array put as an object: a copy in memory same-host readers can
        open, or with ``copy=False`` its own memory where contiguous. Waits for the caller's queued
        writes to it first (:meth:`DeviceBackend.settle
        <hoplite_gpu.memory.backend.DeviceBackend.settle>`)."""
        backend = src.backend
        assert backend is not None
        flat = backend.flat_bytes(src.value)
        dev = backend.device_of(flat)
        backend.settle(dev)  # the caller's last writes to it are done
        if not copy:
            return Buffer(flat, BufferKind.DEVICE, device=dev, device_backend=backend)
        array, ticket = PROCESS.allocate(backend, int(flat.nbytes), dev, self.shares)
        backend.copy(array, flat)
        return Buffer(array, BufferKind.DEVICE, device=dev, device_backend=backend, ticket=ticket)

    @staticmethod
    def check_page_locking() -> None:
        """Raise :class:`InvalidArgumentError` unless this process can page-lock host memory (a
        usable device backend: CuPy and a CUDA device)."""
        if not device.default_backend().available():
            raise InvalidArgumentError(
                "put(..., pinned=True) needs CuPy and a CUDA device in this process", argument="pinned"
            )

    def page_locked(self, nbytes: int) -> Buffer:
        """Page-locked host memory for a pinned put's copy of ``nbytes``: the pool's shared-memory
        segment for it, registered where it is (its pages are its own), or else new page-locked
        memory (private memory of the pool, registered in place, could share a page with memory
        registered already). Raises :class:`InvalidArgumentError` without a usable device backend
        (:meth:`check_page_locking`), :class:`~hoplite_gpu.errors.PinnedMemoryError` where CUDA
        refuses."""
        self.check_page_locking()
        backend = device.default_backend()
        if self.pool.shares(nbytes):
            data = self.pool.allocate(nbytes)
            if shm.segment_of(data) is not None:
                try:
                    unpin = backend.register_host(data)
                except BaseException:
                    self.pool.release(data)
                    raise
                buffer = Buffer.wrap(data, pooled=True)
                buffer.unpin = unpin
                return buffer
            self.pool.release(data)  # /dev/shm had no room: private memory, not the pool's
        locked, release = backend.page_locked(nbytes)
        buffer = Buffer.wrap(locked)
        buffer.unpin = release
        return buffer

    # ------------------------------------------------------------ publish
    @staticmethod
    def segment_name(buffer: Buffer) -> str:
        """The name of the shared-memory segment holding ``buffer``'s bytes, not published yet
        ("" for other memory; device copies are published complete, never announced before)."""
        seg = _segment(buffer)
        return "" if seg is None else seg.name

    def publish(self, buffer: Buffer, object_id: bytes, dtype: str, shape: tuple[int, ...]) -> str:
        """Publish a complete copy for same-host readers: in its shared-memory segment, or a device
        copy in its ticket (sealed with the cluster's key); the name they open, or "" where it is
        not shared."""
        if buffer.ticket is not None:
            return buffer.ticket.publish(object_id, self.seal_key, dtype, shape)
        seg = _segment(buffer)
        if seg is None:
            return ""
        seg.publish(object_id)
        return seg.name

    def index(self, buffer: Buffer, object_id: bytes) -> bool:
        """Link a published device copy under its index name, once the directory registered it
        (same-host readers then find it without a lookup); whether they find it there."""
        ticket = buffer.ticket
        return bool(ticket is not None and self.index_key and ticket.index(self.index_key, object_id))

    # ------------------------------------------------------------ open another process's
    @staticmethod
    async def open_segment(name: str, object_id: bytes, nbytes: int) -> Buffer | None:
        """A same-host holder's shared-memory segment published as ``object_id``, mapped read-only
        (no bytes copied; on a worker thread when large: mapping pre-faults every page); None if
        the segment changed or vanished."""
        args = (name, object_id, nbytes)
        if nbytes >= THREAD_COPY_BYTES:
            view = await asyncio.get_running_loop().run_in_executor(None, shm.map_view, *args)
        else:
            view = shm.map_view(*args)
        return None if view is None else Buffer.wrap(view)

    @staticmethod
    def is_device_ticket(segment: str) -> bool:
        """Whether a copy's ``segment`` (from the directory) names device memory (a ticket)."""
        return is_ticket(segment)

    def open_device(self, segment: str, object_id: bytes, nbytes: int) -> Buffer | None:
        """A same-host holder's device memory published as ``object_id`` under ``segment``, open
        for reading in place: a buffer whose :attr:`~Buffer.lease` the reader closes once read;
        None if it does not open here (or its ticket lacks the cluster's seal)."""
        opened = PROCESS.open_ticket(segment, object_id, nbytes, self.seal_key)
        return None if opened is None else Buffer.wrap(opened.array, lease=opened)

    def open_indexed(self, object_id: bytes) -> tuple[Buffer, Record] | None:
        """The device memory of ``object_id`` another process of the cluster put on this host and
        indexed, open in place (close the buffer's lease once read), and the ticket's record (its
        ``dtype`` and ``shape``); None when there is none, or this process works with no device
        memory yet: then ask the directory."""
        if not self.index_key or not device_in_use():
            return None
        found = PROCESS.open_indexed(self.index_key, object_id, self.seal_key)
        if found is None:
            return None
        opened, record = found
        return Buffer.wrap(opened.array, lease=opened), record

    # ------------------------------------------------------------ release
    def release(self, buffer: Buffer) -> None:
        """The store no longer holds ``buffer``: its page-locking is undone, pooled memory goes
        back to the pool, and an exported device copy is retired (freed once no reader on the
        host has it open)."""
        buffer.release_pin()  # page-locked by put(pinned=True): undone before it is reused
        if buffer.pooled:
            self.pool.release(buffer.host)
        if buffer.ticket is not None:
            PROCESS.retire(buffer.ticket)

    @staticmethod
    def drop(buffer: Buffer) -> None:
        """A buffer that never was the store's is not kept: its page-locking is undone and its
        export retired (its memory goes with its last reference)."""
        buffer.release_pin()
        if buffer.ticket is not None:
            PROCESS.retire(buffer.ticket)

    def clear(self) -> None:
        """Drop every buffer the pool holds, and the mappings of others' segments kept for the
        next read that no view uses (node shutdown)."""
        self.pool.clear()
        shm.drop_kept_mappings()

    # ------------------------------------------------------------ the process's share
    @staticmethod
    def attach(node_id: str, device_pool_bytes: int) -> None:
        """A node opened: it wants up to ``device_pool_bytes`` of device allocations kept for
        reuse (the process's pool keeps the largest wish of its open nodes)."""
        PROCESS.pool.attach(node_id, device_pool_bytes)

    @staticmethod
    def detach(node_id: str) -> None:
        """A node closed; the process's last closes what it kept open of other processes'."""
        PROCESS.pool.detach(node_id)
        if not PROCESS.pool.users:
            PROCESS.sweep(everything=True)

    @staticmethod
    def maintain() -> None:
        """Close kept mappings of other processes' device memory their holders let go, and free
        device memory same-host readers let go of (each node, once per heartbeat)."""
        PROCESS.sweep()
        PROCESS.reap()

    def stats(self) -> dict[str, Any]:
        """Counters of the process's device memory behind this node (``device_pool_*``: bytes held,
        allocations handed out again; ``device_ipc_*``: see :meth:`ProcessIpc.stats
        <hoplite_gpu.memory.ipc.ProcessIpc.stats>`)."""
        return {
            "device_pool_bytes": PROCESS.pool.held_bytes,
            "device_pool_reused": PROCESS.pool.reused,
            **{f"device_ipc_{k}": v for k, v in PROCESS.stats().items()},
        }


def _segment(buffer: Buffer) -> shm.Segment | None:
    """The shared-memory segment holding a pooled buffer's bytes (None: other memory)."""
    return shm.segment_of(buffer.array) if buffer.kind is BufferKind.SEGMENT else None
