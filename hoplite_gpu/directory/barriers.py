"""Barriers: one message per member, one reply to each once all have come.

A group's barrier (:func:`hoplite_gpu.collective.barrier`) was an allreduce of one byte: a put,
a reduce, the placement of its tree and a lookup per member, and the deletes after, 25 events of
the directory's for 4 members (bench/pages/small-operations.md). Here each member sends one
:class:`~hoplite_gpu.protocol.BarrierRequest` and gets one reply.

A member's arrival stays counted if its node leaves or its own timeout passes afterwards (it did
reach the barrier), as long as another member still waits: a barrier nobody waits for any more
is forgotten (a member coming later starts it again). At its timeout a member is answered
``timeout``, naming the ranks missing. Arrivals count against the node's quota of
waiting lookups.
A restarted directory knows no barrier: members still waiting send theirs again (the session
repeats a request the lost directory did not answer). An arrival may carry objects of its node's
to delete once every member has come (``BarrierRequest.release``): deleted then, before the
replies, as the node's own deletes would be, with no reply of their own.

An *agreement* is the barrier of a watched group (``BarrierRequest.group_id``, see
:mod:`.watches`): a member lost there no longer counts as missing, so it is answered once every
member has come or is lost, each with the same decision: the members that came and are not lost,
and the least of their votes (a member already lost is answered at once, with no members).
Elastic training decides a step's outcome and its membership this way
(:mod:`hoplite_gpu.torch.elastic`): the directory is the one place where that is decided.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import protocol as p

if TYPE_CHECKING:
    from .catalog import Catalog
    from .config import DirectoryConfig
    from .lookups import Lookups
    from .outbox import Outbox
    from .records import Reduction
    from .watches import Watches


@dataclass(slots=True)
class Barrier:
    """An open barrier: its size, the ranks that came, and those still to answer (rank -> node
    and request id)."""

    count: int
    arrived: set[int] = field(default_factory=set)
    waiting: dict[int, tuple[str, int]] = field(default_factory=dict)
    named: list[int] | None = None  # the first ranks missing, once asked (None: to find again)
    release: dict[int, list[bytes]] = field(default_factory=dict)  # rank -> objects it releases
    group: bytes = b""  # an agreement's watched group (its lost members are not waited for)
    votes: dict[int, int] = field(default_factory=dict)  # an agreement's votes, per rank come


class Barriers:
    """The directory's open barriers.

    Args:
        config: The directory's settings.
        reductions: The reductions by id (read: an arrival may release one).
        outbox: Where its messages and the events it records go.
        catalog: Deletes the objects an arrival releases.
        lookups: Its waiting lookups count against the same quota as arrivals.

    The watched groups (:class:`~.watches.Watches`, made after it) come through :meth:`connect`.
    """

    watches: Watches

    def __init__(
        self,
        *,
        config: DirectoryConfig,
        reductions: dict[bytes, Reduction],
        outbox: Outbox,
        catalog: Catalog,
        lookups: Lookups,
    ) -> None:
        self.config = config
        self.reductions = reductions
        self.outbox = outbox
        self.catalog = catalog
        self.lookups = lookups
        self.open: dict[bytes, Barrier] = {}
        self.by_request: dict[tuple[str, int], tuple[bytes, int]] = {}  # -> (barrier, rank) waiting
        self.per_node: dict[str, int] = {}  # members waiting, per node
        self.deadlines: list[tuple[float, int, str, int]] = []  # (deadline, seq, node, request id)
        self._seq = itertools.count()

    def connect(self, *, watches: Watches) -> None:
        """Hand it the watched groups, whose lost members an agreement does not wait for."""
        self.watches = watches

    def request(self, node_id: str, msg: p.BarrierRequest, now: float) -> None:
        """Member ``msg.rank`` of node ``node_id`` reached barrier ``msg.barrier_id``."""
        bid, rank = msg.barrier_id, msg.rank
        barrier = self.open.get(bid)
        if barrier is not None and barrier.count != msg.count:
            self._refuse(node_id, msg, f"it has {barrier.count} members, this member said {msg.count}")
            return
        if barrier is not None and barrier.group != msg.group_id:
            self._refuse(node_id, msg, "its members name another watched group")
            return
        if msg.group_id and rank in self.watches.lost_of(msg.group_id):
            # Lost: no agreement counts it any more (one may have been decided without it).
            self.outbox.send(node_id, p.BarrierReply(request_id=msg.request_id, status="ok", vote=0))
            return
        came = barrier.waiting.get(rank) if barrier is not None else None
        if came is not None and came[0] != node_id:
            self._refuse(node_id, msg, f"rank {rank} already reached it from another node")
            return
        quota = self.config.max_pending_lookups
        if came is None and self.per_node.get(node_id, 0) + self.lookups.per_node.get(node_id, 0) >= quota:
            text = f"node has {quota} lookups and barriers waiting, the directory's quota"
            reply = p.ErrorReply(request_id=msg.request_id, kind="QuotaExceededError", message=text)
            self.outbox.send(node_id, reply)
            return
        if barrier is None:
            barrier = self.open[bid] = Barrier(msg.count, group=msg.group_id)
        if came is not None:  # the same member again (its node reconnected): answer the new request
            del self.by_request[(node_id, came[1])]
        else:
            self.per_node[node_id] = self.per_node.get(node_id, 0) + 1
        barrier.arrived.add(rank)
        barrier.named = None
        barrier.waiting[rank] = (node_id, msg.request_id)
        if msg.release:
            barrier.release[rank] = msg.release
        if barrier.group:
            barrier.votes[rank] = msg.vote
        self.by_request[(node_id, msg.request_id)] = (bid, rank)
        if msg.timeout > 0:
            heapq.heappush(self.deadlines, (now + msg.timeout, next(self._seq), node_id, msg.request_id))
        self.outbox.record(
            now, "barrier", node=node_id, barrier_id=bid.hex(), rank=rank, arrived=len(barrier.arrived)
        )
        self._settle(bid, barrier, now)

    def _missing(self, barrier: Barrier) -> tuple[int, dict[int, str]]:
        """How many members have not come (an agreement's lost members are not missing), and the
        agreement's lost members (none for a plain barrier)."""
        lost = self.watches.lost_of(barrier.group) if barrier.group else {}
        gone = sum(1 for r in lost if r < barrier.count and r not in barrier.arrived)
        return barrier.count - len(barrier.arrived) - gone, lost

    def _settle(self, bid: bytes, barrier: Barrier, now: float) -> None:
        """Answer every member ``ok`` if none is missing (an agreement's lost members are not)."""
        waiting, lost = self._missing(barrier)
        if waiting:
            return
        del self.open[bid]
        for r, oids in barrier.release.items():  # every member is past what they served
            self._release(barrier.waiting[r][0], oids, now)
        members = sorted(r for r in barrier.arrived if r not in lost) if barrier.group else []
        vote = min((barrier.votes.get(r, 0) for r in members), default=0)
        for r in list(barrier.waiting):
            self._answer(bid, barrier, r, "ok", members, vote)
        came = len(members) if barrier.group else barrier.count
        self.outbox.record(now, "barrier_ok", barrier_id=bid.hex(), members=came)

    def group_lost(self, group_id: bytes, now: float) -> None:
        """Members of watched group ``group_id`` were lost: its agreements may be decided."""
        for bid, barrier in list(self.open.items()):
            if barrier.group == group_id:
                self._settle(bid, barrier, now)

    def _release(self, node_id: str, oids: list[bytes], now: float) -> None:
        """Delete the objects of ``node_id``'s that its arrival released: what it put, or a
        reduction it requested (others it names are left alone)."""
        for oid in oids:
            entry, red = self.catalog.objects.get(oid), self.reductions.get(oid)
            if (entry and entry.owner == node_id) or (red and red.requester == node_id):
                self.catalog.delete_one(node_id, oid, now)

    def _refuse(self, node_id: str, msg: p.BarrierRequest, why: str) -> None:
        text = f"barrier {msg.barrier_id.hex()[:12]}: {why}"
        reply = p.ErrorReply(request_id=msg.request_id, kind="InvalidArgumentError", message=text)
        self.outbox.send(node_id, reply)

    def _answer(
        self,
        bid: bytes,
        barrier: Barrier,
        rank: int,
        status: str,
        members: list[int] | None = None,
        vote: int = 1,
    ) -> None:
        """Answer the member of ``rank`` (``ok``, or ``timeout`` naming the ranks missing; an
        agreement's ``ok`` with its ``members`` and ``vote``)."""
        node_id, request_id = self._withdraw(barrier, rank)
        waiting, lost = self._missing(barrier)
        missing = (r for r in range(barrier.count) if r not in barrier.arrived and r not in lost)
        if waiting and barrier.named is None:
            # Found once per change, stopping at the first MAX_MISSING_NAMED: a barrier of 65,536
            # members is answered member by member.
            barrier.named = list(itertools.islice(missing, p.MAX_MISSING_NAMED))
        named = barrier.named if waiting and barrier.named is not None else []
        reply = p.BarrierReply(
            request_id=request_id,
            status=status,
            waiting=waiting,
            missing=named,
            members=members or [],
            vote=vote if barrier.group else 1,
        )
        self.outbox.send(node_id, reply)

    def _withdraw(self, barrier: Barrier, rank: int) -> tuple[str, int]:
        node_id, request_id = barrier.waiting.pop(rank)
        barrier.release.pop(rank, None)  # (answered, withdrawn or gone: it releases nothing)
        del self.by_request[(node_id, request_id)]
        self.per_node[node_id] -= 1
        if not self.per_node[node_id]:
            del self.per_node[node_id]
        return node_id, request_id

    def _close_if_idle(self, bid: bytes, barrier: Barrier) -> None:
        """Forget a barrier that nobody waits for any more (its members timed out, left or gave
        up): a member coming later starts it again."""
        if not barrier.waiting and self.open.get(bid) is barrier:
            del self.open[bid]

    def cancel(self, node_id: str, request_id: int) -> None:
        """Withdraw a member (``CancelLookup`` of its request: its caller gave up), uncounted."""
        found = self.by_request.get((node_id, request_id))
        if found is None:
            return
        bid, rank = found
        barrier = self.open[bid]
        self._withdraw(barrier, rank)
        barrier.arrived.discard(rank)
        barrier.votes.pop(rank, None)
        barrier.named = None
        self._close_if_idle(bid, barrier)

    def forget_node(self, node_id: str) -> None:
        """``node_id`` left: its members still count as come, but get no reply."""
        for key in [key for key in self.by_request if key[0] == node_id]:
            bid, rank = self.by_request[key]
            barrier = self.open[bid]
            self._withdraw(barrier, rank)
            self._close_if_idle(bid, barrier)

    def deadline(self) -> float | None:
        """The earliest deadline of a member waiting."""
        heap = self.deadlines
        while heap and heap[0][2:] not in self.by_request:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def expire(self, now: float) -> None:
        """Answer ``timeout`` to every member whose deadline passed; it stays counted as come."""
        heap = self.deadlines
        while heap and heap[0][0] <= now:
            _, _, node_id, request_id = heapq.heappop(heap)
            found = self.by_request.get((node_id, request_id))
            if found is None:
                continue
            bid, rank = found
            barrier = self.open[bid]
            self._answer(bid, barrier, rank, "timeout")
            self.outbox.record(now, "barrier_timeout", node=node_id, barrier_id=bid.hex(), rank=rank)
            self._close_if_idle(bid, barrier)
