"""The collectives of a :class:`~.group.Group` other than its barrier (see
:mod:`hoplite_gpu.collective`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

import numpy as np

from .. import memory
from ..config import Config
from ..errors import CollectiveArgumentError, InvalidArgumentError, ObjectLostError
from ..faults import INJECTOR
from ..iothread import all_or_cancel
from ..memory import LocalObject
from ..object_id import ObjectID
from ..reduce_ops import ReduceOp, as_op
from .group import Group, _check_group, _check_list, _check_rank
from .host import meets, wait_limit
from .ring import direct_allreduce, direct_reduce, goes_direct, ring_peers
from .wire import ON_WIRE, goes_wire, on_wire


def broadcast(array: Any, src_rank: int, group: Group) -> Any:
    """Copy ``src_rank``'s ``array`` into ``array`` on every member (in place); returns it."""
    g = _check_group(group)
    seq = g._next()  # taken before any check: a call refused here keeps its round
    _check_rank(g, src_rank, "src_rank")
    oid = g.object_id(seq, "broadcast")
    g._describe(oid, f"broadcast #{seq} (the root's)", src_rank)

    if g.rank == src_rank:
        g._raise_if_broken()
        g._owned.append((seq, oid))  # a group's ids are never put twice: no digest (see _put_own)
        # From the caller's thread: a small array goes on its channel (hoplite_gpu.node.channel).
        g._call(lambda: g.node.put(array, oid, copy=True, digest=False))
        return array
    if g._watching is not None:  # on the I/O thread, where it can be cancelled
        return g._run(g.node.get_async(oid, timeout=g.timeout, out=array))
    return g._call(lambda: g.node.get(oid, timeout=g.timeout, out=array))


def reduce(array: Any, dst_rank: int, group: Group, op: ReduceOp | str = ReduceOp.SUM) -> Any:
    """Reduce every member's ``array`` into ``array`` on ``dst_rank`` (in place); returns it.

    Other members' arrays are left as they are. Where every member shares this host's memory,
    a host array of any size goes through shared memory, as :func:`allreduce` does
    (:mod:`hoplite_gpu.collective.host`), but that only ``dst_rank`` copies the reduced chunks
    out: the others return once they reduced theirs. Else, where every
    member runs the TCP data plane and
    none asks for the directory's schedule (``Config.allreduce_schedule``; unlike
    :func:`allreduce`'s direct ring, members that share a host's memory go this way too), an array
    of more than the directory keeps inline (``Config.allreduce_direct_bytes``) goes along a
    chain of the members in ring order that ends at ``dst_rank``, member to member over the data
    plane, with no message to the directory in a round
    (:func:`~hoplite_gpu.collective.ring.direct_reduce`): each other
    member returns once the next has read its partial reduction, and a member that dies fails
    the call (:class:`~hoplite_gpu.errors.MemberLostError` in a watched group); ``dst_rank``'s
    array is then undefined. Otherwise each member puts its array and the directory shapes the
    reduction's tree as they arrive: the other members return as soon as their contribution is
    registered.

    ``dst_rank``'s ``array`` is one :func:`allreduce` takes; the others' may be anything ``put``
    takes, read-only arrays included.
    """
    g = _check_group(group)
    seq = g._next()  # taken before any check: a call refused here keeps its round
    with _refused_on_host(g, seq):
        _check_rank(g, dst_rank, "dst_rank")
        reduce_op = as_op(op)
        if g.rank == dst_rank:
            _check_result_array(array)
    refused: list[str] = []
    caller = array
    array, back = _working(array, refused, write=g.rank == dst_rank)
    inputs = [g.object_id(seq, "reduce", r) for r in range(g.world_size)]
    flat = memory.flat_view(array)
    n = g.world_size

    async def run() -> Any:
        mine = g._put_own(seq, array, inputs[g.rank])
        if g.rank != dst_rank:
            await mine
        else:  # the one requester: the directory computes the root on its node
            await g._reduce_into(seq, inputs, g.object_id(seq, "reduce-result"), reduce_op, array, mine)
        return array

    async def chain(host: bool = True) -> Any:
        peers = await ring_peers(g, seq)
        if host and await meets(g, seq, peers, "reduce"):
            return ON_HOST
        large = flat.size >= n and flat.nbytes >= g.node.config.direct_min_bytes
        if not (large and goes_direct(peers, sharing=True)):
            return await run()
        if goes_wire(g, flat, sharing=True):
            return ON_WIRE

        def along(host: np.ndarray) -> Awaitable[None]:
            return direct_reduce(g, seq, host, reduce_op, peers, dst_rank)

        return await _direct(g, seq, array, flat, along, g.rank == dst_rank)

    if n > 1 and flat is not None and flat.size:
        if not on_wire(g, seq, flat, reduce_op, dst_rank):
            if _via_host(g, seq, array, flat, reduce_op, dst_rank, chain) is ON_WIRE:
                on_wire(g, seq, flat, reduce_op, dst_rank)  # (the members just learnt each other)
    else:
        g._run(run())
    if back:
        memory.copy_into(caller, array)
    return _raise_refused(g, seq, "reduce", refused, caller)


