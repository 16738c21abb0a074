"""The directory's event log: what happened, in order, bounded in count and estimated bytes.

Each entry is a dict ``{"seq", "t", "kind", "cause", **details}``: ``cause`` names the event the
directory was handling when it wrote the entry (see :mod:`.events`), so entries written for one
request (a lookup, the transfer it started) share it. Nodes read it with
:class:`~hoplite_gpu.protocol.EventLogRequest`, a page at a time.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any

from .. import protocol as p
from .config import EVENT_LOG_BYTES, EVENT_LOG_CAPACITY

#: The types of event details sent as they are (lists and dicts are the callers' own, of those).
_WIRE = frozenset({str, int, float, bool, bytes, type(None), list, dict})


class EventLog:
    """The newest events, at most ``capacity`` of them and about ``max_bytes`` (oldest go first).

    Args:
        max_bytes: Bound of the log's estimated size (see :func:`event_bytes`).
        capacity: Bound of its number of events.
    """

    def __init__(self, max_bytes: int = EVENT_LOG_BYTES, capacity: int = EVENT_LOG_CAPACITY) -> None:
        self.events: deque[dict[str, Any]] = deque()
        self.sizes: deque[int] = deque()  # estimated bytes of each event in ``events``
        self.total = 0
        self.max_bytes = max_bytes
        self.capacity = capacity
        self._seq = itertools.count()

    def append(self, now: float, kind: str, cause: str, details: dict[str, Any]) -> None:
        """Add an event of ``kind`` at ``now``, written while handling ``cause``. Its details are
        sent to nodes as they are: a value of another type than the wire's (a NumPy scalar) is
        turned into one (an unencodable reply once cut a node's connection; tests/test_soak.py)."""
        size = event_bytes(details)
        self.events.append({"seq": next(self._seq), "t": now, "kind": kind, "cause": cause, **details})
        self.sizes.append(size)
        self.total += size
        while len(self.events) > self.capacity or (self.total > self.max_bytes and len(self.events) > 1):
            self.events.popleft()
            self.total -= self.sizes.popleft()

    def page(self, since: int) -> list[dict[str, Any]]:
        """The events with ``seq >= since``, at most :data:`~hoplite_gpu.protocol.EVENT_LOG_PAGE`."""
        if not self.events:
            return []
        # seq numbers are consecutive: skip to ``since`` in C, not by comparing every event's
        # (a reader paging through a full log made each page scan all of it, on the directory's loop)
        start = max(since - self.events[0]["seq"], 0)
        return list(itertools.islice(self.events, start, start + p.EVENT_LOG_PAGE))

    def problems(self) -> list[str]:
        """What is wrong with the log's size accounting (empty when nothing)."""
        if len(self.events) != len(self.sizes) or self.total != sum(self.sizes):
            return ["the event log's size accounting does not match its events"]
        return []


def event_bytes(details: dict[str, Any]) -> int:
    """An estimate of an event's memory: a fixed cost for the record and each field, plus the
    length of its texts and byte strings (every other value is a number, a flag or short). The
    fixed cost covers ``seq``, ``t``, ``kind`` and ``cause``. On the same walk, a value of a type
    not on the wire is turned into one in place (see :meth:`EventLog.append`)."""
    size = 360
    for key, value in details.items():
        if type(value) not in _WIRE:
            value = details[key] = value.item() if hasattr(value, "item") else str(value)
        size += 72 + (len(value) if isinstance(value, (str, bytes)) else 0)
    return size
