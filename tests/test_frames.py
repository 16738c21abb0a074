"""The directory's frame reader: a node's byte stream cut into messages however it arrives, an
oversized request skipped and refused, a bad one refused, anything else an error after the
messages before it."""

from __future__ import annotations

import msgpack
import pytest

from hoplite_gpu import protocol as p
from hoplite_gpu.directory.frames import REQUEST_HEAD_BYTES, SKIPPED_FRAME_LIMITS, FrameReader, Refusal
from hoplite_gpu.errors import ProtocolError

pytestmark = pytest.mark.timeout(30)

LIMIT = 4096
OID = b"o" * 20


def _messages() -> list[p.Message]:
    return [
        p.LookupRequest(request_id=1, object_id=OID, timeout=0.0),
        p.PutRequest(2, OID, 8, "|u1", [8], b"", bytes(8)),
        p.Heartbeat(),
        p.DeleteRequest(request_id=3, object_id=OID),
    ]


def _frame(body: list) -> bytes:
    payload = msgpack.packb(body, use_bin_type=True)
    return p.FRAME_HEADER.pack(len(payload)) + payload


@pytest.mark.parametrize("step", [1, 3, 7, 64, 1 << 16])
def test_messages_come_out_whole_however_the_bytes_arrive(step: int) -> None:
    stream = b"".join(p.encode(m) for m in _messages())
    reader, got = FrameReader(LIMIT), []
    for i in range(0, len(stream), step):
        items, error = reader.feed(stream[i : i + step])
        assert error is None
        got += items
    assert got == _messages()


def test_an_oversized_request_is_skipped_in_pieces_and_refused_in_its_place() -> None:
    big = p.encode(p.PutRequest(7, OID, LIMIT * 2, "|u1", [LIMIT * 2], b"", bytes(LIMIT * 2)))
    after = p.encode(p.DeleteRequest(request_id=8, object_id=OID))
    reader = FrameReader(LIMIT)
    items, error = reader.feed(big[: REQUEST_HEAD_BYTES + 10])
    assert items == [] and error is None
    items, error = reader.feed(big[REQUEST_HEAD_BYTES + 10 :] + after)
    assert error is None
    assert isinstance(items[0], Refusal) and (items[0].kind, items[0].request_id) == ("put", 7)
    assert "over the directory's control message limit" in items[0].why
    assert items[1:] == [p.DeleteRequest(request_id=8, object_id=OID)]
    assert len(reader._buf) == 0  # never held whole


def test_a_frame_far_over_the_limit_or_not_a_request_ends_the_connection() -> None:
    first = p.encode(p.Heartbeat())
    body = p.encode(p.DeleteRequest(1, OID))[p.FRAME_HEADER.size :] + bytes(REQUEST_HEAD_BYTES)
    huge = p.FRAME_HEADER.pack(SKIPPED_FRAME_LIMITS * LIMIT + 1) + body
    items, error = FrameReader(LIMIT).feed(first + huge)
    assert items == [p.Heartbeat()]
    assert isinstance(error, ProtocolError) and "exceeds the limit" in str(error)
    # Over the limit, and its head names no request the directory answers.
    heartbeat = p.encode(p.Heartbeat())[p.FRAME_HEADER.size :] + bytes(REQUEST_HEAD_BYTES)
    items, error = FrameReader(LIMIT).feed(p.FRAME_HEADER.pack(LIMIT + 1) + heartbeat)
    assert items == [] and isinstance(error, ProtocolError)


def test_a_request_failing_its_checks_is_refused_and_garbage_is_an_error() -> None:
    bad = _frame([p.PROTOCOL_VERSION, "delete", {"request_id": 9, "object_id": b"short"}])
    items, error = FrameReader(LIMIT).feed(bad + p.encode(p.Heartbeat()))
    assert error is None
    assert isinstance(items[0], Refusal) and items[0].request_id == 9 and items[1] == p.Heartbeat()
    items, error = FrameReader(LIMIT).feed(p.encode(p.Heartbeat()) + _frame(["nonsense"]))
    assert items == [p.Heartbeat()] and isinstance(error, ProtocolError)