#: The default of ``Config.allreduce_shard_bytes``: arrays of at least this many bytes are
#: allreduced in shards (see :func:`allreduce`); smaller ones, whose time is latency rather than
#: bandwidth, as one reduce pipelined into a broadcast.
SHARD_MIN_BYTES: int = Config().allreduce_shard_bytes


def allreduce(array: Any, group: Group, op: ReduceOp | str = ReduceOp.SUM) -> Any:
    """Reduce every member's ``array`` and write the result into ``array`` everywhere (in place).

    Where every member shares this host's memory (and ``Config.allreduce_schedule`` is
    ``auto``), a C-contiguous host array of any size goes through shared memory
    (:mod:`hoplite_gpu.collective.host`): each member copies its array into a segment it keeps,
    reduces its own chunk of every member's segment in place, and copies the others' reduced
    chunks out, signalled member to member over Unix sockets, with no message to the directory
    in a round (a device array takes the paths below: CUDA IPC between the processes).
    Otherwise, where no two members share a host's memory (``Config.allreduce_schedule``), a
    C-contiguous array of more than the directory keeps inline (``Config.allreduce_direct_bytes``:
    above 64 KiB by default) goes by the direct ring (:mod:`hoplite_gpu.collective.ring`): it is cut
    into one chunk per member, each member pulls the running sums from the member before it over the
    data plane, adds its own chunk in place and is read on by the next, then the whole sums go round
    the same way, with no message to the directory in a round; where every member runs the TCP
    data plane it runs on the caller's thread, over connections each member keeps to the next
    (:mod:`hoplite_gpu.collective.wire`). Else a small array (under
    ``Config.allreduce_shard_bytes``, :data:`SHARD_MIN_BYTES` by default) is reduced once, on a tree
    the directory shapes, and the result read by every member as it is being reduced; a large one is
    cut into one shard per member, and member ``j`` requests the reduction of everyone's shard
    ``j``. With the ring schedule (``ring``, and ``auto`` where the direct ring does not go) it is a
    chain in ring order, ``j+1 -> j+2 -> ... -> j`` (``reduce(ordered=True)``), and its result is
    read along the same ring, each member from the one before it (``get(via=...)``), while it is
    being computed: every byte goes from a member to the next, so each link carries one member's
    traffic each way, like Gloo's ring. With the star schedule every other member's shard streams
    straight into ``j``'s vertex and every member reads ``j``'s result straight from it
    (``get(direct=True)``). Either way each member's link carries ``2 (N-1)/N`` times the array's
    bytes each way, the bandwidth-optimal amount, whatever the order in which members arrive. The
    shards are ordinary reductions (a tree that loses a vertex is rebuilt like any other), but a
    member that dies takes its own shard with it: the call then raises a typed error
    (:class:`~hoplite_gpu.errors.MemberLostError` at once in a watched group), never a wrong sum.
    The large array is read in place by the other members while the call runs (not copied first):
    write to it only once the call has returned or raised.

    ``array`` is a NumPy or CuPy array (anything else is refused before the round); one that is
    not C-contiguous is worked on as a contiguous copy, the result copied back. A read-only
    NumPy array takes part in the round through a copy, then raises
    :class:`~hoplite_gpu.errors.CollectiveArgumentError` (the others get their results).
    """
    g = _check_group(group)
    seq = g._next()  # taken before any check: a call refused here keeps its round
    with _refused_on_host(g, seq):
        reduce_op = as_op(op)
        _check_result_array(array)
    refused: list[str] = []
    caller = array
    array, back = _working(array, refused)
    flat = memory.flat_view(array)
    if g.world_size > 1 and flat is not None and flat.size:
        if not on_wire(g, seq, flat, reduce_op):
            done = _via_host(
                g, seq, array, flat, reduce_op, None, lambda h: _large(g, seq, array, flat, reduce_op, h)
            )
            if done is ON_WIRE:  # (the members just learnt each other)
                on_wire(g, seq, flat, reduce_op)
    else:
        g._run(_small_allreduce(g, seq, array, reduce_op))
    if back:
        memory.copy_into(caller, array)
    return _raise_refused(g, seq, "allreduce", refused, caller)


