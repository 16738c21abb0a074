"""How an object's bytes arrive at a node: one class per way in, chosen by the directory's reply.

A ``get`` asks the directory where the object is (:meth:`~hoplite_gpu.node.fetch.Fetcher.get`); the
reply's status picks the source that fills the local copy:

* ``inline``: small objects come with the reply (:class:`InlineSource`);
* ``local``: this node holds it, or a reduce vertex here computes it (:class:`LocalSource`, also for
  a copy that appeared here while the lookup was on its way);
* ``shm``: a complete copy in a shared-memory segment on this host is mapped, not copied
  (:class:`SharedMemorySource`); a device copy on this host is opened through its ticket and
  copied device to device (:class:`DeviceIpcSource`);
* ``pull``: the bytes stream over the data plane from the node the directory chose, possibly a
  node still receiving them itself (:class:`PullSource`).

A source's :meth:`Source.fill` returns the local object (complete, or being completed by someone
else on this node), or None to ask the directory for another source; a copy voided by a reduce
tree's repair raises :class:`~hoplite_gpu.errors.ObjectReset`. Memory comes from the node's
:class:`~hoplite_gpu.memory.Memory`. A new way in is a new class here, not a branch in the node.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
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
    AuthenticationError,
    HopliteError,
    HopliteTimeoutError,
    ObjectNotFoundError,
    ObjectReset,
    ProtocolError,
    TransportError,
)
from ..iothread import bounded
from ..memory import Buffer, LocalObject, LocalStore, digest_of
from ..object_id import ObjectID

log = logging.getLogger("hoplite_gpu")

#: Consecutive failed pulls without any new byte received before ``get`` gives up.
MAX_FRUITLESS_PULLS = 8


class Vanished(ObjectReset):
    """The copy the directory said this node holds or computes is not here: a reduce vertex's
    output voided as the node rejoined a restarted directory (which then places the vertex again),
    or dropped as the answer came. The get asks again, at most :data:`MAX_FRUITLESS_PULLS` times
    in a row, then raises :class:`ObjectNotFoundError`."""


@dataclass(frozen=True, slots=True)
class Route:
    """Which copy a get asks the directory for: ``direct``, the owner's; ``via``, the copy of
    this other object's owner (see ``LookupRequest``); neither, any (the chain of readers)."""

    direct: bool = False
    via: bytes = b""


#: A get's route where the caller names none.
ANY_SOURCE = Route()


@dataclass(slots=True)
class Attempt:
    """One ``get``: its object, its deadline, the partial copy it fills (``local``, once it has
    one) and how many pulls in a row brought nothing. ``started`` is resolved with the partial copy
    as soon as it exists; ``lend``: a same-host device copy may be returned open in place, outside
    the store (see :meth:`DeviceIpcSource.lend`); ``route``: which copy to ask for; ``into``: a
    caller's NumPy array a new copy is received into (where its dtype and shape are the object's).
    """

    object_id: ObjectID
    timeout: float | None
    deadline: float | None
    fruitless: int = 0
    local: LocalObject | None = None
    started: asyncio.Future[LocalObject] | None = None
    lend: bool = False
    route: Route = ANY_SOURCE
    into: np.ndarray[Any, Any] | None = None

    def remaining(self) -> float | None:
        """Seconds left (None: no deadline)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def timed_out(self, why: str = "") -> HopliteTimeoutError:
        """The error of a get that ran out of time (``why``: the directory's account of where
        the object is, naming the nodes concerned)."""
        return HopliteTimeoutError(
            f"object {self.object_id} was not available within {self.timeout} s"
            + (f": {why}" if why else ""),
            operation="get",
            timeout=self.timeout,
            object_id=self.object_id.hex(),
        )


def checked_meta(oid: ObjectID, reply: p.LookupReply) -> tuple[str, tuple[int, ...]]:
    """The dtype (wire form) and shape a lookup reply gives, checked against its size."""
    return check_meta(oid, reply.dtype, reply.shape, reply.size, "directory")


def check_meta(oid: ObjectID, dtype: str, shape: Any, size: int, source: str) -> tuple[str, tuple[int, ...]]:
    """``dtype`` (wire form) and ``shape`` of ``oid`` as ``source`` gave them, checked against its
    ``size``: raises :class:`InvalidArgumentError` for a dtype that is not one,
    :class:`ProtocolError` where they do not add up to ``size``."""
    dims = tuple(int(s) for s in shape)
    if math.prod(dims) * dtype_from_wire(dtype).itemsize != size:
        raise ProtocolError(f"{source} metadata of {oid} is inconsistent", object_id=oid.hex())
    return dtype, dims


def from_reply(
    oid: ObjectID, reply: p.LookupReply, meta: tuple[str, tuple[int, ...]], buffer: Buffer, *, progress: int
) -> LocalObject:
    """The local object of ``oid`` as a lookup ``reply`` describes it (``meta``: its dtype and shape
    from :func:`checked_meta`), holding ``buffer`` with ``progress`` bytes present."""
    dtype, shape = meta
    return LocalObject(
        oid,
        reply.size,
        dtype,
        shape,
        reply.digest,
        buffer,
        progress=progress,
        reduction=reply.reduction_id,
        memory=reply.memory,
    )


@dataclass(slots=True)
class Context:
    """What sources use of their node.

    ``completed(local, generation, transfer_id)`` tells the directory that ``local`` is complete
    (a fresh copy from a transfer, or ``transfer_id`` 0 for a mapping), or restores it if the
    directory restarted since ``generation``; ``abandon(local, transfer_id, error)`` gives up a
    partial copy; ``computes(oid)``: whether a reduce vertex on this node computes ``oid``;
    ``new_copy(attempt, reply)``: a new partial copy for ``attempt`` to fill, as ``reply``
    describes the object (``attempt.local`` from then on).
    """

    store: LocalStore
    data: DataPlane
    config: Config
    report: Callable[[p.Message], None]
    completed: Callable[[LocalObject, int, int], None]
    abandon: Callable[[LocalObject, int, HopliteError], None]
    computes: Callable[[ObjectID], bool]
    new_copy: Callable[[Attempt, p.LookupReply], LocalObject]


class Source(abc.ABC):
    """One way for an object's bytes to arrive."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    @abc.abstractmethod
    async def fill(self, reply: p.LookupReply, attempt: Attempt, generation: int) -> LocalObject | None:
        """Fill the local copy (``attempt.local``: the partial copy so far, if any) as ``reply``
        says.

        Returns the local object, or None to ask the directory for another source.
        """


