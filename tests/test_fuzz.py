"""Fuzzing what peers send (issue 18), bounded in time: ``make test`` runs a few hundred cases,
``make fuzz`` many more (``HOPLITE_FUZZ_EXAMPLES``).

* Any frame body, well-typed or not, either decodes into a message or raises ProtocolError.
* Sequences of messages that decode, from three nodes sharing a small pool of ids (so that
  puts, lookups, transfers, reductions and deletes meet), keep the directory's state machine
  consistent: no handler fails and every invariant holds after every event.
* Frames of any shape sent to a real directory service over a socket, before or after
  authenticating, cost at most that connection: a node's put and get work after each case.
"""

from __future__ import annotations

import math
import os
import typing
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hoplite_gpu import protocol as p
from hoplite_gpu.directory.config import DirectoryConfig
from hoplite_gpu.directory.state import DirectoryState, NodeJoined, NodeLeft, Request, Tick
from hoplite_gpu.errors import ProtocolError

pytestmark = pytest.mark.timeout(600)

EXAMPLES = int(os.environ.get("HOPLITE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

ANY = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
MESSAGES = sorted(p._REGISTRY)  # every message type, in both directions


def _value_for(hint: Any) -> st.SearchStrategy[Any]:
    """Values of the field's own type (often out of range), or anything at all."""
    origin = typing.get_origin(hint)
    if hint is int:
        typed: st.SearchStrategy[Any] = st.integers(min_value=-(2**63), max_value=2**64 - 1)
    elif hint is float:
        typed = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 5)
    elif hint is bool:
        typed = st.booleans()
    elif hint is str:
        typed = st.text(max_size=30) | st.sampled_from(["<f4", "|u1", "[x", "", "sum", "n1"])
    elif hint is bytes:
        typed = st.binary(max_size=30) | st.just(b"i" * 20)
    elif origin is list:
        (inner,) = typing.get_args(hint)
        typed = st.lists(_value_for(inner), max_size=4)
    else:
        typed = ANY
    return typed | ANY


@st.composite
def _frame(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(MESSAGES))
    hints = p._hints(p._REGISTRY[kind])
    names = draw(st.lists(st.sampled_from([*sorted(hints), "extra"]), unique=True, max_size=len(hints) + 1))
    body = {name: draw(_value_for(hints.get(name, Any))) for name in names}
    version = draw(st.sampled_from([p.PROTOCOL_VERSION, p.PROTOCOL_VERSION, 0]))
    return msgpack.packb([version, kind, body], use_bin_type=True)


@FUZZ
@given(_frame())
def test_any_frame_decodes_or_raises_protocol_error(frame: bytes) -> None:
    try:
        msg = p.decode(frame)
    except ProtocolError:
        return
    assert p.decode(p.encode(msg)[4:]) == msg


NODES = ("A", "B", "C")
IDS = [bytes([65 + i]) * 20 for i in range(4)]
SIZE = st.sampled_from([(4, [1], "<f4"), (8, [2], "<f4"), (1 << 20, [1 << 18], "<f4"), (0, [0], "|u1")])


@st.composite
def _request(draw: st.DrawFn) -> p.Message:
    oid = draw(st.sampled_from(IDS))
    size, shape, dtype = draw(SIZE)
    rid = draw(st.integers(1, 6))
    inline = draw(st.sampled_from([None, b"\0" * size])) if size <= 64 else None
    timeout = draw(st.sampled_from([0.0, 0.5, 3.0]))
    choice = draw(st.integers(0, 11))
    if choice == 0:
        return p.PutRequest(rid, oid, size, dtype, shape, b"d" * 16, inline)
    if choice == 1:
        return p.Restore(oid, size, dtype, shape, b"d" * 16, owner=draw(st.booleans()), inline=inline)
    if choice == 2:
        have, resume = draw(st.sampled_from([0, 4])), draw(st.booleans())
        return p.LookupRequest(rid, oid, timeout, have_bytes=have, resume=resume)
    if choice == 3:
        return p.CancelLookup(rid)
    if choice == 4:
        return p.TransferDone(
            draw(st.integers(1, 8)), draw(st.booleans()), draw(st.sampled_from([0, 4, size]))
        )
    if choice == 5:
        return p.CopyAdded(oid)
    if choice == 6:
        return p.ServeDone(draw(st.integers(1, 8)), size, 0, failed=draw(st.booleans()))
    if choice == 7:
        return p.DeleteRequest(rid, oid)
    if choice == 8:
        inputs = draw(st.lists(st.sampled_from(IDS), min_size=1, max_size=4, unique=True))
        result = draw(st.sampled_from([*IDS, b"R" * 20]))
        k = draw(st.integers(1, len(inputs)))
        return p.ReduceRequest(rid, result, inputs, draw(st.sampled_from(["sum", "max", "bad"])), k, timeout)
    if choice == 9:
        return p.ReducedObjectsRequest(rid, draw(st.sampled_from([*IDS, b"R" * 20])), timeout)
    if choice == 10:
        return p.VertexDone(
            draw(st.sampled_from([*IDS, b"R" * 20])),
            draw(st.integers(0, 3)),
            draw(st.booleans()),
            epoch=draw(st.integers(0, 2)),
            retry=draw(st.booleans()),
        )
    return p.Heartbeat()


@st.composite
def _events(draw: st.DrawFn) -> list[tuple[str, Any]]:
    steps = []
    for _ in range(draw(st.integers(1, 40))):
        what = draw(st.integers(0, 9))
        node = draw(st.sampled_from(NODES))
        if what == 0:
            steps.append(("tick", draw(st.floats(0.0, 2.0))))
        elif what == 1:
            steps.append(("leave", node))
        elif what == 2:
            steps.append(("join", node))
        else:
            steps.append(("request", (node, draw(_request()))))
    return steps


@FUZZ
@given(_events())
def test_message_sequences_keep_the_directory_consistent(steps: list[tuple[str, Any]]) -> None:
    state = DirectoryState(DirectoryConfig(inline_threshold_bytes=64, lease_timeout=math.inf, validate=True))
    now = 0.0
    joined = set()
    for i, node in enumerate(NODES):
        state.handle(NodeJoined(node, "127.0.0.1", 7000 + i, now))
        joined.add(node)
    for kind, arg in steps:
        now += 0.1
        if kind == "tick":
            now += arg
            state.handle(Tick(now))
        elif kind == "leave" and arg in joined:
            state.handle(NodeLeft(arg, now))
            joined.discard(arg)
        elif kind == "join" and arg not in joined:
            state.handle(NodeJoined(arg, "127.0.0.1", 7000 + NODES.index(arg), now))
            joined.add(arg)
        elif kind == "request":
            node, msg = arg
            try:
                msg = p.decode(p.encode(msg)[4:])  # what the service would hand the state
            except ProtocolError:
                continue
            state.handle(Request(node, msg, now))  # validate=True: raises on a broken invariant
        failed = [e for e in state.events if e["kind"] == "handler_failed"]
        assert not failed, failed


# --------------------------------------------------------------------------- the real service
SERVICE_EXAMPLES = max(30, EXAMPLES // 6)


@pytest.fixture(scope="module")
def service_node() -> Any:
    """A node with an embedded directory (a real DirectoryService on loopback)."""
    import hoplite_gpu as hg

    node = hg.init(shared_memory=False)
    yield node
    node.close()


@settings(max_examples=SERVICE_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=st.lists(_frame(), min_size=1, max_size=6), authenticated=st.booleans())
def test_frames_sent_to_the_real_service_cost_at_most_their_connection(
    service_node: Any, frames: list[bytes], authenticated: bool
) -> None:
    """Frames of any shape, sent before or after authenticating, over a real connection: the
    directory closes that connection at worst (never crashes, never stops serving), and a node's
    put and get still work after each case. Invariant violations fail the test through the
    suite's check of every directory it starts (conftest)."""
    import socket

    import numpy as np

    from tests.test_hardening import _raw_node

    address = service_node.directory_address
    if authenticated:
        sock = _raw_node(address, service_node.token, f"fuzz-{os.getpid()}")
    else:
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=10)
    with sock:
        for body in frames:
            try:
                sock.sendall(p.FRAME_HEADER.pack(len(body)) + body)
            except OSError:  # closed by the directory after a bad frame: what is expected
                break
    data = np.arange(16, dtype=np.int32)
    oid = service_node.put(data)
    assert np.array_equal(service_node.get(oid, timeout=10), data)
    service_node.delete(oid)
