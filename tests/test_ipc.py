"""Same-host device copies (:mod:`hoplite_gpu.memory.ipc`): readers open the holder's device memory through
its ticket and copy device to device, with no bytes on the data plane.

The processes use the simulated device backend (:class:`hoplite_gpu.memory.sim.SimBackend`), whose
exported memory is a file under ``/dev/shm`` that another process maps (memory of a process that
is gone is refused by :func:`hoplite_gpu.memory.ipc.open_ticket`, for every backend). The CUDA backend
runs the same code through ``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle``;
``tests/test_device_objects.py`` runs its cases with CuPy where a GPU is present
(``make gpu-check``).
"""

from __future__ import annotations

import math
import os
import signal
import struct
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu import protocol as p
from hoplite_gpu.auth import new_token
from hoplite_gpu.directory.config import DirectoryConfig
from hoplite_gpu.directory.state import DirectoryState, NodeJoined, Request
from hoplite_gpu.errors import ProtocolError
from hoplite_gpu.memory import device, device_pool, ipc, shm, tickets, to_host
from hoplite_gpu.topology import GpuInfo, Inventory, NvLink
from tests.procs import (
    DEVICE_TYPE,
    Worker,
    array_type,
    device_array,
    digest,
    make_array,
    start_device_workers,
    start_workers,
)

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm"),
]

SHAPE = (4, 1 << 15)  # 512 KiB of float32: several data-plane chunks when pulled
OID = b"o" * 20
KEY = tickets.ticket_key("a-token-of-this-test")  # seals the tickets made in this process by hand
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout


def _sim_only(backend: str) -> None:
    if backend != "sim":
        pytest.skip("reaches into simulated device memory's files")


@pytest.fixture(scope="module")
def ipc_owner(backend: str) -> Iterator[Any]:
    node = hg.init(shared_memory=True)
    yield node
    node.close()


@pytest.fixture(scope="module")
def ipc_workers(backend: str, ipc_owner: Any) -> Iterator[list[Worker]]:
    ws = start_device_workers(ipc_owner.directory_address, ipc_owner.token, 3, backend, shared_memory=True)
    yield ws
    for w in ws:
        w.stop()


def _seal(node: Any) -> bytes:
    """The key that seals the tickets of ``node``'s cluster."""
    return bytes(node._memory.seal_key)


def _events(node: Any, oid: str, since: int) -> list[dict[str, Any]]:
    return [e for e in node.event_log(since) if e.get("object_id") == oid]


def _put(node: Any, backend: str, seed: int) -> tuple[hg.ObjectID, np.ndarray[Any, Any]]:
    want = make_array("float32", SHAPE, seed)
    return node.put(device_array(backend, want)), want


# ---------------------------------------------------------------- through real processes
def test_a_same_host_reader_copies_device_to_device(
    backend: str, ipc_owner: Any, ipc_workers: list[Worker]
) -> None:
    start = ipc_owner.event_log()[-1]["seq"] + 1
    oid = ipc_workers[0].call("put_device", backend, "float32", SHAPE, 1, "")
    before = ipc_workers[1].call("objects")
    indexed = ipc_workers[1].call("stats")["device_ipc_indexed"]
    got = ipc_workers[1].call("get_typed", oid, 60)
    assert got == (DEVICE_TYPE[backend], digest(make_array("float32", SHAPE, 1)))
    # The reader found the owner's ticket through its index link: the directory saw only the put.
    assert [e["kind"] for e in _events(ipc_owner, oid, start)] == ["put"]
    assert ipc_workers[1].call("stats")["device_ipc_indexed"] == indexed + 1
    # A get copies straight into the array it returns: the reader keeps no copy of its own.
    assert ipc_workers[1].call("objects") == before
    ipc_workers[0].call("delete", oid)


def test_reduce_vertices_read_same_host_device_inputs_through_ipc(
    backend: str, ipc_owner: Any, ipc_workers: list[Worker]
) -> None:
    start = ipc_owner.event_log()[-1]["seq"] + 1
    seeds = [2, 3, 4]
    ids = [
        w.call("put_device", backend, "float32", SHAPE, s, "")
        for w, s in zip(ipc_workers, seeds, strict=True)
    ]
    rid = ipc_owner.reduce([hg.ObjectID.from_hex(h) for h in ids], "sum", timeout=60)
    got = ipc_owner.get(rid, timeout=60)
    want = np.sum([make_array("float32", SHAPE, s) for s in seeds], axis=0, dtype=np.float32)
    assert array_type(got) == DEVICE_TYPE[backend] and np.array_equal(to_host(got), want)
    events = ipc_owner.event_log(start)
    kinds = {h: [e["kind"] for e in events if e.get("object_id") == h] for h in [*ids, rid.hex()]}
    # One star on one host: its root holds one input and opens the other two; the caller opens
    # the result at the root. Nothing crosses the data plane.
    assert sorted("lookup_ipc" in kinds[h] for h in ids) == [False, True, True], kinds
    assert "lookup_ipc" in kinds[rid.hex()], kinds
    assert not any("transfer_start" in k for k in kinds.values()), kinds
    for w, h in zip(ipc_workers, ids, strict=True):
        w.call("delete", h)