def inline_object(oid: ObjectID, reply: p.LookupReply) -> LocalObject:
    """The object an inline reply carries (a copy of its bytes), checked against its metadata."""
    meta = checked_meta(oid, reply)
    if reply.inline is None:
        raise ProtocolError(f"inline reply for {oid} without data", object_id=oid.hex())
    data = np.frombuffer(reply.inline, np.uint8).copy()
    if data.size != reply.size:
        raise ProtocolError(f"inline data of {oid} has the wrong size", object_id=oid.hex())
    return from_reply(oid, reply, meta, Buffer.wrap(data), progress=reply.size)


class InlineSource(Source):
    """The bytes came with the directory's reply."""

    async def fill(self, reply: p.LookupReply, attempt: Attempt, generation: int) -> LocalObject | None:
        obj = inline_object(attempt.object_id, reply)
        existing = self.ctx.store.get(attempt.object_id)
        return existing if existing is not None else self.ctx.store.add(obj)


class LocalSource(Source):
    """The directory says this node holds the object, or a copy appeared here while the lookup was
    on its way (a reduce vertex placed here computes it): wait for that copy rather than fetch a
    second one."""

    async def fill(self, reply: p.LookupReply, attempt: Attempt, generation: int) -> LocalObject | None:
        oid = attempt.object_id
        existing = self.ctx.store.get(oid)
        if reply.status != "local":  # appeared meanwhile: the transfer the reply set up is not used
            if reply.transfer_id:
                self.ctx.report(p.TransferDone(transfer_id=reply.transfer_id, ok=False, progress=0))
            return existing
        if existing is None and self.ctx.computes(oid):
            # A vertex placed here just now is still setting its output up.
            left = attempt.remaining()
            wait = self.ctx.config.request_timeout if left is None else left
            existing = await self.ctx.store.wait_for(oid, wait, coming=True)
        if existing is not None and existing.error is None:
            return existing  # complete, or a reduce vertex here computes it
        raise Vanished(f"object {oid} vanished from this node", object_id=oid.hex())


class SharedMemorySource(Source):
    """A same-host holder's segment, mapped read-only as this node's complete copy (no bytes
    copied; see :meth:`Memory.open_segment <hoplite_gpu.memory.Memory.open_segment>`). None if the
    segment changed or vanished."""

    async def fill(self, reply: p.LookupReply, attempt: Attempt, generation: int) -> LocalObject | None:
        oid = attempt.object_id
        meta = checked_meta(oid, reply)
        mapped = await self.ctx.store.memory.open_segment(reply.segment, oid.binary(), reply.size)
        if mapped is None:
            log.debug("segment of %s from %s is gone; pulling instead", oid, reply.sender_node[:8])
            return None
        if self.ctx.config.verify_digest and reply.digest and digest_of(mapped.host) != reply.digest:
            log.warning("shared-memory segment of %s did not match its digest", oid)
            return None
        existing = self.ctx.store.get(oid)
        if existing is not None:  # arrived meanwhile (a vertex here, another get): use that
            return existing
        obj = self.ctx.store.add(from_reply(oid, reply, meta, mapped, progress=reply.size))
        self.ctx.completed(obj, generation, 0)
        return obj


