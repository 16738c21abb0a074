"""The control plane's messages (node <-> directory) as frozen dataclasses: their base, the
handshake, and what nodes send the directory (requests, reports, barriers and watches).

Each class names its wire ``TYPE`` and, where a field's type is not enough, checks its values in
``check()`` (with :mod:`.fields`); :mod:`.codec` turns them into frames and back. Defining a
subclass with a ``TYPE`` registers it with the codec. What the directory sends back is in
:mod:`.replies`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import InvalidArgumentError, ProtocolError
from .fields import (
    MAX_CODING_COLUMNS,
    MAX_NAME_CHARS,
    check_id,
    check_memory,
    check_name,
    check_object,
    check_timeout,
    check_weights,
)

#: Every message class by its wire type (filled as the classes below are defined).
_REGISTRY: dict[str, type[Message]] = {}


class Message:
    """Base of every control-plane message."""

    __slots__ = ()

    TYPE: ClassVar[str] = ""

    def check(self) -> None:
        """Raise :class:`ProtocolError` if a field's value is out of range (:func:`~.codec.decode`
        calls it after the field types matched, so the state machines only ever see valid input)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.TYPE:
            # dataclass(slots=True) re-creates the class, so the same name registers twice.
            previous = _REGISTRY.get(cls.TYPE)
            if previous is not None and previous.__qualname__ != cls.__qualname__:
                raise RuntimeError(f"duplicate message type {cls.TYPE}")
            _REGISTRY[cls.TYPE] = cls


# ---------------------------------------------------------------- handshake
@dataclass(frozen=True, slots=True)
class Challenge(Message):
    """Directory -> node: first frame on a connection."""

    TYPE: ClassVar[str] = "challenge"
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """Node -> directory: authenticate and introduce the node."""

    TYPE: ClassVar[str] = "hello"
    node_id: str
    nonce: bytes
    proof: bytes
    data_host: str
    data_port: int
    host_key: str = ""  # shared-memory namespace (:func:`hoplite_gpu.memory.shm.host_key`); "" for none
    # Reconnecting after losing its directory: the id of the one it lost (its copies follow as
    # Restore messages); "" on a first join.
    previous_directory: str = ""
    # Where its device objects live (:class:`hoplite_gpu.topology.GpuPlace`): a GPU's UUID and its
    # host's GPU inventory; the directory prefers same-GPU and NVLink holders for CUDA IPC.
    gpu: str = ""
    gpus: dict[str, Any] = field(default_factory=dict)
    # A caller thread's own connection of a node already joined (:mod:`hoplite_gpu.node.channel`):
    # the directory answers the requests sent on it there, and nothing else goes there.
    channel: bool = False

    def check(self) -> None:
        check_name(self.TYPE, "node_id", self.node_id)
        if self.gpus or self.gpu:
            from ..topology import Inventory

            try:
                known = Inventory.from_dict(self.gpus).gpu(self.gpu)
            except InvalidArgumentError as exc:
                raise ProtocolError(f"{self.TYPE}: gpus: {exc}") from None
            if known is None:
                raise ProtocolError(f"{self.TYPE}: gpu {self.gpu[:64]!r} is not in its inventory")
        if len(self.host_key) > MAX_NAME_CHARS or not self.host_key.isprintable() or " " in self.host_key:
            raise ProtocolError(f"{self.TYPE}: host_key must be up to {MAX_NAME_CHARS} printable characters")
        check_name(self.TYPE, "previous_directory", self.previous_directory, empty=True)
        if not 0 < len(self.data_host) <= MAX_NAME_CHARS or not self.data_host.isprintable():
            raise ProtocolError(f"{self.TYPE}: data_host is not a host name or address")
        if not 0 < self.data_port < 65536:
            raise ProtocolError(f"{self.TYPE}: data_port {self.data_port} is not a port")


@dataclass(frozen=True, slots=True)
class Welcome(Message):
    """Directory -> node: authentication accepted; carries the directory's proof."""

    TYPE: ClassVar[str] = "welcome"
    proof: bytes
    directory_id: str
    inline_threshold_bytes: int


