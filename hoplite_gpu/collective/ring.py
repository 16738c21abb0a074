"""The direct ring: a group's allreduce passed member to member over the data plane, with no
message to the directory once each member knows its predecessor's data-plane address.

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

Nothing of it is known to the directory, so nothing of it can be repaired: a member that dies
fails the call (``MemberLostError`` in a watched group, ``ObjectLostError`` otherwise), as a
member lost in the directory's ring does. Overwriting the caller's array in
place is safe because of causality: the sum of a chunk reaches a member only after its
successor has read that member's bytes of the chunk that the sum overwrites."""

from __future__ import annotations

import asyncio
import bisect
import math
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..dataplane.base import ChunkCallback
from ..errors import (
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

if TYPE_CHECKING:
    from .group import Group


class Peer(NamedTuple):
    """What a member tells the others at its group's first large allreduce."""

    schedule: str  # its Config.allreduce_schedule
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
    mine = f"{node.config.allreduce_schedule}|{node.host_key}|{node.data_plane_kind}|{node.data_address}"
    await g._put_own(seq, np.frombuffer(mine.encode(), np.uint8), g.object_id(seq, "ring-peer", g.rank))
    if node.config.allreduce_schedule in ("ring", "star"):
        g._peers = [Peer(node.config.allreduce_schedule, "", "", "", 0)]  # told the others: no need to read
        return g._peers
    others = [r for r in range(g.world_size) if r != g.rank]
    got = await asyncio.gather(
        *(node.get_async(g.object_id(seq, "ring-peer", r), timeout=g.timeout) for r in others)
    )
    texts = dict(zip(others, (bytes(raw).decode() for raw in got), strict=True))
    texts[g.rank] = mine
    peers = []
    for r in range(g.world_size):
        schedule, key, plane, address = texts[r].split("|", 3)
        host, _, port = address.rpartition(":")
        peers.append(Peer(schedule, key, plane, host.strip("[]"), int(port)))
    g._peers = peers
    return peers


def goes_direct(peers: list[Peer]) -> bool:
    """Whether the group's large allreduces take the direct ring, the same answer on every
    member: not if any member's ``allreduce_schedule`` is ``ring`` or ``star`` (the directory's,
    which members may mix); else if any says ``direct``, or if no two members share a host's
    memory (a host key, "" for none). Members that share one keep the directory's schedule,
    which maps what they share instead of sending it over loopback; so do members on UCX
    (``Config.data_plane``), whose RDMA and device transports the ring's host copies would
    bypass (not measured yet)."""
    schedules = {p.schedule for p in peers}
    if len(peers) < 2 or schedules & {"ring", "star"}:
        return False
    if "direct" in schedules:
        return True
    keys = [p.host_key for p in peers if p.host_key]
    return len(keys) == len(set(keys)) and all(p.plane == "tcp" for p in peers)


async def direct_allreduce(g: Group, seq: int, flat: Any, op: ReduceOp, peers: list[Peer]) -> None:
    """Collective ``seq``: allreduce ``flat`` (a C-contiguous 1-D view of the caller's array,
    at least one element per member) in place along the ring of members (:func:`ring_peers`)."""
    n, me = g.world_size, g.rank
    node = g.node
    loop = asyncio.get_running_loop()
    stall = node.config.stall_timeout
    host, port = peers[(me - 1) % n].host, peers[(me - 1) % n].port
    cuts = [flat.size * j // n for j in range(n + 1)]
    item = flat.dtype.itemsize

    def region(c: int) -> Any:
        return flat[cuts[c % n] : cuts[c % n + 1]]

    def stream(pieces: list[Any], oid: ObjectID, progress: int) -> LocalObject:
        buffer = Buffer.joined([a.view(np.uint8) for a in pieces])
        return LocalObject(oid, buffer.nbytes, "uint8", (buffer.nbytes,), b"", buffer, progress)

    # What this member sends its successor, in order: its own chunk, the running sum of step s
    # (s = 1 .. N-1: chunk me - s over members me - s .. me, the last the whole sum of chunk
    # me + 1), then the whole sums it relays. What it receives from its predecessor is the same
    # for the member before: the running sums, then the whole sums straight into the caller's
    # array, the last of which (chunk me + 2) goes no further.
    out_pieces = [region(me - s) for s in range(n)] + [region(me + 1 - t) for t in range(1, n - 1)]
    # A running sum is added in as each chunk of it lands, so it lands in a few chunk-sized
    # buffers taken in turn (one per chunk a plane receives ahead, and one more), reused from
    # round to round: little memory, fresh pages once, and the bytes still in cache when added.
    # Taken from the group while in use (the torch backend may run two at once).
    count = node.config.chunks_in_flight + 1  # (UCX receives that many ahead; TCP one)
    size = min(RING_CHUNK_BYTES, max(region(me - s).nbytes for s in range(1, n)))
    kept, g._spare = g._spare, []
    spare = [b for b in kept if b.nbytes >= size][:count]
    spare += [np.empty(size, np.uint8) for _ in range(count - len(spare))]
    in_pieces: list[Any] = []
    steps: list[tuple[int, int]] = []  # for each piece: its step (0: a whole sum), its offset
    for s in range(1, n):
        for off in range(0, region(me - s).nbytes, RING_CHUNK_BYTES):
            piece = min(RING_CHUNK_BYTES, region(me - s).nbytes - off)
            in_pieces.append(spare[len(in_pieces) % count][:piece])
            steps.append((s, off // item))
    for t in range(1, n):
        in_pieces.append(region(me + 1 - t))
        steps.append((0, 0))
    head, relayed = region(me).nbytes, sum(a.nbytes for a in in_pieces[:-1])
    out = stream(out_pieces, g.object_id(seq, "ring-out", me), head)
    inbox = stream(in_pieces, g.object_id(seq, "ring-out", (me - 1) % n), 0)
    ends = inbox.buffer.ends
    done = 0

    def on_chunk(start: int, end: int) -> None:
        # On the thread that received bytes [start, end) of the inbox (no wake-up of the loop),
        # before the next chunk lands: add the running sums into this member's chunks, and let
        # the successor have as much more of what this member sends.
        nonlocal done
        while done < end:
            i = bisect.bisect_right(ends, done)
            base = ends[i] - in_pieces[i].nbytes
            stop = min(end, ends[i])
            s, off = steps[i]
            if s:  # a piece of the running sum of step s, added into chunk me - s
                a, b = (done - base) // item, (stop - base) // item
                if a == b:
                    break  # part of an element: with the next bytes
                mine, theirs = region(me - s)[off + a : off + b], in_pieces[i].view(flat.dtype)[a:b]
                try:
                    reduce_chunk(op, mine, [theirs], mine, n if s == n - 1 else 0)
                except Exception as exc:  # typed, so that the pull is not asked again
                    raise HopliteError(f"allreduce #{seq}: the reduction failed: {exc}") from exc
                stop = base + b * item
            done = stop
        out.advance_from_thread(head + min(done, relayed), loop)

    lent = [out]
    try:
        node.lend_unlisted(out)
        try:
            await _pull_waiting(g, host, port, inbox, on_chunk)
        except (TransportError, ObjectNotFoundError) as exc:
            # The member before failed or died (or withdrew what it served, as one before it
            # did): a watched group waits for the directory's word (MemberLostError).
            raise ObjectLostError(
                f"allreduce #{seq}: rank {(me - 1) % n} at {host}:{port} could not serve "
                f"{inbox.object_id}: {exc}",
                object_id=inbox.object_id.hex(),
            ) from exc
        # The caller may write to its array once this returns: wait for the successor's reads,
        # long enough for the directory to declare a hung successor lost (a watched group then
        # raises MemberLostError) before this gives up.
        cfg = node.config
        patience = stall + cfg.lease_timeout + cfg.heartbeat_interval
        if not await out.wait_served(patience):
            raise HopliteTimeoutError(
                f"the successor did not read this member's part of allreduce #{seq} within {patience} s",
                operation="allreduce",
                timeout=patience,
            )
    except BaseException as exc:
        error = exc if isinstance(exc, HopliteError) else ObjectDeletedError(f"allreduce #{seq} stopped")
        await _withdraw(node, lent, error, stall)
        raise
    await _withdraw(node, lent, None, stall)
    g._spare = spare  # (not after a failure: a pull cut by it may still be landing bytes)


async def _pull_waiting(g: Group, host: str, port: int, inbox: LocalObject, on_chunk: ChunkCallback) -> None:
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
            await node.pull_unlisted(host, port, inbox, on_chunk, RING_CHUNK_BYTES)
            return
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
