"""Barriers in the pure directory state machine: one request per member, one reply to each."""

from __future__ import annotations

import math

import pytest

from hoplite_gpu import protocol as p
from hoplite_gpu.directory.config import DirectoryConfig
from hoplite_gpu.directory.state import DirectoryState, NodeJoined, NodeLeft, Request, Tick
from hoplite_gpu.errors import ProtocolError

pytestmark = pytest.mark.timeout(30)

BID = b"b" * 20


def make_state(*nodes: str, quota: int = 100_000) -> DirectoryState:
    state = DirectoryState(DirectoryConfig(lease_timeout=math.inf, validate=True, max_pending_lookups=quota))
    for i, node in enumerate(nodes):
        assert state.handle(NodeJoined(node, "127.0.0.1", 7000 + i, 0.0)) == []
    return state


def arrive(state, node, rank, count=3, rid=None, timeout=0.0, now=0.0, bid=BID, release=()):
    rid = 10 + rank if rid is None else rid
    msg = p.BarrierRequest(
        request_id=rid, barrier_id=bid, rank=rank, count=count, timeout=timeout, release=list(release)
    )
    return [(s.node_id, s.message) for s in state.handle(Request(node, msg, now))]


def put_inline(state, node, oid, rid=500):
    msg = p.PutRequest(
        request_id=rid, object_id=oid, size=4, dtype="uint8", shape=[4], digest=b"", inline=b"abcd"
    )
    [(to, reply)] = [(s.node_id, s.message) for s in state.handle(Request(node, msg, 0.0))]
    assert to == node and isinstance(reply, p.PutReply) and not reply.error


def test_every_member_is_answered_once_all_have_come():
    state = make_state("A", "B", "C")
    assert arrive(state, "A", 0) == []
    assert arrive(state, "B", 1) == []
    out = arrive(state, "C", 2)
    assert sorted(out, key=lambda o: o[0]) == [
        ("A", p.BarrierReply(request_id=10, status="ok")),
        ("B", p.BarrierReply(request_id=11, status="ok")),
        ("C", p.BarrierReply(request_id=12, status="ok")),
    ]
    assert state.barriers.open == {} and state.barriers.per_node == {} and state.barriers.by_request == {}
    # The next barrier of the same id is a new one.
    assert arrive(state, "A", 0) == []


def test_members_on_one_node_are_answered_each():
    state = make_state("A")
    assert arrive(state, "A", 0, count=2, rid=1) == []
    out = arrive(state, "A", 1, count=2, rid=2)
    assert sorted(m.request_id for _, m in out) == [1, 2]


def test_a_member_with_another_count_is_refused_and_the_others_still_wait():
    state = make_state("A", "B", "C")
    assert arrive(state, "A", 0) == []
    [(node, reply)] = arrive(state, "B", 1, count=4)
    assert node == "B" and isinstance(reply, p.ErrorReply) and reply.kind == "InvalidArgumentError"
    assert "3 members" in reply.message
    assert arrive(state, "B", 1) == []
    assert len(arrive(state, "C", 2)) == 3


def test_a_rank_already_come_from_another_node_is_refused():
    state = make_state("A", "B")
    assert arrive(state, "A", 0) == []
    [(node, reply)] = arrive(state, "B", 0, rid=99)
    assert node == "B" and isinstance(reply, p.ErrorReply) and "rank 0" in reply.message


def test_each_member_is_answered_at_its_own_timeout_naming_the_missing():
    state = make_state("A", "B", "C")
    assert arrive(state, "A", 0, count=5, timeout=2.0, now=1.0) == []
    assert arrive(state, "B", 3, count=5, timeout=2.0, now=1.5) == []
    assert state.next_deadline() == 3.0
    assert state.handle(Tick(2.9)) == []
    out = [(s.node_id, s.message) for s in state.handle(Tick(3.0))]
    assert out == [("A", p.BarrierReply(request_id=10, status="timeout", waiting=3, missing=[1, 2, 4]))]
    assert state.next_deadline() == 3.5
    out = [(s.node_id, s.message) for s in state.handle(Tick(3.5))]
    assert out == [("B", p.BarrierReply(request_id=13, status="timeout", waiting=3, missing=[1, 2, 4]))]
    assert state.barriers.open == {} and state.barriers.per_node == {} and state.next_deadline() is None
    kinds = [e["kind"] for e in state.events]
    assert kinds.count("barrier") == 2 and kinds.count("barrier_timeout") == 2


