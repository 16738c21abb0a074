"""A group of processes that run collectives together (:class:`Group`), and its barrier.

See :mod:`hoplite_gpu.collective` for how the collectives use it: the objects of the ``n``-th
collective of a group have ObjectIDs derived from (group name, ``n``, rank); a member deletes what
it put once every member is past it; a watched group breaks at once when a member is lost
(:mod:`.watching`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NoReturn, TypeVar

from .. import protocol as p
from ..errors import (
    CollectiveArgumentError,
    HopliteError,
    HopliteTimeoutError,
    InvalidArgumentError,
    ObjectExistsError,
    ObjectLostError,
    ReduceMismatchError,
)
from ..iothread import all_or_cancel
from ..memory import LocalObject
from ..node import Node
from ..node.watches import check_parent
from ..object_id import ObjectID
from ..reduce_ops import ReduceOp
from .host import close_listener, wait_limit
from .watching import Watching

T = TypeVar("T")

#: Member objects a group remembers, to name the ranks a timed-out collective waited for.
DESCRIBED_KEPT = 4096
#: Seconds ``Group.destroy(wait=False)`` waits for the other members when the group has no timeout.
DESTROY_WAIT = 300.0
_HEX_ID = re.compile(r"\b[0-9a-f]{40}\b")


class Group(Watching):
    """A fixed set of ``world_size`` processes that run collectives together.

    Args:
        node: This process's node.
        rank: This member's rank, in ``0..world_size-1``.
        world_size: Number of members.
        name: The group's name; identical on every member.
        timeout: Seconds each collective may wait for the other members (0: no limit; None:
            ``Config.default_get_timeout`` of the node, where 0 means no limit too).
        watch: Watch the other members (:meth:`Node.watch_group_async
            <hoplite_gpu.node.Node.watch_group_async>`): once one is lost (its process died or
            closed its node without :meth:`destroy`, its lease ran out, or it called
            :meth:`abort`), every collective in flight on this member and every later one raises
            :class:`~hoplite_gpu.errors.MemberLostError` naming it, instead of waiting for the
            timeout. Every collective then runs on the node's I/O thread (where it can be
            cancelled), not on the caller's channel: a small one costs a few tens of
            microseconds more.
        parent: With ``watch``, a watched group (of this node) whose members this group's are,
            rank ``r`` here being rank ``parent_ranks[r]`` there (-1: not a member of it): a
            member whose node leaves before it watches this group is lost here too (it is known
            by its node there). For a group formed among the survivors of another (elastic
            training's next epoch), where one more may die before it watches: without it, the
            others would wait for that member until their timeout.
        parent_ranks: With ``parent``: one int per member of this group.
    """

    def __init__(
        self,
        node: Node,
        rank: int,
        world_size: int,
        name: str = "default",
        timeout: float | None = None,
        watch: bool = False,
        parent: Group | None = None,
        parent_ranks: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(node, Node):
            raise InvalidArgumentError(
                f"node must be a hoplite_gpu.Node, got {type(node).__name__}", argument="node"
            )
        if not isinstance(world_size, int) or world_size < 1:
            raise InvalidArgumentError("world_size must be an int >= 1", argument="world_size")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise InvalidArgumentError(f"rank must be an int in 0..{world_size - 1}", argument="rank")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError("name must be a non-empty str", argument="name")
        if timeout is not None and timeout < 0:
            raise InvalidArgumentError("timeout must be >= 0 or None", argument="timeout")
        if parent is not None and not (isinstance(parent, Group) and watch and parent.node is node):
            raise InvalidArgumentError(
                "parent must be a Group of the same node, and needs watch=True", argument="parent"
            )
        watch_id = None if parent is None else parent.watch_id
        ranks = check_parent(watch_id, parent_ranks, world_size)  # (here, not once it watches)
        self._parent = None if watch_id is None else (watch_id, ranks)
        self.node = node
        self.rank = rank
        self.world_size = world_size
        self.name = name
        self.timeout = math.inf if timeout == 0 else timeout  # (to a get, 0 would mean at once)
        self.seq = 0  # collectives started so far
        self._owned: list[tuple[int, ObjectID]] = []  # (sequence number, object) this member created
        self._deleting: set[asyncio.Future[Any]] = set()  # background deletes in flight
        self._sent: dict[tuple[int, int], int] = {}  # point-to-point messages sent, per (rank, tag)
        self._received: dict[tuple[int, int], int] = {}  # and received, per (rank, tag)
        self._acks: dict[tuple[int, int], ObjectID] = {}  # the last acknowledgement put, per (sender, tag)
        self._peers: list[Any] = []  # members' hosts and data planes (collective.ring)
        self._spare: list[Any] = []  # its receive buffers, kept for the next (collective.ring)
        self._scratch: Any = None  # a direct reduce's partial sums, kept for the next (the same)
        self._listener: Any = None  # where the members on this host connect (collective.host)
        self._mesh: Any = None  # its sockets to them and shared segments, once made (the same)
        self._wire: Any = None  # its connections along the ring, once made (collective.wire)
        # See _describe; an OrderedDict: point-to-point calls on other threads add to it too.
        self._described: OrderedDict[str, tuple[str, int | None]] = OrderedDict()
        self.destroyed = False  # see destroy
        # Watching (see the class's docstring): the watch, the error that broke the group (set on
        # the I/O thread), the collectives in flight there, and who to tell.
        self._watching: concurrent.futures.Future[None] | None = None
        self._error: HopliteError | None = None
        self._lost: dict[int, str] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_lost: list[Callable[[HopliteError], None]] = []
        if watch:
            # Returns once the directory holds the watch (or the watch ended: refused, or the
            # directory gone): a member that dies after its group was made is always reported.
            registered: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._watching = node.io.submit(self._watch(registered))
            bound = node.config.reconnect_timeout + node.config.request_timeout
            concurrent.futures.wait([registered, self._watching], bound, concurrent.futures.FIRST_COMPLETED)

    def __repr__(self) -> str:
        return (
            f"<hoplite_gpu.collective.Group {self.name!r} rank {self.rank}/{self.world_size} seq {self.seq}>"
        )

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def object_id(self, seq: int, kind: str, *parts: int) -> ObjectID:
        """The ObjectID of an object of collective number ``seq`` (the same on every member)."""
        tail = "/".join(str(x) for x in parts)
        oid = ObjectID.from_name(f"hoplite-group/{self.name}/{seq}/{kind}/{tail}")
        # Member inputs end with the rank that puts them; results and the root's broadcast don't.
        producer = parts[-1] if parts and not kind.endswith("result") else None
        self._describe(oid, f"{kind} #{seq}", producer)
        return oid

    def p2p_id(self, src: int, dst: int, n: int, kind: str = "p2p", tag: int = 0) -> ObjectID:
        """The ObjectID of the ``n``-th message from ``src`` to ``dst`` with ``tag`` (or of its
        acknowledgement)."""
        lane = f"{src}/{dst}" if tag == 0 else f"{src}/{dst}/t{tag}"
        oid = ObjectID.from_name(f"hoplite-group/{self.name}/{kind}/{lane}/{n}")
        what = f"{kind} {src}->{dst} #{n}" + (f" (tag {tag})" if tag else "")
        self._describe(oid, what, dst if kind.endswith("ack") else src)
        return oid

    def _describe(self, oid: ObjectID, what: str, producer: int | None) -> None:
        """Remember what ``oid`` is and which rank puts it, to name the members a timed-out
        collective waited for (the newest :data:`DESCRIBED_KEPT`)."""
        self._described[oid.hex()] = (what, producer)
        if len(self._described) > DESCRIBED_KEPT:
            with contextlib.suppress(KeyError):  # (another thread trimmed it)
                self._described.popitem(last=False)

    def _named(self, exc: HopliteTimeoutError) -> HopliteTimeoutError:
        """``exc`` with the group, this member and the ranks whose objects it waited for."""
        ranks: list[int] = list(exc.fields.get("waiting_for_ranks", []))  # a barrier's
        waiting = [f"rank {r}'s arrival" for r in ranks]
        for hex_id in dict.fromkeys([*_HEX_ID.findall(exc.message), str(exc.fields.get("object_id") or "")]):
            if hex_id not in self._described:
                continue
            producer = self._described[hex_id][1]
            if producer is not None:
                ranks.append(producer)
            waiting.append(self._object(hex_id))
        text = (
            f"{exc.message} [{self._who()}" + (f"; waiting for {', '.join(waiting)}" if waiting else "") + "]"
        )
        fields = {
            **exc.fields,
            "group": self.name,
            "rank": self.rank,
            "waiting_for_ranks": sorted(set(ranks)),
        }
        return HopliteTimeoutError(text, **fields)

    def destroy(self, wait: bool = True) -> concurrent.futures.Future[None] | None:
        """Delete the objects this member created, once every member is past them; later
        collectives on this member's group raise :class:`InvalidArgumentError` (again: no-op).

        Args:
            wait: True: a barrier first (every member calls ``destroy``), then the deletes.
                False: return at once, leaving the barrier and the deletes to run in the
                background (``destroy_collective_group`` in Ray is local: a member destroys its
                group without the others). They wait for the others at most the group's timeout
                (:data:`DESTROY_WAIT` when it has none), then delete anyway: a member that never
                destroys its group only delays this one's clean-up.

        Returns:
            With ``wait=False``, a future that completes when this member's objects are deleted
            (None when the group was already destroyed); else None.

        Raises:
            MemberLostError, HopliteTimeoutError: (``wait``) the barrier failed: a member was lost
                or did not come. This member's objects are deleted all the same.
        """
        if self.destroyed or self.node.closed:
            self.destroyed = True
            self._stop_watching()
            return None
        if self._error is not None:  # broken: the others will not come to a barrier
            self._leave_broken()
            return None
        if wait:
            try:
                barrier(self)
            except HopliteError:
                # A member was lost (or never came): nobody will read this member's objects, which
                # are deleted all the same, and the caller learns the group broke.
                self._leave_broken()
                raise
            self.destroyed = True
            self._stop_watching()  # every member is past every collective: leave cleanly
            self._run(self._clean_up())
            return None
        self.destroyed = True
        seconds = self.timeout if self.timeout and math.isfinite(self.timeout) else DESTROY_WAIT
        return self.node.io.submit(self._destroy_later(seconds))

    def _leave_broken(self) -> None:
        """Destroy a group the others will not come to a barrier of: delete this member's objects
        now and stop watching."""
        self.destroyed = True
        self._stop_watching()
        self._call(lambda: self.node.io.run(self._clean_up()))

    async def _destroy_later(self, seconds: float) -> None:
        try:
            if self._error is None:
                await asyncio.wait_for(_barrier(self, self._next()), seconds)
                self._stop_watching()  # every member is past every collective: leave cleanly
        except (HopliteError, TimeoutError):
            pass  # a member gone or never destroying its group: clean up without it
        await self._clean_up()

    async def _clean_up(self) -> None:
        """Delete this member's objects (after the final barrier, see :meth:`destroy`)."""
        self._leave_host()
        last = self.seq - 1
        self._owned += [(last, ack) for ack in self._acks.values()]  # every sender has read them
        self._acks.clear()
        await self._delete_before(self.seq, wait=True)

    def _leave_host(self) -> None:
        """Close this member's mesh and listening socket (:mod:`.host`), if it has them."""
        mesh, self._mesh = self._mesh, None
        if mesh is not None:
            mesh.close()
        close_listener(self)
        wire, self._wire = self._wire, None
        if wire is not None:
            wire.stop()

    def refuse(self, error: BaseException) -> NoReturn:
        """Raise ``error`` as this member's next collective. A layer over this API that
        refuses a call's arguments before making the call (the Ray backend, say) calls this
        instead of raising, so that the call still takes its place in the group's order: the
        other members' call fails (at once where the members share a host's memory, else by the
        group's timeout) and the group's next collective runs in step on every member."""
        _check_group(self)
        self._tell_refused(self._next())
        raise error

    # ------------------------------------------------------------ plumbing
    def _tell_refused(self, seq: int) -> None:
        """Tell the others through the members' mesh, if they have one, that this member refused
        round ``seq`` (:meth:`~.host.Mesh.refuse`): they fail it at once, and the mesh stays."""
        if self._wire is not None:
            self._wire.refuse(seq)
        mesh = self._mesh
        if mesh is not None and not mesh.broken:
            with contextlib.suppress(HopliteError):  # (the mesh is left then; the error stands)
                self._call(lambda: mesh.refuse(seq, wait_limit(self), self._raise_if_broken))

    def _next(self) -> int:
        seq = self.seq
        self.seq += 1
        return seq

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._watching is not None:
            if self._error is not None:
                coro.close()
                self._raise_if_broken()
            return self._call(lambda: self.node.io.run(self._guarded(coro)))
        return self._call(lambda: self.node.io.run(coro))

    def _call(self, work: Callable[[], T]) -> T:
        """``work()``, a blocking call of the node's, its errors told as this member's."""
        try:
            return work()
        except HopliteTimeoutError as exc:
            raise self._named(exc) from None
        except CollectiveArgumentError:
            raise
        except (InvalidArgumentError, ReduceMismatchError) as exc:  # what other members put
            text = _HEX_ID.sub(lambda found: self._object(found.group(0)), exc.message)
            raise CollectiveArgumentError(f"{text} [{self._who()}]", **exc.fields) from None

    def _who(self) -> str:
        """This member, for errors: ``group 'x', rank 1 of 4``."""
        return f"group {self.name!r}, rank {self.rank} of {self.world_size}"

    def _object(self, hex_id: str) -> str:
        """An object's hex id, with what it is and whose where this member knows it (see
        :meth:`_describe`): ``rank 2's allreduce #0 (9de9f712acfc)``."""
        if hex_id not in self._described:
            return hex_id
        what, producer = self._described[hex_id]
        whose = f"rank {producer}'s " if producer is not None else "the "
        return f"{whose}{what} ({hex_id[:12]})"

    async def _put_own(
        self, seq: int, array: Any, oid: ObjectID, borrow: bool = False, consumable: bool = False
    ) -> None:
        """Put ``array`` as ``oid`` (this member's, deleted once every member is past ``seq``).
        A group's ids are never put twice, so its objects carry no digest: hashing every byte on
        the I/O thread was an eighth of that thread's busy time in a 1 GB/s allreduce
        (bench/pages/defaults.md, "Group puts without a digest"). With ``borrow`` the store keeps
        ``array`` itself where it would copy it only for same-host readers (``put(copy=False)``):
        for a collective that returns once nothing reads it any more, and then deletes it
        (:meth:`_delete_now`), or withdraws it if it fails (:meth:`_withdraw`); ``consumable``:
        the reduction reading it may write its output over it (``put(consumable=True)``)."""
        self._owned.append((seq, oid))
        await self.node.put_async(
            array, oid, copy=not borrow, digest=False, borrow=borrow, consumable=consumable
        )

    def _withdraw(
        self, oids: list[ObjectID], copies: Sequence[LocalObject] = (), before: int | None = None
    ) -> asyncio.Future[Any]:
        """Stop serving the caller's memory now: these objects of this member's (then deleted)
        and these ``copies`` of others' objects received into it (the directory learns they are
        gone from the next reader they are offered to). For a collective that lent the caller's
        array, before it returns. Pulls of them stop at their next chunk; the future is done once
        they did (or after ``stall_timeout``). ``before``: this member's objects of the
        collectives before it go in the same request (:meth:`_delete_before`)."""
        held = self.node.withdraw(oids, copies)
        stall = self.node.config.stall_timeout
        earlier = [] if before is None else self._owned_before(before)
        deleting = self._delete_now([*oids, *earlier])
        return asyncio.gather(*(obj.wait_unserved(stall) for obj in held), deleting)

    async def _lending(
        self, seq: int, lent: list[ObjectID], steps: Coroutine[Any, Any, T], rejoined_before: bool = False
    ) -> T:
        """``await steps`` of collective ``seq``, which lends the caller's memory as ``lent``. If
        the node rejoins a restarted directory meanwhile, ``lent`` are failed at once, before the
        node restores its copies (results received in place may have overwritten their bytes, and
        the restarted directory would rebuild the unfinished reductions from them: the soak saw
        wrong sums), and this raises :class:`ObjectLostError`; at once if ``rejoined_before``
        (the node rejoined since the collective began: the other members withdrew theirs)."""
        restarted: asyncio.Future[ObjectLostError] = asyncio.get_running_loop().create_future()

        def rejoined() -> None:
            if restarted.done():
                return
            error = ObjectLostError(
                f"the directory restarted during allreduce #{seq}: the reductions of the "
                "shards this member lent cannot be rebuilt (results received in place overwrite "
                f"them); call it again [{self._who()}]",
                object_id=lent[0].hex(),
            )
            self.node.withdraw(lent, error=error)
            restarted.set_result(error)

        task: asyncio.Future[Any] = asyncio.ensure_future(steps)
        self.node.add_rejoin_callback(rejoined)
        if rejoined_before:
            rejoined()
        try:
            await asyncio.wait([task, restarted], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        finally:
            self.node.remove_rejoin_callback(rejoined)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise restarted.result()

    async def _get_received(
        self, oid: ObjectID, out: Any, received: list[LocalObject], via: ObjectID | None = None
    ) -> Any:
        """``get_async(oid, out=out, direct=True, via=via)``, but a copy pulled over the data plane
        into a C-contiguous NumPy ``out`` is received straight into it and appended to
        ``received`` (:meth:`Node.receive_into_async <hoplite_gpu.node.Node.receive_into_async>`):
        it stays in the store (served to others) until :meth:`_withdraw`, which must come before
        ``out`` changes (a collective's results, see ``_sharded_allreduce``)."""
        return await self.node.receive_into_async(oid, out, received, self.timeout, direct=True, via=via)

    async def _delete_before(self, seq: int, wait: bool = False) -> None:
        """Delete this member's objects of collectives before ``seq`` (every member is past them),
        in the background unless ``wait``: the collective that frees them need not wait."""
        await self._delete_now(self._owned_before(seq), wait)

    def _owned_before(self, seq: int) -> list[ObjectID]:
        """This member's objects of the collectives before ``seq``."""
        return [oid for s, oid in self._owned if s < seq]

    async def _delete_now(self, oids: list[ObjectID], wait: bool = False) -> None:
        """Delete these objects of this member's (in the background unless ``wait``), with one
        request."""
        if not oids:
            return
        gone = set(oids)
        self._owned = [(s, oid) for s, oid in self._owned if oid not in gone]
        await self._delete_all(oids, wait)

    def _releasable(self, seq: int) -> list[ObjectID]:
        """The objects of this member's collectives before ``seq`` that a barrier's arrival can
        release (``BarrierRequest.release``): those it put, not the reductions it requested
        (their records on the node go on the I/O thread, with :meth:`_release_before`)."""
        oids = self._owned_before(seq)
        return [oid for oid in oids if not self.node.requested_reduction(oid)][: p.MAX_BARRIER_RELEASE]

    def _release_before(self, seq: int, released: Sequence[ObjectID] = ()) -> None:
        """:meth:`_delete_before` from the caller's thread, without waiting: the I/O thread only
        deletes (``_owned`` changes on the caller's thread, as collectives put from there).
        ``released``: those the directory deleted already (a barrier's, :meth:`_releasable`)."""
        gone = set(released)
        oids = [oid for s, oid in self._owned if s < seq and oid not in gone]
        self._owned = [(s, oid) for s, oid in self._owned if s >= seq]
        if oids:
            self.node.io.submit(self._delete_all(oids))

    async def _delete_all(self, oids: list[ObjectID], wait: bool = False) -> None:
        """Delete these objects (in the background unless ``wait``), with one request."""
        deleting = asyncio.gather(self.node.delete_many_async(oids), return_exceptions=True)
        if wait:
            await deleting
        else:
            self._deleting.add(deleting)
            deleting.add_done_callback(self._deleting.discard)

    async def _reduce_into(
        self,
        seq: int,
        inputs: list[ObjectID],
        result: ObjectID,
        op: ReduceOp,
        out: Any,
        contribution: Coroutine[Any, Any, Any] | None = None,
        degree: int | None = None,
        ordered: bool = False,
    ) -> Any:
        """Request the reduction of ``inputs`` into ``result`` and read it into ``out`` (unless
        None), after awaiting ``contribution`` (this member's put) if given: the three requests go
        out back to back, without waiting for each other's replies (the directory handles them in
        order), so a small collective costs one round trip to the directory, not three."""
        self._owned.append((seq, result))
        steps = [] if contribution is None else [contribution]

        async def requested() -> None:
            try:
                await self.node.reduce_async(
                    inputs, op, reduction_id=result, timeout=self.timeout, degree=degree, ordered=ordered
                )
            except ObjectExistsError:  # the same reduction, asked with another operator or inputs
                raise CollectiveArgumentError(
                    f"{self._object(result.hex())}: another member asked for it with another "
                    f"operator or other inputs; every member's call must match [{self._who()}]"
                ) from None

        steps.append(requested())
        if out is not None:
            steps.append(self.node.get_async(result, timeout=self.timeout, out=out))
        done = await all_or_cancel(steps)
        return done[-1] if out is not None else None


def _check_group(group: Any) -> Group:
    if not isinstance(group, Group):
        raise InvalidArgumentError(
            f"group must be a hoplite_gpu.collective.Group, got {type(group).__name__}", argument="group"
        )
    if group.destroyed:
        raise InvalidArgumentError(f"group {group.name!r} was destroyed on this member", argument="group")
    return group


def _check_rank(group: Group, rank: Any, argument: str) -> int:
    if not isinstance(rank, int) or not 0 <= rank < group.world_size:
        raise InvalidArgumentError(
            f"{argument} must be an int in 0..{group.world_size - 1}", argument=argument
        )
    return rank


def _check_list(g: Group, arrays: Any, argument: str) -> None:
    if not isinstance(arrays, list) or len(arrays) != g.world_size:
        raise InvalidArgumentError(f"{argument} must be a list of {g.world_size} arrays", argument=argument)


def _check_tag(tag: Any) -> None:
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise InvalidArgumentError(f"tag must be an int, got {type(tag).__name__}", argument="tag")


def _check_peer(group: Group, rank: Any, argument: str) -> int:
    _check_rank(group, rank, argument)
    if rank == group.rank:
        raise InvalidArgumentError(f"{argument} is this member's own rank ({rank})", argument=argument)
    return int(rank)


def barrier(group: Group) -> None:
    """Return once every member has called ``barrier``: one message to the directory per member,
    answered once all have come (``HopliteTimeoutError`` naming the ranks missing when the
    group's timeout passes first)."""
    g = _check_group(group)
    seq = g._next()
    if g._watching is not None:  # on the I/O thread, where it can be cancelled
        g._run(_barrier(g, seq))
        return
    # The objects of earlier collectives that this member put go with its arrival, deleted by the
    # directory once every member has come: no message, nor I/O-thread work, of their own to
    # overlap the next collective (bench/pages/small-operations.md#barrier-releases). The rest after
    # it, as before.
    release = g._releasable(seq)
    # From the caller's thread, on its channel where it has one (hoplite_gpu.node.channel).
    g._call(lambda: _arrive(g, seq, release))
    g._release_before(seq, release)


async def _barrier(g: Group, seq: int) -> None:
    """Collective ``seq``: a barrier of the directory's (:mod:`hoplite_gpu.directory.barriers`)."""
    try:
        await g.node.barrier_async(_barrier_id(g, seq), g.rank, g.world_size, g.timeout)
    except HopliteTimeoutError as exc:
        raise _late(g, seq, exc) from None
    await g._delete_before(seq)


def _barrier_id(g: Group, seq: int) -> ObjectID:
    return ObjectID.from_name(f"hoplite-group/{g.name}/{seq}/barrier")


def _arrive(g: Group, seq: int, release: list[ObjectID]) -> None:
    """Barrier ``seq`` from the caller's thread, releasing ``release`` once every member came."""
    try:
        g.node.barrier(_barrier_id(g, seq), g.rank, g.world_size, g.timeout, release)
    except HopliteTimeoutError as exc:
        raise _late(g, seq, exc) from None


def _late(g: Group, seq: int, exc: HopliteTimeoutError) -> HopliteTimeoutError:
    """The node's timeout ``exc`` at barrier ``seq``, told with the group's number for it."""
    missing, waiting, timeout = exc.fields["waiting_for_ranks"], exc.fields["waiting"], exc.fields["timeout"]
    named = f" (the first {len(missing)} named)" if waiting > len(missing) else ""
    return HopliteTimeoutError(
        f"barrier #{seq}: {waiting} of {g.world_size} members did not come within {timeout} s{named}",
        operation="barrier",
        timeout=timeout,
        waiting_for_ranks=missing,
    )
