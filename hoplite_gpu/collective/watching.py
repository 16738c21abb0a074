"""A :class:`~.group.Group`'s watch of its members (``watch=True``): the error that breaks the
group once one is lost, the collectives in flight it cancels then, and giving up on the group."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..errors import (
    HopliteError,
    InvalidArgumentError,
    MemberLostError,
    NodeClosedError,
    ObjectLostError,
)
from ..node import Node
from ..object_id import ObjectID

T = TypeVar("T")

log = logging.getLogger("hoplite_gpu")


class Watching:
    """The watch of :class:`~.group.Group` on its members (a part of it)."""

    node: Node
    rank: int
    world_size: int
    name: str
    destroyed: bool
    _watching: concurrent.futures.Future[None] | None
    _error: HopliteError | None
    _lost: dict[int, str]
    _tasks: set[asyncio.Task[Any]]
    _on_lost: list[Callable[[HopliteError], None]]
    _parent: tuple[ObjectID, list[int]] | None  # the parent's watch id, and parent_ranks

    def _who(self) -> str:  # (the group's)
        raise NotImplementedError

    @property
    def watching(self) -> bool:
        """Whether this member watches the others (``watch=True``) and has not left."""
        return self._watching is not None and not self._watching.done()

    @property
    def error(self) -> HopliteError | None:
        """What broke the group on this member (a :class:`~hoplite_gpu.errors.MemberLostError`,
        or the error that ended its watch), or None while it works."""
        return self._error

    @property
    def lost(self) -> dict[int, str]:
        """The members lost so far (rank -> why), as far as this member knows."""
        return dict(self._lost)

    def add_lost_callback(self, callback: Callable[[HopliteError], None]) -> None:
        """Call ``callback(error)`` once the group breaks (see :attr:`error`), on the node's I/O
        thread (it must not block); at once if it is broken already."""
        self._on_lost.append(callback)
        if self._error is not None:
            callback(self._error)

    def abort(self, reason: str) -> None:
        """Give up on the group, for ``reason``: this member's collectives in flight and later
        ones raise :class:`~hoplite_gpu.errors.MemberLostError`, and so do the other members'
        once they hear of it (at once where they watch). For a member whose collective failed in
        a way the others cannot see (a timeout, an argument refused before anything was sent).
        Idempotent."""
        if not isinstance(reason, str) or not reason:
            raise InvalidArgumentError("reason must be a non-empty str", argument="reason")
        mine = {self.rank: f"rank {self.rank} gave up on the group: {reason}"}
        io = self.node.io
        if not self.node.closed:
            with contextlib.suppress(HopliteError):
                work = self.node.abort_group_async(self._watch_id(), self.rank, self.world_size, reason)
                lost = io.run(work, timeout=self.node.config.request_timeout + 1.0)
                mine = {**lost, **mine}
        if io.in_thread():
            self._fail(mine)
        else:
            io.loop.call_soon_threadsafe(self._fail, mine)

    def _watch_id(self) -> ObjectID:
        return ObjectID.from_name(f"hoplite-group/{self.name}/watch")

    @property
    def watch_id(self) -> ObjectID:
        """The id of the watched group the members of this group watch (``watch=True``): the
        ``group_id`` of :meth:`Node.agree <hoplite_gpu.node.Node.agree>` among them."""
        return self._watch_id()

    async def _watch(self, registered: concurrent.futures.Future[None]) -> None:
        """Watch the group until a member is lost (then break it), or until cancelled;
        ``registered`` is resolved once the directory holds the watch."""
        held: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def tell(_: asyncio.Future[None]) -> None:
            if not registered.done():
                registered.set_result(None)

        held.add_done_callback(tell)
        parent, ranks = self._parent or (None, None)
        try:
            lost = await self.node.watch_group_async(
                self._watch_id(), self.rank, self.world_size, held, parent=parent, parent_ranks=ranks
            )
        except NodeClosedError:
            return
        except HopliteError as exc:  # the directory is gone, or refused the watch
            if not (self.destroyed or self.node.closed):
                self._fail({}, exc)
            return
        self._fail(lost)

    def _fail(self, lost: dict[int, str], error: HopliteError | None = None) -> None:
        """The group broke (members ``lost``, or ``error``): on the I/O thread, cancel the
        collectives in flight here and tell the callbacks; later collectives raise at once."""
        self._lost.update(lost)
        if self._error is not None:
            return
        if error is None:
            ranks = sorted(self._lost)
            text = "; ".join(self._lost[r] for r in ranks)
            members = f"member{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            error = MemberLostError(
                f"{self._who()}: {members} lost: {text}",
                group=self.name,
                rank=self.rank,
                lost_ranks=ranks,
                reasons=dict(self._lost),
            )
        self._error = error
        for task in list(self._tasks):
            task.cancel()
        for callback in self._on_lost:
            try:
                callback(error)
            except Exception:  # a callback's own failure must not stop the others
                log.exception("a lost-member callback failed")

    def _raise_if_broken(self) -> None:
        error = self._error
        if error is not None:
            raise _again(error)

    async def _guarded(self, coro: Coroutine[Any, Any, T]) -> T:
        """``await coro`` as a collective of a watched group: cancelled once the group breaks,
        which then raises its error."""
        task = asyncio.current_task()
        if self._error is not None or task is None:
            coro.close()
            self._raise_if_broken()
            raise HopliteError("a watched group's collective must run on the node's I/O thread")
        self._tasks.add(task)
        try:
            return await coro
        except asyncio.CancelledError:
            if self._error is not None:
                raise _again(self._error) from None
            raise
        except ObjectLostError as exc:
            # Every copy of a member's object died: that member almost surely did, and the
            # directory's word of it may come a moment after the loss (the soak saw a torch
            # allgather raise the loss, not RankLostError). Wait for it, up to a lease.
            await self._member_loss(exc)
            raise
        finally:
            self._tasks.discard(task)

    async def _member_loss(self, lost: ObjectLostError) -> None:
        """After ``lost``: raise the group's :class:`MemberLostError` if the watch reports a
        member lost within a lease (it cancels this wait), else return."""
        if self._error is None:
            try:
                await asyncio.sleep(self.node.config.lease_timeout + self.node.config.heartbeat_interval)
            except asyncio.CancelledError:
                if self._error is None:
                    raise
        if self._error is not None:
            raise _again(self._error) from lost

    def _stop_watching(self) -> None:
        """Withdraw the watch: this member leaves the group cleanly (not reported as lost)."""
        if self._watching is not None:
            self._watching.cancel()


def _again(error: HopliteError) -> HopliteError:
    """A fresh copy of ``error`` to raise (one instance raised from many calls would pile up
    their tracebacks)."""
    return type(error)(error.message, **error.fields)
