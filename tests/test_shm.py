"""Same-host copies through shared memory: segments, the directory's choice, real processes."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu import protocol as p
from hoplite_gpu.directory.config import DirectoryConfig
from hoplite_gpu.directory.state import DirectoryState, NodeJoined, NodeLeft, Request, Send
from hoplite_gpu.memory import shm
from hoplite_gpu.memory.buffers import BufferPool, through_file, write_at
from tests.procs import Worker, digest, make_array, start_workers, wait_for_events

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm"),
]

OID = b"o" * 20


def _ours() -> set[str]:
    """Segment files created by this test process."""
    ns = os.stat("/proc/self/ns/pid").st_ino
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"hoplite-{ns}-{os.getpid()}-")}


# ---------------------------------------------------------------- segments
def _read(name: str, object_id: bytes, nbytes: int) -> np.ndarray[Any, Any] | None:
    """:func:`shm.read_locked` as :func:`shm.map_view` answers: the payload's bytes, or None."""
    read = shm.read_locked(name, object_id, nbytes)
    if read is None:
        return None
    read.close()
    return np.frombuffer(read.payload, np.uint8)


@pytest.mark.parametrize("reader", [shm.map_view, _read], ids=["map_view", "read_locked"])
def test_published_payload_is_mapped_and_anything_else_is_refused(reader: Any) -> None:
    buf = shm.create(1000)
    assert buf is not None
    seg = shm.segment_of(buf)
    assert seg is not None and os.path.exists(os.path.join(shm.SHM_DIR, seg.name))
    buf[:] = np.arange(1000) % 251
    assert reader(seg.name, OID, 1000) is None  # not published yet
    seg.publish(OID)
    view = reader(seg.name, OID, 1000)
    assert view is not None and np.array_equal(view, buf) and not view.flags.writeable
    assert reader(seg.name, b"x" * 20, 1000) is None  # another object
    assert reader(seg.name, OID, 999) is None  # another size
    assert reader(seg.name, OID, 1001) is None
    seg.retire()
    assert reader(seg.name, OID, 1000) is None
    seg.publish(b"y" * 20)  # reused for another object
    assert reader(seg.name, OID, 1000) is None
    seg.unlink()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, seg.name))
    assert reader(seg.name, b"y" * 20, 1000) is None


def test_a_read_holds_the_lock_until_closed_or_dropped() -> None:
    buf = shm.create(64)
    seg = shm.segment_of(buf)
    assert seg is not None
    seg.publish(OID)
    read = shm.read_locked(seg.name, OID, 64)
    assert read is not None and seg.mapped_elsewhere()
    read.close()
    read.close()  # idempotent
    assert not seg.mapped_elsewhere()
    read = shm.read_locked(seg.name, OID, 64)
    assert read is not None and seg.mapped_elsewhere()
    del read  # garbage: the lock goes with it
    assert not seg.mapped_elsewhere()
    seg.unlink()


def test_a_mapped_segment_is_not_reused_and_outlives_its_file() -> None:
    pool = BufferPool(1 << 20, shared_min_bytes=4096)
    buf = pool.allocate(8192)
    seg = shm.segment_of(buf)
    assert seg is not None
    buf[:] = 7
    seg.publish(OID)
    assert not seg.mapped_elsewhere()
    probe = shm.map_view(seg.name, OID, 8192)
    assert probe is not None and seg.mapped_elsewhere()
    del probe
    assert not seg.mapped_elsewhere()  # the view went: its lock with it
    view = shm.map_view(seg.name, OID, 8192)
    assert view is not None and seg.mapped_elsewhere()
    part = view[100:200]  # a slice keeps the mapping (and its lock) as well
    del view
    pool.release(buf)
    del buf
    other = pool.allocate(8192)  # the held segment is skipped: a fresh one
    assert shm.segment_of(other) is not seg and pool.reused == 0
    pool.clear()  # unlinks the file of the segment still mapped
    assert not os.path.exists(os.path.join(shm.SHM_DIR, seg.name))
    assert (part == 7).all()  # the reader's memory stays valid
    del part
    pool.release(other)
    pool.clear()


