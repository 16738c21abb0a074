"""Watched groups in the pure directory state machine: members hear at once that one is lost."""

from __future__ import annotations

import math

import pytest

from hoplite_gpu import protocol as p
from hoplite_gpu.directory import watches
from hoplite_gpu.directory.config import DirectoryConfig
from hoplite_gpu.directory.state import DirectoryState, NodeJoined, NodeLeft, Request, Tick
from hoplite_gpu.errors import ProtocolError

pytestmark = pytest.mark.timeout(30)

GID = b"g" * 20


def make_state(*nodes: str, quota: int = 100_000, lease: float = math.inf) -> DirectoryState:
    state = DirectoryState(DirectoryConfig(lease_timeout=lease, validate=True, max_pending_lookups=quota))
    for i, node in enumerate(nodes):
        assert state.handle(NodeJoined(node, "127.0.0.1", 7000 + i, 0.0)) == []
    return state


def watch(state, node, rank, count=3, rid=None, abort="", now=0.0, gid=GID, again=False, **parent):
    rid = 10 + rank if rid is None else rid
    msg = p.WatchRequest(
        request_id=rid, group_id=gid, rank=rank, count=count, abort=abort, again=again, **parent
    )
    return [(s.node_id, s.message) for s in state.handle(Request(node, msg, now))]


def test_members_watch_until_one_leaves_then_all_others_hear_which_and_why():
    state = make_state("A", "B", "C")
    assert watch(state, "A", 0) == [] and watch(state, "B", 1) == [] and watch(state, "C", 2) == []
    out = sorted((node, m) for s in state.handle(NodeLeft("B", 1.0)) for node, m in [(s.node_id, s.message)])
    assert [node for node, _ in out] == ["A", "C"]
    for node, reply in out:
        assert isinstance(reply, p.WatchReply) and reply.lost == [1]
        assert reply.request_id == {"A": 10, "C": 12}[node]
        assert "rank 1's node is gone" in reply.reasons[0]
    # Nobody watches any more: the group is forgotten, its lost member remembered.
    assert state.watches.groups == {} and state.watches.by_request == {} and state.watches.per_node == {}
    # A member that watches later hears of it at once.
    [(node, reply)] = watch(state, "A", 0, rid=50)
    assert node == "A" and reply == p.WatchReply(request_id=50, lost=[1], reasons=out[0][1].reasons)


def test_a_node_whose_lease_runs_out_is_lost():
    state = make_state("A", "B", lease=5.0)
    assert watch(state, "A", 0, count=2) == [] and watch(state, "B", 1, count=2) == []
    state.handle(Request("A", p.Heartbeat(), 4.0))
    out = [(s.node_id, s.message) for s in state.handle(Tick(6.0)) if hasattr(s, "message")]
    replies = [m for node, m in out if node == "A" and isinstance(m, p.WatchReply)]
    assert len(replies) == 1 and replies[0].lost == [1] and "missed its lease" in replies[0].reasons[0]


def test_a_withdrawn_member_left_cleanly_and_is_not_reported():
    state = make_state("A", "B")
    assert watch(state, "A", 0, count=2) == [] and watch(state, "B", 1, count=2) == []
    assert state.handle(Request("B", p.CancelLookup(request_id=11), 1.0)) == []
    assert state.handle(NodeLeft("B", 2.0)) == []
    assert list(state.watches.groups[GID].waiting) == [0]


def test_a_member_that_gives_up_is_lost_and_answered_with_the_others():
    state = make_state("A", "B", "C")
    assert watch(state, "A", 0) == [] and watch(state, "B", 1) == []
    out = watch(state, "C", 2, rid=70, abort="timed out in allreduce #4")
    assert sorted(node for node, _ in out) == ["A", "B", "C"]
    for _, reply in out:
        assert reply.lost == [2] and reply.reasons == [
            "rank 2 gave up on the group: timed out in allreduce #4"
        ]
    # A member that gives up while it watches is answered on both requests.
    state = make_state("A", "B")
    assert watch(state, "A", 0, count=2) == [] and watch(state, "B", 1, count=2) == []
    out = watch(state, "A", 0, count=2, rid=99, abort="bad input")
    assert sorted((node, m.request_id) for node, m in out) == [("A", 10), ("A", 99), ("B", 11)]


