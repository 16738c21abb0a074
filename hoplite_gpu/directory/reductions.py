"""Reductions: requests, the placement of inputs in a tree as they become ready, the tree's
vertices, and the answers to ``reduced_objects``.

Inputs are placed in a tree (:class:`~.reduce.ReducePlan`) as they become ready (put), in the
order they arrive; every vertex but a leaf gets a :class:`~hoplite_gpu.protocol.ReduceTask` on the
node holding its input, and its output is registered at once as a partial object there, so its
parent (or a ``get`` of the result) streams it through the same lookup/pull path as any object
while it is being reduced. Inline-sized inputs are reduced here, without any transfer. A
reduction given a code's encoding rows chooses its weights once its inputs are chosen, or, asked
for the first arrivals that decode, once the rows that arrived do. Repairs after a failure are
:mod:`.repair`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import protocol as p
from ..coding.decoding import DECODE_TOLERANCE
from . import combine
from .config import REDUCTIONS_KEPT
from .lookups import failed_lookup, not_ready
from .records import NodeInfo, ObjectEntry, PendingQuery, Reduction, unindex
from .reduce import LinkEstimate, MismatchError, Placement, ReducePlan
from .reduce_request import (
    Asked,
    Refusal,
    asks_the_same,
    inputs_problem,
    late_reply,
    read_request,
    reduced_reply,
    refusal_reply,
    rejoined_epoch,
    unknown_reply,
)
from .scheduling import computes_at, in_segment, input_holder, one_host

if TYPE_CHECKING:
    from .catalog import Catalog
    from .config import DirectoryConfig
    from .lookups import Lookups
    from .membership import Membership
    from .outbox import Outbox
    from .repair import Repair


class Reductions:
    """What happens to the reductions; which inputs they wait for (:attr:`awaiting`) and the link
    estimate their trees are shaped by (:attr:`link`).

    Args:
        config: The directory's settings.
        nodes: The joined nodes (read).
        objects: The objects (read; the vertices' outputs and inline results are added here).
        reductions: The reductions by id (this part adds and forgets them).
        outbox: Where its messages and the events it records go.
        members: Charged and released for the inputs of each node's reductions.
        catalog: Told of vertices' outputs ready or dropped.
        lookups: The lookups of a result that failed.

    Its repair (:class:`~.repair.Repair`, made after it) comes through :meth:`connect`.
    """

    repair: Repair

    def __init__(
        self,
        *,
        config: DirectoryConfig,
        nodes: dict[str, NodeInfo],
        objects: dict[bytes, ObjectEntry],
        reductions: dict[bytes, Reduction],
        outbox: Outbox,
        members: Membership,
        catalog: Catalog,
        lookups: Lookups,
    ) -> None:
        self.config = config
        self.nodes = nodes
        self.objects = objects
        self.reductions = reductions
        self.outbox = outbox
        self.members = members
        self.catalog = catalog
        self.lookups = lookups
        self.awaiting: dict[bytes, set[bytes]] = {}  # input ObjectID -> reductions waiting for it
        # The reductions that may wait with a deadline: for inputs (until their plan is full) or
        # with a query. The service asks for the earliest after every event, which must not walk
        # every reduction kept. Added where a deadline is set or a plan replaced (see mark_timed).
        self.timed: set[bytes] = set()
        self.link = LinkEstimate()
        self._rejoin_epoch: int | None = None  # see rejoined_epoch

    def connect(self, *, repair: Repair) -> None:
        """Hand it the repair it calls when a vertex lost a source, or a root reported a result
        of a tree a repair replaced."""
        self.repair = repair

    # ------------------------------------------------------------ requests
    def request(self, node_id: str, msg: p.ReduceRequest, now: float) -> None:
        """A node asks for a reduction (every rank of a group may ask for the same one)."""
        asked = read_request(msg)
        if isinstance(asked, tuple):
            self.outbox.send(node_id, refusal_reply(msg.request_id, asked))
            return
        rid = msg.reduction_id
        existing = self.reductions.get(rid)
        if existing is not None:
            self._asked_again(node_id, msg, existing, asked)
            return
        refused = self._quota_problem(node_id, asked.cost)
        if refused is None and rid in self.objects and msg.rejoin:
            self._restored(node_id, msg, asked, now)
            return
        if refused is None and rid in self.objects:
            refused = "ObjectExistsError", f"object {rid.hex()} already exists; use another reduction id", b""
        present = [self.objects[o] for o in asked.plan.inputs if o in self.objects]
        if refused is None:  # refuse what is already known to be wrong: nothing gets reduced
            refused = inputs_problem(asked, present)
        if refused is not None:
            self.outbox.send(node_id, refusal_reply(msg.request_id, refused))
            return
        red = self._start(node_id, msg, asked, now)
        self._queue_present(red, present, now)

    def _asked_again(self, node_id: str, msg: p.ReduceRequest, existing: Reduction, asked: Asked) -> None:
        """Reduction ``msg.reduction_id`` exists: answered as requested if ``msg`` asks for the same
        one, else refused."""
        if asks_the_same(existing, asked, msg.num_objects):
            self.outbox.send(node_id, p.ReduceReply(request_id=msg.request_id))
            return
        text = f"reduction {msg.reduction_id.hex()} already exists with other inputs or op"
        self.outbox.send(node_id, refusal_reply(msg.request_id, ("ObjectExistsError", text, b"")))

    def _quota_problem(self, node_id: str, cost: int) -> Refusal | None:
        """Why ``node_id`` may not request one more reduction of ``cost`` inputs (its unfinished
        reductions, or the inputs its reductions hold), or None; room is made by forgetting its
        finished ones (see :meth:`_make_room`). The directory keeps at most REDUCTIONS_KEPT."""
        active = sum(1 for red in self.reductions.values() if red.requester == node_id and red.active)
        quota = self.config.max_reductions
        if active >= quota:
            return (
                "QuotaExceededError",
                f"node has {quota} reductions not finished, the directory's quota",
                b"",
            )
        if self._make_room(node_id, cost):
            return None
        held = self.members.reduce_inputs.get(node_id, 0)
        text = (
            f"node's reductions hold {held} inputs here and this one counts {cost} "
            "(weights and encoding numbers included): that exceeds the directory's quota of "
            f"{self.config.max_reduce_inputs} (Config.directory_max_reduce_inputs)"
        )
        return "QuotaExceededError", text, b""

    def _restored(self, node_id: str, msg: p.ReduceRequest, asked: Asked, now: float) -> None:
        """Re-sent to this restarted directory, and a node restored the finished result: the
        reduction is done."""
        rid, plan = msg.reduction_id, asked.plan
        red = Reduction(plan, asked.op, node_id, None, msg.timeout, done=True, restored=True)
        red.candidates = plan.inputs if asked.as_arrive else ()
        self.reductions[rid] = red
        self.members.charge_reduction(red, asked.cost)
        result = self.objects[rid]
        result.reduction = b""
        result.owner = node_id  # the requester deletes it, as one computed here
        self.outbox.send(node_id, p.ReduceReply(request_id=msg.request_id))
        self.outbox.record(now, "reduce_restored", node=node_id, object_id=rid.hex())

    def _start(self, node_id: str, msg: p.ReduceRequest, asked: Asked, now: float) -> Reduction:
        """Keep the reduction ``asked`` for, answer its requester, and wait for its inputs."""
        plan, rid = asked.plan, msg.reduction_id
        if msg.rejoin:  # the lost directory's tree of it may still wind down on its nodes
            self._rejoin_epoch = plan.epoch = rejoined_epoch(now, self._rejoin_epoch)
        red = Reduction(plan, asked.op, node_id, now + msg.timeout if msg.timeout > 0 else None, msg.timeout)
        red.weights = asked.weights
        red.coding = asked.coding
        if asked.as_arrive:
            red.candidates = plan.inputs
            red.gather = combine.new_tracker(red)
        self.reductions[rid] = red
        self.mark_timed(red)
        self.members.charge_reduction(red, asked.cost)
        self._forget_old()
        self.outbox.send(node_id, p.ReduceReply(request_id=msg.request_id))
        self.outbox.record(
            now,
            "reduce",
            node=node_id,
            object_id=rid.hex(),
            inputs=len(plan.inputs),
            k=msg.num_objects,
            op=asked.op,
        )
        awaiting = self.awaiting
        for oid in plan.inputs:
            waiting = awaiting.get(oid)
            if waiting is None:
                awaiting[oid] = {rid}
            else:
                waiting.add(rid)
        return red

    def _queue_present(self, red: Reduction, present: list[ObjectEntry], now: float) -> None:
        """Queue the inputs ``present`` at the request for placing (:meth:`place_backlog`), the
        requester's own first: one of them computes the root (see :meth:`offer`), whatever the
        others' position in the list. Many are placed over later events."""
        mine = [entry.object_id for entry in present if computes_at(self.nodes, entry, red.requester)]
        red.backlog.extend(mine)
        if mine:
            chosen = set(mine)
            red.backlog.extend(entry.object_id for entry in present if entry.object_id not in chosen)
        else:
            red.backlog.extend(entry.object_id for entry in present)
        if len(red.backlog) > self.config.place_slice:
            self.outbox.resume(red.plan.reduction_id)  # this event did the O(inputs) part
        else:
            self.place_backlog(red, now)

    def place_backlog(self, red: Reduction, now: float) -> None:
        """Offer up to ``place_slice`` of the inputs that were present when ``red`` was
        requested; ask the host to come back (:class:`~.events.Resume`) for the rest. Inputs that
        arrive meanwhile are offered as they arrive (they still wait in ``awaiting``), and an
        input of the backlog placed some other way, deleted or no longer wanted is skipped by
        :meth:`offer`."""
        for _ in range(min(self.config.place_slice, len(red.backlog))):
            self.offer(red, red.backlog.popleft(), now)
        if not red.active:
            red.backlog.clear()
        elif red.backlog:
            self.outbox.resume(red.plan.reduction_id)

    # ------------------------------------------------------------ placing inputs
    def object_ready(self, oid: bytes, now: float) -> None:
        """``oid`` has a copy a reduction can use: offer it to the reductions waiting for it."""
        for rid in list(self.awaiting.get(oid, ())):
            red = self.reductions.get(rid)
            if red is not None:
                self.offer(red, oid, now)

    def offer(self, red: Reduction, oid: bytes, now: float) -> None:
        """Place input ``oid`` of ``red`` in its tree if it is wanted and has a usable copy."""
        plan = red.plan
        entry = self.objects.get(oid)
        if not red.active or entry is None or not plan.wants(oid):
            return
        holder = input_holder(self.nodes, entry)
        if holder is None:
            return
        problem = combine.input_problem(plan, entry, entry, bool(red.weights or red.coding))
        if problem is None and red.weights and not plan.placed:  # the dtype is known from now on
            problem = combine.weights_problem(red.weights.values(), entry.dtype)
        if problem is None and plan.placed and (entry.inline is not None) != bool(red.inline):
            problem = "ReduceMismatchError", f"input {oid.hex()} is stored differently from the others"
        if problem is not None:
            self.fail(red, problem[0], problem[1], now, culprit=oid)
            return
        if red.memory is None:
            red.memory = entry.memory
        if red.gather is not None:
            self._gather(red, entry, now)
            return
        try:
            # The requester reads the result: its own input, if it has one, computes the root
            # (unless it may hold the result of a tree a repair replaced: see Repair.rebuild).
            root_ok = holder not in red.shun
            at_root = holder == red.requester and root_ok
            pl = plan.place(
                oid,
                holder,
                entry.size,
                entry.dtype,
                tuple(entry.shape),
                self.link,
                at_root=at_root,
                # Only the first placement fixes the shape: the scan of every node is done once.
                one_host=plan.tree is None and in_segment(entry, holder) and one_host(self.nodes),
                root_ok=root_ok,
            )
        except MismatchError as exc:  # pragma: no cover - input_problem checked the same
            self.fail(red, "ReduceMismatchError", str(exc), now, culprit=oid)
            return
        self.unawait(oid, plan.reduction_id)
        if len(plan.placed) == 1:
            self.outbox.record(
                now, "reduce_tree", object_id=plan.reduction_id.hex(), degree=plan.degree, reason=plan.reason
            )
        self.outbox.record(
            now,
            "reduce_place",
            object_id=plan.reduction_id.hex(),
            input=oid.hex(),
            vertex=pl.vertex,
            node=holder,
        )
        if entry.inline is not None:
            red.inline.append(entry.inline)
            red.inline_ids.append(oid)
        else:
            self._start_vertex(red, pl, now)
        if plan.full:
            for other in plan.inputs:
                self.unawait(other, plan.reduction_id)
            if red.coding and not red.weights and not self._choose_weights(red, now):
                return
            if red.inline:
                self._reduce_inline(red, now)

    def _gather(self, red: Reduction, entry: ObjectEntry, now: float) -> None:
        """An input of a reduction that decodes as inputs arrive is ready: add its row, and once
        the rows that arrived decode, place the inputs the decoding uses (all present) as the
        tree, with their weights known from the start."""
        plan, tracker, oid = red.plan, red.gather, entry.object_id
        assert tracker is not None
        if plan.size < 0:  # later inputs are checked against the first (see input_problem)
            plan.size, plan.dtype, plan.shape = entry.size, entry.dtype, tuple(entry.shape)
        before = tracker.seen
        decodable = tracker.add(oid, red.coding[oid])
        if tracker.seen == before:
            return  # offered again (another copy completed): counted already
        self.outbox.record(
            now, "reduce_arrival", object_id=plan.reduction_id.hex(), input=oid.hex(), decodable=decodable
        )
        if not decodable:
            if tracker.seen >= len(red.candidates):
                self.fail(
                    red,
                    "NotDecodableError",
                    f"all {len(red.candidates)} inputs of reduction {plan.reduction_id.hex()} arrived and "
                    f"their encoding rows do not combine into all ones (they span {len(tracker.keys)} of "
                    f"{tracker.width} dimensions)",
                    now,
                )
            return
        used, weights = tracker.solution()
        chosen = set(used)
        for other in red.candidates:  # the chosen stay awaited until offer places them below
            if other not in chosen:
                self.unawait(other, plan.reduction_id)
        red.gather = None
        red.plan = ReducePlan(plan.reduction_id, tuple(used), len(used), epoch=plan.epoch, fan_in=plan.fan_in)
        self.mark_timed(red)
        red.weights = dict(zip(used, weights, strict=True))
        self.outbox.record(
            now,
            "reduce_decodable",
            object_id=plan.reduction_id.hex(),
            arrived=tracker.seen,
            used=len(used),
            epoch=plan.epoch,
        )
        for oid in used:
            self.offer(red, oid, now)

    def _start_vertex(self, red: Reduction, pl: Placement, now: float) -> None:
        """Give the vertex's node its task (registering the output it will produce) and tell an
        already placed parent where this vertex's output is."""
        if pl.runs_task:
            self.objects[pl.output_id] = combine.vertex_output(red, pl)
            self.outbox.send(pl.node_id, combine.vertex_task(red, pl))
            self.catalog.ready(pl.output_id, now)
        parent = red.plan.by_vertex.get(pl.parent) if pl.parent is not None else None
        if parent is not None:
            self.outbox.send(parent.node_id, combine.child_message(red, pl, parent))

    def _choose_weights(self, red: Reduction, now: float) -> bool:
        """A decoded reduction just chose its inputs: the weights whose sum of their encoding
        rows is all ones (:func:`~.combine.decoding_weights`), sent to every vertex waiting for
        them. False (and the reduction failed) if the chosen inputs do not decode."""
        plan = red.plan
        weights, residual = combine.decoding_weights(red)
        if residual > DECODE_TOLERANCE:
            self.fail(
                red,
                "NotDecodableError",
                f"the first {len(plan.placed)} inputs of reduction {plan.reduction_id.hex()} to arrive do "
                f"not decode (their encoding rows do not combine into all ones; residual {residual:.2e})",
                now,
            )
            return False
        red.weights = weights
        self.outbox.record(now, "reduce_weights", object_id=plan.reduction_id.hex(), epoch=plan.epoch)
        for pl in plan.placed:
            if pl.runs_task:
                self.outbox.send(pl.node_id, combine.weights_message(red, pl))
        return True

    def _reduce_inline(self, red: Reduction, now: float) -> None:
        """All inputs are inline: reduce them here and store the result inline."""
        plan = red.plan
        rid = plan.reduction_id
        result = combine.reduce_inline(red)
        self.objects[rid] = ObjectEntry(
            rid, plan.size, plan.dtype, list(plan.shape), b"", red.requester, result, memory=red.memory or ""
        )
        red.done = True
        red.inline = []
        red.inline_ids = []
        self._answer_queries(red)
        self.outbox.record(now, "reduce_done", object_id=rid.hex(), inline=True)
        self.catalog.ready(rid, now)

    # ------------------------------------------------------------ vertices, results, failures
    def vertex_done(self, node_id: str, msg: p.VertexDone, now: float) -> None:
        """A vertex finished its output, failed, or lost a source (its tree is rebuilt)."""
        red = self.reductions.get(msg.reduction_id)
        if red is not None and msg.ok and msg.vertex == 0 and (msg.epoch != red.plan.epoch or not red.active):
            # A root that finished just before a repair replaced its tree, or the reduction was
            # done without it (see Repair.stale_copy).
            self.repair.stale_copy(msg.reduction_id, msg.epoch, node_id, msg.segment, now)
            return
        pl = red.plan.by_vertex.get(msg.vertex) if red is not None else None
        if (
            red is None
            or pl is None
            or pl.node_id != node_id
            or not red.active
            or msg.epoch != red.plan.epoch
        ):
            return  # unknown, finished, or a vertex of a tree rebuilt since
        if not msg.ok and msg.retry:
            # A source died or was reset under it: rebuild (the dead node's own report may follow).
            why = f"vertex {msg.vertex} on node {node_id[:8]} lost a source: {msg.reason}"
            self.repair.rebuild(red, now, why)
            return
        if not msg.ok:
            self.fail(
                red,
                "ReductionFailedError",
                f"vertex {msg.vertex} of reduction {msg.reduction_id.hex()} on node {node_id[:8]} "
                f"failed: {msg.reason}",
                now,
            )
            return
        entry = self.objects.get(pl.output_id)
        if entry is not None:
            self.catalog.add_complete(entry, node_id, msg.segment)
        self.outbox.record(
            now, "vertex_done", object_id=msg.reduction_id.hex(), vertex=msg.vertex, node=node_id
        )
        if pl.parent is None:
            self.finish(red, now)
        self.catalog.ready(pl.output_id, now)

    def finish(self, red: Reduction, now: float) -> None:
        """The root's output is complete: the reduction is done."""
        red.done = True
        red.past.clear()
        red.shun = frozenset()
        for oid in red.plan.inputs:  # finished early (restored, or just before a repair)
            self.unawait(oid, red.plan.reduction_id)
        for inner in red.plan.intermediates():  # their parents hold everything they need
            self.catalog.remove(inner.output_id, now)
        result = self.objects.get(red.plan.reduction_id)
        if result is not None:
            result.reduction = b""  # final: a copy of it survives a directory restart
        self._answer_queries(red)
        self.outbox.record(now, "reduce_done", object_id=red.plan.reduction_id.hex(), repairs=red.repairs)

    def fail(
        self, red: Reduction, kind: str, message: str, now: float, culprit: bytes = b"", drop: str = "failed"
    ) -> None:
        """Abandon a reduction: its tasks are dropped (which cancels them) with ``drop`` as the
        reason (see :class:`~hoplite_gpu.protocol.DropObject`), waiters get the error."""
        if not red.active:
            return
        plan = red.plan
        red.error = error = (kind, message, culprit)
        red.past.clear()
        red.shun = frozenset()
        red.inline = []
        red.inline_ids = []
        self.outbox.record(
            now, "reduce_failed", object_id=plan.reduction_id.hex(), error_kind=kind, reason=message
        )
        for oid in plan.inputs:
            self.unawait(oid, plan.reduction_id)
        for pl in plan.placed:
            if pl.runs_task:  # a get waiting on a copy of its output raises the error
                self.catalog.remove(pl.output_id, now, reason=drop, error=(kind, message))
        self.lookups.fail(
            plan.reduction_id, lambda pl: failed_lookup(pl.request_id, plan.reduction_id, error)
        )
        self._answer_queries(red)

    def requester_left(self, node_id: str, now: float, reason: str) -> None:
        """``node_id`` left: the reductions it requested and that are not finished fail with
        ``ObjectLostError`` (its readers learn at once). Such a reduction often cannot finish at
        all (the requester's own input died with it, and nobody puts it again), and its inputs,
        vertices and partial results would otherwise be held until its timeout, or for ever
        (tests/test_soak.py found them after every collective that lost a member)."""
        for red in list(self.reductions.values()):
            if red.requester == node_id and red.active:
                rid = red.plan.reduction_id.hex()
                text = f"reduction {rid} was abandoned: node {node_id[:8]}, which requested it, {reason}"
                self.fail(red, "ObjectLostError", text, now, culprit=red.plan.reduction_id, drop="lost")

    # ------------------------------------------------------------ reduced_objects
    def reduced_objects(self, node_id: str, msg: p.ReducedObjectsRequest, now: float) -> None:
        """Which inputs a reduction uses: answered now if it finished or failed, else once it does."""
        red = self.reductions.get(msg.reduction_id)
        if red is None:
            self.outbox.send(node_id, unknown_reply(msg.request_id, msg.reduction_id))
        elif red.error is not None or red.done:
            self.outbox.send(node_id, reduced_reply(msg.request_id, red))
        else:
            deadline = now + msg.timeout if msg.timeout > 0 else None
            red.queries.append(PendingQuery(node_id, msg.request_id, deadline))
            if deadline is not None:
                self.timed.add(msg.reduction_id)

    def _answer_queries(self, red: Reduction) -> None:
        """Answer every waiting ``reduced_objects`` query (the reduction failed or finished)."""
        for q in red.queries:
            self.outbox.send(q.node_id, reduced_reply(q.request_id, red))
        red.queries.clear()

    # ------------------------------------------------------------ bookkeeping
    def unawait(self, oid: bytes, rid: bytes) -> None:
        """Reduction ``rid`` no longer waits for input ``oid``."""
        unindex(self.awaiting, oid, rid)

    def forget(self, rid: bytes) -> None:
        """Forget reduction ``rid`` (deleted, or finished long ago): its inputs no longer count
        against its requester's quota."""
        red = self.reductions.pop(rid, None)
        if red is not None:
            self.members.release_reduction(red)

    def _forget_old(self) -> None:
        """Keep at most :data:`~.config.REDUCTIONS_KEPT` finished or failed reductions (oldest go
        first)."""
        excess = len(self.reductions) - REDUCTIONS_KEPT
        if excess <= 0:
            return
        for rid in [rid for rid, red in self.reductions.items() if not red.active][:excess]:
            self.forget(rid)

    def _make_room(self, node_id: str, cost: int) -> bool:
        """Whether a new reduction of ``cost`` inputs (:func:`~.membership.reduction_cost`) fits
        ``node_id``'s quota of inputs, after forgetting as many of its finished or failed
        reductions as that takes (oldest first); unfinished ones are never forgotten."""
        members = self.members
        if members.reduce_inputs_fit(node_id, cost):
            return True
        if cost > self.config.max_reduce_inputs:
            return False
        done = [rid for rid, red in self.reductions.items() if red.requester == node_id and not red.active]
        for rid in done:
            self.forget(rid)
            if members.reduce_inputs_fit(node_id, cost):
                return True
        return False

    def deadlines(self) -> list[float]:
        """The deadlines of reductions waiting for inputs and of queries waiting for them."""
        out: list[float] = []
        for rid in list(self.timed):
            red = self.reductions.get(rid)
            waits: list[float] = []
            if red is not None:
                if red.deadline is not None and red.active and not red.plan.full:
                    waits.append(red.deadline)
                waits.extend(q.deadline for q in red.queries if q.deadline is not None)
            if waits:
                out.extend(waits)
            else:
                self.timed.discard(rid)  # it waits for nothing (until marked again)
        return out

    def mark_timed(self, red: Reduction) -> None:
        """``red`` may wait with a deadline from now on (see ``timed``): its timeout was set or
        restarted, or its plan replaced (a full plan placed only grows: it is full until then)."""
        if red.deadline is not None:
            self.timed.add(red.plan.reduction_id)

    def expire(self, now: float) -> None:
        """Fail the reductions that did not get their inputs in time, and answer the queries
        that waited too long."""
        for red in list(self.reductions.values()):
            if red.active and not red.plan.full and red.deadline is not None and red.deadline <= now:
                plan = red.plan
                if red.gather is not None:
                    text = (
                        f"reduction {plan.reduction_id.hex()}: the {red.gather.seen} of its "
                        f"{len(red.candidates)} inputs that became ready within its timeout do not decode"
                    )
                else:
                    text = (
                        f"reduction {plan.reduction_id.hex()}: only {len(plan.placed)} of "
                        f"{plan.num_objects} inputs became ready within its timeout; {not_ready(plan)}"
                    )
                self.fail(red, "HopliteTimeoutError", text, now)
            expired = [q for q in red.queries if q.deadline is not None and q.deadline <= now]
            for q in expired:
                red.queries.remove(q)
                self.outbox.send(q.node_id, late_reply(q.request_id, red))
