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
import logging
import os
import threading
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np

from . import protocol as p
from . import shm
from .config import Config
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
    ObjectNotFoundError,
    ObjectTooLargeError,
    ProtocolError,
    TransportError,
)
from .object_id import ObjectID
from .store import LocalObject, LocalStore, digest_of, dtype_from_wire, dtype_to_wire
from .transport import DataPlane

log = logging.getLogger("hoplite_gpu")

T = TypeVar("T")

#: Consecutive failed pulls without any new byte received before ``get`` gives up.
MAX_FRUITLESS_PULLS = 8

#: Shared-memory copies at least this large run on a worker thread (NumPy releases the GIL), so
#: the event loop keeps serving other transfers meanwhile.
THREAD_COPY_BYTES = 1 << 20

_ERROR_KINDS: dict[str, type[HopliteError]] = {
    "ObjectExistsError": ObjectExistsError,
    "ProtocolError": ProtocolError,
}


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


def _to_host(array: Any) -> np.ndarray[Any, Any]:
    """A NumPy view/copy of ``array`` (NumPy, CuPy, or anything exposing ``__array__``)."""
    if isinstance(array, np.ndarray):
        return array
    module = type(array).__module__.split(".")[0]
    if module == "cupy":
        return array.get()  # type: ignore[no-any-return]
    if module == "torch":
        return array.detach().cpu().numpy()  # type: ignore[no-any-return]
    raise InvalidArgumentError(
        f"put needs a NumPy or CuPy array, got {type(array).__name__}", argument="array"
    )