def test_ranks_lost_are_reported_in_order_and_only_once():
    state = make_state("A", "B", "C", "D")
    for rank, node in enumerate("ABCD"):
        assert watch(state, node, rank, count=4) == []
    first = [(s.node_id, s.message) for s in state.handle(NodeLeft("D", 1.0))]
    assert all(m.lost == [3] for _, m in first)
    # A, B and C were answered; they watch again and hear of the next loss with the first.
    for rank, node in enumerate("ABC"):
        [(to, reply)] = watch(state, node, rank, count=4, rid=100 + rank)
        assert to == node and reply.lost == [3]  # answered at once: the group has lost a member


def test_members_on_one_node_are_all_lost_with_it():
    state = make_state("A", "B")
    assert watch(state, "A", 0, count=3) == [] and watch(state, "A", 1, count=3) == []
    assert watch(state, "B", 2, count=3) == []
    [(node, reply)] = [(s.node_id, s.message) for s in state.handle(NodeLeft("A", 1.0))]
    assert node == "B" and reply.lost == [0, 1]


def test_refusals_another_count_another_node_and_the_quota():
    state = make_state("A", "B", quota=1)
    assert watch(state, "A", 0) == []
    [(node, reply)] = watch(state, "B", 1, count=4)
    assert node == "B" and isinstance(reply, p.ErrorReply) and "3 members" in reply.message
    [(node, reply)] = watch(state, "B", 0, rid=40)
    assert isinstance(reply, p.ErrorReply) and "another node" in reply.message
    [(node, reply)] = watch(state, "A", 1, rid=41, gid=b"h" * 20)
    assert isinstance(reply, p.ErrorReply) and reply.kind == "QuotaExceededError"
    assert b"h" * 20 not in state.watches.groups
    # The same member again (its node reconnected) replaces its request, within the quota.
    assert watch(state, "A", 0, rid=42) == []
    assert state.watches.by_request == {("A", 42): (GID, 0)}


def test_ended_groups_are_remembered_up_to_a_bound(monkeypatch):
    monkeypatch.setattr(watches, "ENDED_KEPT", 2)
    state = make_state("A", "B")
    for i in range(3):
        gid = bytes([i]) * 20
        assert watch(state, "A", 0, count=2, gid=gid) == [] and watch(state, "B", 1, count=2, gid=gid) == []
        watch(state, "B", 1, count=2, rid=90 + i, abort="done", gid=gid)
    assert list(state.watches.ended) == [bytes([1]) * 20, bytes([2]) * 20]
    assert watch(state, "A", 0, count=2, gid=bytes([0]) * 20) == []  # forgotten: a new group


def restarted(*nodes: str) -> DirectoryState:
    """A fresh directory (the old one died) that ``nodes`` rejoin at 0 s, with a 5 s lease."""
    state = DirectoryState(DirectoryConfig(lease_timeout=5.0, validate=True))
    for i, node in enumerate(nodes):
        state.handle(NodeJoined(node, "127.0.0.1", 7000 + i, 0.0, rejoin=True))
    return state


def test_a_member_that_did_not_watch_again_after_a_restart_is_lost_when_recovery_ends():
    # Found by tests/test_soak.py: a member stopped just after the directory restarted, before it
    # watched again; the restarted directory did not know it was a member, so its node's death
    # (its lease) was not reported, and the others waited for the group's timeout.
    state = restarted("A", "B", "C")
    assert watch(state, "A", 0, again=True) == [] and watch(state, "B", 1, again=True) == []
    for node in ("A", "B"):
        state.handle(Request(node, p.Heartbeat(), 4.0))
    out = [(s.node_id, s.message) for s in state.handle(Tick(5.0)) if hasattr(s, "message")]
    replies = {node: m for node, m in out if isinstance(m, p.WatchReply)}
    assert sorted(replies) == ["A", "B"]
    assert replies["A"].lost == [2] and "did not watch again" in replies["A"].reasons[0]
    assert [e["rank"] for e in state.events if e["kind"] == "member_lost"] == [2]


