"""Repairing reductions after a failure (section 4.3 of the Hoplite paper, plus what it lacked).

A reduction one of whose placed inputs or vertices was on a dead node (or whose vertex lost a
source) is rebuilt under a new epoch from the inputs that still have a copy, in their arrival
order, plus the next ready inputs (first-k), or it waits for the lost input to be put again.
Every vertex of the old tree is cancelled and partial copies of the result are reset, so nothing
is counted twice; ``reduced_objects`` is answered only when the result is complete, so it is
exact. A reduction that decodes as inputs arrive and lost an input it counted counts again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import combine
from .config import MAX_REPAIRS
from .records import LocationState, Reduction
from .reduce import ReducePlan
from .scheduling import input_holder

if TYPE_CHECKING:
    from .state import DirectoryState


class Repair:
    """Rebuilding the trees of :attr:`~.state.DirectoryState.reductions` after failures."""

    def __init__(self, state: DirectoryState) -> None:
        self.state = state
        self.nodes = state.nodes
        self.objects = state.objects

    def node_left(self, node_id: str, now: float, reason: str) -> None:
        """``node_id`` left: rebuild every active reduction it held a vertex of, and count again
        the arrivals of those decoding as inputs arrive that lost one."""
        for red in list(self.state.reductions.values()):
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
        state, reducer, catalog = self.state, self.state.reducer, self.state.catalog
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
        state.record(now, "reduce_repair", object_id=rid.hex(), epoch=old.epoch + 1, reason=why)
        for pl in old.placed:
            if pl.runs_task and pl.parent is not None:
                catalog.remove(pl.output_id, now)  # cancels the vertex computing it
        # The root's node (its vertex is cancelled) and partial readers (they start again).
        catalog.remove(rid, now, reason="reset")
        # Decoded as inputs arrive: count the arrivals again, over every input asked for.
        inputs, count = (
            (red.candidates, len(red.candidates)) if red.candidates else (old.inputs, old.num_objects)
        )
        red.plan = ReducePlan(rid, inputs, count, epoch=old.epoch + 1, fan_in=old.fan_in)
        red.gather = combine.new_tracker(red) if red.candidates else None
        if red.coding:
            red.weights = {}  # the rebuilt tree may choose other inputs: other weights
        red.inline = []
        red.inline_ids = []
        red.deadline = now + red.timeout if red.timeout > 0 else None
        for oid in red.plan.inputs:
            reducer.awaiting.setdefault(oid, set()).add(rid)
        for oid in [pl.object_id for pl in old.placed] + list(red.plan.inputs):
            if red.active and oid in self.objects:
                reducer.offer(red, oid, now)

    def regather(self, red: Reduction, now: float) -> None:
        """An input that a reduction decoding as inputs arrive counted on lost its last copy
        before the decoding was complete: count again over the inputs that are still present."""
        self.state.record(now, "reduce_regather", object_id=red.plan.reduction_id.hex())
        red.gather = combine.new_tracker(red)
        red.plan.size = -1
        for oid in red.candidates:
            if red.active and red.gather is not None and oid in self.objects:
                self.state.reducer.offer(red, oid, now)
