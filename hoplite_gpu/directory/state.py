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
* Reductions (:mod:`.reduce`): inputs are placed in a tree as they become ready (put), in the
  order they arrive; every vertex but a leaf gets a :class:`~hoplite_gpu.protocol.ReduceTask` on
  the node holding its input, and its output is registered at once as a partial object there, so
  its parent (or a ``get`` of the result) streams it through the same lookup/pull path as any
  object while it is being reduced. Inline-sized inputs are reduced here, without any transfer.
* A requester that can use shared memory, on the same host (equal ``host_key``) as a complete copy
  published in a shared-memory segment, is told to copy from that segment. This takes no sender
  time (many readers copy at once, memory bandwidth permitting), so the sender is not marked busy
  and no transfer is recorded; the requester reports its copy with ``CopyAdded`` afterwards.

Failures (section 4.3 of the paper, plus what it lacked):

* A node is dead when its connection closes or when it sends nothing (heartbeats included) for
  ``lease_timeout`` seconds; the host then closes its connection (:class:`Disconnect`). A directory
  that itself stalled (``Tick.lag``) renews every lease instead of declaring everyone dead.
* A receiver that reports its sender failed (``TransferDone.sender_failed``: a lost connection or a
  stalled stream) makes the sender *suspect*: it serves nobody until it heartbeats again, so the
  receiver's next lookup gets another source and resumes from the bytes it holds.
* When a dead node held the last complete copy of an object (and nobody is computing it), the object
  is *lost*: partial holders drop it and waiting lookups fail with ``ObjectLostError``; a later
  ``put`` of the same ObjectID (a restarted task) makes it available again.
* A reduction one of whose placed inputs or vertices was on a dead node is *repaired*: its tree is
  rebuilt under a new epoch from the inputs that still have a copy, in their arrival order, plus
  the next ready inputs (first-k), or it waits for the lost input to be put again. Every vertex
  of the old tree is cancelled and partial copies of the result are reset, so nothing is counted
  twice; ``reduced_objects`` is answered only when the result is complete, so it is exact.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import protocol as p
from ..coding import DECODE_TOLERANCE, DecodeTracker, solve_decoding
from ..dtypes import dtype_from_wire
from ..errors import InvalidArgumentError
from ..reduce_ops import as_op, check_dtype, reduce_chunk, weighted_sum_chunk
from ..topology import Inventory, LinkKind, link_between
from .reduce import LinkEstimate, MismatchError, Placement, ReducePlan

log = logging.getLogger("hoplite_gpu.directory")

#: Finished or failed reductions the directory remembers (for ``reduced_objects`` and lookups).
REDUCTIONS_KEPT = 10_000

#: How many events the directory keeps for :class:`~hoplite_gpu.protocol.EventLogRequest`.
EVENT_LOG_CAPACITY = 100_000
#: Default bound of the event log's size in bytes (estimated: see :func:`_event_bytes`); the oldest
#: events go first once either bound is reached.
EVENT_LOG_BYTES = 64 * 1024 * 1024

#: A suspect node's heartbeat clears the suspicion only if it arrives this long after it (one sent
#: just before the node stopped may still be in flight).
SUSPECT_GRACE = 0.25

#: Rebuilds of one reduction's tree after failures before it is failed instead.
MAX_REPAIRS = 64


class InvariantError(AssertionError):
    """The directory's state broke one of its invariants (a bug; see :meth:`DirectoryState.problems`)."""


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
    rejoin: bool = False  # it lost its directory (this one restarted): its copies follow as Restore
    gpu: str = ""  # the GPU its device objects live on (see protocol.Hello), and its host's GPUs:
    gpus: Inventory | None = None


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
    """Time passed; expire deadlines and leases up to ``now``. ``lag``: how late the host woke
    for this tick (a directory that was itself stalled does not declare its nodes dead)."""

    now: float
    lag: float = 0.0


@dataclass(frozen=True, slots=True)
class ContinueReduce:
    """Place the next slice of a reduction's inputs that were present when it was requested (the
    host feeds it back for a :class:`Resume`, after the events that queued up meanwhile)."""

    reduction_id: bytes
    now: float


Event = NodeJoined | NodeLeft | Request | AuthFailed | Tick | ContinueReduce


# ---------------------------------------------------------------- instructions (outputs)
@dataclass(frozen=True, slots=True)
class Send:
    """Send ``message`` to node ``node_id`` (a reply or a push)."""

    node_id: str
    message: p.Message


@dataclass(frozen=True, slots=True)
class Disconnect:
    """Close node ``node_id``'s connection: it was declared dead (``reason``)."""

    node_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Resume:
    """Give the directory :class:`ContinueReduce` for ``reduction_id`` once the events waiting now
    (other nodes' requests) have been handled: a reduction over many present inputs is placed a
    slice (``DirectoryState.place_slice``) per event, so no other node waits behind all of it."""

    reduction_id: bytes


Instruction = Send | Disconnect | Resume

#: Inputs a reduction places per event when they are already present (see :class:`Resume`): about
#: 5-10 ms of the directory's time on the development machines.
PLACE_SLICE = 256


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
    producing: bool = False  # the node computes this object (a reduce-tree vertex's output)
    copying: bool = False  # the owner is still copying its put into ``segment`` (CopyAdded ends it)


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
    reduction: bytes = b""  # the reduction computing it (an intermediate, or its running result)
    charged: str = ""  # the node whose inline-bytes quota ``inline`` counts against
    memory: str = ""  # "device": put from device memory, read back as device arrays ("" host)


@dataclass(slots=True)
class PendingLookup:
    """A lookup waiting for its object or for an idle source."""

    node_id: str
    request_id: int
    object_id: bytes
    have_bytes: int
    deadline: float | None
    shared_memory: bool = False
    direct: bool = False  # from the owner even while it serves others (see LookupRequest)
    device_ipc: bool = False  # can open a same-host device copy (see LookupRequest)
    resume: bool = False  # holds a copy from an earlier answer, perhaps empty (see LookupRequest)
    live: bool = True  # still in its queue (answered, failed and cancelled lookups are not)


@dataclass(slots=True)
class Transfer:
    """A sender streaming an object to a receiver."""

    transfer_id: int
    object_id: bytes
    sender: str
    receiver: str
    started: float


@dataclass(slots=True)
class PendingQuery:
    """A ``reduced_objects`` request waiting for its reduction to choose all inputs."""

    node_id: str
    request_id: int
    deadline: float | None


@dataclass(slots=True)
class Reduction:
    """A requested reduction: its tree plan and where it stands."""

    plan: ReducePlan
    op: str
    requester: str
    deadline: float | None  # fail if the plan is not full by then
    timeout: float = 0.0  # the request's timeout (the deadline restarts when the tree is rebuilt)
    repairs: int = 0
    error: tuple[str, str, bytes] | None = None  # (error kind, message, offending input)
    done: bool = False
    restored: bool = False  # finished before a directory restart: which inputs it used is unknown
    inline: list[bytes] = field(default_factory=list)  # inputs' bytes, for a directory-side reduce
    weights: dict[bytes, float] = field(default_factory=dict)  # input -> weight (a weighted SUM)
    inline_ids: list[bytes] = field(default_factory=list)  # the inputs of ``inline``, in order
    # A decoded reduction: each input's encoding row; ``weights`` are chosen once it is full.
    coding: dict[bytes, list[float]] = field(default_factory=dict)
    # Decoded as inputs arrive (requested with num_objects 0): every input asked for, and, until
    # the arrivals decode, their rows (the plan then holds nothing; it is rebuilt over the inputs
    # the decoding uses once they do).
    candidates: tuple[bytes, ...] = ()
    gather: DecodeTracker | None = None
    queries: list[PendingQuery] = field(default_factory=list)
    backlog: deque[bytes] = field(default_factory=deque)  # present inputs not offered yet (Resume)
    memory: str | None = None  # the memory of the first input placed: its result's and vertices'

    @property
    def active(self) -> bool:
        """Neither finished nor failed."""
        return self.error is None and not self.done


@dataclass(slots=True)
class NodeInfo:
    """A connected node."""

    node_id: str
    data_host: str
    data_port: int
    joined: float
    host_key: str = ""
    last_seen: float = 0.0
    suspect_since: float | None = None  # a receiver reported it failed; it serves nobody
    gpu: str = ""  # see NodeJoined
    gpus: Inventory | None = None