def test_a_tree_on_one_host_hands_device_partial_results_over_through_ipc(
    backend: str, ipc_owner: Any, ipc_workers: list[Worker]
) -> None:
    """A tree of degree 2 over four device inputs has a vertex between leaves and root. Its
    parent waits for its output to be complete and opens it on the GPU, instead of pulling it
    while it is computed (through host staging buffers and the loopback, at a few GB/s)."""
    start = ipc_owner.event_log()[-1]["seq"] + 1
    seeds = [6, 7, 8, 9]
    ids = [
        w.call("put_device", backend, "float32", SHAPE, s, "")
        for w, s in zip(ipc_workers, seeds[:3], strict=True)
    ]
    own = ipc_owner.put(device_array(backend, make_array("float32", SHAPE, seeds[3])))
    rid = ipc_owner.reduce([*(hg.ObjectID.from_hex(h) for h in ids), own], "sum", degree=2, timeout=60)
    got = ipc_owner.get(rid, timeout=60)
    want = np.sum([make_array("float32", SHAPE, s) for s in seeds], axis=0, dtype=np.float32)
    assert array_type(got) == DEVICE_TYPE[backend] and np.array_equal(to_host(got), want)
    events = ipc_owner.event_log(start)
    inputs = {*ids, own.hex()}
    partial = {
        e["object_id"]
        for e in events
        if e["kind"].startswith("lookup") and e["object_id"] not in inputs and e["object_id"] != rid.hex()
    }
    assert partial, [(e["kind"], e.get("object_id")) for e in events]  # the tree has such a vertex
    for h in partial:
        kinds = [e["kind"] for e in events if e.get("object_id") == h]
        assert "lookup_ipc" in kinds and "transfer_start" not in kinds, kinds
    assert not any(e["kind"] == "transfer_start" for e in events), events
    ipc_owner.delete(own)
    for w, h in zip(ipc_workers, ids, strict=True):
        w.call("delete", h)


@pytest.mark.multiprocess
def test_a_device_tree_on_one_host_survives_its_inner_vertex_killed(backend: str, ipc_owner: Any) -> None:
    """The inner vertex is SIGKILLed (fault injection) a tenth of the way through its reduction,
    while its parent waits to copy its output device to device: the tree is rebuilt, the
    restarted task puts its input again, and the result is exact."""
    address, token = ipc_owner.directory_address, ipc_owner.token
    ws = start_device_workers(address, token, 4, backend, shared_memory=True)
    extra: list[Worker] = []
    try:
        seeds = [11, 12, 13, 14]
        ids = [w.call("put_device", backend, "float32", SHAPE, s, "") for w, s in zip(ws, seeds, strict=True)]
        rid = hg.ObjectID.random()
        # Inputs ready before the request are placed in order: input 1 is the inner vertex.
        ws[1].call("arm", f"reduce:{rid.hex()}:0.1:KILL")
        start = ipc_owner.event_log()[-1]["seq"] + 1
        ipc_owner.reduce([hg.ObjectID.from_hex(h) for h in ids], "sum", degree=2, reduction_id=rid)
        ws[1].proc.join(60)
        assert not ws[1].proc.is_alive()
        extra = start_device_workers(address, token, 1, backend, shared_memory=True)
        extra[0].call("put_device", backend, "float32", SHAPE, seeds[1], ids[1])
        got = ipc_owner.get(rid, timeout=120)
        want = np.sum([make_array("float32", SHAPE, s) for s in seeds], axis=0, dtype=np.float32)
        assert array_type(got) == DEVICE_TYPE[backend] and np.array_equal(to_host(got), want)
        assert any(e["kind"] == "reduce_repair" for e in ipc_owner.event_log(start))
        ipc_owner.delete(rid)
    finally:
        for w in ws + extra:
            w.kill()


def test_a_reader_without_shared_memory_pulls_device_bytes_staged(backend: str, ipc_owner: Any) -> None:
    (reader,) = start_device_workers(
        ipc_owner.directory_address, ipc_owner.token, 1, backend, shared_memory=False
    )
    try:
        start = ipc_owner.event_log()[-1]["seq"] + 1
        oid, want = _put(ipc_owner, backend, 5)
        assert reader.call("get_typed", oid.hex(), 60) == (DEVICE_TYPE[backend], digest(want))
        kinds = [e["kind"] for e in _events(ipc_owner, oid.hex(), start)]
        assert "transfer_start" in kinds and "lookup_ipc" not in kinds
        ipc_owner.delete(oid)
    finally:
        reader.stop()


def test_device_memory_that_does_not_open_falls_back_to_a_pull(
    backend: str, ipc_owner: Any, ipc_workers: list[Worker]
) -> None:
    _sim_only(backend)
    oid, want = _put(ipc_owner, backend, 6)
    ticket = ipc_owner._store.get(oid).buffer.ticket
    record = ipc.PROCESS.read_ticket(ticket.name, oid.binary(), want.nbytes, _seal(ipc_owner))
    assert record is not None and record.backend == "sim"
    os.unlink(os.path.join(shm.SHM_DIR, record.handle.decode()))  # the memory's file is gone
    start = ipc_owner.event_log()[-1]["seq"] + 1
    assert ipc_workers[0].call("get_typed", oid.hex(), 60) == ("hoplite_gpu.SimDeviceArray", digest(want))
    kinds = [e["kind"] for e in _events(ipc_owner, oid.hex(), start)]
    assert kinds[:3] == ["lookup", "lookup_ipc", "lookup"] and "transfer_start" in kinds, kinds
    ipc_owner.delete(oid)
    ipc.PROCESS.reap()
    ipc.PROCESS.pool.clear()  # its memory, broken above, must not serve the next tests' objects


def test_a_holder_frees_device_memory_only_once_its_readers_let_go(
    backend: str, ipc_owner: Any, ipc_workers: list[Worker]
) -> None:
    oid, want = _put(ipc_owner, backend, 7)
    ticket = ipc_owner._store.get(oid).buffer.ticket
    assert ticket is not None and ticket.held
    reader = ipc_workers[0]
    assert reader.call("ipc_open", ticket.name, oid.hex(), "float32", SHAPE) == digest(want)
    assert ipc_owner.delete(oid)
    assert ticket.held  # retired, but a reader has the memory open: not freed
    assert (
        ipc.PROCESS.open_ticket(ticket.name, oid.binary(), want.nbytes, _seal(ipc_owner)) is None
    )  # none new
    assert reader.call("ipc_close")
    ipc.PROCESS.reap()
    assert not ticket.held