def _check_result_array(array: Any) -> None:
    """Raise ``InvalidArgumentError`` unless ``array`` is one a result can be written into in
    place (a NumPy or CuPy array), before the round: the other members are told at once where
    they share a mesh (:func:`_refused_on_host`), not by their timeout."""
    if memory.kind_of(array) not in memory.OUT_KINDS:
        raise InvalidArgumentError(
            f"array must be a NumPy or CuPy array (the result is written into it), "
            f"got {type(array).__name__}",
            argument="array",
        )


def _working(array: Any, refused: list[str], write: bool = True) -> tuple[Any, bool]:
    """What a reduction's round works on for the caller's ``array``, and whether its result is
    then copied back into ``array``. A read-only NumPy array that the result goes into
    (``write``) is stood in for (:func:`_stand_in`); a NumPy or CuPy array that is not
    C-contiguous is worked on as a C-contiguous copy, so that every member's round takes the
    same path whatever the layout of its array (such an array on one member once took another
    path than the others', and the round waited out the group's timeout)."""
    if write:
        stand_in = _stand_in(array, refused, "array")
        if stand_in is not array:
            return stand_in, False
    kind = memory.kind_of(array)
    if memory.flat_view(array) is not None or kind not in (memory.ArrayKind.NUMPY, memory.ArrayKind.CUPY):
        return array, False
    xp = np if kind is memory.ArrayKind.NUMPY else __import__("cupy")
    return xp.ascontiguousarray(array), write


def _stand_in(array: Any, refused: list[str], name: str) -> Any:
    """``array``; or, where it is a read-only NumPy array that a collective writes its result
    into, a writable copy of it (and ``name`` goes into ``refused``). The round runs on the
    copy as on every other member, which get their results and stay in step with this one;
    then :func:`_raise_refused` fails the call."""
    if isinstance(array, np.ndarray) and not array.flags.writeable:
        refused.append(name)
        return np.array(array, order="C")
    return array


def _raise_refused(g: Group, seq: int, what: str, refused: list[str], done: Any) -> Any:
    """``done`` (the round's result) where ``refused`` is empty, else ``CollectiveArgumentError``
    naming the read-only arrays :func:`_stand_in` stood in for."""
    if not refused:
        return done
    raise CollectiveArgumentError(
        f"{what} #{seq}: {', '.join(refused)} {'is' if len(refused) == 1 else 'are'} read-only, "
        "so the result was not written (the round ran on a copy: the other members have their "
        f"results) [{g._who()}]"
    )


@contextlib.contextmanager
def _refused_on_host(g: Group, seq: int) -> Iterator[None]:
    """Checks of round ``seq``'s arguments: where they fail and the members have a mesh, this
    member tells the others through it (:meth:`~.host.Mesh.refuse`), so that they fail the round
    at once, alike, and the mesh stays; then the check's error is raised."""
    try:
        yield
    except InvalidArgumentError:
        g._tell_refused(seq)
        raise


#: What a round's path off the mesh returns once it made the mesh (:func:`_via_host`).
ON_HOST = object()


