"""One reduce-tree vertex, executed on the node the directory placed it on.

The directory's :class:`~hoplite_gpu.protocol.ReduceTask` names the vertex's input (held by this
node), its output (a new object in the local store) and its children's outputs (objects streamed
from wherever they are; a child not placed yet is announced later by
:class:`~hoplite_gpu.protocol.ReduceChild`). :func:`reduce_stream` reduces chunk by chunk as the
input and every child have the chunk, and advances the output's progress after each, so the
parent (or a ``get`` of the result) streams reduced chunks while later ones are still arriving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import ipc
from . import protocol as p
from .buffers import Buffer, dtype_from_wire
from .errors import HopliteError, ObjectDeletedError, ObjectLostError, ObjectNotFoundError, TransportError
from .faults import INJECTOR
from .object_id import ObjectID
from .reduce_ops import ReduceOp, as_op, reduce_chunk, weighted_sum_chunk
from .store import LocalObject, LocalStore

log = logging.getLogger("hoplite_gpu")


class ObjectReset(HopliteError):
    """A partial copy of a reduction's result was voided (the tree is being rebuilt after a
    failure); a get of it starts again from byte 0. Never raised to callers."""


#: Errors of a vertex's sources after which the directory rebuilds the tree instead of failing it.
#: (ObjectDeletedError: a copy of a source shared with a vertex of the tree being replaced was dropped.)
RETRY_VERTEX = (TransportError, ObjectLostError, ObjectReset, ObjectDeletedError)


class VertexRunner:
    """Runs the reduce-tree vertices the directory places on one node (on its event loop).

    Args:
        store: The node's local store (inputs are found, outputs written there).
        fetch: ``fetch(oid, started)`` gets another node's object into the store, resolving
            ``started`` with the local copy as soon as it exists (still filling).
        allocate: A store buffer of the given size.
        report: Sends a message to the directory (best effort).
        publish: Publishes a complete output in its shared-memory segment; the segment's name.
        drop_copy: Deletes a copy fetched only for vertices (in the background).
        chunk_bytes: Bytes reduced per step.
    """

    def __init__(
        self,
        store: LocalStore,
        fetch: Callable[[ObjectID, asyncio.Future[LocalObject]], Awaitable[LocalObject]],
        allocate: Callable[[int], Awaitable[np.ndarray[Any, Any]]],
        report: Callable[[p.Message], None],
        publish: Callable[[LocalObject], str],
        drop_copy: Callable[[ObjectID], None],
        chunk_bytes: int,
    ) -> None:
        self.store = store
        self._fetch = fetch
        self._allocate = allocate
        self._report = report
        self._publish = publish
        self._drop_copy = drop_copy
        self.chunk_bytes = chunk_bytes
        self._runs: dict[tuple[bytes, int, int], VertexRun] = {}
        # Copies fetched only for reduce vertices, with how many running vertices use each.
        self._fetched: dict[ObjectID, Fetch] = {}

    def start(self, task: p.ReduceTask) -> None:
        """Run the vertex ``task`` describes."""
        run = VertexRun(task)
        self._runs[run.key] = run
        run.runner = asyncio.ensure_future(self._run(run))
        run.runner.add_done_callback(
            lambda _: self._runs.pop(run.key) if self._runs.get(run.key) is run else None
        )

    def set_child(self, msg: p.ReduceChild) -> None:
        """A child of a running vertex was placed."""
        found = self._runs.get((msg.reduction_id, msg.epoch, msg.vertex))
        if found is not None:
            found.set_child(msg.index, msg.object_id, msg.weight)

    def set_weights(self, msg: p.ReduceWeights) -> None:
        """The weights of a running vertex that waited for them."""
        found = self._runs.get((msg.reduction_id, msg.epoch, msg.vertex))
        if found is not None:
            found.set_weights(msg.weights)

    def computes(self, oid: ObjectID) -> bool:
        """Whether a running vertex here writes ``oid``."""
        return any(r.output_id == oid for r in self._runs.values())

    def cancel(self, oid: ObjectID | None = None) -> None:
        """Stop the vertices writing ``oid`` (every vertex if None)."""
        for run in list(self._runs.values()):
            if oid is None or run.output_id == oid:
                run.cancel()
        if oid is None:
            self._runs.clear()

    async def _run(self, run: VertexRun) -> None:
        """Execute a :class:`~hoplite_gpu.protocol.ReduceTask` and report how it went."""
        task = run.task
        out: LocalObject | None = None
        try:
            own = self.store.get(ObjectID(task.input_id))
            if own is None:
                raise ObjectNotFoundError(
                    f"input {task.input_id.hex()} of reduction {task.reduction_id.hex()} is no longer "
                    "on this node",
                    object_id=task.input_id.hex(),
                )
            # Children start streaming while the output buffer is being set up.
            streams = asyncio.gather(*(self._stream_child(run, i) for i in range(len(task.children))))
            try:
                stale = self.store.get(run.output_id)
                if stale is not None and stale.complete and not stale.owner:
                    self.store.remove(run.output_id)  # the result of a tree rebuilt since
                self.store.reserve(task.size)
                ticket = None
                if own.buffer.on_device:  # reduced where the input is, by the device's kernels
                    data, ticket = ipc.allocate(
                        own.buffer.backend, task.size, own.buffer.device or 0, self.store.shares
                    )
                    buffer = Buffer.wrap(data)
                else:
                    buffer = Buffer.wrap(await self._allocate(task.size), pooled=True)
                out = LocalObject(
                    run.output_id,
                    task.size,
                    task.dtype,
                    tuple(task.shape),
                    b"",
                    buffer,
                    reduction=task.reduction_id,
                    memory=task.memory,
                    ticket=ticket,
                )
                self.store.add(out)
                children = await streams
                if task.await_weights:
                    # Chosen once the reduction has all its inputs; the children stream meanwhile.
                    # No timeout: the directory cancels the vertex if the reduction fails.
                    await run.weights_chosen
            except BaseException:
                streams.cancel()
                raise
            await reduce_stream(task, own, list(children), out, self.chunk_bytes, run.weights)
            self._report(
                p.VertexDone(
                    reduction_id=task.reduction_id,
                    vertex=task.vertex,
                    ok=True,
                    segment=self._publish(out),
                    epoch=task.epoch,
                )
            )
        except asyncio.CancelledError:
            if out is not None and self.store.get(out.object_id) is out and not out.complete:
                self.store.remove(out.object_id)
            raise
        except HopliteError as exc:
            log.info("reduce vertex %d of %s failed: %s", task.vertex, task.reduction_id.hex()[:8], exc)
            self._report(
                p.VertexDone(
                    reduction_id=task.reduction_id,
                    vertex=task.vertex,
                    ok=False,
                    reason=str(exc),
                    epoch=task.epoch,
                    retry=isinstance(exc, RETRY_VERTEX),
                )
            )
            if out is not None and self.store.get(out.object_id) is out:
                error: HopliteError = exc
                if isinstance(exc, RETRY_VERTEX):
                    # The directory rebuilds the tree: a get here waiting for this output starts
                    # again (with the error itself it failed, 1 run in ~10 of a repair test).
                    error = ObjectReset(f"partial result voided: {exc}", object_id=out.object_id.hex())
                self.store.remove(out.object_id, error)
        finally:
            self._release_fetched(run)

    async def _stream_child(self, run: VertexRun, index: int) -> LocalObject:
        """The local object of a vertex's child: already here, or being fetched (still filling).

        A copy fetched for vertices is shared by every vertex on this node that needs it, and
        dropped when the last of them finishes (:meth:`_release_fetched`).
        """
        oid = await run.child(index)
        fetch = self._fetched.get(oid)
        if fetch is None:
            local = self.store.get(oid)
            if local is not None:
                return local  # this node's own object (or a vertex output computed here)
            started: asyncio.Future[LocalObject] = asyncio.get_running_loop().create_future()
            fetch = Fetch(asyncio.ensure_future(self._fetch(oid, started)), started)
            fetch.task.add_done_callback(fetch.failed)
            self._fetched[oid] = fetch
        fetch.users += 1
        run.fetches.append(oid)
        return await fetch.local()

    def _release_fetched(self, run: VertexRun) -> None:
        """A vertex stopped using the copies it fetched: drop (or stop fetching) those no other
        running vertex uses."""
        for oid in run.fetches:
            shared = self._fetched.get(oid)
            if shared is None:
                continue
            shared.users -= 1
            if shared.users > 0:
                continue
            del self._fetched[oid]
            fetch = shared.task
            if not fetch.done():
                fetch.cancel()
                partial = self.store.get(oid)
                if partial is not None and not partial.owner and not partial.complete:
                    # Now, not when the cancelled get unwinds: a vertex starting meanwhile (a
                    # rebuilt tree's) must fetch afresh, not adopt a copy about to be dropped.
                    self.store.remove(
                        oid, ObjectDeletedError(f"fetch of {oid} was stopped", object_id=oid.hex())
                    )
            elif not fetch.cancelled() and fetch.exception() is None:
                self._drop_copy(oid)
        run.fetches.clear()


class VertexRun:
    """Book-keeping of one running vertex: its task, its children's ids as they become known, and
    the copies it fetched (dropped once the vertex is done).

    Args:
        task: The directory's instruction.
    """

    def __init__(self, task: p.ReduceTask) -> None:
        self.task = task
        self.key = (task.reduction_id, task.epoch, task.vertex)
        self.output_id = ObjectID(task.output_id)
        loop = asyncio.get_running_loop()
        self._children: list[asyncio.Future[ObjectID]] = [loop.create_future() for _ in task.children]
        # A weighted SUM: the input's weight, then each child's (children placed later get theirs
        # from their ReduceChild); [] for an unweighted reduction.
        self.weights = list(task.weights) if len(task.weights) == 1 + len(task.children) else []
        self.weights_chosen: asyncio.Future[None] = loop.create_future()
        for index, oid in enumerate(task.children):
            if oid:
                self.set_child(index, oid, self.weights[index + 1] if self.weights else 1.0)
        self.runner: asyncio.Task[None] | None = None
        self.fetches: list[ObjectID] = []  # children this vertex uses through a :class:`Fetch`

    def set_child(self, index: int, object_id: bytes, weight: float = 1.0) -> None:
        """Child ``index`` is ``object_id``, scaled by ``weight`` in a weighted reduction (ignored
        if out of range or already known)."""
        if 0 <= index < len(self._children) and not self._children[index].done() and len(object_id) == 20:
            if self.weights and not self.weights_chosen.done():
                self.weights[index + 1] = weight
            self._children[index].set_result(ObjectID(object_id))

    def set_weights(self, weights: list[float]) -> None:
        """The weights chosen for a vertex whose task said ``await_weights`` (the input's, then
        each child's); ignored unless one per source."""
        if (
            self.task.await_weights
            and not self.weights_chosen.done()
            and len(weights) == 1 + len(self._children)
        ):
            self.weights = list(weights)
            self.weights_chosen.set_result(None)

    async def child(self, index: int) -> ObjectID:
        """The id of child ``index``, once the directory has placed it."""
        return await self._children[index]

    def cancel(self) -> None:
        """Stop the vertex (the directory dropped the reduction); it releases its fetches."""
        if self.runner is not None:
            self.runner.cancel()


@dataclass(eq=False)
class Fetch:
    """A copy of another node's object being fetched for the vertices on this node that reduce
    it (shared by all of them; ``users`` counts those still running)."""

    task: asyncio.Task[LocalObject]  # the get filling the local copy
    started: asyncio.Future[LocalObject]  # resolved with the local copy once it exists
    users: int = 0

    async def local(self) -> LocalObject:
        """The local copy, as soon as it exists (still filling); raises the fetch's error."""
        await asyncio.wait({self.started, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if self.started.done():
            return self.started.result()
        return self.task.result()

    def failed(self, task: asyncio.Task[LocalObject]) -> None:
        """Done-callback: a failed fetch fails the partial copy, so vertices waiting on it stop."""
        if task.cancelled() or not self.started.done():
            return
        error = task.exception()
        obj = self.started.result()
        if isinstance(error, HopliteError) and not obj.complete:
            obj.fail(error)


async def reduce_stream(
    task: p.ReduceTask,
    own: LocalObject,
    children: list[LocalObject],
    out: LocalObject,
    chunk_bytes: int,
    weights: list[float] | None = None,
) -> None:
    """Fill ``out`` with ``own (op) children...`` chunk by chunk as the sources fill (with
    ``weights``, one for ``own`` and one per child: their weighted sum).

    Raises whatever error a source fails with (a lost transfer, a deletion) or ``out``'s own
    error if the output was dropped meanwhile.
    """
    dtype = dtype_from_wire(task.dtype)
    op = as_op(task.op)
    step = max(dtype.itemsize, chunk_bytes - chunk_bytes % max(1, dtype.itemsize))
    device_chunk = (
        _device_reducer(task, dtype, op, own, children, out, step, weights) if out.buffer.on_device else None
    )
    pos = 0
    while pos < task.size:
        end = min(pos + step, task.size)
        for src in (own, *children):
            if src.progress < end or src.error is not None:
                # No timeout: sources may wait for inputs that are late by design; the directory
                # cancels the vertex when the reduction fails or times out.
                await src.wait_progress(end, None)
        if out.error is not None:
            raise out.error
        if INJECTOR.armed:
            INJECTOR.check("reduce", task.reduction_id.hex(), pos, task.size)
        if device_chunk is not None:
            device_chunk(pos, end)
        else:
            mine = own.buffer.host[pos:end].view(dtype)
            parts = [c.buffer.host_chunk(pos, end).view(dtype) for c in children]
            dest = out.buffer.host[pos:end].view(dtype)
            if weights:
                weighted_sum_chunk(mine, parts, dest, weights)
            else:
                reduce_chunk(op, mine, parts, dest, task.count)
        out.advance(end)
        pos = end
        await asyncio.sleep(0)  # let transfers this node serves or receives run between chunks
    if INJECTOR.armed:
        INJECTOR.check("reduce", task.reduction_id.hex(), pos, task.size)


def _device_reducer(
    task: p.ReduceTask,
    dtype: np.dtype[Any],
    op: ReduceOp,
    own: LocalObject,
    children: list[LocalObject],
    out: LocalObject,
    step: int,
    weights: list[float] | None,
) -> Callable[[int, int], None]:
    """The chunk step of a vertex whose output is in device memory: the same arithmetic as the
    host path, by the output's device backend (the CUDA kernels of ``kernels/reduce.cu``). A
    child's chunk in host memory (received over the data plane) or on another device is copied
    into a scratch chunk on the output's device first. The chunk is complete on the device when
    the step returns (it synchronizes), so it may be published and served at once."""
    backend = out.buffer.backend
    dev = out.buffer.device or 0
    scratch: list[Any] = []

    def here(src: LocalObject) -> bool:
        return src.buffer.on_device and src.buffer.device == dev and src.buffer.backend is backend

    def load(dst: Any, src: LocalObject, pos: int, end: int) -> None:
        if src.buffer.on_device and src.buffer.backend is backend:
            backend.copy(dst, src.buffer.view(pos, end))
        else:  # host memory (or another backend's device memory, through host)
            backend.from_host(dst, src.buffer.host_chunk(pos, end))

    def operand(src: LocalObject, pos: int, end: int) -> Any:
        if here(src):
            return src.buffer.view(pos, end)
        if not scratch:
            scratch.append(backend.empty(step, dev))
        staged = scratch[0][: end - pos]
        load(staged, src, pos, end)
        return staged

    def chunk(pos: int, end: int) -> None:
        dest = out.buffer.view(pos, end)
        load(dest, own, pos, end)
        if weights:
            if weights[0] != 1:
                backend.scale(dest, weights[0], dtype)
            for child, weight in zip(children, weights[1:], strict=True):
                backend.axpy(dest, operand(child, pos, end), weight, dtype)
        else:
            for child in children:
                backend.reduce_into(op, dest, operand(child, pos, end), dtype)
            if task.count:
                backend.finish(op, dest, task.count, dtype)
        backend.synchronize(dev)

    return chunk
