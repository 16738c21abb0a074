"""Tests of the pure directory state machine (no sockets, threads or clocks: time is ``now``)."""

from __future__ import annotations

import math

import pytest

from hoplite_gpu.directory.config import DirectoryConfig
from hoplite_gpu.directory.state import (
    DirectoryState,
    Disconnect,
    InvariantError,
    LocationState,
    NodeJoined,
    NodeLeft,
    Request,
    Send,
    Tick,
)
from hoplite_gpu.errors import ProtocolError
from hoplite_gpu.protocol import (
    EVENT_LOG_PAGE,
    MAX_DELETE_BATCH,
    AbortTransfer,
    CancelLookup,
    DeleteReply,
    DeleteRequest,
    DropObject,
    ErrorReply,
    EventLogReply,
    EventLogRequest,
    LookupReply,
    LookupRequest,
    PutReply,
    PutRequest,
    ServeDone,
    SummaryReply,
    SummaryRequest,
    TransferDone,
    encode,
)

pytestmark = pytest.mark.timeout(30)

MiB = 1 << 20
OID = b"a" * 20
DIGEST = b"d" * 32
HOST = "127.0.0.1"
PORTS = {name: 7000 + i for i, name in enumerate("ABCDEFG")}


def make_state(*nodes: str) -> DirectoryState:
    # Leases: test_directory_faults. Every invariant is checked after every event.
    state = DirectoryState(
        DirectoryConfig(inline_threshold_bytes=64 * 1024, lease_timeout=math.inf, validate=True)
    )
    for node in nodes:
        assert state.handle(NodeJoined(node, HOST, PORTS[node], 0.0)) == []
    return state


def req(state, node, msg, now=0.0):
    return state.handle(Request(node, msg, now))


def put(state, node, rid=100, size=MiB, digest=DIGEST, dtype="uint8", shape=None, inline=None, oid=OID):
    shape = [size] if shape is None else shape
    return req(state, node, PutRequest(rid, oid, size, dtype, shape, digest, inline))


def lookup(state, node, rid, timeout=0.0, have=0, now=0.0, oid=OID):
    return req(state, node, LookupRequest(rid, oid, timeout, have), now)


def done(state, node, tid, ok=True, progress=MiB):
    return req(state, node, TransferDone(tid, ok, progress))


def pull(out, node, rid, sender):
    """The single reply in ``out``: a pull of OID by ``node`` from ``sender``."""
    assert len(out) == 1
    assert out[0].node_id == node
    msg = out[0].message
    assert isinstance(msg, LookupReply)
    assert (msg.request_id, msg.status, msg.object_id) == (rid, "pull", OID)
    assert (msg.sender_node, msg.sender_host, msg.sender_port) == (sender, HOST, PORTS[sender])
    assert (msg.size, msg.dtype, msg.shape, msg.digest, msg.inline) == (MiB, "uint8", [MiB], DIGEST, None)
    return msg


def expected(rid, status, size=MiB, shape=(MiB,), **kw):
    meta = dict(object_id=OID, size=size, dtype="uint8", shape=list(shape), digest=DIGEST)
    return LookupReply(request_id=rid, status=status, **meta, **kw)


def put_ok(node, rid=100):
    return [Send(node, PutReply(request_id=rid))]


def loc(state, node, oid=OID):
    return state.objects[oid].locations[node]


def assert_one_receiver_per_sender(state):
    senders = [t.sender for t in state.transfers.values()]
    assert len(senders) == len(set(senders)), f"a node serves several receivers: {senders}"
    for t in state.transfers.values():
        assert loc(state, t.sender, t.object_id).busy


# ---------------------------------------------------------------- scheduling
def test_concurrent_lookups_form_a_pipelined_chain():
    state = make_state("A", "B", "C", "D", "E")
    assert put(state, "A") == put_ok("A")
    replies = [lookup(state, node, rid=i) for i, node in enumerate("BCDE", start=1)]
    first = pull(replies[0], "B", 1, sender="A")
    assert first.sender_complete is True
    for i, (receiver, sender) in enumerate([("C", "B"), ("D", "C"), ("E", "D")], start=1):
        assert pull(replies[i], receiver, i + 1, sender=sender).sender_complete is False
    assert [r[0].message.transfer_id for r in replies] == [1, 2, 3, 4]
    assert loc(state, "C").state is LocationState.PARTIAL and loc(state, "C").upstream == "B"
    assert [n for n in "ABCDE" if loc(state, n).busy] == ["A", "B", "C", "D"]
    assert_one_receiver_per_sender(state)