# ---------------------------------------------------------------- requests (node -> directory)
@dataclass(frozen=True, slots=True)
class PutRequest(Message):
    """Register an object whose complete copy the sender holds (or inline data)."""

    TYPE: ClassVar[str] = "put"
    request_id: int
    object_id: bytes
    size: int
    dtype: str
    shape: list[int]
    digest: bytes
    inline: bytes | None = None
    segment: str = ""  # shared-memory segment holding the copy ("" if none)
    # The sender is still copying the bytes into ``segment`` (it serves them as they come, and
    # sends CopyAdded once done): same-host readers wait for that rather than pull.
    copying: bool = False
    memory: str = ""  # "device": put from device memory (readers get device arrays); "": host

    def check(self) -> None:
        check_object(self.TYPE, self.object_id, self.size, self.dtype, self.shape, self.inline)
        check_memory(self.TYPE, self.memory)


@dataclass(frozen=True, slots=True)
class Restore(Message):
    """Node -> directory, after rejoining a (restarted) directory: a complete copy this node holds.

    ``owner``: the node put it (it may delete it everywhere). ``inline`` carries the bytes of an
    object small enough to be kept in the directory. No reply.
    """

    TYPE: ClassVar[str] = "restore"
    object_id: bytes
    size: int
    dtype: str
    shape: list[int]
    digest: bytes
    owner: bool = False
    inline: bytes | None = None
    segment: str = ""
    memory: str = ""  # as in PutRequest

    def check(self) -> None:
        check_object(self.TYPE, self.object_id, self.size, self.dtype, self.shape, self.inline)
        check_memory(self.TYPE, self.memory)


@dataclass(frozen=True, slots=True)
class LookupRequest(Message):
    """Ask for the object or a source to pull it from; blocks until one exists or ``timeout``.

    ``timeout`` 0 waits until cancelled. ``have_bytes`` is how much of the object the requester
    already holds (a resumed transfer). ``resume``: the requester holds a copy of it from an
    earlier answer, perhaps still empty, so an object the directory no longer knows was lost or
    deleted meanwhile (it fails the lookup) rather than not put yet (the lookup waits).
    ``shared_memory``: the requester can copy from a
    complete copy's shared-memory segment on its own host; ``device_ipc``: also open a same-host
    device copy's memory (:mod:`hoplite_gpu.memory.ipc`). ``direct``: pull from the owner (or the
    node computing the object) even while it serves others, rather than from the chain of readers.
    ``keep``: an inline answer is kept in the requester's store, and recorded as its copy (the
    owner's delete then drops it); False: it goes to one caller only (a caller channel's ``get``),
    and nothing is recorded. ``via``: an object whose owner's copy of this one to pull from,
    partial or complete, busy or not; while that node holds none and no copy is complete yet,
    the lookup waits for it (it is about to receive it: a ring of readers); else, or once that
    node is gone, as without.
    """

    TYPE: ClassVar[str] = "lookup"
    request_id: int
    object_id: bytes
    timeout: float
    have_bytes: int = 0
    shared_memory: bool = False
    direct: bool = False
    device_ipc: bool = False
    resume: bool = False
    keep: bool = True
    via: bytes = b""

    def check(self) -> None:
        check_id(self.TYPE, "object_id", self.object_id)
        if self.via:
            check_id(self.TYPE, "via", self.via)
        check_timeout(self.TYPE, self.timeout)
        if self.have_bytes < 0:
            raise ProtocolError(f"{self.TYPE}: have_bytes {self.have_bytes} is negative")


@dataclass(frozen=True, slots=True)
class CancelLookup(Message):
    """Withdraw a pending lookup (the caller timed out or was cancelled)."""

    TYPE: ClassVar[str] = "cancel_lookup"
    request_id: int