def test_memory_of_a_killed_holder_is_not_opened(backend: str, ipc_owner: Any) -> None:
    (holder,) = start_workers(ipc_owner.directory_address, ipc_owner.token, 1, shared_memory=True)
    try:
        oid = holder.call("put_device", backend, "float32", SHAPE, 8, "")
        name = holder.call("ticket", oid)
        nbytes = int(np.prod(SHAPE)) * 4
        assert ipc.PROCESS.read_ticket(name, bytes.fromhex(oid), nbytes, _seal(ipc_owner)) is not None
        os.kill(holder.proc.pid, signal.SIGKILL)
        holder.proc.join(30)
        assert ipc.PROCESS.open_ticket(name, bytes.fromhex(oid), nbytes, _seal(ipc_owner)) is None
    finally:
        holder.stop()
        shm.sweep_orphans()  # the killed holder's ticket and memory files


# ---------------------------------------------------------------- tickets in one process
def test_a_ticket_opens_only_for_its_object_and_size(backend: str) -> None:
    ramp = np.arange(64, dtype=np.uint8)
    array = device.default_backend().empty_shared(64, 0)
    device.default_backend().from_host(array, ramp)
    ticket = ipc.PROCESS.export(array)
    assert ticket is not None and tickets.is_ticket(ticket.name)
    assert ipc.PROCESS.open_ticket(ticket.name, OID, 64, KEY) is None  # not published yet
    ticket.publish(OID, KEY)
    opened = ipc.PROCESS.open_ticket(ticket.name, OID, 64, KEY)
    assert opened is not None and np.array_equal(to_host(opened.array), ramp)
    opened.close()
    assert ipc.PROCESS.open_ticket(ticket.name, b"x" * 20, 64, KEY) is None  # another object
    assert ipc.PROCESS.open_ticket(ticket.name, OID, 65, KEY) is None  # another size
    assert ipc.PROCESS.open_ticket(ticket.name[len(tickets.PREFIX) :], OID, 64, KEY) is None  # not a ticket
    assert ipc.PROCESS.open_ticket(tickets.PREFIX + "../etc/passwd", OID, 64, KEY) is None
    ipc.PROCESS.retire(ticket)
    assert ipc.PROCESS.open_ticket(ticket.name, OID, 64, KEY) is None and not ticket.held


def test_memory_of_a_pool_is_not_exported(backend: str) -> None:
    # not memory of empty_shared (for CuPy: a sub-allocation of its pool)
    assert ipc.PROCESS.export(device_array(backend, np.zeros(8, np.uint8))) is None
    assert ipc.PROCESS.export(np.zeros(8, np.uint8)) is None  # host memory
    assert ipc.PROCESS.allocate(device.default_backend(), 8, 0, share=False)[1] is None


# ---------------------------------------------------------------- the directory's choice
def _state(**hosts: str) -> DirectoryState:
    state = DirectoryState(DirectoryConfig(lease_timeout=math.inf, validate=True))
    for i, (node, key) in enumerate(hosts.items()):
        state.handle(NodeJoined(node, "127.0.0.1", 7000 + i, 0.0, key))
    return state


@pytest.mark.parametrize(
    ("device_ipc", "host", "waits"),
    [(True, "h1", True), (False, "h1", False), (True, "h2", False)],
)
def test_a_device_vertex_output_is_copied_on_its_host_once_complete(
    device_ipc: bool, host: str, waits: bool
) -> None:
    """A reader on the host of the vertex computing a device output (its parent vertex), able to
    open device memory, is answered once the vertex is done, with its ticket; any other reader
    pulls the output while it is computed."""
    state = _state(A="h1", B="h1", C="h1", D="h1", E=host)
    rid = b"r" * 20
    state.handle(
        Request(
            "A", p.ReduceRequest(9, rid, [bytes([i]) * 20 for i in range(4)], "sum", 4, 0.0, degree=2), 0.0
        )
    )
    tasks: list[p.ReduceTask] = []
    for i, node in enumerate("ABCD"):
        ticket = tickets.PREFIX + f"hoplite-1-2-3-{i}"
        put = p.PutRequest(1, bytes([i]) * 20, 1 << 20, "<f4", [1 << 18], b"", None, ticket, memory="device")
        tasks += [
            s.message for s in state.handle(Request(node, put, 0.0)) if isinstance(s.message, p.ReduceTask)
        ]
    inner = [t for t in tasks if t.vertex != 0 and t.children]
    assert len(inner) == 1 and inner[0].memory == "device"  # one vertex between leaves and root
    output = inner[0].output_id
    holder = next(n for n, loc in state.objects[output].locations.items() if loc.producing)
    lookup = p.LookupRequest(7, output, 0.0, 0, True, device_ipc=device_ipc)
    replies = [
        s.message for s in state.handle(Request("E", lookup, 0.0)) if isinstance(s.message, p.LookupReply)
    ]
    if not waits:
        assert [r.status for r in replies] == ["pull"]
        return
    assert replies == []  # not pulled while it is computed
    ticket = tickets.PREFIX + "hoplite-1-2-3-out"
    done = p.VertexDone(rid, inner[0].vertex, True, segment=ticket, epoch=inner[0].epoch)
    replies = [
        s.message for s in state.handle(Request(holder, done, 0.0)) if isinstance(s.message, p.LookupReply)
    ]
    assert [(r.status, r.segment, r.sender_node) for r in replies] == [("shm", ticket, holder)]


@pytest.mark.parametrize(
    ("device_ipc", "host", "status"),
    [(True, "h1", "shm"), (False, "h1", "pull"), (True, "h2", "pull")],
)
def test_a_ticket_goes_only_to_same_host_readers_that_open_device_memory(
    device_ipc: bool, host: str, status: str
) -> None:
    state = _state(A="h1", B=host)
    name = tickets.PREFIX + "hoplite-1-2-3-ab"
    put = p.PutRequest(1, OID, 1 << 20, "|u1", [1 << 20], b"", None, name, memory="device")
    state.handle(Request("A", put, 0.0))
    (send,) = state.handle(Request("B", p.LookupRequest(7, OID, 0.0, 0, True, device_ipc=device_ipc), 0.0))
    assert isinstance(send.message, p.LookupReply)
    assert send.message.status == status
    if status == "shm":
        assert send.message.segment == name and send.message.memory == "device" and not state.transfers
        assert state.events[-1]["kind"] == "lookup_ipc"


