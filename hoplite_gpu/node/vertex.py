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
import collections
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import protocol as p
from ..dtypes import dtype_from_wire
from ..errors import (
    HopliteError,
    HopliteTimeoutError,
    ObjectDeletedError,
    ObjectLostError,
    ObjectNotFoundError,
    ObjectReset,
    TransportError,
)
from ..faults import INJECTOR
from ..iothread import bounded, forget, retrieved
from ..memory import Buffer, BufferKind, DeviceEvent, LocalObject, LocalStore, through_file
from ..object_id import ObjectID
from ..reduce_ops import ReduceOp, as_op
from .host_steps import HostSteps, ready_run

log = logging.getLogger("hoplite_gpu")


#: Errors of a vertex's sources after which the directory rebuilds the tree instead of failing it.
#: (ObjectDeletedError: a copy of a source shared with a vertex of the tree being replaced was dropped.)
RETRY_VERTEX = (TransportError, ObjectLostError, ObjectReset, ObjectDeletedError)

#: Seconds a vertex waits for its device to finish a reduce step it queued.
DEVICE_WAIT_SECONDS = 120.0


class VertexRunner:
    """Runs the reduce-tree vertices the directory places on one node (on its event loop).

    Args:
        store: The node's local store (inputs are found, outputs written there).
        fetch: ``fetch(oid, started)`` gets another node's object into the store, resolving
            ``started`` with the local copy as soon as it exists (still filling).
        report: Sends a message to the directory (best effort).
        drop_copy: Deletes a copy fetched only for vertices (in the background).
        chunk_bytes: Bytes reduced per step (the least per step for outputs in device memory).
        device_chunk_bytes: The most bytes reduced per step for outputs in device memory (see
            :func:`reduce_stream`).
        threads: The most threads reducing a run of host chunks every source holds (see
            :func:`reduce_stream`).
    """

    def __init__(
        self,
        store: LocalStore,
        fetch: Callable[[ObjectID, asyncio.Future[LocalObject]], Awaitable[LocalObject]],
        report: Callable[[p.Message], None],
        drop_copy: Callable[[ObjectID], None],
        chunk_bytes: int,
        device_chunk_bytes: int = 0,
        threads: int = 1,
    ) -> None:
        self.store = store
        self._fetch = fetch
        self._report = report
        self._drop_copy = drop_copy
        self.chunk_bytes = chunk_bytes
        self.device_chunk_bytes = device_chunk_bytes
        self.threads = threads
        self._runs: dict[tuple[bytes, int, int], VertexRun] = {}
        # Copies fetched only for reduce vertices, with how many running vertices use each.
        self._fetched: dict[ObjectID, Fetch] = {}
        # Outputs written over consumable inputs, and that memory, by input (see :meth:`_take_over`).
        self._over: dict[ObjectID, tuple[LocalObject, Buffer]] = {}
        self.taken_over = 0  # vertices that did (diagnostics)

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
        return self._producer(oid) is not None

    def _producer(self, oid: ObjectID) -> VertexRun | None:
        """The running vertex here that writes ``oid``, if any."""
        return next((r for r in self._runs.values() if r.output_id == oid), None)

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
        memory = self.store.memory
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
                buffer: Buffer
                if self._take_over(own, task):  # written over the input, which left the store
                    buffer = own.buffer
                else:
                    self.store.reserve(task.size)
                    if own.buffer.on_device:  # reduced where the input is, by the device's kernels
                        buffer = memory.device(task.size, like=own.buffer)
                    else:
                        buffer = await memory.host_async(task.size, populate=False)  # see reduce_stream
                out = LocalObject(
                    run.output_id,
                    task.size,
                    task.dtype,
                    tuple(task.shape),
                    b"",
                    buffer,
                    reduction=task.reduction_id,
                    memory=task.memory,
                )
                self.store.add(out)
                run.created.set_result(out)
                if buffer is own.buffer:
                    self._over[own.object_id] = (out, buffer)
                children = await streams
                if task.await_weights:
                    # Chosen once the reduction has all its inputs; the children stream meanwhile.
                    # No timeout: the directory cancels the vertex if the reduction fails.
                    await run.weights_chosen
            except BaseException:
                forget(streams)  # (a stream cancelled under it failed it: not logged as unretrieved)
                raise
            await reduce_stream(
                task,
                own,
                list(children),
                out,
                self.chunk_bytes,
                run.weights,
                self.device_chunk_bytes,
                self.threads,
            )
            if INJECTOR.armed:
                INJECTOR.check("report", task.reduction_id.hex(), task.size, task.size)
            self._report(
                p.VertexDone(
                    reduction_id=task.reduction_id,
                    vertex=task.vertex,
                    ok=True,
                    segment=memory.publish(out.buffer, out.object_id.binary(), out.dtype, out.shape),
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
            if not run.created.done():  # a vertex here waiting for this output is rebuilt too
                stopped = f"the vertex computing {run.output_id} here stopped before its output existed"
                run.created.set_exception(ObjectReset(stopped, object_id=run.output_id.hex()))
                run.created.add_done_callback(retrieved)
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
            producer = self._producer(oid)
            if producer is not None:
                # A vertex here computes it and has not made its output yet: wait for that. A
                # fetch would end on the same local object, then delete it as a copy fetched for
                # vertices: everywhere, since this node owns it (the directory's invariant "vertex
                # 2's output is not registered", broken by any reduce of two inputs of one node).
                return await asyncio.shield(producer.created)
            started: asyncio.Future[LocalObject] = asyncio.get_running_loop().create_future()
            fetch = Fetch(asyncio.ensure_future(self._fetch(oid, started)), started)
            fetch.task.add_done_callback(fetch.failed)
            self._fetched[oid] = fetch
        fetch.users += 1
        run.fetches.append(oid)
        return await fetch.local()

    def _take_over(self, own: LocalObject, task: p.ReduceTask) -> bool:
        """Whether the vertex writes its output over its input: one put ``consumable``, in this
        process's host memory, as large as the output. The input then leaves the store, so a
        tree rebuilt after this vertex fails (it finds the input gone) and never reads its
        overwritten bytes. Saves the output's buffer and, at the root of a collective's shard,
        the copy of the result into the caller's array (bench/pages/collectives.md, "Outputs
        over inputs")."""
        if not own.consumable or own.buffer.kind is not BufferKind.PRIVATE or own.size != task.size:
            return False
        if self.store.hand_over(own.object_id) is None:  # still filling, awaited or served
            return False
        self._over = {k: v for k, v in self._over.items() if self.store.get(v[0].object_id) is v[0]}
        self.taken_over += 1
        return True

    def outputs_over(self, inputs: list[ObjectID]) -> list[LocalObject]:
        """The outputs held here that vertices wrote over these inputs' memory and that are
        still in it (forgotten now): whoever takes that memory back withdraws them too."""
        found = [self._over.pop(oid, None) for oid in inputs]
        return [
            out
            for out, buffer in filter(None, found)
            if out.buffer is buffer and self.store.get(out.object_id) is out
        ]

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
        # Resolved with the output once it is in the store (a vertex here whose child it is
        # waits on it; see VertexRunner._stream_child).
        self.created: asyncio.Future[LocalObject] = loop.create_future()
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
    device_chunk_bytes: int = 0,
    threads: int = 1,
) -> None:
    """Fill ``out`` with ``own (op) children...`` chunk by chunk as the sources fill (with
    ``weights``, one for ``own`` and one per child: their weighted sum).

    Host memory is reduced ``chunk_bytes`` at a time, or, where every source holds several chunks
    ahead, a run of them by up to ``threads`` threads at once (:mod:`.host_steps`). An output in
    device memory is reduced in steps of at least ``chunk_bytes`` that take in everything every
    source holds, up to ``device_chunk_bytes`` (0: ``chunk_bytes``). Each step's kernels are
    queued on the device without waiting for them; its bytes are published (``out``'s progress)
    once an event after it is done, while the next step is queued.

    Raises whatever error a source fails with (a lost transfer, a deletion) or ``out``'s own
    error if the output was dropped meanwhile.
    """
    dtype = dtype_from_wire(task.dtype)
    op = as_op(task.op)
    item = max(1, dtype.itemsize)
    step = max(item, chunk_bytes - chunk_bytes % item)
    sources = (own, *children)
    if out.buffer.on_device:
        most = max(step, device_chunk_bytes - device_chunk_bytes % item)
        queue = _device_reducer(task, dtype, op, own, children, out, min(most, task.size), weights)
        await _device_stream(task, sources, out, step, most, item, queue)
        return
    # Into new shared memory, each chunk is reduced into scratch memory and written through the
    # segment's file: cheaper than a page fault per page of the output (see Segment.write_file).
    steps = HostSteps(
        op, dtype, own, tuple(children), out.buffer.host, task.count, weights, through_file(out.buffer.host)
    )
    if any(src.buffer.on_device for src in sources):
        threads = 1  # (a device source's chunks are copied to the host on this thread)
    scratch = np.empty(min(step, task.size), np.uint8) if steps.through_file else None
    pos = 0
    while pos < task.size:
        end = min(pos + step, task.size)
        await _step_ready(task, sources, out, pos, end)
        far = pos if INJECTOR.armed else ready_run(sources, pos, step, task.size, threads)
        if far > pos:  # several chunks ready: a few threads reduce them (see host_steps)
            steps.run(pos, far, step, threads)
            end = far
        else:
            steps.step(pos, end, scratch)
        out.advance(end)
        pos = end
        await asyncio.sleep(0)  # let transfers this node serves or receives run between chunks
    if INJECTOR.armed:
        INJECTOR.check("reduce", task.reduction_id.hex(), pos, task.size)


async def _step_ready(
    task: p.ReduceTask, sources: tuple[LocalObject, ...], out: LocalObject, pos: int, end: int
) -> None:
    """Wait until every source holds bytes ``[0, end)``; raise ``out``'s error if it was dropped;
    fire a fault armed at ``pos``."""
    for src in sources:
        if src.progress < end or src.error is not None:
            # No timeout: sources may wait for inputs that are late by design; the directory
            # cancels the vertex when the reduction fails or times out.
            await src.wait_progress(end, None)
    if out.error is not None:
        raise out.error
    if INJECTOR.armed:
        INJECTOR.check("reduce", task.reduction_id.hex(), pos, task.size)


async def _device_stream(
    task: p.ReduceTask,
    sources: tuple[LocalObject, ...],
    out: LocalObject,
    step: int,
    most: int,
    item: int,
    queue: Callable[[int, int], None],
) -> None:
    """:func:`reduce_stream`'s loop for an output in device memory: ``queue(pos, end)`` queues a
    step's work on the output's device; its bytes are published once the event after it is done.
    Whatever happens, nothing is left queued on the sources' or the output's memory when it
    returns (the caller may free them)."""
    backend = out.buffer.backend
    device = out.buffer.device or 0
    size = task.size
    queued: collections.deque[tuple[int, DeviceEvent]] = collections.deque()
    pos = 0
    try:
        while pos < size:
            end = min(pos + step, size)
            if any(src.progress < end or src.error is not None for src in sources):
                await _publish(queued, out, True)  # what is queued goes out before sources are awaited
            await _step_ready(task, sources, out, pos, end)
            end = _extent(pos, end, min(src.progress for src in sources), most, item, size)
            if INJECTOR.armed:  # a fault armed inside the step fires at its offset (as on the host)
                cut = INJECTOR.next_offset("reduce", task.reduction_id.hex(), pos, size)
                if cut is not None and cut < end:
                    end = max(min(pos + step, size), cut - (cut - pos) % item)
            queue(pos, end)
            queued.append((end, backend.record(device)))
            pos = end
            await _publish(queued, out, False)
            await asyncio.sleep(0)  # let transfers this node serves or receives run between steps
        await _publish(queued, out, True)
    finally:
        for _, event in queued:  # an error or a cancellation: the queued work still ends first
            event.wait()
    if INJECTOR.armed:
        INJECTOR.check("reduce", task.reduction_id.hex(), pos, size)


def _extent(pos: int, end: int, ready: int, most: int, item: int, size: int) -> int:
    """Where a device step from ``pos`` ends: at least at ``end``, on to ``ready`` (what every
    source holds), at most ``most`` bytes long, on an element boundary unless at ``size``."""
    far = min(max(end, ready), pos + most, size)
    if far < size:
        far -= (far - pos) % item
    return max(far, end)


async def _publish(queued: collections.deque[tuple[int, DeviceEvent]], out: LocalObject, wait: bool) -> None:
    """Advance ``out`` past the queued steps whose events are done, in order; with ``wait``, past
    all of them, waiting on a worker thread (the event loop goes on serving meanwhile)."""
    while queued:
        end, event = queued[0]
        if not event.done():
            if not wait:
                return
            try:
                done = asyncio.get_running_loop().run_in_executor(None, event.wait)
                await bounded(done, DEVICE_WAIT_SECONDS)
            except asyncio.TimeoutError:
                raise HopliteTimeoutError(
                    f"the device did not finish a reduce step of {out.object_id} within "
                    f"{DEVICE_WAIT_SECONDS:.0f} s",
                    operation="reduce step",
                    timeout=DEVICE_WAIT_SECONDS,
                    object_id=out.object_id.hex(),
                ) from None
        queued.popleft()
        out.advance(end)


def _device_reducer(
    task: p.ReduceTask,
    dtype: np.dtype[Any],
    op: ReduceOp,
    own: LocalObject,
    children: list[LocalObject],
    out: LocalObject,
    most: int,
    weights: list[float] | None,
) -> Callable[[int, int], None]:
    """The step of a vertex whose output is in device memory: the same arithmetic as the host
    path, by the output's device backend (the CUDA kernels of ``kernels/reduce.cu``), queued on
    the output device's current stream without waiting for it. A child's bytes in host memory
    (received over the data plane) or on another device are copied into a scratch area on the
    output's device first (of ``most`` bytes, the longest step); work queued later on the same
    stream runs after what reads it."""
    backend = out.buffer.backend
    dev = out.buffer.device or 0
    scratch: list[Any] = []

    def here(src: LocalObject) -> bool:
        return src.buffer.on_device and src.buffer.device == dev and src.buffer.backend is backend

    def load(dst: Any, src: LocalObject, pos: int, end: int) -> None:
        if src.buffer.on_device and src.buffer.backend is backend:
            backend.copy_async(dst, src.buffer.view(pos, end))
        else:  # host memory (or another backend's device memory, through host)
            backend.from_host(dst, src.buffer.host_chunk(pos, end))

    def operand(src: LocalObject, pos: int, end: int) -> Any:
        if here(src):
            return src.buffer.view(pos, end)
        if not scratch:
            scratch.append(backend.empty(most, dev))
        staged = scratch[0][: end - pos]
        load(staged, src, pos, end)
        return staged

    def queue(pos: int, end: int) -> None:
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

    return queue
