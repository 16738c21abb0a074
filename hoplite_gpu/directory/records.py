"""The directory's records: nodes, objects and their copies, waiting lookups, transfers and
reductions. Plain mutable dataclasses; the parts of :mod:`hoplite_gpu.directory` change them."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import TypeVar

from ..coding.decoding import DecodeTracker
from ..topology import Inventory
from .reduce import ReducePlan

K = TypeVar("K")
V = TypeVar("V")


def unindex(index: dict[K, set[V]], key: K, item: V) -> None:
    """Remove ``item`` from ``index[key]``, and ``key`` once its set is empty (an index that keeps
    no empty sets)."""
    items = index.get(key)
    if items is not None:
        items.discard(item)
        if not items:
            del index[key]


class LocationState(enum.Enum):
    """What a node holds of an object."""

    PARTIAL = "partial"
    COMPLETE = "complete"


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
    keep: bool = True  # an inline answer is kept (recorded as the requester's copy; see LookupRequest)
    via: bytes = b""  # pull from this object's owner's copy (see LookupRequest)
    live: bool = True  # still in its queue (answered, failed and cancelled lookups are not)


@dataclass(slots=True)
class Transfer:
    """A sender streaming an object to a receiver."""

    transfer_id: int
    object_id: bytes
    sender: str
    receiver: str
    started: float


@dataclass(frozen=True, slots=True)
class EndedTransfer:
    """A transfer of a reduction's result that the directory ended (its sender left, or a repair
    reset the result) before its receiver reported: the receiver may still report it complete."""

    object_id: bytes
    epoch: int  # the tree whose root's output it carried
    receiver: str


@dataclass(frozen=True, slots=True)
class PastTree:
    """A full tree a repair replaced while a copy of its root's output may have been complete
    already (a reader's transfer of it ended, or its root's node lives on): adopted if one turns
    out to be (see :meth:`~.repair.Repair.stale_copy`)."""

    plan: ReducePlan
    weights: dict[bytes, float]


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
    charged: int = 0  # inputs counted against the requester's quota (Membership.reduce_inputs)
    past: dict[int, PastTree] = field(default_factory=dict)  # epoch -> a tree replaced (see PastTree)
    # The nodes that may hold a complete result of a tree in ``past``: not given the root of the
    # tree that replaced it while another vertex is free (that task would replace their copy).
    shun: frozenset[str] = frozenset()

    @property
    def active(self) -> bool:
        """Neither finished nor failed."""
        return self.error is None and not self.done

    @property
    def chooses(self) -> bool:
        """Whether it reduces only some of the inputs asked for (the first to be ready, or those
        that decode): two runs of it may reduce different ones."""
        return bool(self.candidates) or self.plan.num_objects < len(self.plan.inputs)


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
