"""The node's part in watched groups (:mod:`hoplite_gpu.directory.watches`): watching a group as one
of its members, giving up on one, and agreeing with the members not lost.
:class:`hoplite_gpu.collective.Group` with ``watch=True`` and elastic training
(:mod:`hoplite_gpu.torch.elastic`) use them; they are :class:`~hoplite_gpu.node.Node` methods."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import protocol as p
from ..errors import HopliteTimeoutError, InvalidArgumentError
from ..iothread import IOThread
from ..object_id import ObjectID
from .session import DirectorySession


def check_parent(parent: Any, parent_ranks: Any, count: int) -> list[int]:
    """A watched group's ``parent`` (an ObjectID or None) and ``parent_ranks``
    (:meth:`GroupWatches.watch_group_async`): ``parent_ranks`` as a list of ``count`` ints in
    -1..MAX_BARRIER_MEMBERS-1 (empty without a parent), or InvalidArgumentError."""
    if parent is None:
        if parent_ranks is not None:
            raise InvalidArgumentError("parent_ranks needs a parent", argument="parent_ranks")
        return []
    if not isinstance(parent, ObjectID):
        raise InvalidArgumentError(
            f"parent must be an ObjectID or None, got {type(parent).__name__}", argument="parent"
        )
    ranks = list(parent_ranks) if isinstance(parent_ranks, (list, tuple)) else None
    bound = p.MAX_BARRIER_MEMBERS
    if ranks is None or len(ranks) != count or any(type(r) is not int or not -1 <= r < bound for r in ranks):
        raise InvalidArgumentError(
            f"parent_ranks must be a list of {count} ints in -1..{bound - 1}", argument="parent_ranks"
        )
    return ranks


@dataclass(frozen=True)
class Agreement:
    """What the directory decided at an agreement (:meth:`GroupWatches.agree`), the same for
    every member: the ranks that came and are not lost (ascending), and the least of their votes
    (0 when none is left)."""

    members: tuple[int, ...]
    vote: int


class GroupWatches:
    """The watched-group methods of :class:`~hoplite_gpu.node.Node` (a part of it)."""

    _io: IOThread
    _session: DirectorySession

    def _check_open(self) -> None:  # (the node's)
        raise NotImplementedError

    async def watch_group_async(
        self,
        group_id: ObjectID,
        rank: int,
        count: int,
        registered: asyncio.Future[None] | None = None,
        parent: ObjectID | None = None,
        parent_ranks: Sequence[int] | None = None,
    ) -> dict[int, str]:
        """Watch a group as its member ``rank`` of ``count``: returns once a member of the group
        is lost, with each lost member's rank and why (at once if one already is). A member is
        lost when its node leaves the directory (its process died or closed the node, or its
        lease ran out) or when it gives up on the group (:meth:`abort_group`). Cancel the call
        to stop watching: this member then leaves the group cleanly and is not reported.
        :class:`hoplite_gpu.collective.Group` with ``watch=True`` uses it. ``registered`` (a
        future of this node's I/O loop) is resolved once the directory holds the watch: this
        member's death is reported from then on (a member that dies before is known to nobody,
        unless ``parent`` names it). ``parent``: a group watched before whose members this
        group's are, rank ``r`` here being rank ``parent_ranks[r]`` there (-1: not a member of
        it; a list of ``count`` ints): a member whose node leaves before it watches this group,
        known by its node there, is lost here too (a group formed among the survivors of
        another, where one more may die before it watches).

        Raises:
            InvalidArgumentError: bad arguments, or the group was watched with another ``count``,
                or ``rank`` is watched from another node.
            QuotaExceededError: this node holds as many watches as the directory allows.
            DirectoryUnavailableError: the directory was lost and did not come back.
        """
        self._check_open()
        self._check_member(group_id, rank, count)
        ranks = check_parent(parent, parent_ranks, count)
        watch = self._session.watch(
            group_id.binary(),
            rank,
            count,
            registered=registered,
            parent=b"" if parent is None else parent.binary(),
            parent_ranks=ranks,
        )
        reply = await self._io.run_async(watch)
        return dict(zip(reply.lost, reply.reasons, strict=False))

    def abort_group(self, group_id: ObjectID, rank: int, count: int, reason: str) -> dict[int, str]:
        """Give up on a group as its member ``rank`` of ``count``, for ``reason``: this member is
        lost from now on, and every member watching the group (:meth:`watch_group_async`) is
        told. Returns the members lost so far (this one included)."""
        return self._io.run(self._abort_group(group_id, rank, count, reason))

    async def abort_group_async(
        self, group_id: ObjectID, rank: int, count: int, reason: str
    ) -> dict[int, str]:
        """Async twin of :meth:`abort_group`."""
        return await self._io.run_async(self._abort_group(group_id, rank, count, reason))

    async def _abort_group(self, group_id: ObjectID, rank: int, count: int, reason: str) -> dict[int, str]:
        self._check_open()
        self._check_member(group_id, rank, count)
        if not isinstance(reason, str) or not reason:
            raise InvalidArgumentError("reason must be a non-empty str", argument="reason")
        reply = await self._session.watch(group_id.binary(), rank, count, abort=reason[:1000])
        return dict(zip(reply.lost, reply.reasons, strict=False))

    def _resolve_timeout(self, timeout: float | None) -> float | None:  # (the node's)
        raise NotImplementedError

    def agree(
        self,
        group_id: ObjectID,
        agreement_id: ObjectID,
        rank: int,
        count: int,
        vote: int = 1,
        timeout: float | None = None,
    ) -> Agreement:
        """Agree with the members of watched group ``group_id`` that are not lost: a barrier
        (``agreement_id``, fresh for each decision) that waits for every member of ``count``
        until it has come or is lost (see :meth:`watch_group_async`), and answers every member
        with the same :class:`Agreement`: the members that came and are not lost, and the least
        of their ``vote`` (an int in 0..2**31-1). This member is not among them if it was
        lost meanwhile. The directory decides it once, so no two members see different outcomes
        (elastic training decides each step's outcome and membership this way).

        Raises:
            HopliteTimeoutError: members neither came nor were lost within ``timeout`` (None:
                ``Config.default_get_timeout``, 0 there: forever); it names them.
            InvalidArgumentError: bad arguments, or the agreement was reached with another
                ``count`` or ``group_id``.
            DirectoryUnavailableError: the directory was lost and did not come back.
        """
        return self._io.run(self.agree_async(group_id, agreement_id, rank, count, vote, timeout))

    async def agree_async(
        self,
        group_id: ObjectID,
        agreement_id: ObjectID,
        rank: int,
        count: int,
        vote: int = 1,
        timeout: float | None = None,
    ) -> Agreement:
        """Async twin of :meth:`agree`."""
        self._check_open()
        self._check_member(group_id, rank, count)
        if not isinstance(agreement_id, ObjectID):
            raise InvalidArgumentError("agreement_id must be an ObjectID", argument="agreement_id")
        if isinstance(vote, bool) or not isinstance(vote, int) or not 0 <= vote <= p.MAX_VOTE:
            raise InvalidArgumentError(f"vote must be an int in 0..{p.MAX_VOTE}", argument="vote")
        wait = self._resolve_timeout(timeout)
        work = self._session.barrier(
            agreement_id.binary(), rank, count, wait, group_id=group_id.binary(), vote=vote
        )
        reply = await self._io.run_async(work)
        if reply.status != "ok":
            raise HopliteTimeoutError(
                f"agreement {agreement_id.hex()[:12]}: {reply.waiting} of {count} members neither "
                f"came nor were lost within {wait} s",
                operation="agree",
                timeout=wait,
                waiting_for_ranks=list(reply.missing),
            )
        return Agreement(tuple(reply.members), reply.vote)

    @staticmethod
    def _check_member(group_id: Any, rank: Any, count: Any) -> None:
        if not isinstance(group_id, ObjectID):
            raise InvalidArgumentError(
                f"group_id must be an ObjectID, got {type(group_id).__name__}", argument="group_id"
            )
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= p.MAX_BARRIER_MEMBERS:
            raise InvalidArgumentError(
                f"count must be an int in 1..{p.MAX_BARRIER_MEMBERS}", argument="count"
            )
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < count:
            raise InvalidArgumentError(f"rank must be an int in 0..{count - 1}", argument="rank")
