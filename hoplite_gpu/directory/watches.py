"""Watched groups: the members of a group learn at once that one of them is gone.

A group's collectives wait for every member, so a member that dies would leave the others
waiting until their timeout. Instead each member of a watched group sends one
:class:`~hoplite_gpu.protocol.WatchRequest`, which the directory holds. When a member's node
leaves (its connection closed or its lease ran out), or a member gives up on the group
(``abort``: a timeout, bad input), that member is *lost*: every member still watching is answered
with the ranks lost so far and why, and a member that watches later is answered at once. A member
that withdraws its request (``CancelLookup``) leaves the group cleanly and is not reported.

A group is kept while a member watches it; once none does, its lost members are remembered
(the newest :data:`ENDED_KEPT` groups), so that a member arriving late still hears of them. A
restarted directory knows no group: members still watching send theirs again (the session repeats
a request the lost directory did not answer, marked ``again``). A member of such a group that has
not watched again when the restart's recovery window closes (a lease after the first node
rejoined: :meth:`Watches.recovered`) is lost: it died while the directory was down, or before it
could watch again (its node's own death after that is reported as always). A member that had left
cleanly before the restart is reported too, which the group's other members, also past their last
collective, do not see.

This part receives what it uses: the function that sends a message to a node, the one that records
an event, the most watches a node may hold, and whom to tell that a group lost members.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import protocol as p
from .records import unindex

#: Ended groups (no member watching, some lost) whose lost members are remembered.
ENDED_KEPT = 4096


@dataclass(slots=True)
class WatchedGroup:
    """A group some member watches: its size, the node of each member that came, the members
    watching now (rank -> node and request id) and those lost (rank -> why)."""

    count: int
    members: dict[int, str] = field(default_factory=dict)
    waiting: dict[int, tuple[str, int]] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)
    again: bool = False  # watched again after a restart of the directory: see Watches.recovered
    # Members that have not watched yet, by the node they had in the group's parent
    # (WatchRequest.parent): lost if that node leaves before they watch.
    expected: dict[int, str] = field(default_factory=dict)


class Watches:
    """The directory's watched groups.

    Args:
        send: Sends a message to a node (for the event being handled).
        record: Appends an event to the event log: ``record(now, kind, **details)``.
        quota: Most watches one node may hold at once.
        on_lost: Called with a group's id and the time once members of it were lost (the
            group's agreements may then be decided, see :mod:`.barriers`).
        alive: Whether a node is a live member of the cluster (a group's parent names members
            by their nodes there; see :meth:`request`). None: every node is.
    """

    def __init__(
        self,
        send: Callable[[str, p.Message], None],
        record: Callable[..., None],
        quota: int,
        on_lost: Callable[[bytes, float], None] | None = None,
        alive: Callable[[str], bool] | None = None,
    ) -> None:
        self._send = send
        self._record = record
        self._on_lost = on_lost
        self._alive = alive
        self.quota = quota
        self.groups: dict[bytes, WatchedGroup] = {}
        self.by_request: dict[tuple[str, int], tuple[bytes, int]] = {}  # -> (group, rank)
        self.per_node: dict[str, int] = {}  # watches held, per node
        # Groups nobody watches any more that lost members, oldest first; a member of one whose
        # node dies later is lost too (an agreement among the rest may wait on it), hence the
        # index of their members' nodes.
        self.ended: OrderedDict[bytes, WatchedGroup] = OrderedDict()
        self._ended_nodes: dict[str, set[bytes]] = {}

    def request(self, node_id: str, msg: p.WatchRequest, now: float) -> None:
        """Member ``msg.rank`` of node ``node_id`` watches group ``msg.group_id``, or gives up on
        it (``msg.abort``)."""
        gid, rank = msg.group_id, msg.rank
        group = self._group(node_id, msg)
        if group is None:
            return
        came = group.members.get(rank)
        if came is not None and came != node_id and rank not in group.lost:
            self._refuse(node_id, msg, f"rank {rank} is watched from another node")
            return
        if msg.abort:
            self._lose(gid, group, {rank: f"rank {rank} gave up on the group: {msg.abort}"}, now)
            self._answer(node_id, msg.request_id, group)
            self._close_if_idle(gid, group)
            return
        if rank not in group.waiting and self.per_node.get(node_id, 0) >= self.quota:
            text = f"node has {self.quota} watches, the directory's quota"
            self._send(
                node_id, p.ErrorReply(request_id=msg.request_id, kind="QuotaExceededError", message=text)
            )
            self._close_if_idle(gid, group)
            return
        group.members[rank] = node_id
        group.expected.pop(rank, None)
        group.again = group.again or msg.again
        self._record(now, "watch", node=node_id, group_id=gid.hex(), rank=rank, lost=len(group.lost))
        if msg.parent:
            self._expect(gid, group, msg, now)
        if group.lost:
            self._answer(node_id, msg.request_id, group)
            self._close_if_idle(gid, group)
            return
        if rank in group.waiting:  # the same member again (its node reconnected)
            self._withdraw(group, rank)
        group.waiting[rank] = (node_id, msg.request_id)
        self.by_request[(node_id, msg.request_id)] = (gid, rank)
        self.per_node[node_id] = self.per_node.get(node_id, 0) + 1

    def _group(self, node_id: str, msg: p.WatchRequest) -> WatchedGroup | None:
        """The group ``msg`` names (made, or brought back from :attr:`ended`); None once refused
        (its size differs from the one it was watched with)."""
        gid = msg.group_id
        group = self.groups.get(gid)
        if group is None:
            ended = self.ended.get(gid)  # (brought back with its count and its lost members)
            group = WatchedGroup(msg.count) if ended is None else WatchedGroup(ended.count, lost=ended.lost)
        if group.count != msg.count:
            self._refuse(node_id, msg, f"it has {group.count} members, this member said {msg.count}")
            return None
        if gid in self.ended:
            self._forget_ended(gid)
        self.groups[gid] = group
        return group

    def _expect(self, gid: bytes, group: WatchedGroup, msg: p.WatchRequest, now: float) -> None:
        """The members of ``group`` that have not watched it yet are known by their nodes in
        ``msg.parent`` (a group watched now, or one that ended with members lost): one whose node
        is gone already is lost now; the others are lost if their node leaves before they watch
        (:meth:`forget_node`). A member gone from the parent's record (it left it cleanly, or the
        parent is forgotten) is not expected: it is reported once it watches, as without a parent."""
        parent = self.groups.get(msg.parent) or self.ended.get(msg.parent)
        if parent is None:
            return
        gone: dict[int, str] = {}
        for rank, there in enumerate(msg.parent_ranks):
            node_id = parent.members.get(there) if there >= 0 else None
            if node_id is None or rank in group.members or rank in group.lost:
                continue
            if self._alive is not None and not self._alive(node_id):
                gone[rank] = f"rank {rank}'s node is gone (rank {there} of the group before it)"
            else:
                group.expected[rank] = node_id
        if gone:
            self._lose(gid, group, gone, now)

    def _refuse(self, node_id: str, msg: p.WatchRequest, why: str) -> None:
        text = f"watch of group {msg.group_id.hex()[:12]}: {why}"
        self._send(
            node_id, p.ErrorReply(request_id=msg.request_id, kind="InvalidArgumentError", message=text)
        )

    def _lose(self, gid: bytes, group: WatchedGroup, lost: dict[int, str], now: float) -> None:
        """Members ``lost`` are gone: every member watching is answered."""
        fresh = {rank: why for rank, why in lost.items() if rank not in group.lost}
        if not fresh:
            return
        group.lost.update(fresh)
        for rank, why in sorted(fresh.items()):
            self._record(now, "member_lost", group_id=gid.hex(), rank=rank, reason=why[:200])
        for rank in list(group.waiting):  # (a member that gave up too: its node is still here)
            node_id, request_id = self._withdraw(group, rank)
            self._answer(node_id, request_id, group)
        if self._on_lost is not None:
            self._on_lost(gid, now)

    def lost_of(self, group_id: bytes) -> dict[int, str]:
        """The members lost so far of watched group ``group_id`` (rank -> why; none if unknown)."""
        group = self.groups.get(group_id) or self.ended.get(group_id)
        return group.lost if group is not None else {}

    def _answer(self, node_id: str, request_id: int, group: WatchedGroup) -> None:
        ranks = sorted(group.lost)[: p.MAX_MISSING_NAMED]
        reply = p.WatchReply(request_id=request_id, lost=ranks, reasons=[group.lost[r] for r in ranks])
        self._send(node_id, reply)

    def _withdraw(self, group: WatchedGroup, rank: int) -> tuple[str, int]:
        node_id, request_id = group.waiting.pop(rank)
        del self.by_request[(node_id, request_id)]
        self.per_node[node_id] -= 1
        if not self.per_node[node_id]:
            del self.per_node[node_id]
        return node_id, request_id

    def _close_if_idle(self, gid: bytes, group: WatchedGroup) -> None:
        """Forget a group nobody watches any more; its lost members are kept in :attr:`ended`."""
        if group.waiting or self.groups.get(gid) is not group:
            return
        del self.groups[gid]
        if group.lost:
            self.ended[gid] = group
            for node_id in set(group.members.values()):
                self._ended_nodes.setdefault(node_id, set()).add(gid)
            while len(self.ended) > ENDED_KEPT:
                self._forget_ended(next(iter(self.ended)))

    def _forget_ended(self, gid: bytes) -> None:
        group = self.ended.pop(gid)
        for node_id in set(group.members.values()):
            unindex(self._ended_nodes, node_id, gid)

    def cancel(self, node_id: str, request_id: int) -> None:
        """A member withdrew its watch (``CancelLookup``): it left the group cleanly."""
        found = self.by_request.get((node_id, request_id))
        if found is None:
            return
        gid, rank = found
        group = self.groups[gid]
        self._withdraw(group, rank)
        group.members.pop(rank, None)
        self._close_if_idle(gid, group)

    def recovered(self, now: float) -> None:
        """The restart's recovery window closed (see :mod:`.recovery`): the members of a group
        watched again that have not watched again by now are lost (their node died while the
        directory was down, or before it watched again: nothing else would report them)."""
        for gid, group in list(self.groups.items()):
            if group.again:
                group.again = False
                why = "rank {} did not watch again within a lease of the directory's restart"
                missing = {r: why.format(r) for r in range(group.count) if r not in group.members}
                self._lose(gid, group, missing, now)
                self._close_if_idle(gid, group)

    def forget_node(self, node_id: str, now: float, reason: str) -> None:
        """``node_id`` left: its members of every group are lost (of groups nobody watches any
        more too, which nobody is told of but their agreements)."""
        why = "its connection closed" if reason == "left" else reason
        ended = [(gid, self.ended[gid]) for gid in sorted(self._ended_nodes.pop(node_id, ()))]
        for gid, group in ended + list(self.groups.items()):  # (an ended one: nobody to answer)
            gone = {r: f"rank {r}'s node is gone ({why})" for r, n in group.members.items() if n == node_id}
            gone.update(
                {
                    r: f"rank {r}'s node is gone before it watched ({why})"
                    for r, n in group.expected.items()
                    if n == node_id
                }
            )
            for rank in gone:
                group.expected.pop(rank, None)
            if not gone:
                continue
            for rank in [r for r, (n, _) in group.waiting.items() if n == node_id]:
                self._withdraw(group, rank)  # (gone: not answered)
            self._lose(gid, group, gone, now)
            self._close_if_idle(gid, group)

    def problems(self) -> list[str]:
        """Broken invariants of the watches, described (see :mod:`.invariants`)."""
        out: list[str] = []
        index: dict[tuple[str, int], tuple[bytes, int]] = {}
        counts: dict[str, int] = {}
        for gid, group in self.groups.items():
            if not group.waiting:
                out.append(f"watched group {gid.hex()[:12]} is kept with nobody watching")
            for rank, (node_id, request_id) in group.waiting.items():
                index[(node_id, request_id)] = (gid, rank)
                counts[node_id] = counts.get(node_id, 0) + 1
                if group.members.get(rank) != node_id:
                    out.append(f"watching member {rank} of group {gid.hex()[:12]} is not its member")
                if rank in group.lost:
                    out.append(f"lost member {rank} of group {gid.hex()[:12]} still watches")
        if index != self.by_request:
            out.append("the index of watches by request does not match the groups")
        if counts != self.per_node:
            out.append(f"watches per node {self.per_node} are really {counts}")
        return out
