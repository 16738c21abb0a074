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
from dataclasses import dataclass

from . import protocol as p
from .buffers import dtype_from_wire
from .errors import HopliteError
from .faults import INJECTOR
from .object_id import ObjectID
from .reduce_ops import as_op, reduce_chunk
from .store import LocalObject


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
        for index, oid in enumerate(task.children):
            if oid:
                self.set_child(index, oid)
        self.runner: asyncio.Task[None] | None = None
        self.fetches: list[ObjectID] = []  # children this vertex uses through a :class:`Fetch`

    def set_child(self, index: int, object_id: bytes) -> None:
        """Child ``index`` is ``object_id`` (ignored if out of range or already known)."""
        if 0 <= index < len(self._children) and not self._children[index].done() and len(object_id) == 20:
            self._children[index].set_result(ObjectID(object_id))

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
) -> None:
    """Fill ``out`` with ``own (op) children...`` chunk by chunk as the sources fill.

    Raises whatever error a source fails with (a lost transfer, a deletion) or ``out``'s own
    error if the output was dropped meanwhile.
    """
    dtype = dtype_from_wire(task.dtype)
    op = as_op(task.op)
    step = max(dtype.itemsize, chunk_bytes - chunk_bytes % max(1, dtype.itemsize))
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
        reduce_chunk(
            op,
            own.data[pos:end].view(dtype),
            [c.data[pos:end].view(dtype) for c in children],
            out.data[pos:end].view(dtype),
            task.count,
        )
        out.advance(end)
        pos = end
        await asyncio.sleep(0)  # let transfers this node serves or receives run between chunks
    if INJECTOR.armed:
        INJECTOR.check("reduce", task.reduction_id.hex(), pos, task.size)