def _as_hoplite_error(exc: BaseException, oid: ObjectID) -> HopliteError:
    """The error waiters of an abandoned get see: ``exc`` itself if typed, else a cancellation."""
    if isinstance(exc, HopliteError):
        return exc
    return ObjectDeletedError(f"get of {oid} was cancelled", object_id=oid.hex())


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
        self._control = ControlClient(self._on_push, self.config.control_message_limit)
        self._closed = False
        self._active: set[concurrent.futures.Future[Any]] = set()
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
        return f"{self.config.data_host}:{self._data.port}"

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
    async def _start(self) -> None:
        port = await self._data.start()
        try:
            await self._control.connect(
                self._directory_address,
                self._token,
                self.node_id,
                self.config.data_host,
                port,
                self.config.connect_timeout,
                host_key=shm.host_key() if self._shm else "",
            )
        except BaseException:
            await self._data.close()
            raise

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
        await self._data.close(grace=self.config.close_grace)
        self._store.clear(err)
        shm.forget_mappings()
        await self._control.close()
        if self._embedded is not None:
            await self._embedded.stop()

    def _check_open(self) -> None:
        if self._closed:
            raise NodeClosedError("this node was closed; create a new one with hoplite_gpu.init()")

    # ------------------------------------------------------------ put
    def _prepare(self, array: Any, object_id: ObjectID | None, copy: bool) -> LocalObject:
        if object_id is not None and not isinstance(object_id, ObjectID):
            raise InvalidArgumentError(
                f"object_id must be an ObjectID, got {type(object_id).__name__}", argument="object_id"
            )
        host = _to_host(array)
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
        if pooled:
            data = self._store.pool.allocate(nbytes)
            if nbytes:
                data.view(host.dtype).reshape(host.shape)[...] = host
        else:
            data = host.reshape(-1).view(np.uint8)
        oid = object_id or ObjectID.random()
        return LocalObject(
            object_id=oid,
            size=nbytes,
            dtype=dtype,
            shape=tuple(int(s) for s in host.shape),
            digest=digest_of(data),
            data=data,
            progress=nbytes,
            owner=True,
            pooled=pooled,
        )

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
        obj = self._prepare(array, object_id, copy)
        return self._io.run(self._put(obj))

    async def put_async(
        self, array: Any, object_id: ObjectID | None = None, *, copy: bool = True
    ) -> ObjectID:
        """Async twin of :meth:`put`."""
        self._check_open()
        obj = self._prepare(array, object_id, copy)
        return await self._io.run_async(self._put(obj))

    async def _put(self, obj: LocalObject) -> ObjectID:
        oid = obj.object_id
        existing = self._store.get(oid)
        if existing is not None:
            if existing.digest == obj.digest and existing.dtype == obj.dtype and existing.shape == obj.shape:
                if existing.complete:
                    return oid
            raise ObjectExistsError(
                f"object {oid} already exists on this node with different content; use a new "
                "ObjectID or delete it first",
                object_id=oid.hex(),
            )
        inline = obj.data.tobytes() if obj.size <= self._control.inline_threshold_bytes else None
        self._store.add(obj)
        segment = self._publish(obj)
        rid = self._control.next_id()
        try:
            reply = await self._control.request(
                p.PutRequest(
                    request_id=rid,
                    object_id=oid.binary(),
                    size=obj.size,
                    dtype=obj.dtype,
                    shape=list(obj.shape),
                    digest=obj.digest,
                    inline=inline,
                    segment=segment,
                ),
                self.config.request_timeout,
            )
        except BaseException:
            self._store.remove(oid)
            raise
        if not isinstance(reply, p.PutReply):
            self._store.remove(oid)
            raise ProtocolError(f"unexpected reply to put: {reply.TYPE}")
        if reply.error:
            self._store.remove(oid)
            cls = _ERROR_KINDS.get(reply.error_kind, HopliteError)
            raise cls(reply.error, object_id=oid.hex())
        return oid

    # ------------------------------------------------------------ get
    def _resolve_timeout(self, timeout: float | None) -> float | None:
        if timeout is None:
            timeout = self.config.default_get_timeout or None
        if timeout is not None and timeout < 0:
            raise InvalidArgumentError("timeout must be >= 0 seconds or None", argument="timeout")
        return timeout

    def get(self, object_id: ObjectID, timeout: float | None = None, out: Any = None) -> Any:
        """Return the object's array, waiting until it exists (a ``get`` before the ``put`` works).

        Args:
            object_id: What to fetch.
            timeout: Seconds to wait in total; None uses ``Config.default_get_timeout`` (0: forever).
            out: Optional array (NumPy or CuPy) of the same dtype and shape to copy the result into;
                it is returned. Without ``out`` the result is a read-only NumPy array that shares
                memory with the local store.

        Raises:
            HopliteTimeoutError: not available within ``timeout``.
            ObjectDeletedError: the owner deleted the object while waiting.
            TransportError: the directory or every source was lost.
        """
        self._check_open()
        self._check_oid(object_id)
        timeout = self._resolve_timeout(timeout)
        obj = self._io.run(self._get(object_id, timeout))
        return self._deliver(obj, out)

    async def get_async(self, object_id: ObjectID, timeout: float | None = None, out: Any = None) -> Any:
        """Async twin of :meth:`get`."""
        self._check_open()
        self._check_oid(object_id)
        timeout = self._resolve_timeout(timeout)
        obj = await self._io.run_async(self._get(object_id, timeout))
        return self._deliver(obj, out)

    @staticmethod
    def _check_oid(object_id: Any) -> None:
        if not isinstance(object_id, ObjectID):
            raise InvalidArgumentError(
                f"expected an ObjectID, got {type(object_id).__name__}", argument="object_id"
            )

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
        if isinstance(out, np.ndarray):
            np.copyto(out, arr)
        else:
            out.set(arr)  # CuPy
        return out

    async def _get(self, oid: ObjectID, timeout: float | None) -> LocalObject:
        deadline = None if timeout is None else time.monotonic() + timeout

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        def timed_out() -> HopliteTimeoutError:
            return HopliteTimeoutError(
                f"object {oid} was not available within {timeout} s",
                operation="get",
                timeout=timeout,
                object_id=oid.hex(),
            )

        local = self._store.get(oid)
        if local is not None and not local.owner and local.progress < local.size:
            # Another get in this process is filling it: wait for that one.
            try:
                await local.wait_progress(local.size, remaining())
            except HopliteTimeoutError:
                raise timed_out() from None
            return local
        if local is not None and local.complete:
            return local
        fruitless = 0
        while True:
            left = remaining()
            if left is not None and left <= 0:
                raise timed_out()
            have = local.progress if local is not None else 0
            reply = await self._lookup(oid, left, have, shared_memory=self._shm and local is None)
            if reply.status == "timeout":
                raise timed_out()
            if reply.status == "inline":
                return self._store_inline(oid, reply)
            if reply.status == "local":
                existing = self._store.get(oid)
                if existing is not None and existing.complete:
                    return existing
                raise ObjectNotFoundError(f"object {oid} vanished from this node", object_id=oid.hex())
            if local is None:
                local = self._new_partial(oid, reply)
            if reply.status == "shm":
                try:
                    copied = await self._copy_shared(local, reply)
                except BaseException as exc:
                    self._abandon(local, 0, _as_hoplite_error(exc, oid))
                    raise
                if copied:
                    return local
                if local.error is not None:
                    raise local.error
                log.debug(
                    "shared-memory copy of %s from %s failed; pulling instead", oid, reply.sender_node[:8]
                )
                continue  # ``local`` exists now, so the next lookup asks for a data-plane source
            before = local.progress
            try:
                pull = self._data.pull(reply.sender_host, reply.sender_port, local, reply.transfer_id)
                try:
                    await asyncio.wait_for(pull, remaining())
                except asyncio.TimeoutError:
                    raise timed_out() from None
                if self.config.verify_digest and digest_of(local.data) != local.digest:
                    raise TransportError(
                        f"object {oid} arrived corrupted (digest mismatch)", peer="", cause="digest"
                    )
            except (TransportError, ObjectNotFoundError) as exc:
                if isinstance(exc, AuthenticationError) or (
                    deadline is not None and time.monotonic() >= deadline
                ):
                    self._abandon(local, reply.transfer_id, exc)
                    raise
                self._report(
                    p.TransferDone(
                        transfer_id=reply.transfer_id, ok=False, progress=local.progress, reason=str(exc)
                    )
                )
                fruitless = 0 if local.progress > before else fruitless + 1
                if fruitless >= MAX_FRUITLESS_PULLS:
                    self._abandon(local, 0, exc)
                    raise
                # A copy deleted just as the directory chose it is routine; a lost peer is news.
                log.log(
                    logging.DEBUG if isinstance(exc, ObjectNotFoundError) else logging.INFO,
                    "pull of %s from %s failed (%s); asking for another source",
                    oid,
                    reply.sender_node[:8],
                    exc,
                )
                continue
            except BaseException as exc:
                self._abandon(local, reply.transfer_id, _as_hoplite_error(exc, oid))
                raise
            if local.error is not None:
                raise local.error
            self._report(
                p.TransferDone(
                    transfer_id=reply.transfer_id, ok=True, progress=local.size, segment=self._publish(local)
                )
            )
            return local

    async def _copy_shared(self, local: LocalObject, reply: p.LookupReply) -> bool:
        """Fill ``local`` from a same-host holder's shared-memory segment; False if it changed or
        vanished (the caller then pulls over the data plane)."""
        oid = local.object_id.binary()
        if local.size >= THREAD_COPY_BYTES:
            loop = asyncio.get_running_loop()
            ok = await loop.run_in_executor(None, shm.read_into, reply.segment, oid, local.data)
        else:
            ok = shm.read_into(reply.segment, oid, local.data)
        if not ok or local.error is not None:  # removed meanwhile: an incomplete copy is failed
            return False
        if self.config.verify_digest and digest_of(local.data) != local.digest:
            log.warning("shared-memory copy of %s did not match its digest", local.object_id)
            return False
        local.advance(local.size)
        self._report(p.CopyAdded(object_id=oid, segment=self._publish(local)))
        return True

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
        self, oid: ObjectID, timeout: float | None, have: int, shared_memory: bool = False
    ) -> p.LookupReply:
        rid = self._control.next_id()
        fut = self._control.expect(rid)
        try:
            self._control.send(
                p.LookupRequest(
                    request_id=rid,
                    object_id=oid.binary(),
                    timeout=timeout or 0.0,
                    have_bytes=have,
                    shared_memory=shared_memory,
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
                self._control.send(p.CancelLookup(request_id=rid))
            raise
        finally:
            self._control.forget(rid)
        if not isinstance(reply, p.LookupReply):
            raise ProtocolError(f"unexpected reply to lookup: {reply.TYPE}")
        return reply

    def _meta_checked(self, oid: ObjectID, reply: p.LookupReply) -> tuple[str, tuple[int, ...]]:
        shape = tuple(int(s) for s in reply.shape)
        dtype = dtype_from_wire(reply.dtype)
        if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != reply.size:
            raise ProtocolError(f"directory metadata of {oid} is inconsistent", object_id=oid.hex())
        return reply.dtype, shape

    def _store_inline(self, oid: ObjectID, reply: p.LookupReply) -> LocalObject:
        dtype, shape = self._meta_checked(oid, reply)
        assert reply.inline is not None
        data = np.frombuffer(reply.inline, np.uint8).copy()
        if data.size != reply.size:
            raise ProtocolError(f"inline data of {oid} has the wrong size", object_id=oid.hex())
        existing = self._store.get(oid)
        if existing is not None:
            return existing
        obj = LocalObject(oid, reply.size, dtype, shape, reply.digest, data, progress=reply.size)
        return self._store.add(obj)

    def _new_partial(self, oid: ObjectID, reply: p.LookupReply) -> LocalObject:
        dtype, shape = self._meta_checked(oid, reply)
        if reply.size > self.config.max_object_bytes:
            raise ObjectTooLargeError(
                f"object {oid} of {reply.size} bytes exceeds Config.max_object_bytes",
                size=reply.size,
                limit=self.config.max_object_bytes,
            )
        self._store.reserve(reply.size)
        data = self._store.pool.allocate(reply.size)
        obj = LocalObject(oid, reply.size, dtype, shape, reply.digest, data, progress=0, pooled=True)
        return self._store.add(obj)

    def _report(self, msg: p.Message) -> None:
        with contextlib.suppress(HopliteError):
            self._control.send(msg)

    def _on_served(self, transfer_id: int, sent: int, while_incomplete: int) -> None:
        self._report(
            p.ServeDone(
                transfer_id=transfer_id, bytes_sent=sent, bytes_sent_while_incomplete=while_incomplete
            )
        )

    def _on_push(self, msg: p.Message) -> None:
        if isinstance(msg, p.DropObject):
            oid = ObjectID(msg.object_id)
            self._store.remove(
                oid, ObjectDeletedError(f"object {oid} was deleted by its owner", object_id=oid.hex())
            )
            shm.forget_mappings(unlinked_only=True)

    # ------------------------------------------------------------ delete and diagnostics
    def delete(self, object_id: ObjectID) -> bool:
        """Delete an object. On its owner (the node that put it) it disappears from the directory
        and from every node; elsewhere only the local copy is dropped. Returns whether the object
        was deleted everywhere."""
        self._check_open()
        self._check_oid(object_id)
        return self._io.run(self._delete(object_id))

    async def delete_async(self, object_id: ObjectID) -> bool:
        """Async twin of :meth:`delete`."""
        self._check_open()
        self._check_oid(object_id)
        return await self._io.run_async(self._delete(object_id))

    async def _delete(self, oid: ObjectID) -> bool:
        rid = self._control.next_id()
        reply = await self._control.request(
            p.DeleteRequest(request_id=rid, object_id=oid.binary()), self.config.request_timeout
        )
        self._store.remove(oid)
        shm.forget_mappings(unlinked_only=True)
        return isinstance(reply, p.DeleteReply) and reply.deleted

    def contains(self, object_id: ObjectID) -> bool:
        """Whether this node holds a complete local copy."""
        obj = self._store.get(object_id)
        return obj is not None and obj.complete

    def event_log(self, since: int = 0) -> list[dict[str, Any]]:
        """The directory's event log from sequence number ``since`` (diagnostics, tests)."""
        self._check_open()

        async def fetch() -> list[dict[str, Any]]:
            rid = self._control.next_id()
            reply = await self._control.request(
                p.EventLogRequest(request_id=rid, since=since), self.config.request_timeout
            )
            assert isinstance(reply, p.EventLogReply)
            return reply.events

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
