"""Lookups and transfers: who waits for which object, and who streams it to whom.

A lookup is answered with the object's bytes (inline), a same-host segment to copy from, or a
sender to pull from (:mod:`.scheduling` chooses it); the sender is then busy (it serves one
receiver at a time) and the receiver is at once a partial location whose upstream is the sender,
so a later receiver can pull from it while it fills: concurrent receivers form pipelined chains
that branch as copies complete. A lookup with no idle source (or for an object not yet put)
waits, FIFO per object, until a source becomes idle, the object is put, or its deadline passes.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import protocol as p
from .records import (
    EndedTransfer,
    Location,
    LocationState,
    NodeInfo,
    ObjectEntry,
    PendingLookup,
    Reduction,
    Transfer,
)
from .reduce import ReducePlan
from .scheduling import choose_sender, computed_on_host, received_on_host, same_host_copy, via_sender

if TYPE_CHECKING:
    from .catalog import Catalog
    from .config import DirectoryConfig
    from .membership import Membership
    from .outbox import Outbox
    from .recovery import Recovery
    from .reductions import Reductions
    from .repair import Repair

#: Transfers of reduction results the directory ended before their receiver reported that it
#: remembers, the latest (a receiver reports within a round trip; see :class:`EndedTransfer`).
ENDED_KEPT = 4096


class Lookups:
    """The waiting lookups (:attr:`pending`, FIFO per object, with indexes) and the transfers
    under way (:attr:`transfers`).

    Args:
        config: The directory's settings.
        nodes: The joined nodes (read).
        objects: The objects and their copies (this part adds partial copies and ends transfers).
        reductions: The reductions by id (read: a lookup of a failed result fails).
        outbox: Where its messages and the events it records go.
        members: Told of a sender a receiver reported as failed.
        catalog: The deletes and losses it answers lookups with, and copies completed.

    Its collaborators made after it come through :meth:`connect`.
    """

    reducer: Reductions
    repair: Repair
    recovery: Recovery

    def __init__(
        self,
        *,
        config: DirectoryConfig,
        nodes: dict[str, NodeInfo],
        objects: dict[bytes, ObjectEntry],
        reductions: dict[bytes, Reduction],
        outbox: Outbox,
        members: Membership,
        catalog: Catalog,
    ) -> None:
        self.config = config
        self.nodes = nodes
        self.objects = objects
        self.reductions = reductions
        self.outbox = outbox
        self.members = members
        self.catalog = catalog
        self.pending: dict[bytes, deque[PendingLookup]] = {}
        # Indexes of ``pending`` so that no event walks every pending lookup: the deadlines (a
        # heap; entries of lookups no longer live are dropped when they reach the top), the
        # objects a node's request id waits for (for CancelLookup; a peer may reuse a request id,
        # hence a count per object), and each node's count (for its quota).
        self.deadlines: list[tuple[float, int, PendingLookup]] = []
        self._deadline_seq = itertools.count()
        self.by_request: dict[tuple[str, int], dict[bytes, int]] = {}
        self.per_node: dict[str, int] = {}
        self.transfers: dict[int, Transfer] = {}
        self._transfer_ids = itertools.count(1)
        self.ended: OrderedDict[int, EndedTransfer] = OrderedDict()  # by transfer id, oldest first

    def connect(self, *, reducer: Reductions, repair: Repair, recovery: Recovery) -> None:
        """Hand it the parts a transfer's end concerns: the reductions (a copy ready, the link
        estimate), their repair (a result of a replaced tree received whole), and the recovery
        after a restart (whether copies may still be restored)."""
        self.reducer = reducer
        self.repair = repair
        self.recovery = recovery

    # ------------------------------------------------------------ requests
    def request(self, node_id: str, msg: p.LookupRequest, now: float) -> None:
        """A node asks for an object: answer it now or queue it."""
        red = self.reductions.get(msg.object_id)
        if red is not None and red.error is not None:
            self.outbox.send(node_id, failed_lookup(msg.request_id, msg.object_id, red.error))
            return
        if red is None and msg.object_id in self.catalog.deleted and msg.object_id not in self.objects:
            self.outbox.send(node_id, deleted_lookup(msg.request_id, msg.object_id))  # it will not come
            return
        gone = msg.object_id not in self.objects and (red is None or not red.active)
        if gone and self.catalog.lost_recently(msg.object_id, now):
            # Lost an instant ago: this lookup raced the holder's death (tests/test_soak.py found
            # a get that then waited its whole timeout for a put that never came).
            self.outbox.send(node_id, lost_lookup(msg.request_id, msg.object_id))
            return
        if (
            (msg.have_bytes > 0 or msg.resume)
            and msg.object_id not in self.objects
            and (red is None or not red.active)
            and not self.recovery.recovering
        ):
            # It was receiving an object that has since been lost (or deleted): it cannot complete.
            # (While copies are being restored, it waits: its source may not have rejoined yet.)
            # A receiver whose sender died before any byte arrived asks with have_bytes 0 and
            # ``resume``: its empty copy was no location to drop (tests/test_soak.py found it).
            self.outbox.send(node_id, lost_lookup(msg.request_id, msg.object_id))
            return
        quota = self.config.max_pending_lookups
        if self.per_node.get(node_id, 0) >= quota:
            text = f"node has {quota} lookups pending, the directory's quota"
            reply = p.LookupReply(
                request_id=msg.request_id,
                status="error",
                object_id=msg.object_id,
                error=text,
                error_kind="QuotaExceededError",
            )
            self.outbox.send(node_id, reply)
            return
        deadline = now + msg.timeout if msg.timeout > 0 else None
        pl = PendingLookup(
            node_id,
            msg.request_id,
            msg.object_id,
            max(0, msg.have_bytes),
            deadline,
            msg.shared_memory,
            msg.direct,
            msg.device_ipc,
            msg.resume,
            msg.keep,
            msg.via,
        )
        self.pending.setdefault(msg.object_id, deque()).append(pl)
        by_object = self.by_request.setdefault((node_id, msg.request_id), {})
        by_object[msg.object_id] = by_object.get(msg.object_id, 0) + 1
        self.per_node[node_id] = self.per_node.get(node_id, 0) + 1
        if deadline is not None:
            heapq.heappush(self.deadlines, (deadline, next(self._deadline_seq), pl))
        self.outbox.record(
            now, "lookup", node=node_id, object_id=msg.object_id.hex(), request_id=msg.request_id
        )
        self.serve(msg.object_id, now)

    def cancel(self, node_id: str, request_id: int) -> None:
        """Withdraw ``node_id``'s lookups under ``request_id`` (CancelLookup)."""
        for oid in list(self.by_request.get((node_id, request_id), ())):
            self.retain(oid, lambda pl: (pl.node_id, pl.request_id) != (node_id, request_id))

    # ------------------------------------------------------------ answering
    def serve(self, oid: bytes, now: float) -> None:
        """Answer as many waiting lookups for ``oid`` as there are idle sources, FIFO."""
        queue = self.pending.get(oid)
        entry = self.objects.get(oid)
        if not queue or entry is None:
            return
        answered = 0

        def unanswered(pl: PendingLookup) -> bool:
            nonlocal answered
            done = self._try_answer(entry, pl, now)
            answered += done
            return not done

        self.retain(oid, unanswered)
        # A lookup via a node that an answer just gave a copy to, queued before that answer:
        # one more pass (a ring of n readers asking in any order settles in at most n passes).
        while answered and any(pl.via for pl in self.pending.get(oid, ())):
            answered = 0
            self.retain(oid, unanswered)

    def serve_all(self, now: float) -> None:
        """Try every waiting lookup again (a suspect node may serve again)."""
        for oid in list(self.pending):
            self.serve(oid, now)

    def _try_answer(self, entry: ObjectEntry, pl: PendingLookup, now: float) -> bool:
        meta: dict[str, Any] = dict(
            request_id=pl.request_id,
            object_id=entry.object_id,
            size=entry.size,
            dtype=entry.dtype,
            shape=list(entry.shape),
            digest=entry.digest,
            reduction_id=entry.reduction,
            memory=entry.memory,
        )
        if entry.inline is not None:
            # Recorded as a holder so that the owner's delete drops the reader's copy too; not one
            # that keeps no copy (a caller channel's get: a DropObject would only wake its node).
            if pl.keep:
                held = Location(pl.node_id, LocationState.COMPLETE, entry.size)
                entry.locations.setdefault(pl.node_id, held)
            self.outbox.send(pl.node_id, p.LookupReply(status="inline", inline=entry.inline, **meta))
            self.outbox.record(now, "lookup_inline", node=pl.node_id, object_id=entry.object_id.hex())
            return True
        own = entry.locations.get(pl.node_id)
        if own is not None and (own.state is LocationState.COMPLETE or own.producing):
            # The requester already holds it (e.g. a re-put), or a reduce vertex placed on it
            # computes it (after the lookup was sent): nothing to transfer.
            self.outbox.send(pl.node_id, p.LookupReply(status="local", **meta))
            return True
        nodes = self.nodes
        shared = same_host_copy(nodes, entry, pl.node_id, pl.device_ipc) if pl.shared_memory else None
        if shared is not None and shared.copying:
            return False  # its segment is being filled: mapping it then beats pulling it now
        if shared is None and pl.shared_memory and computed_on_host(nodes, entry, pl.node_id, pl.device_ipc):
            return False  # likewise for a result being computed on this host
        if shared is None and pl.shared_memory and received_on_host(nodes, entry, pl.node_id, pl.device_ipc):
            return False  # and for a copy another node of this host is receiving
        if shared is not None:
            self.outbox.send(
                pl.node_id,
                p.LookupReply(status="shm", sender_node=shared.node_id, segment=shared.segment, **meta),
            )
            kind = "lookup_ipc" if shared.segment.startswith(p.IPC_SEGMENT_PREFIX) else "lookup_shm"
            self.outbox.record(
                now, kind, node=pl.node_id, object_id=entry.object_id.hex(), sender=shared.node_id
            )
            return True
        routed: Location | bool = False
        if pl.via:
            queue = self.pending.get(entry.object_id, ())

            def asking(node: str) -> bool:
                return any(other.node_id == node and other.live for other in queue)

            routed = via_sender(nodes, self.objects, entry, pl.node_id, pl.via, asking)
        if routed is True:
            return False  # its node is about to receive it
        sender = routed or choose_sender(nodes, entry, pl.node_id, pl.direct)
        if sender is None:
            return False
        info = nodes[sender.node_id]
        transfer = Transfer(next(self._transfer_ids), entry.object_id, sender.node_id, pl.node_id, now)
        self.transfers[transfer.transfer_id] = transfer
        sender.busy = True
        have = min(pl.have_bytes, entry.size)  # a requester claiming more than the object holds
        if own is None:
            own = Location(pl.node_id, LocationState.PARTIAL, have)
            entry.locations[pl.node_id] = own
        own.upstream = sender.node_id
        own.progress = max(own.progress, have)
        self.outbox.send(
            pl.node_id,
            p.LookupReply(
                status="pull",
                transfer_id=transfer.transfer_id,
                sender_node=sender.node_id,
                sender_host=info.data_host,
                sender_port=info.data_port,
                sender_complete=sender.state is LocationState.COMPLETE,
                **meta,
            ),
        )
        self.outbox.record(
            now,
            "transfer_start",
            object_id=entry.object_id.hex(),
            transfer_id=transfer.transfer_id,
            sender=sender.node_id,
            receiver=pl.node_id,
            sender_complete=sender.state is LocationState.COMPLETE,
            sender_progress=sender.progress,
            have=own.progress,
        )
        return True

    def retain(self, oid: bytes, keep: Callable[[PendingLookup], bool]) -> None:
        """Keep, in order, the lookups waiting for ``oid`` for which ``keep`` is true (it may
        answer the others); forget the queue once it is empty."""
        kept: deque[PendingLookup] = deque()
        for pl in self.pending.get(oid, ()):
            if keep(pl):
                kept.append(pl)
                continue
            pl.live = False
            left = self.per_node.get(pl.node_id, 0) - 1
            if left > 0:
                self.per_node[pl.node_id] = left
            else:
                self.per_node.pop(pl.node_id, None)
            key = (pl.node_id, pl.request_id)
            by_object = self.by_request.get(key)
            if by_object is not None and oid in by_object:
                by_object[oid] -= 1
                if by_object[oid] <= 0:
                    del by_object[oid]
                if not by_object:
                    del self.by_request[key]
        if kept:
            self.pending[oid] = kept
        else:
            self.pending.pop(oid, None)

    def fail(self, oid: bytes, reply: Callable[[PendingLookup], p.LookupReply]) -> None:
        """Answer every lookup waiting for ``oid`` with ``reply(lookup)`` (an error)."""

        def answer(pl: PendingLookup) -> bool:
            self.outbox.send(pl.node_id, reply(pl))
            return False

        self.retain(oid, answer)

    # ------------------------------------------------------------ transfers
    def transfer_done(self, node_id: str, msg: p.TransferDone, now: float) -> None:
        """A receiver reports a transfer ended (complete, or failed with ``progress`` bytes)."""
        transfer = self.transfers.get(msg.transfer_id)
        if transfer is None:
            ended = self.ended.pop(msg.transfer_id, None)
            if ended is not None and ended.receiver == node_id and msg.ok:
                # A reduction's result, received whole just before its tree was repaired.
                self.repair.stale_copy(ended.object_id, ended.epoch, node_id, msg.segment, now)
            return
        if transfer.receiver != node_id:
            return  # unknown, finished, or not this node's transfer: nothing to change
        del self.transfers[msg.transfer_id]
        entry = self.objects.get(transfer.object_id)
        self.outbox.record(
            now,
            "transfer_done",
            object_id=transfer.object_id.hex(),
            transfer_id=transfer.transfer_id,
            sender=transfer.sender,
            receiver=node_id,
            ok=msg.ok,
            progress=msg.progress,
            reason=msg.reason,
        )
        if entry is None:
            return
        sender = entry.locations.get(transfer.sender)
        if sender is not None:
            sender.busy = False
        if msg.sender_failed and not msg.ok:
            self.members.suspect(transfer.sender, now, node_id, msg.reason)
        if msg.sender_lacks and not msg.ok and sender is not None and not sender.producing:
            self._lacks(entry, sender, now)
            if transfer.object_id not in self.objects:
                return  # that was its last copy: lost (the receiver was told)
        own = entry.locations.get(node_id)
        if msg.ok:
            reducer = self.reducer
            reducer.link = reducer.link.with_transfer(entry.size, now - transfer.started)
        if own is not None:
            if msg.ok:
                self.catalog.add_complete(entry, node_id, msg.segment)
                self.reducer.object_ready(transfer.object_id, now)
            else:
                # The receiver will look up again with what it holds; keep its bytes on record
                # (no more than the object has: found by tests/test_fuzz.py).
                own.progress = max(own.progress, min(msg.progress, entry.size))
                if own.state is LocationState.PARTIAL and own.upstream == transfer.sender:
                    own.upstream = None
                if (
                    own.progress == 0
                    and own.state is LocationState.PARTIAL
                    and not own.busy
                    and not own.producing
                ):
                    del entry.locations[node_id]
        self.serve(transfer.object_id, now)

    def _lacks(self, entry: ObjectEntry, sender: Location, now: float) -> None:
        """A reader found ``sender``'s copy gone (a collective withdraws results it received into
        the caller's memory without telling the directory): it is not offered again, and with no
        other complete copy and nobody computing it, the object is lost."""
        del entry.locations[sender.node_id]
        self.outbox.record(now, "copy_gone", object_id=entry.object_id.hex(), node=sender.node_id)
        self.catalog.settle({entry.object_id}, now)

    def serve_failed(self, node_id: str, transfer_id: int, now: float) -> None:
        """The sender gave up on a transfer (its receiver stalled, e.g. a stopped process): it is
        free to serve others now, not only once the receiver reports or is declared dead."""
        transfer = self.transfers.get(transfer_id)
        entry = self.objects.get(transfer.object_id) if transfer is not None else None
        if transfer is None or entry is None or transfer.sender != node_id:
            return
        sender = entry.locations.get(node_id)
        if sender is not None and sender.busy:
            sender.busy = False
            self.serve(transfer.object_id, now)

    def drop_transfers(self, oid: bytes) -> None:
        """``oid`` was forgotten: so are its transfers."""
        for tid in [t for t, tr in self.transfers.items() if tr.object_id == oid]:
            self._end(self.transfers.pop(tid))

    def _end(self, tr: Transfer) -> None:
        """The directory ends transfer ``tr`` before its receiver reported. One of an active
        reduction's result is remembered (:attr:`ended`): its receiver may have every byte already,
        and keeps them (a reset keeps a complete copy), so its report still counts."""
        red = self.reductions.get(tr.object_id)
        if red is None or not red.active or tr.receiver not in self.nodes:
            return
        ended = self.ended
        ended[tr.transfer_id] = EndedTransfer(tr.object_id, red.plan.epoch, tr.receiver)
        while len(ended) > ENDED_KEPT:
            ended.popitem(last=False)

    def forget_node(self, node_id: str, reason: str) -> set[bytes]:
        """``node_id`` left: drop its lookups and end the transfers it took part in (a receiver
        whose sender left is told at once). The ids of the objects those transfers were of."""
        for oid in list(self.pending):
            self.retain(oid, lambda pl: pl.node_id != node_id)
        touched: set[bytes] = set()
        for tid, tr in list(self.transfers.items()):
            if node_id in (tr.sender, tr.receiver):
                del self.transfers[tid]
                self._end(tr)
                entry = self.objects.get(tr.object_id)
                if tr.sender == node_id and tr.receiver in self.nodes:
                    self.outbox.send(tr.receiver, p.AbortTransfer(tid, f"sender {node_id[:8]} {reason}"))
                if entry is not None:
                    peer = entry.locations.get(tr.sender if tr.receiver == node_id else tr.receiver)
                    if peer is not None and tr.receiver == node_id:
                        peer.busy = False
                    elif peer is not None and peer.upstream == node_id:
                        peer.upstream = None  # it will ask for another source
                touched.add(tr.object_id)
        return touched

    # ------------------------------------------------------------ time
    def deadline(self) -> float | None:
        """The earliest deadline of a waiting lookup."""
        heap = self.deadlines
        while heap and not heap[0][2].live:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def expire(self, now: float) -> None:
        """Answer the lookups whose deadline passed with ``timeout`` and why they still wait."""

        def alive(pl: PendingLookup) -> bool:
            if pl.deadline is None or pl.deadline > now:
                return True
            reply = p.LookupReply(
                request_id=pl.request_id,
                status="timeout",
                object_id=pl.object_id,
                error=self.diagnose(pl.object_id),
            )
            self.outbox.send(pl.node_id, reply)
            self.outbox.record(now, "lookup_timeout", node=pl.node_id, object_id=pl.object_id.hex())
            return False

        due = set()  # only the queues of lookups whose deadline passed (the heap knows them)
        heap = self.deadlines
        while heap and heap[0][0] <= now:
            _, _, pl = heapq.heappop(heap)
            if pl.live:
                due.add(pl.object_id)
        for oid in due:
            self.retain(oid, alive)

    def diagnose(self, object_id: bytes) -> str:
        """Why a lookup of ``object_id`` is still waiting, naming the nodes concerned (for the
        error of a get that timed out: which member is missing or slow)."""
        entry = self.objects.get(object_id)
        red = self.reductions.get(object_id)
        if red is not None and red.active and not red.plan.full:
            plan = red.plan
            return (
                f"it is the result of a reduction with {len(plan.placed)} of its {plan.num_objects} "
                f"inputs ready; {not_ready(plan)}"
            )
        if entry is None:
            if self.recovery.recovering:
                return "the directory restarted and no node has restored it yet"
            return "no node has put it"

        def where(node_id: str) -> str:
            info = self.nodes.get(node_id)
            return (
                f"node {node_id[:8]} at {info.data_host}:{info.data_port}" if info else f"node {node_id[:8]}"
            )

        complete = [n for n, loc in entry.locations.items() if loc.state is LocationState.COMPLETE]
        partial = [(n, loc) for n, loc in entry.locations.items() if loc.state is LocationState.PARTIAL]
        parts = []
        if complete:
            busy = [n for n in complete if entry.locations[n].busy]
            parts.append(
                f"complete at {', '.join(where(n) for n in complete[:4])}"
                + (f" ({len(busy)} of them busy serving)" if busy else "")
            )
        for node_id, loc in partial[:4]:
            source = f" from {where(loc.upstream)}" if loc.upstream else ""
            doing = "computing it" if loc.producing else f"receiving it{source}"
            parts.append(f"{where(node_id)} is {doing}, {loc.progress} of {entry.size} bytes so far")
        if not parts:
            parts.append(f"put by {where(entry.owner)}, but no copy is left")
        return "; ".join(parts)