def test_direct_lookups_pull_from_the_owner_while_it_serves_others():
    state = make_state("A", "B", "C", "D", "E")
    put(state, "A")
    for i, node in enumerate("BCD", start=1):  # each would have joined a chain
        pull(req(state, node, LookupRequest(i, OID, 0.0, direct=True)), node, i, sender="A")
    # A plain lookup still joins a chain (an idle partial copy), not the busy owner.
    assert pull(lookup(state, "E", 4), "E", 4, sender="B").sender_complete is False


def test_a_direct_lookup_falls_back_to_another_copy_when_the_owner_is_suspect():
    state = make_state("A", "B", "C")
    put(state, "A")
    done(state, "B", pull(lookup(state, "B", 1), "B", 1, sender="A").transfer_id)  # B: complete
    tid = pull(req(state, "C", LookupRequest(2, OID, 0.0, direct=True)), "C", 2, sender="A").transfer_id
    req(state, "C", TransferDone(tid, False, 0, sender_failed=True))  # A stalled: suspect
    pull(req(state, "C", LookupRequest(3, OID, 0.0, direct=True)), "C", 3, sender="B")


def test_idle_complete_copy_preferred_over_idle_partial_copy():
    state = make_state("A", "B", "C", "D", "E", "F")
    put(state, "A")
    t_b = pull(lookup(state, "B", 1), "B", 1, "A").transfer_id
    t_c = pull(lookup(state, "C", 1), "C", 1, "B").transfer_id
    pull(lookup(state, "D", 1), "D", 1, "C")
    assert done(state, "B", t_b) == []
    assert loc(state, "B").state is LocationState.COMPLETE and not loc(state, "A").busy
    assert done(state, "C", t_c) == []
    assert loc(state, "C").state is LocationState.COMPLETE and not loc(state, "B").busy
    # Idle now: A (complete), B (complete), D (partial). C is busy serving D.
    assert pull(lookup(state, "E", 1), "E", 1, "A").sender_complete is True
    assert pull(lookup(state, "F", 1), "F", 1, "B").sender_complete is True
    assert_one_receiver_per_sender(state)


def test_partial_copy_with_most_bytes_preferred():
    state = make_state("A", "B", "C", "D", "E", "F")
    put(state, "A")
    t_b = pull(lookup(state, "B", 1), "B", 1, "A").transfer_id
    t_c = pull(lookup(state, "C", 1), "C", 1, "B").transfer_id
    pull(lookup(state, "D", 1), "D", 1, "C")
    assert done(state, "B", t_b, ok=False, progress=300) == []
    assert done(state, "C", t_c, ok=False, progress=200) == []
    assert (loc(state, "B").progress, loc(state, "B").upstream) == (300, None)
    assert pull(lookup(state, "E", 1), "E", 1, "A").sender_complete is True
    # Idle partial copies now: B (300 bytes), D and E (0 bytes); C is busy serving D.
    assert pull(lookup(state, "F", 1), "F", 1, "B").sender_complete is False


def test_busy_sole_holder_makes_lookup_wait_until_transfer_done():
    state = make_state("A", "B", "C")
    put(state, "A")
    t_b = pull(lookup(state, "B", 1), "B", 1, "A").transfer_id
    # B drops its partial copy, so the only holder left is A, busy serving B.
    assert req(state, "B", DeleteRequest(5, OID)) == [Send("B", DeleteReply(request_id=5, deleted=False))]
    assert lookup(state, "C", 7) == []
    assert "C" not in state.objects[OID].locations
    assert pull(done(state, "B", t_b, ok=False, progress=0), "C", 7, "A").sender_complete is True
    assert_one_receiver_per_sender(state)


