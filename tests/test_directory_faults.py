"""Failures in the pure directory state machine: leases, suspects, lost objects, tree repair."""

from __future__ import annotations

import math

import pytest

from hoplite_gpu.directory.reduce import vertex_object_id
from hoplite_gpu.directory.state import (
    MAX_REPAIRS,
    DirectoryState,
    Disconnect,
    LocationState,
    NodeJoined,
    NodeLeft,
    Tick,
)
from hoplite_gpu.protocol import (
    DeleteReply,
    DeleteRequest,
    DropObject,
    Heartbeat,
    LookupReply,
    LookupRequest,
    ReduceChild,
    ReducedObjectsReply,
    ReducedObjectsRequest,
    ReduceReply,
    ReduceRequest,
    ReduceTask,
    Restore,
    ServeDone,
    TransferDone,
    VertexDone,
)
from tests import test_directory_reduce as reduce_tests
from tests.test_directory_reduce import NODES, RID, MiB, oid, put, reduce, req, sent

pytestmark = pytest.mark.timeout(30)

BIG = 256 * MiB  # reduce trees of this size are chains (degree 1)


def make_state(lease: float = 5.0) -> DirectoryState:
    return reduce_tests.make_state(lease)


def lookup(state, node, i, have=0, now=0.0, request_id=4):
    ((_, reply),) = sent(
        req(state, node, LookupRequest(request_id, oid(i), 0.0, have_bytes=have), now), LookupReply
    )
    return reply


def kinds(state, kind):
    return [e for e in state.events if e["kind"] == kind]


# ---------------------------------------------------------------- leases
def test_a_silent_node_is_declared_dead_when_its_lease_ends() -> None:
    state = make_state(lease=5.0)
    for node in "AB":
        req(state, node, Heartbeat(), now=3.0)
    assert state.next_deadline() == 5.0  # C..H were last heard of at 0
    assert state.handle(Tick(4.99)) == []
    out = state.handle(Tick(5.0))
    assert sorted(i.node_id for i in out if isinstance(i, Disconnect)) == list("CDEFGH")
    assert sorted(state.nodes) == ["A", "B"]
    assert state.next_deadline() == 8.0
    # A message from a node declared dead is not acted on.
    assert req(state, "C", LookupRequest(1, oid(0), 0.0), now=5.5) == []


def test_a_stalled_directory_renews_leases_instead_of_declaring_nodes_dead() -> None:
    state = make_state(lease=5.0)
    assert state.handle(Tick(9.0, lag=4.0)) == []
    assert len(state.nodes) == len(NODES) and kinds(state, "directory_stalled")
    assert state.next_deadline() == 14.0


def test_lease_and_reduction_deadlines_are_found_without_walking_every_node_and_reduction() -> None:
    # next_deadline runs after every event: it keeps a lower bound of the nodes' last heartbeats
    # (renewed at a Tick) and the reductions that wait with a deadline, not a walk over all of them.
    state = make_state(lease=5.0)
    assert state.next_deadline() == 5.0
    for node in NODES:
        req(state, node, Heartbeat(), now=3.0)
    assert state.next_deadline() == 5.0  # the bound stays early until a Tick checks the leases
    assert [i for i in state.handle(Tick(5.0)) if isinstance(i, Disconnect)] == []
    assert state.next_deadline() == 8.0
    state.handle(NodeJoined("Z", "127.0.0.1", 9000, 6.0))
    reduce(state, ids=(0, 1), timeout=4.0, now=6.0)
    assert state.next_deadline() == 8.0 and state.reducer.timed == {RID}
    for node in "ABZ":
        req(state, node, Heartbeat(), now=7.5)
    put(state, "A", 0, now=7.5)
    put(state, "B", 1, now=7.5)  # the plan is full: the reduction waits for no input now
    dead = [i.node_id for i in state.handle(Tick(8.0)) if isinstance(i, Disconnect)]
    assert sorted(dead) == list("CDEFGH")
    assert state.next_deadline() == 12.5 and state.reducer.timed == set()
    # B, holding an input placed in the tree, leaves: the tree is rebuilt and waits again.
    state.handle(NodeLeft("B", 9.0))
    assert state.reducer.timed == {RID}
    for node in "AZ":
        req(state, node, Heartbeat(), now=12.0)
    assert state.handle(Tick(12.5)) == []
    assert state.next_deadline() == 13.0  # the reduction's restarted timeout (the leases: 17.0)
    state.handle(Tick(13.0))
    assert [e["error_kind"] for e in state.events if e["kind"] == "reduce_failed"] == ["HopliteTimeoutError"]
    assert state.next_deadline() == 17.0 and state.reducer.timed == set()


