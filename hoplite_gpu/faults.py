"""Deterministic fault injection for tests and benchmarks.

A process kills (or stops) itself when a chosen transfer reaches a chosen byte offset: keyed by
node (the process it is armed in) and event, never by time. A spec is a comma-separated list of
``event:object:at[:signal]``:

* ``event``: ``serve`` (this node sends the object to a receiver; fires before sending the byte at
  the offset, and the sender cuts its chunks there so the offset is exact), ``receive`` (this
  node's copy of the object has at least that many bytes; checked as chunks land) or ``reduce``
  (a reduce-tree vertex on this node, of the reduction with that id, is about to reduce the chunk
  at the offset), or ``report`` (this node holds every byte of its copy, or of a reduce vertex's
  output, and is about to tell the directory: "after the last byte, before the report"; any
  ``at`` fires there). ``serve`` at ``0`` fires before the first byte.
* ``object``: the ObjectID in hex (for ``reduce``: the reduction id), a prefix of it, or ``*``.
* ``at``: a fraction of the object's size in ``[0, 1]`` (``0.5``: half way), or a byte count
  with a ``B`` suffix (``1048576B``).
* ``signal``: ``KILL`` (default; a real ``SIGKILL``) or ``STOP`` (``SIGSTOP``: a hung peer).

Arm it with ``Config.fault_injection`` (``HOPLITE_FAULT_INJECTION``) or :func:`arm`. Each fault fires
at most once per process.

Example: ``serve:3fa2:0.5:KILL`` kills the process half way through serving object ``3fa2...``.

If the environment variable ``HOPLITE_FAULT_LOG`` names a file, a fault appends one JSON line to it
just before it fires: the event, object, offset, signal, pid and ``time.monotonic()`` (the host's
CLOCK_MONOTONIC, the clock the directory's event log uses), so a benchmark can measure the time
from the failure to its detection and repair (``bench/recovery.py``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass

from .errors import InvalidArgumentError

EVENTS = ("serve", "receive", "reduce", "report")
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


@dataclass(frozen=True, slots=True)
class Fault:
    """One armed fault (see the module docstring)."""

    event: str
    object_prefix: str  # lower-case hex prefix; "" matches every object
    fraction: float | None
    offset: int | None
    signal_name: str = "KILL"

    def matches(self, event: str, object_hex: str) -> bool:
        """Whether this fault watches ``event`` on that object."""
        return self.event == event and object_hex.startswith(self.object_prefix)

    def byte_offset(self, size: int) -> int:
        """The offset in an object of ``size`` bytes at which the fault fires."""
        if self.offset is not None:
            return min(self.offset, size)
        assert self.fraction is not None
        return min(size, int(self.fraction * size))


def parse(spec: str) -> list[Fault]:
    """Parse a spec (see the module docstring); raises InvalidArgumentError on a malformed one."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        parts = item.split(":")
        if len(parts) not in (3, 4):
            raise InvalidArgumentError(
                f"fault {item!r} is not event:object:at[:signal]", argument="fault_injection"
            )
        event, obj, at = parts[:3]
        sig = parts[3].upper() if len(parts) == 4 else "KILL"
        if event not in EVENTS or sig not in SIGNALS:
            raise InvalidArgumentError(
                f"fault {item!r}: event must be one of {EVENTS} and signal one of {sorted(SIGNALS)}",
                argument="fault_injection",
            )
        prefix = "" if obj == "*" else obj.lower()
        if any(c not in "0123456789abcdef" for c in prefix):
            raise InvalidArgumentError(f"fault {item!r}: object must be hex or *", argument="fault_injection")
        try:
            if at.upper().endswith("B"):
                fraction, offset = None, int(at[:-1])
            else:
                fraction, offset = float(at), None
        except ValueError:
            raise InvalidArgumentError(
                f"fault {item!r}: at must be a fraction or a byte count like 4096B",
                argument="fault_injection",
            ) from None
        if (fraction is not None and not 0.0 <= fraction <= 1.0) or (offset is not None and offset < 0):
            raise InvalidArgumentError(f"fault {item!r}: at is out of range", argument="fault_injection")
        faults.append(Fault(event, prefix, fraction, offset, sig))
    return faults


class FaultInjector:
    """The faults armed in this process; transports and vertices consult it at each chunk."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._lock = threading.Lock()

    @property
    def armed(self) -> bool:
        """Whether any fault is armed (the hooks cost nothing otherwise)."""
        return bool(self._faults)

    def arm(self, spec: str) -> None:
        """Add the faults of ``spec``."""
        faults = parse(spec)
        with self._lock:
            self._faults.extend(faults)

    def clear(self) -> None:
        """Disarm every fault."""
        with self._lock:
            self._faults.clear()

    def next_offset(self, event: str, object_hex: str, pos: int, size: int) -> int | None:
        """The smallest armed offset beyond ``pos`` (a sender cuts its chunk there), or None."""
        if not self._faults:
            return None
        offsets = [
            f.byte_offset(size)
            for f in self._faults
            if f.matches(event, object_hex) and f.byte_offset(size) > pos
        ]
        return min(offsets) if offsets else None

    def check(self, event: str, object_hex: str, pos: int, size: int) -> None:
        """Fire (kill or stop this process) if a fault on ``event`` for the object is at or
        before ``pos``."""
        if not self._faults:
            return
        with self._lock:
            due = [f for f in self._faults if f.matches(event, object_hex) and pos >= f.byte_offset(size)]
            for f in due:
                self._faults.remove(f)
        for f in due:
            _record(f, object_hex, pos)
            # Directed at this thread, which takes it on its way back from the call: sent to
            # the process, the signal may wait for another thread to be scheduled (the main
            # one), while this one goes on sending what the fault was to cut.
            signal.pthread_kill(threading.get_ident(), SIGNALS[f.signal_name])


def _record(fault: Fault, object_hex: str, pos: int) -> None:
    """Append the fault about to fire to ``$HOPLITE_FAULT_LOG`` (if set)."""
    path = os.environ.get("HOPLITE_FAULT_LOG")
    if not path:
        return
    line = json.dumps(
        {
            "event": fault.event,
            "object_id": object_hex,
            "offset": pos,
            "signal": fault.signal_name,
            "pid": os.getpid(),
            "t": time.monotonic(),
        }
    )
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one write: whole lines even from several processes
    finally:
        os.close(fd)


#: The process-wide injector (a process hosts one node).
INJECTOR = FaultInjector()


def arm(spec: str) -> None:
    """Arm the faults of ``spec`` in this process (see the module docstring)."""
    INJECTOR.arm(spec)


def clear() -> None:
    """Disarm every fault in this process."""
    INJECTOR.clear()