def test_second_lookup_by_receiver_waits_then_is_answered_local():
    state = make_state("A", "B")
    put(state, "A")
    t_b = pull(lookup(state, "B", 1), "B", 1, "A").transfer_id
    assert lookup(state, "B", 2) == []  # A is busy and B cannot pull from itself
    out = done(state, "B", t_b)
    assert out == [Send("B", expected(2, "local"))]


# ---------------------------------------------------------------- inline objects
def test_inline_object_lookup_returns_data_without_transfer():
    state = make_state("A", "B")
    data = bytes(range(16))
    assert put(state, "A", size=16, shape=[16], inline=data) == put_ok("A")
    assert state.objects[OID].locations == {}
    assert lookup(state, "B", 3) == [Send("B", expected(3, "inline", size=16, shape=[16], inline=data))]
    assert state.transfers == {}


def test_inline_lookups_made_before_put_are_answered_at_put():
    state = make_state("A", "B", "C")
    assert lookup(state, "B", 1) == [] and lookup(state, "C", 2) == []
    out = put(state, "A", size=4, shape=[2, 2], inline=b"wxyz")
    assert out[0] == Send("A", PutReply(request_id=100))
    assert [(s.node_id, s.message.request_id, s.message.status, s.message.inline) for s in out[1:]] == [
        ("B", 1, "inline", b"wxyz"),
        ("C", 2, "inline", b"wxyz"),
    ]
    assert state.pending == {}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(size=5, inline=b"abcd"),  # inline length differs from size
        dict(size=64 * 1024 + 1, inline=b"x" * (64 * 1024 + 1)),  # above the inline threshold
        dict(oid=b"short"),  # ObjectIDs are 20 bytes
        dict(size=-1),
    ],
)
def test_invalid_put_is_rejected_as_protocol_error(kwargs):
    state = make_state("A")
    out = put(state, "A", rid=9, **kwargs)
    assert len(out) == 1 and out[0].node_id == "A"
    assert (out[0].message.request_id, out[0].message.error_kind) == (9, "ProtocolError")
    assert state.objects == {}


# ---------------------------------------------------------------- blocking lookups
def test_lookups_before_put_wait_and_put_answers_them_in_order():
    state = make_state("A", "B", "C")
    assert lookup(state, "B", 1, timeout=5.0) == []
    assert lookup(state, "C", 2, timeout=5.0) == []
    out = put(state, "A")
    assert out[0] == Send("A", PutReply(request_id=100))
    assert pull(out[1:2], "B", 1, "A").sender_complete is True
    assert pull(out[2:], "C", 2, "B").sender_complete is False
    assert state.pending == {} and state.next_deadline() is None


def test_lookup_times_out_exactly_at_its_deadline():
    state = make_state("B", "C")
    assert lookup(state, "B", 1, timeout=2.0, now=0.0) == []
    assert lookup(state, "C", 2, timeout=3.5, now=1.0) == []
    assert state.next_deadline() == 2.0
    assert state.handle(Tick(now=1.9)) == []
    assert state.handle(Tick(now=2.0)) == [
        Send("B", LookupReply(request_id=1, status="timeout", object_id=OID, error="no node has put it"))
    ]
    assert state.next_deadline() == 4.5
    assert state.handle(Tick(now=2.0)) == []


def test_lookup_without_timeout_never_expires():
    state = make_state("A", "B")
    assert lookup(state, "B", 1, timeout=0.0) == []
    assert state.next_deadline() is None
    assert state.handle(Tick(now=1e9)) == []
    assert pull(put(state, "A")[1:], "B", 1, "A").transfer_id == 1


def test_cancel_lookup_removes_only_that_lookup():
    state = make_state("A", "B", "C")
    lookup(state, "B", 1, timeout=2.0)
    lookup(state, "C", 1, timeout=9.0)
    assert req(state, "B", CancelLookup(1)) == []
    assert state.next_deadline() == 9.0
    assert state.handle(Tick(now=5.0)) == []
    out = put(state, "A")
    assert out[0] == Send("A", PutReply(request_id=100))
    pull(out[1:], "C", 1, "A")


