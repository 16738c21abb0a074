"""Reductions in the pure directory state machine: placement, tasks, results, failures, time."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hoplite_gpu.directory.config import DirectoryConfig
from hoplite_gpu.directory.reduce import vertex_object_id
from hoplite_gpu.directory.state import DirectoryState, LocationState, NodeJoined, NodeLeft, Request, Tick
from hoplite_gpu.protocol import (
    DeleteReply,
    DeleteRequest,
    DropObject,
    Heartbeat,
    LookupReply,
    LookupRequest,
    PutReply,
    PutRequest,
    ReduceChild,
    ReducedObjectsReply,
    ReducedObjectsRequest,
    ReduceReply,
    ReduceRequest,
    ReduceTask,
    TransferDone,
    VertexDone,
)

pytestmark = pytest.mark.timeout(30)

MiB = 1 << 20
RID = b"r" * 20
NODES = "ABCDEFGH"


def oid(i: int) -> bytes:
    return bytes([i]) * 20


def make_state(lease: float = math.inf, now: float = 0.0, rejoin: bool = False) -> DirectoryState:
    """A directory that nodes A..H joined at ``now`` (``rejoin``: after losing another directory).
    No leases by default (leases: test_directory_faults)."""
    state = DirectoryState(
        DirectoryConfig(inline_threshold_bytes=64 * 1024, lease_timeout=lease, validate=True)
    )
    for i, node in enumerate(NODES):
        state.handle(NodeJoined(node, "127.0.0.1", 7000 + i, now, rejoin=rejoin))
    return state


def req(state, node, msg, now=0.0):
    return state.handle(Request(node, msg, now))


def put(state, node, i, size=MiB, dtype="<f4", inline=None, now=0.0):
    itemsize = np.dtype(dtype).itemsize
    return req(state, node, PutRequest(1, oid(i), size, dtype, [size // itemsize], b"d" * 16, inline), now)


def reduce(state, node="A", ids=(0, 1, 2, 3), k=None, op="sum", timeout=0.0, now=0.0):
    k = len(ids) if k is None else k
    return req(state, node, ReduceRequest(9, RID, [oid(i) for i in ids], op, k, timeout), now)


def sent(out, kind):
    return [(s.node_id, s.message) for s in out if isinstance(s.message, kind)]


def test_a_chain_places_arrivals_and_streams_outputs_to_parents() -> None:
    state = make_state()
    assert sent(reduce(state), ReduceReply) == [("A", ReduceReply(request_id=9))]
    size = 256 * MiB  # large: a chain (degree 1), first arrival at the tail
    assert sent(put(state, "B", 1, size), ReduceTask) == []  # a leaf costs its node nothing
    out = put(state, "C", 2, size)
    ((node, task),) = sent(out, ReduceTask)
    assert node == "C" and task.vertex == 2 and task.children == [oid(1)] and task.count == 0
    assert task.input_id == oid(2) and task.output_id == vertex_object_id(RID, 2)
    loc = state.objects[task.output_id].locations["C"]
    assert loc.state is LocationState.PARTIAL and loc.upstream is None
    put(state, "D", 3, size)
    ((node, root),) = sent(put(state, "E", 0, size), ReduceTask)
    assert node == "E" and root.vertex == 0 and root.output_id == RID and root.count == 4
    assert root.children == [vertex_object_id(RID, 1)]
    # A get of the result streams from the root while it is being reduced.
    ((_, reply),) = sent(req(state, "F", LookupRequest(5, RID, 0.0)), LookupReply)
    assert reply.status == "pull" and reply.sender_node == "E" and not reply.sender_complete
    # Vertices finish bottom up; the root finishing drops the intermediate outputs everywhere.
    for node, vertex in (("C", 2), ("D", 1)):
        req(state, node, VertexDone(RID, vertex, True))
    out = req(state, "E", VertexDone(RID, 0, True))
    drops = sent(out, DropObject)
    assert {(n, m.object_id) for n, m in drops} == {
        ("C", vertex_object_id(RID, 2)),
        ("D", vertex_object_id(RID, 1)),
    }
    assert state.objects[RID].locations["E"].state is LocationState.COMPLETE
    assert vertex_object_id(RID, 1) not in state.objects
    ((_, ids),) = sent(req(state, "A", ReducedObjectsRequest(3, RID)), ReducedObjectsReply)
    assert ids.object_ids == [oid(1), oid(2), oid(3), oid(0)]


def test_children_placed_after_their_parent_are_announced_to_it() -> None:
    state = make_state()
    reduce(state, node="H", ids=tuple(range(7)))  # H holds no input: in-order placement throughout
    tasks: dict[int, tuple[str, ReduceTask]] = {}
    announced = []
    for i in range(7):  # 1 MiB each: a binary tree; in-order 3 1 4 0 5 2 6
        out = put(state, NODES[i], i)
        tasks.update({m.vertex: (n, m) for n, m in sent(out, ReduceTask)})
        announced += sent(out, ReduceChild)
    assert set(tasks) == {0, 1, 2}  # leaves 3..6 run nothing
    # A child placed before its parent is in the parent's task; a later one is announced.
    assert tasks[1] == ("B", tasks[1][1]) and tasks[1][1].children == [oid(0), b""]
    assert tasks[0] == ("D", tasks[0][1]) and tasks[0][1].children == [vertex_object_id(RID, 1), b""]
    assert tasks[2] == ("F", tasks[2][1]) and tasks[2][1].children == [oid(4), b""]
    assert sorted(announced, key=lambda a: a[0]) == [
        ("B", ReduceChild(RID, 1, 1, oid(2))),
        ("D", ReduceChild(RID, 0, 1, vertex_object_id(RID, 2))),
        ("F", ReduceChild(RID, 2, 1, oid(6))),
    ]


def test_inline_inputs_are_reduced_by_the_directory() -> None:
    state = make_state()
    xs = [np.arange(5, dtype=np.float32) * (i + 1) for i in range(3)]
    reduce(state, ids=(0, 1, 2), op="avg")
    out = []
    for i, x in enumerate(xs):
        out += put(state, NODES[i], i, x.nbytes, inline=x.tobytes())
    assert sent(out, ReduceTask) == []
    ((_, reply),) = sent(req(state, "D", LookupRequest(4, RID, 0.0)), LookupReply)
    assert reply.status == "inline"
    assert np.array_equal(np.frombuffer(reply.inline, np.float32), sum(xs) / 3)


def test_first_k_takes_the_first_ready_inputs_only() -> None:
    state = make_state()
    reduce(state, ids=(0, 1, 2, 3), k=2)
    put(state, "C", 2)
    out = put(state, "A", 0)
    assert [m.vertex for _, m in sent(out, ReduceTask)] == [0]
    assert sent(put(state, "B", 1), ReduceTask) == []  # a straggler is ignored
    # Answered once the result is complete (a failure before then could change the inputs).
    assert sent(req(state, "A", ReducedObjectsRequest(3, RID)), ReducedObjectsReply) == []
    ((_, ids),) = sent(req(state, "A", VertexDone(RID, 0, True)), ReducedObjectsReply)
    assert ids.object_ids == [oid(2), oid(0)]
    assert state.awaiting == {}


def test_a_mismatch_known_at_request_time_is_refused() -> None:
    state = make_state()
    put(state, "A", 0)
    put(state, "B", 1, dtype="<f8")
    ((_, reply),) = sent(reduce(state, ids=(0, 1)), ReduceReply)
    assert reply.error_kind == "ReduceMismatchError" and reply.error_object_id == oid(1)
    assert RID not in state.reductions
    put(state, "C", 2, dtype="|u1")
    put(state, "D", 3, dtype="<c8")
    ((_, reply),) = sent(reduce(state, ids=(3,)), ReduceReply)
    assert reply.error_kind == "InvalidArgumentError" and reply.error_object_id == oid(3)


def test_a_late_mismatch_fails_the_reduction_and_cancels_its_tasks() -> None:
    state = make_state()
    reduce(state, node="H", ids=(0, 1, 2, 3))
    put(state, "A", 0, 256 * MiB)
    put(state, "B", 1, 256 * MiB)  # vertex 2 runs on B
    sent(req(state, "H", LookupRequest(6, RID, 0.0)), LookupReply)  # waits for the result
    out = put(state, "C", 2, 256 * MiB, dtype="<i4")
    drops = [(n, m) for n, m in sent(out, DropObject) if m.object_id == vertex_object_id(RID, 2)]
    assert [(n, m.reason, m.error_kind) for n, m in drops] == [("B", "failed", "ReduceMismatchError")]
    ((node, failed),) = sent(out, LookupReply)
    assert node == "H" and failed.status == "error" and failed.error_kind == "ReduceMismatchError"
    assert failed.error_object_id == oid(2)
    ((_, again),) = sent(req(state, "G", LookupRequest(7, RID, 0.0)), LookupReply)
    assert again.status == "error"
    ((_, ids),) = sent(req(state, "A", ReducedObjectsRequest(3, RID)), ReducedObjectsReply)
    assert ids.error_kind == "ReduceMismatchError"


def test_a_reduction_short_of_inputs_times_out() -> None:
    state = make_state()
    reduce(state, ids=(0, 1), timeout=5.0, now=10.0)
    req(state, "B", ReducedObjectsRequest(3, RID, timeout=2.0), now=10.0)
    assert state.next_deadline() == 12.0
    ((_, late),) = sent(state.handle(Tick(12.0)), ReducedObjectsReply)
    assert late.error_kind == "HopliteTimeoutError"
    put(state, "A", 0, now=11.0)
    assert state.next_deadline() == 15.0
    assert state.handle(Tick(14.9)) == []
    state.handle(Tick(15.0))
    ((_, reply),) = sent(req(state, "C", LookupRequest(4, RID, 0.0), now=16.0), LookupReply)
    assert reply.status == "error" and reply.error_kind == "HopliteTimeoutError"
    assert state.next_deadline() is None


def test_requests_are_idempotent_and_ids_are_not_reused() -> None:
    state = make_state()
    reduce(state, ids=(0, 1))
    assert sent(reduce(state, node="B", ids=(0, 1)), ReduceReply) == [("B", ReduceReply(request_id=9))]
    ((_, clash),) = sent(reduce(state, ids=(0, 1), op="max"), ReduceReply)
    assert clash.error_kind == "ObjectExistsError"
    ((_, taken),) = sent(req(state, "C", PutRequest(1, RID, 4, "<f4", [1], b"d", b"abcd")), PutReply)
    assert taken.error_kind == "ObjectExistsError"
    ((_, bad),) = sent(req(state, "A", ReduceRequest(9, oid(9), [oid(1), oid(1)], "sum", 2)), ReduceReply)
    assert bad.error_kind == "InvalidArgumentError"


def test_the_requester_deletes_a_reduction_before_or_after_it_is_placed() -> None:
    state = make_state()
    reduce(state, node="H", ids=(0, 1))
    ((_, deleted),) = sent(req(state, "H", DeleteRequest(2, RID)), DeleteReply)
    assert deleted.deleted and RID not in state.reductions and state.awaiting == {}
    reduce(state, node="H", ids=(0, 1))
    put(state, "A", 0, 256 * MiB)
    put(state, "B", 1, 256 * MiB)
    out = req(state, "H", DeleteRequest(2, RID))
    assert ("B", DropObject(RID)) in sent(out, DropObject) and RID not in state.objects


def test_the_node_holding_the_only_copy_of_a_result_keeps_it_until_the_owner_deletes() -> None:
    state = make_state()
    reduce(state, ids=(0, 1))  # requested (owned) by A
    put(state, "B", 0, 256 * MiB)
    put(state, "C", 1, 256 * MiB)  # the root runs on C
    req(state, "C", VertexDone(RID, 0, True))
    ((_, kept),) = sent(req(state, "C", DeleteRequest(2, RID)), DeleteReply)
    assert kept.kept and not kept.deleted and "C" in state.objects[RID].locations
    ((_, pulling),) = sent(req(state, "D", LookupRequest(4, RID, 0.0)), LookupReply)
    assert pulling.status == "pull" and pulling.sender_node == "C"
    req(state, "D", TransferDone(pulling.transfer_id, True, 256 * MiB))
    ((_, dropped),) = sent(req(state, "C", DeleteRequest(3, RID)), DeleteReply)
    assert not dropped.kept and "C" not in state.objects[RID].locations  # D has a copy now
    out = req(state, "A", DeleteRequest(5, RID))
    assert sent(out, DropObject) == [("D", DropObject(RID))] and RID not in state.objects


def test_a_vertex_output_is_not_deleted_by_its_node_while_its_tree_runs() -> None:
    # Its parent reads it: it goes with its tree (here: when the root finishes), not when the
    # node computing it deletes it (once a bug of the node's, which broke the invariants).
    state = make_state()
    reduce(state, ids=(0, 1, 2))
    for i, node in enumerate("ABC"):  # a chain: B's input at the tail, C's vertex 1, root on A
        put(state, node, i, 256 * MiB)
    inner = vertex_object_id(RID, 1)
    assert state.objects[inner].owner == "C"
    ((_, kept),) = sent(req(state, "C", DeleteRequest(2, inner)), DeleteReply)
    assert kept.kept and not kept.deleted and inner in state.objects
    req(state, "C", VertexDone(RID, 1, True))
    req(state, "A", VertexDone(RID, 0, True))
    assert state.reductions[RID].done and inner not in state.objects


def test_the_requesters_own_input_computes_the_root_whenever_it_arrives() -> None:
    # The requester reads the result: computing the root there saves its link one copy of it.
    for order in ([3, 0, 1, 2], [0, 1, 3, 2], [0, 1, 2, 3]):  # D's input first, third, last
        state = make_state()
        reduce(state, node="D", ids=(0, 1, 2, 3))  # D holds input 3
        tasks = {}
        for i in order:
            tasks.update({m.vertex: n for n, m in sent(put(state, NODES[i], i, 256 * MiB), ReduceTask)})
        assert tasks[0] == "D", (order, tasks)
        assert sorted(state.reductions[RID].plan.reduced_objects()) == [oid(i) for i in range(4)]


def test_a_requested_degree_shapes_the_tree_and_the_requester_computes_the_root() -> None:
    # A sharded allreduce: D asks for a star over four shards, after putting its own (listed last).
    state = make_state()
    put(state, "A", 0, 64 * MiB)  # present before the request, listed first
    put(state, "D", 3, 64 * MiB)
    req(state, "D", ReduceRequest(9, RID, [oid(i) for i in range(4)], "sum", 4, 0.0, degree=3))
    tasks = {m.vertex: (n, m) for n, m in sent(put(state, "B", 1, 64 * MiB), ReduceTask)}
    tasks.update({m.vertex: (n, m) for n, m in sent(put(state, "C", 2, 64 * MiB), ReduceTask)})
    plan = state.reductions[RID].plan
    assert (plan.degree, plan.reason) == (3, "degree 3 requested")
    assert {pl.object_id: pl.vertex for pl in plan.placed}[oid(3)] == 0  # the root, on D
    assert all(pl.parent == 0 for pl in plan.placed if pl.vertex)  # a star: every leaf streams into it
    assert not [v for v in tasks if v != 0]  # leaves cost their nodes nothing
    # The cost model would have chosen a chain for 64 MiB inputs.
    state = make_state()
    put(state, "D", 3, 64 * MiB)
    reduce(state, node="D")
    for i in range(3):
        put(state, NODES[i], i, 64 * MiB)
    assert state.reductions[RID].plan.degree == 1


def test_a_requested_degree_is_capped_and_survives_a_repair() -> None:
    state = make_state(lease=5.0)
    req(state, "A", ReduceRequest(9, RID, [oid(i) for i in range(3)], "sum", 3, 0.0, degree=7))
    for i in range(3):
        put(state, NODES[i], i, 64 * MiB)
    assert state.reductions[RID].plan.degree == 2
    for node in "ACDEFGH":  # B misses its lease: its input is lost and must be put again
        req(state, node, Heartbeat(), 4.0)
    state.handle(Tick(6.0))
    put(state, "E", 1, 64 * MiB, now=6.0)
    plan = state.reductions[RID].plan
    assert plan.epoch == 1 and plan.degree == 2 and len(plan.placed) == 3


def test_a_negative_degree_is_refused() -> None:
    state = make_state()
    out = req(state, "A", ReduceRequest(9, RID, [oid(0), oid(1)], "sum", 2, 0.0, degree=-1))
    ((_, reply),) = sent(out, ReduceReply)
    assert reply.error_kind == "InvalidArgumentError" and "degree" in reply.error


def test_a_weighted_reduction_gives_each_vertex_its_inputs_weights() -> None:
    """Leaf children are scaled by their input's weight, vertex children (weighted already) by 1,
    whether a child is known when the task goes out or announced later (ReduceChild)."""
    import math

    from hoplite_gpu import protocol as p
    from hoplite_gpu.directory.state import DirectoryState, NodeJoined, Request

    state = DirectoryState(DirectoryConfig(lease_timeout=math.inf, validate=True))
    nodes = "ABCDE"
    for i, name in enumerate(nodes):
        state.handle(NodeJoined(name, "127.0.0.1", 7000 + i, 0.0))
    ids = [bytes([65 + i]) * 20 for i in range(5)]
    weights = [0.5, -1.25, 2.0, 0.75, 3.0]
    rid = b"r" * 20
    state.handle(Request("A", p.ReduceRequest(1, rid, ids, "sum", 5, degree=2, weights=weights), 0.0))
    out = []
    for k, (name, oid) in enumerate(zip(nodes, ids, strict=True)):  # arriving one by one
        put = p.PutRequest(10 + k, oid, 1 << 20, "<f4", [1 << 18], b"")
        out += state.handle(Request(name, put, 0.1 * k))
    plan = state.reductions[rid].plan
    by_output = {pl.output_id: pl for pl in plan.placed}
    weight_of = dict(zip(ids, weights, strict=True))
    tasks = [i.message for i in out if isinstance(i.message, p.ReduceTask)]
    children = [i.message for i in out if isinstance(i.message, p.ReduceChild)]
    assert tasks and children  # some children were announced after their parent's task
    effective: dict[tuple[int, int], float] = {}
    for task in tasks:
        assert task.weights[0] == weight_of[task.input_id]
        for index, child in enumerate(task.children):
            if child:
                effective[(task.vertex, index)] = task.weights[1 + index]
    for msg in children:
        effective[(msg.vertex, msg.index)] = msg.weight
    for pl in plan.placed:
        if pl.parent is None:
            continue
        parent = plan.by_vertex[pl.parent]
        expected = 1.0 if pl.runs_task else weight_of[pl.object_id]
        assert effective[(parent.vertex, parent.children.index(pl.vertex))] == expected
    assert any(pl.runs_task and pl.parent is not None for pl in plan.placed)  # a vertex child too
    assert len(by_output) == 5 and plan.full


# ---------------------------------------------------------------- decoded as inputs arrive
def unit_rows(ids, width=4):
    """Partition ``i % width``'s unit row for each id ``i`` (a PartialCode's pieces)."""
    return [[1.0 if j == i % width else 0.0 for j in range(width)] for i in ids]


def reduce_as_arrive(state, ids, node="A", timeout=0.0, now=0.0):
    msg = ReduceRequest(9, RID, [oid(i) for i in ids], "sum", 0, timeout, coding=unit_rows(ids))
    return req(state, node, msg, now)


def test_a_reduction_decoding_as_inputs_arrive_places_the_first_cover_of_every_partition() -> None:
    """Eight pieces over four partitions: nothing is placed until every partition arrived; a
    second piece of a partition already covered is not used; then the tree is the first piece
    of each partition, weight 1, known to every task from the start."""
    state = make_state()
    ids = list(range(8))
    assert sent(reduce_as_arrive(state, ids), ReduceReply) == [("A", ReduceReply(request_id=9))]
    out = []
    for node, i in (("B", 0), ("C", 4), ("D", 1), ("E", 2)):  # 4 covers partition 0 again
        out += put(state, node, i)
    assert sent(out, ReduceTask) == [] and state.reductions[RID].gather is not None
    out = put(state, "F", 3)
    red = state.reductions[RID]
    assert red.gather is None and red.plan.inputs == tuple(oid(i) for i in (0, 1, 2, 3))
    assert red.weights == {oid(i): 1.0 for i in (0, 1, 2, 3)}
    tasks = [m for _, m in sent(out, ReduceTask)]
    assert tasks and all(not t.await_weights and t.weights[0] == 1.0 for t in tasks)
    assert red.plan.reduced_objects() == [oid(i) for i in (0, 1, 2, 3)]
    assert not any(RID in waiting for waiting in state.awaiting.values())
    assert sent(put(state, "G", 5), ReduceTask) == []  # after the decision: not read
    # The same request again is accepted; other rows are not.
    assert sent(reduce_as_arrive(state, ids), ReduceReply) == [("A", ReduceReply(request_id=9))]
    other = ReduceRequest(9, RID, [oid(i) for i in ids], "sum", 0, coding=unit_rows(ids, width=8))
    ((_, refused),) = sent(req(state, "A", other), ReduceReply)
    assert refused.error_kind == "ObjectExistsError"


def test_the_event_log_of_a_reduction_decoding_as_inputs_arrive_goes_on_the_wire() -> None:
    # Found by tests/test_soak.py: an arrival's event held a NumPy bool; the event log reply to a
    # node then failed to encode and cut the node's connection to the directory.
    from hoplite_gpu import protocol as p

    state = make_state()
    reduce_as_arrive(state, [0, 1])
    put(state, "B", 0)
    put(state, "C", 1)
    arrivals = [e for e in state.events if e["kind"] == "reduce_arrival"]
    assert [type(e["decodable"]) for e in arrivals] == [bool, bool]
    p.encode(p.EventLogReply(request_id=1, events=list(state.events)))


def test_a_counted_input_lost_before_the_decision_is_counted_out_again() -> None:
    """Node B holds the only piece of partition 0 and leaves before the others arrive: the
    arrivals are counted again without it, and partition 0's other piece (put later) is used."""
    from hoplite_gpu.directory.state import NodeLeft

    state = make_state()
    reduce_as_arrive(state, list(range(8)))
    put(state, "B", 0)
    put(state, "C", 1)
    state.handle(NodeLeft("B", 1.0))
    for node, i in (("D", 2), ("E", 3)):
        put(state, node, i, now=2.0)
    assert state.reductions[RID].gather is not None  # partition 0 is missing again
    put(state, "F", 4, now=3.0)
    red = state.reductions[RID]
    assert red.gather is None and sorted(red.plan.inputs) == sorted(oid(i) for i in (1, 2, 3, 4))


