"""The object directory as a pure state machine.

No sockets, threads or clock calls: every event carries ``now`` (seconds, any monotonic origin), and
:meth:`DirectoryState.handle` returns the instructions the hosting service must carry out (send a
reply to a node, push a message to a node, close a connection, come back for more). Tests drive it
directly, moving time by passing another ``now``. Scheduling follows the Hoplite paper (Zhuang et
al., SIGCOMM 2021, sections 4.2 and 4.3), receiver-driven, with what it lacked on failures.

:class:`DirectoryState` is small: it holds the records every part reads (:attr:`~DirectoryState.nodes`,
:attr:`~DirectoryState.objects`, :attr:`~DirectoryState.reductions`), hands each event to its
handler (a table keyed by event and message type), and collects what the handlers produce. The
handlers' work is done by its parts:

* :mod:`.events`: the events in, the instructions out, and their causes; :mod:`.outbox`
  collects the instructions and event-log entries of the event being handled.
* :mod:`.records`: the records (nodes, objects and copies, lookups, transfers, reductions).
* :mod:`.membership`: joined nodes, leases, suspects, inline-bytes quotas.
* :mod:`.catalog`: puts, copies, deletes, lost objects.
* :mod:`.lookups` and :mod:`.scheduling`: waiting lookups, transfers, and which copy serves whom
  (same-host segments ranked by GPU link, idle complete copies, partial copies without cycles).
* :mod:`.reductions`, :mod:`.reduce_request`, :mod:`.combine` and :mod:`.repair`: reduce trees
  (the pure plan is :mod:`.reduce`), their requests, weights and decoding, the inline reduce,
  and repair after failures.
* :mod:`.recovery`: restoring copies after this directory restarted.
* :mod:`.barriers`: barriers, one message per member.
* :mod:`.watches`: watched groups, whose members hear at once that one of them is gone.
* :mod:`.eventlog` and :mod:`.invariants`: the event log and the invariant checker.

Each part is handed, by keyword, what it uses: the settings, the tables it reads or changes, the
outbox, and the parts it calls; a part it calls that is made after it comes through its
``connect``. None holds the state (tests/test_layout.py checks it).
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, TypedDict, TypeVar

from .. import protocol as p
from .barriers import Barriers
from .catalog import Catalog
from .config import MAX_REPAIRS, PLACE_SLICE, DirectoryConfig
from .eventlog import EventLog
from .events import (
    AuthFailed,
    ContinueReduce,
    Disconnect,
    Event,
    Instruction,
    NodeJoined,
    NodeLeft,
    Request,
    Resume,
    Send,
    Tick,
)
from .invariants import InvariantError, problems
from .lookups import Lookups
from .membership import Membership
from .outbox import Outbox
from .records import LocationState, NodeInfo, ObjectEntry, PendingLookup, Reduction, Transfer
from .recovery import Recovery
from .reductions import Reductions
from .repair import Repair
from .watches import Watches

__all__ = [
    "MAX_REPAIRS",
    "PLACE_SLICE",
    "AuthFailed",
    "ContinueReduce",
    "DirectoryConfig",
    "DirectoryState",
    "Disconnect",
    "Event",
    "Instruction",
    "InvariantError",
    "LocationState",
    "NodeJoined",
    "NodeLeft",
    "Request",
    "Resume",
    "Send",
    "Tick",
]

log = logging.getLogger("hoplite_gpu.directory")

_Handler = TypeVar("_Handler", bound=Callable[..., None])

#: The handler of each event type, and of each message type a node may send: method names of
#: :class:`DirectoryState`, looked up on the instance (so that a test can wrap one).
_EVENT_HANDLERS: dict[type, str] = {}
_REQUEST_HANDLERS: dict[type[p.Message], str] = {}


def _handles(table: dict[Any, str], kind: type) -> Callable[[_Handler], _Handler]:
    def register(method: _Handler) -> _Handler:
        table[kind] = method.__name__
        return method

    return register


def on_event(kind: type) -> Callable[[_Handler], _Handler]:
    """Register the decorated method as the handler of events of type ``kind``."""
    return _handles(_EVENT_HANDLERS, kind)


def on_request(kind: type[p.Message]) -> Callable[[_Handler], _Handler]:
    """Register the decorated method as the handler of ``kind`` messages from nodes; it is
    called with the node's id, the message and ``now``."""
    return _handles(_REQUEST_HANDLERS, kind)