# ---------------------------------------------------------------- put conflicts
@pytest.mark.parametrize(
    "change", [dict(digest=b"e" * 32), dict(shape=[512, 2048]), dict(dtype="float32"), dict(size=MiB + 1)]
)
def test_conflicting_put_is_rejected(change):
    state = make_state("A", "B")
    put(state, "A")
    out = put(state, "B", rid=8, **change)
    assert len(out) == 1 and out[0].node_id == "B"
    assert (out[0].message.request_id, out[0].message.error_kind) == (8, "ObjectExistsError")
    assert "already exists" in out[0].message.error
    assert state.objects[OID].owner == "A" and "B" not in state.objects[OID].locations


def test_identical_reput_is_accepted_and_adds_a_complete_copy():
    state = make_state("A", "B", "C", "D")
    put(state, "A")
    assert put(state, "A", rid=101) == put_ok("A", 101)
    assert put(state, "B", rid=102) == put_ok("B", 102)
    assert state.objects[OID].owner == "A"
    assert loc(state, "B").state is LocationState.COMPLETE
    assert pull(lookup(state, "C", 1), "C", 1, "A").sender_complete is True
    assert pull(lookup(state, "D", 1), "D", 1, "B").sender_complete is True


# ---------------------------------------------------------------- delete
def test_owner_delete_drops_object_everywhere():
    state = make_state("A", "B", "C", "D")
    put(state, "A")
    t_b = pull(lookup(state, "B", 1), "B", 1, "A").transfer_id
    done(state, "B", t_b)
    pull(lookup(state, "C", 1), "C", 1, "A")
    out = req(state, "A", DeleteRequest(4, OID))
    assert sorted(out, key=lambda s: s.node_id) == [
        Send("A", DeleteReply(request_id=4, deleted=True)),
        Send("B", DropObject(object_id=OID)),
        Send("C", DropObject(object_id=OID)),
    ]
    assert OID not in state.objects and state.transfers == {}
    # The object is gone, and the directory says so (issue 39: it used to wait for a put).
    (answer,) = lookup(state, "D", 2, timeout=1.0)
    assert (answer.message.status, answer.message.error_kind) == ("error", "ObjectDeletedError")


def test_non_owner_delete_removes_only_its_own_location():
    state = make_state("A", "B", "C")
    put(state, "A")
    done(state, "B", pull(lookup(state, "B", 1), "B", 1, "A").transfer_id)
    assert req(state, "B", DeleteRequest(6, OID)) == [Send("B", DeleteReply(request_id=6, deleted=False))]
    assert OID in state.objects and set(state.objects[OID].locations) == {"A"}
    pull(lookup(state, "C", 1), "C", 1, "A")


def test_one_delete_request_deletes_several_objects_each_as_alone():
    """A collective's objects go with one request (``also``): each is deleted as if alone, in
    order, its holders told as then, and the one reply answers for each."""
    state = make_state("A", "B", "C", "D")
    mine, theirs, kept, unknown = OID, b"b" * 20, b"c" * 20, b"u" * 20

    def copy(node: str, oid: bytes, owner: str, rid: int) -> None:
        (reply,) = req(state, node, LookupRequest(rid, oid, 0.0, 0))
        assert (reply.message.status, reply.message.sender_node) == ("pull", owner)
        assert req(state, node, TransferDone(reply.message.transfer_id, True, MiB)) == []

    put(state, "A", oid=mine)
    copy("C", mine, "A", 1)
    put(state, "B", oid=theirs)
    copy("A", theirs, "B", 2)
    put(state, "D", oid=kept)
    copy("A", kept, "D", 3)
    state.handle(NodeLeft("D", 0.0))  # A now holds the only copy of ``kept``
    out = req(state, "A", DeleteRequest(4, mine, also=[theirs, kept, unknown]))
    assert out == [
        Send("C", DropObject(object_id=mine)),
        Send(
            "A",
            DeleteReply(
                request_id=4,
                deleted=True,
                deleted_also=[False, False, False],
                kept_also=[False, True, False],
            ),
        ),
    ]
    assert mine not in state.objects  # the owner's delete: gone everywhere
    assert set(state.objects[theirs].locations) == {"B"}  # another's: A's copy alone dropped
    assert set(state.objects[kept].locations) == {"A"}  # the only copy: kept
    assert state.handled["delete"] == 1