def _gpus(*uuids: str, nvlink: tuple[str, str] = ("", "")) -> Inventory:
    """One host's GPUs, all on NUMA node 0; ``nvlink`` joins two of them."""
    gpus = [
        GpuInfo(
            i,
            u,
            "test GPU",
            numa_node=0,
            nvlinks=(NvLink(0, True, remote_uuid=nvlink[1]),) if u == nvlink[0] else (),
        )
        for i, u in enumerate(uuids)
    ]
    return Inventory("host", "h1", gpus=tuple(gpus))


def test_a_reader_opens_the_holder_whose_gpu_reaches_its_own_best() -> None:
    """Among same-host holders of a device object, the directory gives a ticket of one on the
    reader's own GPU, else one on NVLink to it, else the owner's (as without GPU information)."""
    inv = _gpus("G0", "G1", "G2", "G3", nvlink=("G2", "G1"))
    state = DirectoryState(DirectoryConfig(lease_timeout=math.inf, validate=True))
    for i, (node, gpu) in enumerate({"A": "G0", "B": "G1", "C": "G2", "D": "G3", "E": "", "F": ""}.items()):
        state.handle(NodeJoined(node, "127.0.0.1", 7000 + i, 0.0, "h1", gpu=gpu, gpus=inv if gpu else None))
    named = {n: tickets.PREFIX + f"hoplite-1-2-{i}-ab" for i, n in enumerate("AB")}
    put = p.PutRequest(1, OID, 1 << 20, "|u1", [1 << 20], b"", None, named["A"], memory="device")
    state.handle(Request("A", put, 0.0))
    state.handle(Request("B", p.CopyAdded(OID, named["B"]), 0.0))

    def ticket_for(reader: str, rid: int) -> str:
        (send,) = state.handle(Request(reader, p.LookupRequest(rid, OID, 0.0, 0, True, device_ipc=True), 0.0))
        assert send.message.status == "shm"
        return str(send.message.segment)

    assert ticket_for("C", 2) == named["B"]  # NVLink G2-G1 beats PCIe to the owner's G0
    assert ticket_for("D", 3) == named["A"]  # equally far: the owner's
    assert ticket_for("E", 4) == named["A"]  # a reader that named no GPU: the owner's
    state.handle(NodeJoined("G", "127.0.0.1", 7010, 0.0, "h1", gpu="G1", gpus=inv))
    assert ticket_for("G", 5) == named["B"]  # on the holder's own GPU


def test_a_hello_names_a_gpu_of_its_inventory() -> None:
    inv = _gpus("G0").to_dict()
    hello = {"node_id": "n1", "nonce": b"n" * 16, "proof": b"p" * 32, "data_host": "h", "data_port": 1}
    p.Hello(**hello, gpu="G0", gpus=inv).check()
    p.Hello(**hello).check()  # no GPU
    for gpu, gpus in (("G9", inv), ("G0", {}), ("", inv), ("G0", {"gpus": "not a list"})):
        with pytest.raises(ProtocolError):
            p.Hello(**hello, gpu=gpu, gpus=gpus).check()


def test_nothing_is_left_in_dev_shm(backend: str, ipc_owner: Any) -> None:
    """A node's tickets (and simulated device memory) go with its objects."""
    ns = os.stat("/proc/self/ns/pid").st_ino

    def ours() -> set[str]:
        return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"hoplite-{ns}-{os.getpid()}-")}

    ipc.PROCESS.pool.clear()
    before = ours()
    node = hg.connect(ipc_owner.directory_address, token=ipc_owner.token, shared_memory=True)
    oid, want = _put(node, backend, 9)
    after_put = ours()
    assert after_put - before  # the ticket (and for the simulated backend, the memory)
    assert node.put(device_array(backend, want), oid) == oid  # the same put again: not kept
    assert ours() - after_put == _spare_files(backend)  # but its memory stays for the next
    assert os.path.exists(_index_path(node, oid.hex()))  # the put was indexed
    node.delete(oid)
    assert not os.path.exists(_index_path(node, oid.hex()))
    last, _ = _put(node, backend, 10)  # into the deleted object's memory, from the process's pool
    node.close()
    ipc.PROCESS.reap()
    assert not os.path.exists(_index_path(node, last.hex()))
    # Nothing of this node's is left but the pool's spares (kept for the process's next device
    # copies). Files of earlier tests may go meanwhile: memory their readers kept open until
    # their next sweep.
    assert not ours() - _spare_files(backend) - before


def test_a_retired_ticket_stays_retired(backend: str) -> None:
    ticket = ipc.PROCESS.export(device.default_backend().empty_shared(16, 0))
    assert ticket is not None
    ticket.publish(OID, KEY)
    ipc.PROCESS.retire(ticket)
    ipc.PROCESS.retire(ticket)  # a second retirement (the store's, after a failed put's) changes nothing
    ipc.PROCESS.reap()
    assert ticket.publish(OID, KEY) == "" and not ticket.held


# ---------------------------------------------------------------- the pool of device allocations
def _address(flat: Any) -> int:
    return int(flat.ctypes.data) if isinstance(flat, np.ndarray) else int(flat.data.ptr)