def _via_host(
    g: Group,
    seq: int,
    array: Any,
    flat: Any,
    op: ReduceOp,
    root: int | None,
    path: Callable[[bool], Coroutine[Any, Any, Any]],
) -> Any:
    """Round ``seq`` (an allreduce, or with ``root`` a reduce) through the members' shared
    memory where they have a mesh (:func:`_on_host`); else ``path(True)``, which makes the mesh
    where every member shares this host (returning :data:`ON_HOST`: the round then goes
    through it) or runs the round its own way. ``path(False)`` runs it off the mesh, as every
    member does when one does not take the mesh's round."""
    if g._mesh is None or g._mesh.broken:
        done = g._run(path(True))
        if done is not ON_HOST:
            return done
    if _on_host(g, seq, flat, op, root):
        return array
    return g._run(path(False))


def _on_host(g: Group, seq: int, flat: Any, op: ReduceOp, root: int | None = None) -> bool:
    """Round ``seq`` through the members' shared memory (:mod:`.host`), on the caller's thread:
    an allreduce, or with ``root`` a reduce into its array; whether it ran (False: every member
    runs it on the directory's schedule instead)."""
    g._raise_if_broken()
    # Device arrays keep the directory's path (CUDA IPC between the processes).
    takes = memory.kind_of(flat) is memory.ArrayKind.NUMPY
    try:
        fault = g.object_id(seq, "host", g.rank).hex() if INJECTOR.armed else ""
        ran = g._call(
            lambda: g._mesh.reduce(seq, flat, op, takes, wait_limit(g), g._raise_if_broken, root, fault)
        )
    except ObjectLostError as exc:
        if g._watching is None:
            raise
        g._run(_raise(exc))  # the watch's MemberLostError, once it reports the member
        raise
    if ran and g._owned:
        g._run(g._delete_before(seq))
    return ran


async def _raise(exc: BaseException) -> None:
    raise exc


async def _large(g: Group, seq: int, array: Any, flat: Any, op: ReduceOp, host: bool = True) -> Any:
    """The direct ring (:mod:`.ring`) where the members' schedules agree on it
    (:func:`~.ring.goes_direct`) and ``array`` is large enough for it; else the shards'
    reductions through the directory, or one reduce for an array under their threshold. Where
    every member shares this host (:func:`~.host.goes_host`), ``host`` and the mesh is not made
    yet: make it (:func:`~.host.meet`) and return :data:`ON_HOST`."""
    cfg = g.node.config
    rejoined: list[bool] = []  # a directory restart during the exchange: see Group._lending

    def rejoined_cb() -> None:
        rejoined.append(True)

    g.node.add_rejoin_callback(rejoined_cb)
    try:
        peers = await ring_peers(g, seq)
    finally:
        g.node.remove_rejoin_callback(rejoined_cb)
    if host and await meets(g, seq, peers, "allreduce"):
        return ON_HOST
    if flat.size < g.world_size:
        return await _small_allreduce(g, seq, array, op)
    if goes_wire(g, flat):
        return ON_WIRE
    if goes_direct(peers) and flat.nbytes >= cfg.direct_min_bytes:
        return await _direct(g, seq, array, flat, lambda h: direct_allreduce(g, seq, h, op, peers), True)
    if flat.nbytes >= cfg.allreduce_shard_bytes:
        return await _sharded_allreduce(g, seq, array, flat, op, bool(rejoined))
    return await _small_allreduce(g, seq, array, op)


async def _direct(
    g: Group, seq: int, array: Any, flat: Any, run: Callable[[np.ndarray], Awaitable[None]], write_back: bool
) -> Any:
    """Run a direct path (:mod:`.ring`) on ``flat``'s bytes in host memory: device memory goes
    through a host copy (the ring reduces with NumPy, and the TCP plane sends host bytes
    anyway), written back into ``flat`` where ``write_back``; then the group's objects of the
    rounds before go."""
    host = flat if isinstance(flat, np.ndarray) else memory.to_host(flat).reshape(-1)
    await run(host)
    if write_back and host is not flat:
        memory.copy_into(flat, host)
    await g._delete_before(seq)
    return array