def test_a_delete_request_adds_at_most_its_batch_of_objects():
    with pytest.raises(ProtocolError, match="over"):
        DeleteRequest(1, OID, also=[OID] * (MAX_DELETE_BATCH + 1)).check()
    with pytest.raises(ProtocolError, match="also"):
        DeleteRequest(1, OID, also=[b"short"]).check()


def test_delete_of_unknown_object_reports_not_deleted():
    state = make_state("A")
    assert req(state, "A", DeleteRequest(1, OID)) == [Send("A", DeleteReply(request_id=1, deleted=False))]


# ---------------------------------------------------------------- node failures
def test_dead_sole_sender_loses_the_object_and_its_partial_receiver_drops_it():
    state = make_state("A", "B", "C")
    put(state, "A")
    t_b = pull(lookup(state, "B", 1), "B", 1, "A").transfer_id
    # B's bytes can never be completed: it is not offered as a source (see test_directory_faults).
    assert state.handle(NodeLeft("A", 1.0)) == [
        Send("B", AbortTransfer(t_b, "sender A left")),  # stop waiting for its bytes at once
        Send("B", DropObject(object_id=OID, reason="lost")),
    ]
    assert OID not in state.objects and state.transfers == {}
    # A lookup just after the loss raced it: it fails too (past the lease it would wait for a put
    # again; test_directory_faults).
    ((_, reply),) = [(s.node_id, s.message) for s in lookup(state, "C", 1, now=1.0)]
    assert reply.error_kind == "ObjectLostError"
    assert done(state, "B", t_b) == []  # the transfer died with A: a late report changes nothing


def test_receiver_leaving_frees_its_sender_for_a_waiting_lookup():
    state = make_state("A", "B", "C")
    put(state, "A")
    pull(lookup(state, "B", 1), "B", 1, "A")
    req(state, "B", DeleteRequest(2, OID))  # no partial copy left to pull from
    assert lookup(state, "C", 3) == []
    assert pull(state.handle(NodeLeft("B", 1.0)), "C", 3, "A").sender_complete is True


def test_pending_lookups_of_a_dead_node_are_dropped():
    state = make_state("A", "B")
    lookup(state, "B", 1, timeout=3.0)
    state.handle(NodeLeft("B", 0.5))
    assert state.pending == {} and state.next_deadline() is None
    assert put(state, "A") == put_ok("A")


def test_receiver_is_never_given_a_sender_downstream_of_itself():
    state = make_state("A", "B", "C", "D")
    put(state, "A")
    t_b = pull(lookup(state, "B", 1), "B", 1, "A").transfer_id
    pull(lookup(state, "C", 1), "C", 1, "B")  # chain A -> B -> C
    assert done(state, "B", t_b, ok=False, progress=4096) == []
    pull(lookup(state, "D", 1), "D", 1, "A")  # keeps A busy
    # Idle partial copies: C (downstream of B) and D. B must get D, never C.
    assert pull(lookup(state, "B", 2, have=4096), "B", 2, "D").sender_complete is False
    assert (loc(state, "B").progress, loc(state, "B").upstream) == (4096, "D")


def test_receiver_waits_rather_than_pull_from_its_downstream_after_its_sender_died():
    state = make_state("A", "B", "C", "D", "E")
    put(state, "A")
    done(state, "D", pull(lookup(state, "D", 1), "D", 1, "A").transfer_id)  # D: a complete copy
    pull(lookup(state, "B", 1), "B", 1, "A")
    pull(lookup(state, "E", 2), "E", 2, "D")  # D is busy serving E
    pull(lookup(state, "C", 1), "C", 1, "B")
    state.handle(NodeLeft("A", 1.0))
    # D is busy and C pulls from B: B resumes from E's partial copy, never from C.
    assert pull(lookup(state, "B", 2, have=4096, now=1.5), "B", 2, "E").sender_complete is False


@pytest.mark.parametrize(
    "msg",
    [
        PutRequest(1, OID, MiB, "uint8", [MiB], DIGEST),
        LookupRequest(1, OID, 0.0),
        DeleteRequest(1, OID),
        EventLogRequest(1),
        PutReply(1),
    ],
)
def test_requests_from_a_node_that_never_joined_are_ignored(msg):
    state = make_state("A")
    assert req(state, "X", msg) == []
    assert state.objects == {} and state.pending == {}