def test_a_member_that_timed_out_still_counts_for_those_waiting():
    state = make_state("A", "B", "C")
    assert arrive(state, "A", 0, timeout=1.0) == []  # a group with a timeout
    assert arrive(state, "B", 1, timeout=0.0) == []  # and one waiting forever
    assert [s.node_id for s in state.handle(Tick(1.0))] == ["A"]
    out = arrive(state, "C", 2, now=2.0)
    assert sorted(node for node, _ in out) == ["B", "C"]
    assert all(m.status == "ok" for _, m in out)


def test_a_member_whose_node_left_after_coming_still_counts():
    state = make_state("A", "B", "C")
    assert arrive(state, "A", 0) == []
    assert arrive(state, "B", 1) == []
    state.handle(NodeLeft("A", 1.0))
    out = arrive(state, "C", 2, now=1.0)
    assert sorted(node for node, _ in out) == ["B", "C"]  # nobody to answer on A
    assert state.barriers.per_node == {}


def test_a_barrier_nobody_waits_for_is_forgotten():
    state = make_state("A", "B")
    assert arrive(state, "A", 0, count=2) == []
    state.handle(NodeLeft("A", 1.0))
    assert state.barriers.open == {}
    assert arrive(state, "B", 1, count=2, now=1.0) == []  # starts it again


def test_a_cancelled_arrival_is_withdrawn():
    state = make_state("A", "B")
    assert arrive(state, "A", 0, count=2) == []
    assert state.handle(Request("A", p.CancelLookup(request_id=10), 0.0)) == []
    assert state.barriers.open == {}
    assert arrive(state, "B", 1, count=2) == []  # A's arrival is gone: B waits
    assert len(arrive(state, "A", 0, count=2, rid=20)) == 2


def test_a_member_sending_again_is_answered_on_its_new_request():
    state = make_state("A", "B")
    assert arrive(state, "A", 0, count=2, rid=1) == []
    assert arrive(state, "A", 0, count=2, rid=2) == []  # e.g. after its node reconnected
    out = arrive(state, "B", 1, count=2, rid=3)
    assert sorted((node, m.request_id) for node, m in out) == [("A", 2), ("B", 3)]
    assert state.barriers.per_node == {}


def test_a_node_sending_again_after_it_was_declared_gone_is_counted_once():
    state = make_state("A", "B")
    assert arrive(state, "A", 0, count=2, rid=1) == []
    state.handle(NodeLeft("A", 1.0))
    state.handle(NodeJoined("A", "127.0.0.1", 7100, 2.0))
    assert arrive(state, "A", 0, count=2, rid=5, now=2.0) == []
    out = arrive(state, "B", 1, count=2, rid=3, now=2.0)
    assert sorted((node, m.request_id) for node, m in out) == [("A", 5), ("B", 3)]
    assert state.barriers.per_node == {}


def test_arrivals_count_against_the_nodes_quota_of_waiting_lookups():
    state = make_state("A", "B", quota=2)
    assert arrive(state, "A", 0, count=2, bid=b"x" * 20) == []
    assert arrive(state, "A", 0, count=2, bid=b"y" * 20) == []
    [(_, reply)] = arrive(state, "A", 0, count=2, bid=b"z" * 20)
    assert isinstance(reply, p.ErrorReply) and reply.kind == "QuotaExceededError"
    assert arrive(state, "B", 1, count=2, bid=b"x" * 20) != []  # others are unaffected
    assert arrive(state, "A", 0, count=2, bid=b"z" * 20) == []  # the quota is free again


@pytest.mark.parametrize(
    "fields",
    [
        {"rank": 3, "count": 3},
        {"rank": -1, "count": 3},
        {"rank": 0, "count": 0},
        {"rank": 0, "count": p.MAX_BARRIER_MEMBERS + 1},
        {"rank": 0, "count": 2, "barrier_id": b"short"},
        {"rank": 0, "count": 2, "timeout": -1.0},
    ],
)
def test_a_barrier_request_out_of_range_does_not_decode(fields):
    body = {"request_id": 1, "barrier_id": BID, "timeout": 0.0, **fields}
    frame = p.encode(p.BarrierRequest(**body))
    with pytest.raises(ProtocolError):
        p.decode(frame[p.FRAME_HEADER.size :])


def test_the_largest_barrier_is_answered_in_linear_time():
    """65,536 members: each answer must not walk every rank (that was minutes of one event)."""
    count = p.MAX_BARRIER_MEMBERS
    state = DirectoryState(DirectoryConfig(lease_timeout=math.inf))  # no invariant pass per event
    state.handle(NodeJoined("A", "127.0.0.1", 7000, 0.0))
    for rank in range(count - 1):
        arrive(state, "A", rank, count=count, rid=rank + 1, timeout=1.0)
    out = state.handle(Tick(1.0))  # every member times out, the last one never came
    assert len(out) == count - 1
    assert all(s.message.missing == [count - 1] and s.message.waiting == 1 for s in out)
    assert state.barriers.open == {}


