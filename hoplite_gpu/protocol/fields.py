"""Limits and value checks of control-message fields.

The messages' ``check()`` methods (:mod:`.messages`) call these after :func:`~.codec.decode` has
matched every field's type, so the state machines only ever see valid input. The limits bound what
a peer's texts can cost the directory (its state and event log keep them).
"""

from __future__ import annotations

import math
import re

from ..errors import InvalidArgumentError, ProtocolError
from ..object_id import OBJECT_ID_SIZE

#: Longest node id, host key or host name accepted.
MAX_NAME_CHARS = 128
#: Most dimensions of an object's shape.
MAX_DIMS = 64
#: Longest text field by default; a few fields have their own limit (:data:`FIELD_LIMITS`), and
#: ``inline`` (object bytes) and ``events`` are bounded by the frame size alone. Peers' texts end
#: up in the directory's state and event log, whose size these limits bound.
MAX_TEXT_CHARS = 4096
#: Largest hello a directory reads (before the node is authenticated): its GPU inventory included.
MAX_HELLO_BYTES = 64 * 1024
#: Fields of messages from nodes with a limit other than :data:`MAX_TEXT_CHARS`.
FIELD_LIMITS = {
    "reason": 1024,
    "abort": 1024,
    "segment": MAX_NAME_CHARS,
    "digest": 64,
    "nonce": 64,
    "proof": 64,
    "inline": 1 << 62,
}
#: Widest encoding-matrix row a ReduceRequest's ``coding`` may carry.
MAX_CODING_COLUMNS = 4096
#: :attr:`~.messages.PutRequest.memory` values: host memory, device memory.
MEMORY_KINDS = ("", "device")
#: What a copy's ``segment`` starts with when it names a device memory ticket
#: (:mod:`hoplite_gpu.memory.ipc`) rather than a shared-memory segment.
IPC_SEGMENT_PREFIX = "ipc:"

_NAME = re.compile(r"[A-Za-z0-9._:-]+")


def check_name(kind: str, name: str, value: str, empty: bool = False) -> None:
    """Node and directory ids: 1-128 characters of ``[A-Za-z0-9._:-]`` (or "" where allowed)."""
    if value == "" and empty:
        return
    if len(value) > MAX_NAME_CHARS or not _NAME.fullmatch(value):
        raise ProtocolError(f"{kind}: {name} must be 1-{MAX_NAME_CHARS} characters of [A-Za-z0-9._:-]")


def check_id(kind: str, name: str, value: bytes) -> None:
    """An ObjectID's length."""
    if len(value) != OBJECT_ID_SIZE:
        raise ProtocolError(f"{kind}: {name} has {len(value)} bytes, not {OBJECT_ID_SIZE}")


def check_weights(kind: str, weights: list[float]) -> None:
    """Every weight a finite number."""
    if not all(math.isfinite(w) for w in weights):
        raise ProtocolError(f"{kind}: a weight is not a finite number")


def check_timeout(kind: str, value: float) -> None:
    """A timeout: finite and not negative (0: none)."""
    if not (math.isfinite(value) and value >= 0):
        raise ProtocolError(f"{kind}: timeout {value!r} is not a finite number >= 0")


#: What a request carries for a wait with no time left (a call's ``timeout=0``, or a deadline
#: that passed): on the wire 0 means no timeout, so the least it carries is this; the directory
#: answers at once what it has and times out the rest.
LEAST_WIRE_TIMEOUT = 1e-3


def wire_timeout(timeout: float | None) -> float:
    """A wait's ``timeout`` as a request carries it: 0 for none (None), else at least
    :data:`LEAST_WIRE_TIMEOUT`."""
    return 0.0 if timeout is None else max(float(timeout), LEAST_WIRE_TIMEOUT)


def check_object(
    kind: str, object_id: bytes, size: int, dtype: str, shape: list[int], inline: bytes | None
) -> None:
    """An object's description: its id's length, a dtype NumPy accepts, and a size that is its
    shape times its itemsize (and its inline bytes' length). The dtype text is already bounded
    by :func:`~.codec.decode` (:data:`MAX_TEXT_CHARS`)."""
    from ..dtypes import dtype_from_wire  # NumPy stays out of this module's import

    check_id(kind, "object_id", object_id)
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise ProtocolError(f"{kind}: shape out of range")
    try:
        itemsize = dtype_from_wire(dtype).itemsize
    except InvalidArgumentError as exc:
        raise ProtocolError(f"{kind}: {exc}") from None
    if size != math.prod(shape) * itemsize:
        raise ProtocolError(f"{kind}: size {size} is not shape {tuple(shape)} x itemsize {itemsize}")
    if inline is not None and len(inline) != size:
        raise ProtocolError(f"{kind}: {len(inline)} inline bytes for an object of {size}")


def check_memory(kind: str, memory: str) -> None:
    """A memory kind of :data:`MEMORY_KINDS`."""
    if memory not in MEMORY_KINDS:
        raise ProtocolError(f"{kind}: memory {memory[:40]!r} is not one of {list(MEMORY_KINDS)}")