def test_a_reader_keeps_its_mapping_for_the_next_object_in_the_same_segment() -> None:
    """Once no view uses a mapping its lock goes but the mapping stays: the holder may reuse the
    segment, and the next read of it (another object) maps nothing anew. A kept mapping whose
    file is gone is unmapped at the next release."""
    size = 1 << 20
    buf = shm.create(size)
    seg = shm.segment_of(buf)
    assert buf is not None and seg is not None
    buf[:] = 1
    seg.publish(OID)
    view = shm.map_view(seg.name, OID, size)
    assert view is not None and seg.mapped_elsewhere()
    mapping = view.base  # the mmap (holding it keeps no lock: only views do)
    del view
    assert not seg.mapped_elsewhere()  # the lock went with the view; the mapping stayed
    seg.begin_write()
    buf[:] = 2
    seg.publish(b"n" * 20)  # the holder reused it for another object
    again = shm.map_view(seg.name, b"n" * 20, size)
    assert again is not None and again.base is mapping and (again == 2).all()
    assert shm.map_view(seg.name, OID, size) is None and seg.mapped_elsewhere()  # still held
    inode = os.stat(os.path.join(shm.SHM_DIR, seg.name)).st_ino
    del again, mapping
    seg.unlink()
    assert inode in shm._MAPPED
    other = shm.create(4096)
    second = shm.segment_of(other)
    assert second is not None
    second.publish(OID)
    probe = shm.map_view(second.name, OID, 4096)
    del probe  # a release trims what is kept: the unlinked segment's mapping goes
    assert inode not in shm._MAPPED
    second.unlink()
    shm.drop_kept_mappings()
    assert not [m for m in shm._MAPPED.values() if not m.views]


@pytest.mark.parametrize("name", ["../../etc/passwd", "hoplite-1-2-3-zz", "", "hoplite-1-2-3-ab/../x"])
def test_names_from_the_network_are_checked(name: str) -> None:
    assert not shm.valid_name(name)
    assert shm.map_view(name, OID, 8) is None
    assert shm.read_locked(name, OID, 8) is None


def test_pool_puts_large_buffers_in_segments_and_unlinks_them_when_dropped() -> None:
    before = _ours()
    pool = BufferPool(1 << 20, shared_min_bytes=4096)
    small, large = pool.allocate(100), pool.allocate(8192)
    assert shm.segment_of(small) is None
    seg = shm.segment_of(large)
    assert seg is not None and not seg.published
    seg.publish(OID)
    pool.release(large)
    assert not seg.published  # retired at once: readers refuse it
    del large, seg
    again = pool.allocate(8192)
    assert pool.reused == 1 and shm.segment_of(again) is not None
    pool.release(again)
    assert len(_ours() - before) == 1
    pool.clear()
    assert _ours() == before


def test_orphaned_segments_of_a_killed_process_are_swept() -> None:
    import subprocess
    import sys

    code = (
        "import os, sys, signal; from hoplite_gpu.memory import shm; b = shm.create(1 << 16); "
        "print(shm.segment_of(b).name, flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    name = proc.stdout.strip()
    assert os.path.exists(os.path.join(shm.SHM_DIR, name))
    assert shm.sweep_orphans() >= 1
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))


# ---------------------------------------------------------------- index links
CLUSTER = "0123456789abcdef"


def test_an_index_link_is_one_live_holders_and_goes_with_its_segment() -> None:
    oid = os.urandom(20)
    name = shm.index_name(CLUSTER, oid)
    path = os.path.join(shm.SHM_DIR, name)
    a, b = (shm.segment_of(shm.create(64)) for _ in range(2))
    assert a is not None and b is not None
    a.publish(oid)
    assert a.link(name) and os.path.samefile(path, os.path.join(shm.SHM_DIR, a.name))
    view = shm.map_view(name, oid, 64)  # a reader finds the segment under the index name
    assert view is not None
    del view
    read = shm.read_locked(name, oid, 64)  # ... or reads it, and its creator (this process)
    assert read is not None and read.creator == os.getpid() and shm.alive(read.creator)
    assert a.mapped_elsewhere()  # the read holds the segment's lock
    read.close()
    assert not a.mapped_elsewhere()
    assert not b.link(name)  # a live holder's link stays
    a.retire()
    assert not os.path.exists(path)  # gone with the object
    assert b.link(name) and os.path.samefile(path, os.path.join(shm.SHM_DIR, b.name))
    a.unlink()  # a's links went at retire: b's stays
    assert os.path.exists(path)
    b.unlink()
    assert not os.path.exists(path)
    assert not a.link("hoplite-i-not-an-index-name")