class DirectoryState:
    """The directory's state and transition logic (pure, synchronous).

    Args:
        inline_threshold_bytes: Objects up to this size are stored inline.
        lease_timeout: Seconds of silence after which a node is declared dead.
        validate: Check every invariant after each event (:meth:`validate`; for tests: it costs
            a pass over the whole state per event).
        max_pending_lookups: Per-node quota of waiting lookups.
        max_reductions: Per-node quota of unfinished reductions.
        max_inline_bytes: Per-node quota of bytes of the objects a node put (or restored) that
            are stored inline here.
        event_log_bytes: Bound of the event log's estimated size; with ``EVENT_LOG_CAPACITY``
            events, the oldest go first.
        place_slice: Present inputs a reduction places per event.
    """

    def __init__(
        self,
        inline_threshold_bytes: int = 64 * 1024,
        lease_timeout: float = 5.0,
        validate: bool = False,
        max_pending_lookups: int = 100_000,
        max_reductions: int = 10_000,
        max_inline_bytes: int = 256 * 1024 * 1024,
        event_log_bytes: int = EVENT_LOG_BYTES,
        place_slice: int = PLACE_SLICE,
    ) -> None:
        self.inline_threshold_bytes = inline_threshold_bytes
        self.lease_timeout = lease_timeout
        # Per-node quotas of lookups waiting and reductions not finished (see
        # Config.directory_max_pending_lookups and Config.directory_max_reductions).
        self.max_pending_lookups = max_pending_lookups
        self.max_reductions = max_reductions
        # Per-node quota of bytes stored inline here (Config.directory_max_inline_bytes), and what
        # each node's inline objects hold now.
        self.max_inline_bytes = max_inline_bytes
        self.place_slice = place_slice
        self._inline_per_node: dict[str, int] = {}
        self._pending_per_node: dict[str, int] = {}
        self.check_invariants = validate
        self.nodes: dict[str, NodeInfo] = {}
        self.objects: dict[bytes, ObjectEntry] = {}
        self.pending: dict[bytes, deque[PendingLookup]] = {}
        # Indexes of ``pending`` so that no event walks every pending lookup: the deadlines (a
        # heap; entries of lookups no longer live are dropped when they reach the top) and the
        # objects a node's request id waits for (for CancelLookup).
        self._lookup_deadlines: list[tuple[float, int, PendingLookup]] = []
        self._lookup_seq = itertools.count()
        # (node, request id) -> {object id: how many lookups}: a peer may reuse a request id.
        self._pending_by_request: dict[tuple[str, int], dict[bytes, int]] = {}
        self.transfers: dict[int, Transfer] = {}
        self.events: deque[dict[str, Any]] = deque()
        self._event_sizes: deque[int] = deque()  # estimated bytes of each event in ``events``
        self.event_log_bytes = event_log_bytes
        self._event_bytes_total = 0
        self._seq = itertools.count()
        self._transfer_ids = itertools.count(1)
        self._out: list[Instruction] = []
        self.reductions: dict[bytes, Reduction] = {}
        self.awaiting: dict[bytes, set[bytes]] = {}  # input ObjectID -> reductions waiting for it
        self.link = LinkEstimate()
        # After a node rejoins (this directory restarted), until when copies are still being
        # restored: a resumed lookup of an object not known yet waits instead of failing as lost.
        self.recovering_until: float | None = None

    # ------------------------------------------------------------ entry point
    def handle(self, event: Event) -> list[Instruction]:
        """Apply one event and return the instructions it produced.

        An exception inside a handler (a bug, or input the decoder let through) costs that one
        event, never the directory: it is logged (and recorded as a ``handler_failed`` event), the
        instructions produced before it still go out, and a request gets an ``ErrorReply``.
        """
        self._out = []
        try:
            self._dispatch(event)
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            log.exception("the directory failed to handle %s", type(event).__name__)
            self._log(event.now, "handler_failed", event=type(event).__name__, error=text[:500])
            if isinstance(event, Request):
                request_id = getattr(event.message, "request_id", None)
                if isinstance(request_id, int):
                    what = f"the directory failed to handle this {event.message.TYPE} request: {text[:500]}"
                    reply = p.ErrorReply(request_id=request_id, kind="HopliteError", message=what)
                    self._send(event.node_id, reply)
        out, self._out = self._out, []
        if self.check_invariants:
            self.validate()
        return out

    def _dispatch(self, event: Event) -> None:
        if isinstance(event, Request):
            self._on_request(event)
        elif isinstance(event, NodeJoined):
            self.nodes[event.node_id] = NodeInfo(
                event.node_id,
                event.data_host,
                event.data_port,
                event.now,
                event.host_key,
                event.now,
                gpu=event.gpu,
                gpus=event.gpus,
            )
            self._log(event.now, "node_joined", node=event.node_id, rejoin=event.rejoin, gpu=event.gpu)
            if event.rejoin and self.recovering_until is None:
                self.recovering_until = event.now + self.lease_timeout
                self._log(event.now, "directory_recovering", until=self.recovering_until)
        elif isinstance(event, NodeLeft):
            self._on_node_left(event.node_id, event.now, "left")
        elif isinstance(event, Tick):
            if event.lag > self.lease_timeout / 4:
                for info in self.nodes.values():  # we were stalled, not they: renew every lease
                    info.last_seen = max(info.last_seen, event.now)
                self._log(event.now, "directory_stalled", lag=round(event.lag, 3))
            self._expire(event.now)
        elif isinstance(event, AuthFailed):
            self._log(event.now, "auth_failed", peer=event.peer)
        elif isinstance(event, ContinueReduce):
            red = self.reductions.get(event.reduction_id)
            if red is not None:
                self._place_backlog(red, event.now)
        else:  # pragma: no cover - exhaustive over Event
            raise TypeError(f"unknown event {event!r}")

    def next_deadline(self) -> float | None:
        """Earliest deadline or lease expiry, so the host knows when to send a :class:`Tick`."""
        heap = self._lookup_deadlines
        while heap and not heap[0][2].live:
            heapq.heappop(heap)
        deadlines = [heap[0][0]] if heap else []
        if self.nodes and math.isfinite(self.lease_timeout):
            deadlines.append(min(info.last_seen for info in self.nodes.values()) + self.lease_timeout)
        if self.recovering_until is not None and math.isfinite(self.recovering_until):
            deadlines.append(self.recovering_until)
        for red in self.reductions.values():
            if red.deadline is not None and red.active and not red.plan.full:
                deadlines.append(red.deadline)
            deadlines.extend(q.deadline for q in red.queries if q.deadline is not None)
        return min(deadlines) if deadlines else None

    # ------------------------------------------------------------ requests
    def _on_request(self, ev: Request) -> None:
        msg = ev.message
        info = self.nodes.get(ev.node_id)
        if info is None:
            return  # not authenticated/joined, or declared dead: nothing it sends is acted on
        info.last_seen = max(info.last_seen, ev.now)
        if isinstance(msg, p.Heartbeat):
            if info.suspect_since is not None and ev.now - info.suspect_since >= SUSPECT_GRACE:
                info.suspect_since = None  # alive after all: it may serve again
                self._log(ev.now, "node_trusted", node=ev.node_id)
                for oid in list(self.pending):
                    self._serve_pending(oid, ev.now)
        elif isinstance(msg, p.PutRequest):
            self._on_put(ev.node_id, msg, ev.now)
        elif isinstance(msg, p.Restore):
            self._on_restore(ev.node_id, msg, ev.now)
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
                failed=msg.failed,
            )
            if msg.failed:
                self._on_serve_failed(ev.node_id, msg.transfer_id, ev.now)
        elif isinstance(msg, p.DeleteRequest):
            self._on_delete(ev.node_id, msg, ev.now)
        elif isinstance(msg, p.ReduceRequest):
            self._on_reduce(ev.node_id, msg, ev.now)
        elif isinstance(msg, p.VertexDone):
            self._on_vertex_done(ev.node_id, msg, ev.now)
        elif isinstance(msg, p.ReducedObjectsRequest):
            self._on_reduced_objects(ev.node_id, msg, ev.now)
        elif isinstance(msg, p.EventLogRequest):
            wanted = (e for e in self.events if e["seq"] >= msg.since)
            events = list(itertools.islice(wanted, p.EVENT_LOG_PAGE))
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
        if oid in self.reductions and oid not in self.objects:
            self._send(
                node_id,
                p.PutReply(
                    request_id=msg.request_id,
                    error=f"object {oid.hex()} is the result of a reduction; use another ObjectID",
                    error_kind="ObjectExistsError",
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
                self._add_complete(entry, node_id, msg.segment, copying=msg.copying)
            self._send(node_id, p.PutReply(request_id=msg.request_id))
            self._log(now, "put", node=node_id, object_id=oid.hex(), size=msg.size, again=True)
            self._serve_pending(oid, now)
            self._object_ready(oid, now)
            return
        if msg.inline is not None and not self._inline_fits(node_id, msg.size):
            text = (
                f"the objects this node stored inline in the directory hold {self._inline_per_node[node_id]} "
                f"bytes, and {msg.size} more pass its quota of {self.max_inline_bytes} "
                "(Config.directory_max_inline_bytes); delete some"
            )
            self._log(now, "quota_exceeded", node=node_id, quota="inline_bytes")
            self._send(
                node_id,
                p.PutReply(request_id=msg.request_id, error=text, error_kind="QuotaExceededError"),
            )
            return
        entry = ObjectEntry(
            object_id=oid,
            size=msg.size,
            dtype=msg.dtype,
            shape=list(msg.shape),
            digest=msg.digest,
            owner=node_id,
            inline=msg.inline,
            memory=msg.memory,
        )
        if msg.inline is None:
            self._add_complete(entry, node_id, msg.segment, copying=msg.copying)
        else:
            self._charge_inline(entry, node_id)
        self.objects[oid] = entry
        self._send(node_id, p.PutReply(request_id=msg.request_id))
        self._log(now, "put", node=node_id, object_id=oid.hex(), size=msg.size, inline=msg.inline is not None)
        self._serve_pending(oid, now)
        self._object_ready(oid, now)

    def _inline_fits(self, node_id: str, size: int) -> bool:
        """Whether ``size`` more inline bytes stay within ``node_id``'s quota."""
        return self._inline_per_node.get(node_id, 0) + size <= self.max_inline_bytes

    def _charge_inline(self, entry: ObjectEntry, node_id: str) -> None:
        entry.charged = node_id
        if entry.size:  # (the per-node counts hold no zeros)
            self._inline_per_node[node_id] = self._inline_per_node.get(node_id, 0) + entry.size

    def _add_complete(self, entry: ObjectEntry, node_id: str, segment: str, copying: bool = False) -> None:
        loc = entry.locations.get(node_id)
        if loc is None:
            loc = Location(node_id, LocationState.COMPLETE, entry.size)
            entry.locations[node_id] = loc
        loc.state = LocationState.COMPLETE
        loc.progress = entry.size
        loc.upstream = None
        loc.segment = segment
        loc.producing = False
        loc.copying = copying and bool(segment)

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
        self._object_ready(msg.object_id, now)

    def _on_restore(self, node_id: str, msg: p.Restore, now: float) -> None:
        """A rejoining node's complete copy (this directory restarted and lost its records)."""
        oid = msg.object_id
        if len(oid) != 20 or msg.size < 0:
            return
        inline = msg.inline if msg.inline is not None and len(msg.inline) == msg.size else None
        too_big = msg.size > self.inline_threshold_bytes or not self._inline_fits(node_id, msg.size)
        if inline is not None and too_big:
            inline = None  # over the threshold or the quota: the node's own copy is registered
        entry = self.objects.get(oid)
        if entry is None:
            entry = ObjectEntry(
                oid,
                msg.size,
                msg.dtype,
                list(msg.shape),
                msg.digest,
                node_id if msg.owner else "",
                inline,
                memory=msg.memory,
            )
            if inline is not None:
                self._charge_inline(entry, node_id)
            self.objects[oid] = entry
        elif (entry.size, entry.dtype, list(entry.shape)) != (msg.size, msg.dtype, list(msg.shape)) or (
            entry.digest and msg.digest and entry.digest != msg.digest
        ):
            # Size, dtype and shape always; the content when both sides know its digest (a
            # reduction's result has none).
            self._log(now, "restore_conflict", node=node_id, object_id=oid.hex())
            return
        else:
            entry.digest = entry.digest or msg.digest
            if msg.owner and entry.owner != node_id:
                if entry.owner and entry.owner in self.nodes:
                    # Another joined node owns it: a Restore does not take it over (only the node
                    # that put an object may delete it for everyone).
                    self._log(
                        now, "restore_owner_refused", node=node_id, object_id=oid.hex(), owner=entry.owner
                    )
                else:
                    entry.owner = node_id
        if entry.inline is None:
            self._add_complete(entry, node_id, msg.segment)
        self._log(now, "restore", node=node_id, object_id=oid.hex(), owner=msg.owner)
        red = self.reductions.get(oid)
        if red is not None and red.active:
            # The result was complete before the restart; the re-sent request's tree is not needed.
            red.restored = True
            self._finish(red, now)  # which also marks the result final (not void on a restart)
        self._serve_pending(oid, now)
        self._object_ready(oid, now)

    def _on_lookup(self, node_id: str, msg: p.LookupRequest, now: float) -> None:
        red = self.reductions.get(msg.object_id)
        if red is not None and red.error is not None:
            self._send(node_id, self._failed_lookup(msg.request_id, msg.object_id, red.error))
            return
        if (
            (msg.have_bytes > 0 or msg.resume)
            and msg.object_id not in self.objects
            and (red is None or not red.active)
            and self.recovering_until is None
        ):
            # It was receiving an object that has since been lost (or deleted): it cannot complete.
            # (While copies are being restored, it waits: its source may not have rejoined yet.)
            # A receiver whose sender died before any byte arrived asks with have_bytes 0 and
            # ``resume``: its empty copy was no location to drop (tests/test_soak.py found it).
            self._send(node_id, self._lost_lookup(msg.request_id, msg.object_id))
            return
        if self._pending_per_node.get(node_id, 0) >= self.max_pending_lookups:
            text = f"node has {self.max_pending_lookups} lookups pending, the directory's quota"
            reply = p.LookupReply(
                request_id=msg.request_id,
                status="error",
                object_id=msg.object_id,
                error=text,
                error_kind="QuotaExceededError",
            )
            self._send(node_id, reply)
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
        )
        self.pending.setdefault(msg.object_id, deque()).append(pl)
        by_object = self._pending_by_request.setdefault((node_id, msg.request_id), {})
        by_object[msg.object_id] = by_object.get(msg.object_id, 0) + 1
        self._pending_per_node[node_id] = self._pending_per_node.get(node_id, 0) + 1
        if deadline is not None:
            heapq.heappush(self._lookup_deadlines, (deadline, next(self._lookup_seq), pl))
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
            reduction_id=entry.reduction,
            memory=entry.memory,
        )
        if entry.inline is not None:
            # Recorded as a holder so that the owner's delete drops the reader's copy too.
            entry.locations.setdefault(pl.node_id, Location(pl.node_id, LocationState.COMPLETE, entry.size))
            self._send(pl.node_id, p.LookupReply(status="inline", inline=entry.inline, **meta))
            self._log(now, "lookup_inline", node=pl.node_id, object_id=entry.object_id.hex())
            return True
        own = entry.locations.get(pl.node_id)
        if own is not None and (own.state is LocationState.COMPLETE or own.producing):
            # The requester already holds it (e.g. a re-put), or a reduce vertex placed on it
            # computes it (after the lookup was sent): nothing to transfer.
            self._send(pl.node_id, p.LookupReply(status="local", **meta))
            return True
        shared = self._same_host_copy(entry, pl.node_id, pl.device_ipc) if pl.shared_memory else None
        if shared is not None and shared.copying:
            return False  # its segment is being filled: mapping it then beats pulling it now
        if shared is None and pl.shared_memory and self._computed_on_host(entry, pl.node_id, pl.device_ipc):
            return False  # likewise for a result being computed on this host
        if shared is not None:
            self._send(
                pl.node_id,
                p.LookupReply(status="shm", sender_node=shared.node_id, segment=shared.segment, **meta),
            )
            kind = "lookup_ipc" if shared.segment.startswith(p.IPC_SEGMENT_PREFIX) else "lookup_shm"
            self._log(now, kind, node=pl.node_id, object_id=entry.object_id.hex(), sender=shared.node_id)
            return True
        sender = self._choose_sender(entry, pl.node_id, pl.direct)
        if sender is None:
            return False
        info = self.nodes[sender.node_id]
        transfer = Transfer(next(self._transfer_ids), entry.object_id, sender.node_id, pl.node_id, now)
        self.transfers[transfer.transfer_id] = transfer
        sender.busy = True
        have = min(pl.have_bytes, entry.size)  # a requester claiming more than the object holds
        if own is None:
            own = Location(pl.node_id, LocationState.PARTIAL, have)
            entry.locations[pl.node_id] = own
        own.upstream = sender.node_id
        own.progress = max(own.progress, have)
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
            have=own.progress,
        )
        return True

    def _one_host(self) -> bool:
        """Whether every node shares one host's shared memory (see :meth:`ReducePlan.place`)."""
        keys = {info.host_key for info in self.nodes.values()}
        return len(keys) == 1 and "" not in keys

    @staticmethod
    def _in_segment(entry: ObjectEntry, node_id: str) -> bool:
        """Whether ``node_id``'s copy of ``entry`` lives in a shared-memory segment (a put with
        ``copy=False`` keeps the caller's memory: readers on the host then pull it, and a star's
        root would pull every input through its one connection)."""
        loc = entry.locations.get(node_id)
        return loc is not None and bool(loc.segment)

    def _same_host_copy(self, entry: ObjectEntry, receiver: str, device_ipc: bool = False) -> Location | None:
        """A complete copy in a shared-memory segment on ``receiver``'s host. A device copy's
        ticket (:mod:`hoplite_gpu.ipc`) counts only for a ``device_ipc`` receiver, and the holders
        whose GPU reaches the receiver's best come first (the same GPU, then NVLink, then PCIe on
        its NUMA node: :func:`hoplite_gpu.topology.link_between`, from the GPUs nodes named when
        they joined). Then the owner's copy, and one still being copied into its segment (see
        :attr:`Location.copying`) only if no other."""
        reader = self.nodes[receiver]
        if not reader.host_key:
            return None
        found: list[Location] = []
        for loc in entry.locations.values():
            info = self.nodes.get(loc.node_id)
            if (
                loc.state is LocationState.COMPLETE
                and loc.segment
                and (device_ipc or not loc.segment.startswith(p.IPC_SEGMENT_PREFIX))
                and loc.node_id != receiver
                and info is not None
                and info.host_key == reader.host_key
                and info.suspect_since is None
            ):
                found.append(loc)

        def rank(loc: Location) -> tuple[int, bool, bool]:
            holder = self.nodes[loc.node_id]
            link = LinkKind.SAME_HOST
            if loc.segment.startswith(p.IPC_SEGMENT_PREFIX) and holder.gpus and reader.gpus:
                link = link_between(holder.gpus, holder.gpu, reader.gpus, reader.gpu)
            return link, loc.copying, loc.node_id != entry.owner

        return min(found, key=rank, default=None)  # the first of equals: in the order copies came

    def _computed_on_host(self, entry: ObjectEntry, receiver: str, device_ipc: bool) -> bool:
        """Whether a reduce vertex on ``receiver``'s host (not ``receiver``) computes ``entry``, and
        ``receiver`` is to copy it on the host once it is complete instead of pulling it through
        the loopback while it is computed. So it is for:

        - a reduction's result (the root's output): on one host the pull's copy competes with the
          reduction for the same cores (``bench/asgd.py --local`` summed four 100 MB gradients in
          0.58 s streamed, 0.30 s waiting and mapping). A vertex's host-memory output is still
          streamed to its parent vertex.
        - any vertex's output in device memory, for a receiver that opens device memory on this
          host (``device_ipc``): a pull stages it through host memory and the loopback at a few
          GB/s (``bench/gpu.py`` wire part: 2-3 GB/s on an H100), where the vertex computes it at
          the device's memory bandwidth and the reader then copies it device to device."""
        key = self.nodes[receiver].host_key
        device = device_ipc and entry.memory == "device"
        if not key or (entry.object_id != entry.reduction and not device):
            return False
        for loc in entry.locations.values():
            info = self.nodes.get(loc.node_id)
            if loc.producing and loc.node_id != receiver and info is not None and info.host_key == key:
                return info.suspect_since is None
        return False

    def _choose_sender(self, entry: ObjectEntry, receiver: str, direct: bool = False) -> Location | None:
        """Idle complete copy first, else the idle partial copy with most bytes; never a cycle.
        ``direct``: the owner's copy (complete, or being computed there), busy or not, while its node
        is alive and not suspect; else as without."""
        owner = entry.locations.get(entry.owner) if direct else None
        if (
            owner is not None
            and owner.node_id != receiver
            and (owner.state is LocationState.COMPLETE or owner.producing)
        ):
            info = self.nodes.get(owner.node_id)
            if info is not None and info.suspect_since is None:
                return owner
        best: Location | None = None
        for loc in entry.locations.values():
            info = self.nodes.get(loc.node_id)
            if loc.busy or loc.node_id == receiver or info is None or info.suspect_since is not None:
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
        suspect = self.nodes.get(transfer.sender)
        if msg.sender_failed and not msg.ok and suspect is not None and suspect.suspect_since is None:
            suspect.suspect_since = now  # it serves nobody until it shows it is alive
            self._log(now, "node_suspect", node=transfer.sender, reporter=node_id, reason=msg.reason)
        own = entry.locations.get(node_id)
        if msg.ok:
            self.link = self.link.with_transfer(entry.size, now - transfer.started)
        if own is not None:
            if msg.ok:
                self._add_complete(entry, node_id, msg.segment)
                self._object_ready(transfer.object_id, now)
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
        self._serve_pending(transfer.object_id, now)

    def _on_serve_failed(self, node_id: str, transfer_id: int, now: float) -> None:
        """The sender gave up on a transfer (its receiver stalled, e.g. a stopped process): it is
        free to serve others now, not only once the receiver reports or is declared dead."""
        transfer = self.transfers.get(transfer_id)
        entry = self.objects.get(transfer.object_id) if transfer is not None else None
        if transfer is None or entry is None or transfer.sender != node_id:
            return
        sender = entry.locations.get(node_id)
        if sender is not None and sender.busy:
            sender.busy = False
            self._serve_pending(transfer.object_id, now)

    def _on_delete(self, node_id: str, msg: p.DeleteRequest, now: float) -> None:
        red = self.reductions.get(msg.object_id)
        if red is not None and red.requester == node_id:
            self._fail_reduction(
                red, "ObjectDeletedError", f"reduction {msg.object_id.hex()} was deleted", now
            )
            del self.reductions[msg.object_id]
            if msg.object_id not in self.objects:  # the result was never placed, or dropped above
                self._send(node_id, p.DeleteReply(request_id=msg.request_id, deleted=True))
                self._log(now, "delete", node=node_id, object_id=msg.object_id.hex())
                return
        entry = self.objects.get(msg.object_id)
        if entry is None:
            self._send(node_id, p.DeleteReply(request_id=msg.request_id, deleted=False))
            return
        if entry.owner != node_id:
            loc = entry.locations.get(node_id)
            if loc is not None and self._sole_copy(entry, loc):
                # E.g. a reduction's result on the node that computed it, owned by the node that
                # asked for it: dropping it would lose it; it goes when its owner deletes it.
                self._send(node_id, p.DeleteReply(request_id=msg.request_id, deleted=False, kept=True))
                self._log(now, "delete_kept", node=node_id, object_id=msg.object_id.hex())
                return
            # Even while it serves a transfer: that transfer goes on from the array it holds, but
            # nobody may be sent to (or told to use) the dropped copy any more.
            entry.locations.pop(node_id, None)
            self._send(node_id, p.DeleteReply(request_id=msg.request_id, deleted=False))
            self._log(now, "delete_local", node=node_id, object_id=msg.object_id.hex())
            return
        self._remove_object(msg.object_id, now, skip=node_id)
        self._send(node_id, p.DeleteReply(request_id=msg.request_id, deleted=True))
        self._log(now, "delete", node=node_id, object_id=msg.object_id.hex())

    def _sole_copy(self, entry: ObjectEntry, loc: Location) -> bool:
        """Whether ``loc`` is the only complete copy of a non-inline object (or the node producing
        it), so dropping it would lose the object."""
        if entry.inline is not None:
            return False
        if loc.state is LocationState.PARTIAL and not loc.producing:
            return False  # a copy still being received from elsewhere
        return not any(
            other.state is LocationState.COMPLETE
            and other.node_id != loc.node_id
            and other.node_id in self.nodes
            for other in entry.locations.values()
        )

    def _remove_object(self, oid: bytes, now: float, skip: str = "", reason: str = "deleted") -> None:
        """Forget an object everywhere: its transfers end and its holders (but ``skip``) drop it,
        told ``reason`` (see :class:`~hoplite_gpu.protocol.DropObject`)."""
        entry = self.objects.pop(oid, None)
        if entry is None:
            return
        if entry.inline is not None and entry.charged and entry.size:
            left = self._inline_per_node[entry.charged] - entry.size
            if left:
                self._inline_per_node[entry.charged] = left
            else:
                del self._inline_per_node[entry.charged]
        for tid in [t for t, tr in self.transfers.items() if tr.object_id == oid]:
            del self.transfers[tid]
        for holder in entry.locations:
            if holder != skip and holder in self.nodes:
                self._send(holder, p.DropObject(object_id=oid, reason=reason))

    # ------------------------------------------------------------ reductions
    def _on_reduce(self, node_id: str, msg: p.ReduceRequest, now: float) -> None:
        rid, inputs = msg.reduction_id, tuple(msg.object_ids)

        def refuse(kind: str, text: str, culprit: bytes = b"") -> None:
            self._send(
                node_id,
                p.ReduceReply(
                    request_id=msg.request_id, error=text, error_kind=kind, error_object_id=culprit
                ),
            )

        if len(rid) != 20 or not inputs or any(len(o) != 20 for o in inputs) or rid in inputs:
            refuse(
                "InvalidArgumentError", "a reduction needs 20-byte ObjectIDs and an id not among its inputs"
            )
            return
        as_arrive = msg.num_objects == 0 and bool(msg.coding)
        try:
            op = as_op(msg.op).value
            plan = ReducePlan(rid, inputs, len(inputs) if as_arrive else msg.num_objects, fan_in=msg.degree)
        except (InvalidArgumentError, ValueError) as exc:
            refuse("InvalidArgumentError", str(exc))
            return
        if (msg.weights or msg.coding) and op != "sum":
            refuse("InvalidArgumentError", f"weights need the SUM op, not {op.upper()}")
            return
        weights = dict(zip(inputs, msg.weights, strict=True)) if msg.weights else {}
        coding = dict(zip(inputs, msg.coding, strict=True)) if msg.coding else {}
        existing = self.reductions.get(rid)
        if existing is None:  # (bounded: the directory keeps at most REDUCTIONS_KEPT of them)
            active = sum(1 for red in self.reductions.values() if red.requester == node_id and red.active)
            if active >= self.max_reductions:
                text = f"node has {self.max_reductions} reductions not finished, the directory's quota"
                refuse("QuotaExceededError", text)
                return
        if existing is not None:
            old = existing.plan
            asked = (existing.candidates, 0) if existing.candidates else (old.inputs, old.num_objects)
            if (*asked, existing.op, existing.coding) == (
                inputs,
                msg.num_objects,
                op,
                coding,
            ) and (coding or existing.weights == weights):
                self._send(node_id, p.ReduceReply(request_id=msg.request_id))  # every rank may ask
            else:
                refuse("ObjectExistsError", f"reduction {rid.hex()} already exists with other inputs or op")
            return
        if rid in self.objects and msg.rejoin:
            # Re-sent to this restarted directory, and a node restored the finished result.
            red = Reduction(plan, op, node_id, None, msg.timeout, done=True, restored=True)
            red.candidates = inputs if as_arrive else ()
            self.reductions[rid] = red
            self.objects[rid].reduction = b""
            self._send(node_id, p.ReduceReply(request_id=msg.request_id))
            self._log(now, "reduce_restored", node=node_id, object_id=rid.hex())
            return
        if rid in self.objects:
            refuse("ObjectExistsError", f"object {rid.hex()} already exists; use another reduction id")
            return
        objects = self.objects
        present = [objects[o] for o in inputs if o in objects]
        if present:  # refuse what is already known to be wrong: nothing gets reduced
            first = present[0]
            for entry in present:
                same_kind = (entry.size, entry.dtype, entry.shape) == (first.size, first.dtype, first.shape)
                if entry is not first and same_kind:
                    continue  # the first had the full check
                problem = self._input_problem(plan, entry, first, bool(weights or coding))
                if problem is not None:
                    refuse(problem[0], problem[1], entry.object_id)
                    return
        red = Reduction(plan, op, node_id, now + msg.timeout if msg.timeout > 0 else None, msg.timeout)
        red.weights = weights
        red.coding = coding
        if as_arrive:
            red.candidates = inputs
            red.gather = self._tracker(red)
        self.reductions[rid] = red
        self._forget_old_reductions()
        self._send(node_id, p.ReduceReply(request_id=msg.request_id))
        self._log(
            now, "reduce", node=node_id, object_id=rid.hex(), inputs=len(inputs), k=msg.num_objects, op=op
        )
        awaiting = self.awaiting
        for oid in inputs:
            waiting = awaiting.get(oid)
            if waiting is None:
                awaiting[oid] = {rid}
            else:
                waiting.add(rid)
        # The requester's own inputs first: one of them computes the root (see _offer), whatever
        # the others' position in the list.
        mine = [entry.object_id for entry in present if self._computes_at(entry, node_id)]
        red.backlog.extend(mine)
        if mine:
            chosen = set(mine)
            red.backlog.extend(entry.object_id for entry in present if entry.object_id not in chosen)
        else:
            red.backlog.extend(entry.object_id for entry in present)
        if len(red.backlog) > self.place_slice:
            self._out.append(Resume(rid))  # this event did the O(inputs) part; placing comes next
        else:
            self._place_backlog(red, now)

    def _place_backlog(self, red: Reduction, now: float) -> None:
        """Offer up to ``place_slice`` of the inputs that were present when ``red`` was
        requested; ask the host to come back (:class:`Resume`) for the rest. Inputs that arrive
        meanwhile are offered as they arrive (they still wait in ``awaiting``), and an input of
        the backlog placed some other way, deleted or no longer wanted is skipped by ``_offer``."""
        for _ in range(min(self.place_slice, len(red.backlog))):
            self._offer(red, red.backlog.popleft(), now)
        if not red.active:
            red.backlog.clear()
        elif red.backlog:
            self._out.append(Resume(red.plan.reduction_id))

    @staticmethod
    def _input_problem(
        plan: ReducePlan, entry: ObjectEntry, first: ObjectEntry, weighted: bool = False
    ) -> tuple[str, str] | None:
        """Why ``entry`` cannot be reduced together with ``first`` (or with what ``plan`` placed),
        in a weighted reduction if ``weighted``."""
        try:
            dtype = dtype_from_wire(entry.dtype)
            check_dtype(dtype)
        except (InvalidArgumentError, TypeError) as exc:
            return "InvalidArgumentError", f"input {entry.object_id.hex()}: {exc}"
        if weighted and dtype.kind != "f" and dtype.name != "bfloat16":
            return "InvalidArgumentError", (
                f"input {entry.object_id.hex()} is {dtype.name}: a weighted reduction needs floats"
            )
        ref = (
            (plan.size, plan.dtype, plan.shape)
            if plan.size >= 0
            else (first.size, first.dtype, tuple(first.shape))
        )
        if (entry.size, entry.dtype, tuple(entry.shape)) != ref:
            return "ReduceMismatchError", (
                f"input {entry.object_id.hex()} has dtype {entry.dtype} and shape {list(entry.shape)}, but "
                f"reduction {plan.reduction_id.hex()}'s inputs have dtype {ref[1]} and shape {list(ref[2])}; "
                "nothing was reduced"
            )
        return None

    def _object_ready(self, oid: bytes, now: float) -> None:
        """``oid`` has a copy a reduction can use: offer it to the reductions waiting for it."""
        for rid in list(self.awaiting.get(oid, ())):
            red = self.reductions.get(rid)
            if red is not None:
                self._offer(red, oid, now)

    def _computes_at(self, entry: ObjectEntry, node_id: str) -> bool:
        """Whether ``_input_holder(entry) == node_id``, without sorting the copies in the common
        cases (a reduce over 10,000 inputs asks this of each)."""
        loc = entry.locations.get(node_id)
        if loc is None or entry.inline is not None or node_id not in self.nodes:
            return False
        if entry.owner == node_id and loc.state is LocationState.COMPLETE:
            return True  # a complete copy at the owner comes first
        return self._input_holder(entry) == node_id

    def _input_holder(self, entry: ObjectEntry) -> str | None:
        """The node to compute at for an input: its owner, else another complete copy, else the
        node producing it (a reduction's result); "" for an inline object; None for none yet."""
        if entry.inline is not None:
            return ""
        usable = [
            loc
            for loc in entry.locations.values()
            if loc.node_id in self.nodes and (loc.state is LocationState.COMPLETE or loc.producing)
        ]
        usable.sort(
            key=lambda loc: (loc.state is LocationState.COMPLETE, loc.node_id == entry.owner), reverse=True
        )
        return usable[0].node_id if usable else None

    def _offer(self, red: Reduction, oid: bytes, now: float) -> None:
        plan = red.plan
        entry = self.objects.get(oid)
        if not red.active or entry is None or not plan.wants(oid):
            return
        holder = self._input_holder(entry)
        if holder is None:
            return
        problem = self._input_problem(plan, entry, entry, bool(red.weights or red.coding))
        if problem is None and plan.placed and (entry.inline is not None) != bool(red.inline):
            problem = "ReduceMismatchError", f"input {oid.hex()} is stored differently from the others"
        if problem is not None:
            self._fail_reduction(red, problem[0], problem[1], now, culprit=oid)
            return
        if red.memory is None:
            red.memory = entry.memory
        if red.gather is not None:
            self._gather(red, entry, now)
            return
        try:
            # The requester reads the result: its own input, if it has one, computes the root.
            at_root = holder == red.requester
            pl = plan.place(
                oid,
                holder,
                entry.size,
                entry.dtype,
                tuple(entry.shape),
                self.link,
                at_root=at_root,
                # Only the first placement fixes the shape: the scan of every node is done once.
                one_host=plan.tree is None and self._in_segment(entry, holder) and self._one_host(),
            )
        except MismatchError as exc:  # pragma: no cover - _input_problem checked the same
            self._fail_reduction(red, "ReduceMismatchError", str(exc), now, culprit=oid)
            return
        self._unawait(oid, plan.reduction_id)
        if len(plan.placed) == 1:
            self._log(
                now, "reduce_tree", object_id=plan.reduction_id.hex(), degree=plan.degree, reason=plan.reason
            )
        self._log(
            now,
            "reduce_place",
            object_id=plan.reduction_id.hex(),
            input=oid.hex(),
            vertex=pl.vertex,
            node=holder,
        )
        if entry.inline is not None:
            red.inline.append(entry.inline)
            red.inline_ids.append(oid)
        else:
            self._start_vertex(red, pl, now)
        if plan.full:
            for other in plan.inputs:
                self._unawait(other, plan.reduction_id)
            if red.coding and not red.weights and not self._choose_weights(red, now):
                return
            if red.inline:
                self._reduce_inline(red, now)

    def _gather(self, red: Reduction, entry: ObjectEntry, now: float) -> None:
        """An input of a reduction that decodes as inputs arrive is ready: add its row, and once
        the rows that arrived decode, place the inputs the decoding uses (all present) as the
        tree, with their weights known from the start."""
        plan, tracker, oid = red.plan, red.gather, entry.object_id
        assert tracker is not None
        if plan.size < 0:  # later inputs are checked against the first (see _input_problem)
            plan.size, plan.dtype, plan.shape = entry.size, entry.dtype, tuple(entry.shape)
        before = tracker.seen
        decodable = tracker.add(oid, red.coding[oid])
        if tracker.seen == before:
            return  # offered again (another copy completed): counted already
        self._log(
            now, "reduce_arrival", object_id=plan.reduction_id.hex(), input=oid.hex(), decodable=decodable
        )
        if not decodable:
            if tracker.seen >= len(red.candidates):
                self._fail_reduction(
                    red,
                    "NotDecodableError",
                    f"all {len(red.candidates)} inputs of reduction {plan.reduction_id.hex()} arrived and "
                    f"their encoding rows do not combine into all ones (they span {len(tracker.keys)} of "
                    f"{tracker.width} dimensions)",
                    now,
                )
            return
        used, weights = tracker.solution()
        chosen = set(used)
        for other in red.candidates:  # the chosen stay awaited until _offer places them below
            if other not in chosen:
                self._unawait(other, plan.reduction_id)
        red.gather = None
        red.plan = ReducePlan(plan.reduction_id, tuple(used), len(used), epoch=plan.epoch, fan_in=plan.fan_in)
        red.weights = dict(zip(used, weights, strict=True))
        self._log(
            now,
            "reduce_decodable",
            object_id=plan.reduction_id.hex(),
            arrived=tracker.seen,
            used=len(used),
            epoch=plan.epoch,
        )
        for oid in used:
            self._offer(red, oid, now)

    def _start_vertex(self, red: Reduction, pl: Placement, now: float) -> None:
        """Give the vertex's node its task (registering the output it will produce) and tell an
        already placed parent where this vertex's output is."""
        plan = red.plan
        if pl.runs_task:
            root = pl.parent is None
            self.objects[pl.output_id] = ObjectEntry(
                object_id=pl.output_id,
                size=plan.size,
                dtype=plan.dtype,
                shape=list(plan.shape),
                digest=b"",
                owner=red.requester if root else pl.node_id,
                inline=None,
                memory=red.memory or "",
                locations={pl.node_id: Location(pl.node_id, LocationState.PARTIAL, 0, producing=True)},
                reduction=plan.reduction_id,
            )
            self._send(
                pl.node_id,
                p.ReduceTask(
                    reduction_id=plan.reduction_id,
                    vertex=pl.vertex,
                    input_id=pl.object_id,
                    output_id=pl.output_id,
                    children=plan.child_sources(pl.vertex),
                    op=red.op,
                    count=plan.num_objects if root else 0,
                    size=plan.size,
                    dtype=plan.dtype,
                    shape=list(plan.shape),
                    epoch=plan.epoch,
                    weights=self._vertex_weights(red, pl),
                    await_weights=bool(red.coding) and not red.weights,
                    memory=red.memory or "",
                ),
            )
            self._serve_pending(pl.output_id, now)
            self._object_ready(pl.output_id, now)
        parent = plan.by_vertex.get(pl.parent) if pl.parent is not None else None
        if parent is not None:
            self._send(
                parent.node_id,
                p.ReduceChild(
                    reduction_id=plan.reduction_id,
                    vertex=parent.vertex,
                    index=parent.children.index(pl.vertex),
                    object_id=pl.output_id,
                    epoch=plan.epoch,
                    weight=self._stream_weight(red, pl),
                ),
            )

    @staticmethod
    def _stream_weight(red: Reduction, pl: Placement) -> float:
        """The weight a parent applies to what ``pl`` streams: an input's own weight for a leaf,
        1 for a vertex's output (weighted already)."""
        return 1.0 if pl.runs_task else red.weights.get(pl.object_id, 1.0)

    def _choose_weights(self, red: Reduction, now: float) -> bool:
        """A decoded reduction just chose its inputs: the weights whose sum of their encoding
        rows is all ones (least-norm, as :meth:`GradientCode.decoding_weights
        <hoplite_gpu.coding.GradientCode.decoding_weights>` computes them), sent to every vertex
        waiting for them. False (and the reduction failed) if the chosen inputs do not decode."""
        plan = red.plan
        chosen = [pl.object_id for pl in plan.placed]
        weights, residual = solve_decoding(np.array([red.coding[oid] for oid in chosen], dtype=np.float64))
        if residual > DECODE_TOLERANCE:
            self._fail_reduction(
                red,
                "NotDecodableError",
                f"the first {len(chosen)} inputs of reduction {plan.reduction_id.hex()} to arrive do "
                f"not decode (their encoding rows do not combine into all ones; residual {residual:.2e})",
                now,
            )
            return False
        red.weights = {oid: float(w) for oid, w in zip(chosen, weights, strict=True)}
        self._log(now, "reduce_weights", object_id=plan.reduction_id.hex(), epoch=plan.epoch)
        for pl in plan.placed:
            if pl.runs_task:
                self._send(
                    pl.node_id,
                    p.ReduceWeights(
                        reduction_id=plan.reduction_id,
                        vertex=pl.vertex,
                        epoch=plan.epoch,
                        weights=self._vertex_weights(red, pl),
                    ),
                )
        return True

    def _vertex_weights(self, red: Reduction, pl: Placement) -> list[float]:
        """:attr:`~hoplite_gpu.protocol.ReduceTask.weights` of vertex ``pl`` ([] unweighted)."""
        if not red.weights:
            return []
        weights = [red.weights.get(pl.object_id, 1.0)]
        for child in pl.children:
            placed = red.plan.by_vertex.get(child)
            weights.append(self._stream_weight(red, placed) if placed is not None else 1.0)
        return weights

    def _reduce_inline(self, red: Reduction, now: float) -> None:
        """All inputs are inline: reduce them here and store the result inline."""
        plan = red.plan
        dtype = dtype_from_wire(plan.dtype)
        arrays = [np.frombuffer(b, dtype) for b in red.inline]
        out = np.empty_like(arrays[0])
        if red.weights:
            scales = [red.weights.get(oid, 1.0) for oid in red.inline_ids]
            weighted_sum_chunk(arrays[0], arrays[1:], out, scales)
        else:
            reduce_chunk(as_op(red.op), arrays[0], arrays[1:], out, plan.num_objects)
        rid = plan.reduction_id
        self.objects[rid] = ObjectEntry(
            rid,
            plan.size,
            plan.dtype,
            list(plan.shape),
            b"",
            red.requester,
            out.tobytes(),
            memory=red.memory or "",
        )
        red.done = True
        red.inline = []
        red.inline_ids = []
        self._answer_queries(red)
        self._log(now, "reduce_done", object_id=rid.hex(), inline=True)
        self._serve_pending(rid, now)
        self._object_ready(rid, now)

    def _on_vertex_done(self, node_id: str, msg: p.VertexDone, now: float) -> None:
        red = self.reductions.get(msg.reduction_id)
        pl = red.plan.by_vertex.get(msg.vertex) if red is not None else None
        if (
            red is None
            or pl is None
            or pl.node_id != node_id
            or not red.active
            or msg.epoch != red.plan.epoch
        ):
            return  # unknown, finished, or a vertex of a tree rebuilt since
        if not msg.ok and msg.retry:
            # A source died or was reset under it: rebuild (the dead node's own report may follow).
            self._repair(red, now, f"vertex {msg.vertex} on node {node_id[:8]} lost a source: {msg.reason}")
            return
        if not msg.ok:
            self._fail_reduction(
                red,
                "ReductionFailedError",
                f"vertex {msg.vertex} of reduction {msg.reduction_id.hex()} on node {node_id[:8]} "
                f"failed: {msg.reason}",
                now,
            )
            return
        entry = self.objects.get(pl.output_id)
        if entry is not None:
            self._add_complete(entry, node_id, msg.segment)
        self._log(now, "vertex_done", object_id=msg.reduction_id.hex(), vertex=msg.vertex, node=node_id)
        if pl.parent is None:
            self._finish(red, now)
        self._serve_pending(pl.output_id, now)
        self._object_ready(pl.output_id, now)

    def _fail_reduction(
        self, red: Reduction, kind: str, message: str, now: float, culprit: bytes = b""
    ) -> None:
        """Abandon a reduction: its tasks are dropped (which cancels them), waiters get the error."""
        if not red.active:
            return
        plan = red.plan
        red.error = (kind, message, culprit)
        red.inline = []
        red.inline_ids = []
        self._log(now, "reduce_failed", object_id=plan.reduction_id.hex(), error_kind=kind, reason=message)
        for oid in plan.inputs:
            self._unawait(oid, plan.reduction_id)
        for pl in plan.placed:
            if pl.runs_task:
                self._remove_object(pl.output_id, now)

        def fail(pl: PendingLookup) -> bool:
            assert red.error is not None
            self._send(pl.node_id, self._failed_lookup(pl.request_id, plan.reduction_id, red.error))
            return False

        self._retain_pending(plan.reduction_id, fail)
        self._answer_queries(red)

    @staticmethod
    def _failed_lookup(request_id: int, oid: bytes, error: tuple[str, str, bytes]) -> p.LookupReply:
        kind, message, culprit = error
        return p.LookupReply(
            request_id=request_id,
            status="error",
            object_id=oid,
            error=message,
            error_kind=kind,
            error_object_id=culprit,
        )

    def _on_reduced_objects(self, node_id: str, msg: p.ReducedObjectsRequest, now: float) -> None:
        red = self.reductions.get(msg.reduction_id)
        if red is None:
            self._send(
                node_id,
                p.ReducedObjectsReply(
                    request_id=msg.request_id,
                    error=f"no reduction {msg.reduction_id.hex()} is known (never requested, or deleted)",
                    error_kind="ObjectNotFoundError",
                ),
            )
        elif red.error is not None or red.done:
            self._send(node_id, self._reduced_reply(msg.request_id, red))
        else:
            deadline = now + msg.timeout if msg.timeout > 0 else None
            red.queries.append(PendingQuery(node_id, msg.request_id, deadline))

    @staticmethod
    def _reduced_reply(request_id: int, red: Reduction) -> p.ReducedObjectsReply:
        """The answer to a ``reduced_objects`` query of a failed or finished reduction."""
        if red.error is not None:
            kind, message, culprit = red.error
            return p.ReducedObjectsReply(
                request_id=request_id, error=message, error_kind=kind, error_object_id=culprit
            )
        plan = red.plan
        if red.restored and (red.candidates or plan.num_objects < len(plan.inputs)):
            return p.ReducedObjectsReply(
                request_id=request_id,
                error=(
                    f"reduction {plan.reduction_id.hex()} finished before the directory restarted; "
                    f"which of its {len(red.candidates or plan.inputs)} inputs it reduced is not known"
                ),
                error_kind="ObjectNotFoundError",
            )
        if red.restored:
            return p.ReducedObjectsReply(request_id=request_id, object_ids=list(plan.inputs))
        return p.ReducedObjectsReply(request_id=request_id, object_ids=plan.reduced_objects())

    def _answer_queries(self, red: Reduction) -> None:
        """Answer every waiting ``reduced_objects`` query (the reduction failed or finished)."""
        for q in red.queries:
            self._send(q.node_id, self._reduced_reply(q.request_id, red))
        red.queries.clear()

    def _unawait(self, oid: bytes, rid: bytes) -> None:
        waiting = self.awaiting.get(oid)
        if waiting is not None:
            waiting.discard(rid)
            if not waiting:
                del self.awaiting[oid]

    def _forget_old_reductions(self) -> None:
        """Keep at most :data:`REDUCTIONS_KEPT` finished or failed reductions (oldest go first)."""
        excess = len(self.reductions) - REDUCTIONS_KEPT
        if excess <= 0:
            return
        for rid in [rid for rid, red in self.reductions.items() if not red.active][:excess]:
            del self.reductions[rid]

    def _finish(self, red: Reduction, now: float) -> None:
        """The root's output is complete: the reduction is done."""
        red.done = True
        for oid in red.plan.inputs:  # finished early (restored, or just before a repair)
            self._unawait(oid, red.plan.reduction_id)
        for inner in red.plan.intermediates():  # their parents hold everything they need
            self._remove_object(inner.output_id, now)
        result = self.objects.get(red.plan.reduction_id)
        if result is not None:
            result.reduction = b""  # final: a copy of it survives a directory restart
        self._answer_queries(red)
        self._log(now, "reduce_done", object_id=red.plan.reduction_id.hex(), repairs=red.repairs)

    def _repair(self, red: Reduction, now: float, why: str) -> None:
        """Rebuild a reduction's tree after a failure: cancel every vertex of the old tree, reset
        partial copies of the result, and place again (under a new epoch) the inputs that still
        have a live copy, in their arrival order, then the next ready inputs."""
        if not red.active:
            return
        old = red.plan
        rid = old.reduction_id
        result = self.objects.get(rid)
        if result is not None and any(
            loc.state is LocationState.COMPLETE and loc.node_id in self.nodes
            for loc in result.locations.values()
        ):
            # The root finished just before the failure (a reader already holds the whole result).
            self._finish(red, now)
            return
        red.repairs += 1
        if red.repairs > MAX_REPAIRS:
            self._fail_reduction(
                red,
                "ReductionFailedError",
                f"reduction {rid.hex()} failed {MAX_REPAIRS} times; last: {why}",
                now,
            )
            return
        self._log(now, "reduce_repair", object_id=rid.hex(), epoch=old.epoch + 1, reason=why)
        for pl in old.placed:
            if pl.runs_task and pl.parent is not None:
                self._remove_object(pl.output_id, now)  # cancels the vertex computing it
        # The root's node (its vertex is cancelled) and partial readers (they start again).
        self._remove_object(rid, now, reason="reset")
        # Decoded as inputs arrive: count the arrivals again, over every input asked for.
        inputs, count = (
            (red.candidates, len(red.candidates)) if red.candidates else (old.inputs, old.num_objects)
        )
        red.plan = ReducePlan(rid, inputs, count, epoch=old.epoch + 1, fan_in=old.fan_in)
        red.gather = self._tracker(red) if red.candidates else None
        if red.coding:
            red.weights = {}  # the rebuilt tree may choose other inputs: other weights
        red.inline = []
        red.inline_ids = []
        red.deadline = now + red.timeout if red.timeout > 0 else None
        for oid in red.plan.inputs:
            self.awaiting.setdefault(oid, set()).add(rid)
        for oid in [pl.object_id for pl in old.placed] + list(red.plan.inputs):
            if red.active and oid in self.objects:
                self._offer(red, oid, now)

    @staticmethod
    def _tracker(red: Reduction) -> DecodeTracker:
        """A fresh :class:`DecodeTracker` for a reduction that decodes as its inputs arrive."""
        return DecodeTracker(len(next(iter(red.coding.values()))))

    def _regather(self, red: Reduction, now: float) -> None:
        """An input that a reduction decoding as inputs arrive counted on lost its last copy
        before the decoding was complete: count again over the inputs that are still present."""
        self._log(now, "reduce_regather", object_id=red.plan.reduction_id.hex())
        red.gather = self._tracker(red)
        red.plan.size = -1
        for oid in red.candidates:
            if red.active and red.gather is not None and oid in self.objects:
                self._offer(red, oid, now)

    @classmethod
    def _lost_lookup(cls, request_id: int, oid: bytes) -> p.LookupReply:
        message = (
            f"object {oid.hex()} was lost: every complete copy died while it was being received; put it again"
        )
        return cls._failed_lookup(request_id, oid, ("ObjectLostError", message, oid))

    def _lose_object(self, oid: bytes, now: float) -> None:
        """No live complete copy of ``oid`` is left and nobody computes it: partial holders drop
        it and waiting lookups fail. A later put of the same id makes it available again."""
        self._log(now, "object_lost", object_id=oid.hex(), partial_copies=len(self.objects[oid].locations))
        self._remove_object(oid, now, reason="lost")

        def fail(pl: PendingLookup) -> bool:
            self._send(pl.node_id, self._lost_lookup(pl.request_id, oid))
            return False

        self._retain_pending(oid, fail)
        red = self.reductions.get(oid)
        if red is not None and red.done:  # a finished result cannot be put again: fail its readers
            red.error = ("ObjectLostError", f"the result of reduction {oid.hex()} was lost", oid)

    # ------------------------------------------------------------ node and time
    def _on_node_left(self, node_id: str, now: float, reason: str) -> None:
        """A node left or was declared dead: repair every schedule it took part in."""
        if self.nodes.pop(node_id, None) is None:
            return
        self._log(now, "node_left", node=node_id, reason=reason)
        for oid in list(self.pending):
            self._retain_pending(oid, lambda pl: pl.node_id != node_id)
        touched: set[bytes] = set()
        for tid, tr in list(self.transfers.items()):
            if node_id in (tr.sender, tr.receiver):
                del self.transfers[tid]
                entry = self.objects.get(tr.object_id)
                if tr.sender == node_id and tr.receiver in self.nodes:
                    self._send(tr.receiver, p.AbortTransfer(tid, f"sender {node_id[:8]} {reason}"))
                if entry is not None:
                    peer = entry.locations.get(tr.sender if tr.receiver == node_id else tr.receiver)
                    if peer is not None and tr.receiver == node_id:
                        peer.busy = False
                    elif peer is not None and peer.upstream == node_id:
                        peer.upstream = None  # it will ask for another source
                touched.add(tr.object_id)
        for oid, entry in list(self.objects.items()):
            if entry.locations.pop(node_id, None) is not None:
                touched.add(oid)
        for red in list(self.reductions.values()):
            hit = [pl for pl in red.plan.placed if pl.node_id == node_id]
            if hit and red.active:
                self._repair(red, now, f"node {node_id[:8]} holding vertex {hit[0].vertex} {reason}")
            elif (
                red.active
                and red.gather is not None
                and any(
                    oid not in self.objects or self._input_holder(self.objects[oid]) is None
                    for oid in red.gather.keys
                )
            ):
                self._regather(red, now)
        for oid in touched:
            entry = self.objects.get(oid)
            if entry is None or entry.inline is not None:
                continue
            if not any(
                loc.state is LocationState.COMPLETE or loc.producing for loc in entry.locations.values()
            ):
                self._lose_object(oid, now)
            else:
                self._serve_pending(oid, now)

    def _expire(self, now: float) -> None:
        for info in [i for i in self.nodes.values() if now - i.last_seen >= self.lease_timeout]:
            silent = now - info.last_seen
            self._out.append(Disconnect(info.node_id, f"no heartbeat for {silent:.1f} s"))
            self._on_node_left(info.node_id, now, f"missed its lease ({silent:.1f} s silent)")

        def alive(pl: PendingLookup) -> bool:
            if pl.deadline is None or pl.deadline > now:
                return True
            reply = p.LookupReply(
                request_id=pl.request_id,
                status="timeout",
                object_id=pl.object_id,
                error=self._diagnose(pl.object_id, now),
            )
            self._send(pl.node_id, reply)
            self._log(now, "lookup_timeout", node=pl.node_id, object_id=pl.object_id.hex())
            return False

        due = set()  # only the queues of lookups whose deadline passed (the heap knows them)
        heap = self._lookup_deadlines
        while heap and heap[0][0] <= now:
            _, _, pl = heapq.heappop(heap)
            if pl.live:
                due.add(pl.object_id)
        for oid in due:
            self._retain_pending(oid, alive)
        if self.recovering_until is not None and now >= self.recovering_until:
            self._end_recovery(now)
        for red in list(self.reductions.values()):
            if red.active and not red.plan.full and red.deadline is not None and red.deadline <= now:
                plan = red.plan
                if red.gather is not None:
                    text = (
                        f"reduction {plan.reduction_id.hex()}: the {red.gather.seen} of its "
                        f"{len(red.candidates)} inputs that became ready within its timeout do not decode"
                    )
                else:
                    text = (
                        f"reduction {plan.reduction_id.hex()}: only {len(plan.placed)} of "
                        f"{plan.num_objects} inputs became ready within its timeout; {_not_ready(plan)}"
                    )
                self._fail_reduction(red, "HopliteTimeoutError", text, now)
            expired = [q for q in red.queries if q.deadline is not None and q.deadline <= now]
            for q in expired:
                red.queries.remove(q)
                self._send(
                    q.node_id,
                    p.ReducedObjectsReply(
                        request_id=q.request_id,
                        error=f"reduction {red.plan.reduction_id.hex()} did not choose its inputs in time",
                        error_kind="HopliteTimeoutError",
                    ),
                )

    def _diagnose(self, object_id: bytes, now: float) -> str:
        """Why a lookup of ``object_id`` is still waiting, naming the nodes concerned (for the
        error of a get that timed out: which member is missing or slow)."""
        entry = self.objects.get(object_id)
        red = self.reductions.get(object_id)
        if red is not None and red.active and not red.plan.full:
            plan = red.plan
            return (
                f"it is the result of a reduction with {len(plan.placed)} of its {plan.num_objects} "
                f"inputs ready; {_not_ready(plan)}"
            )
        if entry is None:
            if self.recovering_until is not None:
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

    def _end_recovery(self, now: float) -> None:
        """Every live node had time to rejoin and restore its copies: a resumed lookup of an object
        still unknown was for a copy that died with the old directory's records (lost)."""
        self.recovering_until = None
        self._log(now, "directory_recovered", objects=len(self.objects))
        for oid in [o for o in self.pending if o not in self.objects]:
            red = self.reductions.get(oid)
            if red is not None and red.active:
                continue

            def fail(pl: PendingLookup, oid: bytes = oid) -> bool:
                if pl.have_bytes == 0 and not pl.resume:
                    return True  # a get before the put: it waits, as always
                self._send(pl.node_id, self._lost_lookup(pl.request_id, oid))
                return False

            self._retain_pending(oid, fail)

    def _drop_pending(self, node_id: str, request_id: int) -> None:
        for oid in list(self._pending_by_request.get((node_id, request_id), ())):
            self._retain_pending(oid, lambda pl: (pl.node_id, pl.request_id) != (node_id, request_id))

    def _retain_pending(self, oid: bytes, keep: Callable[[PendingLookup], bool]) -> None:
        """Keep, in order, the lookups waiting for ``oid`` for which ``keep`` is true (it may
        answer the others); forget the queue once it is empty."""
        kept: deque[PendingLookup] = deque()
        for pl in self.pending.get(oid, ()):
            if keep(pl):
                kept.append(pl)
                continue
            pl.live = False
            left = self._pending_per_node.get(pl.node_id, 0) - 1
            if left > 0:
                self._pending_per_node[pl.node_id] = left
            else:
                self._pending_per_node.pop(pl.node_id, None)
            key = (pl.node_id, pl.request_id)
            by_object = self._pending_by_request.get(key)
            if by_object is not None and oid in by_object:
                by_object[oid] -= 1
                if by_object[oid] <= 0:
                    del by_object[oid]
                if not by_object:
                    del self._pending_by_request[key]
        if kept:
            self.pending[oid] = kept
        else:
            self.pending.pop(oid, None)

    # ------------------------------------------------------------ invariants
    def problems(self) -> list[str]:
        """Every broken invariant of the state, described (empty when it is consistent).

        What must hold after every event: records are keyed by their own ids; every location,
        transfer, pending lookup and live reduction vertex names a node that is joined; progress
        stays within the object's size; a complete copy has no upstream; no upstream chain is a
        cycle (the scheduling rule of the module docstring); a busy sender serves a recorded
        transfer; ``awaiting`` lists exactly the unplaced inputs of active, unfilled reductions;
        the indexes of pending lookups (per node, per request, by deadline) match the queues.
        """
        out: list[str] = []
        counts: dict[str, int] = {}
        by_request: dict[tuple[str, int], dict[bytes, int]] = {}
        for queue in self.pending.values():
            for pl in queue:
                counts[pl.node_id] = counts.get(pl.node_id, 0) + 1
                by_object = by_request.setdefault((pl.node_id, pl.request_id), {})
                by_object[pl.object_id] = by_object.get(pl.object_id, 0) + 1
                if not pl.live:
                    out.append(f"pending lookup {pl.request_id} of {pl.node_id[:8]} is marked answered")
        if counts != self._pending_per_node:
            out.append(f"pending lookups per node {self._pending_per_node} are really {counts}")
        if by_request != self._pending_by_request:
            out.append("the index of pending lookups by request does not match the queues")
        for nid, info in self.nodes.items():
            if info.node_id != nid:
                out.append(f"node {nid[:8]} is recorded as {info.node_id[:8]}")
        inline: dict[str, int] = {}
        for entry in self.objects.values():
            if entry.inline is not None and entry.charged and entry.size:
                inline[entry.charged] = inline.get(entry.charged, 0) + entry.size
        if inline != self._inline_per_node:
            out.append(f"inline bytes per node {self._inline_per_node} are really {inline}")
        if len(self.events) != len(self._event_sizes) or self._event_bytes_total != sum(self._event_sizes):
            out.append("the event log's size accounting does not match its events")
        serving = {(tr.object_id, tr.sender) for tr in self.transfers.values()}
        for oid, entry in self.objects.items():
            name = oid.hex()[:12]
            if entry.object_id != oid or len(oid) != 20 or entry.size < 0:
                out.append(f"object {name}: bad key, id or size {entry.size}")
            if entry.inline is not None and len(entry.inline) != entry.size:
                out.append(f"object {name}: {len(entry.inline)} inline bytes for size {entry.size}")
            for nid, loc in entry.locations.items():
                where = f"object {name} at {nid[:8]}"
                if loc.node_id != nid:
                    out.append(f"{where}: recorded as {loc.node_id[:8]}")
                if nid not in self.nodes:
                    out.append(f"{where}: the node is not joined")
                if not 0 <= loc.progress <= entry.size:
                    out.append(f"{where}: progress {loc.progress} outside 0..{entry.size}")
                complete = loc.state is LocationState.COMPLETE
                if complete and (loc.progress != entry.size or loc.upstream is not None or loc.producing):
                    out.append(f"{where}: complete but short, fed or still produced")
                if loc.copying and not (complete and loc.segment):
                    out.append(f"{where}: copying without a complete copy's segment")
                if entry.inline is not None and (not complete or loc.segment or loc.busy):
                    out.append(f"{where}: an inline object's holder is partial, in a segment or busy")
                if loc.busy and (oid, nid) not in serving:
                    out.append(f"{where}: busy without a transfer")
                if self._upstream_cycle(entry, loc):
                    out.append(f"{where}: its upstream chain is a cycle")
        for tid, tr in self.transfers.items():
            if tr.transfer_id != tid or tr.object_id not in self.objects or tr.sender == tr.receiver:
                out.append(f"transfer {tid}: bad key, unknown object or sender = receiver")
            if tr.sender not in self.nodes or tr.receiver not in self.nodes:
                out.append(f"transfer {tid}: between nodes not joined")
        for oid, queue in self.pending.items():
            if not queue:
                out.append(f"pending {oid.hex()[:12]}: an empty queue is kept")
            for pl in queue:
                if pl.object_id != oid or pl.node_id not in self.nodes or pl.have_bytes < 0:
                    out.append(f"pending {oid.hex()[:12]} of {pl.node_id[:8]}: bad key, node or progress")
        out.extend(self._reduction_problems())
        return out

    def _reduction_problems(self) -> list[str]:
        out: list[str] = []
        expected: dict[bytes, set[bytes]] = {}
        for rid, red in self.reductions.items():
            plan, name = red.plan, f"reduction {rid.hex()[:12]}"
            if plan.reduction_id != rid or len(plan.placed) > plan.num_objects:
                out.append(f"{name}: bad key, or more inputs placed than asked for")
            if [pl.vertex for pl in plan.placed] != [v for v in plan.by_vertex] or any(
                plan.by_vertex[pl.vertex] is not pl or pl.object_id not in plan.inputs for pl in plan.placed
            ):
                out.append(f"{name}: its placements and vertices disagree")
            if not red.active:
                continue
            for pl in plan.placed:
                if pl.node_id and pl.node_id not in self.nodes:
                    out.append(f"{name}: vertex {pl.vertex} on {pl.node_id[:8]}, not joined")
                if pl.runs_task and pl.node_id and pl.output_id not in self.objects:
                    out.append(f"{name}: vertex {pl.vertex}'s output is not registered")
            if not plan.full:
                placed = {pl.object_id for pl in plan.placed}
                for oid in plan.inputs:
                    if oid not in placed:
                        expected.setdefault(oid, set()).add(rid)
        if {o: set(r) for o, r in self.awaiting.items()} != expected:
            out.append("awaiting does not list exactly the unplaced inputs of active reductions")
        return out

    @staticmethod
    def _upstream_cycle(entry: ObjectEntry, loc: Location) -> bool:
        seen = {loc.node_id}
        current: Location | None = loc
        while current is not None and current.upstream is not None:
            if current.upstream in seen:
                return True
            seen.add(current.upstream)
            current = entry.locations.get(current.upstream)
        return False

    def validate(self) -> None:
        """Raise :class:`InvariantError` listing every broken invariant (see :meth:`problems`).

        The state machine's tests run it after every event (``DirectoryState(validate=True)``), the
        service after every event when ``HOPLITE_VALIDATE_DIRECTORY=1`` (the test suite and the
        soak set it)."""
        found = self.problems()
        if found:
            raise InvariantError("; ".join(found))

    # ------------------------------------------------------------ helpers
    def _send(self, node_id: str, message: p.Message) -> None:
        self._out.append(Send(node_id, message))

    def record(self, now: float, kind: str, **details: Any) -> None:
        """Append an event of ``kind`` to the event log (for the hosting service's own events)."""
        self._log(now, kind, **details)

    def _log(self, now: float, kind: str, **details: Any) -> None:
        size = _event_bytes(details)
        self.events.append({"seq": next(self._seq), "t": now, "kind": kind, **details})
        self._event_sizes.append(size)
        self._event_bytes_total += size
        while len(self.events) > EVENT_LOG_CAPACITY or (
            self._event_bytes_total > self.event_log_bytes and len(self.events) > 1
        ):
            self.events.popleft()
            self._event_bytes_total -= self._event_sizes.popleft()


def _event_bytes(details: dict[str, Any]) -> int:
    """An estimate of an event's memory: a fixed cost for the record and each field, plus the
    length of its texts and byte strings (every other value is a number, a flag or short)."""
    size = 360
    for value in details.values():
        size += 72 + (len(value) if isinstance(value, (str, bytes)) else 0)
    return size


def _rank(loc: Location) -> tuple[int, int]:
    return (1 if loc.state is LocationState.COMPLETE else 0, loc.progress)


def _not_ready(plan: ReducePlan) -> str:
    """``"not ready: <ids>"``: the inputs of ``plan`` not placed yet (the first 8)."""
    placed = set(plan.reduced_objects())
    missing = [oid.hex() for oid in plan.inputs if oid not in placed]
    more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
    return f"not ready: {', '.join(missing[:8])}{more}"