def _spare_files(backend: str) -> set[str]:
    """The ``/dev/shm`` files of the pool's spares: their pins, their retired tickets, and
    simulated device memory."""
    names = {s.pin.name for s in ipc.PROCESS.pool._spares if s.pin is not None}
    names |= {shm.segment_of(s.record).name for s in ipc.PROCESS.pool._spares if s.record is not None}  # type: ignore[union-attr]
    if backend == "sim":
        names |= {shm.segment_of(s.array.base).name for s in ipc.PROCESS.pool._spares}  # type: ignore[union-attr]
    return names


def _taken(spare: device_pool.Spare | None) -> Any:
    assert spare is not None
    return spare.array


def _stored(node: Any, oid: hg.ObjectID) -> Any:
    return node._store.get(oid).buffer.array


def test_a_deleted_device_objects_memory_takes_the_next_of_its_size(backend: str) -> None:
    ipc.PROCESS.pool.clear()  # spares of earlier tests' objects of the same size
    node = hg.init(shared_memory=True)
    try:
        oid, _ = _put(node, backend, 11)
        first = _address(_stored(node, oid))
        reused = ipc.PROCESS.pool.reused
        node.delete(oid)
        ipc.PROCESS.reap()
        assert ipc.PROCESS.pool.held_bytes >= int(np.prod(SHAPE)) * 4
        small = node.put(device_array(backend, np.zeros(8, np.float32)))  # another size: new memory
        assert _address(_stored(node, small)) != first and ipc.PROCESS.pool.reused == reused
        again, want = _put(node, backend, 12)
        assert _address(_stored(node, again)) == first and ipc.PROCESS.pool.reused == reused + 1
        assert np.array_equal(to_host(node.get(again, timeout=30)), want)
        assert node.stats()["device_pool_reused"] == ipc.PROCESS.pool.reused
    finally:
        node.close()


def test_memory_something_still_uses_is_not_handed_out(backend: str) -> None:
    ipc.PROCESS.pool.clear()  # spares of earlier tests' objects of the same size
    node = hg.init(shared_memory=True)
    try:
        oid, _ = _put(node, backend, 13)
        view = node._store.get(oid).buffer.view(0, 64)  # as a transfer still sending from it
        first = _address(_stored(node, oid))
        node.delete(oid)
        ipc.PROCESS.reap()
        assert len(ipc.PROCESS.pool) == 1
        other, _ = _put(node, backend, 14)
        assert _address(_stored(node, other)) != first
        del view
        node.delete(other)
        ipc.PROCESS.reap()
        third, want = _put(node, backend, 15)
        assert _address(_stored(node, third)) == first  # the oldest spare, free again
        assert np.array_equal(to_host(node.get(third, timeout=30)), want)
    finally:
        node.close()


def test_the_pool_keeps_what_its_largest_user_asks_oldest_freed_first(backend: str) -> None:
    pool, dev = device_pool.DevicePool(ipc.PROCESS.discard), device.default_backend()
    pool.attach("a", 100)
    pool.attach("b", 300)
    addresses = []
    for _ in range(4):
        array = dev.empty_shared(100, 0)
        addresses.append(_address(array))
        pool.give(dev, array)
    del array
    assert pool.held_bytes == 300 and [_address(s.array) for s in pool._spares] == addresses[1:]
    assert pool.take(dev, 99, 0) is None and pool.take(dev, 100, 1) is None  # size, device
    taken = _taken(pool.take(dev, 100, 0))
    assert _address(taken) == addresses[1] and pool.reused == 1
    pool.give(dev, taken)  # while still referenced (by ``taken``): kept, but not handed out
    others = [_taken(pool.take(dev, 100, 0)), _taken(pool.take(dev, 100, 0))]
    assert [_address(a) for a in others] == addresses[2:4]
    assert pool.take(dev, 100, 0) is None
    del taken
    last = _taken(pool.take(dev, 100, 0))
    assert _address(last) == addresses[1] and pool.reused == 4 and len(pool) == 0
    for array in (*others, last):
        pool.give(dev, array)
    del others, last, array
    pool.detach("b")
    assert pool.held_bytes == 100 and [_address(s.array) for s in pool._spares] == addresses[1:2]
    pool.detach("a")
    assert len(pool) == 0
    pool.give(dev, dev.empty_shared(100, 0))  # nobody wants any kept
    assert len(pool) == 0


def test_a_reader_on_the_host_reads_each_object_of_reused_memory(
    backend: str, ipc_owner: Any, ipc_workers: list[Worker]
) -> None:
    reader = ipc_workers[2]
    ipc.PROCESS.pool.clear()
    seen, tickets, earlier = set(), set(), []
    nbytes = int(np.prod(SHAPE)) * 4
    for seed in (40, 41, 42):
        oid, want = _put(ipc_owner, backend, seed)
        seen.add(_address(_stored(ipc_owner, oid)))
        ticket = ipc_owner._store.get(oid).buffer.ticket.name
        tickets.add(ticket)
        for old in earlier:  # the ticket names only its present object
            assert ipc.PROCESS.read_ticket(ticket, old.binary(), nbytes, _seal(ipc_owner)) is None
        assert ipc.PROCESS.read_ticket(ticket, oid.binary(), nbytes, _seal(ipc_owner)) is not None
        assert reader.call("get_typed", oid.hex(), 60) == (DEVICE_TYPE[backend], digest(want))
        assert ipc_owner.delete(oid)
        ipc.PROCESS.reap()
        assert (
            ipc.PROCESS.read_ticket(ticket, oid.binary(), nbytes, _seal(ipc_owner)) is None
        )  # retired with its object
        earlier.append(oid)
    assert len(seen) == 1  # one allocation served all three
    assert len(tickets) == 1  # named by one ticket, published again for each object