def test_members_that_all_watched_again_or_a_group_watched_afresh_lose_nobody_at_recovery():
    state = restarted("A", "B", "C")
    for rank, node in enumerate("ABC"):
        assert watch(state, node, rank, again=True) == []
    fresh = b"f" * 20  # a group first watched while the directory recovers: its ranks may be late
    assert watch(state, "A", 0, gid=fresh, rid=90) == []
    for node in "ABC":
        state.handle(Request(node, p.Heartbeat(), 4.0))
    assert [s for s in state.handle(Tick(5.0)) if isinstance(getattr(s, "message", None), p.WatchReply)] == []
    assert sorted(state.watches.groups[GID].waiting) == [0, 1, 2]
    assert list(state.watches.groups[fresh].waiting) == [0]


CHILD = b"c" * 20


def test_a_member_of_the_parent_whose_node_leaves_before_it_watches_is_lost():
    # The parent: A, B, C as ranks 0, 1, 2. The child: C, A, B as ranks 0, 1, 2.
    state = make_state("A", "B", "C")
    for rank, node in enumerate("ABC"):
        assert watch(state, node, rank) == []
    parent = {"parent": GID, "parent_ranks": [2, 0, 1]}
    assert watch(state, "A", 1, gid=CHILD, rid=20, **parent) == []
    assert state.watches.groups[CHILD].expected == {0: "C", 2: "B"}
    # B watches from its node: expected no more; C's node leaves before it watched.
    assert watch(state, "B", 2, gid=CHILD, rid=21, **parent) == []
    assert state.watches.groups[CHILD].expected == {0: "C"}
    out = [(s.node_id, s.message) for s in state.handle(NodeLeft("C", 1.0))]
    child = sorted((node, m.request_id, m.lost) for node, m in out if m.request_id in (20, 21))
    assert child == [("A", 20, [0]), ("B", 21, [0])]
    assert all("before it watched" in m.reasons[0] for _, m in out if m.request_id in (20, 21))


def test_a_member_of_the_parent_gone_already_is_lost_at_once_and_others_are_not():
    state = make_state("A", "B", "C")
    for rank, node in enumerate("ABC"):
        assert watch(state, node, rank) == []
    state.handle(NodeLeft("B", 1.0))  # the parent loses rank 1; it ends with its members kept
    # The child of A and B (ranks 0 and 1 there) and a newcomer (-1): B is lost at once.
    [(node, reply)] = watch(state, "A", 0, gid=CHILD, rid=30, parent=GID, parent_ranks=[0, 1, -1])
    assert node == "A" and reply.lost == [1] and "rank 1 of the group before it" in reply.reasons[0]
    # A parent the directory does not know (or an unknown rank): watched as without one.
    other = b"o" * 20
    assert watch(state, "A", 0, gid=other, rid=31, parent=b"u" * 20, parent_ranks=[0, 1, 2]) == []
    assert state.watches.groups[other].expected == {}


def test_the_message_is_validated():
    for bad in (
        {"group_id": b"short"},
        {"rank": 3},
        {"count": 0},
        {"rank": -1},
        {"parent_ranks": [0, 1, 2]},  # without a parent
        {"parent": GID, "parent_ranks": [0, 1]},  # one per member
        {"parent": GID, "parent_ranks": [0, 1, -2]},
        {"parent": GID, "parent_ranks": [0, 1, True]},
        {"parent": b"short", "parent_ranks": [0, 1, 2]},
    ):
        fields = {"request_id": 1, "group_id": GID, "rank": 0, "count": 3, **bad}
        with pytest.raises(ProtocolError):
            p.WatchRequest(**fields).check()
    msg = p.WatchRequest(request_id=1, group_id=GID, rank=1, count=3, abort="x")
    assert p.decode(p.encode(msg)[p.FRAME_HEADER.size :]) == msg
    msg = p.WatchRequest(request_id=1, group_id=GID, rank=1, count=3, parent=CHILD, parent_ranks=[2, -1, 0])
    assert p.decode(p.encode(msg)[p.FRAME_HEADER.size :]) == msg