def test_a_vertex_lost_after_the_decision_sends_the_reduction_back_to_counting() -> None:
    """The node of a placed vertex dies: the rebuilt reduction (next epoch) counts the pieces
    still held and decodes with partition 2's other piece once it arrives."""
    from hoplite_gpu.directory.state import NodeLeft

    state = make_state()
    reduce_as_arrive(state, list(range(8)))
    for node, i in (("B", 0), ("C", 1), ("D", 2), ("E", 3)):
        put(state, node, i)
    red = state.reductions[RID]
    assert red.gather is None and red.plan.epoch == 0
    state.handle(NodeLeft("D", 1.0))  # piece 2 dies with its vertex
    assert red.gather is not None and red.plan.epoch == 1 and red.active
    out = put(state, "F", 6, now=2.0)
    assert red.gather is None and sorted(red.plan.inputs) == sorted(oid(i) for i in (0, 1, 3, 6))
    assert all(t.epoch == 1 for _, t in sent(out, ReduceTask))


def test_a_reduction_decoding_as_inputs_arrive_fails_when_it_cannot() -> None:
    """Every piece arrived and one partition has none: NotDecodableError at once, naming the span;
    pieces still missing at the timeout: HopliteTimeoutError saying how many arrived."""
    state = make_state()
    reduce_as_arrive(state, [0, 1, 2, 4])  # nobody has partition 3
    for node, i in (("B", 0), ("C", 1), ("D", 2), ("E", 4)):
        put(state, node, i)
    error = state.reductions[RID].error
    assert error is not None and error[0] == "NotDecodableError" and "span 3 of 4" in error[1]

    state = make_state()
    reduce_as_arrive(state, list(range(8)), timeout=5.0)
    put(state, "B", 0, now=1.0)
    state.handle(Tick(6.0))
    error = state.reductions[RID].error
    assert error is not None and error[0] == "HopliteTimeoutError"
    assert "the 1 of its 8 inputs that became ready" in error[1]