# ---------------------------------------------------------------- mappings a reader keeps
def test_a_reader_keeps_the_holders_allocation_open_across_its_objects(
    backend: str, ipc_owner: Any, ipc_workers: list[Worker]
) -> None:
    reader = ipc_workers[1]
    ipc.PROCESS.pool.clear()
    reader.call("ipc_sweep")
    before = reader.call("stats")
    for seed in (50, 51, 52):  # each object in the memory the one before was deleted from
        oid, want = _put(ipc_owner, backend, seed)
        assert reader.call("get_typed", oid.hex(), 60) == (DEVICE_TYPE[backend], digest(want))
        assert ipc_owner.delete(oid)
        ipc.PROCESS.reap()
    after = reader.call("stats")
    assert after["device_ipc_opened"] - before["device_ipc_opened"] == 1
    assert after["device_ipc_reused"] - before["device_ipc_reused"] == 2
    assert after["device_ipc_kept"] >= 1


def test_an_allocation_a_reader_keeps_open_is_freed_once_it_closed_it(
    backend: str, ipc_owner: Any, ipc_workers: list[Worker]
) -> None:
    reader = ipc_workers[1]
    ipc.PROCESS.pool.clear()
    ipc.PROCESS.reap()
    oid, want = _put(ipc_owner, backend, 53)
    (spare_pin,) = [ipc_owner._store.get(oid).buffer.ticket.pin]
    assert reader.call("get_typed", oid.hex(), 60) == (DEVICE_TYPE[backend], digest(want))
    assert ipc_owner.delete(oid)
    ipc.PROCESS.reap()
    ipc.PROCESS.pool.clear()  # the holder lets the allocation go while the reader keeps it open
    assert ipc.PROCESS.pinned(spare_pin)  # so it is not freed yet
    path = os.path.join(shm.SHM_DIR, spare_pin.name)
    assert os.path.exists(path)
    kept = reader.call("ipc_sweep")  # the reader sees the retired pin and closes its mapping
    ipc.PROCESS.reap()
    assert not ipc.PROCESS.pinned(spare_pin) and not os.path.exists(path)
    assert reader.call("stats")["device_ipc_kept"] == kept


# ---------------------------------------------------------------- index links
def _index_key(node: Any) -> str:
    """The key ``node`` indexes under now."""
    key = node._memory.index_key
    assert key
    return str(key)


def _index_path(node: Any, oid_hex: str) -> str:
    return os.path.join(shm.SHM_DIR, shm.index_name(_index_key(node), bytes.fromhex(oid_hex)))


def test_a_deleted_object_is_not_found_through_its_index_link(
    backend: str, ipc_owner: Any, ipc_workers: list[Worker]
) -> None:
    owner, reader = ipc_workers[0], ipc_workers[1]
    oid = owner.call("put_device", backend, "float32", SHAPE, 60, "")
    path = _index_path(ipc_owner, oid)
    assert os.path.exists(path)
    assert owner.call("delete", oid)
    assert not os.path.exists(path)  # gone with the object, before delete returned
    indexed = reader.call("stats")["device_ipc_indexed"]
    with pytest.raises(RuntimeError, match=r"HopliteTimeoutError|ObjectDeletedError"):
        reader.call("get_typed", oid, 0.5)
    assert reader.call("stats")["device_ipc_indexed"] == indexed


def test_an_index_link_is_of_one_cluster_and_goes_with_a_killed_owner(backend: str, ipc_owner: Any) -> None:
    (holder,) = start_workers(ipc_owner.directory_address, ipc_owner.token, 1, shared_memory=True)
    try:
        oid = holder.call("put_device", backend, "float32", SHAPE, 62, "")
        path = _index_path(ipc_owner, oid)
        key, seal = _index_key(ipc_owner), _seal(ipc_owner)
        other = tickets.cluster_key("another-token", ipc_owner._session.control.directory_id)
        assert ipc.PROCESS.open_indexed(other, bytes.fromhex(oid), seal) is None  # another cluster's name
        assert ipc.PROCESS.open_indexed(key, bytes.fromhex(oid), KEY) is None  # another token's seal
        found = ipc.PROCESS.open_indexed(key, bytes.fromhex(oid), seal)
        assert found is not None
        opened, record = found
        assert (np.dtype(record.dtype), record.shape) == (np.float32, SHAPE)
        assert digest(to_host(opened.array).view(np.ndarray).view(np.float32).reshape(SHAPE)) == digest(
            make_array("float32", SHAPE, 62)
        )
        opened.close()
        os.kill(holder.proc.pid, signal.SIGKILL)
        holder.proc.join(30)
        assert os.path.exists(path)  # a killed process removes nothing
        assert ipc.PROCESS.open_indexed(key, bytes.fromhex(oid), seal) is None  # its process is gone
        shm.sweep_orphans()
        assert not os.path.exists(path)
    finally:
        holder.stop()
        shm.sweep_orphans()
        ipc.PROCESS.sweep()


