"""A node's byte stream cut into messages as bytes arrive: pure (bytes in, messages out), so the
service reads whatever a connection holds at once and handles every request in it before it
writes the replies, one write per connection (a send per reply took 45% of the directory's
CPU with 12 requests in flight: bench/pages/small-operations.md, "The directory's throughput").

A frame over the control message limit that names a request the directory answers is skipped a
piece at a time (never held whole) and refused with an ``ErrorReply``, as is a request that fails
its checks: closing the connection made the node reconnect and send it again, forever. Anything
else that cannot be answered is a :class:`~hoplite_gpu.errors.ProtocolError`: the connection is
then closed, after the messages before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from .. import protocol as p
from ..errors import ProtocolError

#: Messages the directory answers: one it refuses is answered with an ``ErrorReply`` naming its
#: ``request_id`` (what it waits for), not by closing the connection.
ANSWERED = frozenset(
    cls.TYPE
    for cls in (
        p.PutRequest,
        p.LookupRequest,
        p.DeleteRequest,
        p.ReduceRequest,
        p.ReducedObjectsRequest,
        p.EventLogRequest,
        p.SummaryRequest,
        p.PingRequest,
        p.BarrierRequest,
    )
)
#: Bytes of an oversized frame read to find which request it is (its type and ``request_id``
#: come first).
REQUEST_HEAD_BYTES = 256
#: An oversized request up to this many times the limit is skipped and refused; a larger frame
#: closes the connection.
SKIPPED_FRAME_LIMITS = 16


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request the directory refuses: answer ``request_id`` with an ``InvalidArgumentError``."""

    kind: str
    request_id: int
    why: str


def answered_request(body: bytes) -> tuple[str, int] | None:
    """``(type, request_id)`` of the request a frame body (or its start) holds, if it is one the
    directory answers (:data:`ANSWERED`) and names its ``request_id`` within ``body``; None
    otherwise. Reads only the frame's shape: nothing else in it need be valid."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(body), 1))
    unpacker.feed(body)
    try:
        if unpacker.read_array_header() != 3 or unpacker.unpack() != p.PROTOCOL_VERSION:
            return None
        kind = unpacker.unpack()
        if kind not in ANSWERED:
            return None
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() != "request_id":
                unpacker.skip()
                continue
            request_id = unpacker.unpack()
            if isinstance(request_id, int) and not isinstance(request_id, bool) and request_id >= 0:
                return str(kind), request_id
            return None
    except Exception:  # truncated, or not msgpack: msgpack raises several unrelated types
        return None
    return None


class FrameReader:
    """Cuts one connection's bytes into messages (see the module's docstring).

    Args:
        limit: The control message limit (``DirectoryConfig.max_message_bytes``).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()
        self._skip = 0  # bytes of an oversized frame still to skip
        self._skipped: Refusal | None = None  # its refusal, once skipped

    def feed(self, data: bytes) -> tuple[list[p.Message | Refusal], ProtocolError | None]:
        """The messages and refusals ``data`` completes, in order, and the error that ends the
        connection after them (None: it goes on)."""
        buf = self._buf
        buf += data
        out: list[p.Message | Refusal] = []
        pos = 0
        error: ProtocolError | None = None
        try:
            while True:
                if self._skipped is not None:
                    step = min(self._skip, len(buf) - pos)
                    pos += step
                    self._skip -= step
                    if self._skip:
                        break
                    out.append(self._skipped)
                    self._skipped = None
                if len(buf) - pos < p.FRAME_HEADER.size:
                    break
                (length,) = p.FRAME_HEADER.unpack_from(buf, pos)
                start = pos + p.FRAME_HEADER.size
                if length > self.limit:
                    head = bytes(buf[start : start + min(length, REQUEST_HEAD_BYTES)])
                    if len(head) < min(length, REQUEST_HEAD_BYTES):
                        break
                    request = answered_request(head)
                    if request is None or length > SKIPPED_FRAME_LIMITS * self.limit:
                        raise ProtocolError(
                            f"control message of {length} bytes exceeds the limit of {self.limit}"
                        )
                    why = (
                        f"{length} bytes, over the directory's control message limit of {self.limit} "
                        "(Config.control_message_limit)"
                    )
                    pos, self._skip, self._skipped = (
                        start + len(head),
                        length - len(head),
                        Refusal(*request, why),
                    )
                    continue
                if len(buf) - start < length:
                    break
                payload = bytes(buf[start : start + length])
                pos = start + length
                try:
                    out.append(p.decode(payload))
                except ProtocolError as exc:
                    request = answered_request(payload)
                    if request is None:
                        raise
                    out.append(Refusal(*request, str(exc)))
        except ProtocolError as exc:
            error = exc
        del buf[:pos]
        return out, error