class _Tables(TypedDict):
    """The settings and the records most parts are handed (by keyword)."""

    config: DirectoryConfig
    nodes: dict[str, NodeInfo]
    objects: dict[bytes, ObjectEntry]
    reductions: dict[bytes, Reduction]


class DirectoryState:
    """The directory's state and transition logic (pure, synchronous).

    Args:
        config: Its settings (:class:`~.config.DirectoryConfig`; the defaults if None).
    """

    def __init__(self, config: DirectoryConfig | None = None) -> None:
        self.config = config = config or DirectoryConfig()
        self.check_invariants = config.validate
        self.handled: collections.Counter[str] = collections.Counter()  # messages from nodes, by type
        # The records every part reads (each changed by the part named beside it).
        self.nodes: dict[str, NodeInfo] = {}  # members
        self.objects: dict[bytes, ObjectEntry] = {}  # catalog, and reducer for results
        self.reductions: dict[bytes, Reduction] = {}  # reducer and repair
        self.eventlog = EventLog(config.event_log_bytes)
        self.outbox = outbox = Outbox(self.eventlog)
        # The parts, each handed its records, the outbox and the parts it calls; those it calls
        # that are made after it come through its connect().
        nodes, objects, reductions = self.nodes, self.objects, self.reductions
        tables: _Tables = {"config": config, "nodes": nodes, "objects": objects, "reductions": reductions}
        self.members = members = Membership(config=config, nodes=nodes, outbox=outbox)
        self.catalog = catalog = Catalog(**tables, outbox=outbox, members=members)
        self.lookups = lookups = Lookups(**tables, outbox=outbox, members=members, catalog=catalog)
        self.reducer = reducer = Reductions(
            **tables, outbox=outbox, members=members, catalog=catalog, lookups=lookups
        )
        # A reduction's tree is rebuilt by the repair, which places its inputs again through the
        # reducer: each is handed the other.
        self.repair = repair = Repair(
            nodes=nodes,
            objects=objects,
            reductions=reductions,
            outbox=outbox,
            catalog=catalog,
            reducer=reducer,
        )
        reducer.connect(repair=repair)
        self.barriers = barriers = Barriers(
            config=config, reductions=reductions, outbox=outbox, catalog=catalog, lookups=lookups
        )
        self.watches = watches = Watches(
            outbox.send, outbox.record, config.max_pending_lookups, barriers.group_lost, nodes.__contains__
        )
        barriers.connect(watches=watches)
        self.recovery = recovery = Recovery(
            **tables,
            outbox=outbox,
            members=members,
            catalog=catalog,
            reducer=reducer,
            lookups=lookups,
            watches=watches,
        )
        catalog.connect(lookups=lookups, reducer=reducer)
        lookups.connect(reducer=reducer, repair=repair, recovery=recovery)

    # ------------------------------------------------------------ tables the parts own
    @property
    def pending(self) -> dict[bytes, deque[PendingLookup]]:
        """Lookups waiting, FIFO per object (:attr:`.lookups.Lookups.pending`)."""
        return self.lookups.pending

    @property
    def transfers(self) -> dict[int, Transfer]:
        """Transfers under way by id (:attr:`.lookups.Lookups.transfers`)."""
        return self.lookups.transfers

    @property
    def awaiting(self) -> dict[bytes, set[bytes]]:
        """Input ObjectID -> the reductions waiting for it (:attr:`.reductions.Reductions.awaiting`)."""
        return self.reducer.awaiting

    @property
    def events(self) -> deque[dict[str, Any]]:
        """The event log's entries, oldest first (:class:`.eventlog.EventLog`)."""
        return self.eventlog.events

    @property
    def recovering_until(self) -> float | None:
        """Until when copies are still being restored after a restart (:mod:`.recovery`)."""
        return self.recovery.until

    # ------------------------------------------------------------ entry point
    def handle(self, event: Event) -> list[Instruction]:
        """Apply one event and return the instructions it produced.

        An exception inside a handler (a bug, or input the decoder let through) costs that one
        event, never the directory: it is logged (and recorded as a ``handler_failed`` event), the
        instructions produced before it still go out, and a request gets an ``ErrorReply``.
        """
        self.outbox.begin(event)
        try:
            name = _EVENT_HANDLERS.get(type(event))
            if name is None:  # pragma: no cover - every Event type has a handler
                raise TypeError(f"unknown event {event!r}")
            getattr(self, name)(event)
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            log.exception("the directory failed to handle %s", type(event).__name__)
            self.record(event.now, "handler_failed", event=type(event).__name__, error=text[:500])
            if isinstance(event, Request):
                request_id = getattr(event.message, "request_id", None)
                if isinstance(request_id, int):
                    what = f"the directory failed to handle this {event.message.TYPE} request: {text[:500]}"
                    reply = p.ErrorReply(request_id=request_id, kind="HopliteError", message=what)
                    self.send(event.node_id, reply)
        out = self.outbox.take()
        if self.check_invariants:
            self.validate()
        return out

    def next_deadline(self) -> float | None:
        """Earliest deadline or lease expiry, so the host knows when to send a :class:`Tick`."""
        deadlines = self.reducer.deadlines()
        for deadline in (
            self.lookups.deadline(),
            self.members.lease_deadline(),
            self.recovery.deadline(),
            self.barriers.deadline(),
        ):
            if deadline is not None:
                deadlines.append(deadline)
        return min(deadlines) if deadlines else None

    # ------------------------------------------------------------ what the parts produce
    @property
    def cause(self) -> str:
        """The cause of the event being handled, or handled last (see :mod:`.events`):
        ``"<kind>#<number>"``, e.g. ``"lookup#17"``; "" before the first."""
        return self.outbox.cause

    def send(self, node_id: str, message: p.Message) -> None:
        """Send ``message`` to node ``node_id``, for the event being handled."""
        self.outbox.send(node_id, message)

    def disconnect(self, node_id: str, reason: str) -> None:
        """Close ``node_id``'s connection: it was declared dead."""
        self.outbox.disconnect(node_id, reason)

    def record(self, now: float, kind: str, **details: Any) -> None:
        """Append an event of ``kind`` to the event log, with the cause of the event being handled
        (also for the hosting service's own events)."""
        self.outbox.record(now, kind, **details)

    # ------------------------------------------------------------ invariants
    def problems(self) -> list[str]:
        """Every broken invariant of the state, described (empty when it is consistent); see
        :mod:`.invariants` for what must hold after every event."""
        return problems(self)

    def validate(self) -> None:
        """Raise :class:`InvariantError` listing every broken invariant (see :meth:`problems`).

        The state machine's tests run it after every event (``DirectoryConfig(validate=True)``),
        the service after every event when ``HOPLITE_VALIDATE_DIRECTORY=1`` (the test suite and the
        soak set it)."""
        found = self.problems()
        if found:
            raise InvariantError("; ".join(found))

    # ------------------------------------------------------------ events
    @on_event(Request)
    def _on_request(self, ev: Request) -> None:
        if self.members.seen(ev.node_id, ev.now) is None:
            return  # not authenticated/joined, or declared dead: nothing it sends is acted on
        msg = ev.message
        self.handled[msg.TYPE] += 1
        name = _REQUEST_HANDLERS.get(type(msg))
        if name is None:
            message = f"the directory does not accept {msg.TYPE!r} messages"
            reply = p.ErrorReply(
                request_id=getattr(msg, "request_id", 0), kind="ProtocolError", message=message
            )
            self.send(ev.node_id, reply)
            return
        getattr(self, name)(ev.node_id, msg, ev.now)

    @on_event(NodeJoined)
    def _on_node_joined(self, ev: NodeJoined) -> None:
        self.members.join(ev)
        if ev.rejoin:
            self.recovery.rejoined(ev.now)

    @on_event(NodeLeft)
    def _on_node_left(self, ev: NodeLeft) -> None:
        self._node_left(ev.node_id, ev.now, "left")

    @on_event(Tick)
    def _on_tick(self, ev: Tick) -> None:
        self.members.renew_if_stalled(ev.now, ev.lag)
        now = ev.now
        for info in self.members.expired(now):
            silent = now - info.last_seen
            self.disconnect(info.node_id, f"no heartbeat for {silent:.1f} s")
            self._node_left(info.node_id, now, f"missed its lease ({silent:.1f} s silent)")
        self.lookups.expire(now)
        self.recovery.expire(now)
        self.reducer.expire(now)
        self.barriers.expire(now)

    @on_event(AuthFailed)
    def _on_auth_failed(self, ev: AuthFailed) -> None:
        self.record(ev.now, "auth_failed", peer=ev.peer)

    @on_event(ContinueReduce)
    def _on_continue_reduce(self, ev: ContinueReduce) -> None:
        red = self.reductions.get(ev.reduction_id)
        if red is not None:
            self.reducer.place_backlog(red, ev.now)

    def _node_left(self, node_id: str, now: float, reason: str) -> None:
        """A node left or was declared dead: repair every schedule it took part in."""
        if not self.members.leave(node_id):
            return
        self.record(now, "node_left", node=node_id, reason=reason)
        self.barriers.forget_node(node_id)
        self.watches.forget_node(node_id, now, reason)
        touched = set(self.lookups.forget_node(node_id, reason))
        touched.update(self.catalog.forget_node(node_id))
        self.reducer.requester_left(node_id, now, reason)
        self.repair.node_left(node_id, now, reason)
        self.catalog.settle(touched, now)

    # ------------------------------------------------------------ requests
    @on_request(p.Heartbeat)
    def _on_heartbeat(self, node_id: str, msg: p.Heartbeat, now: float) -> None:
        if self.members.trust(node_id, now):  # alive after all: it may serve again
            self.lookups.serve_all(now)

    @on_request(p.PutRequest)
    def _on_put(self, node_id: str, msg: p.PutRequest, now: float) -> None:
        self.catalog.put(node_id, msg, now)

    @on_request(p.Restore)
    def _on_restore(self, node_id: str, msg: p.Restore, now: float) -> None:
        self.recovery.restore(node_id, msg, now)

    @on_request(p.LookupRequest)
    def _on_lookup(self, node_id: str, msg: p.LookupRequest, now: float) -> None:
        self.lookups.request(node_id, msg, now)

    @on_request(p.CancelLookup)
    def _on_cancel_lookup(self, node_id: str, msg: p.CancelLookup, now: float) -> None:
        self.lookups.cancel(node_id, msg.request_id)
        self.barriers.cancel(node_id, msg.request_id)
        self.watches.cancel(node_id, msg.request_id)

    @on_request(p.BarrierRequest)
    def _on_barrier(self, node_id: str, msg: p.BarrierRequest, now: float) -> None:
        self.barriers.request(node_id, msg, now)

    @on_request(p.WatchRequest)
    def _on_watch(self, node_id: str, msg: p.WatchRequest, now: float) -> None:
        self.watches.request(node_id, msg, now)

    @on_request(p.TransferDone)
    def _on_transfer_done(self, node_id: str, msg: p.TransferDone, now: float) -> None:
        self.lookups.transfer_done(node_id, msg, now)

    @on_request(p.CopyAdded)
    def _on_copy_added(self, node_id: str, msg: p.CopyAdded, now: float) -> None:
        self.catalog.copy_added(node_id, msg, now)

    @on_request(p.ServeDone)
    def _on_serve_done(self, node_id: str, msg: p.ServeDone, now: float) -> None:
        self.record(
            now,
            "serve_done",
            node=node_id,
            transfer_id=msg.transfer_id,
            bytes_sent=msg.bytes_sent,
            bytes_sent_while_incomplete=msg.bytes_sent_while_incomplete,
            failed=msg.failed,
        )
        if msg.failed:
            self.lookups.serve_failed(node_id, msg.transfer_id, now)

    @on_request(p.DeleteRequest)
    def _on_delete(self, node_id: str, msg: p.DeleteRequest, now: float) -> None:
        self.catalog.delete(node_id, msg, now)

    @on_request(p.ReduceRequest)
    def _on_reduce(self, node_id: str, msg: p.ReduceRequest, now: float) -> None:
        self.reducer.request(node_id, msg, now)

    @on_request(p.VertexDone)
    def _on_vertex_done(self, node_id: str, msg: p.VertexDone, now: float) -> None:
        self.reducer.vertex_done(node_id, msg, now)

    @on_request(p.ReducedObjectsRequest)
    def _on_reduced_objects(self, node_id: str, msg: p.ReducedObjectsRequest, now: float) -> None:
        self.reducer.reduced_objects(node_id, msg, now)

    @on_request(p.EventLogRequest)
    def _on_event_log(self, node_id: str, msg: p.EventLogRequest, now: float) -> None:
        self.send(node_id, p.EventLogReply(request_id=msg.request_id, events=self.eventlog.page(msg.since)))

    @on_request(p.PingRequest)
    def _on_ping(self, node_id: str, msg: p.PingRequest, now: float) -> None:
        self.send(node_id, p.PingReply(request_id=msg.request_id))

    @on_request(p.SummaryRequest)
    def _on_summary(self, node_id: str, msg: p.SummaryRequest, now: float) -> None:
        self.send(node_id, p.SummaryReply(request_id=msg.request_id, summary=self.summary()))

    def summary(self) -> dict[str, Any]:
        """What the directory holds now, in brief: the live nodes; each object with its owner, size,
        the live nodes holding a complete copy (``holders``) or still receiving one
        (``receiving``) and whether its bytes are inline; the objects with lookups waiting; the
        transfers under way; the unfinished reductions; the open barriers and watched groups; and
        ``handled``, the messages nodes have sent it so far, by type (a control plane's cost).
        Each list holds at most :data:`~hoplite_gpu.protocol.SUMMARY_PAGE` entries; ``*_total``
        counts them all."""
        page, COMPLETE = p.SUMMARY_PAGE, LocationState.COMPLETE
        objects = [
            {
                "object_id": oid.hex(),
                "owner": entry.owner,
                "size": entry.size,
                "holders": sorted(
                    n for n, loc in entry.locations.items() if n in self.nodes and loc.state is COMPLETE
                ),
                "receiving": sorted(
                    n for n, loc in entry.locations.items() if n in self.nodes and loc.state is not COMPLETE
                ),
                "inline": entry.inline is not None,
            }
            for oid, entry in itertools.islice(self.objects.items(), page)
        ]
        waiting = [oid for oid, queue in self.lookups.pending.items() if any(q.live for q in queue)]
        active = [rid for rid, red in self.reductions.items() if red.active]
        return {
            "nodes": sorted(self.nodes)[:page],
            "objects": objects,
            "objects_total": len(self.objects),
            "lookups": [oid.hex() for oid in waiting[:page]],
            "lookups_total": len(waiting),
            "transfers": [
                {"object_id": t.object_id.hex(), "sender": t.sender, "receiver": t.receiver}
                for t in itertools.islice(self.lookups.transfers.values(), page)
            ],
            "transfers_total": len(self.lookups.transfers),
            "reductions": [rid.hex() for rid in active[:page]],
            "reductions_total": len(active),
            "barriers": len(self.barriers.open),
            "watched_groups": len(self.watches.groups),
            "handled": dict(self.handled),
        }
