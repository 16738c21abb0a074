"""A get of a deleted object fails at once with ObjectDeletedError, while a get before a put still
waits (issue 39, finding 8): the directory remembers the latest deletes, bounded."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu.directory import catalog
from hoplite_gpu.protocol import DeleteRequest, LookupReply
from tests.procs import MARGIN, Worker, digest, make_array, start_workers
from tests.test_directory_state import OID, done, lookup, make_state, pull, put, req

pytestmark = pytest.mark.timeout(120)


def _deleted(out: list[Any], node: str, rid: int, oid: bytes = OID) -> None:
    """``out`` is one answer to ``node``'s lookup ``rid``: ``oid`` was deleted."""
    assert len(out) == 1 and out[0].node_id == node
    msg = out[0].message
    assert isinstance(msg, LookupReply)
    assert (msg.request_id, msg.status, msg.error_kind, msg.error_object_id) == (
        rid,
        "error",
        "ObjectDeletedError",
        oid,
    )
    assert "deleted" in msg.error


def test_a_lookup_of_a_deleted_object_fails_and_one_before_a_put_waits() -> None:
    state = make_state("A", "B")
    other = b"o" * 20
    assert lookup(state, "B", 1, oid=other) == []  # never put: it waits, as a get before a put may
    put(state, "A")
    req(state, "A", DeleteRequest(2, OID))
    _deleted(lookup(state, "B", 3), "B", 3)
    _deleted(lookup(state, "B", 4, timeout=0.0), "B", 4)  # no timeout: still answered at once
    assert state.pending.keys() == {other}


def test_a_lookup_waiting_for_a_busy_source_fails_when_the_object_is_deleted() -> None:
    state = make_state("A", "B", "C")
    put(state, "A")
    pull(lookup(state, "B", 1), "B", 1, "A")  # A is busy serving B
    req(state, "B", DeleteRequest(5, OID))  # B drops its partial copy: A, busy, is the only source
    assert lookup(state, "C", 2) == []  # C waits for it
    out = req(state, "A", DeleteRequest(3, OID))
    _deleted([s for s in out if s.node_id == "C"], "C", 2)
    assert state.pending == {}


def test_an_id_put_again_after_its_delete_is_served_again() -> None:
    state = make_state("A", "B")
    put(state, "A")
    req(state, "A", DeleteRequest(2, OID))
    put(state, "A")
    done(state, "B", pull(lookup(state, "B", 3), "B", 3, "A").transfer_id)
    req(state, "A", DeleteRequest(4, OID))  # deleted once more, then a lookup before the next put
    _deleted(lookup(state, "B", 5), "B", 5)
    put(state, "A", rid=101)
    assert OID not in state.catalog.deleted


def test_the_directory_remembers_only_the_latest_deletes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalog, "DELETES_KEPT", 3)
    state = make_state("A", "B")
    oids = [bytes([i]) * 20 for i in range(5)]
    for i, oid in enumerate(oids):
        put(state, "A", rid=10 + i, oid=oid)
        req(state, "A", DeleteRequest(20 + i, oid))
    assert list(state.catalog.deleted) == oids[2:]
    assert lookup(state, "B", 1, oid=oids[0]) == []  # forgotten: an unknown id, which waits
    _deleted(lookup(state, "B", 2, oid=oids[4]), "B", 2, oids[4])


@pytest.fixture(scope="module")
def reader(owner: Any) -> Iterator[Worker]:
    """Another process with its own node."""
    (worker,) = start_workers(owner.directory_address, owner.token, 1)
    yield worker
    worker.stop()


@pytest.mark.parametrize("size", [16, 1 << 20], ids=["inline", "pulled"])
def test_a_get_of_a_deleted_object_raises_object_deleted_error_elsewhere(
    owner: Any, reader: Worker, size: int
) -> None:
    oid = hg.ObjectID.random()
    owner.put(make_array("uint8", (size,), 3), oid)
    assert reader.call("get", oid.hex(), 60.0) == digest(make_array("uint8", (size,), 3))
    assert reader.call("delete", oid.hex()) is False  # the reader drops its own copy only
    assert owner.delete(oid) is True
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="ObjectDeletedError"):
        reader.call("get", oid.hex(), None, timeout=30.0)  # the default timeout: none (forever)
    assert time.monotonic() - started < MARGIN  # at once: the directory knows it was deleted
    with pytest.raises(hg.ObjectDeletedError, match="deleted"):
        owner.get(oid)
    owner.put(np.arange(4, dtype=np.int32), oid)  # the id may be used anew
    assert reader.call("get", oid.hex(), 60.0) == digest(np.arange(4, dtype=np.int32))
    owner.delete(oid)


def test_delete_many_deletes_each_object_with_one_request(owner: Any, reader: Worker) -> None:
    """``delete_many``: each object as :meth:`Node.delete` would, the owner's everywhere and
    another's copy here only, with one request; what each answered, in order."""
    mine = [hg.ObjectID.random() for _ in range(3)]
    for i, oid in enumerate(mine):
        owner.put(make_array("uint8", (1 << 20,), i), oid)
    theirs = hg.ObjectID.from_hex(reader.call("put", "uint8", (1 << 20,), 9, ""))
    assert owner.get(theirs).nbytes == 1 << 20  # a copy here too
    for oid in mine:  # the reader holds copies of mine
        reader.call("get", oid.hex(), 60.0)
    sent = owner.directory_summary()["handled"].get("delete", 0)
    assert owner.delete_many([*mine, theirs, hg.ObjectID.random()]) == [True, True, True, False, False]
    assert owner.directory_summary()["handled"]["delete"] == sent + 1
    for oid in mine:
        with pytest.raises(RuntimeError, match="ObjectDeletedError"):
            reader.call("get", oid.hex(), 30.0)
    assert not owner.contains(theirs)  # this node's copy went; the reader's own stays
    assert reader.call("get", theirs.hex(), 60.0) == digest(make_array("uint8", (1 << 20,), 9))
    assert owner.delete_many([]) == []
    reader.call("delete", theirs.hex())


@pytest.mark.parametrize("bad", ["ab" * 20, hg.ObjectID.random(), [b"x" * 20], 7, None])
def test_delete_many_takes_a_list_of_object_ids(owner: Any, bad: Any) -> None:
    with pytest.raises(hg.InvalidArgumentError, match="object_ids"):
        owner.delete_many(bad)