async def _small_allreduce(g: Group, seq: int, array: Any, op: ReduceOp = ReduceOp.SUM) -> Any:
    """Collective ``seq``: reduce every member's ``array`` on one tree, read into ``array``."""
    inputs = [g.object_id(seq, "allreduce", r) for r in range(g.world_size)]
    mine = g._put_own(seq, array, inputs[g.rank])
    await g._reduce_into(seq, inputs, g.object_id(seq, "allreduce-result"), op, array, mine)
    await g._delete_before(seq)
    return array


async def _sharded_allreduce(
    g: Group, seq: int, array: Any, flat: Any, op: ReduceOp, rejoined: bool = False
) -> Any:
    n, me = g.world_size, g.rank
    cuts = [flat.size * j // n for j in range(n + 1)]
    shards = [flat[cuts[j] : cuts[j + 1]] for j in range(n)]
    inputs = [[g.object_id(seq, "allreduce-shard", j, r) for r in range(n)] for j in range(n)]
    results = [g.object_id(seq, "allreduce-shard-result", j) for j in range(n)]
    # The star puts its own shard first: the reduction it requests then has its root here (the
    # directory places the requester's input there) and is set up while the others are put. Then
    # the others, each member starting after its own, so that every reduction soon has inputs.
    # The shards are lent to the store, not copied (unless same-host readers would map a copy):
    # result j's bytes land in shard j only after the reduction read this member's shard j up to
    # them (the star's root, or the ring's vertex here or next); the call returns once every
    # result is whole, when nothing reads the shards any more, and deletes them; if it fails, it
    # withdraws them first. After a member died the call fails, even where a rebuilt tree read
    # overwritten shards: the dead member's own shard, held by it alone, cannot be reduced again.
    # bench/pages/defaults.md, "Lent shards".
    lent = [inputs[j][me] for j in range(n)]
    received: list[LocalObject] = []  # results pulled straight into the shards
    ring = g.node.config.allreduce_schedule != "star"  # auto: the ring (bench/pages/collectives.md)
    pred = (me - 1) % n

    def mine() -> Coroutine[Any, Any, None]:  # (made where it is awaited: none left unawaited)
        return g._put_own(seq, shards[me], inputs[me][me], borrow=True, consumable=ring)

    async def own_chain(chain: list[ObjectID]) -> None:
        await g._reduce_into(seq, chain, results[me], op, None, mine(), ordered=True)

    async def steps() -> None:
        if ring:
            # Shard me's chain: me+1, me+2, ..., me-1, then me, which computes the result. Each
            # input has its place whenever it comes, so the request, every put and every read go
            # out at once: result j travels j, j+1, ..., each member reading its predecessor's
            # copy, and a member's reads reach the directory before the results its puts feed
            # can be complete (a later one would read a complete copy off the ring).
            chain = [inputs[me][(me + 1 + i) % n] for i in range(n)]
            order = [(me - 1 - i) % n for i in range(n - 1)]  # earliest in its chain first
            await all_or_cancel(
                [
                    own_chain(chain),  # (on one host the directory makes it that host's star)
                    *(g._put_own(seq, shards[j], inputs[j][me], borrow=True, consumable=True) for j in order),
                    *(
                        g._get_received(results[j], shards[j], received, inputs[j][pred])
                        for j in [*order, me]
                    ),
                ]
            )
        else:
            await g._reduce_into(seq, inputs[me], results[me], op, None, mine(), degree=n - 1)
            order = [(me + 1 + i) % n for i in range(n - 1)]
            await all_or_cancel([g._put_own(seq, shards[j], inputs[j][me], borrow=True) for j in order])
            await all_or_cancel([g._get_received(results[j], shards[j], received) for j in [*order, me]])
        if ring:  # the successor reads these copies: let it finish (bounded) before withdrawing
            stall = g.node.config.stall_timeout
            await asyncio.gather(*(obj.wait_unserved(stall) for obj in received))

    try:  # a restart of the directory fails it (ObjectLostError): see Group._lending
        await g._lending(seq, lent, steps(), rejoined)
    except BaseException:
        await asyncio.shield(g._withdraw(lent, received))  # before the caller may write to its array
        raise
    # On the ring each vertex wrote its output over this member's shard (put consumable), the
    # result of shard me included. A result copy here that the successor, which reads it from
    # here, has not read whole moves to the store's memory and stays; the rest is withdrawn.
    succ = (me + 1) % n
    unread = {results[j] for j in range(n) if j != succ}
    kept = await _keep_unread(g, received, unread) if ring else []
    await asyncio.shield(g._withdraw(lent, [o for o in received if o not in kept], before=seq))
    return array


async def _keep_unread(g: Group, received: list[LocalObject], unread: set[ObjectID]) -> list[LocalObject]:
    """Move the copies of ``received`` that are of ``unread`` and not yet served whole into the
    store's memory (``Node.keep_served``); returns those moved. A copy being served is not moved
    (its pull reads the caller's memory): wait for its pull first (bounded by ``stall_timeout``),
    and check again with no wait between the last check and the move, so that a pull starting
    meanwhile is not cut by the withdrawal that follows (its reader would find no copy left)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + g.node.config.stall_timeout
    while True:
        unread_here = [o for o in received if o.object_id in unread and not o.served_whole]
        busy = [o for o in unread_here if o.serving]
        left = deadline - loop.time()
        if not busy or left <= 0:
            return g.node.keep_served(unread_here)
        await asyncio.gather(*(o.wait_unserved(left) for o in busy))


def allgather(list_out: list[Any], array: Any, group: Group) -> list[Any]:
    """Fill ``list_out[r]`` with member ``r``'s ``array`` on every member; returns ``list_out``.

    Every member reads each other member's array straight from it (``get(direct=True)``): each
    link carries ``N-1`` arrays each way, the least possible, where chains of readers would load
    some links more than others.
    """
    g = _check_group(group)
    seq = g._next()  # taken before any check: a call refused here keeps its round
    _check_list(g, list_out, "list_out")
    refused: list[str] = []
    list_out = [_stand_in(a, refused, f"list_out[{r}]") for r, a in enumerate(list_out)]
    ids = [g.object_id(seq, "allgather", r) for r in range(g.world_size)]

    async def run() -> list[Any]:
        others = [(g.rank + 1 + i) % g.world_size for i in range(g.world_size - 1)]
        gets = [g.node.get_async(ids[r], timeout=g.timeout, out=list_out[r], direct=True) for r in others]
        await all_or_cancel([g._put_own(seq, array, ids[g.rank]), *gets])
        _copy(list_out[g.rank], array)
        await g._delete_before(seq)
        return list_out

    return _raise_refused(g, seq, "allgather", refused, g._run(run()))


def gather(list_out: list[Any] | None, array: Any, dst_rank: int, group: Group) -> list[Any] | None:
    """Fill ``list_out[r]`` on ``dst_rank`` with member ``r``'s ``array``; returns ``list_out``.

    Only ``dst_rank``'s ``list_out`` is used (others may pass None); the others return as soon as
    their array is registered, like :func:`reduce`.
    """
    g = _check_group(group)
    seq = g._next()  # taken before any check: a call refused here keeps its round
    _check_rank(g, dst_rank, "dst_rank")
    if g.rank == dst_rank:
        _check_list(g, list_out, "list_out")
    ids = [g.object_id(seq, "gather", r) for r in range(g.world_size)]

    async def run() -> list[Any] | None:
        mine = g._put_own(seq, array, ids[g.rank])
        if g.rank != dst_rank or list_out is None:
            await mine
            return list_out
        others = [r for r in range(g.world_size) if r != g.rank]
        gets = [g.node.get_async(ids[r], timeout=g.timeout, out=list_out[r], direct=True) for r in others]
        await all_or_cancel([mine, *gets])
        _copy(list_out[g.rank], array)
        return list_out

    return g._run(run())


def scatter(array: Any, list_in: list[Any] | None, src_rank: int, group: Group) -> Any:
    """Member ``r`` receives ``src_rank``'s ``list_in[r]`` into ``array`` (in place); returns it.

    Only ``src_rank``'s ``list_in`` is used (others may pass None); it returns as soon as its
    pieces are registered, like :func:`reduce`; the others read theirs straight from it.
    """
    g = _check_group(group)
    seq = g._next()  # taken before any check: a call refused here keeps its round
    _check_rank(g, src_rank, "src_rank")
    if g.rank == src_rank:
        _check_list(g, list_in, "list_in")
    ids = [g.object_id(seq, "scatter", r) for r in range(g.world_size)]
    for r, oid in enumerate(ids):
        g._describe(oid, f"scatter #{seq} piece {r}", src_rank)

    async def run() -> Any:
        if g.rank != src_rank:
            return await g.node.get_async(ids[g.rank], timeout=g.timeout, out=array, direct=True)
        assert list_in is not None
        others = [r for r in range(g.world_size) if r != g.rank]
        await all_or_cancel([g._put_own(seq, list_in[r], ids[r]) for r in others])
        _copy(array, list_in[g.rank])
        return array

    return g._run(run())


def alltoall(list_out: list[Any], list_in: list[Any], group: Group) -> list[Any]:
    """Member ``r``'s ``list_in[j]`` lands in member ``j``'s ``list_out[r]``, for every pair;
    returns ``list_out``. Each member reads its pieces straight from their senders; the pieces
    of a pair may differ in size from those of another pair (each ``list_out[r]`` has the
    dtype and shape of what ``r`` sends it)."""
    g = _check_group(group)
    seq = g._next()  # taken before any check: a call refused here keeps its round
    _check_list(g, list_out, "list_out")
    _check_list(g, list_in, "list_in")
    refused: list[str] = []
    list_out = [_stand_in(a, refused, f"list_out[{r}]") for r, a in enumerate(list_out)]
    n, me = g.world_size, g.rank

    def piece(src: int, dst: int) -> ObjectID:
        return g.object_id(seq, "alltoall", dst, src)  # (put by src: the last part)

    async def run() -> list[Any]:
        others = [(me + 1 + i) % n for i in range(n - 1)]
        puts = [g._put_own(seq, list_in[dst], piece(me, dst)) for dst in others]
        gets = [
            g.node.get_async(piece(src, me), timeout=g.timeout, out=list_out[src], direct=True)
            for src in reversed(others)
        ]
        await all_or_cancel([*puts, *gets])
        _copy(list_out[me], list_in[me])
        await g._delete_before(seq)
        return list_out

    return _raise_refused(g, seq, "alltoall", refused, g._run(run()))


def reducescatter(out: Any, list_in: list[Any], group: Group, op: ReduceOp | str = ReduceOp.SUM) -> Any:
    """Member ``r`` gets, in ``out``, the reduction over members of their ``list_in[r]``."""
    g = _check_group(group)
    seq = g._next()  # taken before any check: a call refused here keeps its round
    _check_list(g, list_in, "list_in")
    reduce_op = as_op(op)
    refused: list[str] = []
    out = _stand_in(out, refused, "out")

    async def run() -> Any:
        ids = [g.object_id(seq, "reducescatter", dst, g.rank) for dst in range(g.world_size)]

        async def contribute() -> None:  # the puts begin here: none is left unawaited if cancelled
            puts = [g._put_own(seq, piece, oid) for piece, oid in zip(list_in, ids, strict=True)]
            await all_or_cancel(puts)

        inputs = [g.object_id(seq, "reducescatter", g.rank, src) for src in range(g.world_size)]
        result = g.object_id(seq, "reducescatter-result", g.rank)
        await g._reduce_into(seq, inputs, result, reduce_op, out, contribute())
        await g._delete_before(seq)
        return out

    return _raise_refused(g, seq, "reducescatter", refused, g._run(run()))


def _copy(dst: Any, src: Any) -> None:
    """Copy a result (host or device memory) into a caller's array (NumPy or CuPy)."""
    if tuple(dst.shape) != tuple(src.shape) or np.dtype(dst.dtype) != np.dtype(src.dtype):
        raise InvalidArgumentError(
            "list_out entries must match the array's dtype and shape", argument="list_out"
        )
    memory.copy_into(dst, src)