def test_index_links_of_a_killed_process_are_replaced_or_swept() -> None:
    import subprocess
    import sys

    oids = [os.urandom(20), os.urandom(20)]
    names = [shm.index_name(CLUSTER, oid) for oid in oids]
    code = (
        "import os, sys, signal; from hoplite_gpu.memory import shm; s = shm.segment_of(shm.create(64)); "
        f"s.publish(bytes.fromhex('{oids[0].hex()}')); "
        f"assert s.link('{names[0]}') and s.link('{names[1]}'); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    paths = [os.path.join(shm.SHM_DIR, n) for n in names]
    assert all(os.path.exists(path) for path in paths)  # a killed process removes nothing
    read = shm.read_locked(names[0], oids[0], 64)  # still published, but its creator is gone,
    assert read is not None and not shm.alive(read.creator)  # a ticket names it too (open_indexed)
    read.close()
    mine = shm.segment_of(shm.create(64))
    assert mine is not None
    assert mine.link(names[1])  # the dead holder's link is replaced
    assert os.path.samefile(paths[1], os.path.join(shm.SHM_DIR, mine.name))
    assert shm.sweep_orphans() >= 2  # the killed process's segment and its other link
    assert not os.path.exists(paths[0]) and os.path.exists(paths[1])
    mine.unlink()
    assert not os.path.exists(paths[1])


def test_a_segment_of_another_user_is_not_read_under_any_name() -> None:
    """A name the directory gave may be made anew by another user once its holder removed it
    (and then truncated under a reader's mapping: SIGBUS): readers open only their own user's
    files, under segment names as under index names."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a file of another user")
    buf = shm.create(64)
    seg = shm.segment_of(buf)
    assert seg is not None
    seg.publish(OID)
    path = os.path.join(shm.SHM_DIR, seg.name)
    index = shm.index_name(CLUSTER, OID)
    assert seg.link(index)
    try:
        os.chown(path, 65534, 65534)  # now another user's (as if it had made the name anew)
        for name in (seg.name, index):
            assert shm.map_view(name, OID, 64) is None
            assert shm.read_locked(name, OID, 64) is None
            assert shm.map_payload(name, 0, 64) is None
        os.chown(path, os.geteuid(), os.getegid())  # this user's again: read
        view = shm.map_view(seg.name, OID, 64)
        assert view is not None and shm.map_payload(seg.name, 0, 64) is not None
        del view
    finally:
        seg.unlink()


# ---------------------------------------------------------------- directory decisions
def _state(**hosts: str) -> DirectoryState:
    state = DirectoryState(DirectoryConfig(lease_timeout=math.inf, validate=True))
    for i, (node, key) in enumerate(hosts.items()):
        state.handle(NodeJoined(node, "127.0.0.1", 7000 + i, 0.0, key))
    return state


def _put(state: DirectoryState, node: str, segment: str) -> None:
    state.handle(Request(node, p.PutRequest(1, OID, 1 << 20, "|u1", [1 << 20], b"d", None, segment), 0.0))


def _lookup(state: DirectoryState, node: str, shared: bool = True) -> p.LookupReply:
    out = state.handle(Request(node, p.LookupRequest(7, OID, 0.0, 0, shared), 0.0))
    (send,) = out
    assert isinstance(send.message, p.LookupReply)
    return send.message


def test_same_host_requester_is_sent_to_the_segment_without_a_transfer() -> None:
    state = _state(A="h1", B="h1")
    _put(state, "A", "hoplite-1-2-3-ab")
    reply = _lookup(state, "B")
    assert (reply.status, reply.segment, reply.sender_node) == ("shm", "hoplite-1-2-3-ab", "A")
    assert not state.transfers and not state.objects[OID].locations["A"].busy
    assert _lookup(state, "B").status == "shm"  # the holder is not busy: any number of readers


@pytest.mark.parametrize(
    ("hosts", "segment", "shared"),
    [
        ({"A": "h1", "B": "h2"}, "hoplite-1-2-3-ab", True),  # other host
        ({"A": "h1", "B": "h1"}, "", True),  # holder has no segment
        ({"A": "h1", "B": "h1"}, "hoplite-1-2-3-ab", False),  # requester cannot use shm
        ({"A": "", "B": ""}, "hoplite-1-2-3-ab", True),  # no shared-memory namespace
    ],
)
def test_otherwise_the_requester_pulls(hosts: dict[str, str], segment: str, shared: bool) -> None:
    state = _state(**hosts)
    _put(state, "A", segment)
    assert _lookup(state, "B", shared).status == "pull"


def test_each_node_is_told_how_many_others_share_its_host() -> None:
    state = DirectoryState(DirectoryConfig(lease_timeout=math.inf, validate=True))

    def join(node: str, key: str) -> list[Any]:
        return state.handle(NodeJoined(node, "127.0.0.1", 7000, 0.0, key))

    assert join("A", "h1") == [Send("A", p.HostPeers(peers=0), "node_joined#1")]
    out = join("B", "h1")
    assert sorted((s.node_id, s.message.peers) for s in out) == [("A", 1), ("B", 1)]
    assert [(s.node_id, s.message.peers) for s in join("C", "h2")] == [("C", 0)]
    assert join("D", "") == []  # no shared memory: nothing to tell
    out = state.handle(NodeLeft("B", 1.0))
    assert [(s.node_id, s.message) for s in out if isinstance(s, Send)] == [("A", p.HostPeers(peers=0))]
    assert sorted((s.node_id, s.message.peers) for s in join("F", "h1")) == [("A", 1), ("F", 1)]
    # A node that joins again under another host key counts there only, and its old host's
    # nodes are told it left them.
    out = join("A", "h2")
    assert sorted((s.node_id, s.message.peers) for s in out if isinstance(s, Send)) == [
        ("A", 1),
        ("C", 1),
        ("F", 0),
    ]
    assert sorted((s.node_id, s.message.peers) for s in join("E", "h1")) == [("E", 1), ("F", 1)]


def test_a_same_host_reader_waits_for_a_segment_still_being_copied_and_others_pull() -> None:
    state = _state(A="h1", B="h1", C="h2")
    put = p.PutRequest(1, OID, 1 << 20, "|u1", [1 << 20], b"d", None, "hoplite-1-2-3-ab", copying=True)
    state.handle(Request("A", put, 0.0))
    assert state.handle(Request("B", p.LookupRequest(7, OID, 0.0, 0, True), 0.0)) == []  # waits
    assert _lookup(state, "C").status == "pull"  # another host streams behind the copy
    (send,) = state.handle(Request("A", p.CopyAdded(OID, "hoplite-1-2-3-ab"), 0.1))
    assert send.node_id == "B" and isinstance(send.message, p.LookupReply)
    assert (send.message.status, send.message.segment) == ("shm", "hoplite-1-2-3-ab")
    # Not waiting for it: a reader that cannot map segments, and a copy without a segment.
    state = _state(A="h1", B="h1")
    state.handle(Request("A", put, 0.0))
    assert _lookup(state, "B", shared=False).status == "pull"
    state = _state(A="h1", B="h1")
    state.handle(Request("A", dataclasses.replace(put, segment=""), 0.0))
    assert _lookup(state, "B").status == "pull"


def test_a_same_host_reader_waits_for_a_copy_received_on_its_host_and_maps_it() -> None:
    """B is receiving the object from another host; C, on B's host, maps B's copy once complete
    instead of pulling it over the host's link again; D, elsewhere, pulls."""
    state = _state(A="h1", B="h2", C="h2", D="h3")
    _put(state, "A", "hoplite-1-2-3-ab")
    first = _lookup(state, "B")
    assert (first.status, first.sender_node) == ("pull", "A")
    assert state.handle(Request("C", p.LookupRequest(8, OID, 0.0, 0, True), 0.0)) == []  # waits
    assert _lookup(state, "D").status == "pull"
    done = p.TransferDone(transfer_id=first.transfer_id, ok=True, progress=1 << 20, segment="hoplite-9-9-9-b")
    sends = state.handle(Request("B", done, 0.1))
    (reply,) = [s.message for s in sends if s.node_id == "C"]
    assert isinstance(reply, p.LookupReply)
    assert (reply.status, reply.segment, reply.sender_node) == ("shm", "hoplite-9-9-9-b", "B")
    # Not waiting: a reader that cannot map segments; a partial copy nothing feeds any more.
    state = _state(A="h1", B="h2", C="h2")
    _put(state, "A", "hoplite-1-2-3-ab")
    _lookup(state, "B")
    assert _lookup(state, "C", shared=False).status == "pull"
    state = _state(A="h1", B="h2", C="h2")
    _put(state, "A", "hoplite-1-2-3-ab")
    first = _lookup(state, "B")
    failed = p.TransferDone(transfer_id=first.transfer_id, ok=False, progress=4096)
    state.handle(Request("B", failed, 0.1))
    assert _lookup(state, "C").status == "pull"


@pytest.mark.parametrize(
    ("hosts", "segment", "degree"),
    [
        ({"A": "h1", "B": "h1", "C": "h1", "D": "h1"}, "hoplite-1-2-3-ab", 3),
        ({"A": "h1", "B": "h1", "C": "h1", "D": "h1"}, "", 1),  # put(copy=False): not mappable
        ({"A": "h1", "B": "h1", "C": "h1", "D": "h2"}, "hoplite-1-2-3-ab", 1),
        ({"A": "", "B": "", "C": "", "D": ""}, "hoplite-1-2-3-ab", 1),
    ],
)
def test_a_reduction_of_mappable_inputs_on_one_host_is_a_star(
    hosts: dict[str, str], segment: str, degree: int
) -> None:
    state = _state(**hosts)
    ids = [bytes([i]) * 20 for i in range(4)]
    state.handle(Request("A", p.ReduceRequest(9, b"r" * 20, ids, "sum", 4), 0.0))
    size = 64 << 20
    state.handle(Request("B", p.PutRequest(1, ids[0], size, "|u1", [size], b"d", None, segment), 0.0))
    (tree,) = [e for e in state.events if e["kind"] == "reduce_tree"]
    assert tree["degree"] == degree


def test_a_same_host_reader_of_a_result_waits_for_its_root_and_maps_it_others_stream_it() -> None:
    state = _state(A="h1", B="h1", C="h1", D="h2")
    ids, rid, size = [b"x" * 20, b"y" * 20], b"r" * 20, 64 << 20
    state.handle(Request("A", p.ReduceRequest(9, rid, ids, "sum", 2), 0.0))
    for node, oid in zip("BC", ids, strict=True):
        state.handle(
            Request(node, p.PutRequest(1, oid, size, "|u1", [size], b"d", None, f"hoplite-1-{node}"), 0.0)
        )
    (root,) = [e["node"] for e in state.events if e["kind"] == "reduce_place" and e["vertex"] == 0]
    ask = {n: p.LookupRequest(7, rid, 0.0, 0, True) for n in "AD"}
    assert state.handle(Request("A", ask["A"], 0.0)) == []  # same host as the root: it waits
    (streamed,) = state.handle(Request("D", ask["D"], 0.0))
    assert streamed.message.status == "pull" and streamed.message.sender_node == root
    (mapped,) = [
        out
        for out in state.handle(Request(root, p.VertexDone(rid, 0, True, segment="hoplite-1-R"), 0.1))
        if out.node_id == "A"
    ]
    assert (mapped.message.status, mapped.message.segment) == ("shm", "hoplite-1-R")


def test_copy_added_registers_a_complete_copy_or_drops_a_deleted_one() -> None:
    state = _state(A="h1", B="h1", C="h2")
    _put(state, "A", "hoplite-1-2-3-ab")
    assert state.handle(Request("B", p.CopyAdded(OID, "hoplite-1-2-4-cd"), 0.0)) == []
    loc = state.objects[OID].locations["B"]
    assert loc.state.value == "complete" and loc.segment == "hoplite-1-2-4-cd"
    state.handle(Request("A", p.DeleteRequest(2, OID), 0.0))
    out = state.handle(Request("C", p.CopyAdded(OID, "hoplite-1-9-4-cd"), 0.0))
    assert out == [Send("C", p.DropObject(OID))]


def test_a_segment_made_without_its_pages_is_filled_through_its_file() -> None:
    pool = BufferPool(1 << 20, shared_min_bytes=4096)
    buf = pool.allocate(3 << 20, populate=False)
    seg = shm.segment_of(buf)
    assert seg is not None and not seg.populated and through_file(buf)
    want = (np.arange(3 << 20) % 251).astype(np.uint8)
    for pos in range(0, 3 << 20, 1 << 20):
        write_at(buf, pos, want[pos : pos + (1 << 20)])
    assert np.array_equal(buf, want)  # the file's pages are the mapping's
    write_at(buf[4096:], 10, np.full(5, 7, np.uint8))  # a view inside the payload: its own offset
    assert np.array_equal(buf[4106:4111], np.full(5, 7, np.uint8)) and buf[4105] == want[4105]
    want[4106:4111] = 7
    with pytest.raises(ValueError, match="overrun"):
        seg.write_file((3 << 20) - 2, np.zeros(3, np.uint8))
    seg.publish(OID)
    assert np.array_equal(shm.map_view(seg.name, OID, 3 << 20), want)
    populated = pool.allocate(8192)
    assert not through_file(populated) and not through_file(np.zeros(8192, np.uint8))
    pool.release(buf)
    pool.release(populated)
    pool.clear()


def test_a_reused_segment_is_written_in_place_and_readers_see_the_new_bytes() -> None:
    pool = BufferPool(8 << 20, shared_min_bytes=4096)
    buf = pool.allocate(3 << 20, populate=False)
    seg = shm.segment_of(buf)
    assert seg is not None and through_file(buf)
    first = (np.arange(3 << 20) % 251).astype(np.uint8)
    write_at(buf, 0, first)
    seg.publish(OID)
    assert np.array_equal(shm.map_view(seg.name, OID, 3 << 20), first)
    pool.release(buf)
    del buf
    again = pool.allocate(3 << 20, populate=False)  # the same segment, its pages mapped now
    assert shm.segment_of(again) is seg and pool.reused == 1
    assert seg.populated and not through_file(again)
    second = first[::-1].copy()
    for pos in range(0, 3 << 20, 1 << 20):
        write_at(again, pos, second[pos : pos + (1 << 20)])
    other = b"p" * 20
    seg.publish(other)
    assert np.array_equal(shm.map_view(seg.name, other, 3 << 20), second)  # the file holds them too
    pool.release(again)
    pool.clear()


def test_a_write_after_the_file_went_goes_through_the_mapping_never_to_the_name() -> None:
    buf = shm.create(8192, populate=False)
    assert buf is not None
    seg = shm.segment_of(buf)
    assert seg is not None
    path = os.path.join(shm.SHM_DIR, seg.name)
    seg.unlink()
    assert not seg.write_file(0, np.ones(16, np.uint8))
    with open(path, "wb") as other:  # the name made again by someone else
        other.write(b"\0" * 8192)
    try:
        write_at(buf, 0, np.full(16, 9, np.uint8))
        assert np.array_equal(buf[:16], np.full(16, 9, np.uint8))
        with open(path, "rb") as other:
            assert other.read() == b"\0" * 8192  # not written
    finally:
        os.unlink(path)


# ---------------------------------------------------------------- real processes
@pytest.fixture(scope="module")
def shm_owner() -> Iterator[Any]:
    node = hg.init(shared_memory=True)
    yield node
    node.close()


@pytest.fixture(scope="module")
def shm_workers(shm_owner: Any) -> Iterator[list[Worker]]:
    ws = start_workers(shm_owner.directory_address, shm_owner.token, 3, shared_memory=True)
    yield ws
    for w in ws:
        w.stop()


def _kinds(
    events: list[dict[str, Any]], oid: hg.ObjectID, since: int, besides: str | None = None
) -> list[str]:
    """Kinds of the events about ``oid`` after ``since`` (from nodes other than ``besides``)."""
    return [
        e["kind"]
        for e in events
        if e["seq"] > since and e.get("object_id") == oid.hex() and (besides is None or e["node"] != besides)
    ]


def test_same_host_gets_map_shared_memory(shm_owner: Any, shm_workers: list[Worker]) -> None:
    arr = make_array("float32", (1024, 1024), seed=11)  # 4 MiB
    start = shm_owner.event_log()[-1]["seq"]
    oid = shm_owner.put(arr)
    for w in shm_workers:
        w.send("get", oid.hex(), 60)
    assert [w.result() for w in shm_workers] == [digest(arr)] * 3
    # A put this large is published before its copy finishes; the owner announces its segment
    # with a copy_added of its own once the copy is done.
    owner = shm_owner.node_id
    events = wait_for_events(
        shm_owner, lambda evs: _kinds(evs, oid, start, besides=owner).count("copy_added") == 3, timeout=30
    )
    kinds = _kinds(events, oid, start, besides=owner)
    assert kinds.count("lookup_shm") == 3 and "transfer_start" not in kinds
    shm_owner.delete(oid)


def test_a_put_without_a_copy_is_copied_into_a_segment_that_same_host_readers_map(
    shm_owner: Any, shm_workers: list[Worker]
) -> None:
    arr = make_array("float32", (2048, 1024), seed=17)  # 8 MiB
    start = shm_owner.event_log()[-1]["seq"]
    oid = shm_owner.put(arr, copy=False)
    held = shm_owner._store.get(oid).buffer.array
    assert shm.segment_of(held) is not None and not np.shares_memory(held, arr)
    owner = shm_owner.node_id
    # put returned before the copy ended; the owner announces the segment once it has.
    wait_for_events(shm_owner, lambda evs: "copy_added" in _kinds(evs, oid, start), timeout=30)
    for w in shm_workers:
        w.send("get", oid.hex(), 60)
    assert [w.result() for w in shm_workers] == [digest(arr)] * 3
    kinds = _kinds(shm_owner.event_log(), oid, start, besides=owner)
    assert kinds.count("lookup_shm") == 3 and "transfer_start" not in kinds
    assert digest(shm_owner.get(oid)) == digest(arr)
    shm_owner.delete(oid)
    # Deleted while its copy still runs: nothing breaks, and the next object is intact.
    for seed in (18, 19):
        other = make_array("float32", (2048, 1024), seed=seed)
        oid = shm_owner.put(other, copy=False)
        shm_owner.delete(oid)
    last = shm_owner.put(make_array("float32", (2048, 1024), seed=20), copy=False)
    assert shm_workers[0].call("get", last.hex(), 60) == digest(make_array("float32", (2048, 1024), seed=20))
    shm_owner.delete(last)


def test_a_node_alone_on_its_host_keeps_what_it_lends_until_another_joins() -> None:
    node = hg.init(shared_memory=True)
    workers: list[Worker] = []
    try:
        # The directory tells a node how many others share its host once it joined, before it
        # answers anything the node asks later: after this put's reply the node knows.
        arrays = [make_array("float32", (2048, 1024), seed=s) for s in (21, 22, 23)]  # 8 MiB
        first = node.put(arrays[0], copy=False)
        assert node._memory.host_peers == 0
        alone = node.put(arrays[1], copy=False)  # nobody here would map a copy: none made
        held = node._store.get(alone).buffer.array
        assert shm.segment_of(held) is None and np.shares_memory(held, arrays[1])
        copied = node.put(arrays[0])  # a copy: into private memory (cheaper new) when alone
        assert shm.segment_of(node._store.get(copied).buffer.array) is None
        workers = start_workers(node.directory_address, node.token, 1, shared_memory=True)
        node.delete(first)  # (a request after the worker joined: the node knows it now)
        assert node._memory.host_peers == 1
        start = node.event_log()[-1]["seq"]
        shared = node.put(arrays[2], copy=False)
        held = node._store.get(shared).buffer.array
        assert shm.segment_of(held) is not None and not np.shares_memory(held, arrays[2])
        assert shm.segment_of(node._store.get(node.put(arrays[2])).buffer.array) is not None
        wait_for_events(node, lambda evs: "copy_added" in _kinds(evs, shared, start), timeout=30)
        (w,) = workers
        assert w.call("get", alone.hex(), 60) == digest(arrays[1])  # pulled over the data plane
        assert w.call("get", shared.hex(), 60) == digest(arrays[2])  # mapped
        kinds = _kinds(node.event_log(), alone, start) + _kinds(node.event_log(), shared, start)
        assert kinds.count("transfer_start") == 1 and kinds.count("lookup_shm") == 1
    finally:
        for w in workers:
            w.stop()
        node.close()


def test_nodes_with_other_host_tags_never_map_each_others_segments() -> None:
    node = hg.init(shared_memory=True, host_tag="emulated-a")
    workers: list[Worker] = []
    try:
        tag = "emulated-b"
        workers = start_workers(node.directory_address, node.token, 2, shared_memory=True, host_tag=tag)
        arr = make_array("float32", (1024, 1024), seed=24)  # 4 MiB
        start = node.event_log()[-1]["seq"]
        oid = node.put(arr)
        assert shm.segment_of(node._store.get(oid).buffer.array) is None  # alone on its host: private
        assert [w.call("get", oid.hex(), 60) for w in workers] == [digest(arr)] * 2
        # Node's copy is pulled by one of them (another host), which the other maps (its host).
        kinds = _kinds(node.event_log(), oid, start)
        assert kinds.count("transfer_start") == 1 and kinds.count("lookup_shm") == 1
    finally:
        for w in workers:
            w.stop()
        node.close()
    with pytest.raises(hg.InvalidArgumentError, match="host_tag"):
        hg.Config(host_tag="two words")


def test_a_mapped_object_stays_intact_while_its_holder_deletes_reuses_and_dies(
    shm_owner: Any, shm_workers: list[Worker]
) -> None:
    arr = make_array("float64", (512, 1024), seed=14)  # 4 MiB
    oid = shm_owner.put(arr)
    segment = shm.segment_of(shm_owner._store.get(oid).buffer.array)
    assert segment is not None
    assert shm_workers[0].call("hold", oid.hex(), 60) == (digest(arr), False)
    assert segment.mapped_elsewhere()  # a view of the owner's segment, not a copy
    shm_owner.delete(oid)
    other = shm_owner.put(make_array("float64", (512, 1024), seed=15))  # same size: a pool candidate
    assert shm.segment_of(shm_owner._store.get(other).buffer.array) is not segment
    assert shm_workers[0].call("held", oid.hex()) == digest(arr)
    shm_owner.delete(other)
    # A holder that dies (SIGKILL) leaves its readers' views valid.
    holder = Worker(shm_owner.directory_address, shm_owner.token, shared_memory=True)
    try:
        holder.wait_ready()
        held = hg.ObjectID.from_hex(holder.call("put", "int32", (1 << 20,), 16, ""))
        assert shm_workers[1].call("hold", held.hex(), 60) == (
            digest(make_array("int32", (1 << 20,), 16)),
            False,
        )
        holder.kill()
        assert shm_workers[1].call("held", held.hex()) == digest(make_array("int32", (1 << 20,), 16))
    finally:
        holder.stop()
        shm.sweep_orphans()  # the killed holder's segment file


def test_a_vanished_segment_falls_back_to_the_data_plane(shm_owner: Any, shm_workers: list[Worker]) -> None:
    arr = make_array("int64", (512, 1024), seed=12)  # 4 MiB
    oid = shm_owner.put(arr)
    seg = shm.segment_of(shm_owner._store.get(oid).buffer.array)
    assert seg is not None
    seg.unlink()  # the directory still lists the segment; the reader finds no file
    start = shm_owner.event_log()[-1]["seq"]
    assert shm_workers[0].call("get", oid.hex(), 60) == digest(arr)
    kinds = _kinds(shm_owner.event_log(), oid, start)
    assert kinds[:3] == ["lookup", "lookup_shm", "lookup"] and "transfer_start" in kinds
    shm_owner.delete(oid)


def test_nothing_is_left_in_dev_shm(shm_owner: Any) -> None:
    node = hg.connect(shm_owner.directory_address, token=shm_owner.token, shared_memory=True)
    before = _ours()
    node.put(make_array("uint8", (1 << 20,), seed=13))
    assert len(_ours() - before) == 1
    node.close()
    assert _ours() == before
