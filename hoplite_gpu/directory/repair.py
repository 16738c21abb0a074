"""Repairing reductions after a failure (section 4.3 of the Hoplite paper, plus what it lacked).

A reduction one of whose placed inputs or vertices was on a dead node (or whose vertex lost a
source) is rebuilt under a new epoch from the inputs that still have a copy, in their arrival
order, plus the next ready inputs (first-k), or it waits for the lost input to be put again.
Every vertex of the old tree is cancelled and partial copies of the result are reset, so nothing
is counted twice; ``reduced_objects`` is answered only when the result is complete, so it is
exact. A reduction that decodes as inputs arrive and lost an input it counted counts again.

A node may hold a complete copy of the old tree's result before the directory hears of it: a
reader received every byte from a root that died before reporting (or whose child did), or the
root finished just as a child's node died. It keeps that copy through the reset (its ``get`` may
have returned it already), and its report (a ``TransferDone`` of a transfer the directory ended,
or the old root's ``VertexDone``) then arrives after the repair. The old tree is then *adopted*:
the reduction is done with the inputs that copy was computed from, and the new tree is cancelled
(:meth:`Repair.stale_copy`). Otherwise ``reduced_objects`` would name the new tree's inputs while
that node's ``get`` returned the old tree's result (a first-k reduction may choose others).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import protocol as p
from . import combine
from .config import MAX_REPAIRS
from .records import LocationState, NodeInfo, ObjectEntry, PastTree, Reduction
from .reduce import ReducePlan
from .scheduling import input_holder

if TYPE_CHECKING:
    from .catalog import Catalog
    from .outbox import Outbox
    from .reductions import Reductions


class Repair:
    """Rebuilding the trees of the reductions after failures.

    Args:
        nodes: The joined nodes (read).
        objects: The objects (read; an adopted result is added).
        reductions: The reductions by id (read).
        outbox: Where its messages and the events it records go.
        catalog: The copies of the old trees' outputs, dropped or recorded.
        reducer: The reductions' part, which places the inputs again, finishes or fails them.
    """

    def __init__(
        self,
        *,
        nodes: dict[str, NodeInfo],
        objects: dict[bytes, ObjectEntry],
        reductions: dict[bytes, Reduction],
        outbox: Outbox,
        catalog: Catalog,
        reducer: Reductions,
    ) -> None:
        self.nodes = nodes
        self.objects = objects
        self.reductions = reductions
        self.outbox = outbox
        self.catalog = catalog
        self.reducer = reducer

    def node_left(self, node_id: str, now: float, reason: str) -> None:
        """``node_id`` left: rebuild every active reduction it held a vertex of, and count again
        the arrivals of those decoding as inputs arrive that lost one."""
        for red in list(self.reductions.values()):
            hit = [pl for pl in red.plan.placed if pl.node_id == node_id]
            if hit and red.active:
                self.rebuild(red, now, f"node {node_id[:8]} holding vertex {hit[0].vertex} {reason}")
            elif (
                red.active
                and red.gather is not None
                and any(
                    oid not in self.objects or input_holder(self.nodes, self.objects[oid]) is None
                    for oid in red.gather.keys
                )
            ):
                self.regather(red, now)

    def rebuild(self, red: Reduction, now: float, why: str) -> None:
        """Rebuild a reduction's tree after a failure: cancel every vertex of the old tree, reset
        partial copies of the result, and place again (under a new epoch) the inputs that still
        have a live copy, in their arrival order, then the next ready inputs."""
        if not red.active:
            return
        reducer, catalog = self.reducer, self.catalog
        old = red.plan
        rid = old.reduction_id
        result = self.objects.get(rid)
        if result is not None and any(
            loc.state is LocationState.COMPLETE and loc.node_id in self.nodes
            for loc in result.locations.values()
        ):
            # The root finished just before the failure (a reader already holds the whole result).
            reducer.finish(red, now)
            return
        red.repairs += 1
        if red.repairs > MAX_REPAIRS:
            text = f"reduction {rid.hex()} failed {MAX_REPAIRS} times; last: {why}"
            reducer.fail(red, "ReductionFailedError", text, now)
            return
        self.outbox.record(now, "reduce_repair", object_id=rid.hex(), epoch=old.epoch + 1, reason=why)
        if old.full and result is not None and result.locations:
            # A live node computed or read its result: that copy may be complete (see stale_copy).
            red.past[old.epoch] = PastTree(old, dict(red.weights))
            red.shun |= set(result.locations)
        for pl in old.placed:
            if pl.runs_task and pl.parent is not None:
                catalog.remove(pl.output_id, now)  # cancels the vertex computing it
        # The root's node (its vertex is cancelled) and partial readers (they start again).
        catalog.remove(rid, now, reason="reset")
        # Decoded as inputs arrive: count the arrivals again, over every input asked for.
        inputs, count = (
            (red.candidates, len(red.candidates)) if red.candidates else (old.inputs, old.num_objects)
        )
        # Rebuilt in arrival order even if it was ordered: a node that may hold the replaced
        # tree's result is kept off the root (see ReducePlan.place's root_ok).
        red.plan = ReducePlan(rid, inputs, count, epoch=old.epoch + 1, fan_in=old.fan_in)
        red.gather = combine.new_tracker(red) if red.candidates else None
        if red.coding:
            red.weights = {}  # the rebuilt tree may choose other inputs: other weights
        red.inline = []
        red.inline_ids = []
        red.deadline = now + red.timeout if red.timeout > 0 else None
        reducer.mark_timed(red)
        for oid in red.plan.inputs:
            reducer.awaiting.setdefault(oid, set()).add(rid)
        for oid in [pl.object_id for pl in old.placed] + list(red.plan.inputs):
            if red.active and oid in self.objects:
                reducer.offer(red, oid, now)

    def regather(self, red: Reduction, now: float) -> None:
        """An input that a reduction decoding as inputs arrive counted on lost its last copy
        before the decoding was complete: count again over the inputs that are still present."""
        self.outbox.record(now, "reduce_regather", object_id=red.plan.reduction_id.hex())
        red.gather = combine.new_tracker(red)
        red.plan.size = -1
        for oid in red.candidates:
            if red.active and red.gather is not None and oid in self.objects:
                self.reducer.offer(red, oid, now)

    def stale_copy(self, rid: bytes, epoch: int, node_id: str, segment: str, now: float) -> None:
        """``node_id`` holds a complete copy of reduction ``rid``'s result computed by its tree of
        ``epoch`` and says so late: a transfer of it the directory had ended, or that tree's root
        (``segment``: where the copy is, as in ``TransferDone``). Recorded if that tree is the
        reduction's; adopted if a repair replaced it since and the reduction goes on (unless the
        node computes the new tree's root, whose task replaced the copy there, or a copy of the
        new tree's result is complete already); else the node drops the copy, of a tree nobody
        uses."""
        catalog = self.catalog
        red = self.reductions.get(rid)
        entry = self.objects.get(rid)
        if red is not None and red.error is None and epoch == red.plan.epoch:
            if entry is not None and entry.inline is None:
                catalog.add_complete(entry, node_id, segment)  # e.g. its sender, a relay, died
                catalog.ready(rid, now)
            return
        root = red.plan.by_vertex.get(0) if red is not None else None
        computes = red is not None and red.active and root is not None and root.node_id == node_id
        tree = red.past.get(epoch) if red is not None and red.active else None
        # A copy of the new tree's result already complete (its get may have returned it) wins.
        won = entry is not None and any(
            loc.state is LocationState.COMPLETE for loc in entry.locations.values()
        )
        if red is not None and tree is not None and not computes and not won:
            self._adopt(red, tree, node_id, segment, now)
            return
        self.outbox.record(now, "reduce_stale_copy", object_id=rid.hex(), node=node_id, epoch=epoch)
        if not computes and (entry is None or node_id not in entry.locations):
            self.outbox.send(node_id, p.DropObject(object_id=rid, reason="deleted"))

    def _adopt(self, red: Reduction, past: PastTree, node_id: str, segment: str, now: float) -> None:
        """Finish ``red`` with the tree ``past`` whose result ``node_id`` holds complete: cancel
        the tree that replaced it, and record that copy as the result."""
        catalog, reducer = self.catalog, self.reducer
        current = red.plan
        rid = current.reduction_id
        self.outbox.record(
            now,
            "reduce_adopted",
            object_id=rid.hex(),
            epoch=past.plan.epoch,
            replaced=current.epoch,
            node=node_id,
        )
        for pl in current.placed:
            if pl.runs_task and pl.parent is not None:
                catalog.remove(pl.output_id, now)  # cancels the vertex computing it
        # The new root's node (its vertex is cancelled) and partial readers (they look up again).
        catalog.remove(rid, now, skip=node_id, reason="reset")
        for oid in current.inputs:
            reducer.unawait(oid, rid)
        red.plan, red.weights, red.gather = past.plan, dict(past.weights), None
        red.inline, red.inline_ids = [], []
        plan = red.plan
        entry = ObjectEntry(
            rid, plan.size, plan.dtype, list(plan.shape), b"", red.requester, None, memory=red.memory or ""
        )
        entry.reduction = rid
        self.objects[rid] = entry
        catalog.add_complete(entry, node_id, segment)
        reducer.finish(red, now)
        catalog.ready(rid, now)
