"""The direct ring: a group's allreduce (and reduce) passed member to member over the data plane,
with no message to the directory once each member knows its predecessor's data-plane address.

The array is cut into one chunk per member. Each round, every member makes one pull from the
member before it, of one object that member lends: the bytes it sends its successor, in order.
In the reduce-scatter, member ``m`` receives the running sum of chunk ``m - s`` (step
``s = 1 .. N-1``) and adds its own chunk into it, in place in the caller's array, piece by piece
on the thread that received the piece; what it has summed is at once the next part of what it
serves its successor. After ``N-1`` steps member ``m`` holds the whole sum of chunk ``m + 1``; in
the allgather the whole sums arrive on the same stream straight into the caller's array, and go
on to the successor as they land. Every byte goes from a member to the next on one connection,
``2 (N-1)/N`` of the array each way on every link, like Gloo's ring; the only control is one pull
request per member and round, and the event loop wakes once per round, not once per piece.

Where every member runs the TCP data plane, both run instead on the caller's thread over
connections the members keep along the ring (:mod:`.wire`): the same streams, with no pull
request or I/O thread in a round.

A large reduce goes the same way along a chain that ends at its root (:func:`direct_reduce`):
the first member lends its array, each next one pulls the partial reduction from the one before
it and adds its own array in as the bytes land, and the root adds the last one into its array.

Every stream starts with its sender's dtype, operator and element count (:data:`HEADER`): a
member whose predecessor's array differs from its own fails with ``CollectiveArgumentError``
before it adds anything in, as does one whose predecessor's stream is of another size.

Nothing of either is known to the directory, so nothing of it can be repaired: a member that dies
fails the call (``MemberLostError`` in a watched group, ``ObjectLostError`` otherwise), as a
member lost in the directory's ring does. Overwriting the caller's array in
place is safe because of causality: the sum of a chunk reaches a member only after its
successor has read that member's bytes of the chunk that the sum overwrites."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..dataplane.base import ChunkCallback
from ..dataplane.shared import SizeMismatch
from ..errors import (
    CollectiveArgumentError,
    HopliteError,
    HopliteTimeoutError,
    ObjectDeletedError,
    ObjectLostError,
    ObjectNotFoundError,
    PeerLostError,
    TransportError,
)
from ..memory import Buffer, LocalObject
from ..object_id import ObjectID
from ..reduce_ops import ReduceOp, reduce_chunk
from .host import listen

if TYPE_CHECKING:
    from .group import Group


class Peer(NamedTuple):
    """What a member tells the others at its group's first large allreduce."""

    schedule: str  # its Config.allreduce_schedule
    meet: str  # its mesh's listening socket (collective.host), "" for none
    host_key: str  # Node.host_key: "" without shared memory
    plane: str  # Node.data_plane_kind
    host: str  # its data plane's address
    port: int


#: The chunk a member asks its predecessor for (the TCP plane takes at most 2 MiB): one flow
#: carries the whole round in order, so a chunk's wait is hidden behind what is already there,
#: and fewer chunks cost less CPU (bench/pages/collectives.md#one-stream-per-round).
RING_CHUNK_BYTES = 2 << 20


async def ring_peers(g: Group, seq: int) -> list[Peer]:
    """Every member's :class:`Peer`, learnt once per
    group: at its first large allreduce every member puts its own (a small object) and reads
    the others', but for a member whose own schedule is ``ring`` or ``star``: the group takes
    the directory's schedule anyway, and it returns one placeholder without waiting."""
    if g._peers:
        return g._peers
    node = g.node
    meet = listen(g) if node.host_key and node.config.allreduce_schedule == "auto" else ""
    mine = (
        f"{node.config.allreduce_schedule}|{meet}|{node.host_key}|{node.data_plane_kind}|{node.data_address}"
    )
    await g._put_own(seq, np.frombuffer(mine.encode(), np.uint8), g.object_id(seq, "ring-peer", g.rank))
    if node.config.allreduce_schedule in ("ring", "star"):
        g._peers = [
            Peer(node.config.allreduce_schedule, "", "", "", "", 0)
        ]  # told the others: no need to read
        return g._peers
    others = [r for r in range(g.world_size) if r != g.rank]
    got = await asyncio.gather(
        *(node.get_async(g.object_id(seq, "ring-peer", r), timeout=g.timeout) for r in others)
    )
    texts = dict(zip(others, (bytes(raw).decode() for raw in got), strict=True))
    texts[g.rank] = mine
    peers = []
    for r in range(g.world_size):
        schedule, meet, rest = texts[r].split("|", 2)
        key, plane, address = rest.rsplit("|", 2)  # (a host tag may hold "|")
        host, _, port = address.rpartition(":")
        peers.append(Peer(schedule, meet, key, plane, host.strip("[]"), int(port)))
    g._peers = peers
    return peers