def test_requests_after_a_node_left_are_ignored():
    state = make_state("A", "B")
    state.handle(NodeLeft("A", 1.0))
    assert put(state, "A") == []
    assert state.objects == {}


def test_unexpected_message_type_gets_an_error_reply():
    state = make_state("A")
    message = "the directory does not accept 'put_reply' messages"
    error = ErrorReply(request_id=3, kind="ProtocolError", message=message)
    assert req(state, "A", PutReply(request_id=3)) == [Send("A", error)]


# ---------------------------------------------------------------- event log
def test_event_log_records_transfers_and_filters_by_seq():
    state = make_state("A", "B")
    put(state, "A")
    tid = pull(lookup(state, "B", 1), "B", 1, "A").transfer_id
    req(state, "A", ServeDone(tid, MiB, 0))
    done(state, "B", tid)
    out = req(state, "B", EventLogRequest(2))
    assert len(out) == 1 and out[0].node_id == "B" and isinstance(out[0].message, EventLogReply)
    events = out[0].message.events
    assert [e["seq"] for e in events] == list(range(len(events)))
    kinds = [e["kind"] for e in events]
    assert kinds == "node_joined node_joined put lookup transfer_start serve_done transfer_done".split()
    start = events[kinds.index("transfer_start")]
    assert {k: start[k] for k in ("transfer_id", "sender", "receiver", "sender_complete")} == dict(
        transfer_id=tid, sender="A", receiver="B", sender_complete=True
    )
    finish = events[kinds.index("transfer_done")]
    assert (finish["ok"], finish["progress"], finish["object_id"]) == (True, MiB, OID.hex())
    since = start["seq"]
    later = req(state, "B", EventLogRequest(3, since=since))[0].message
    assert later.request_id == 3 and later.events == events[since:]
    assert req(state, "B", EventLogRequest(4, since=len(events)))[0].message.events == []


# ---------------------------------------------------------------- transfer reports (two suspected bugs)
def test_transfer_done_with_unknown_id_is_ignored():
    state = make_state("A", "B")
    put(state, "A")
    pull(lookup(state, "B", 1), "B", 1, "A")
    assert done(state, "B", 999) == []
    assert loc(state, "A").busy and loc(state, "B").state is LocationState.PARTIAL


def test_transfer_done_from_a_node_other_than_the_receiver_is_ignored():
    state = make_state("A", "B", "C")
    put(state, "A")
    tid = pull(lookup(state, "B", 1), "B", 1, "A").transfer_id
    assert done(state, "C", tid) == []  # not C's transfer
    done(state, "B", tid)  # the real receiver's report must still count
    assert loc(state, "B").state is LocationState.COMPLETE
    assert not loc(state, "A").busy


def test_failed_empty_receiver_still_serving_is_not_handed_a_second_receiver():
    state = make_state("A", "B", "C", "E", "F")
    put(state, "A")
    t_b = pull(lookup(state, "B", 1), "B", 1, "A").transfer_id
    pull(lookup(state, "C", 1), "C", 1, "B")  # B now serves C
    done(state, "B", t_b, ok=False, progress=0)
    pull(lookup(state, "B", 2), "B", 2, "A")
    lookup(state, "E", 1)
    lookup(state, "F", 1)
    assert_one_receiver_per_sender(state)


