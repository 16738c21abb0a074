"""The directory's invariant checker: what must hold after every event, and a description of
each broken one.

Records are keyed by their own ids; every location, transfer, pending lookup and live reduction
vertex names a node that is joined; progress stays within the object's size; a complete copy has
no upstream; no upstream chain is a cycle (the scheduling rule of :mod:`.scheduling`); a busy
sender serves a recorded transfer; ``awaiting`` lists exactly the unplaced inputs of active,
unfilled reductions; the indexes of pending lookups (per node, per request, by deadline) match the
queues; the per-node inline bytes and reduction inputs and the event log's size accounting match
what they count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .records import LocationState
from .scheduling import upstream_cycle

if TYPE_CHECKING:
    from .state import DirectoryState


class InvariantError(AssertionError):
    """The directory's state broke one of its invariants (a bug; see :func:`problems`)."""


def problems(state: DirectoryState) -> list[str]:
    """Every broken invariant of ``state``, described (empty when it is consistent)."""
    out: list[str] = []
    lookups = state.lookups
    counts: dict[str, int] = {}
    by_request: dict[tuple[str, int], dict[bytes, int]] = {}
    for queue in lookups.pending.values():
        for pl in queue:
            counts[pl.node_id] = counts.get(pl.node_id, 0) + 1
            by_object = by_request.setdefault((pl.node_id, pl.request_id), {})
            by_object[pl.object_id] = by_object.get(pl.object_id, 0) + 1
            if not pl.live:
                out.append(f"pending lookup {pl.request_id} of {pl.node_id[:8]} is marked answered")
    if counts != lookups.per_node:
        out.append(f"pending lookups per node {lookups.per_node} are really {counts}")
    if by_request != lookups.by_request:
        out.append("the index of pending lookups by request does not match the queues")
    for nid, info in state.nodes.items():
        if info.node_id != nid:
            out.append(f"node {nid[:8]} is recorded as {info.node_id[:8]}")
    inline: dict[str, int] = {}
    for entry in state.objects.values():
        if entry.inline is not None and entry.charged and entry.size:
            inline[entry.charged] = inline.get(entry.charged, 0) + entry.size
    if inline != state.members.inline_bytes:
        out.append(f"inline bytes per node {state.members.inline_bytes} are really {inline}")
    out.extend(state.eventlog.problems())
    out.extend(state.watches.problems())
    out.extend(_object_problems(state))
    out.extend(_reduction_problems(state))
    return out


def _object_problems(state: DirectoryState) -> list[str]:
    """Objects and their copies, transfers and the queues of pending lookups."""
    out: list[str] = []
    nodes, transfers = state.nodes, state.lookups.transfers
    serving = {(tr.object_id, tr.sender) for tr in transfers.values()}
    for oid, entry in state.objects.items():
        name = oid.hex()[:12]
        if entry.object_id != oid or len(oid) != 20 or entry.size < 0:
            out.append(f"object {name}: bad key, id or size {entry.size}")
        if entry.inline is not None and len(entry.inline) != entry.size:
            out.append(f"object {name}: {len(entry.inline)} inline bytes for size {entry.size}")
        for nid, loc in entry.locations.items():
            where = f"object {name} at {nid[:8]}"
            if loc.node_id != nid:
                out.append(f"{where}: recorded as {loc.node_id[:8]}")
            if nid not in nodes:
                out.append(f"{where}: the node is not joined")
            if not 0 <= loc.progress <= entry.size:
                out.append(f"{where}: progress {loc.progress} outside 0..{entry.size}")
            complete = loc.state is LocationState.COMPLETE
            if complete and (loc.progress != entry.size or loc.upstream is not None or loc.producing):
                out.append(f"{where}: complete but short, fed or still produced")
            if loc.copying and not (complete and loc.segment):
                out.append(f"{where}: copying without a complete copy's segment")
            if entry.inline is not None and (not complete or loc.segment or loc.busy):
                out.append(f"{where}: an inline object's holder is partial, in a segment or busy")
            if loc.busy and (oid, nid) not in serving:
                out.append(f"{where}: busy without a transfer")
            if upstream_cycle(entry, loc):
                out.append(f"{where}: its upstream chain is a cycle")
    for tid, tr in transfers.items():
        if tr.transfer_id != tid or tr.object_id not in state.objects or tr.sender == tr.receiver:
            out.append(f"transfer {tid}: bad key, unknown object or sender = receiver")
        if tr.sender not in nodes or tr.receiver not in nodes:
            out.append(f"transfer {tid}: between nodes not joined")
    for oid, queue in state.lookups.pending.items():
        if not queue:
            out.append(f"pending {oid.hex()[:12]}: an empty queue is kept")
        for pl in queue:
            if pl.object_id != oid or pl.node_id not in nodes or pl.have_bytes < 0:
                out.append(f"pending {oid.hex()[:12]} of {pl.node_id[:8]}: bad key, node or progress")
    return out


def _reduction_problems(state: DirectoryState) -> list[str]:
    """Reductions: their plans, their vertices' nodes and outputs, and ``awaiting``."""
    out: list[str] = []
    expected: dict[bytes, set[bytes]] = {}
    charged: dict[str, int] = {}
    for rid, red in state.reductions.items():
        plan, name = red.plan, f"reduction {rid.hex()[:12]}"
        if red.charged:
            charged[red.requester] = charged.get(red.requester, 0) + red.charged
        if plan.reduction_id != rid or len(plan.placed) > plan.num_objects:
            out.append(f"{name}: bad key, or more inputs placed than asked for")
        if [pl.vertex for pl in plan.placed] != [v for v in plan.by_vertex] or any(
            plan.by_vertex[pl.vertex] is not pl or pl.object_id not in plan.inputs for pl in plan.placed
        ):
            out.append(f"{name}: its placements and vertices disagree")
        waits = red.deadline is not None and red.active and not plan.full
        if (waits or any(q.deadline is not None for q in red.queries)) and rid not in state.reducer.timed:
            out.append(f"{name}: waits with a deadline that next_deadline does not see (Reductions.timed)")
        if not red.active:
            continue
        for pl in plan.placed:
            if pl.node_id and pl.node_id not in state.nodes:
                out.append(f"{name}: vertex {pl.vertex} on {pl.node_id[:8]}, not joined")
            if pl.runs_task and pl.node_id and pl.output_id not in state.objects:
                out.append(f"{name}: vertex {pl.vertex}'s output is not registered")
        if not plan.full:
            placed = {pl.object_id for pl in plan.placed}
            for oid in plan.inputs:
                if oid not in placed:
                    expected.setdefault(oid, set()).add(rid)
    if {o: set(r) for o, r in state.reducer.awaiting.items()} != expected:
        out.append("awaiting does not list exactly the unplaced inputs of active reductions")
    if charged != state.members.reduce_inputs:
        out.append("the per-node counts of reduction inputs are not those of the reductions held")
    return out
