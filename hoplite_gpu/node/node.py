"""A node: one process's view of the object store.

The public methods are synchronous and thread-safe; each has an ``*_async`` twin for asyncio code
(and Ray async actors). All network work runs on one event-loop thread per process
(:class:`~hoplite_gpu.iothread.IOThread`), shared by every node and embedded directory of that process.

The node wires its parts together: the directory link (:mod:`.session`), the get side
(:mod:`.fetch`, with :mod:`.sources`), reduce vertices (:mod:`.vertex`), the store and the data
plane. Its methods come in parts: the object API here (put, get, reduce, delete), watched groups
(:mod:`.watches`), what libraries built on the node use (:mod:`.primitives`), diagnostics
(:mod:`.diagnostics`), and the handlers of what the directory pushes (:mod:`.pushes`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import functools
import logging
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from .. import faults
from .. import protocol as p
from ..config import WILDCARD_HOSTS, Config, host_of, is_loopback
from ..dataplane.selection import DataPlane, make_data_plane
from ..directory.service import DirectoryService
from ..errors import AuthenticationError, InvalidArgumentError, NodeClosedError, ProtocolError, from_kind
from ..iothread import IOThread
from ..memory import LocalStore, Memory, host_key, node_place, shared_memory_available, sweep_orphans
from ..object_id import ObjectID
from ..reduce_ops import ReduceOp
from .arguments import object_id_list, reduce_request, resolve_timeout, route_of
from .channel import Channels
from .diagnostics import Diagnostics
from .fetch import Fetcher, check_out, streamable
from .host_steps import default_threads
from .primitives import Primitives
from .pushes import DirectoryPushes
from .puts import Putter
from .session import DirectorySession
from .vertex import VertexRunner
from .watches import GroupWatches

__all__ = ["IOThread", "Node"]

log = logging.getLogger("hoplite_gpu")


class Node(GroupWatches, Primitives, Diagnostics, DirectoryPushes):
    """A process's handle on the object store. Create it with :func:`hoplite_gpu.init` or
    :func:`hoplite_gpu.connect`.

    Args:
        directory_address: ``host:port`` of the directory.
        token: Shared secret.
        config: Tunables.
        embedded: The directory service this node started in-process (stopped on :meth:`close`).
        resolve_directory: Where the directory is now, given the seconds to wait at most: asked
            before each attempt to reach it again after it was lost, for a directory that may come
            back at another address (the Ray directory actor, restarted); None: the same address.
    """

    def __init__(
        self,
        directory_address: str,
        token: str,
        config: Config | None = None,
        embedded: DirectoryService | None = None,
        resolve_directory: Callable[[float], str] | None = None,
    ) -> None:
        if not token:
            raise AuthenticationError("a token is needed to join a directory (HOPLITE_TOKEN)")
        self.config = config or Config.from_env()
        self._token = token
        self._embedded = embedded
        self.node_id = uuid.uuid4().hex
        self._data_host = self.config.data_host(directory_address)
        if is_loopback(self._data_host) and not is_loopback(host_of(directory_address)):
            log.warning(
                "this node advertises %s to a directory at %s: nodes on other hosts cannot reach it; "
                "unset HOPLITE_LISTEN_HOST or set HOPLITE_ADVERTISE_HOST to a reachable address",
                self._data_host,
                directory_address,
            )
        self._io = IOThread.get()
        self._ipc_sweeper: asyncio.Future[None] | None = None
        self._shm = self.config.shared_memory and shared_memory_available()
        if self._shm:
            sweep_orphans()
        # Same-host readers find device objects put here without a lookup (see Memory.index),
        # under a key of the directory instance joined (set at each join: _index_joined).
        self._indexes = self._shm and self.config.same_host_index
        self._memory = Memory(
            self.config.buffer_pool_bytes,
            shared_min_bytes=self.config.inline_threshold_bytes + 1 if self._shm else 0,
            seal=Memory.ticket_key(token),
        )
        self._store = LocalStore(self.config.store_capacity_bytes, self._memory)
        self._data: DataPlane = make_data_plane(self._store, token, self.config, on_served=self._on_served)
        self._session = DirectorySession(
            directory_address,
            token,
            self.node_id,
            self._data_host,
            0,  # set once the data plane listens (_start)
            self.config,
            host_key(self.config.host_tag) if self._shm else "",
            self._on_push,
            self._on_lost,
            self._on_rejoined,
            resolve_directory,
            node_place(),
        )
        self._fetcher = Fetcher(
            self._store,
            self._data,
            self.config,
            self._session,
            self._shm,
            lambda oid: self._vertices.computes(oid),
        )
        self._vertices = VertexRunner(
            self._store,
            lambda oid, started: self._fetcher.get(oid, None, started=started),
            self._session.send,
            lambda oid: self._in_background(self._delete(oid)),
            self.config.reduce_chunk_bytes,
            self.config.device_reduce_chunk_bytes,
            self.config.reduce_threads or default_threads(),
        )
        # Called when the node rejoins a restarted directory (see add_rejoin_callback).
        self._rejoin_callbacks: set[Callable[[], None]] = set()
        self._putter = Putter(self._store, self.config, self._session, self._delete, self._in_background)
        # The caller threads' own directory connections, for small puts and gets (see .channel).
        self._channels = Channels(self._session, token, self._io, self.config.caller_channels)
        self._background: set[asyncio.Future[Any]] = set()  # see _in_background
        self._closed = False
        if self.config.fault_injection:
            faults.arm(self.config.fault_injection)
        self._io.run(self._start(), timeout=self.config.connect_timeout * 3)
        atexit.register(self.close)

    # ------------------------------------------------------------ properties
    @property
    def directory_address(self) -> str:
        """``host:port`` of the directory this node is joined to (or was, while it reconnects)."""
        return self._session.address

    @property
    def token(self) -> str:
        """The shared token other processes need to connect."""
        return self._token

    @property
    def data_address(self) -> str:
        """``host:port`` of this node's data-plane (UCX) listener."""
        return f"{self._data_host}:{self._data.port}"

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<hoplite_gpu.Node {self.node_id[:8]} directory={self.directory_address} {state}>"

    # ------------------------------------------------------------ lifecycle
    async def _start(self) -> None:
        # UCX is limited to the interface of an address the user gave to listen on (not to one
        # found by routing, nor an advertised one, which may be a name or behind NAT).
        listen = self.config.listen_host
        await self._data.start(listen if listen not in WILDCARD_HOSTS else "")
        self._session.data_port = self._data.port
        try:
            await self._session.start()
        except BaseException:
            await self._data.close()
            raise
        self._index_joined()
        Memory.attach(self.node_id, self.config.device_pool_bytes)  # detached by _close
        if self._shm:
            self._ipc_sweeper = asyncio.ensure_future(self._sweep_ipc())

    async def _sweep_ipc(self) -> None:
        """Free device memory same-host readers let go of, and close mappings of other processes'
        device memory that their holders let go (:mod:`hoplite_gpu.memory.ipc`), once per heartbeat."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)  # a period, not synchronisation
            Memory.maintain()

    def close(self) -> None:
        """Leave the directory, close every connection and drop local objects. Idempotent. Calls
        of this node still waiting in other threads (a ``get``, a collective) raise
        :class:`~hoplite_gpu.errors.NodeClosedError`."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        with contextlib.suppress(Exception):
            self._io.run(self._close(), timeout=self.config.close_grace + 10.0)

    async def _close(self) -> None:
        err = NodeClosedError("the node was closed")
        self._channels.close()
        self._session.closing()
        if self._ipc_sweeper is not None:
            self._ipc_sweeper.cancel()
        self._vertices.cancel()
        await self._data.close(grace=self.config.close_grace)
        self._store.clear(err)
        Memory.detach(self.node_id)  # the process's last closes what it kept of other processes'
        await self._session.close(err)  # what waits for the directory fails as closed, too
        if self._embedded is not None:
            await self._embedded.stop()

    def _check_open(self) -> None:
        if self._closed:
            raise NodeClosedError("this node was closed; create a new one with hoplite_gpu.init()")

    # ------------------------------------------------------------ put
    def put(
        self,
        array: Any,
        object_id: ObjectID | None = None,
        *,
        copy: bool = True,
        pinned: bool = False,
        digest: bool = True,
        borrow: bool = False,
        consumable: bool = False,
    ) -> ObjectID:
        """Store ``array`` under ``object_id`` (a new random id if None) and return the id.

        The bytes are copied (``copy=False`` stores a C-contiguous NumPy array without copying: the
        caller must then never modify it; on a node with shared memory a large one is still copied
        into a shared-memory segment, after ``put`` returned, so processes on this host map it
        instead of pulling it, unless the directory said no other node is on this host).
        Non-contiguous arrays are always copied. GPU arrays (CuPy, CUDA torch tensors,
        ``__cuda_array_interface__``, DLPack on a CUDA device) stay in device memory: copied
        device to device (``copy=False``: kept as they are), and read back as device arrays (see
        :meth:`get`).

        ``pinned=True`` (host arrays; needs CuPy and a CUDA device in this process) keeps the
        store's copy in page-locked host memory until the object is deleted: a large one in its
        shared-memory segment, registered with CUDA in place (same-host processes still map it),
        a small one in CuPy's pinned memory. Copies between it and a GPU in this process, such as
        a ``get(out=cupy_array)``, then run at the link's full rate. The copy is always made
        (``copy`` is ignored). It has no effect on device arrays.

        ``digest=False`` stores no digest of the content: a later put of the same id with other
        content is then not refused (for ids never put twice, such as a collective group's; it
        saves hashing every byte). ``borrow=True`` (with ``copy=False``) never copies the array
        after ``put`` returns (where same-host nodes would map a copy, it is made before): the
        caller may take its memory back once it withdrew the object (:meth:`withdraw`).
        ``consumable=True`` lets a reduction that takes the object as an input write its partial
        result over the object's memory on this node (host memory; the object then leaves this
        node, and a tree rebuilt without it fails rather than read changed bytes): for an input
        that reduction alone reads, such as a collective's shard. :meth:`withdraw` of the object
        withdraws that result too.

        Raises:
            ObjectExistsError: the id exists with different content, dtype or shape.
            ObjectTooLargeError: larger than ``Config.max_object_bytes``.
            StoreFullError: the local store is full.
            InvalidArgumentError: not an array, or an object dtype; ``pinned`` without a CUDA device.
            PinnedMemoryError: ``pinned``, and CUDA could not page-lock the copy.
        """
        self._check_open()
        prepared = self._putter.prepare(array, object_id, copy, pinned, digest, borrow, consumable)
        put = self._putter.put_on_channel(prepared, self._channels, self._io)
        return put if put is not None else self._io.run(self._putter.put(prepared))

    async def put_async(
        self,
        array: Any,
        object_id: ObjectID | None = None,
        *,
        copy: bool = True,
        pinned: bool = False,
        digest: bool = True,
        borrow: bool = False,
        consumable: bool = False,
    ) -> ObjectID:
        """Async twin of :meth:`put`."""
        self._check_open()
        prepared = self._putter.prepare(array, object_id, copy, pinned, digest, borrow, consumable)
        return await self._io.run_async(self._putter.put(prepared))

    # ------------------------------------------------------------ get
    def _resolve_timeout(self, timeout: float | None) -> float | None:
        return resolve_timeout(timeout, self.config.default_get_timeout)

    def get(
        self,
        object_id: ObjectID,
        timeout: float | None = None,
        out: Any = None,
        *,
        direct: bool = False,
        via: ObjectID | None = None,
    ) -> Any:
        """Return the object's array, waiting until it exists (a ``get`` before the ``put`` works).

        Args:
            object_id: What to fetch.
            timeout: Seconds to wait in total (0: answer at once, with what is there now); None
                uses ``Config.default_get_timeout`` (0 there: no limit).
            out: Optional array (NumPy or CuPy) of the same dtype and shape to copy the result into;
                it is returned. Without ``out`` the result is a read-only NumPy array that shares
                memory with the local store (for an object held by another process on this host,
                with that process's shared-memory segment, which stays valid while you use it; for
                one stored inline in the directory, got on a caller channel: its own copy).
                An object put from device memory comes back as a new CuPy array on the caller's
                current device (bfloat16 as uint16 before CuPy 14; a host copy where this process
                has no GPU).
            direct: Pull from the object's owner (for a reduction's result: the node computing it)
                even while it serves other readers, instead of joining the pipelined chain of
                readers. For collectives whose traffic pattern leaves the owner's link room for
                every reader, such as the gather phase of a sharded allreduce, where a chain would
                load some links more than others. Falls back to any source if the owner is gone.
            via: Pull from the copy held by the owner of this other ObjectID, partial or not,
                busy or not, waiting for it while no copy is complete: readers in a ring, each
                reading from the one before it. Else, or once that node is gone, as without.

        Raises:
            HopliteTimeoutError: not available within ``timeout``.
            ObjectDeletedError: the owner deleted the object while waiting.
            TransportError: the directory or every source was lost.
        """
        self._check_open()
        self._check_oid(object_id)
        route = route_of(direct, via)
        timeout = self._resolve_timeout(timeout)
        into = check_out(out)
        ready = self._fetcher.at_hand(object_id)
        if ready is not None:
            return ready.deliver(into)
        first = self._fetcher.ask_on_channel(object_id, timeout, route, self._channels)
        if first is not None and first.inline is not None:
            return first.inline.deliver(into)
        if streamable(into):
            return self._io.run(self._fetcher.get_into(object_id, timeout, out, route, first=first))
        fetch = self._fetcher.get(object_id, timeout, route=route, lend=True, first=first)
        return self._io.run(fetch).deliver(into)

    async def get_async(
        self,
        object_id: ObjectID,
        timeout: float | None = None,
        out: Any = None,
        *,
        direct: bool = False,
        via: ObjectID | None = None,
    ) -> Any:
        """Async twin of :meth:`get`."""
        self._check_open()
        self._check_oid(object_id)
        route = route_of(direct, via)
        timeout = self._resolve_timeout(timeout)
        into = check_out(out)
        ready = self._fetcher.at_hand(object_id)
        if ready is not None:
            return ready.deliver(into)
        if streamable(into):
            return await self._io.run_async(self._fetcher.get_into(object_id, timeout, out, route))
        fetch = self._fetcher.get(object_id, timeout, route=route, lend=True)
        return (await self._io.run_async(fetch)).deliver(into)

    @staticmethod
    def _check_oid(object_id: Any) -> None:
        if not isinstance(object_id, ObjectID):
            raise InvalidArgumentError(
                f"expected an ObjectID, got {type(object_id).__name__}", argument="object_id"
            )

    # ------------------------------------------------------------ reduce
    def reduce(
        self,
        object_ids: Any,
        op: ReduceOp | str = ReduceOp.SUM,
        num_objects: int | None = None,
        reduction_id: ObjectID | None = None,
        timeout: float | None = None,
        degree: int | None = None,
        weights: Any = None,
        coding: Any = None,
        ordered: bool = False,
    ) -> ObjectID:
        """Reduce the first ``num_objects`` of ``object_ids`` to become ready; return the result's id.

        Returns at once: the reduction runs in the background, on the nodes holding the inputs,
        as a tree built in the order the inputs become ready (inputs may be put after this call).
        ``get`` the returned id for the result; it streams while the reduction runs. Every input
        must have the same dtype and shape.

        Args:
            object_ids: Candidate inputs (distinct ObjectIDs).
            op: A :class:`ReduceOp` (or its name). ``AVG`` divides by the number of inputs reduced.
            num_objects: How many inputs to reduce (default all); the first to become ready are
                used, later ones ignored (see :meth:`reduced_objects`).
            reduction_id: Id of the result (default a new random id). Repeating a request with the
                same id and arguments is accepted, so every member of a group may issue it.
            timeout: Seconds the directory waits for ``num_objects`` inputs before failing the
                reduction with :class:`HopliteTimeoutError` (None: ``Config.default_get_timeout``,
                0 there: forever).
            degree: Fan-in of the reduce tree: 1 is a chain, ``num_objects - 1`` a star (one vertex
                reduces every other input). None lets the directory choose from its cost model,
                which suits one reduction using the whole network; a caller running several
                reductions at once that should share the links evenly (a sharded allreduce) asks.
            weights: One finite number per id in ``object_ids``, for a weighted SUM: the result is
                ``sum_i weights[i] * x_i`` over the inputs reduced, each input scaled where the
                tree reads it (float inputs only; ``op`` must be SUM).
            coding: Instead of ``weights``, for weights that depend on which inputs arrive: each
                id's row of an encoding matrix (a gradient code's, see
                :mod:`hoplite_gpu.coding`). With ``num_objects``, once the first ``num_objects``
                inputs are chosen the directory takes the weights that make their rows sum to all
                ones (the decoding weights) and the tree applies them; the vertices stream their
                inputs meanwhile; if the chosen rows cannot do that, the reduction fails with
                :class:`NotDecodableError`. Without ``num_objects`` the directory adds each
                input's row as it arrives and, as soon as the rows that arrived combine into all
                ones, reduces the inputs whose weight is not 0 (the rows that added to the span
                of those before them, in arrival order); :meth:`reduced_objects` names them. It
                fails with :class:`NotDecodableError` when every input arrived without that.
            ordered: Place input ``i`` at the tree's ``i``-th position whenever it arrives, not
                in arrival order (every input reduced; no ``num_objects`` or ``coding``). Without
                ``degree``: a chain from the first to the last, which computes the result (where
                every node shares one host: that host's star). A rebuilt tree is unordered.

        Raises:
            InvalidArgumentError: bad ids, ``num_objects`` or op, or an unsupported dtype.
            ReduceMismatchError: inputs already present differ in dtype or shape (names one).
            ObjectExistsError: ``reduction_id`` exists as an object or another reduction.
        """
        self._check_open()
        default = self.config.default_get_timeout
        msg = reduce_request(
            object_ids, op, num_objects, reduction_id, timeout, default, degree, weights, coding, ordered
        )
        return self._io.run(self._reduce(msg))

    async def reduce_async(
        self,
        object_ids: Any,
        op: ReduceOp | str = ReduceOp.SUM,
        num_objects: int | None = None,
        reduction_id: ObjectID | None = None,
        timeout: float | None = None,
        degree: int | None = None,
        weights: Any = None,
        coding: Any = None,
        ordered: bool = False,
    ) -> ObjectID:
        """Async twin of :meth:`reduce`."""
        self._check_open()
        default = self.config.default_get_timeout
        msg = reduce_request(
            object_ids, op, num_objects, reduction_id, timeout, default, degree, weights, coding, ordered
        )
        return await self._io.run_async(self._reduce(msg))

    async def _reduce(self, msg: p.ReduceRequest) -> ObjectID:
        reply = await self._session.request(
            lambda rid: dataclasses.replace(msg, request_id=rid), self.config.request_timeout
        )
        if not isinstance(reply, p.ReduceReply):
            raise ProtocolError(f"unexpected reply to reduce: {reply.TYPE}")
        if reply.error:
            culprit = reply.error_object_id.hex() if reply.error_object_id else None
            raise from_kind(
                reply.error_kind, reply.error, object_id=culprit, reduction_id=msg.reduction_id.hex()
            )
        self._session.remember(msg)
        return ObjectID(msg.reduction_id)

    def reduced_objects(self, reduction_id: ObjectID, timeout: float | None = None) -> list[ObjectID]:
        """The inputs a reduction reduces, in the order they became ready.

        Waits until the reduction has chosen all of them (``num_objects`` became ready).

        Raises:
            HopliteTimeoutError: not chosen within ``timeout`` (None: ``Config.default_get_timeout``).
            ObjectNotFoundError: no such reduction (never requested, or deleted).
            ReduceMismatchError, ReductionFailedError: the reduction failed.
        """
        self._check_open()
        self._check_oid(reduction_id)
        return self._io.run(self._reduced_objects(reduction_id, self._resolve_timeout(timeout)))

    async def reduced_objects_async(
        self, reduction_id: ObjectID, timeout: float | None = None
    ) -> list[ObjectID]:
        """Async twin of :meth:`reduced_objects`."""
        self._check_open()
        self._check_oid(reduction_id)
        return await self._io.run_async(self._reduced_objects(reduction_id, self._resolve_timeout(timeout)))

    async def _reduced_objects(self, rid: ObjectID, timeout: float | None) -> list[ObjectID]:
        # The directory enforces ``timeout``; the margin covers a directory that went silent.
        guard = None if timeout is None else self.config.request_timeout + timeout
        reply = await self._session.request(
            lambda request_id: p.ReducedObjectsRequest(
                request_id=request_id, reduction_id=rid.binary(), timeout=p.wire_timeout(timeout)
            ),
            guard,
        )
        if not isinstance(reply, p.ReducedObjectsReply):
            raise ProtocolError(f"unexpected reply to reduced_objects: {reply.TYPE}")
        if reply.error:
            culprit = reply.error_object_id.hex() if reply.error_object_id else None
            raise from_kind(reply.error_kind, reply.error, object_id=culprit, reduction_id=rid.hex())
        return [ObjectID(o) for o in reply.object_ids]

    def _in_background(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` (a delete, a detached put's copy) in the background; failures are logged."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Future[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("background work failed: %s", task.exception())

    # ------------------------------------------------------------ delete and diagnostics
    def delete(self, object_id: ObjectID) -> bool:
        """Delete an object. On its owner (the node that put it, or that requested the reduction)
        it disappears from the directory and from every node; elsewhere only the local copy is
        dropped, unless it is the only copy (a reduction result on the node that computed it),
        which stays until the owner deletes it. Returns whether the object was deleted everywhere."""
        self._check_open()
        self._check_oid(object_id)
        deleted = self._putter.delete_on_channel(object_id, self._channels, self._io)  # (.channel)
        return self._io.run(self._delete(object_id)) if deleted is None else deleted

    async def delete_async(self, object_id: ObjectID) -> bool:
        """Async twin of :meth:`delete`."""
        self._check_open()
        self._check_oid(object_id)
        return await self._io.run_async(self._delete(object_id))

    def delete_many(self, object_ids: Sequence[ObjectID]) -> list[bool]:
        """:meth:`delete` of each of ``object_ids``, in order, with one request to the directory
        per :data:`~hoplite_gpu.protocol.MAX_DELETE_BATCH` + 1 objects rather than one each (a
        collective's objects); returns, for each, whether it was deleted everywhere."""
        self._check_open()
        oids = object_id_list(object_ids, empty=True)
        return self._io.run(self._delete_many(oids))

    async def delete_many_async(self, object_ids: Sequence[ObjectID]) -> list[bool]:
        """Async twin of :meth:`delete_many`."""
        self._check_open()
        oids = object_id_list(object_ids, empty=True)
        return await self._io.run_async(self._delete_many(oids))

    async def _delete(self, oid: ObjectID) -> bool:
        return (await self._delete_many([oid]))[0]

    async def _delete_many(self, oids: list[ObjectID]) -> list[bool]:
        deleted: list[bool] = []
        step = p.MAX_DELETE_BATCH + 1
        for batch in (oids[i : i + step] for i in range(0, len(oids), step)):
            for oid in batch:
                self._session.forget(oid.binary())
            first, *more = [oid.binary() for oid in batch]
            request = functools.partial(p.DeleteRequest, object_id=first, also=more)
            reply = await self._session.request(request, self.config.request_timeout)
            if not isinstance(reply, p.DeleteReply):
                raise ProtocolError(f"unexpected reply to delete: {reply.TYPE}")
            if not len(reply.deleted_also) == len(reply.kept_also) == len(more):
                raise ProtocolError(f"a delete of {len(batch)} objects answered for another number")
            for oid, kept in zip(batch, [reply.kept, *reply.kept_also], strict=True):
                if not kept:
                    self._store.remove(oid)
            deleted += [reply.deleted, *reply.deleted_also]
        return deleted

    def contains(self, object_id: ObjectID) -> bool:
        """Whether this node holds a complete local copy."""
        obj = self._store.get(object_id)
        return obj is not None and obj.complete