@dataclass(frozen=True, slots=True)
class TransferDone(Message):
    """Receiver -> directory: a transfer ended; ``ok`` means the receiver's copy is complete."""

    TYPE: ClassVar[str] = "transfer_done"
    transfer_id: int
    ok: bool
    progress: int
    reason: str = ""
    segment: str = ""  # the receiver's shared-memory segment holding the copy (when ok)
    sender_failed: bool = False  # the sender went away or stalled (not: it no longer holds it)
    sender_lacks: bool = False  # the sender refused: it no longer holds the object (withdrawn)


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Node -> directory, every ``Config.heartbeat_interval``: this node is alive. A node the
    directory hears nothing from for its lease is declared dead."""

    TYPE: ClassVar[str] = "heartbeat"


@dataclass(frozen=True, slots=True)
class CopyAdded(Message):
    """Node -> directory: it now holds a complete copy, made from a same-host shared-memory
    segment (no transfer was scheduled for it)."""

    TYPE: ClassVar[str] = "copy_added"
    object_id: bytes
    segment: str = ""

    def check(self) -> None:
        check_id(self.TYPE, "object_id", self.object_id)


@dataclass(frozen=True, slots=True)
class ServeDone(Message):
    """Sender -> directory: it finished serving a transfer (for the event log), or gave up on it
    (``failed``: the receiver stalled or went away), so it may serve others at once."""

    TYPE: ClassVar[str] = "serve_done"
    transfer_id: int
    bytes_sent: int
    bytes_sent_while_incomplete: int
    failed: bool = False


@dataclass(frozen=True, slots=True)
class DeleteRequest(Message):
    """Delete the object (owner: everywhere; other nodes: their own copy only); ``also``: more
    objects deleted by the same request, each as if alone, in order (a collective's objects: one
    message, not one each; at most :data:`MAX_DELETE_BATCH`)."""

    TYPE: ClassVar[str] = "delete"
    request_id: int
    object_id: bytes
    also: list[bytes] = field(default_factory=list)

    def check(self) -> None:
        check_id(self.TYPE, "object_id", self.object_id)
        if len(self.also) > MAX_DELETE_BATCH:
            raise ProtocolError(f"{self.TYPE}: {len(self.also)} more objects, over {MAX_DELETE_BATCH}")
        for oid in self.also:
            check_id(self.TYPE, "also", oid)


@dataclass(frozen=True, slots=True)
class ReduceRequest(Message):
    """Reduce the first ``num_objects`` of ``object_ids`` to become ready into ``reduction_id``
    (with ``coding`` and ``num_objects`` 0: the first arrivals whose rows decode).

    ``op`` is a :class:`~hoplite_gpu.reduce_ops.ReduceOp` value; ``timeout`` (0: none) is how long
    the directory waits for enough inputs before failing the reduction. ``degree`` is the tree's
    fan-in (0: the directory chooses from its cost model); ``ordered``: input ``i`` takes the
    tree's ``i``-th vertex in in-order, whenever it arrives (every input is reduced; with degree
    1 a chain from the first listed to the last, which computes the result). Repeating a request
    with the same id and arguments is accepted (every rank of a group may issue it).
    """

    TYPE: ClassVar[str] = "reduce"
    request_id: int
    reduction_id: bytes
    object_ids: list[bytes]
    op: str
    num_objects: int
    timeout: float = 0.0
    rejoin: bool = False  # re-sent to a restarted directory: a complete result already held is it
    degree: int = 0
    weights: list[float] = field(default_factory=list)  # one per object id (SUM only); [] for none
    # Instead of weights: each input's row of a code's encoding matrix; the directory chooses the
    # weights once the num_objects inputs are chosen (those that make the rows sum to all ones),
    # or, with num_objects 0, once the rows that arrived can.
    coding: list[list[float]] = field(default_factory=list)
    ordered: bool = False

    def check(self) -> None:
        check_timeout(self.TYPE, self.timeout)
        if self.weights and len(self.weights) != len(self.object_ids):
            raise ProtocolError(f"{self.TYPE}: {len(self.weights)} weights for {len(self.object_ids)} inputs")
        check_weights(self.TYPE, self.weights)
        if self.coding:
            if self.weights or len(self.coding) != len(self.object_ids):
                raise ProtocolError(f"{self.TYPE}: coding needs one row per input and no weights")
            width = len(self.coding[0])
            if not 1 <= width <= MAX_CODING_COLUMNS or any(len(row) != width for row in self.coding):
                raise ProtocolError(f"{self.TYPE}: coding rows of 1..{MAX_CODING_COLUMNS} numbers, all alike")
            for row in self.coding:
                check_weights(self.TYPE, row)


@dataclass(frozen=True, slots=True)
class ReducedObjectsRequest(Message):
    """Ask which inputs a reduction uses; answered once all of them are chosen, or ``timeout``."""

    TYPE: ClassVar[str] = "reduced_objects"
    request_id: int
    reduction_id: bytes
    timeout: float = 0.0

    def check(self) -> None:
        check_timeout(self.TYPE, self.timeout)


@dataclass(frozen=True, slots=True)
class VertexDone(Message):
    """Node -> directory: a reduce-tree vertex finished its output (``ok``) or failed."""

    TYPE: ClassVar[str] = "vertex_done"
    reduction_id: bytes
    vertex: int
    ok: bool
    reason: str = ""
    segment: str = ""  # shared-memory segment holding the output (when ok)
    epoch: int = 0  # the tree's epoch (a tree rebuilt after a failure has a higher one)
    retry: bool = False  # failed because a source died or was reset: rebuild, do not fail


#: Most events one :class:`~.replies.EventLogReply` carries, so that a reply stays well under the control
#: message limit (a whole log of 100 000 events is several megabytes).
EVENT_LOG_PAGE = 1000


@dataclass(frozen=True, slots=True)
class EventLogRequest(Message):
    """Fetch directory events with sequence number >= ``since`` (diagnostics and tests); a reply
    holds at most :data:`EVENT_LOG_PAGE` of them (ask again from after the last for more)."""

    TYPE: ClassVar[str] = "event_log"
    request_id: int
    since: int = 0


#: Most entries each list of a :class:`~.replies.SummaryReply` carries (its totals count them all).
SUMMARY_PAGE = 1000


@dataclass(frozen=True, slots=True)
class SummaryRequest(Message):
    """What the directory holds now, in brief (diagnostics, tests, leak checks): answered with a
    :class:`~.replies.SummaryReply`."""

    TYPE: ClassVar[str] = "summary"
    request_id: int


@dataclass(frozen=True, slots=True)
class PingRequest(Message):
    """Answered at once with a :class:`~.replies.PingReply`. The directory handles a connection's messages
    in order, so the reply says that what the node sent before it on that connection was handled
    (a group member knows its watch is registered: :class:`hoplite_gpu.collective.Group`)."""

    TYPE: ClassVar[str] = "ping"
    request_id: int


# ---------------------------------------------------------------- barriers and watches
#: Most members a barrier may have (:class:`BarrierRequest`), and most missing ranks a reply names.
MAX_BARRIER_MEMBERS = 1 << 16
MAX_MISSING_NAMED = 64
#: Most objects one barrier arrival may release (:attr:`BarrierRequest.release`).
MAX_BARRIER_RELEASE = 4096
#: Most objects one delete request may add to its first (:attr:`DeleteRequest.also`).
MAX_DELETE_BATCH = 4096
#: Largest vote an agreement's member may cast (:attr:`BarrierRequest.vote`).
MAX_VOTE = (1 << 31) - 1


def _check_member(kind: str, rank: int, count: int) -> None:
    """A member ``rank`` of a group of ``count`` (barriers, watches)."""
    if not 1 <= count <= MAX_BARRIER_MEMBERS:
        raise ProtocolError(f"{kind}: count {count} is not in 1..{MAX_BARRIER_MEMBERS}")
    if not 0 <= rank < count:
        raise ProtocolError(f"{kind}: rank {rank} is not in 0..{count - 1}")


@dataclass(frozen=True, slots=True)
class BarrierRequest(Message):
    """Member ``rank`` of ``count`` reached barrier ``barrier_id``: answered (:class:`~.replies.BarrierReply`)
    once all ``count`` members have, or at ``timeout`` (0: waits until cancelled, with
    ``CancelLookup`` of the same request id). One message per member: a group's barrier
    (:func:`hoplite_gpu.collective.barrier`). ``release``: objects to delete, as a
    :class:`DeleteRequest` of this node's would (with no reply), once every member has come and
    before any is answered ``ok`` (a group's objects of its collectives before the barrier,
    deleted with no message of their own); an arrival answered otherwise releases nothing.

    ``group_id`` (an agreement, :meth:`hoplite_gpu.node.Node.agree`): the barrier of a watched
    group (:class:`WatchRequest`) whose lost members no longer count as missing; it is answered
    once every member has come or is lost, with the members that came and are not lost and the
    least ``vote`` among theirs (the same answer to every member)."""

    TYPE: ClassVar[str] = "barrier"
    request_id: int
    barrier_id: bytes
    rank: int
    count: int
    timeout: float
    release: list[bytes] = field(default_factory=list)
    group_id: bytes = b""
    vote: int = 1

    def check(self) -> None:
        check_id(self.TYPE, "barrier_id", self.barrier_id)
        if self.group_id:
            check_id(self.TYPE, "group_id", self.group_id)
        if not 0 <= self.vote <= MAX_VOTE:
            raise ProtocolError(f"{self.TYPE}: vote {self.vote} is not in 0..{MAX_VOTE}")
        if len(self.release) > MAX_BARRIER_RELEASE:
            raise ProtocolError(f"{self.TYPE}: {len(self.release)} released, over {MAX_BARRIER_RELEASE}")
        for oid in self.release:
            check_id(self.TYPE, "release", oid)
        check_timeout(self.TYPE, self.timeout)
        _check_member(self.TYPE, self.rank, self.count)


@dataclass(frozen=True, slots=True)
class WatchRequest(Message):
    """Member ``rank`` of ``count`` watches group ``group_id``: answered (:class:`~.replies.WatchReply`) as
    soon as a member of the group is lost (its node left or was declared dead, or it gave up on
    the group), at once if one already is; held until then (withdrawn with ``CancelLookup`` of the
    same request id: this member leaves the group cleanly, and is not reported lost). With
    ``abort`` set, the member gives up on the group instead, for that reason: it is lost from
    now on, every member watching is answered, and so is this request (at once). A group's
    collectives use it to fail at once when a member is gone (:class:`hoplite_gpu.collective.Group`
    with ``watch=True``). ``again``: sent again to a restarted directory (this member watched
    the one before it). ``parent``: a watched group whose members this group's are, rank ``r``
    here being rank ``parent_ranks[r]`` there (-1: not a member of it): a member whose node left
    before it watched this group, known by its node there, is lost here at once, and one whose
    node leaves before it watches here is lost then (a group formed among the survivors of
    another, where one more may die before it watches)."""

    TYPE: ClassVar[str] = "watch"
    request_id: int
    group_id: bytes
    rank: int
    count: int
    abort: str = ""
    again: bool = False
    parent: bytes = b""
    parent_ranks: list[int] = field(default_factory=list)

    def check(self) -> None:
        check_id(self.TYPE, "group_id", self.group_id)
        _check_member(self.TYPE, self.rank, self.count)
        if not self.parent:
            if self.parent_ranks:
                raise ProtocolError(f"{self.TYPE}: parent_ranks without a parent")
            return
        check_id(self.TYPE, "parent", self.parent)
        if len(self.parent_ranks) != self.count:
            raise ProtocolError(
                f"{self.TYPE}: {len(self.parent_ranks)} parent_ranks for {self.count} members"
            )
        if any(type(r) is not int or not -1 <= r < MAX_BARRIER_MEMBERS for r in self.parent_ranks):
            raise ProtocolError(f"{self.TYPE}: a parent rank is not in -1..{MAX_BARRIER_MEMBERS - 1}")


#: What nodes send the directory: the messages whose texts :func:`~.codec.decode` bounds.
FROM_NODES: frozenset[type[Message]] = frozenset(
    {
        Hello,
        PutRequest,
        Restore,
        LookupRequest,
        CancelLookup,
        TransferDone,
        Heartbeat,
        CopyAdded,
        ServeDone,
        DeleteRequest,
        ReduceRequest,
        ReducedObjectsRequest,
        VertexDone,
        EventLogRequest,
        SummaryRequest,
        PingRequest,
        BarrierRequest,
        WatchRequest,
    }
)