class DeviceIpcSource(Source):
    """A same-host holder's device memory, opened through its ticket (:mod:`hoplite_gpu.memory.ipc`):
    lent to a ``get`` that copies it into the array it returns (``attempt.lend``), else copied
    device to device into a store copy of this node's own (exported in turn, and reported, so it
    serves later readers). None if the ticket is gone or its memory does not open here."""

    async def fill(self, reply: p.LookupReply, attempt: Attempt, generation: int) -> LocalObject | None:
        oid = attempt.object_id
        lent = self.lend(reply, attempt)
        if lent is None or lent.buffer.lease is None or attempt.lend:
            return lent
        memory = self.ctx.store.memory
        try:
            existing = self.ctx.store.get(oid)
            if existing is not None:  # arrived meanwhile (a vertex here, another get): use that
                return existing
            self.ctx.store.reserve(reply.size)
            buffer = memory.device(reply.size)
            try:
                lent.buffer.backend.copy(buffer.array, lent.buffer.array)
            except BaseException:
                memory.release(buffer)
                raise
        finally:
            lent.buffer.close_lease()
        obj = from_reply(oid, reply, (lent.dtype, lent.shape), buffer, progress=reply.size)
        self.ctx.store.add(obj)
        self.ctx.completed(obj, generation, 0)
        return obj

    def lend(self, reply: p.LookupReply, attempt: Attempt) -> LocalObject | None:
        """The holder's memory itself, open for one reader (a ``get`` that copies it into the array
        it returns: one device copy in all): a complete object outside the store, whose buffer's
        :attr:`~hoplite_gpu.memory.Buffer.lease` the caller closes once it has read it. None if it
        does not open here."""
        oid = attempt.object_id
        meta = checked_meta(oid, reply)
        opened = self.ctx.store.memory.open_device(reply.segment, oid.binary(), reply.size)
        if opened is None:
            log.debug("device memory of %s at %s does not open here; pulling", oid, reply.sender_node[:8])
            return None
        return from_reply(oid, reply, meta, opened, progress=reply.size)


class PullSource(Source):
    """A stream over the data plane from the node the directory chose (complete or partial).

    ``aborts`` holds the running pulls by transfer id: the directory's AbortTransfer (the sender
    died) fails the one it names.
    """

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.aborts: dict[int, asyncio.Future[None]] = {}

    def abort(self, transfer_id: int, error: HopliteError) -> None:
        """Fail the running pull ``transfer_id`` with ``error`` (if it still runs)."""
        abort = self.aborts.get(transfer_id)
        if abort is not None and not abort.done():
            abort.set_exception(error)

    async def fill(self, reply: p.LookupReply, attempt: Attempt, generation: int) -> LocalObject | None:
        local = attempt.local or self.ctx.new_copy(attempt, reply)
        oid = attempt.object_id
        before = local.progress
        try:
            abort: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.aborts[reply.transfer_id] = abort
            pull = self.ctx.data.pull(reply.sender_host, reply.sender_port, local, reply.transfer_id, abort)
            try:
                await bounded(pull, attempt.remaining())
            except asyncio.TimeoutError:
                sender = reply.sender_node[:8] if reply.sender_node else "?"
                raise attempt.timed_out(
                    f"still receiving it from node {sender} at {reply.sender_host}:{reply.sender_port} "
                    f"({'complete there' if reply.sender_complete else 'itself still receiving it'}), "
                    f"{local.progress} of {local.size} bytes so far"
                ) from None
            finally:
                del self.aborts[reply.transfer_id]
                if not abort.cancel() and not abort.cancelled():
                    abort.exception()  # the pull raised it (or finished first): retrieved
            if self.ctx.config.verify_digest and local.digest and local.buffer.digest() != local.digest:
                raise TransportError(
                    f"object {oid} arrived corrupted (digest mismatch)", peer="", cause="digest"
                )
        except (TransportError, ObjectNotFoundError, AuthenticationError) as exc:
            # A peer admitted by our directory that hangs up mid-handshake has most likely died
            # (a wrong proof is definitive); that is retried like any lost sender.
            refused = isinstance(exc, AuthenticationError) and exc.fields.get("cause") != "closed"
            if refused or (attempt.deadline is not None and time.monotonic() >= attempt.deadline):
                self.ctx.abandon(local, reply.transfer_id, exc)
                raise
            self.ctx.report(
                p.TransferDone(
                    transfer_id=reply.transfer_id,
                    ok=False,
                    progress=local.progress,
                    reason=str(exc),
                    sender_failed=not isinstance(exc, ObjectNotFoundError),
                    sender_lacks=isinstance(exc, ObjectNotFoundError),
                )
            )
            attempt.fruitless = 0 if local.progress > before else attempt.fruitless + 1
            if attempt.fruitless >= MAX_FRUITLESS_PULLS:
                self.ctx.abandon(local, 0, exc)
                raise
            # A copy deleted just as the directory chose it is routine; a lost peer is news.
            log.log(
                logging.DEBUG if isinstance(exc, ObjectNotFoundError) else logging.INFO,
                "pull of %s from %s failed (%s); asking for another source",
                oid,
                reply.sender_node[:8],
                exc,
            )
            return None
        except BaseException as exc:
            # A get cancelled under its pull: another get waiting on this copy starts again
            # (ObjectReset) rather than failing with this one's cancellation.
            voided = (
                exc if isinstance(exc, HopliteError) else ObjectReset(f"the get filling {oid} was cancelled")
            )
            self.ctx.abandon(local, reply.transfer_id, voided)
            raise
        if local.error is not None:
            raise local.error
        self.ctx.completed(local, generation, reply.transfer_id)
        return local