def test_an_ordered_reduction_places_each_input_at_its_listed_position() -> None:
    # The chain 1 -> 2 -> 3 -> 0 (the listed order), whatever order the inputs arrive in: the
    # first listed is the leaf, the last computes the result (a ring allreduce's shard).
    state = make_state()
    ids = [oid(i) for i in (1, 2, 3, 0)]
    out = req(state, "A", ReduceRequest(9, RID, ids, "sum", 4, degree=1, ordered=True))
    assert sent(out, ReduceReply) == [("A", ReduceReply(request_id=9))]
    tasks: dict[int, tuple[str, ReduceTask]] = {}
    for node, i in (("A", 0), ("C", 2), ("D", 3), ("B", 1)):  # the root's input first
        tasks.update({m.vertex: (n, m) for n, m in sent(put(state, node, i, 64 * MiB), ReduceTask)})
    assert {v: n for v, (n, _) in tasks.items()} == {0: "A", 1: "D", 2: "C"}  # B: the leaf
    assert tasks[2][1].input_id == oid(2) and tasks[0][1].input_id == oid(0)
    assert state.reductions[RID].plan.by_vertex[3].node_id == "B"
    # Arrival order is still what reduced_objects names.
    assert state.reductions[RID].plan.reduced_objects() == [oid(0), oid(2), oid(3), oid(1)]