def test_event_log_replies_are_pages():
    state = make_state("A")
    for i in range(EVENT_LOG_PAGE + 300):
        put(state, "A", rid=1000 + i, oid=bytes([i % 256, i // 256]) * 10)
    total = len(state.events)
    assert total > EVENT_LOG_PAGE
    first = req(state, "A", EventLogRequest(1))[0].message.events
    assert [e["seq"] for e in first] == list(range(EVENT_LOG_PAGE))
    rest = req(state, "A", EventLogRequest(2, since=EVENT_LOG_PAGE))[0].message.events
    assert [e["seq"] for e in rest] == list(range(EVENT_LOG_PAGE, total))


def test_the_summary_names_what_the_directory_holds():
    state = make_state("A", "B", "C")
    put(state, "A")
    tid = pull(lookup(state, "B", 1), "B", 1, "A").transfer_id
    lookup(state, "C", 2, timeout=30.0, oid=b"z" * 20)  # nobody put it: it waits
    out = req(state, "C", SummaryRequest(3))
    assert len(out) == 1 and out[0].node_id == "C" and out[0].message.request_id == 3
    summary = out[0].message.summary
    assert summary["nodes"] == ["A", "B", "C"]
    assert summary["objects"] == [
        {
            "object_id": OID.hex(),
            "owner": "A",
            "size": MiB,
            "holders": ["A"],
            "receiving": ["B"],
            "inline": False,
        }
    ]
    assert summary["lookups"] == [(b"z" * 20).hex()] and summary["lookups_total"] == 1
    assert summary["transfers"] == [{"object_id": OID.hex(), "sender": "A", "receiver": "B"}]
    done(state, "B", tid)
    summary = req(state, "C", SummaryRequest(4))[0].message.summary
    assert summary["objects"][0]["holders"] == ["A", "B"] and summary["transfers_total"] == 0
    encode(SummaryReply(request_id=4, summary=summary))  # it goes on the wire as it is


# ---------------------------------------------------------------- invariants
def test_validate_names_each_broken_invariant():
    state = make_state("A", "B", "C")
    put(state, "A")
    lookup(state, "B", 1)
    lookup(state, "C", 2)  # a chain A -> B -> C
    assert state.problems() == []
    loc(state, "B").upstream = "C"  # C is fed by B: a cycle
    loc(state, "A").busy = False
    loc(state, "A").progress = MiB + 1
    state.objects[OID].locations["Z"] = state.objects[OID].locations.pop("A")
    state.awaiting[b"x" * 20] = {b"r" * 20}
    with pytest.raises(InvariantError) as info:
        state.validate()
    text = str(info.value)
    for part in (
        "upstream chain is a cycle",
        "recorded as A",
        "node is not joined",
        "progress 1048577 outside",
        "awaiting does not list",
    ):
        assert part in text
    # With validate=True, handle() checks after every event.
    with pytest.raises(InvariantError):
        state.handle(Tick(1.0))


def test_a_service_with_validation_logs_and_records_a_broken_invariant(broken_invariants):
    from hoplite_gpu.directory.service import DirectoryService

    service = DirectoryService("t", config=DirectoryConfig(validate=True))
    service.state.handle(NodeJoined("A", HOST, 1, 0.0))
    service._apply(Tick(1.0))
    assert service.violations == 0
    service.state.nodes["A"].node_id = "B"
    service._apply(Tick(2.0))
    assert service.violations == 1 and len(broken_invariants) == 1
    (event,) = [e for e in service.state.events if e["kind"] == "invariant_violated"]
    assert event["after"] == "Tick" and "node A is recorded as B" in event["problems"][0]
    broken_invariants.clear()  # expected here: the fixture fails any other test that logs one


def test_deadlines_and_cancels_follow_only_the_live_lookups() -> None:
    # next_deadline and Tick read a heap of lookup deadlines, CancelLookup an index by request
    # (no event walks every pending lookup): entries of answered, cancelled or timed-out lookups
    # must never fire or hold a deadline.
    state = make_state("A", "B")
    other = b"o" * 20
    lookup(state, "B", 1, timeout=5.0, oid=other)  # answered below
    lookup(state, "B", 2, timeout=3.0)  # cancelled below
    lookup(state, "B", 3, timeout=7.0)  # times out
    lookup(state, "A", 2, timeout=9.0)  # same request id, another node: not cancelled
    assert state.next_deadline() == 3.0
    assert req(state, "B", CancelLookup(2), now=1.0) == []
    assert state.next_deadline() == 5.0
    put(state, "A", rid=10, size=4, inline=b"abcd", shape=[4], oid=other)
    assert state.next_deadline() == 7.0
    out = state.handle(Tick(7.0))
    assert [(o.node_id, o.message.request_id, o.message.status) for o in out] == [("B", 3, "timeout")]
    assert state.next_deadline() == 9.0
    assert [(pl.node_id, pl.request_id) for pl in state.pending[OID]] == [("A", 2)]
    out = state.handle(Tick(9.0))
    assert [(o.node_id, o.message.status) for o in out] == [("A", "timeout")]
    assert state.next_deadline() is None and not state.pending


def test_a_lookup_claiming_more_bytes_than_the_object_has_is_clamped() -> None:
    # Found by tests/test_fuzz.py: a resumed lookup's have_bytes beyond the object's size was
    # recorded as the reader's progress (4 of 0 bytes), breaking the progress invariant.
    state = make_state("A", "C")
    put(state, "A", rid=1, size=0, shape=[0])
    out = lookup(state, "C", 1, have=4)
    assert out[0].message.status == "pull"
    assert state.objects[OID].locations["C"].progress == 0


def test_a_failed_transfer_reporting_more_bytes_than_the_object_has_is_clamped() -> None:
    # Found by tests/test_fuzz.py (20,000 cases): a failed transfer's progress beyond the
    # object's size was kept as the receiver's progress (4 of 0 bytes).
    state = make_state("A", "B")
    put(state, "B", rid=1, size=0, shape=[0])
    reply = lookup(state, "A", 1)[0].message
    assert req(state, "A", TransferDone(reply.transfer_id, False, 4)) == []  # validated after it
    assert "A" not in state.objects[OID].locations  # a receiver holding nothing is forgotten


def test_a_request_id_used_twice_for_one_object_keeps_both_lookups_indexed() -> None:
    # Found by tests/test_fuzz.py: a peer reusing a request id for the same object left the
    # second lookup out of the index by request once the first one timed out.
    state = make_state("A", "C")
    lookup(state, "C", 1, timeout=3.0)
    lookup(state, "C", 1, timeout=0.0)
    out = state.handle(Tick(3.0))  # the first times out; validate=True checks the indexes
    assert [(o.node_id, o.message.status) for o in out] == [("C", "timeout")]
    assert [pl.deadline for pl in state.pending[OID]] == [None]
    assert req(state, "C", CancelLookup(1), now=4.0) == [] and not state.pending


def test_empty_inline_objects_keep_the_inline_quota_accounting_consistent() -> None:
    """Found by make fuzz: two zero-byte inline objects of one node, one deleted, left the count
    of inline bytes per node out of step with the objects (validate=True raises on it)."""
    state = make_state("A", "B")
    for rid, oid in ((1, b"x" * 20), (2, b"y" * 20)):
        put(state, "B", rid=rid, size=0, shape=[0], inline=b"", oid=oid)
    req(state, "B", DeleteRequest(3, b"x" * 20))
    assert state.problems() == []


# ---------------------------------------------------------------- causes and configuration
def test_every_instruction_and_log_entry_names_the_event_that_caused_it() -> None:
    state = make_state("A", "B")
    assert lookup(state, "B", 1) == []  # waits: nobody put it yet
    waited = state.cause
    reply, answer = put(state, "A")  # the put answers A and starts B's pull
    assert waited.startswith("lookup#") and reply.cause.startswith("put#")
    assert reply.cause == answer.cause == state.cause != waited
    assert answer.node_id == "B" and answer.message.status == "pull"
    # The log tells why B was answered: the entries written for that put.
    assert [e["kind"] for e in state.events if e["cause"] == answer.cause] == ["put", "transfer_start"]
    assert [e["kind"] for e in state.events if e["cause"] == waited] == ["lookup"]
    # Causes stay out of equality (and off the wire: the message is sent as it is).
    assert reply == Send("A", PutReply(request_id=100))
    (disconnect, *_) = make_state_with_lease().handle(Tick(10.0))
    assert isinstance(disconnect, Disconnect) and disconnect.cause.startswith("tick#")


def make_state_with_lease() -> DirectoryState:
    state = DirectoryState(DirectoryConfig(lease_timeout=5.0, validate=True))
    state.handle(NodeJoined("A", HOST, PORTS["A"], 0.0))
    return state


def test_directory_defaults_are_config_defaults() -> None:
    from hoplite_gpu.config import Config

    assert DirectoryConfig() == DirectoryConfig.from_config(Config())
    custom = DirectoryConfig.from_config(Config(lease_timeout=9.0, directory_place_slice=3))
    assert (custom.lease_timeout, custom.place_slice) == (9.0, 3)
    assert DirectoryState(custom).config is custom