def goes_direct(peers: list[Peer], sharing: bool = False) -> bool:
    """Whether the group's large allreduces take the direct ring, the same answer on every
    member: not if any member's ``allreduce_schedule`` is ``ring`` or ``star`` (the directory's,
    which members may mix); else if any says ``direct``, or if no two members share a host's
    memory (a host key, "" for none). Members that share one keep the directory's schedule,
    which maps what they share instead of sending it over loopback; so do members on UCX
    (``Config.data_plane``), whose RDMA and device transports the ring's host copies would
    bypass (not measured yet). ``sharing``: members that share a host's memory go direct too
    (a reduce's chain: over loopback it beat the directory's shared-memory tree on one host,
    bench/pages/collectives.md#the-chain-on-one-host)."""
    schedules = {p.schedule for p in peers}
    if len(peers) < 2 or schedules & {"ring", "star"}:
        return False
    if "direct" in schedules:
        return True
    keys = [p.host_key for p in peers if p.host_key]
    return (sharing or len(keys) == len(set(keys))) and all(p.plane == "tcp" for p in peers)


async def direct_allreduce(g: Group, seq: int, flat: Any, op: ReduceOp, peers: list[Peer]) -> None:
    """Collective ``seq``: allreduce ``flat`` (a C-contiguous 1-D view of the caller's array,
    at least one element per member) in place along the ring of members (:func:`ring_peers`)."""
    n, me = g.world_size, g.rank
    node = g.node
    loop = asyncio.get_running_loop()
    cuts = [flat.size * j // n for j in range(n + 1)]
    item = flat.dtype.itemsize

    def region(c: int) -> Any:
        return flat[cuts[c % n] : cuts[c % n + 1]]

    # What this member sends its successor, in order: its own chunk, the running sum of step s
    # (s = 1 .. N-1: chunk me - s over members me - s .. me, the last the whole sum of chunk
    # me + 1), then the whole sums it relays. What it receives from its predecessor is the same
    # for the member before: the running sums, then the whole sums straight into the caller's
    # array, the last of which (chunk me + 2) goes no further.
    out_pieces = [region(me - s) for s in range(n)] + [region(me + 1 - t) for t in range(1, n - 1)]
    # A running sum is added in as each chunk of it lands, so it lands in a few chunk-sized
    # buffers taken in turn (one per chunk a plane receives ahead, and one more), reused from
    # round to round: little memory, fresh pages once, and the bytes still in cache when added.
    count = node.config.chunks_in_flight + 1  # (UCX receives that many ahead; TCP one)
    spare = _take_spare(g, min(RING_CHUNK_BYTES, max(region(me - s).nbytes for s in range(1, n))), count)
    in_pieces: list[Any] = []
    targets: list[_Target | None] = []
    for s in range(1, n):
        chunk = region(me - s)
        for off in range(0, chunk.nbytes, RING_CHUNK_BYTES):
            piece = spare[len(in_pieces) % count][: min(RING_CHUNK_BYTES, chunk.nbytes - off)]
            in_pieces.append(piece)
            targets.append(_Target(chunk[off // item : (off + piece.nbytes) // item], n if s == n - 1 else 0))
    for t in range(1, n):
        in_pieces.append(region(me + 1 - t))
        targets.append(None)  # a whole sum: lands in place
    head, relayed = region(me).nbytes, sum(a.nbytes for a in in_pieces[:-1])
    header = _header(op, flat)
    out = _stream(header, out_pieces, g.object_id(seq, "ring-out", me), head)
    inbox = _stream(header, in_pieces, g.object_id(seq, "ring-out", (me - 1) % n), None)
    # Each running sum adds in on the thread that received it, and lets the successor have as
    # much more of what this member sends.
    on_chunk = _adder(
        f"allreduce #{seq}",
        op,
        flat.dtype,
        inbox,
        header,
        targets,
        lambda done: out.advance_from_thread(HEADER.size + head + min(done, relayed), loop),
    )
    cfg = node.config
    # The caller may write to its array once this returns: wait for the successor's reads,
    # long enough for the directory to declare a hung successor lost (a watched group then
    # raises MemberLostError) before this gives up.
    patience = cfg.stall_timeout + cfg.lease_timeout + cfg.heartbeat_interval
    await _exchange(g, seq, "allreduce", out, inbox, peers, on_chunk, patience, RING_CHUNK_BYTES)
    g._spare = spare  # (not after a failure: a pull cut by it may still be landing bytes)


def chain_chunk(nbytes: int) -> int:
    """The chunk a member of a direct reduce lands (and passes on) at a time: a sixteenth of
    the array, between 256 KiB and :data:`RING_CHUNK_BYTES` (a multiple of 64 KiB): the chain's
    pipeline fills in ``N-1`` chunks, and each chunk costs CPU (an eighth and a 64th were slower
    or cost more: bench/pages/collectives.md#the-chains-pull-chunk)."""
    return min(RING_CHUNK_BYTES, max(256 << 10, (nbytes // 16) >> 16 << 16))


async def direct_reduce(g: Group, seq: int, flat: Any, op: ReduceOp, peers: list[Peer], dst: int) -> None:
    """Collective ``seq``: reduce every member's ``flat`` (a C-contiguous 1-D view of the
    caller's array) into ``dst``'s, in place, along a chain of the members in ring order that
    ends at ``dst``: ``dst+1 -> dst+2 -> ... -> dst``. The first member lends its array as it is;
    each next one pulls the partial reduction from the one before it, adds its own array in as
    each chunk lands (on the thread that received it), and is read on by the next as it goes;
    ``dst`` adds the last partial reduction into its own array. Every byte crosses each link
    once, pipelined: about ``S/B`` plus ``N-1`` chunks. Members but ``dst`` keep their array
    unchanged (the partial reductions pass through a buffer of the array's size, kept by the
    group for the next) and return once their successor has read what they send."""
    n, me = g.world_size, g.rank
    node = g.node
    loop = asyncio.get_running_loop()
    first, pred = (dst + 1) % n, (me - 1) % n
    nbytes, item = flat.nbytes, flat.dtype.itemsize
    chunk = chain_chunk(nbytes)
    header = _header(op, flat)
    spare: list[Any] = []
    scratch: Any = None
    out: LocalObject | None = None
    inbox: LocalObject | None = None
    on_chunk: ChunkCallback | None = None
    if me == first:
        out = _stream(header, [flat], g.object_id(seq, "chain-out", me), nbytes)
    elif me == dst:
        count = node.config.chunks_in_flight + 1
        spare = _take_spare(g, min(chunk, nbytes), count)
        offsets = range(0, nbytes, chunk)
        pieces = [spare[i % count][: min(chunk, nbytes - off)] for i, off in enumerate(offsets)]
        targets = [
            _Target(flat[off // item : (off + a.nbytes) // item], n)
            for off, a in zip(offsets, pieces, strict=True)
        ]
        inbox = _stream(header, pieces, g.object_id(seq, "chain-out", pred), None)
        on_chunk = _adder(f"reduce #{seq}", op, flat.dtype, inbox, header, targets, None)
    else:
        kept, g._scratch = g._scratch, None  # (in use: not another collective's)
        scratch = kept if kept is not None and kept.nbytes >= nbytes else np.empty(nbytes, np.uint8)
        partial = scratch[:nbytes]
        mid = _stream(header, [partial], g.object_id(seq, "chain-out", me), 0)
        out = mid
        inbox = _stream(header, [partial], g.object_id(seq, "chain-out", pred), None)
        on_chunk = _adder(
            f"reduce #{seq}",
            op,
            flat.dtype,
            inbox,
            header,
            [_Target(flat, 0, into_piece=True)],
            lambda done: mid.advance_from_thread(HEADER.size + done, loop),
        )
    cfg = node.config
    limit = g.timeout if g.timeout is not None else cfg.default_get_timeout
    patience = cfg.stall_timeout + cfg.lease_timeout + cfg.heartbeat_interval
    # A successor may come late (the root busy elsewhere): wait for it up to the group's timeout.
    await _exchange(g, seq, "reduce", out, inbox, peers, on_chunk, max(limit, patience), chunk)
    if spare:
        g._spare = spare
    if me not in (first, dst):
        g._scratch = scratch


#: What every stream of the direct paths starts with: the dtype's name, the operator's and the
#: array's element count of the member that sends it. A member checks its predecessor's against
#: its own before it adds anything in: arrays that differ fail the call with
#: ``CollectiveArgumentError`` (those of one size in bytes but not in dtype would otherwise be
#: added up as the wrong numbers; those of other sizes are told apart by the stream's size).
HEADER = struct.Struct("<16s8sQ")


def _header(op: ReduceOp, flat: Any) -> Any:
    """This member's :data:`HEADER` (a uint8 array: sent, and compared with the one received)."""
    raw = HEADER.pack(np.dtype(flat.dtype).name.encode(), op.value.encode(), flat.size)
    return np.frombuffer(raw, np.uint8)


def _described(header: bytes) -> str:
    """A :data:`HEADER` in words: ``262144 float32 elements, sum``."""
    name, op, count = (
        x.rstrip(b"\0").decode(errors="replace") if isinstance(x, bytes) else x for x in HEADER.unpack(header)
    )
    return f"{count} {name} elements, {op}"


def _stream(header: Any, pieces: list[Any], oid: ObjectID, progress: int | None) -> LocalObject:
    """An object over :data:`HEADER` and ``pieces`` (arrays, in order), unlisted: one this member
    sends, ``header`` and ``progress`` bytes of the pieces there; or (``progress`` None) one it
    receives, nothing there yet (the header it will compare with its own lands beside it)."""
    first = np.zeros(HEADER.size, np.uint8) if progress is None else header
    buffer = Buffer.joined([first, *(a.view(np.uint8) for a in pieces)])
    there = 0 if progress is None else HEADER.size + progress
    return LocalObject(oid, buffer.nbytes, "uint8", (buffer.nbytes,), b"", buffer, there)


def _take_spare(g: Group, size: int, count: int) -> list[Any]:
    """``count`` receive buffers of ``size`` bytes: the group's kept ones where large enough.
    Taken from the group while in use (the torch backend may run two collectives at once)."""
    kept, g._spare = g._spare, []
    spare = [b for b in kept if b.nbytes >= size][:count]
    return spare + [np.empty(size, np.uint8) for _ in range(count - len(spare))]


class _Target(NamedTuple):
    """What a piece of an inbox is added to as it lands: ``into`` (a typed array of the
    piece's length), the result in ``into`` (or, ``into_piece``, in the piece itself, for a
    member that passes it on); ``inputs`` > 0: the last addition, of that many inputs in all,
    which finishes ``AVG``."""

    into: Any
    inputs: int
    into_piece: bool = False


def _adder(
    what: str,
    op: ReduceOp,
    dtype: Any,
    inbox: LocalObject,
    header: Any,
    targets: Sequence[_Target | None],
    after: Callable[[int], None] | None,
) -> ChunkCallback:
    """An ``on_chunk`` for ``inbox`` (a stream, :func:`_stream`): it checks the :data:`HEADER`
    that lands first against this member's ``header``, then adds each piece to its target (None:
    nothing to add) as it lands, whole elements at a time, then calls ``after(bytes of the
    pieces done)``. It runs on the receiving thread, before the next chunk lands."""
    got, *pieces = inbox.buffer.pieces
    ends = list(itertools.accumulate(a.nbytes for a in pieces))
    item = np.dtype(dtype).itemsize
    done = 0
    checked = False

    def on_chunk(start: int, end: int) -> None:
        nonlocal done, checked
        if not checked:
            if end < HEADER.size:
                return  # (part of the header)
            if bytes(got) != bytes(header):
                raise CollectiveArgumentError(
                    f"{what}: the member before this one has {_described(bytes(got))}, "
                    f"this one {_described(bytes(header))}: every member's array must match"
                )
            checked = True
        end -= HEADER.size
        while done < end:
            i = bisect.bisect_right(ends, done)
            base = ends[i] - pieces[i].nbytes
            stop = min(end, ends[i])
            target = targets[i]
            if target is not None:
                a, b = (done - base) // item, (stop - base) // item
                if a == b:
                    break  # part of an element: with the next bytes
                theirs, mine = pieces[i].view(dtype)[a:b], target.into[a:b]
                into = theirs if target.into_piece else mine
                try:
                    reduce_chunk(op, into, [mine if target.into_piece else theirs], into, target.inputs)
                except Exception as exc:  # typed, so that the pull is not asked again
                    raise HopliteError(f"{what}: the reduction failed: {exc}") from exc
                stop = base + b * item
            done = stop
        if after is not None:
            after(done)

    return on_chunk


async def _exchange(
    g: Group,
    seq: int,
    what: str,
    out: LocalObject | None,
    inbox: LocalObject | None,
    peers: list[Peer],
    on_chunk: ChunkCallback | None,
    wait: float,
    chunk: int,
) -> None:
    """Lend ``out`` (what this member sends its successor) unlisted, pull ``inbox`` from the
    member before (landing at most ``chunk`` bytes between two ``on_chunk`` calls: what a
    member passes on waits for that much), then wait (``wait`` seconds, and on while a pull of
    it goes on) for the successor to have read ``out`` whole, and take ``out`` back. A member
    that failed or died before fails this (``ObjectLostError``, or the watched group's
    ``MemberLostError``)."""
    node = g.node
    stall = node.config.stall_timeout
    lent = [out] if out is not None else []
    pred = (g.rank - 1) % g.world_size
    host, port = peers[pred].host, peers[pred].port
    try:
        for obj in lent:
            node.lend_unlisted(obj)
        if inbox is not None:
            try:
                await _pull_waiting(g, host, port, inbox, on_chunk, chunk)
            except SizeMismatch as exc:
                raise CollectiveArgumentError(
                    f"{what} #{seq}: rank {pred} sends {exc.size} bytes where this member expects "
                    f"{inbox.size}: every member's array must match"
                ) from None
            except (TransportError, ObjectNotFoundError) as exc:
                # The member before failed or died (or withdrew what it served, as one before it
                # did): a watched group waits for the directory's word (MemberLostError).
                raise ObjectLostError(
                    f"{what} #{seq}: rank {pred} at {host}:{port} could not serve {inbox.object_id}: {exc}",
                    object_id=inbox.object_id.hex(),
                ) from exc
        if out is not None and not await _read_whole(out, wait, stall):
            begun = bool(out.served_begun)
            why = (
                f"its read ended short and it did not ask again within {stall} s"
                if begun
                else f"it did not begin to read within {wait} s"
            )
            raise HopliteTimeoutError(
                f"rank {(g.rank + 1) % g.world_size} did not read this member's part of {what} #{seq}: {why}",
                operation=what,
                timeout=stall if begun else wait,
            )
    except BaseException as exc:
        error = exc if isinstance(exc, HopliteError) else ObjectDeletedError(f"{what} #{seq} stopped")
        await _withdraw(node, lent, error, stall)
        raise
    await _withdraw(node, lent, None, stall)


async def _read_whole(out: LocalObject, wait: float, stall: float) -> bool:
    """Whether a pull read ``out`` to its end: waiting up to ``wait`` seconds for the successor
    to begin, on while a pull of it goes on (the data plane cuts one that stalls for ``stall``
    seconds), and ``stall`` more for it to ask again after one that ended short (a pull cut is
    asked again at once; a successor that failed does not ask again)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        begun = out.served_begun
        left = stall if out.serving else min(stall, deadline - loop.time())
        if out.served_whole or (left > 0 and await out.wait_served(left)):
            return True
        if out.error is not None:
            return False
        if out.serving or out.served_begun != begun:
            continue  # read meanwhile
        if out.served_begun or loop.time() >= deadline:
            return False  # read short and not asked again, or never read


async def _pull_waiting(
    g: Group, host: str, port: int, inbox: LocalObject, on_chunk: ChunkCallback | None, chunk: int
) -> None:
    """Pull ``inbox`` from the member before, waiting for the ring up to the group's timeout
    when a member is late (a straggler, busy elsewhere): the member before has not lent what it
    sends yet (its data plane answers "not found" after ``stall_timeout`` of waiting for it), or
    it waits for its own predecessor's bytes (the transfer stalls, and is cut): ask again, after
    the bytes that landed. A member that took its part back (it failed) answers "not found" at
    once, and one that died cannot be reached: that is final."""
    node = g.node
    loop = asyncio.get_running_loop()
    stall = node.config.stall_timeout
    limit = g.timeout if g.timeout is not None else node.config.default_get_timeout
    deadline = loop.time() + limit if limit else math.inf
    while True:
        asked = loop.time()
        try:
            await node.pull_unlisted(host, port, inbox, on_chunk, chunk)
            return
        except SizeMismatch:
            raise  # arrays of other sizes: asking again changes nothing
        except ObjectNotFoundError:
            if loop.time() - asked < stall / 2 or loop.time() >= deadline:
                raise
        except PeerLostError:
            if loop.time() >= deadline:
                raise


async def _withdraw(node: Any, lent: list[LocalObject], error: HopliteError | None, stall: float) -> None:
    """Take the caller's memory back: the objects leave the store, and pulls still reading them
    stop (failed) before this returns."""
    node.withdraw([], lent, error)
    await asyncio.gather(*(obj.wait_unserved(stall) for obj in lent))
