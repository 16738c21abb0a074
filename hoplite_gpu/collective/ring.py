"""The direct ring: a group's allreduce passed member to member over the data plane, with no
message to the directory once each member knows its predecessor's data-plane address.

The array is cut into one chunk per member. In the reduce-scatter, member ``m`` pulls from its
predecessor the running sum of chunk ``m - s`` (step ``s = 1 .. N-1``) and adds its own chunk
into it, in place in the caller's array, chunk by chunk as the bytes land; its successor pulls
that sum from it while it is being computed. After ``N-1`` steps member ``m`` holds the whole
sum of chunk ``m + 1``; in the allgather each member pulls the sums from its predecessor
straight into its array, and its successor pulls them on from it while they land. Every byte
goes from a member to the next, ``2 (N-1)/N`` of the array each way on every link, like Gloo's
ring, and the only control is the data plane's pull requests.

Nothing of it is known to the directory, so nothing of it can be repaired: a member that dies
fails the call (``MemberLostError`` at once in a watched group, or a data-plane error or timeout
otherwise), as a member lost in the directory's ring does. Overwriting the caller's array in
place is safe because of causality: the sum of a chunk reaches a member only after its
successor has read that member's bytes of the chunk that the sum overwrites."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..dtypes import dtype_to_wire
from ..errors import (
    HopliteError,
    HopliteTimeoutError,
    ObjectDeletedError,
    ObjectLostError,
    ObjectNotFoundError,
    TransportError,
    as_hoplite_error,
)
from ..iothread import all_or_cancel
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


#: The most pulls a member of a direct ring runs at once (``MAX_IDLE_PER_PEER`` of the TCP plane:
#: each has its connection, kept for the next round).
PULLS_AT_ONCE = 8

#: The most memory a group keeps between direct rings for the running sums it receives.
SPARE_BYTES = 256 << 20


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
    stall = node.config.stall_timeout
    host, port = peers[(me - 1) % n].host, peers[(me - 1) % n].port
    cuts = [flat.size * j // n for j in range(n + 1)]
    wire = dtype_to_wire(flat.dtype)
    item = flat.dtype.itemsize
    step = max(1, node.config.reduce_chunk_bytes // item)

    def region(c: int) -> Any:
        return flat[cuts[c % n] : cuts[c % n + 1]]

    def sum_id(c: int, k: int) -> ObjectID:  # chunk c summed over members c .. c + k
        return g.object_id(seq, "ring-sum", c % n, k)

    def all_id(c: int) -> ObjectID:  # the whole sum of chunk c (a copy on every member)
        return g.object_id(seq, "ring-all", c % n)

    def local(oid: ObjectID, arr: Any, progress: int, served: bool) -> LocalObject:
        obj = LocalObject(oid, arr.nbytes, wire, (arr.size,), b"", Buffer.wrap(arr.view(np.uint8)), progress)
        if served:  # pulled by the successor, which asks for it by its id
            node.lend_unlisted(obj)
            lent.append(obj)
        return obj

    async def pull(obj: LocalObject) -> None:
        try:
            try:
                async with window:
                    await node.pull_unlisted(host, port, obj)
            except (TransportError, ObjectNotFoundError) as exc:
                # The member before (or one before it, which withdrew what it served) failed or
                # died: a watched group waits for the directory's word (MemberLostError).
                raise ObjectLostError(
                    f"allreduce #{seq}: rank {(me - 1) % n} at {host}:{port} could not serve "
                    f"{obj.object_id}: {exc}",
                    object_id=obj.object_id.hex(),
                ) from exc
        except BaseException as exc:  # wake whoever waits for its bytes
            obj.fail(as_hoplite_error(exc, obj.object_id))
            raise

    async def reduce_step(s: int) -> None:
        # Sum of chunk me - s over members me - s .. me, written over this member's chunk; the
        # last step's (s = N-1) is the whole sum of chunk me + 1, read by the successor first.
        mine, inbox, scratch = region(me - s), inboxes[s - 1], scratches[s - 1]
        last = s == n - 1
        out = local(all_id(me - s) if last else sum_id(me - s, s), mine, 0, True)
        pos = 0
        while pos < mine.size:
            # No time-out of its own: the pull ends within stall_timeout of no progress.
            await inbox.wait_progress(min(pos + step, mine.size) * item, None)
            end = min(mine.size, inbox.progress // item)
            part = mine[pos:end]
            reduce_chunk(op, part, [scratch[pos:end]], part, n if last else 0)
            out.advance(end * item)
            pos = end
        await pulls[s - 1]

    lent: list[LocalObject] = []
    # Where the running sums land before they are added in: reused from round to round (fresh
    # memory costs a page fault per page), up to SPARE_BYTES a group.
    # Taken from the group while in use (the torch backend may run two at once).
    most = max(cuts[c + 1] - cuts[c] for c in range(n)) * item
    kept, g._spare = g._spare, []
    spare = [b if b.nbytes >= most else np.empty(most, np.uint8) for b in kept[: n - 1]]
    spare += [np.empty(most, np.uint8) for _ in range(n - 1 - len(spare))]
    scratches = [spare[s - 1][: region(me - s).nbytes].view(flat.dtype) for s in range(1, n)]
    # At most PULLS_AT_ONCE pulls from the member before, taken in the ring's order (each waits
    # for the one before it anyway): a connection each, kept between rounds.
    window = asyncio.Semaphore(PULLS_AT_ONCE)
    pulls: list[asyncio.Future[None]] = []
    try:
        local(sum_id(me, 0), region(me), region(me).nbytes, n > 1)  # step 0: own chunk me
        inboxes = [local(sum_id(me - s, s - 1), scratches[s - 1], 0, False) for s in range(1, n)]
        # The whole sums into the caller's array, served on but for the one the successor
        # computed itself (t = N-1).
        gathered = [local(all_id(me + 1 - t), region(me + 1 - t), 0, t < n - 1) for t in range(1, n)]
        pulls = [asyncio.ensure_future(pull(obj)) for obj in (*inboxes, *gathered)]  # in this order
        await all_or_cancel([*(reduce_step(s) for s in range(1, n)), _all_of(pulls[n - 1 :])])
        # The caller may write to its array once this returns: wait for the successor's reads,
        # long enough for the directory to declare a hung successor lost (a watched group then
        # raises MemberLostError) before this gives up.
        cfg = node.config
        patience = stall + cfg.lease_timeout + cfg.heartbeat_interval
        if not all(await asyncio.gather(*(obj.wait_served(patience) for obj in lent))):
            raise HopliteTimeoutError(
                f"the successor did not read this member's part of allreduce #{seq} within {patience} s",
                operation="allreduce",
                timeout=patience,
            )
    except BaseException as exc:
        for task in pulls:
            task.cancel()
        await asyncio.gather(*pulls, return_exceptions=True)
        error = exc if isinstance(exc, HopliteError) else ObjectDeletedError(f"allreduce #{seq} stopped")
        await _withdraw(node, lent, error, stall)
        raise
    await _withdraw(node, lent, None, stall)
    if most * (n - 1) <= SPARE_BYTES:
        g._spare = spare  # (not after a failure: a pull cut by it may still be landing bytes)


async def _withdraw(node: Any, lent: list[LocalObject], error: HopliteError | None, stall: float) -> None:
    """Take the caller's memory back: the objects leave the store, and pulls still reading them
    stop (failed) before this returns."""
    node.withdraw([], lent, error)
    await asyncio.gather(*(obj.wait_unserved(stall) for obj in lent))


async def _all_of(tasks: list[asyncio.Future[None]]) -> None:
    await asyncio.gather(*tasks)
