"""What the directory sends nodes: the replies to their requests and the messages it pushes
unasked (tasks of a reduction, objects to drop, transfers to abort), as frozen dataclasses.

The base class, the handshake and what nodes send are in :mod:`.messages`; defining a class here
registers it with the codec as there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from .messages import Message


@dataclass(frozen=True, slots=True)
class PutReply(Message):
    """Directory -> node: result of a :class:`~.messages.PutRequest`; ``error`` is empty on success."""

    TYPE: ClassVar[str] = "put_reply"
    request_id: int
    error: str = ""
    error_kind: str = ""


@dataclass(frozen=True, slots=True)
class LookupReply(Message):
    """Directory -> node: where to get an object.

    ``status`` is ``"inline"`` (data in ``inline``), ``"pull"`` (stream from the sender at
    ``sender_host:sender_port`` under ``transfer_id``), ``"shm"`` (copy from ``sender_node``'s
    shared-memory ``segment`` on the requester's host), ``"local"``, ``"timeout"`` or
    ``"error"`` (the object is a reduction that failed: ``error_kind`` and ``error``); with
    ``"timeout"``, ``error`` says why it is still waiting (who holds it, who is slow or missing).
    ``reduction_id`` is set when the object is being computed by that reduction (its result while
    it runs, or one of its intermediates): such a partial copy is void if the directory restarts.
    """

    TYPE: ClassVar[str] = "lookup_reply"
    request_id: int
    status: str
    object_id: bytes
    size: int = 0
    dtype: str = ""
    shape: list[int] = field(default_factory=list)
    digest: bytes = b""
    inline: bytes | None = None
    transfer_id: int = 0
    sender_node: str = ""
    sender_host: str = ""
    sender_port: int = 0
    sender_complete: bool = False
    segment: str = ""
    error: str = ""
    error_kind: str = ""
    error_object_id: bytes = b""
    reduction_id: bytes = b""
    memory: str = ""  # the memory the object was put from (see PutRequest)


@dataclass(frozen=True, slots=True)
class DeleteReply(Message):
    """Directory -> node: the object was deleted everywhere (``deleted``), or only the requester's
    copy is to be dropped, or (``kept``) the requester must keep its copy: it is the only one.
    ``deleted_also`` and ``kept_also``: the same for each object of the request's ``also``."""

    TYPE: ClassVar[str] = "delete_reply"
    request_id: int
    deleted: bool
    kept: bool = False  # the requester holds the only copy (a reduction result): it must keep it
    deleted_also: list[bool] = field(default_factory=list)
    kept_also: list[bool] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class DropObject(Message):
    """Directory -> node (push): drop the local copy.

    ``reason``: ``"deleted"`` (its owner deleted it), ``"lost"`` (every complete copy died: a
    partial copy can never complete), ``"reset"`` (a reduction result being computed is
    recomputed after a failure: a partial copy's bytes are void and a get starts again) or
    ``"failed"`` (the reduction computing it failed with ``error_kind`` and ``error``, as its
    lookups are answered: a get waiting on the copy raises that, not a delete).
    """

    TYPE: ClassVar[str] = "drop_object"
    object_id: bytes
    reason: str = "deleted"
    error_kind: str = ""
    error: str = ""


@dataclass(frozen=True, slots=True)
class AbortTransfer(Message):
    """Directory -> receiver (push): the sender of transfer ``transfer_id`` died; stop waiting for
    its bytes (a killed peer's UCX endpoint does not always fail at once) and ask for another
    source."""

    TYPE: ClassVar[str] = "abort_transfer"
    transfer_id: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Goodbye(Message):
    """Directory -> node (push): the directory is stopping normally and closes the connection
    next. The node still reconnects (a restarted directory may come back), but says so quietly:
    only a connection lost without this message is a failure worth a warning."""

    TYPE: ClassVar[str] = "goodbye"


@dataclass(frozen=True, slots=True)
class HostPeers(Message):
    """Directory -> node (push): how many other joined nodes share this node's host (the same
    non-empty ``host_key``), sent once it joined and whenever that number changes. A node told it
    is alone lends arrays (``put(borrow=True)``) and keeps ``copy=False`` puts in its own memory,
    without copying them into shared memory for same-host readers that do not exist."""

    TYPE: ClassVar[str] = "host_peers"
    peers: int


@dataclass(frozen=True, slots=True)
class ReduceReply(Message):
    """Directory -> node: the reduction was accepted (``error`` empty) or refused."""

    TYPE: ClassVar[str] = "reduce_reply"
    request_id: int
    error: str = ""
    error_kind: str = ""
    error_object_id: bytes = b""  # the offending input, for a mismatch


@dataclass(frozen=True, slots=True)
class ReducedObjectsReply(Message):
    """Directory -> node: the inputs a reduction uses, in arrival order (or an error)."""

    TYPE: ClassVar[str] = "reduced_objects_reply"
    request_id: int
    object_ids: list[bytes] = field(default_factory=list)
    error: str = ""
    error_kind: str = ""
    error_object_id: bytes = b""


@dataclass(frozen=True, slots=True)
class ReduceTask(Message):
    """Directory -> node (push): compute vertex ``vertex`` of a reduce tree.

    The output ``output_id`` is ``input_id`` (held by this node) reduced with the objects in
    ``children`` (streamed from wherever they are, chunk by chunk as they fill); an empty entry
    is a child not known yet, announced later by :class:`ReduceChild`. The root (``count`` > 0)
    applies the operator's final step over ``count`` inputs (AVG divides).
    """

    TYPE: ClassVar[str] = "reduce_task"
    reduction_id: bytes
    vertex: int
    input_id: bytes
    output_id: bytes
    children: list[bytes]
    op: str
    count: int
    size: int
    dtype: str
    shape: list[int]
    epoch: int = 0  # the tree's epoch (echoed in VertexDone; stale vertices are ignored)
    # A weighted SUM: the input's weight, then each child's ([] for an unweighted reduction). A
    # child that is an input is scaled by that input's weight, a vertex's output (already
    # weighted) by 1; a child not known yet has its weight in its ReduceChild.
    weights: list[float] = field(default_factory=list)
    await_weights: bool = False  # weighted, with weights chosen later (ReduceWeights)
    memory: str = ""  # the memory kind of the output (that of the reduction's first input)


@dataclass(frozen=True, slots=True)
class ReduceWeights(Message):
    """Directory -> node (push): the weights of a vertex whose task said ``await_weights`` (the
    reduction's inputs are now chosen); the same layout as :attr:`ReduceTask.weights`."""

    TYPE: ClassVar[str] = "reduce_weights"
    reduction_id: bytes
    vertex: int
    epoch: int
    weights: list[float]


@dataclass(frozen=True, slots=True)
class ReduceChild(Message):
    """Directory -> node (push): child ``index`` of ``vertex`` is ``object_id``."""

    TYPE: ClassVar[str] = "reduce_child"
    reduction_id: bytes
    vertex: int
    index: int
    object_id: bytes
    epoch: int = 0
    weight: float = 1.0  # its weight in a weighted reduction (see ReduceTask.weights)


@dataclass(frozen=True, slots=True)
class BarrierReply(Message):
    """Directory -> node: every member reached the barrier (``ok``), or its ``timeout`` passed
    first (``timeout``: ``waiting`` members had not come, the first of them in ``missing``).
    An agreement's ``ok`` (``BarrierRequest.group_id``) carries the ``members`` that came and
    are not lost, and the least of their votes (``vote``)."""

    TYPE: ClassVar[str] = "barrier_reply"
    request_id: int
    status: str
    waiting: int = 0
    missing: list[int] = field(default_factory=list)
    members: list[int] = field(default_factory=list)
    vote: int = 1


@dataclass(frozen=True, slots=True)
class WatchReply(Message):
    """Directory -> node: the members of the group lost so far (ranks, ascending), each with
    why (``reasons[i]`` for ``lost[i]``); at most :data:`~.messages.MAX_MISSING_NAMED` of them."""

    TYPE: ClassVar[str] = "watch_reply"
    request_id: int
    lost: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class EventLogReply(Message):
    """Directory -> node: events (dicts with ``seq``, ``t``, ``kind`` and details)."""

    TYPE: ClassVar[str] = "event_log_reply"
    request_id: int
    events: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class SummaryReply(Message):
    """Directory -> node: ``summary`` (see
    :meth:`~hoplite_gpu.directory.state.DirectoryState.summary`)."""

    TYPE: ClassVar[str] = "summary_reply"
    request_id: int
    summary: dict[str, Any]


@dataclass(frozen=True, slots=True)
class PingReply(Message):
    """Directory -> node: the answer to a :class:`~.messages.PingRequest`."""

    TYPE: ClassVar[str] = "ping_reply"
    request_id: int


@dataclass(frozen=True, slots=True)
class ErrorReply(Message):
    """Directory -> node: the request could not be served."""

    TYPE: ClassVar[str] = "error"
    request_id: int
    kind: str
    message: str