def test_a_barrier_deletes_what_its_members_released_once_all_have_come():
    state = make_state("A", "B", "C")
    mine, theirs, gone = b"m" * 20, b"t" * 20, b"g" * 20
    put_inline(state, "A", mine)
    put_inline(state, "B", theirs)
    assert arrive(state, "A", 0, release=[mine, theirs, gone]) == []  # theirs is B's: left alone
    assert arrive(state, "B", 1) == []
    assert mine in state.catalog.objects  # not before every member has come
    out = arrive(state, "C", 2)
    # No DeleteReply: the members learn from their "ok".
    assert sorted(n for n, m in out if isinstance(m, p.BarrierReply) and m.status == "ok") == ["A", "B", "C"]
    assert len(out) == 3
    assert mine not in state.catalog.objects and theirs in state.catalog.objects
    assert [e["kind"] for e in state.eventlog.page(0)].count("delete") == 1


def test_an_arrival_answered_at_its_timeout_releases_nothing():
    state = make_state("A", "B", "C")
    mine = b"m" * 20
    put_inline(state, "A", mine)
    assert arrive(state, "B", 1) == []
    assert arrive(state, "A", 0, timeout=1.0, release=[mine]) == []
    [(node, reply)] = [(s.node_id, s.message) for s in state.handle(Tick(1.0))]
    assert node == "A" and reply.status == "timeout"
    assert sorted(n for n, _ in arrive(state, "C", 2, now=2.0)) == ["B", "C"]  # A still counts as come
    assert mine in state.catalog.objects  # A was told it failed: it deletes its objects itself


def test_a_barrier_request_releasing_too_many_does_not_decode():
    body = {"request_id": 1, "barrier_id": BID, "rank": 0, "count": 2, "timeout": 0.0}
    frame = p.encode(p.BarrierRequest(**body, release=[b"o" * 20] * (p.MAX_BARRIER_RELEASE + 1)))
    with pytest.raises(ProtocolError, match="released"):
        p.decode(frame[p.FRAME_HEADER.size :])
    frame = p.encode(p.BarrierRequest(**body, release=[b"short"]))
    with pytest.raises(ProtocolError, match="release"):
        p.decode(frame[p.FRAME_HEADER.size :])


def test_a_barrier_releases_a_reduction_its_member_requested():
    state = make_state("A", "B")
    put_inline(state, "A", b"1" * 20, rid=1)
    rid = b"r" * 20
    msg = p.ReduceRequest(
        request_id=2,
        reduction_id=rid,
        object_ids=[b"1" * 20, b"2" * 20],
        num_objects=2,
        op="sum",
        timeout=0.0,
    )
    state.handle(Request("A", msg, 0.0))  # waits for its second input
    assert rid in state.reductions
    assert arrive(state, "B", 1, count=2, release=[rid]) == []  # not B's: left alone
    assert arrive(state, "A", 0, count=2, release=[rid]) != []
    assert rid not in state.reductions


# ---------------------------------------------------------------------------- agreements
GID = b"g" * 20


def watch(state, node, rank, count=3, rid=None, abort=""):
    rid = 200 + rank if rid is None else rid
    msg = p.WatchRequest(request_id=rid, group_id=GID, rank=rank, count=count, abort=abort)
    return [(s.node_id, s.message) for s in state.handle(Request(node, msg, 0.0))]


def agree(state, node, rank, vote=1, count=3, now=0.0, bid=BID, timeout=0.0):
    msg = p.BarrierRequest(
        request_id=10 + rank, barrier_id=bid, rank=rank, count=count, timeout=timeout, group_id=GID, vote=vote
    )
    return sorted(((s.node_id, s.message) for s in state.handle(Request(node, msg, now))), key=lambda o: o[0])


def replies(out):
    return [m for _, m in out if isinstance(m, p.BarrierReply)]


def test_an_agreement_of_members_all_alive_tells_each_the_members_and_the_least_vote():
    state = make_state("A", "B", "C")
    for rank, node in enumerate("ABC"):
        assert watch(state, node, rank) == []
    assert agree(state, "A", 0, vote=1) == []
    assert agree(state, "B", 1, vote=0) == []
    out = replies(agree(state, "C", 2, vote=1))
    assert [(r.request_id, r.status, r.members, r.vote) for r in out] == [
        (10, "ok", [0, 1, 2], 0),
        (11, "ok", [0, 1, 2], 0),
        (12, "ok", [0, 1, 2], 0),
    ]
    assert state.barriers.open == {}