# ---------------------------------------------------------------- replies
def failed_lookup(request_id: int, oid: bytes, error: tuple[str, str, bytes]) -> p.LookupReply:
    """The answer to a lookup of ``oid`` that failed with ``error`` (kind, message, culprit)."""
    kind, message, culprit = error
    return p.LookupReply(
        request_id=request_id,
        status="error",
        object_id=oid,
        error=message,
        error_kind=kind,
        error_object_id=culprit,
    )


def lost_lookup(request_id: int, oid: bytes) -> p.LookupReply:
    """The answer to a lookup of ``oid``, which was lost."""
    message = (
        f"object {oid.hex()} was lost: every complete copy died while it was being received; put it again"
    )
    return failed_lookup(request_id, oid, ("ObjectLostError", message, oid))


def deleted_lookup(request_id: int, oid: bytes) -> p.LookupReply:
    """The answer to a lookup of ``oid``, which its owner deleted (and nobody put again)."""
    message = f"object {oid.hex()} was deleted by its owner; put it again to use the id anew"
    return failed_lookup(request_id, oid, ("ObjectDeletedError", message, oid))


def not_ready(plan: ReducePlan) -> str:
    """``"not ready: <ids>"``: the inputs of ``plan`` not placed yet (the first 8)."""
    placed = set(plan.reduced_objects())
    missing = [oid.hex() for oid in plan.inputs if oid not in placed]
    more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
    return f"not ready: {', '.join(missing[:8])}{more}"