def test_an_ordered_reduction_needs_every_input() -> None:
    state = make_state()
    ids = [oid(i) for i in range(4)]
    ((_, reply),) = sent(req(state, "A", ReduceRequest(9, RID, ids, "sum", 3, ordered=True)), ReduceReply)
    assert reply.error_kind == "InvalidArgumentError" and "listed order" in reply.error


def _computed_at_a(state: DirectoryState) -> None:
    """RID computed at A (a chain B -> A), not complete yet; C, D and E put objects of theirs."""
    req(state, "A", ReduceRequest(9, RID, [oid(1), oid(0)], "sum", 2, degree=1, ordered=True))
    for node, i in (("A", 0), ("B", 1), ("C", 2), ("D", 3), ("E", 4)):
        put(state, node, i)


def test_a_lookup_via_a_node_waits_for_its_copy_then_pulls_from_it() -> None:
    # A ring of readers: D reads via C's object, C via B's, B straight from A computing it.
    state = make_state()
    _computed_at_a(state)
    assert sent(req(state, "D", LookupRequest(1, RID, 0.0, via=oid(2))), LookupReply) == []
    assert sent(req(state, "C", LookupRequest(2, RID, 0.0, via=oid(1))), LookupReply) == []
    out = req(state, "B", LookupRequest(3, RID, 0.0, direct=True))
    pulls = {n: m.sender_node for n, m in sent(out, LookupReply)}
    assert pulls == {"B": "A", "C": "B", "D": "C"}  # each from the one before it
    # Via an object not put yet: it waits too (its owner has not entered the ring yet).
    assert sent(req(state, "F", LookupRequest(4, RID, 0.0, via=oid(7))), LookupReply) == []
    # Once a copy is complete, a lookup via a node holding none is as one without ``via`` (here:
    # the chain of readers' idle end, A being busy).
    ((_, reply),) = sent(req(state, "A", VertexDone(RID, 0, True)), LookupReply)
    assert (reply.request_id, reply.status, reply.sender_node) == (4, "pull", "D")


