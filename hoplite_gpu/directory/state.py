"""The object directory as a pure state machine.

No sockets, threads or clock calls: every event carries ``now`` (seconds, any monotonic origin), and
:meth:`DirectoryState.handle` returns the instructions the hosting service must carry out (send a
reply to a node, push a message to a node). Tests drive it directly, moving time by passing another
``now``.

Scheduling follows the Hoplite paper (Zhuang et al., SIGCOMM 2021, section 4.2), receiver-driven:

* An object has locations: nodes holding a *complete* copy, or a *partial* copy that is still
  filling (with the number of bytes held at the last report).
* A lookup is answered with an idle complete copy if there is one, else with the idle partial copy
  holding the most bytes. The chosen sender is marked busy (it serves one receiver at a time) and the
  receiver is registered at once as a partial location whose upstream is the sender, so a later
  receiver can pull from it while it is still filling: concurrent receivers form pipelined chains that
  branch as copies complete.
* A lookup with no idle source (or for an object not yet put) waits, FIFO per object, until a source
  becomes idle, the object is put, or its deadline passes.
* A receiver is never given a source whose upstream chain leads back to itself (no cycles).
* Objects of at most ``inline_threshold_bytes`` are stored in the directory and returned with the
  lookup; no data-plane transfer happens.
* A requester that can use shared memory, on the same host (equal ``host_key``) as a complete copy
  published in a shared-memory segment, is told to copy from that segment. This takes no sender
  time (many readers copy at once, memory bandwidth permitting), so the sender is not marked busy
  and no transfer is recorded; the requester reports its copy with ``CopyAdded`` afterwards.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import protocol as p

#: How many events the directory keeps for :class:`~hoplite_gpu.protocol.EventLogRequest`.
EVENT_LOG_CAPACITY = 100_000


class LocationState(enum.Enum):
    """What a node holds of an object."""

    PARTIAL = "partial"
    COMPLETE = "complete"


# ---------------------------------------------------------------- events (inputs)
@dataclass(frozen=True, slots=True)
class NodeJoined:
    """A node authenticated; ``data_host:data_port`` is its data-plane listener."""

    node_id: str
    data_host: str
    data_port: int
    now: float
    host_key: str = ""


@dataclass(frozen=True, slots=True)
class NodeLeft:
    """A node's control connection closed (or it was declared dead)."""

    node_id: str
    now: float


@dataclass(frozen=True, slots=True)
class Request:
    """A control message from a node."""

    node_id: str
    message: p.Message
    now: float


@dataclass(frozen=True, slots=True)
class AuthFailed:
    """A connection from ``peer`` failed authentication and was dropped (logged only)."""

    peer: str
    now: float


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed; expire deadlines up to ``now``."""

    now: float


Event = NodeJoined | NodeLeft | Request | AuthFailed | Tick


# ---------------------------------------------------------------- instructions (outputs)
@dataclass(frozen=True, slots=True)
class Send:
    """Send ``message`` to node ``node_id`` (a reply or a push)."""

    node_id: str
    message: p.Message


Instruction = Send


# ---------------------------------------------------------------- state
@dataclass(slots=True)
class Location:
    """One node's copy of an object."""

    node_id: str
    state: LocationState
    progress: int
    busy: bool = False
    upstream: str | None = None  # node this copy is being filled from
    segment: str = ""  # shared-memory segment of a complete copy ("" if none)


@dataclass(slots=True)
class ObjectEntry:
    """Everything the directory knows about one object."""

    object_id: bytes
    size: int
    dtype: str
    shape: list[int]
    digest: bytes
    owner: str
    inline: bytes | None
    locations: dict[str, Location] = field(default_factory=dict)


@dataclass(slots=True)
class PendingLookup:
    """A lookup waiting for its object or for an idle source."""

    node_id: str
    request_id: int
    object_id: bytes
    have_bytes: int
    deadline: float | None
    shared_memory: bool = False


@dataclass(slots=True)
class Transfer:
    """A sender streaming an object to a receiver."""

    transfer_id: int
    object_id: bytes
    sender: str
    receiver: str
    started: float


