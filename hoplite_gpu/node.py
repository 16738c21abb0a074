"""A node: one process's view of the object store.

The public methods are synchronous and thread-safe; each has an ``*_async`` twin for asyncio code
(and Ray async actors). All network work runs on one event-loop thread per process
(:class:`IOThread`), shared by every node and embedded directory of that process.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import numpy as np

from . import buffers, faults, shm, sources
from . import protocol as p
from .buffers import digest_of, dtype_from_wire, dtype_to_wire
from .config import Config, host_of, is_loopback
from .control import ControlClient
from .directory.service import DirectoryService
from .errors import (
    AuthenticationError,
    DirectoryUnavailableError,
    HopliteError,
    HopliteTimeoutError,
    InvalidArgumentError,
    NodeClosedError,
    ObjectDeletedError,
    ObjectExistsError,
    ObjectLostError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    PeerLostError,
    ProtocolError,
    ReduceMismatchError,
    ReductionFailedError,
)
from .object_id import ObjectID
from .reduce_ops import ReduceOp, as_op
from .sources import as_hoplite_error
from .store import LocalObject, LocalStore
from .transport import DataPlane
from .vertex import ObjectReset, VertexRunner

log = logging.getLogger("hoplite_gpu")

T = TypeVar("T")

#: Reductions this node requested that it remembers, to re-send them to a restarted directory.
REQUESTED_KEPT = 1000

#: Longest pause between two attempts to reach a lost directory again.
MAX_RECONNECT_BACKOFF = 1.0

_ERROR_KINDS: dict[str, type[HopliteError]] = {
    cls.__name__: cls
    for cls in (
        HopliteTimeoutError,
        InvalidArgumentError,
        ObjectDeletedError,
        ObjectExistsError,
        ObjectLostError,
        ObjectNotFoundError,
        ProtocolError,
        ReduceMismatchError,
        ReductionFailedError,
    )
}


def _remote_error(kind: str, message: str, **fields: Any) -> HopliteError:
    """The typed error for an error the directory reported as ``kind``."""
    return _ERROR_KINDS.get(kind, HopliteError)(message, **fields)


class IOThread:
    """The process-wide event loop thread that runs all network work."""

    _instance: IOThread | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="hoplite-io", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @classmethod
    def get(cls) -> IOThread:
        """The shared instance, started on first use."""
        with cls._lock:
            if cls._instance is None or not cls._instance._thread.is_alive():
                cls._instance = IOThread()
            return cls._instance

    def in_thread(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it (from any other thread)."""
        if self.in_thread():
            coro.close()
            raise HopliteError(
                "a blocking hoplite_gpu call was made on its own I/O thread; use the *_async methods"
            )
        fut = self.submit(coro)
        try:
            concurrent.futures.wait([fut], timeout)
        except BaseException:  # e.g. KeyboardInterrupt: stop the operation too
            fut.cancel()
            raise
        if not fut.done():
            fut.cancel()
            raise HopliteTimeoutError(
                f"operation did not finish within {timeout} s", operation="call", timeout=timeout
            )
        return fut.result()

    async def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and await it from another event loop."""
        if self.in_thread():
            return await coro
        return await asyncio.wrap_future(self.submit(coro))


#: Bytes a ``get`` into ``out`` copies at a time while the object arrives.
STREAM_COPY_BYTES = 4 << 20


def _streamable(out: Any) -> bool:
    """Whether ``get`` can copy into ``out`` while the object arrives (a writable C-contiguous
    NumPy array of at least a few chunks; others get one copy at the end)."""
    return (
        isinstance(out, np.ndarray)
        and out.flags.c_contiguous
        and out.flags.writeable
        and out.nbytes >= 2 * STREAM_COPY_BYTES
    )


async def _follow(source: LocalObject, dst: np.ndarray[Any, Any]) -> LocalObject:
    """Copy ``source``'s bytes into ``dst`` as they arrive; return ``source`` once all are copied
    (raises if the copy is dropped or reset meanwhile: the caller then copies the final object)."""
    copied = 0
    while copied < source.size:
        await source.wait_progress(min(copied + STREAM_COPY_BYTES, source.size), None)
        end = source.progress
        dst[copied:end] = source.data[copied:end]
        copied = end
    return source


#: Bytes a put copies at a time when it copies after publishing (see :meth:`Node._prepare`).
PUT_COPY_BYTES = 2 << 20


def _copy_advancing(
    loop: asyncio.AbstractEventLoop, src: np.ndarray[Any, Any], obj: LocalObject, stop: threading.Event
) -> None:
    """Copy ``src`` into ``obj.data`` chunk by chunk (on a worker thread), advancing ``obj``'s
    progress on ``loop`` after each chunk; stops early once ``stop`` is set."""
    pos = 0
    while pos < obj.size and not stop.is_set():
        end = min(pos + PUT_COPY_BYTES, obj.size)
        np.copyto(obj.data[pos:end], src[pos:end])
        loop.call_soon_threadsafe(obj.advance, end)
        pos = end


def _lookup_error(oid: ObjectID, reply: p.LookupReply) -> HopliteError:
    """The error a lookup of ``oid`` answered with (status ``"error"``)."""
    culprit = reply.error_object_id.hex() if reply.error_object_id else None
    return _remote_error(
        reply.error_kind, reply.error, object_id=culprit, reduction_id=oid.hex(), cause=reply.error
    )


class Node:
    """A process's handle on the object store. Create it with :func:`hoplite_gpu.init` or
    :func:`hoplite_gpu.connect`.

    Args:
        directory_address: ``host:port`` of the directory.
        token: Shared secret.
        config: Tunables.
        embedded: The directory service this node started in-process (stopped on :meth:`close`).
    """

    def __init__(
        self,
        directory_address: str,
        token: str,
        config: Config | None = None,
        embedded: DirectoryService | None = None,
    ) -> None:
        if not token:
            raise AuthenticationError("a token is needed to join a directory (HOPLITE_TOKEN)")
        self.config = config or Config.from_env()
        self._token = token
        self._directory_address = directory_address
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
        self._shm = self.config.shared_memory and shm.available()
        if self._shm:
            shm.sweep_orphans()
        self._store = LocalStore(
            self.config.store_capacity_bytes,
            self.config.buffer_pool_bytes,
            shared_min_bytes=self.config.inline_threshold_bytes + 1 if self._shm else 0,
        )
        self._data = DataPlane(self._store, token, self.config, on_served=self._on_served)
        ctx = sources.Context(
            self._store, self._data, self.config, self._report, self._completed, self._abandon
        )
        self._inline = sources.InlineSource(ctx)
        self._mapped = sources.SharedMemorySource(ctx)
        self._pull = sources.PullSource(ctx)
        self._control = self._new_control()
        self._vertices = VertexRunner(
            self._store,
            lambda oid, started: self._get(oid, None, started=started),
            self._allocate,
            self._report,
            self._publish,
            lambda oid: self._in_background(self._delete(oid)),
            self.config.reduce_chunk_bytes,
        )
        self._background: set[asyncio.Future[Any]] = set()  # fire-and-forget deletes
        self._closed = False
        self._beat: asyncio.Future[None] | None = None
        # Directory reconnection: which connection this is (a pull that began under an earlier one
        # reports its copy with Restore), the running reconnection (resolved when it ends), the
        # error once it gave up, and the reductions this node requested (re-sent after a restart).
        self._generation = 0
        self._reconnecting: asyncio.Future[None] | None = None
        self._unreachable: HopliteError | None = None
        self._requested: dict[bytes, p.ReduceRequest] = {}
        self._active: set[concurrent.futures.Future[Any]] = set()
        if self.config.fault_injection:
            faults.arm(self.config.fault_injection)
        self._io.run(self._start(), timeout=self.config.connect_timeout * 3)
        atexit.register(self.close)

    # ------------------------------------------------------------ properties
    @property
    def directory_address(self) -> str:
        """``host:port`` of the directory this node is connected to."""
        return self._directory_address

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
        return f"<hoplite_gpu.Node {self.node_id[:8]} directory={self._directory_address} {state}>"

    # ------------------------------------------------------------ lifecycle
    def _new_control(self, ids: itertools.count[int] | None = None) -> ControlClient:
        """A directory client (not connected yet) that hands pushes and its loss to this node."""
        return ControlClient(
            self._on_push, self.config.control_message_limit, on_lost=self._on_directory_lost, ids=ids
        )

    async def _join(self, client: ControlClient, previous_directory: str = "") -> None:
        """Connect ``client`` to the directory and introduce this node (see ``Hello``)."""
        await client.connect(
            self._directory_address,
            self._token,
            self.node_id,
            self._data_host,
            self._data.port,
            self.config.connect_timeout,
            host_key=shm.host_key() if self._shm else "",
            previous_directory=previous_directory,
        )

    async def _start(self) -> None:
        await self._data.start()
        try:
            await self._join(self._control)
        except BaseException:
            await self._data.close()
            raise
        self._beat = asyncio.ensure_future(self._heartbeats())

    async def _heartbeats(self) -> None:
        """Tell the directory this node is alive, every ``Config.heartbeat_interval`` seconds."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)  # a period, not synchronisation
            with contextlib.suppress(HopliteError):  # lost: the next connection's turn comes
                self._control.send(p.Heartbeat())

    def close(self) -> None:
        """Leave the directory, close every connection and drop local objects. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        with contextlib.suppress(Exception):
            self._io.run(self._close(), timeout=self.config.close_grace + 10.0)

    async def _close(self) -> None:
        err = NodeClosedError("the node was closed")
        if self._beat is not None:
            self._beat.cancel()
        if self._reconnecting is not None and not self._reconnecting.done():
            self._reconnecting.cancel()
        self._vertices.cancel()
        await self._data.close(grace=self.config.close_grace)
        self._store.clear(err)
        await self._control.close()
        if self._embedded is not None:
            await self._embedded.stop()

    def _check_open(self) -> None:
        if self._closed:
            raise NodeClosedError("this node was closed; create a new one with hoplite_gpu.init()")

    # ------------------------------------------------------------ put
    def _prepare(
        self, array: Any, object_id: ObjectID | None, copy: bool
    ) -> tuple[LocalObject, np.ndarray[Any, Any] | None]:
        """The local object for a put, and the bytes still to copy into it (None: copied already).

        A large contiguous array is copied after the put is published (:meth:`_put`), so receivers
        start while the copy runs; its digest is taken from the caller's array first.
        """
        if object_id is not None and not isinstance(object_id, ObjectID):
            raise InvalidArgumentError(
                f"object_id must be an ObjectID, got {type(object_id).__name__}", argument="object_id"
            )
        host = buffers.to_host(array)
        dtype = dtype_to_wire(host.dtype)
        nbytes = int(host.nbytes)
        if nbytes > self.config.max_object_bytes:
            raise ObjectTooLargeError(
                f"object of {nbytes} bytes exceeds Config.max_object_bytes={self.config.max_object_bytes}",
                size=nbytes,
                limit=self.config.max_object_bytes,
            )
        contiguous = host.flags.c_contiguous
        pooled = copy or not contiguous
        pending: np.ndarray[Any, Any] | None = None
        if pooled:
            data = self._store.pool.allocate(nbytes)
            if contiguous and nbytes >= 2 * PUT_COPY_BYTES:
                pending = host.reshape(-1).view(np.uint8)
            elif nbytes:
                data.view(host.dtype).reshape(host.shape)[...] = host
        else:
            data = host.reshape(-1).view(np.uint8)
        oid = object_id or ObjectID.random()
        obj = LocalObject(
            object_id=oid,
            size=nbytes,
            dtype=dtype,
            shape=tuple(int(s) for s in host.shape),
            digest=digest_of(data if pending is None else pending),
            data=data,
            progress=nbytes if pending is None else 0,
            owner=True,
            pooled=pooled,
        )
        return obj, pending

    def put(self, array: Any, object_id: ObjectID | None = None, *, copy: bool = True) -> ObjectID:
        """Store ``array`` under ``object_id`` (a new random id if None) and return the id.

        The bytes are copied (``copy=False`` stores a C-contiguous NumPy array without copying: the
        caller must then never modify it). Non-contiguous arrays are always copied. CuPy arrays are
        staged through host memory.

        Raises:
            ObjectExistsError: the id exists with different content, dtype or shape.
            ObjectTooLargeError: larger than ``Config.max_object_bytes``.
            StoreFullError: the local store is full.
            InvalidArgumentError: not an array, or an object dtype.
        """
        self._check_open()
        obj, pending = self._prepare(array, object_id, copy)
        return self._io.run(self._put(obj, pending))

    async def put_async(
        self, array: Any, object_id: ObjectID | None = None, *, copy: bool = True
    ) -> ObjectID:
        """Async twin of :meth:`put`."""
        self._check_open()
        obj, pending = self._prepare(array, object_id, copy)
        return await self._io.run_async(self._put(obj, pending))

    async def _put(self, obj: LocalObject, pending: np.ndarray[Any, Any] | None = None) -> ObjectID:
        """Publish ``obj``; with ``pending``, copy those bytes into it meanwhile (on a worker
        thread, advancing its progress chunk by chunk, so pulls of it stream behind the copy) and
        return once both are done. Its shared-memory segment is announced once the copy is."""
        oid = obj.object_id
        existing = self._store.get(oid)
        if existing is not None:
            if existing.digest == obj.digest and existing.dtype == obj.dtype and existing.shape == obj.shape:
                if existing.owner and not existing.complete:  # the same put, still copying
                    await existing.wait_progress(existing.size, self.config.request_timeout)
                if existing.complete:
                    return oid
            raise ObjectExistsError(
                f"object {oid} already exists on this node with different content; use a new "
                "ObjectID or delete it first",
                object_id=oid.hex(),
            )
        inline = obj.data.tobytes() if obj.size <= self._control.inline_threshold_bytes else None
        self._store.add(obj)
        stop = threading.Event()
        copying = None
        registered = False
        if pending is not None:
            loop = asyncio.get_running_loop()
            copying = loop.run_in_executor(None, _copy_advancing, loop, pending, obj, stop)
            seg = shm.segment_of(obj.data) if obj.pooled else None
            segment = "" if seg is None else seg.name  # published once the copy is done
        else:
            segment = self._publish(obj)
        try:
            reply = await self._request(
                lambda rid: p.PutRequest(
                    request_id=rid,
                    object_id=oid.binary(),
                    size=obj.size,
                    dtype=obj.dtype,
                    shape=list(obj.shape),
                    digest=obj.digest,
                    inline=inline,
                    segment=segment,
                    copying=copying is not None and bool(segment),
                ),
                self.config.request_timeout,
            )
            if not isinstance(reply, p.PutReply):
                raise ProtocolError(f"unexpected reply to put: {reply.TYPE}")
            if reply.error:
                raise _remote_error(reply.error_kind, reply.error, object_id=oid.hex())
            registered = True
            if copying is not None:
                await asyncio.shield(copying)  # the caller may reuse its array once put returns
        except BaseException as exc:
            stop.set()
            if copying is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.shield(copying)
            if self._store.get(oid) is obj:
                self._store.remove(oid, as_hoplite_error(exc, oid))
            if registered:  # published, then the copy failed (or the put was cancelled): withdraw it
                self._in_background(self._delete(oid))
            raise
        if copying is not None and obj.error is None:
            segment = self._publish(obj)
            if segment:
                self._report(p.CopyAdded(object_id=oid.binary(), segment=segment))
        return oid

    # ------------------------------------------------------------ get
    def _resolve_timeout(self, timeout: float | None) -> float | None:
        if timeout is None:
            timeout = self.config.default_get_timeout or None
        if timeout is not None and timeout < 0:
            raise InvalidArgumentError("timeout must be >= 0 seconds or None", argument="timeout")
        return timeout

    def get(
        self, object_id: ObjectID, timeout: float | None = None, out: Any = None, *, direct: bool = False
    ) -> Any:
        """Return the object's array, waiting until it exists (a ``get`` before the ``put`` works).

        Args:
            object_id: What to fetch.
            timeout: Seconds to wait in total; None uses ``Config.default_get_timeout`` (0: forever).
            out: Optional array (NumPy or CuPy) of the same dtype and shape to copy the result into;
                it is returned. Without ``out`` the result is a read-only NumPy array that shares
                memory with the local store (for an object held by another process on this host,
                with that process's shared-memory segment, which stays valid while you use it).
            direct: Pull from the object's owner (for a reduction's result: the node computing it)
                even while it serves other readers, instead of joining the pipelined chain of
                readers. For collectives whose traffic pattern leaves the owner's link room for
                every reader, such as the gather phase of a sharded allreduce, where a chain would
                load some links more than others. Falls back to any source if the owner is gone.

        Raises:
            HopliteTimeoutError: not available within ``timeout``.
            ObjectDeletedError: the owner deleted the object while waiting.
            TransportError: the directory or every source was lost.
        """
        self._check_open()
        self._check_oid(object_id)
        timeout = self._resolve_timeout(timeout)
        if _streamable(out):
            return self._io.run(self._get_into(object_id, timeout, out, direct))
        obj = self._io.run(self._get(object_id, timeout, direct=direct))
        return self._deliver(obj, out)

    async def get_async(
        self, object_id: ObjectID, timeout: float | None = None, out: Any = None, *, direct: bool = False
    ) -> Any:
        """Async twin of :meth:`get`."""
        self._check_open()
        self._check_oid(object_id)
        timeout = self._resolve_timeout(timeout)
        if _streamable(out):
            return await self._io.run_async(self._get_into(object_id, timeout, out, direct))
        obj = await self._io.run_async(self._get(object_id, timeout, direct=direct))
        return self._deliver(obj, out)

    @staticmethod
    def _check_oid(object_id: Any) -> None:
        if not isinstance(object_id, ObjectID):
            raise InvalidArgumentError(
                f"expected an ObjectID, got {type(object_id).__name__}", argument="object_id"
            )

    async def _get_into(self, oid: ObjectID, timeout: float | None, out: Any, direct: bool) -> Any:
        """:meth:`_get` into a NumPy ``out``, copying the bytes into it as they arrive rather than
        all at the end (for a large object the last copy would otherwise add to its latency)."""
        started: asyncio.Future[LocalObject] = asyncio.get_running_loop().create_future()
        fetch = asyncio.ensure_future(self._get(oid, timeout, started=started, direct=direct))
        follower: asyncio.Future[LocalObject] | None = None
        try:
            await asyncio.wait([fetch, started], return_when=asyncio.FIRST_COMPLETED)
            if started.done() and not fetch.done():
                source = started.result()
                dtype = dtype_from_wire(source.dtype)
                if tuple(out.shape) == tuple(source.shape) and np.dtype(out.dtype) == dtype:
                    follower = asyncio.ensure_future(_follow(source, out.reshape(-1).view(np.uint8)))
            obj = await fetch
            if follower is not None and started.result() is obj:
                # obj is complete: the follower copies what is left at once (or failed earlier, if
                # the copy was reset; obj is then another object, copied whole below)
                with contextlib.suppress(HopliteError):
                    if await follower is obj:
                        return out  # every byte was copied as it came
        finally:
            fetch.cancel()
            if follower is not None and not follower.done():
                follower.cancel()
        return self._deliver(obj, out)

    def _deliver(self, obj: LocalObject, out: Any) -> Any:
        arr = obj.array()
        if out is None:
            return arr
        if tuple(out.shape) != arr.shape or np.dtype(out.dtype) != arr.dtype:
            raise InvalidArgumentError(
                f"out has dtype {out.dtype} and shape {tuple(out.shape)}, the object "
                f"{obj.object_id} has dtype {arr.dtype} and shape {arr.shape}",
                argument="out",
            )
        buffers.copy_into(out, arr)
        return out

    async def _get(
        self,
        oid: ObjectID,
        timeout: float | None,
        started: asyncio.Future[LocalObject] | None = None,
        direct: bool = False,
    ) -> LocalObject:
        """Fetch ``oid`` into the local store; ``started`` (if given) is resolved with the local
        object as soon as it exists, while it is still filling."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return await self._fetch(oid, deadline, timeout, started, direct)
            except ObjectReset:
                log.debug("partial copy of %s was reset (its reduction is rebuilt); starting again", oid)

    async def _fetch(
        self,
        oid: ObjectID,
        deadline: float | None,
        timeout: float | None,
        started: asyncio.Future[LocalObject] | None,
        direct: bool = False,
    ) -> LocalObject:
        """One attempt of :meth:`_get` (raises :class:`ObjectReset` if its copy was voided)."""

        attempt = sources.Attempt(oid, timeout, deadline)

        async def filled(obj: LocalObject) -> LocalObject:
            try:
                await obj.wait_progress(obj.size, attempt.remaining())
            except HopliteTimeoutError:
                raise attempt.timed_out() from None
            return obj

        local = self._store.get(oid)
        if local is not None and local.progress < local.size:
            # Another get in this process (or a reduce vertex here, or a put still copying) is
            # filling it: wait for that.
            return await filled(local)
        if local is not None and local.complete:
            return local
        while True:
            left = attempt.remaining()
            if left is not None and left <= 0:
                raise attempt.timed_out()
            have = local.progress if local is not None else 0
            reply = await self._lookup(oid, left, have, self._shm and local is None, direct)
            generation = self._generation  # a copy finished under a later connection is restored
            if local is not None and local.error is not None:
                # Dropped while we asked (lost, deleted, or reset): this answer is for void bytes.
                if reply.transfer_id:
                    self._report(p.TransferDone(transfer_id=reply.transfer_id, ok=False, progress=0))
                if isinstance(local.error, ObjectReset) and reply.status == "error":
                    # Reset by a repair, then failed or deleted: starting again would wait for an
                    # object that will never come.
                    raise _lookup_error(oid, reply)
                raise local.error
            if reply.status == "timeout":
                if local is not None:
                    self._abandon(local, 0, attempt.timed_out())
                raise attempt.timed_out()
            if reply.status == "error":
                error = _lookup_error(oid, reply)
                if local is not None:
                    self._abandon(local, 0, error)
                raise error
            if reply.status == "inline":
                stored = await self._inline.fill(local, reply, attempt, generation)
                assert stored is not None  # inline data always fills the copy
                return await filled(stored)
            if reply.status == "local":
                existing = self._store.get(oid)
                if existing is None and self._vertices.computes(oid):
                    # A vertex placed here just now is still setting its output up.
                    wait = self.config.request_timeout if left is None else left
                    existing = await self._store.wait_for(oid, wait, coming=True)
                if existing is not None and existing.error is None:
                    return await filled(existing)  # complete, or a reduce vertex here computes it
                raise ObjectNotFoundError(f"object {oid} vanished from this node", object_id=oid.hex())
            appeared = self._store.get(oid) if local is None else None
            if appeared is not None:
                # It appeared while we asked: a reduce vertex on this node computes it (it was
                # placed here meanwhile). Wait for that instead of pulling a second copy.
                if reply.transfer_id:
                    self._report(p.TransferDone(transfer_id=reply.transfer_id, ok=False, progress=0))
                return await filled(appeared)
            if reply.status == "shm" and local is None:
                mapped = await self._mapped.fill(None, reply, attempt, generation)
                if mapped is not None:
                    return await filled(mapped)
            if local is None:
                local = self._new_partial(oid, reply)
                if started is not None and not started.done():
                    started.set_result(local)
            if reply.status == "shm":
                continue  # ``local`` exists now, so the next lookup asks for a data-plane source
            pulled = await self._pull.fill(local, reply, attempt, generation)
            if pulled is not None:
                return pulled

    def _completed(self, local: LocalObject, generation: int, transfer_id: int) -> None:
        """Tell the directory about a complete copy this node now holds (see :class:`sources.Context`)."""
        if generation != self._generation:
            self._restore(local)  # the directory restarted meanwhile: it never heard of the copy
        elif transfer_id:
            self._report(
                p.TransferDone(
                    transfer_id=transfer_id, ok=True, progress=local.size, segment=self._publish(local)
                )
            )
        else:
            self._report(p.CopyAdded(object_id=local.object_id.binary(), segment=self._publish(local)))

    @staticmethod
    def _publish(obj: LocalObject) -> str:
        """Publish a complete pooled copy in its shared-memory segment; the segment's name, or ""."""
        seg = shm.segment_of(obj.data) if obj.pooled else None
        if seg is None:
            return ""
        seg.publish(obj.object_id.binary())
        return seg.name

    def _abandon(self, local: LocalObject, transfer_id: int, exc: HopliteError) -> None:
        if transfer_id:
            self._report(
                p.TransferDone(transfer_id=transfer_id, ok=False, progress=local.progress, reason=str(exc))
            )
        if self._store.get(local.object_id) is local:
            self._store.remove(local.object_id, exc)

    async def _lookup(
        self,
        oid: ObjectID,
        timeout: float | None,
        have: int,
        shared_memory: bool = False,
        direct: bool = False,
    ) -> p.LookupReply:
        return await self._with_directory(
            lambda control, left: self._lookup_once(control, oid, left, have, shared_memory, direct), timeout
        )

    async def _lookup_once(
        self,
        control: ControlClient,
        oid: ObjectID,
        timeout: float | None,
        have: int,
        shared_memory: bool,
        direct: bool = False,
    ) -> p.LookupReply:
        rid = control.next_id()
        fut = control.expect(rid)
        try:
            control.send(
                p.LookupRequest(
                    request_id=rid,
                    object_id=oid.binary(),
                    timeout=timeout or 0.0,
                    have_bytes=have,
                    shared_memory=shared_memory,
                    direct=direct,
                )
            )
            # The directory enforces the deadline; the margin covers a directory that went silent.
            guard = None if timeout is None else timeout + self.config.request_timeout
            reply = await asyncio.wait_for(fut, guard)
        except asyncio.TimeoutError:
            raise DirectoryUnavailableError(
                f"the directory did not answer a lookup of {oid}",
                peer=self._directory_address,
                cause="timeout",
            ) from None
        except BaseException:
            with contextlib.suppress(HopliteError):
                control.send(p.CancelLookup(request_id=rid))
            raise
        finally:
            control.forget(rid)
        if not isinstance(reply, p.LookupReply):
            raise ProtocolError(f"unexpected reply to lookup: {reply.TYPE}")
        return reply

    def _new_partial(self, oid: ObjectID, reply: p.LookupReply) -> LocalObject:
        meta = sources.checked_meta(oid, reply)
        if reply.size > self.config.max_object_bytes:
            raise ObjectTooLargeError(
                f"object {oid} of {reply.size} bytes exceeds Config.max_object_bytes",
                size=reply.size,
                limit=self.config.max_object_bytes,
            )
        self._store.reserve(reply.size)
        data = self._store.pool.allocate(reply.size)
        return self._store.add(sources.from_reply(oid, reply, meta, data, progress=0, pooled=True))

    async def _allocate(self, nbytes: int) -> np.ndarray[Any, Any]:
        """A store buffer; large fresh ones are set up (page faults) on a worker thread, so the
        event loop keeps serving transfers meanwhile."""
        if nbytes < sources.THREAD_COPY_BYTES:
            return self._store.pool.allocate(nbytes)
        return await asyncio.get_running_loop().run_in_executor(None, self._store.pool.allocate, nbytes)

    def _report(self, msg: p.Message) -> None:
        with contextlib.suppress(HopliteError):
            self._control.send(msg)

    def _on_served(self, transfer_id: int, sent: int, while_incomplete: int, failed: bool) -> None:
        self._report(
            p.ServeDone(
                transfer_id=transfer_id,
                bytes_sent=sent,
                bytes_sent_while_incomplete=while_incomplete,
                failed=failed,
            )
        )

    def _on_push(self, msg: p.Message) -> None:
        if isinstance(msg, p.ReduceTask):
            self._vertices.start(msg)
        elif isinstance(msg, p.ReduceChild):
            self._vertices.set_child(msg)
        elif isinstance(msg, p.DropObject):
            self._drop(ObjectID(msg.object_id), msg.reason)
        elif isinstance(msg, p.AbortTransfer):
            self._pull.abort(msg.transfer_id, PeerLostError(msg.reason, peer="", cause="sender died"))

    def _drop(self, oid: ObjectID, reason: str) -> None:
        """The directory dropped this node's copy of ``oid`` (see :class:`protocol.DropObject`)."""
        self._vertices.cancel(oid)  # the reduction failed, was deleted, or its tree is rebuilt
        local = self._store.get(oid)
        error: HopliteError
        if reason == "reset":
            if local is not None and local.complete:
                return  # finished before the failure: exact for the inputs it reduced; keep it
            error = ObjectReset(f"partial copy of {oid} was reset", object_id=oid.hex())
        elif reason == "lost":
            error = ObjectLostError(
                f"object {oid} was lost: every complete copy died while it was being received; put it again",
                object_id=oid.hex(),
            )
        else:
            error = ObjectDeletedError(f"object {oid} was deleted by its owner", object_id=oid.hex())
        self._store.remove(oid, error)

    def _on_directory_lost(self, error: HopliteError) -> None:
        # Nobody can tell a vertex any more that its reduction failed: stop them.
        self._vertices.cancel()
        if self._closed:
            return
        if self.config.reconnect_timeout <= 0:
            self._unreachable = error
            return
        log.warning("lost the directory at %s (%s); reconnecting", self._directory_address, error)
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = asyncio.ensure_future(self._reconnect(error))
        # A restarted directory rebuilds every unfinished reduction from scratch: copies of what
        # the old trees computed are void (pulls of ordinary objects go on meanwhile).
        for obj in self._store.objects():
            if obj.reduction and (obj.object_id.binary() != obj.reduction or not obj.complete):
                self._store.remove(
                    obj.object_id,
                    ObjectReset(
                        f"{obj.object_id} was being reduced when the directory was lost",
                        object_id=obj.object_id.hex(),
                    ),
                )

    async def _reconnect(self, error: HopliteError) -> None:
        """Reach the directory again (it may be restarting at the same address), with backoff,
        for up to ``Config.reconnect_timeout`` s; then restore this node's copies and re-send its
        reductions. On giving up, every waiting and later request fails with the error."""
        lost = self._control
        give_up = time.monotonic() + self.config.reconnect_timeout
        pause = 0.05
        while True:
            client = self._new_control(ids=lost.ids)
            try:
                await self._join(client, previous_directory=lost.directory_id)
                break
            except HopliteError as exc:
                # Also an AuthenticationError: a directory dying as it authenticated us looks
                # like a refusal; a real one (another token) fails when the time is up.
                error = exc
            except Exception as exc:  # not expected; retried all the same, and said
                log.exception("reconnecting to the directory failed unexpectedly")
                error = DirectoryUnavailableError(str(exc), peer=self._directory_address, cause="error")
            if time.monotonic() + pause > give_up:
                break
            await asyncio.sleep(pause)  # backoff between attempts, not synchronisation
            pause = min(2 * pause, MAX_RECONNECT_BACKOFF)
        if client.directory_id == "":
            self._unreachable = DirectoryUnavailableError(
                f"the directory at {self._directory_address} did not come back within "
                f"{self.config.reconnect_timeout} s: {error}",
                peer=self._directory_address,
                cause="unreachable",
            )
            log.error("%s", self._unreachable)
            return
        self._control = client
        self._generation += 1
        for obj in self._store.objects():
            if obj.complete and not obj.reduction:
                self._restore(obj)
        for msg in self._requested.values():
            client.send(dataclasses.replace(msg, request_id=client.next_id(), rejoin=True))
        log.warning("rejoined the directory at %s (%s)", self._directory_address, client.directory_id[:8])

    def _restore(self, obj: LocalObject) -> None:
        """Tell a restarted directory about a complete copy this node holds."""
        inline = obj.data.tobytes() if obj.size <= self._control.inline_threshold_bytes else None
        self._report(
            p.Restore(
                object_id=obj.object_id.binary(),
                size=obj.size,
                dtype=obj.dtype,
                shape=list(obj.shape),
                digest=obj.digest,
                owner=obj.owner,
                inline=inline,
                segment=self._publish(obj),
            )
        )

    def _will_reconnect(self, control: ControlClient) -> bool:
        """Whether a request that failed on ``control`` should wait for the next connection."""
        return (
            control.lost
            and not self._closed
            and self._unreachable is None
            and (control is not self._control or self._reconnecting is not None)
        )

    async def _await_directory(self, timeout: float | None) -> None:
        """Return once connected to the directory (at once, normally); wait for a reconnection
        in progress for up to ``timeout`` s."""
        if self._unreachable is not None:
            raise self._unreachable
        pending = self._reconnecting
        if pending is None or pending.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(pending), timeout)
        except asyncio.TimeoutError:
            raise DirectoryUnavailableError(
                f"the directory at {self._directory_address} is unreachable (reconnecting)",
                peer=self._directory_address,
                cause="timeout",
            ) from None
        if self._unreachable is not None:
            raise self._unreachable

    async def _request(self, make: Callable[[int], p.Message], timeout: float | None) -> p.Message:
        """Send the request ``make(request_id)`` and return its reply (see :meth:`_with_directory`)."""
        return await self._with_directory(
            lambda control, left: control.request(make(control.next_id()), left), timeout
        )

    async def _with_directory(
        self, call: Callable[[ControlClient, float | None], Awaitable[T]], timeout: float | None
    ) -> T:
        """``await call(connection, seconds_left)``; if the directory is lost meanwhile, call it
        again on the reconnected one (a restarted directory), within ``timeout`` in all."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            await self._await_directory(left)
            control = self._control
            try:
                return await call(control, left)
            except DirectoryUnavailableError:
                if not self._will_reconnect(control):
                    raise

    # ------------------------------------------------------------ reduce
    def reduce(
        self,
        object_ids: Any,
        op: ReduceOp | str = ReduceOp.SUM,
        num_objects: int | None = None,
        reduction_id: ObjectID | None = None,
        timeout: float | None = None,
        degree: int | None = None,
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

        Raises:
            InvalidArgumentError: bad ids, ``num_objects`` or op, or an unsupported dtype.
            ReduceMismatchError: inputs already present differ in dtype or shape (names one).
            ObjectExistsError: ``reduction_id`` exists as an object or another reduction.
        """
        self._check_open()
        msg = self._reduce_request(object_ids, op, num_objects, reduction_id, timeout, degree)
        return self._io.run(self._reduce(msg))

    async def reduce_async(
        self,
        object_ids: Any,
        op: ReduceOp | str = ReduceOp.SUM,
        num_objects: int | None = None,
        reduction_id: ObjectID | None = None,
        timeout: float | None = None,
        degree: int | None = None,
    ) -> ObjectID:
        """Async twin of :meth:`reduce`."""
        self._check_open()
        msg = self._reduce_request(object_ids, op, num_objects, reduction_id, timeout, degree)
        return await self._io.run_async(self._reduce(msg))

    def _reduce_request(
        self,
        object_ids: Any,
        op: ReduceOp | str,
        num_objects: int | None,
        reduction_id: ObjectID | None,
        timeout: float | None,
        degree: int | None = None,
    ) -> p.ReduceRequest:
        ids = list(object_ids) if not isinstance(object_ids, (str, bytes, ObjectID)) else None
        if not ids or not all(isinstance(o, ObjectID) for o in ids):
            raise InvalidArgumentError(
                "object_ids must be a non-empty list of ObjectIDs", argument="object_ids"
            )
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError("object_ids must be distinct", argument="object_ids")
        k = len(ids) if num_objects is None else num_objects
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= len(ids):
            raise InvalidArgumentError(
                f"num_objects must be an int in 1..{len(ids)}, got {num_objects!r}", argument="num_objects"
            )
        if reduction_id is not None and not isinstance(reduction_id, ObjectID):
            raise InvalidArgumentError("reduction_id must be an ObjectID or None", argument="reduction_id")
        if degree is not None and (not isinstance(degree, int) or isinstance(degree, bool) or degree < 1):
            raise InvalidArgumentError(
                f"degree must be an int >= 1 or None, got {degree!r}", argument="degree"
            )
        rid = reduction_id or ObjectID.random()
        if rid in ids:
            raise InvalidArgumentError("reduction_id must not be one of the inputs", argument="reduction_id")
        wait = self._resolve_timeout(timeout)
        return p.ReduceRequest(
            request_id=0,
            reduction_id=rid.binary(),
            object_ids=[o.binary() for o in ids],
            op=as_op(op).value,
            num_objects=k,
            timeout=wait or 0.0,
            degree=degree or 0,
        )

    async def _reduce(self, msg: p.ReduceRequest) -> ObjectID:
        reply = await self._request(
            lambda rid: dataclasses.replace(msg, request_id=rid), self.config.request_timeout
        )
        if not isinstance(reply, p.ReduceReply):
            raise ProtocolError(f"unexpected reply to reduce: {reply.TYPE}")
        if reply.error:
            culprit = reply.error_object_id.hex() if reply.error_object_id else None
            raise _remote_error(
                reply.error_kind, reply.error, object_id=culprit, reduction_id=msg.reduction_id.hex()
            )
        self._requested.pop(msg.reduction_id, None)
        self._requested[msg.reduction_id] = msg
        if len(self._requested) > REQUESTED_KEPT:
            del self._requested[next(iter(self._requested))]
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
        guard = self.config.request_timeout + timeout if timeout else None
        reply = await self._request(
            lambda request_id: p.ReducedObjectsRequest(
                request_id=request_id, reduction_id=rid.binary(), timeout=timeout or 0.0
            ),
            guard,
        )
        if not isinstance(reply, p.ReducedObjectsReply):
            raise ProtocolError(f"unexpected reply to reduced_objects: {reply.TYPE}")
        if reply.error:
            culprit = reply.error_object_id.hex() if reply.error_object_id else None
            raise _remote_error(reply.error_kind, reply.error, object_id=culprit, reduction_id=rid.hex())
        return [ObjectID(o) for o in reply.object_ids]

    def _in_background(self, delete: Coroutine[Any, Any, bool]) -> None:
        """Run a delete nobody waits for (its failure is only logged)."""
        task = asyncio.ensure_future(delete)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Future[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("background delete failed: %s", task.exception())

    # ------------------------------------------------------------ delete and diagnostics
    def delete(self, object_id: ObjectID) -> bool:
        """Delete an object. On its owner (the node that put it, or that requested the reduction)
        it disappears from the directory and from every node; elsewhere only the local copy is
        dropped, unless it is the only copy (a reduction result on the node that computed it),
        which stays until the owner deletes it. Returns whether the object was deleted everywhere."""
        self._check_open()
        self._check_oid(object_id)
        return self._io.run(self._delete(object_id))

    async def delete_async(self, object_id: ObjectID) -> bool:
        """Async twin of :meth:`delete`."""
        self._check_open()
        self._check_oid(object_id)
        return await self._io.run_async(self._delete(object_id))

    async def _delete(self, oid: ObjectID) -> bool:
        self._requested.pop(oid.binary(), None)
        reply = await self._request(
            lambda rid: p.DeleteRequest(request_id=rid, object_id=oid.binary()), self.config.request_timeout
        )
        if not isinstance(reply, p.DeleteReply):
            raise ProtocolError(f"unexpected reply to delete: {reply.TYPE}")
        if not reply.kept:
            self._store.remove(oid)
        return reply.deleted

    def contains(self, object_id: ObjectID) -> bool:
        """Whether this node holds a complete local copy."""
        obj = self._store.get(object_id)
        return obj is not None and obj.complete

    def event_log(self, since: int = 0) -> list[dict[str, Any]]:
        """The directory's event log from sequence number ``since`` (diagnostics, tests); fetched
        in pages of :data:`~hoplite_gpu.protocol.EVENT_LOG_PAGE` events."""
        self._check_open()

        async def fetch() -> list[dict[str, Any]]:
            events: list[dict[str, Any]] = []
            start = since
            while True:
                request = functools.partial(p.EventLogRequest, since=start)
                reply = await self._request(request, self.config.request_timeout)
                if not isinstance(reply, p.EventLogReply):
                    raise ProtocolError(f"unexpected reply to event_log: {reply.TYPE}")
                events += reply.events
                if len(reply.events) < p.EVENT_LOG_PAGE:
                    return events
                start = reply.events[-1]["seq"] + 1

        return self._io.run(fetch())

    def stats(self) -> dict[str, Any]:
        """Local store figures: objects, bytes used, capacity, data-plane auth failures."""
        return {
            "node_id": self.node_id,
            "objects": len(self._store),
            "used_bytes": self._store.used_bytes,
            "capacity_bytes": self._store.capacity_bytes,
            "data_auth_failures": self._data.auth_failures,
            "pid": os.getpid(),
        }
