"""What the directory's parts produce while one event is handled: the instructions for the
host (:mod:`.events`) and the entries of the event log, each carrying the event's cause.

Every part receives the one :class:`Outbox` its state made, instead of the whole state: sending a
message, closing a connection, asking to come back for a reduction and recording an event are all
a part may do beyond its own records and the collaborators it was handed.
"""

from __future__ import annotations

import itertools
from typing import Any

from .. import protocol as p
from .eventlog import EventLog
from .events import Disconnect, Event, Instruction, Resume, Send


class Outbox:
    """The instructions produced for the event being handled, and the event log they are
    recorded in with that event's cause.

    Args:
        eventlog: Where :meth:`record` appends.
    """

    def __init__(self, eventlog: EventLog) -> None:
        self.eventlog = eventlog
        self._stimuli = itertools.count(1)
        self._event: Event | None = None  # the event being handled (or handled last)
        self._stimulus = 0  # its number
        self._cause = ""  # its cause, once asked for (most events write nothing)
        self._out: list[Instruction] = []

    def begin(self, event: Event) -> None:
        """Start handling ``event``: number it, and forget what earlier events produced."""
        self._out = []
        self._event, self._stimulus, self._cause = event, next(self._stimuli), ""

    def take(self) -> list[Instruction]:
        """The instructions produced since :meth:`begin` (the outbox is empty after)."""
        out, self._out = self._out, []
        return out

    @property
    def cause(self) -> str:
        """The cause of the event being handled, or handled last (see :mod:`.events`):
        ``"<kind>#<number>"``, e.g. ``"lookup#17"``; "" before the first."""
        if not self._cause and self._event is not None:
            self._cause = f"{self._event.kind}#{self._stimulus}"
        return self._cause

    def send(self, node_id: str, message: p.Message) -> None:
        """Send ``message`` to node ``node_id``, for the event being handled."""
        self._out.append(Send(node_id, message, self.cause))

    def disconnect(self, node_id: str, reason: str) -> None:
        """Close ``node_id``'s connection: it was declared dead."""
        self._out.append(Disconnect(node_id, reason, self.cause))

    def resume(self, reduction_id: bytes) -> None:
        """Ask the host for a :class:`~.events.ContinueReduce` once the events waiting now are
        handled."""
        self._out.append(Resume(reduction_id, self.cause))

    def record(self, now: float, kind: str, **details: Any) -> None:
        """Append an event of ``kind`` to the event log, with the cause of the event being handled
        (also for the hosting service's own events)."""
        self.eventlog.append(now, kind, self.cause, details)