@dataclass(slots=True)
class NodeInfo:
    """A connected node."""

    node_id: str
    data_host: str
    data_port: int
    joined: float
    host_key: str = ""


class DirectoryState:
    """The directory's state and transition logic (pure, synchronous).

    Args:
        inline_threshold_bytes: Objects up to this size are stored inline.
    """

    def __init__(self, inline_threshold_bytes: int = 64 * 1024) -> None:
        self.inline_threshold_bytes = inline_threshold_bytes
        self.nodes: dict[str, NodeInfo] = {}
        self.objects: dict[bytes, ObjectEntry] = {}
        self.pending: dict[bytes, deque[PendingLookup]] = {}
        self.transfers: dict[int, Transfer] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENT_LOG_CAPACITY)
        self._seq = itertools.count()
        self._transfer_ids = itertools.count(1)
        self._out: list[Instruction] = []

    # ------------------------------------------------------------ entry point
    def handle(self, event: Event) -> list[Instruction]:
        """Apply one event and return the instructions it produced."""
        self._out = []
        if isinstance(event, Request):
            self._on_request(event)
        elif isinstance(event, NodeJoined):
            self.nodes[event.node_id] = NodeInfo(
                event.node_id, event.data_host, event.data_port, event.now, event.host_key
            )
            self._log(event.now, "node_joined", node=event.node_id)
        elif isinstance(event, NodeLeft):
            self._on_node_left(event)
        elif isinstance(event, Tick):
            self._expire(event.now)
        elif isinstance(event, AuthFailed):
            self._log(event.now, "auth_failed", peer=event.peer)
        else:  # pragma: no cover - exhaustive over Event
            raise TypeError(f"unknown event {event!r}")
        out, self._out = self._out, []
        return out

    def next_deadline(self) -> float | None:
        """Earliest pending-lookup deadline, so the host knows when to send a :class:`Tick`."""
        deadlines = [pl.deadline for q in self.pending.values() for pl in q if pl.deadline is not None]
        return min(deadlines) if deadlines else None

    # ------------------------------------------------------------ requests
    def _on_request(self, ev: Request) -> None:
        msg = ev.message
        if ev.node_id not in self.nodes:
            return  # not authenticated/joined: nothing it sends is acted on
        if isinstance(msg, p.PutRequest):
            self._on_put(ev.node_id, msg, ev.now)
        elif isinstance(msg, p.LookupRequest):
            self._on_lookup(ev.node_id, msg, ev.now)
        elif isinstance(msg, p.CancelLookup):
            self._drop_pending(ev.node_id, msg.request_id)
        elif isinstance(msg, p.TransferDone):
            self._on_transfer_done(ev.node_id, msg, ev.now)
        elif isinstance(msg, p.CopyAdded):
            self._on_copy_added(ev.node_id, msg, ev.now)
        elif isinstance(msg, p.ServeDone):
            self._log(
                ev.now,
                "serve_done",
                node=ev.node_id,
                transfer_id=msg.transfer_id,
                bytes_sent=msg.bytes_sent,
                bytes_sent_while_incomplete=msg.bytes_sent_while_incomplete,
            )
        elif isinstance(msg, p.DeleteRequest):
            self._on_delete(ev.node_id, msg, ev.now)
        elif isinstance(msg, p.EventLogRequest):
            events = [e for e in self.events if e["seq"] >= msg.since]
            self._send(ev.node_id, p.EventLogReply(request_id=msg.request_id, events=events))
        else:
            request_id = getattr(msg, "request_id", 0)
            self._send(
                ev.node_id,
                p.ErrorReply(
                    request_id=request_id,
                    kind="ProtocolError",
                    message=f"the directory does not accept {msg.TYPE!r} messages",
                ),
            )

    def _on_put(self, node_id: str, msg: p.PutRequest, now: float) -> None:
        oid = msg.object_id
        if msg.size < 0 or len(oid) != 20:
            self._send(
                node_id,
                p.PutReply(request_id=msg.request_id, error="invalid put", error_kind="ProtocolError"),
            )
            return
        if msg.inline is not None and (len(msg.inline) != msg.size or msg.size > self.inline_threshold_bytes):
            self._send(
                node_id,
                p.PutReply(
                    request_id=msg.request_id,
                    error="inline data does not match the announced size or exceeds the threshold",
                    error_kind="ProtocolError",
                ),
            )
            return
        entry = self.objects.get(oid)
        if entry is not None:
            same = (
                entry.size == msg.size
                and entry.dtype == msg.dtype
                and list(entry.shape) == list(msg.shape)
                and entry.digest == msg.digest
            )
            if not same:
                self._log(now, "put_conflict", node=node_id, object_id=oid.hex())
                self._send(
                    node_id,
                    p.PutReply(
                        request_id=msg.request_id,
                        error=(
                            f"object {oid.hex()} already exists with different content "
                            f"(size {entry.size}, dtype {entry.dtype}, shape {list(entry.shape)}); "
                            "use a new ObjectID or delete the old object first"
                        ),
                        error_kind="ObjectExistsError",
                    ),
                )
                return
            if entry.inline is None:
                self._add_complete(entry, node_id, msg.segment)
            self._send(node_id, p.PutReply(request_id=msg.request_id))
            self._log(now, "put", node=node_id, object_id=oid.hex(), size=msg.size, again=True)
            self._serve_pending(oid, now)
            return
        entry = ObjectEntry(
            object_id=oid,
            size=msg.size,
            dtype=msg.dtype,
            shape=list(msg.shape),
            digest=msg.digest,
            owner=node_id,
            inline=msg.inline,
        )
        if msg.inline is None:
            self._add_complete(entry, node_id, msg.segment)
        self.objects[oid] = entry
        self._send(node_id, p.PutReply(request_id=msg.request_id))
        self._log(now, "put", node=node_id, object_id=oid.hex(), size=msg.size, inline=msg.inline is not None)
        self._serve_pending(oid, now)

    def _add_complete(self, entry: ObjectEntry, node_id: str, segment: str) -> None:
        loc = entry.locations.get(node_id)
        if loc is None:
            entry.locations[node_id] = Location(node_id, LocationState.COMPLETE, entry.size, segment=segment)
        else:
            loc.state = LocationState.COMPLETE
            loc.progress = entry.size
            loc.upstream = None
            loc.segment = segment

    def _on_copy_added(self, node_id: str, msg: p.CopyAdded, now: float) -> None:
        entry = self.objects.get(msg.object_id)
        if entry is None or entry.inline is not None:
            # Deleted while the node copied it: the node was not on record as a holder when the
            # owner's delete went out, so tell it now.
            self._send(node_id, p.DropObject(object_id=msg.object_id))
            return
        self._add_complete(entry, node_id, msg.segment)
        self._log(now, "copy_added", node=node_id, object_id=msg.object_id.hex())
        self._serve_pending(msg.object_id, now)

    def _on_lookup(self, node_id: str, msg: p.LookupRequest, now: float) -> None:
        deadline = now + msg.timeout if msg.timeout > 0 else None
        pl = PendingLookup(
            node_id, msg.request_id, msg.object_id, max(0, msg.have_bytes), deadline, msg.shared_memory
        )
        self.pending.setdefault(msg.object_id, deque()).append(pl)
        self._log(now, "lookup", node=node_id, object_id=msg.object_id.hex(), request_id=msg.request_id)
        self._serve_pending(msg.object_id, now)

    def _serve_pending(self, oid: bytes, now: float) -> None:
        """Answer as many waiting lookups for ``oid`` as there are idle sources, FIFO."""
        queue = self.pending.get(oid)
        entry = self.objects.get(oid)
        if not queue or entry is None:
            return
        self._retain_pending(oid, lambda pl: not self._try_answer(entry, pl, now))

    def _try_answer(self, entry: ObjectEntry, pl: PendingLookup, now: float) -> bool:
        meta: dict[str, Any] = dict(
            request_id=pl.request_id,
            object_id=entry.object_id,
            size=entry.size,
            dtype=entry.dtype,
            shape=list(entry.shape),
            digest=entry.digest,
        )
        if entry.inline is not None:
            self._send(pl.node_id, p.LookupReply(status="inline", inline=entry.inline, **meta))
            self._log(now, "lookup_inline", node=pl.node_id, object_id=entry.object_id.hex())
            return True
        own = entry.locations.get(pl.node_id)
        if own is not None and own.state is LocationState.COMPLETE:
            # The requester already holds it (e.g. a re-put); nothing to transfer.
            self._send(pl.node_id, p.LookupReply(status="local", **meta))
            return True
        shared = self._same_host_copy(entry, pl.node_id) if pl.shared_memory else None
        if shared is not None:
            self._send(
                pl.node_id,
                p.LookupReply(status="shm", sender_node=shared.node_id, segment=shared.segment, **meta),
            )
            self._log(
                now, "lookup_shm", node=pl.node_id, object_id=entry.object_id.hex(), sender=shared.node_id
            )
            return True
        sender = self._choose_sender(entry, pl.node_id)
        if sender is None:
            return False
        info = self.nodes[sender.node_id]
        transfer = Transfer(next(self._transfer_ids), entry.object_id, sender.node_id, pl.node_id, now)
        self.transfers[transfer.transfer_id] = transfer
        sender.busy = True
        if own is None:
            own = Location(pl.node_id, LocationState.PARTIAL, pl.have_bytes)
            entry.locations[pl.node_id] = own
        own.upstream = sender.node_id
        own.progress = max(own.progress, pl.have_bytes)
        self._send(
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
        self._log(
            now,
            "transfer_start",
            object_id=entry.object_id.hex(),
            transfer_id=transfer.transfer_id,
            sender=sender.node_id,
            receiver=pl.node_id,
            sender_complete=sender.state is LocationState.COMPLETE,
            sender_progress=sender.progress,
        )
        return True

    def _same_host_copy(self, entry: ObjectEntry, receiver: str) -> Location | None:
        """A complete copy in a shared-memory segment on ``receiver``'s host (the owner's first)."""
        key = self.nodes[receiver].host_key
        if not key:
            return None
        found: Location | None = None
        for loc in entry.locations.values():
            info = self.nodes.get(loc.node_id)
            if (
                loc.state is LocationState.COMPLETE
                and loc.segment
                and loc.node_id != receiver
                and info is not None
                and info.host_key == key
            ):
                if loc.node_id == entry.owner:
                    return loc
                found = found or loc
        return found

    def _choose_sender(self, entry: ObjectEntry, receiver: str) -> Location | None:
        """Idle complete copy first, else the idle partial copy with most bytes; never a cycle."""
        best: Location | None = None
        for loc in entry.locations.values():
            if loc.busy or loc.node_id == receiver or loc.node_id not in self.nodes:
                continue
            if loc.state is LocationState.PARTIAL and self._depends_on(entry, loc, receiver):
                continue
            if best is None or _rank(loc) > _rank(best):
                best = loc
        return best

    def _depends_on(self, entry: ObjectEntry, loc: Location, receiver: str) -> bool:
        """Whether ``loc``'s upstream chain passes through ``receiver``."""
        seen: set[str] = set()
        current: Location | None = loc
        while current is not None and current.upstream is not None:
            if current.upstream == receiver:
                return True
            if current.upstream in seen:
                return True  # defensive: a cycle already exists; do not extend it
            seen.add(current.upstream)
            current = entry.locations.get(current.upstream)
        return False

    def _on_transfer_done(self, node_id: str, msg: p.TransferDone, now: float) -> None:
        transfer = self.transfers.get(msg.transfer_id)
        if transfer is None or transfer.receiver != node_id:
            return  # unknown, finished, or not this node's transfer: nothing to change
        del self.transfers[msg.transfer_id]
        entry = self.objects.get(transfer.object_id)
        self._log(
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
        own = entry.locations.get(node_id)
        if own is not None:
            if msg.ok:
                self._add_complete(entry, node_id, msg.segment)
            else:
                # The receiver will look up again with what it holds; keep its bytes on record.
                own.progress = max(own.progress, msg.progress)
                if own.state is LocationState.PARTIAL and own.upstream == transfer.sender:
                    own.upstream = None
                if own.progress == 0 and own.state is LocationState.PARTIAL and not own.busy:
                    del entry.locations[node_id]
        self._serve_pending(transfer.object_id, now)

    def _on_delete(self, node_id: str, msg: p.DeleteRequest, now: float) -> None:
        entry = self.objects.get(msg.object_id)
        if entry is None:
            self._send(node_id, p.DeleteReply(request_id=msg.request_id, deleted=False))
            return
        if entry.owner != node_id:
            loc = entry.locations.get(node_id)
            if loc is not None and not loc.busy:
                del entry.locations[node_id]
            self._send(node_id, p.DeleteReply(request_id=msg.request_id, deleted=False))
            self._log(now, "delete_local", node=node_id, object_id=msg.object_id.hex())
            return
        del self.objects[msg.object_id]
        for tid in [t for t, tr in self.transfers.items() if tr.object_id == msg.object_id]:
            del self.transfers[tid]
        for holder in entry.locations:
            if holder != node_id and holder in self.nodes:
                self._send(holder, p.DropObject(object_id=msg.object_id))
        self._send(node_id, p.DeleteReply(request_id=msg.request_id, deleted=True))
        self._log(now, "delete", node=node_id, object_id=msg.object_id.hex())

    # ------------------------------------------------------------ node and time
    def _on_node_left(self, ev: NodeLeft) -> None:
        if self.nodes.pop(ev.node_id, None) is None:
            return
        self._log(ev.now, "node_left", node=ev.node_id)
        for oid in list(self.pending):
            self._retain_pending(oid, lambda pl: pl.node_id != ev.node_id)
        touched: set[bytes] = set()
        for tid, tr in list(self.transfers.items()):
            if ev.node_id in (tr.sender, tr.receiver):
                del self.transfers[tid]
                entry = self.objects.get(tr.object_id)
                if entry is not None and tr.receiver == ev.node_id:
                    sender = entry.locations.get(tr.sender)
                    if sender is not None:
                        sender.busy = False
                touched.add(tr.object_id)
        for oid, entry in list(self.objects.items()):
            if entry.locations.pop(ev.node_id, None) is not None:
                touched.add(oid)
        for oid in touched:
            self._serve_pending(oid, ev.now)

    def _expire(self, now: float) -> None:
        def alive(pl: PendingLookup) -> bool:
            if pl.deadline is None or pl.deadline > now:
                return True
            reply = p.LookupReply(request_id=pl.request_id, status="timeout", object_id=pl.object_id)
            self._send(pl.node_id, reply)
            self._log(now, "lookup_timeout", node=pl.node_id, object_id=pl.object_id.hex())
            return False

        for oid in list(self.pending):
            self._retain_pending(oid, alive)

    def _drop_pending(self, node_id: str, request_id: int) -> None:
        for oid in list(self.pending):
            self._retain_pending(oid, lambda pl: (pl.node_id, pl.request_id) != (node_id, request_id))

    def _retain_pending(self, oid: bytes, keep: Callable[[PendingLookup], bool]) -> None:
        """Keep, in order, the lookups waiting for ``oid`` for which ``keep`` is true (it may
        answer the others); forget the queue once it is empty."""
        kept = deque(pl for pl in self.pending.get(oid, ()) if keep(pl))
        if kept:
            self.pending[oid] = kept
        else:
            self.pending.pop(oid, None)

    # ------------------------------------------------------------ helpers
    def _send(self, node_id: str, message: p.Message) -> None:
        self._out.append(Send(node_id, message))

    def _log(self, now: float, kind: str, **details: Any) -> None:
        self.events.append({"seq": next(self._seq), "t": now, "kind": kind, **details})


def _rank(loc: Location) -> tuple[int, int]:
    return (1 if loc.state is LocationState.COMPLETE else 0, loc.progress)