# ---------------------------------------------------------------- what a reader trusts in /dev/shm
def _forge_ticket(name: str, object_id: bytes, memory: str, dtype: str, shape: tuple[int, ...]) -> Any:
    """Write, as an attacker without the token would, a published ticket for ``object_id`` under
    the shared-memory name ``name`` naming the simulated device memory of segment ``memory``, made
    by process 1 (alive in every pid namespace): the ticket layout is in the open, the seal's key
    is not (any 32 bytes are as good a guess as another). Returns the ticket's segment."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    record = shm.create(tickets.RECORD_BYTES)
    seg = shm.segment_of(record) if record is not None else None
    assert seg is not None
    handle = memory.encode()
    tickets._RECORD.pack_into(record.data, 0, b"sim", 0, 1, 0, nbytes, len(handle))
    record[tickets._RECORD.size : tickets._RECORD.size + len(handle)] = np.frombuffer(handle, np.uint8)
    tickets._META.pack_into(record.data, tickets._META_AT, np.dtype(dtype).str.encode(), len(shape))
    struct.pack_into(f"<{len(shape)}Q", record.data, tickets._SHAPE_AT, *shape)
    record[-32:] = np.frombuffer(os.urandom(32), np.uint8)  # where a seal goes
    struct.pack_into("<I", seg, 36, 1)  # the header's creator: process 1
    seg.publish(object_id)
    os.link(os.path.join(shm.SHM_DIR, seg.name), os.path.join(shm.SHM_DIR, name))
    return seg


def test_a_ticket_opens_only_with_its_clusters_seal(backend: str) -> None:
    array = device.default_backend().empty_shared(64, 0)
    device.default_backend().from_host(array, np.arange(64, dtype=np.uint8))
    ticket = ipc.PROCESS.export(array)
    assert ticket is not None
    ticket.publish(OID, KEY, "|u1", (64,))
    found = tickets.read(ticket.name[len(tickets.PREFIX) :], OID, KEY)
    assert found is not None
    found[0].close()
    assert ipc.PROCESS.read_ticket(ticket.name, OID, 64, KEY) is not None
    refused = ipc.PROCESS.stats()["refused"]
    assert ipc.PROCESS.read_ticket(ticket.name, OID, 64, tickets.ticket_key("another token")) is None
    assert ipc.PROCESS.read_ticket(ticket.name, OID, 64, b"") is None  # a reader without a key
    assert ipc.PROCESS.stats()["refused"] == refused + 2
    # Any byte of the record changed (here the offset into the allocation) breaks the seal.
    segment = ticket._segment
    assert segment is not None
    struct.pack_into("<Q", segment, shm.HEADER_BYTES + 16, 8)
    assert ipc.PROCESS.read_ticket(ticket.name, OID, 64, KEY) is None
    struct.pack_into("<Q", segment, shm.HEADER_BYTES + 16, 0)
    assert ipc.PROCESS.read_ticket(ticket.name, OID, 64, KEY) is not None
    ticket.publish(b"x" * 20, b"")  # published without a key: nobody opens it
    assert ipc.PROCESS.read_ticket(ticket.name, b"x" * 20, 64, KEY) is None
    ipc.PROCESS.retire(ticket)
    ipc.PROCESS.reap()


def test_a_forged_index_link_is_refused_and_the_get_asks_the_directory(
    backend: str, ipc_owner: Any, ipc_workers: list[Worker]
) -> None:
    """The issue's attack: a process without the token reads the cluster's key off the names in
    /dev/shm, and writes a ticket at the index name of a predictable ObjectID before its owner
    puts it, naming memory of its own, by process 1. The owner's put goes on (the name is taken),
    and the reader refuses the forged ticket (no seal) and gets the true bytes through the
    directory."""
    _sim_only(backend)
    owner, reader = ipc_workers[0], ipc_workers[2]
    # The cluster's key, as anyone on the host reads it: off the index name of an earlier put.
    seen = owner.call("put_device", backend, "float32", (4,), 1, "")
    ns = os.stat("/proc/self/ns/pid").st_ino
    (key,) = {
        n.split("-")[3]
        for n in os.listdir(shm.SHM_DIR)
        if n.startswith(f"hoplite-i-{ns}-") and n.endswith(seen)
    }
    oid = hg.ObjectID.from_name(f"allreduce-step-{os.urandom(4).hex()}")  # predictable
    evil = make_array("float32", SHAPE, 666)
    memory = shm.create(evil.nbytes)
    assert memory is not None
    memory[:] = evil.view(np.uint8).reshape(-1)
    name = shm.index_name(key, oid.binary())
    forged = _forge_ticket(name, oid.binary(), shm.segment_of(memory).name, "float32", SHAPE)  # type: ignore[union-attr]
    path = os.path.join(shm.SHM_DIR, name)
    try:
        before = reader.call("stats")
        start = ipc_owner.event_log()[-1]["seq"] + 1
        assert owner.call("put_device", backend, "float32", SHAPE, 70, oid.hex()) == oid.hex()
        assert os.path.samefile(path, os.path.join(shm.SHM_DIR, forged.name))  # the name stays taken
        got = reader.call("get_typed", oid.hex(), 60)
        assert got == (DEVICE_TYPE[backend], digest(make_array("float32", SHAPE, 70))), "the forged bytes"
        after = reader.call("stats")
        assert after["device_ipc_indexed"] == before["device_ipc_indexed"]
        assert after["device_ipc_refused"] >= before["device_ipc_refused"] + 1
        assert "lookup_ipc" in [e["kind"] for e in _events(ipc_owner, oid.hex(), start)]  # asked
        owner.call("delete", oid.hex())
    finally:
        forged.unlink()
        os.unlink(path)
        shm.segment_of(memory).unlink()  # type: ignore[union-attr]
        owner.call("delete", seen)


# A holder that is not root: it joins as root (the interpreter's files may be root's only), then
# acts as another user; puts the object the test names and prints what became of the put.
_UNPRIVILEGED_HOLDER = r"""
import os, sys, numpy as np, hoplite_gpu as hg
from hoplite_gpu.memory import sim
from tests.procs import make_array
node = hg.connect(sys.argv[1], token=sys.argv[2], shared_memory=True)
os.setegid(int(sys.argv[3])); os.seteuid(int(sys.argv[3]))
array = sim.sim_array(make_array("float32", (4, 1 << 15), 71))
try:
    print("PUT", node.put(array, hg.ObjectID.from_hex(sys.argv[4])).hex(), flush=True)
except Exception as exc:
    print("FAILED", type(exc).__name__, exc, flush=True)