def test_an_agreement_is_decided_when_the_missing_member_is_lost_and_leaves_it_out():
    state = make_state("A", "B", "C")
    for rank, node in enumerate("ABC"):
        watch(state, node, rank)
    assert agree(state, "A", 0) == [] and agree(state, "B", 1) == []
    out = state.handle(NodeLeft("C", 1.0))  # rank 2's node dies before it comes
    decided = [s.message for s in out if isinstance(s.message, p.BarrierReply)]
    assert sorted((r.request_id, r.members, r.vote) for r in decided) == [(10, [0, 1], 1), (11, [0, 1], 1)]
    # A member lost before the agreement does not hold it up either.
    assert agree(state, "A", 0, bid=b"c" * 20) == []
    assert [(r.members, r.vote) for r in replies(agree(state, "B", 1, bid=b"c" * 20))] == [([0, 1], 1)] * 2


def test_a_member_that_came_and_then_died_is_not_a_member_and_its_vote_is_not_counted():
    state = make_state("A", "B", "C")
    for rank, node in enumerate("ABC"):
        watch(state, node, rank)
    assert agree(state, "C", 2, vote=0) == []
    state.handle(NodeLeft("C", 1.0))
    assert agree(state, "A", 0) == []
    assert [(r.members, r.vote) for r in replies(agree(state, "B", 1))] == [([0, 1], 1)] * 2


def test_a_member_lost_is_left_out_and_answered_at_once_when_it_comes_later():
    state = make_state("A", "B")
    watch(state, "A", 0, count=2)
    watch(state, "B", 1, count=2)
    assert agree(state, "B", 1, count=2) == []
    out = state.handle(
        Request("A", p.WatchRequest(request_id=300, group_id=GID, rank=0, count=2, abort="x"), 0.0)
    )
    decided = [s.message for s in out if isinstance(s.message, p.BarrierReply)]
    assert [(r.request_id, r.members) for r in decided] == [(11, [1])]  # decided with rank 0's loss
    # Rank 0 (its node still connected) comes after: told it is no member, at once.
    assert [(r.request_id, r.members, r.vote) for r in replies(agree(state, "A", 0, count=2))] == [
        (10, [], 0)
    ]
    assert state.barriers.open == {}


def test_an_agreement_times_out_naming_only_members_neither_come_nor_lost():
    state = make_state("A", "B", "C")
    for rank, node in enumerate("ABC"):
        watch(state, node, rank)
    state.handle(NodeLeft("C", 0.5))
    assert agree(state, "A", 0, timeout=1.0) == []
    [(_, reply)] = [(s.node_id, s.message) for s in state.handle(Tick(2.0))]
    assert reply.status == "timeout" and reply.waiting == 1 and reply.missing == [1]


def test_an_agreement_and_a_plain_barrier_of_one_id_are_refused_together():
    state = make_state("A", "B")
    assert agree(state, "A", 0, count=2) == []
    [(_, reply)] = arrive(state, "B", 1, count=2)
    assert isinstance(reply, p.ErrorReply) and "another watched group" in reply.message


def test_an_agreement_vote_out_of_range_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        p.BarrierRequest(request_id=1, barrier_id=BID, rank=0, count=1, timeout=0.0, vote=-1).check()
    with pytest.raises(ProtocolError):
        p.BarrierRequest(request_id=1, barrier_id=BID, rank=0, count=1, timeout=0.0, group_id=b"x").check()


def test_a_second_death_after_the_watches_were_answered_still_decides_the_agreement():
    """The first loss answers every watch (nobody watches the group any more); a member whose
    node dies after that is lost all the same, so the agreement of the rest is decided."""
    state = make_state("A", "B", "C", "D")
    for rank, node in enumerate("ABCD"):
        watch(state, node, rank, count=4)
    state.handle(NodeLeft("A", 1.0))  # every watch answered: the group has ended
    assert GID not in state.watches.groups and state.watches.lost_of(GID).keys() == {0}
    assert agree(state, "B", 1, count=4) == [] and agree(state, "D", 3, count=4) == []
    out = state.handle(NodeLeft("C", 2.0))
    decided = [s.message for s in out if isinstance(s.message, p.BarrierReply)]
    assert sorted((r.request_id, r.members) for r in decided) == [(11, [1, 3]), (13, [1, 3])]
    assert state.watches.lost_of(GID).keys() == {0, 2}
