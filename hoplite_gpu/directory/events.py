"""What goes into the directory's state machine (events) and what comes out (instructions).

Every event carries ``now``. :meth:`~.state.DirectoryState.handle` numbers the events it handles
and names each by its kind and number, e.g. ``"lookup#17"`` or ``"tick#40"`` (a *cause*, like a
stimulus id): every instruction it returns and every event-log entry it writes carries the cause of
the event that produced it, so the log tells why something was sent. Causes stay inside the
directory: a :class:`Send`'s message goes on the wire as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .. import protocol as p
from ..topology import Inventory


# ---------------------------------------------------------------- events (inputs)
@dataclass(frozen=True, slots=True)
class NodeJoined:
    """A node authenticated; ``data_host:data_port`` is its data-plane listener."""

    kind: ClassVar[str] = "node_joined"
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

    kind: ClassVar[str] = "node_left"
    node_id: str
    now: float


@dataclass(frozen=True, slots=True)
class Request:
    """A control message from a node."""

    node_id: str
    message: p.Message
    now: float

    @property
    def kind(self) -> str:
        """The message's wire type (``"lookup"``, ``"put"``, ...)."""
        return self.message.TYPE


@dataclass(frozen=True, slots=True)
class AuthFailed:
    """A connection from ``peer`` failed authentication and was dropped (logged only)."""

    kind: ClassVar[str] = "auth_failed"
    peer: str
    now: float


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed; expire deadlines and leases up to ``now``. ``lag``: how late the host woke
    for this tick (a directory that was itself stalled does not declare its nodes dead)."""

    kind: ClassVar[str] = "tick"
    now: float
    lag: float = 0.0


@dataclass(frozen=True, slots=True)
class ContinueReduce:
    """Place the next slice of a reduction's inputs that were present when it was requested (the
    host feeds it back for a :class:`Resume`, after the events that queued up meanwhile)."""

    kind: ClassVar[str] = "continue_reduce"
    reduction_id: bytes
    now: float


Event = NodeJoined | NodeLeft | Request | AuthFailed | Tick | ContinueReduce


# ---------------------------------------------------------------- instructions (outputs)
# ``cause`` names the event that produced an instruction (see the module docstring). It is left
# out of comparisons: two instructions that do the same are equal, whatever produced them.
@dataclass(frozen=True, slots=True)
class Send:
    """Send ``message`` to node ``node_id`` (a reply or a push)."""

    node_id: str
    message: p.Message
    cause: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class Disconnect:
    """Close node ``node_id``'s connection: it was declared dead (``reason``)."""

    node_id: str
    reason: str
    cause: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class Resume:
    """Give the directory :class:`ContinueReduce` for ``reduction_id`` once the events waiting now
    (other nodes' requests) have been handled: a reduction over many present inputs is placed a
    slice (:attr:`~.config.DirectoryConfig.place_slice`) per event, so no other node waits behind
    all of it."""

    reduction_id: bytes
    cause: str = field(default="", compare=False)


Instruction = Send | Disconnect | Resume