sys.stdin.readline()  # hold the object until the test is done with it
os.seteuid(0)
node.close()
"""


def test_a_put_goes_on_when_another_user_holds_its_index_name(
    backend: str, ipc_owner: Any, ipc_workers: list[Worker]
) -> None:
    """Another local user creates the index name of a predictable id first, as a file whose
    creator is gone: the holder (not root, in sticky /dev/shm) cannot remove it. Its put succeeds
    all the same (the name is just not its), and readers get the object through the directory."""
    _sim_only(backend)
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as two other users")
    import subprocess
    import sys

    other, holder_uid = 65532, 65533
    oid = hg.ObjectID.random()
    path = os.path.join(shm.SHM_DIR, shm.index_name(_index_key(ipc_owner), oid.binary()))
    header = bytearray(shm.HEADER_BYTES + tickets.RECORD_BYTES)
    struct.pack_into("<QQ20sI", header, 0, 0, tickets.RECORD_BYTES, oid.binary(), 2**31 - 2)  # no such pid
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, bytes(header))
    os.fchown(fd, other, other)
    os.close(fd)
    env = {**os.environ, "HOPLITE_DEVICE_BACKEND": "sim", "PYTHONPATH": _ROOT}
    args = [ipc_owner.directory_address, ipc_owner.token, str(holder_uid), oid.hex()]
    holder = subprocess.Popen(
        [sys.executable, "-c", _UNPRIVILEGED_HOLDER, *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().split() == ["PUT", oid.hex()]  # not FAILED PermissionError
        assert os.stat(path).st_uid == other  # the name is still the other user's
        got = ipc_workers[1].call("get_typed", oid.hex(), 60)
        assert got == (DEVICE_TYPE[backend], digest(make_array("float32", SHAPE, 71)))
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        try:
            holder.wait(60)
        finally:
            if holder.poll() is None:
                holder.kill()
            os.unlink(path)


# One cluster in a network namespace: a directory at 127.0.0.1:17070 and a node of it, which puts
# a device object (argv "put") or gets it within a second (argv "get") and prints what it found.
_CLUSTER_IN_NAMESPACE = r"""
import sys, numpy as np, hoplite_gpu as hg
from hoplite_gpu.memory import sim
from tests.procs import digest, make_array
service = hg.start_directory(sys.argv[1], host="127.0.0.1", port=17070)
node = hg.connect("127.0.0.1:17070", token=sys.argv[1], shared_memory=True)
oid = hg.ObjectID.from_hex(sys.argv[3])
sim.sim_array(np.zeros(1, np.uint8))  # works with (simulated) device memory, as a GPU process
if sys.argv[2] == "put":
    node.put(sim.sim_array(make_array("float32", (4, 1 << 15), 72)), oid)
    print("PUT", flush=True)
    sys.stdin.readline()  # hold the object until the other cluster has tried
else:
    try:
        got = node.get(oid, timeout=1.0)
        print("GOT", digest(np.asarray(got).view(np.ndarray)), node.stats()["device_ipc_indexed"], flush=True)
    except hg.HopliteError as exc:
        print("NOT FOUND", type(exc).__name__, flush=True)
node.close()
hg.stop_directory(service)
"""


@pytest.mark.multiprocess
def test_two_clusters_of_one_token_and_directory_address_share_no_index_link(backend: str) -> None:
    """Two network namespaces, each with a directory on 127.0.0.1:17070 and the same token, one
    /dev/shm: a get in cluster B of an id put only in cluster A does not find A's object (each
    directory instance gives its cluster index names of its own)."""
    _sim_only(backend)
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2, to make network namespaces")
    names = [f"hg39ix{i}{os.getpid()}" for i in range(2)]
    made: list[str] = []
    token = new_token()
    oid = hg.ObjectID.from_name(f"step-{os.urandom(4).hex()}").hex()
    env = {**os.environ, "HOPLITE_DEVICE_BACKEND": "sim", "PYTHONPATH": _ROOT}
    env.pop("HOPLITE_LISTEN_HOST", None)
    env.pop("HOPLITE_ADVERTISE_HOST", None)
    holder = None
    try:
        for ns in names:
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
            made.append(ns)
            subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, capture_output=True)
        run = ["ip", "netns", "exec"]
        code = [sys.executable, "-c", _CLUSTER_IN_NAMESPACE, token]
        holder = subprocess.Popen(
            [*run, names[0], *code, "put", oid],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "PUT"
        reader = subprocess.run(
            [*run, names[1], *code, "get", oid], env=env, capture_output=True, text=True, timeout=90
        )
        assert reader.stdout.split()[:2] == ["NOT", "FOUND"], (reader.stdout, reader.stderr[-2000:])
    finally:
        if holder is not None:
            if holder.stdin is not None:
                holder.stdin.close()
            try:
                holder.wait(60)
            finally:
                if holder.poll() is None:
                    holder.kill()
                    holder.wait(10)
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shm.sweep_orphans()


def test_a_restarted_directory_gives_new_index_names_and_the_old_links_go(backend: str) -> None:
    """A node that rejoins a restarted directory (a new instance id) indexes under the new
    instance's key, and removes the links it made under the old one: no name of a directory that
    is gone outlives it. The object stays readable."""
    token = new_token()
    service = hg.start_directory(token)
    port = service.port
    node = hg.connect(service.address, token=token, shared_memory=True)
    try:
        oid, want = _put(node, backend, 73)
        old_key = _index_key(node)
        assert old_key == tickets.cluster_key(token, node._session.control.directory_id)
        old_link = os.path.join(shm.SHM_DIR, shm.index_name(old_key, oid.binary()))
        assert os.path.exists(old_link)
        first = node._session.control.directory_id
        hg.stop_directory(service)
        service = hg.start_directory(token, port=port)
        deadline = time.monotonic() + 60
        while node._session.control.directory_id in ("", first) or node._session.control.lost:
            assert time.monotonic() < deadline, "the node did not rejoin the restarted directory"
            time.sleep(0.02)
        new_key = _index_key(node)
        assert new_key != old_key
        assert new_key == tickets.cluster_key(token, node._session.control.directory_id)
        assert not os.path.exists(old_link)  # removed as the node rejoined
        assert np.array_equal(to_host(node.get(oid, timeout=30)), want)
        again, _ = _put(node, backend, 74)
        assert os.path.exists(os.path.join(shm.SHM_DIR, shm.index_name(new_key, again.binary())))
        node.delete(again)
        node.delete(oid)
    finally:
        node.close()
        hg.stop_directory(service)