def test_a_lookup_via_a_node_that_left_waits_no_longer_than_the_first_complete_copy() -> None:
    state = make_state()
    _computed_at_a(state)
    assert sent(req(state, "C", LookupRequest(1, RID, 0.0, via=oid(4))), LookupReply) == []
    assert sent(state.handle(NodeLeft("E", 1.0)), LookupReply) == []  # A computes it: no copy
    ((_, reply),) = sent(req(state, "A", VertexDone(RID, 0, True), now=2.0), LookupReply)
    assert (reply.request_id, reply.sender_node, reply.sender_complete) == (1, "A", True)


def test_a_lookup_via_a_node_still_asking_waits_for_it_when_the_result_completes() -> None:
    state = make_state()
    _computed_at_a(state)
    assert sent(req(state, "D", LookupRequest(1, RID, 0.0, via=oid(2))), LookupReply) == []
    assert sent(req(state, "C", LookupRequest(2, RID, 0.0, via=oid(1))), LookupReply) == []
    # The result completes with D's lookup first in the queue: C (asking) is waited for, and C,
    # whose B never asked, reads A's complete copy.
    out = req(state, "A", VertexDone(RID, 0, True))
    assert {n: m.sender_node for n, m in sent(out, LookupReply)} == {"C": "A", "D": "C"}


