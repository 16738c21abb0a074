"""How a node gets an object: ask the directory, fill the local copy from the source it names,
report the copy.

:meth:`Fetcher.get` is a short loop: a lookup (:meth:`Fetcher._lookup`: the directory's answer,
checked), the source (:mod:`hoplite_gpu.node.sources`) that answer names (:meth:`Fetcher._source_for`)
filling the local copy, and a report when it is complete (:meth:`Fetcher.completed`), so later
readers can pull from it. A source that asks for another one sends the loop round again, with the
bytes it already holds; the copy is visible in the local store while it fills, so other readers can
pull from it even then. :meth:`LocalObject.deliver <hoplite_gpu.memory.LocalObject.deliver>`
hands the object to the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import protocol as p
from ..config import Config
from ..dataplane.base import DataPlane
from ..dtypes import dtype_from_wire
from ..errors import (
    HopliteError,
    HopliteTimeoutError,
    InvalidArgumentError,
    ObjectNotFoundError,
    ObjectReset,
    ObjectTooLargeError,
    ProtocolError,
    TransportError,
    from_kind,
)
from ..faults import INJECTOR
from ..memory import (
    MEMORY_DEVICE,
    OUT_KINDS,
    ArrayKind,
    Buffer,
    CallerArray,
    LocalObject,
    LocalStore,
    device_in_use,
)
from ..object_id import ObjectID
from . import sources
from .channel import ChannelLost, Channels
from .session import DirectorySession

log = logging.getLogger("hoplite_gpu")

#: Bytes a ``get`` into ``out`` copies at a time while the object arrives.
STREAM_COPY_BYTES = 4 << 20


def check_out(out: Any) -> CallerArray | None:
    """``out`` as the caller's array ``get`` writes into (None for None); raises
    :class:`InvalidArgumentError` unless it is a writable NumPy array, or a CuPy array. Its dtype
    and shape are checked on arrival."""
    if out is None:
        return None
    entered = CallerArray.of(out)
    if entered.kind not in OUT_KINDS:
        raise InvalidArgumentError(
            f"out must be a NumPy or CuPy array, got {type(out).__name__}", argument="out"
        )
    if entered.kind is ArrayKind.NUMPY and not out.flags.writeable:
        raise InvalidArgumentError("out is read-only", argument="out")
    return entered


def receivable(out: CallerArray | None) -> bool:
    """Whether the data plane can receive straight into ``out`` (a writable C-contiguous NumPy
    array)."""
    return (
        out is not None
        and out.kind is ArrayKind.NUMPY
        and out.value.flags.c_contiguous
        and out.value.flags.writeable
    )


def streamable(out: CallerArray | None) -> bool:
    """Whether ``get`` can copy into ``out`` while the object arrives (a writable C-contiguous
    NumPy array of at least a few chunks; others get one copy at the end)."""
    return receivable(out) and out is not None and out.value.nbytes >= 2 * STREAM_COPY_BYTES


async def _follow(source: LocalObject, dst: np.ndarray[Any, Any]) -> LocalObject:
    """Copy ``source``'s bytes into ``dst`` as they arrive; return ``source`` once all are copied
    (raises if the copy is dropped or reset meanwhile: the caller then copies the final object)."""
    copied = 0
    while copied < source.size:
        await source.wait_progress(min(copied + STREAM_COPY_BYTES, source.size), None)
        end = source.progress
        dst[copied:end] = source.buffer.host[copied:end]
        copied = end
    return source


def _holds(obj: LocalObject, array: np.ndarray[Any, Any]) -> bool:
    """Whether ``obj``'s bytes are ``array``'s memory (a copy received into it)."""
    held = obj.buffer.array
    same_bytes = isinstance(held, np.ndarray) and held.nbytes == array.nbytes
    return same_bytes and held.ctypes.data == array.ctypes.data


def _fits(array: np.ndarray[Any, Any], meta: tuple[str, tuple[int, ...]]) -> bool:
    """Whether ``array`` has the dtype and shape ``meta`` (wire dtype, shape) describes."""
    return tuple(array.shape) == meta[1] and np.dtype(array.dtype) == dtype_from_wire(meta[0])


def _lookup_error(oid: ObjectID, reply: p.LookupReply) -> HopliteError:
    """The error a lookup of ``oid`` answered with (status ``"error"``)."""
    culprit = reply.error_object_id.hex() if reply.error_object_id else None
    return from_kind(
        reply.error_kind, reply.error, object_id=culprit, reduction_id=oid.hex(), cause=reply.error
    )


@dataclass(slots=True)
class First:
    """The answer to a get's first lookup, made from the caller's thread
    (:meth:`Fetcher.ask_on_channel`): the reply, the directory's generation then, the get's
    deadline, and the object itself for an inline answer."""

    reply: p.LookupReply
    generation: int
    deadline: float | None
    inline: LocalObject | None = None


class Fetcher:
    """The get side of a node.

    Args:
        store: The node's local store (and through it the node's memory).
        data: The node's data plane (pulls).
        config: Limits and timeouts.
        session: The node's directory link.
        shared_memory: Whether this node may map same-host segments.
        computes: Whether a reduce vertex on this node computes an object (its output).
    """

    def __init__(
        self,
        store: LocalStore,
        data: DataPlane,
        config: Config,
        session: DirectorySession,
        shared_memory: bool,
        computes: Callable[[ObjectID], bool],
    ) -> None:
        self._store = store
        self._config = config
        self._session = session
        self._shm = shared_memory
        ctx = sources.Context(
            store, data, config, session.send, self.completed, self.abandon, computes, self._new_copy
        )
        self._inline = sources.InlineSource(ctx)
        self._local = sources.LocalSource(ctx)
        self._mapped = sources.SharedMemorySource(ctx)
        self._device = sources.DeviceIpcSource(ctx)
        self._pull = sources.PullSource(ctx)

    def abort(self, transfer_id: int, error: HopliteError) -> None:
        """The directory says a transfer's sender died: stop pulling from it."""
        self._pull.abort(transfer_id, error)

    def at_hand(self, oid: ObjectID) -> LocalObject | None:
        """What a ``get`` can deliver from the caller's thread, with no lookup and no hop to the
        I/O thread: a complete copy this node holds (the I/O thread would hand back the same object),
        or one another process on this host put and indexed (:meth:`indexed`); None
        when there is neither (then ask the directory). Called from the caller's thread."""
        held = self._store.get(oid)
        if held is not None and held.complete:
            return held
        return self.indexed(oid)

    def indexed(self, oid: ObjectID) -> LocalObject | None:
        """A device object another process on this host put, found through its index link and
        open in place (a lent copy, as :meth:`get` with ``lend`` returns; close its buffer's lease
        once read), with no lookup and no hop to the I/O thread; None when there is none (or this
        node holds the object, or this process works with no device memory yet): then ask the
        directory. Called from the caller's thread."""
        if self._store.get(oid) is not None:
            return None
        found = self._store.memory.open_indexed(oid.binary())
        if found is None:
            return None
        buffer, record = found
        try:
            dtype, shape = sources.check_meta(oid, record.dtype, record.shape, record.nbytes, "ticket")
        except HopliteError:
            buffer.close_lease()
            return None
        return LocalObject(
            oid, record.nbytes, dtype, shape, b"", buffer, progress=record.nbytes, memory=MEMORY_DEVICE
        )

    def ask_on_channel(
        self, oid: ObjectID, timeout: float | None, route: sources.Route, channels: Channels
    ) -> First | None:
        """The first lookup of a ``get``, made from the caller's thread on its channel
        (:mod:`.channel`); None where it cannot be (no channel, or a copy is here): then
        :meth:`get` makes it. Raises what a timeout or an error answer means, as :meth:`get` does.
        An inline answer's object is built here, outside the store (nothing but this caller reads
        it); any other answer is for :meth:`get` to carry out (``first``)."""
        if not channels.usable() or self._store.get(oid) is not None:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        guard = None if timeout is None else timeout + self._config.request_timeout
        same_host = self._shm
        request = functools.partial(
            p.LookupRequest,
            object_id=oid.binary(),
            timeout=p.wire_timeout(timeout),
            shared_memory=same_host,
            direct=route.direct,
            via=route.via,
            device_ipc=same_host and device_in_use(),
            keep=False,  # an inline answer goes to this caller only (see below)
        )
        try:
            reply = channels.ask(lambda rid: request(request_id=rid), guard)
        except ChannelLost:
            return None
        generation = self._session.generation
        if not isinstance(reply, p.LookupReply):
            raise ProtocolError(f"unexpected reply to lookup: {reply.TYPE}")
        if reply.status == "timeout":
            raise sources.Attempt(oid, timeout, None).timed_out(reply.error)
        if reply.status == "error":
            raise _lookup_error(oid, reply)
        first = First(reply, generation, deadline)
        if reply.status == "inline":
            first.inline = sources.inline_object(oid, reply)
        return first

    def _discard(self, reply: p.LookupReply) -> None:
        """An answer not used (its copy was dropped, or one appeared here meanwhile): end the
        transfer it began, if any."""
        if reply.transfer_id:
            self._session.send(p.TransferDone(transfer_id=reply.transfer_id, ok=False, progress=0))

    async def get(
        self,
        oid: ObjectID,
        timeout: float | None,
        started: asyncio.Future[LocalObject] | None = None,
        route: sources.Route = sources.ANY_SOURCE,
        lend: bool = False,
        into: np.ndarray[Any, Any] | None = None,
        first: First | None = None,
    ) -> LocalObject:
        """Fetch ``oid`` into the local store; ``started`` (if given) is resolved with the local
        object as soon as it exists, while it is still filling; ``first``: the answer to the first
        lookup, made already (:meth:`ask_on_channel`).

        ``lend``: the caller reads the object once and lets go (a ``get`` copying it into the
        array it returns), so a device copy of another process on this host may be returned
        open in place, outside the store: close its buffer's lease once read. ``into``: a copy
        pulled over the data plane is received straight into this array (see :meth:`get_into`).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if first is not None:
            deadline = first.deadline
        vanished = 0
        while True:
            attempt = sources.Attempt(
                oid, timeout, deadline, started=started, lend=lend, route=route, into=into
            )
            try:
                return await self._fetch(attempt, first)
            except sources.Vanished as exc:
                first = None
                vanished += 1
                if vanished >= sources.MAX_FRUITLESS_PULLS:
                    raise ObjectNotFoundError(str(exc), object_id=oid.hex()) from None
                log.debug("%s; asking again", exc)
            except ObjectReset:
                first = None
                log.debug("partial copy of %s was reset (its reduction is rebuilt); starting again", oid)
            except BaseException as exc:
                self._give_up(attempt, exc)
                raise

    def _give_up(self, attempt: sources.Attempt, exc: BaseException) -> None:
        """A get that failed or was cancelled gives up the copy it made and did not fill: left in
        the store it would hold its memory (the caller's array, for :meth:`get_into`) for good.
        A lookup that timed out, or one cancelled, left such a copy."""
        local = attempt.local
        if local is not None and not local.complete and self._store.get(local.object_id) is local:
            oid = local.object_id
            error = (
                exc if isinstance(exc, HopliteError) else ObjectReset(f"the get filling {oid} was cancelled")
            )
            self.abandon(local, 0, error)

    async def get_into(
        self,
        oid: ObjectID,
        timeout: float | None,
        out: np.ndarray[Any, Any],
        route: sources.Route,
        received: list[LocalObject] | None = None,
        first: First | None = None,
    ) -> Any:
        """:meth:`get` into a NumPy ``out``, copying the bytes into it as they arrive rather than
        all at the end (for a large object the last copy would otherwise add to its latency).

        With ``received``, a copy pulled over the data plane is received straight into ``out``
        (no copy of the store's) and appended to ``received``: it stays in the store, served to
        other readers, until the caller withdraws it (it must, before ``out`` changes)."""
        started: asyncio.Future[LocalObject] = asyncio.get_running_loop().create_future()
        into = None if received is None else out
        fetch = asyncio.ensure_future(
            self.get(oid, timeout, started=started, route=route, into=into, first=first)
        )
        follower: asyncio.Future[LocalObject] | None = None
        try:
            await asyncio.wait([fetch, started], return_when=asyncio.FIRST_COMPLETED)
            if started.done() and not fetch.done():
                source = started.result()
                dtype = dtype_from_wire(source.dtype)
                same = tuple(out.shape) == tuple(source.shape) and np.dtype(out.dtype) == dtype
                if same and not source.buffer.on_device and not _holds(source, out):
                    follower = asyncio.ensure_future(_follow(source, out.reshape(-1).view(np.uint8)))
            obj = await fetch
            if received is not None and _holds(obj, out):
                received.append(obj)
                return out  # received in place
            if follower is not None and started.result() is obj:
                # obj is complete: the follower copies what is left at once (or failed earlier, if
                # the copy was reset; obj is then another object, copied whole below)
                with contextlib.suppress(HopliteError):
                    if await follower is obj:
                        return out  # every byte was copied as it came
        except BaseException:
            if received is not None:
                await self._settle_into(oid, fetch, out, received)
            raise
        finally:
            fetch.cancel()
            if follower is not None and not follower.done():
                follower.cancel()
        return obj.deliver(CallerArray.of(out))

    async def _settle_into(
        self, oid: ObjectID, fetch: asyncio.Future[LocalObject], out: Any, received: list[LocalObject]
    ) -> None:
        """:meth:`get_into` failed or was cancelled: end its ``fetch`` (a partial copy leaves the
        store) and add to ``received`` a copy of ``oid`` still held in ``out`` (one completed just
        as the call ended), so that the caller's withdrawal covers it."""
        fetch.cancel()
        await asyncio.wait([fetch], timeout=self._config.stall_timeout)
        obj = self._store.get(oid)
        if obj is not None and _holds(obj, out) and obj not in received:
            received.append(obj)

    async def _fetch(self, attempt: sources.Attempt, first: First | None = None) -> LocalObject:
        """One attempt of :meth:`get` (raises :class:`ObjectReset` if its copy was voided): a
        lookup (the ``first`` made already, if given), the source it names, again until one
        fills the copy."""
        local = self._store.get(attempt.object_id)
        if local is not None and first is not None:
            self._discard(first.reply)  # a copy appeared since it was asked for: use that
            first = None
        if local is not None and (local.progress < local.size or local.complete):
            # Complete, or another get in this process (or a reduce vertex here, or a put still
            # copying) is filling it: wait for that.
            return await self._filled(local, attempt, theirs=True)
        attempt.local = local
        while True:
            if first is not None:
                reply, generation, first = first.reply, first.generation, None
            else:
                reply, generation = await self._lookup(attempt)
            source = self._source_for(reply, attempt)
            obj = None if source is None else await source.fill(reply, attempt, generation)
            if obj is not None:
                return await self._filled(obj, attempt)
            if attempt.local is None:
                # With a copy of its own, the next lookup asks for a data-plane source to fill it.
                self._new_copy(attempt, reply)

    async def _lookup(self, attempt: sources.Attempt) -> tuple[p.LookupReply, int]:
        """Ask the directory where the object is; its reply (raised if it is an error, a timeout,
        or the copy being filled was dropped meanwhile) and the directory's generation then."""
        oid, local = attempt.object_id, attempt.local
        left = attempt.remaining()
        if left is not None and left <= 0:
            raise attempt.timed_out()
        have = local.progress if local is not None else 0
        same_host = self._shm and local is None
        # Same-host device copies are opened (CUDA IPC) once this process works with device
        # memory; until then it receives them like host objects.
        device_ipc = same_host and device_in_use()
        # ``local`` exists only after an answer of this get, so the object was known then.
        resume = local is not None
        reply = await self._session.lookup(oid, left, have, same_host, attempt.route, device_ipc, resume)
        generation = self._session.generation  # a copy finished under a later one is restored
        if local is not None and local.error is not None:
            # Dropped while we asked (lost, deleted, or reset): this answer is for void bytes.
            self._discard(reply)
            if isinstance(local.error, ObjectReset) and reply.status == "error":
                # Reset by a repair, then failed or deleted: starting again would wait for an
                # object that will never come.
                raise _lookup_error(oid, reply)
            raise local.error
        if reply.status in ("timeout", "error"):
            error = attempt.timed_out(reply.error) if reply.status == "timeout" else _lookup_error(oid, reply)
            if local is not None:
                self.abandon(local, 0, error)
            raise error
        return reply, generation

    def _source_for(self, reply: p.LookupReply, attempt: sources.Attempt) -> sources.Source | None:
        """The source a lookup's reply names (None: none for this attempt, ask again)."""
        if reply.status == "inline":
            return self._inline
        if reply.status == "local" or (attempt.local is None and attempt.object_id in self._store):
            return self._local  # here, or it appeared while we asked (a vertex placed here computes it)
        if reply.status == "shm":
            if attempt.local is not None:
                return None  # a same-host copy is for a reader without one: ask for a data-plane source
            return self._device if self._store.memory.is_device_ticket(reply.segment) else self._mapped
        return self._pull

    async def _filled(self, obj: LocalObject, attempt: sources.Attempt, theirs: bool = False) -> LocalObject:
        """``obj`` once complete (a copy this node is still filling: another get, a vertex, a put).
        ``theirs``: another call fills it; where that call gave up on its own terms (its timeout,
        a transfer failing past its deadline) this one, with time left, starts again
        (:class:`ObjectReset`) rather than fail with that call's error."""
        try:
            await obj.wait_progress(obj.size, attempt.remaining())
        except (HopliteTimeoutError, TransportError) as exc:
            left = attempt.remaining()
            if theirs and obj.error is exc and (left is None or left > 0):
                raise ObjectReset(f"the call filling {attempt.object_id} gave up: {exc}") from None
            if isinstance(exc, TransportError):
                raise
            raise attempt.timed_out(
                f"this node is still filling it (another get or a reduce here), {obj.progress} of "
                f"{obj.size} bytes so far"
            ) from None
        return obj

    def _new_copy(self, attempt: sources.Attempt, reply: p.LookupReply) -> LocalObject:
        """A new local copy for this attempt to fill over the data plane (``attempt.local``), in
        the store while it fills (and handed to ``attempt.started``)."""
        oid = attempt.object_id
        meta = sources.checked_meta(oid, reply)
        if reply.size > self._config.max_object_bytes:
            raise ObjectTooLargeError(
                f"object {oid} of {reply.size} bytes exceeds Config.max_object_bytes",
                size=reply.size,
                limit=self._config.max_object_bytes,
            )
        self._store.reserve(reply.size)
        memory = self._store.memory
        if reply.memory == MEMORY_DEVICE and device_in_use():
            # A device object is received into this process's device memory, chunk by chunk as
            # it lands (see DataPlane.pull): readers here then copy device to device, and
            # same-host processes open it through CUDA IPC once it is complete.
            buffer = memory.device(reply.size)
        elif attempt.into is not None and _fits(attempt.into, meta):
            buffer = Buffer.wrap(attempt.into.reshape(-1).view(np.uint8))  # the caller's array
        else:
            buffer = memory.host(reply.size, populate=False)  # the data plane fills it whole
        local = attempt.local = self._store.add(sources.from_reply(oid, reply, meta, buffer, progress=0))
        if attempt.started is not None and not attempt.started.done():
            attempt.started.set_result(local)
        return local

    # ------------------------------------------------------------ reports (see sources.Context)
    def completed(self, local: LocalObject, generation: int, transfer_id: int) -> None:
        """Tell the directory about a complete copy this node now holds: the transfer that
        filled it, or a copy added (a mapping); restored instead if the directory restarted since
        ``generation``."""
        if INJECTOR.armed:
            INJECTOR.check("report", local.object_id.hex(), local.size, local.size)
        if generation != self._session.generation:
            self.restore(local)  # the directory restarted meanwhile: it never heard of the copy
        elif transfer_id:
            self._session.send(
                p.TransferDone(
                    transfer_id=transfer_id, ok=True, progress=local.size, segment=self._publish(local)
                )
            )
        else:
            self._session.send(p.CopyAdded(object_id=local.object_id.binary(), segment=self._publish(local)))

    def abandon(self, local: LocalObject, transfer_id: int, exc: HopliteError) -> None:
        """Give up a partial copy (and the transfer filling it, if any)."""
        if transfer_id:
            # None of its bytes stay here (the copy leaves the store), whatever had landed: with
            # them on record the directory would keep this node as a partial holder and offer it
            # to readers (a vertex letting go of a child whose last bytes were still being acked
            # left one such stale holder every time).
            self._session.send(p.TransferDone(transfer_id=transfer_id, ok=False, progress=0, reason=str(exc)))
        if self._store.get(local.object_id) is local:
            self._store.remove(local.object_id, exc)

    def restore(self, obj: LocalObject) -> None:
        """Tell a restarted directory about a complete copy this node holds."""
        inline = obj.buffer.to_host().tobytes() if obj.size <= self._session.inline_threshold_bytes else None
        self._session.send(
            p.Restore(
                object_id=obj.object_id.binary(),
                size=obj.size,
                dtype=obj.dtype,
                shape=list(obj.shape),
                digest=obj.digest,
                owner=obj.owner,
                inline=inline,
                segment=self._publish(obj),
                memory=obj.memory,
            )
        )

    def _publish(self, obj: LocalObject) -> str:
        """Publish a complete copy for same-host readers; the name they open, or ""."""
        return self._store.memory.publish(obj.buffer, obj.object_id.binary(), obj.dtype, obj.shape)