# ---------------------------------------------------------------- broadcast
def test_a_receiver_whose_sender_failed_gets_another_source_and_resumes() -> None:
    state = make_state()
    put(state, "A", 0, BIG)
    first = lookup(state, "B", 0)
    assert first.sender_node == "A"
    req(state, "B", TransferDone(first.transfer_id, True, BIG))  # B holds a complete copy too
    pulling = lookup(state, "C", 0)
    assert pulling.sender_node == "A"
    # A stalls half way: C reports it and asks again with what it holds.
    req(state, "C", TransferDone(pulling.transfer_id, False, BIG // 2, sender_failed=True), now=1.0)
    assert state.nodes["A"].suspect_since == 1.0
    again = lookup(state, "C", 0, have=BIG // 2, now=1.0)
    assert again.status == "pull" and again.sender_node == "B"
    start = kinds(state, "transfer_start")[-1]
    assert start["receiver"] == "C" and start["sender"] == "B"
    assert state.objects[oid(0)].locations["C"].progress == BIG // 2  # resumes, nothing twice
    # A heartbeat sent before the stall proves nothing; one well after it restores trust.
    req(state, "A", Heartbeat(), now=1.1)
    assert state.nodes["A"].suspect_since == 1.0
    req(state, "A", Heartbeat(), now=2.0)
    assert state.nodes["A"].suspect_since is None
    assert lookup(state, "D", 0, now=2.0).sender_node == "A"


def test_a_copy_a_reader_found_withdrawn_is_not_offered_again_and_the_last_is_lost() -> None:
    # A collective withdraws results it received into the caller's memory without telling the
    # directory; the soak saw a reader offered such a copy until it gave up with an untyped error.
    state = make_state()
    put(state, "A", 0, BIG)
    for node in "BC":
        first = lookup(state, node, 0)
        req(state, node, TransferDone(first.transfer_id, True, BIG))
    offered = lookup(state, "D", 0)
    req(state, "D", TransferDone(offered.transfer_id, False, 0, sender_lacks=True), now=1.0)
    assert offered.sender_node not in state.objects[oid(0)].locations
    assert state.nodes[offered.sender_node].suspect_since is None  # alive: it only dropped it
    again = lookup(state, "D", 0, now=1.0)
    second = again.sender_node
    assert again.status == "pull" and second != offered.sender_node
    req(state, "D", TransferDone(again.transfer_id, False, 0, sender_lacks=True), now=1.1)
    (last,) = {"A", "B", "C"} - {offered.sender_node, second}
    third = lookup(state, "D", 0, now=1.1)
    assert third.sender_node == last
    # The last complete copy gone, and nobody computing it: lost, not offered again and again (a
    # soak run: a survivor gave up with an untyped error 20 ms before the typed one).
    req(state, "D", TransferDone(third.transfer_id, False, 0, sender_lacks=True), now=1.2)
    assert oid(0) not in state.objects and kinds(state, "object_lost")
    lost = lookup(state, "D", 0, have=0, now=1.2)
    assert lost.status == "error" and lost.error_kind == "ObjectLostError"


def test_after_a_relay_dies_its_downstream_never_pulls_from_its_own_descendants() -> None:
    state = make_state()
    put(state, "A", 0, BIG)
    assert lookup(state, "B", 0).sender_node == "A"
    assert lookup(state, "C", 0).sender_node == "B"
    d = lookup(state, "D", 0)
    assert d.sender_node == "C"
    state.handle(NodeLeft("B", 1.0))
    assert state.objects[oid(0)].locations["C"].upstream is None
    # A is busy (it was serving B: freed now). C gets A, never D (D depends on C).
    c_again = lookup(state, "C", 0, have=MiB, now=1.0)
    assert c_again.sender_node == "A"
    assert state.objects[oid(0)].locations["D"].upstream == "C"


def test_an_object_whose_last_complete_copy_died_is_lost_until_put_again() -> None:
    state = make_state()
    put(state, "A", 0, BIG)
    b = lookup(state, "B", 0)
    assert b.sender_node == "A"
    assert lookup(state, "C", 0).sender_node == "B"  # a pipelined chain A -> B -> C
    assert lookup(state, "D", 0).sender_node == "C"
    out = state.handle(NodeLeft("A", 1.0))
    assert sorted(sent(out, DropObject)) == [(n, DropObject(oid(0), reason="lost")) for n in "BCD"]
    assert oid(0) not in state.objects and kinds(state, "object_lost")
    # A receiver that held bytes learns it at once; a new reader (past the lease after the loss)
    # waits for the object to be put.
    assert lookup(state, "B", 0, have=MiB, now=2.0).error_kind == "ObjectLostError"
    assert sent(req(state, "H", LookupRequest(8, oid(0), 0.0), 6.5), LookupReply) == []
    out = put(state, "E", 0, BIG, now=7.0)  # the restarted task puts it again under the same id
    assert state.objects[oid(0)].owner == "E"
    assert [(n, m.sender_node) for n, m in sent(out, LookupReply)] == [("H", "E")]


def test_a_receiver_whose_sender_died_before_any_byte_learns_the_object_was_lost() -> None:
    # Found by tests/test_soak.py: the sender is killed as it starts serving; the receiver reports
    # the failed transfer with nothing received before the directory sees the sender die, so its
    # empty copy is no location to drop. Its next lookup (have_bytes 0) says it resumes.
    state = make_state()
    put(state, "A", 0, BIG)
    b = lookup(state, "B", 0)
    req(state, "B", TransferDone(b.transfer_id, False, 0, sender_failed=True), now=1.0)
    assert "B" not in state.objects[oid(0)].locations
    out = state.handle(NodeLeft("A", 1.1))
    assert sent(out, DropObject) == [] and kinds(state, "object_lost")
    resumed = LookupRequest(5, oid(0), 0.0, have_bytes=0, resume=True)
    ((node, reply),) = sent(req(state, "B", resumed, 1.2), LookupReply)
    assert (node, reply.status, reply.error_kind) == ("B", "error", "ObjectLostError")
    # A first lookup of the same id a lease after the loss is a get before the (next) put: it waits.
    assert sent(req(state, "C", LookupRequest(6, oid(0), 0.0), 6.2), LookupReply) == []


def test_a_first_lookup_that_raced_the_loss_fails_at_once() -> None:
    # Found by tests/test_soak.py (about one run in a thousand): receivers of a broadcast ask on
    # their own channels; the source dies as it starts serving the first of them, and the lookup
    # of a slower one reaches the directory just after the loss. It used to wait its whole timeout
    # for a put that never came; within the lease after the loss it fails as the waiting ones did.
    state = make_state(lease=5.0)
    put(state, "A", 0, BIG)
    assert lookup(state, "B", 0).sender_node == "A"
    state.handle(NodeLeft("A", 1.0))
    assert kinds(state, "object_lost")
    ((node, reply),) = sent(req(state, "C", LookupRequest(6, oid(0), 60.0), 1.05), LookupReply)
    assert (node, reply.status, reply.error_kind) == ("C", "error", "ObjectLostError")
    assert lookup(state, "D", 0, now=6.0).error_kind == "ObjectLostError"  # the lease's last instant
    # Past the lease, a first lookup is a get before the next put; a put clears the loss at once.
    assert sent(req(state, "E", LookupRequest(7, oid(0), 60.0), 6.01), LookupReply) == []
    put(state, "F", 0, BIG, now=6.5)
    state.handle(NodeLeft("F", 7.0))  # lost again: remembered from the new loss
    assert lookup(state, "G", 0, now=7.5).error_kind == "ObjectLostError"
    put(state, "H", 0, BIG, now=8.0)
    assert lookup(state, "G", 0, now=8.1).sender_node == "H"


def test_a_surviving_complete_copy_keeps_the_object() -> None:
    state = make_state()
    put(state, "A", 0, BIG)
    b = lookup(state, "B", 0)
    req(state, "B", TransferDone(b.transfer_id, True, BIG))
    out = state.handle(NodeLeft("A", 1.0))
    assert sent(out, DropObject) == [] and oid(0) in state.objects
    assert lookup(state, "C", 0, now=1.0).sender_node == "B"


# ---------------------------------------------------------------- reduce
def chain(state, n=4, k=None):
    """Reduce inputs 0..n-1, put in order by nodes B, C, D, ... (A requested it)."""
    reduce(state, ids=tuple(range(n)), k=k)
    tasks = []
    for i in range(n):
        tasks += sent(put(state, NODES[i + 1], i, BIG), ReduceTask)
    return tasks


def test_a_dead_inner_node_rebuilds_the_tree_and_waits_for_its_input_again() -> None:
    state = make_state()
    old = chain(state, n=4)
    assert [m.epoch for _, m in old] == [0, 0, 0]
    ((_, pulling),) = sent(req(state, "G", LookupRequest(5, RID, 0.0)), LookupReply)
    assert pulling.status == "pull"
    out = state.handle(NodeLeft("C", 1.0))  # C held input 1 and computed a vertex
    drops = sent(out, DropObject)
    assert ("G", DropObject(RID, reason="reset")) in drops  # the reader's partial result is void
    assert all(d.reason == "deleted" for _, d in drops if d.object_id != RID)
    new = sent(out, ReduceTask)
    assert new and all(m.epoch == 1 for _, m in new)
    red = state.reductions[RID]
    assert red.plan.epoch == 1 and red.plan.reduced_objects() == [oid(0), oid(2), oid(3)]
    assert not red.plan.full and oid(1) in state.awaiting
    assert kinds(state, "reduce_repair")[0]["epoch"] == 1
    # The restarted task puts input 1 again (on another node): the tree completes.
    out = put(state, "F", 1, BIG, now=2.0)
    assert red.plan.full and red.plan.reduced_objects() == [oid(0), oid(2), oid(3), oid(1)]
    root = red.plan.by_vertex[0]
    assert root.output_id == RID
    # A stale vertex of epoch 0 reporting in changes nothing.
    assert req(state, root.node_id, VertexDone(RID, 0, True, epoch=0), 3.0) == []
    assert not red.done
    # The reader's new lookup (from byte 0) is answered from the new root.
    ((_, answer),) = sent(req(state, "G", LookupRequest(6, RID, 0.0), 3.0), LookupReply)
    assert answer.status == "pull" and answer.sender_node == root.node_id
    out = req(state, root.node_id, VertexDone(RID, 0, True, epoch=1), 4.0)
    assert red.done
    ((_, which),) = sent(req(state, "A", ReducedObjectsRequest(3, RID), 4.0), ReducedObjectsReply)
    assert which.object_ids == [oid(0), oid(2), oid(3), oid(1)]
    # Intermediate ids of the new tree differ from the old ones.
    assert vertex_object_id(RID, 1, 1) != vertex_object_id(RID, 1, 0)


def test_first_k_replaces_a_dead_input_holder_with_the_next_ready_input() -> None:
    state = make_state()
    chain(state, n=4, k=2)  # inputs 0 (B) and 1 (C) are reduced; 2 and 3 are ready spares
    red = state.reductions[RID]
    assert red.plan.reduced_objects() == [oid(0), oid(1)]
    out = state.handle(NodeLeft("C", 1.0))
    assert red.plan.full and red.plan.reduced_objects() == [oid(0), oid(2)]
    assert sent(out, ReduceTask)
    assert oid(1) not in state.awaiting  # full again: nobody waits for the lost input


def test_a_reduction_whose_result_a_reader_already_holds_is_done_not_rebuilt() -> None:
    state = make_state()
    chain(state, n=2)
    root = state.reductions[RID].plan.by_vertex[0]
    ((_, pulling),) = sent(req(state, "G", LookupRequest(5, RID, 0.0)), LookupReply)
    req(state, "G", TransferDone(pulling.transfer_id, True, BIG))
    out = state.handle(NodeLeft(root.node_id, 1.0))
    red = state.reductions[RID]
    assert red.done and red.plan.epoch == 0 and sent(out, ReduceTask) == []
    assert state.objects[RID].locations["G"].state is LocationState.COMPLETE


def test_a_vertex_that_lost_a_source_rebuilds_and_a_plain_failure_fails() -> None:
    state = make_state()
    chain(state, n=3)
    red = state.reductions[RID]
    root = red.plan.by_vertex[0]
    out = req(state, root.node_id, VertexDone(RID, 0, False, "peer lost", epoch=0, retry=True), 1.0)
    assert red.active and red.plan.epoch == 1 and sent(out, ReduceTask)
    root = red.plan.by_vertex[0]
    req(state, root.node_id, VertexDone(RID, 0, False, "store full", epoch=1), 2.0)
    assert red.error is not None and red.error[0] == "ReductionFailedError"


def test_a_reduction_failing_again_and_again_gives_up() -> None:
    state = make_state()
    chain(state, n=2)
    red = state.reductions[RID]
    for attempt in range(MAX_REPAIRS + 1):
        root = red.plan.by_vertex[0]
        req(state, root.node_id, VertexDone(RID, 0, False, "x", epoch=red.plan.epoch, retry=True), attempt)
    assert red.error is not None and "failed" in red.error[1]


def test_a_child_announced_after_a_rebuild_carries_the_new_epoch() -> None:
    state = make_state()
    reduce(state, ids=(0, 1, 2))
    put(state, "B", 0, BIG)
    put(state, "C", 1, BIG)
    out = state.handle(NodeLeft("B", 1.0))  # input 0 lost; C's input placed first now
    assert all(m.epoch == 1 for _, m in sent(out, ReduceTask))
    out = put(state, "D", 2, BIG, now=2.0)
    assert all(m.epoch == 1 for _, m in sent(out, ReduceChild) + sent(out, ReduceTask))


# ---------------------------------------------------------------- a result complete before a repair
# A node may hold the whole result of a tree before the directory hears of it: a reader got every
# byte from a root killed before its VertexDone, or a root finished from a child killed just after
# streaming all of it. Node._drop keeps a complete copy through a reset (its get may have returned
# it), so its late report adopts that tree (tests/test_soak.py found "wrong reduction (reduce at
# 0.99, k=3)": the reader's result was the old tree's, reduced_objects named the new tree's inputs).


def reduced(state, now):
    ((_, which),) = sent(req(state, "A", ReducedObjectsRequest(3, RID), now), ReducedObjectsReply)
    return which.object_ids


def test_a_reader_holding_the_whole_result_when_its_root_died_unseen_adopts_the_old_tree() -> None:
    state = make_state()
    chain(state, n=4, k=3)  # inputs 0 (B), 1 (C), 2 (D) reduced, D computes the root; 3 (E) spare
    red = state.reductions[RID]
    assert red.plan.by_vertex[0].node_id == "D" and red.plan.reduced_objects() == [oid(0), oid(1), oid(2)]
    pulling = lookup_result(state, "G")
    assert pulling.status == "pull" and pulling.sender_node == "D"
    # D streams the last byte to G and dies before its VertexDone; G's TransferDone (sent first,
    # on another connection) reaches the directory after D's death.
    out = state.handle(NodeLeft("D", 1.0))
    assert ("G", DropObject(RID, reason="reset")) in sent(out, DropObject)  # G keeps its copy
    new = red.plan
    assert new.epoch == 1 and new.reduced_objects() == [oid(0), oid(1), oid(3)]  # 2 died with D
    out = req(state, "G", TransferDone(pulling.transfer_id, True, BIG), 1.1)
    assert red.done and red.plan.epoch == 0 and kinds(state, "reduce_adopted")[0]["replaced"] == 1
    assert reduced(state, 1.1) == [oid(0), oid(1), oid(2)]  # the inputs of G's copy
    # The new tree is cancelled: its intermediates are dropped, its root's node resets it.
    drops = sent(out, DropObject)
    for pl in new.placed:
        if pl.runs_task:
            reason = "reset" if pl.parent is None else "deleted"
            assert (pl.node_id, DropObject(pl.output_id, reason=reason)) in drops
    assert not any(node == "G" for node, _ in drops)
    assert set(state.objects[RID].locations) == {"G"}
    assert state.objects[RID].locations["G"].state is LocationState.COMPLETE
    assert lookup_result(state, "H", now=1.2).sender_node == "G"  # the result is G's copy
    # The new root, cancelled, reports late: its copy (if it finished) is dropped.
    root = new.by_vertex[0].node_id
    out = req(state, root, VertexDone(RID, 0, True, epoch=1), 1.3)
    assert sent(out, DropObject) == [(root, DropObject(RID))] and red.plan.epoch == 0


def test_a_root_that_finished_as_its_childs_node_died_unseen_adopts_the_old_tree() -> None:
    state = make_state()
    chain(state, n=4, k=3)  # C computes vertex 1 from B's input, D the root from C's output
    red = state.reductions[RID]
    assert red.plan.by_vertex[1].node_id == "C"
    reading = lookup_result(state, "G")
    out = state.handle(NodeLeft("C", 1.0))  # D read all of C's output and finished meanwhile
    assert ("D", DropObject(RID, reason="reset")) in sent(out, DropObject)  # D keeps its copy
    assert ("G", DropObject(RID, reason="reset")) in sent(out, DropObject)  # G's partial copy is void
    new = red.plan
    assert new.reduced_objects() == [oid(0), oid(2), oid(3)] and new.by_vertex[0].node_id != "D"
    req(state, "G", TransferDone(reading.transfer_id, False, MiB), 1.05)  # G gives up its copy
    out = req(state, "D", VertexDone(RID, 0, True, epoch=0), 1.1)  # sent before the reset came
    assert red.done and red.plan.epoch == 0
    assert reduced(state, 1.1) == [oid(0), oid(1), oid(2)]
    assert state.objects[RID].locations["D"].state is LocationState.COMPLETE
    assert (new.by_vertex[0].node_id, DropObject(RID, reason="reset")) in sent(out, DropObject)
    again = lookup_result(state, "G", now=1.2)
    assert again.status == "pull" and again.sender_node == "D"


def test_a_reduction_whose_requester_left_fails_at_once() -> None:
    # Found by tests/test_soak.py: a collective's member requests the reduction of everyone's
    # shard and dies with its own input; nobody puts that again, so the reduction, its vertices'
    # partial outputs and the others' inputs were held until its timeout (or for ever).
    state = make_state()
    reduce(state, node="A", ids=(0, 1, 2))
    for i, node in enumerate("ABC"):
        put(state, node, i, BIG)
    state.handle(NodeLeft("A", 1.0))
    red = state.reductions[RID]
    assert not red.active and red.error is not None and red.error[0] == "ObjectLostError"
    reply = lookup_result(state, "D", now=1.1)
    assert reply.error_kind == "ObjectLostError" and "which requested it" in reply.error
    assert not any(pl.output_id in state.objects for pl in red.plan.placed if pl.runs_task)
    # A reduction another node requested goes on without A's input (first-k): not failed.
    state2 = make_state()
    reduce(state2, node="B", ids=(0, 1, 2), k=2)
    for i, node in enumerate("ABC"):
        put(state2, node, i, BIG)
    state2.handle(NodeLeft("A", 1.0))
    assert state2.reductions[RID].active


def test_a_rebuilt_tree_gives_its_root_to_a_node_other_than_one_that_may_hold_the_old_result() -> None:
    state = make_state()
    reduce(state, ids=(0, 1, 2), k=2)
    for i, node in enumerate("ABC"):
        put(state, node, i, BIG)
    red = state.reductions[RID]
    # The requester A computes the root from B's input; C's input is a spare.
    assert [(pl.vertex, pl.node_id) for pl in red.plan.placed] == [(0, "A"), (1, "B")]
    # B dies after streaming its whole input: A's root finished and A's get returned it.
    out = state.handle(NodeLeft("B", 1.0))
    assert ("A", DropObject(RID, reason="reset")) in sent(out, DropObject)
    # A's own input does not compute the new root: that task would replace A's copy before its
    # VertexDone, sent before the reset came, could adopt the old tree.
    assert [(pl.vertex, pl.node_id) for pl in red.plan.placed] == [(1, "A"), (0, "C")]
    out = req(state, "A", VertexDone(RID, 0, True, epoch=0), 1.1)
    assert red.done and reduced(state, 1.1) == [oid(0), oid(1)]
    assert ("C", DropObject(RID, reason="reset")) in sent(out, DropObject)


def test_without_a_late_report_the_rebuilt_tree_finishes_as_usual() -> None:
    state = make_state()
    chain(state, n=4, k=3)
    red = state.reductions[RID]
    lookup_result(state, "G")
    state.handle(NodeLeft("D", 1.0))  # G had not got every byte: no report adopts the old tree
    root = red.plan.by_vertex[0].node_id
    req(state, root, VertexDone(RID, 0, True, epoch=1), 2.0)
    assert red.done and red.plan.epoch == 1 and reduced(state, 2.0) == [oid(0), oid(1), oid(3)]
    assert not red.past and not kinds(state, "reduce_adopted")


def test_a_complete_copy_reported_after_the_rebuilt_tree_finished_is_dropped() -> None:
    state = make_state()
    chain(state, n=4, k=3)
    red = state.reductions[RID]
    pulling = lookup_result(state, "G")
    state.handle(NodeLeft("D", 1.0))
    root = red.plan.by_vertex[0].node_id
    req(state, root, VertexDone(RID, 0, True, epoch=1), 2.0)  # the new tree won the race
    out = req(state, "G", TransferDone(pulling.transfer_id, True, BIG), 2.1)
    assert sent(out, DropObject) == [("G", DropObject(RID))]  # a copy of a tree nobody uses
    assert red.plan.epoch == 1 and reduced(state, 2.1) == [oid(0), oid(1), oid(3)]
    assert kinds(state, "reduce_stale_copy")


def test_a_complete_copy_of_the_rebuilt_trees_result_wins_over_a_later_report_of_the_old() -> None:
    state = make_state()
    chain(state, n=4, k=3)
    red = state.reductions[RID]
    pulling = lookup_result(state, "G")
    state.handle(NodeLeft("D", 1.0))
    root = red.plan.by_vertex[0].node_id
    reading = lookup_result(state, "H", now=1.5, request_id=6)
    assert reading.sender_node == root
    req(state, "H", TransferDone(reading.transfer_id, True, BIG), 2.0)  # before the root reports
    out = req(state, "G", TransferDone(pulling.transfer_id, True, BIG), 2.1)
    assert sent(out, DropObject) == [("G", DropObject(RID))] and red.active and red.plan.epoch == 1
    req(state, root, VertexDone(RID, 0, True, epoch=1), 2.2)
    assert red.done and reduced(state, 2.2) == [oid(0), oid(1), oid(3)]


def test_a_reader_that_got_the_whole_result_from_a_dying_relay_holds_a_complete_copy() -> None:
    state = make_state()
    chain(state, n=2)
    red = state.reductions[RID]
    assert lookup_result(state, "G").sender_node == red.plan.by_vertex[0].node_id
    relayed = lookup_result(state, "H", request_id=6)
    assert relayed.sender_node == "G"
    state.handle(NodeLeft("G", 1.0))  # a reader, not a vertex: the tree stands
    assert red.active and red.plan.epoch == 0
    req(state, "H", TransferDone(relayed.transfer_id, True, BIG), 1.1)
    assert state.objects[RID].locations["H"].state is LocationState.COMPLETE


def test_a_finished_reduction_whose_result_was_lost_still_names_its_inputs() -> None:
    # The soak: the owner's get had every byte of the result when the root died serving it (its
    # report crossed the loss); it then asked which inputs it holds the sum of.
    state = make_state()
    chain(state, n=4, k=3)
    red = state.reductions[RID]
    root = red.plan.by_vertex[0].node_id
    pulling = lookup_result(state, "A")
    assert pulling.sender_node == root
    req(state, root, VertexDone(RID, 0, True, epoch=0), 1.0)
    assert red.done
    state.handle(NodeLeft(root, 1.1))
    assert RID not in state.objects and kinds(state, "object_lost")
    req(state, "A", TransferDone(pulling.transfer_id, True, BIG), 1.2)
    assert reduced(state, 1.2) == [oid(0), oid(1), oid(2)]
    lost = lookup_result(state, "G", now=1.3)
    assert lost.status == "error" and lost.error_kind == "ObjectLostError"  # readers still fail


def lookup_result(state, node, now=0.0, request_id=5):
    ((_, reply),) = sent(req(state, node, LookupRequest(request_id, RID, 0.0), now), LookupReply)
    return reply


# ---------------------------------------------------------------- directory restart
def restarted(lease: float = 5.0, now: float = 100.0) -> DirectoryState:
    """A fresh directory (the old one died) that nodes A..H rejoin at ``now``."""
    return reduce_tests.make_state(lease, now, rejoin=True)


def restore(state, node, i, size=BIG, owner=False, now=100.0):
    return req(state, node, Restore(oid(i), size, "<f4", [size // 4], b"d" * 16, owner=owner), now)


def test_a_resumed_lookup_waits_for_its_source_to_rejoin_while_the_directory_recovers() -> None:
    state = restarted()
    assert kinds(state, "directory_recovering") and state.next_deadline() == 105.0
    # B was receiving object 0 from A when the old directory died; B asks first.
    assert sent(req(state, "B", LookupRequest(4, oid(0), 0.0, have_bytes=MiB), 100.1), LookupReply) == []
    out = restore(state, "A", 0, owner=True, now=100.2)
    ((node, reply),) = sent(out, LookupReply)
    assert (node, reply.status, reply.sender_node) == ("B", "pull", "A")
    assert state.objects[oid(0)].owner == "A" and state.transfers  # resumes from the bytes it holds


def test_a_resumed_lookup_of_an_object_nobody_restored_is_lost_when_recovery_ends() -> None:
    state = restarted()
    req(state, "B", LookupRequest(4, oid(0), 0.0, have_bytes=MiB), 100.1)
    req(state, "C", LookupRequest(5, oid(0), 0.0), 100.1)  # a get before the put: keeps waiting
    for node in NODES:
        req(state, node, Heartbeat(), 104.0)
    assert state.handle(Tick(104.9)) == []
    out = state.handle(Tick(105.0))
    ((node, reply),) = sent(out, LookupReply)
    assert (node, reply.status, reply.error_kind) == ("B", "error", "ObjectLostError")
    assert [pl.node_id for pl in state.pending[oid(0)]] == ["C"]
    assert state.recovering_until is None and kinds(state, "directory_recovered")
    # Recovery over: a resumed lookup of an unknown object fails at once again.
    ((_, reply),) = sent(req(state, "D", LookupRequest(6, oid(1), 0.0, have_bytes=1), 106.0), LookupReply)
    assert reply.error_kind == "ObjectLostError"


def test_a_resumed_empty_lookup_of_an_object_nobody_restored_is_lost_when_recovery_ends() -> None:
    state = restarted()
    req(state, "B", LookupRequest(4, oid(0), 0.0, resume=True), 100.1)  # waits for a restore
    for node in NODES:
        req(state, node, Heartbeat(), 104.0)
    ((node, reply),) = sent(state.handle(Tick(105.0)), LookupReply)
    assert (node, reply.error_kind) == ("B", "ObjectLostError")


def test_a_node_the_directory_declared_dead_rejoining_does_not_start_a_recovery() -> None:
    state = make_state()
    state.handle(NodeJoined("Z", "127.0.0.1", 7999, 1.0))  # not a restart: rejoin=False
    assert state.recovering_until is None


def test_a_reduction_resent_after_a_restart_runs_again_from_the_restored_inputs() -> None:
    state = restarted(lease=math.inf)
    for i, node in enumerate("ABCD"):
        restore(state, node, i, owner=True)
    out = req(state, "A", ReduceRequest(9, RID, [oid(i) for i in range(4)], "sum", 4, rejoin=True), 100.5)
    assert sent(out, ReduceReply) == [("A", ReduceReply(request_id=9))]
    assert len(sent(out, ReduceTask)) == 3  # a chain of 4: every vertex but the tail runs a task
    assert state.objects[RID].reduction == RID  # a copy of the running result is void on a restart
    ((_, reply),) = sent(req(state, "H", LookupRequest(6, RID, 0.0), 100.6), LookupReply)
    assert reply.reduction_id == RID


def test_a_resent_reduction_runs_under_an_epoch_the_lost_directorys_trees_did_not_have() -> None:
    # The lost directory's tree of it may still wind down on its nodes (epoch 0, intermediate ids
    # of epoch 0): its late reports and clean-up must not pass for the new tree's. The restart
    # soak saw a new vertex's output deleted by the old one's node ("output is not registered").
    state = restarted(lease=math.inf)
    for i, node in enumerate("ABCD"):
        restore(state, node, i, owner=True)
    out = req(state, "A", ReduceRequest(9, RID, [oid(i) for i in range(4)], "sum", 4, rejoin=True), 100.5)
    tasks = [task for _, task in sent(out, ReduceTask)]
    epoch = state.reductions[RID].plan.epoch
    assert epoch > MAX_REPAIRS and {task.epoch for task in tasks} == {epoch}
    old_ids = {vertex_object_id(RID, v) for v in range(1, 4)}
    assert not old_ids & {task.output_id for task in tasks} and not old_ids & set(state.objects)
    # The old tree's root reporting late does not finish the new tree.
    root = state.reductions[RID].plan.by_vertex[0].node_id
    req(state, root, VertexDone(RID, 0, True, epoch=0), 100.6)
    assert state.reductions[RID].active
    # Another reduction re-sent to the same directory starts at the same epoch.
    other = b"s" * 20
    req(state, "B", ReduceRequest(10, other, [oid(i) for i in range(4)], "sum", 4, rejoin=True), 100.7)
    assert state.reductions[other].plan.epoch == epoch


def test_a_result_restored_by_a_reader_finishes_the_resent_reduction() -> None:
    # k = n: the inputs it reduced are known; k < n: which ones is not, and reduced_objects says so.
    for k, expect_error in ((4, False), (3, True)):
        state = restarted(lease=math.inf)
        req(state, "H", Restore(RID, BIG, "<f4", [BIG // 4], b""), 100.0)
        msg = ReduceRequest(9, RID, [oid(i) for i in range(4)], "sum", k, rejoin=True)
        assert sent(req(state, "A", msg, 100.1), ReduceReply) == [("A", ReduceReply(request_id=9))]
        red = state.reductions[RID]
        assert red.done and red.restored
        ((_, reply),) = sent(req(state, "A", ReducedObjectsRequest(3, RID), 100.2), ReducedObjectsReply)
        if expect_error:
            assert reply.error_kind == "ObjectNotFoundError" and not reply.object_ids
        else:
            assert reply.object_ids == [oid(i) for i in range(4)]
        ((_, lookup_reply),) = sent(req(state, "G", LookupRequest(6, RID, 0.0), 100.3), LookupReply)
        assert (lookup_reply.sender_node, lookup_reply.reduction_id) == ("H", b"")


def test_a_result_restored_before_its_reduction_was_resent_is_the_requesters_to_delete() -> None:
    state = restarted(lease=math.inf)
    req(state, "H", Restore(RID, BIG, "<f4", [BIG // 4], b""), 100.0)  # a reader's copy
    req(state, "A", ReduceRequest(9, RID, [oid(i) for i in range(4)], "sum", 3, rejoin=True), 100.1)
    out = req(state, "A", DeleteRequest(10, RID), 100.2)
    assert sent(out, DeleteReply) == [("A", DeleteReply(request_id=10, deleted=True))]
    assert ("H", DropObject(RID)) in sent(out, DropObject)
    assert RID not in state.objects and RID not in state.reductions


def test_a_copy_of_a_result_of_other_inputs_is_not_restored_beside_the_one_computed_again() -> None:
    # The restart soak: the requester held the old tree's result (of inputs 0, 1, 2) and the
    # restarted directory computed the re-sent reduction (3 of 4) from the first inputs restored.
    state = restarted(lease=math.inf)
    req(state, "A", ReduceRequest(9, RID, [oid(i) for i in range(4)], "max", 3, rejoin=True), 100.0)
    for i, node in ((3, "E"), (1, "C"), (2, "D")):
        restore(state, node, i, owner=True, now=100.1)
    red = state.reductions[RID]
    root = red.plan.by_vertex[0].node_id
    req(state, root, VertexDone(RID, 0, True, epoch=red.plan.epoch), 100.2)
    assert red.done and not red.restored
    req(state, "H", Restore(RID, BIG, "<f4", [BIG // 4], b""), 100.3)
    assert list(state.objects[RID].locations) == [root] and kinds(state, "restore_conflict")
    ((_, which),) = sent(req(state, "A", ReducedObjectsRequest(3, RID), 100.4), ReducedObjectsReply)
    assert which.object_ids == [oid(3), oid(1), oid(2)]


def test_a_result_restored_after_its_reduction_was_resent_finishes_it() -> None:
    state = restarted(lease=math.inf)
    req(state, "A", ReduceRequest(9, RID, [oid(i) for i in range(4)], "sum", 4, rejoin=True), 100.0)
    for i, node in enumerate("ABC"):
        restore(state, node, i, owner=True, now=100.1)
    assert state.reductions[RID].active
    req(state, "H", Restore(RID, BIG, "<f4", [BIG // 4], b""), 100.2)
    red = state.reductions[RID]
    assert red.done and red.restored
    ((_, reply),) = sent(req(state, "A", ReducedObjectsRequest(3, RID), 100.3), ReducedObjectsReply)
    assert reply.object_ids == [oid(i) for i in range(4)]


def test_a_restored_copy_that_conflicts_with_the_known_object_is_ignored() -> None:
    state = restarted()
    restore(state, "A", 0, owner=True)
    req(state, "B", Restore(oid(0), MiB, "<f4", [MiB // 4], b"x" * 16), 100.0)
    assert list(state.objects[oid(0)].locations) == ["A"] and kinds(state, "restore_conflict")


def test_a_restored_copy_without_a_digest_still_conflicts_on_its_size_or_shape() -> None:
    # A reduction's result carries no digest: its size, dtype and shape are still checked.
    state = restarted()
    req(state, "H", Restore(RID, BIG, "<f4", [BIG // 4], b""), 100.0)
    req(state, "G", Restore(RID, MiB, "<f4", [MiB // 4], b""), 100.0)
    req(state, "F", Restore(RID, BIG, "<f4", [BIG // 8, 2], b""), 100.0)
    req(state, "D", Restore(RID, BIG, "<i4", [BIG // 4], b""), 100.0)
    assert list(state.objects[RID].locations) == ["H"] and len(kinds(state, "restore_conflict")) == 3
    req(state, "E", Restore(RID, BIG, "<f4", [BIG // 4], b"e" * 16), 100.0)  # its digest is adopted
    assert state.objects[RID].digest == b"e" * 16 and list(state.objects[RID].locations) == ["H", "E"]
    req(state, "C", Restore(RID, BIG, "<f4", [BIG // 4], b"c" * 16), 100.0)
    assert "C" not in state.objects[RID].locations and len(kinds(state, "restore_conflict")) == 4


def test_a_reader_given_the_root_vertex_reads_its_own_output_instead_of_pulling_it() -> None:
    state = make_state()
    reduce(state, node="G")  # G holds no input: in-order placement, the root last
    assert sent(req(state, "H", LookupRequest(6, RID, 0.0)), LookupReply) == []  # a reader waits
    for i, node in enumerate("ABC"):
        put(state, node, i, BIG)  # a chain: the root (vertex 0) is placed last
    out = put(state, "H", 3, BIG)
    ((node, task),) = sent(out, ReduceTask)
    assert (node, task.vertex, task.output_id) == ("H", 0, RID)
    replies = sent(out, LookupReply)
    assert [(n, r.status) for n, r in replies] == [("H", "local")]  # not a pull from itself


def test_a_sender_that_gave_up_on_a_stalled_receiver_serves_others_at_once() -> None:
    state = make_state()
    put(state, "A", 0, BIG)
    first = lookup(state, "B", 0)  # B will stop (SIGSTOP): it never reports
    assert first.sender_node == "A" and state.objects[oid(0)].locations["A"].busy
    req(state, "A", ServeDone(first.transfer_id, 0, 0, failed=True), now=1.0)
    assert not state.objects[oid(0)].locations["A"].busy
    assert lookup(state, "C", 0, now=1.1).sender_node == "A"  # the complete copy, not B's