def test_an_ordered_reduction_without_a_degree_is_a_chain_or_one_hosts_star() -> None:
    ids = [oid(i) for i in (1, 2, 3, 0)]
    state = make_state()  # every node on 127.0.0.1 without a host key: not one host
    req(state, "A", ReduceRequest(9, RID, ids, "sum", 4, ordered=True))
    put(state, "A", 0, 64 * MiB)
    plan = state.reductions[RID].plan
    assert plan.degree == 1 and plan.by_vertex[0].node_id == "A"
    # Every node on one host, the inputs in shared memory: that host's star, rooted at A.
    state = DirectoryState(DirectoryConfig(inline_threshold_bytes=64 * 1024, lease_timeout=math.inf))
    for i, node in enumerate("ABCD"):
        state.handle(NodeJoined(node, "127.0.0.1", 7000 + i, 0.0, host_key="one-host"))
    req(state, "A", ReduceRequest(9, RID, ids, "sum", 4, ordered=True))
    for node, i in (("B", 1), ("A", 0), ("C", 2), ("D", 3)):
        shape = [64 * MiB // 4]
        req(state, node, PutRequest(1, oid(i), 64 * MiB, "<f4", shape, b"d" * 16, segment=f"seg-{i}"))
    plan = state.reductions[RID].plan
    assert plan.degree == 3 and plan.by_vertex[0].node_id == "A" and plan.full
