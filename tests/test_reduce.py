"""Multi-process reduce, allreduce and group collectives over real UCX on loopback.

Inputs come from ``make_array`` (integers 0..250), so sums of eight are exact in every float dtype
and results can be compared bit for bit whatever order the tree reduced them in.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu import collective as coll
from hoplite_gpu.node.sources import Route
from tests.procs import Worker, digest, make_array, start_workers, wait_for_events

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SIZES = [
    ("float32", (16, 16)),  # 1 KiB: inline, reduced by the directory
    ("float64", (128, 1024)),  # 1 MiB
    ("int64", (1024, 8192)),  # 64 MiB
]


def _eventually(condition: Any, timeout: float = 30.0) -> None:
    """Poll ``condition`` until it holds (a deadline, not a sleep used as synchronisation)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition never held")
        time.sleep(0.02)


def _put_inputs(workers: Any, dtype: str, shape: tuple[int, ...], seed: int) -> list[hg.ObjectID]:
    for i, w in enumerate(workers):
        w.send("put", dtype, shape, seed + i, "")
    return [hg.ObjectID.from_hex(w.result()) for w in workers]


def _expected(dtype: str, shape: tuple[int, ...], seeds: list[int], op: str = "sum") -> np.ndarray[Any, Any]:
    xs = np.stack([make_array(dtype, shape, s).astype(np.float64) for s in seeds])
    ufunc = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min, "prod": np.prod}[op]
    out = ufunc(xs, axis=0)
    if np.dtype(dtype).kind in "iu" and op == "avg":
        out = np.trunc(out)
    return out.astype(dtype)


@pytest.mark.parametrize(("dtype", "shape"), SIZES)
def test_reduce_then_allreduce_of_eight_processes(
    owner: Any, workers: Any, dtype: str, shape: tuple[int, ...]
) -> None:
    ids = _put_inputs(workers, dtype, shape, seed=10)
    start = owner.event_log()[-1]["seq"]
    rid = owner.reduce(ids, hg.ReduceOp.SUM)
    want = _expected(dtype, shape, [10 + i for i in range(8)])
    for w in workers:  # allreduce: every process gets the result while it is being reduced
        w.send("get", rid.hex(), 120)
    assert [w.result() for w in workers] == [digest(want)] * 8
    assert np.array_equal(owner.get(rid, timeout=60), want)
    assert owner.reduced_objects(rid, timeout=10) == owner.reduced_objects(rid) and set(
        owner.reduced_objects(rid)
    ) == set(ids)
    events = [e for e in owner.event_log(start) if e.get("object_id") in {rid.hex()} | {o.hex() for o in ids}]
    kinds = [e["kind"] for e in events]
    assert kinds.count("reduce_place") == 8 and "reduce_done" in kinds
    if np.prod(shape) * np.dtype(dtype).itemsize <= 64 * 1024:
        # Inline inputs are reduced in the directory: no data-plane transfer of inputs or result.
        assert "transfer_start" not in kinds and "vertex_done" not in kinds
    else:
        assert "vertex_done" in kinds
    owner.delete(rid)
    for w, oid in zip(workers, ids, strict=True):
        w.call("delete", oid.hex())
    # Intermediate outputs and fetched copies are gone too (drops arrive asynchronously).
    _eventually(lambda: [w.call("objects") for w in workers] == [0] * 8)


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "avg"])
def test_every_op_matches_numpy(owner: Any, workers: Any, op: str) -> None:
    shape = (300, 701)  # 1.6 MiB of float64: not a multiple of the reduce chunk
    ids = _put_inputs(workers[:5], "float64", shape, seed=3)
    rid = workers[0].call("reduce", [o.hex() for o in ids], op, None, "", 60)
    got = workers[7].call("get_array", rid, 60)
    xs = [make_array("float64", shape, 3 + i) for i in range(5)]
    want = {"sum": sum, "prod": np.prod, "min": np.min, "max": np.max, "avg": np.mean}[op]
    expected = want(xs) if op == "sum" else want(np.stack(xs), axis=0)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    for w, oid in zip(workers, ids, strict=False):
        w.call("delete", oid.hex())


def test_first_k_ignores_late_and_missing_inputs(owner: Any, workers: Any) -> None:
    shape = (256, 1024)  # 1 MiB of float32
    ids = [hg.ObjectID.random() for _ in range(8)]
    ontime = [0, 1, 2, 3, 4, 5]
    rid = owner.reduce(ids, hg.ReduceOp.SUM, num_objects=6, timeout=120)
    for i in ontime:
        workers[i].send("put", "float32", shape, 40 + i, ids[i].hex())
    for i in ontime:
        workers[i].result()
    want = _expected("float32", shape, [40 + i for i in ontime])
    assert workers[7].call("get", rid.hex(), 60) == digest(want)  # input 7 is never put
    assert sorted(owner.reduced_objects(rid), key=ids.index) == [ids[i] for i in ontime]
    workers[6].call("put", "float32", shape, 46, ids[6].hex())  # a straggler changes nothing
    assert digest(owner.get(rid, timeout=60)) == digest(want)
    assert ids[6] not in owner.reduced_objects(rid)
    owner.delete(rid)
    for i in [*ontime, 6]:
        workers[i].call("delete", ids[i].hex())


def test_mismatched_inputs_name_the_culprit_and_reduce_nothing(owner: Any, workers: Any) -> None:
    good = _put_inputs(workers[:3], "float32", (1024, 64), seed=1)
    bad = hg.ObjectID.from_hex(workers[3].call("put", "float32", (64, 1024), 1, ""))
    with pytest.raises(hg.ReduceMismatchError) as info:
        owner.reduce([*good, bad])
    assert info.value.object_id == bad.hex() and bad.hex() in str(info.value)
    # A culprit that arrives after the request fails the reduction for every getter.
    late = hg.ObjectID.random()
    rid = owner.reduce([*good, late])
    workers[4].call("put", "float64", (1024, 64), 1, late.hex())
    with pytest.raises(hg.ReduceMismatchError) as info:
        owner.get(rid, timeout=30)
    assert info.value.object_id == late.hex()
    with pytest.raises(hg.ReduceMismatchError):
        owner.reduced_objects(rid)
    with pytest.raises(hg.InvalidArgumentError):
        owner.reduce([good[0], good[0]])
    with pytest.raises(hg.InvalidArgumentError):
        owner.reduce(good, num_objects=4)
    for w, oid in zip(workers, [*good, bad, late], strict=False):
        w.call("delete", oid.hex())


def test_a_reduction_that_never_gets_its_inputs_times_out(owner: Any) -> None:
    rid = owner.reduce([hg.ObjectID.random(), hg.ObjectID.random()], timeout=0.5)
    with pytest.raises(hg.HopliteTimeoutError):
        owner.get(rid, timeout=30)
    with pytest.raises(hg.HopliteTimeoutError):
        owner.reduced_objects(rid)


def test_a_get_on_the_node_computing_a_reduction_that_times_out_hears_the_timeout(owner: Any) -> None:
    """The root's vertex runs here (this node holds the one input that came): a get waiting on its
    partial result raises the reduction's own error, not "deleted by its owner"."""
    here = owner.put(np.ones(1 << 18, np.float32))  # 1 MiB: reduced by a vertex, not inline
    rid = owner.reduce([here, hg.ObjectID.random()], timeout=1)
    with pytest.raises(hg.HopliteTimeoutError):
        owner.get(rid, timeout=30)
    owner.delete(here)


def test_a_node_reducing_several_of_its_own_objects_deletes_none_of_the_trees_outputs(owner: Any) -> None:
    """Every vertex runs here, so parents read their children's outputs from this node's store.
    Before, a parent that found its child's output not made yet fetched it, and then deleted it as
    a copy fetched for vertices: everywhere, since this node owns it (the directory broke its
    invariant "vertex 2's output is not registered" on every such reduce)."""
    start = owner.event_log()[-1]["seq"]
    ours: set[str] = set()
    for round_ in range(3):
        ids = [owner.put(np.full(1 << 18, i + round_, np.float32)) for i in range(4)]
        rid = owner.reduce(ids)
        expected = np.full(1 << 18, 6 + 4 * round_, np.float32)
        np.testing.assert_array_equal(owner.get(rid, timeout=30), expected)
        ours |= {oid.hex() for oid in [*ids, rid]}
        for oid in [*ids, rid]:
            owner.delete(oid)
    events = [e for e in owner.event_log() if e["seq"] > start]
    assert sum(e["kind"] == "reduce_done" for e in events) == 3
    others = [e for e in events if e["kind"].startswith("delete") and e["object_id"] not in ours]
    assert not others, others


def test_concurrent_reductions_sharing_inputs_do_not_double_count(owner: Any, workers: Any) -> None:
    shape = (512, 1024)  # 4 MiB of int64
    ids = _put_inputs(workers, "int64", shape, seed=70)
    rids = []
    subsets = [ids, ids[:4], ids[2:], ids]
    ops = ["sum", "sum", "sum", "max"]
    for i, (subset, op) in enumerate(zip(subsets, ops, strict=True)):
        workers[i].send("reduce", [o.hex() for o in subset], op, None, "", 60)
    rids = [w.result() for w in workers[:4]]
    for i, rid in enumerate(rids):
        workers[7 - i].send("get", rid, 120)
    try:
        got = [w.result() for w in workers[4:][::-1]]
    except Exception:
        print([e for e in owner.event_log() if "reduce_failed" in e["kind"] or e["kind"] == "delete"][-10:])
        raise
    seeds = [70 + ids.index(o) for o in ids]
    want = [
        _expected("int64", shape, seeds),
        _expected("int64", shape, seeds[:4]),
        _expected("int64", shape, seeds[2:]),
        _expected("int64", shape, seeds, "max"),
    ]
    assert got == [digest(w) for w in want]
    for w, oid in zip(workers, ids, strict=True):
        w.call("delete", oid.hex())


def test_a_reduction_of_a_reduction_streams(owner: Any, workers: Any) -> None:
    shape = (1024, 256)  # 1 MiB of float32
    ids = _put_inputs(workers[:4], "float32", shape, seed=5)
    first = owner.reduce(ids[:2])
    second = owner.reduce([first, *ids[2:]])
    want = _expected("float32", shape, [5, 6, 7, 8])
    assert workers[6].call("get", second.hex(), 60) == digest(want)
    wait_for_events(
        owner, lambda evs: any(e["kind"] == "reduce_done" and e["object_id"] == second.hex() for e in evs)
    )
    for w, oid in zip(workers, ids, strict=False):
        w.call("delete", oid.hex())


def test_group_collectives_match_numpy(owner: Any, workers: Any) -> None:
    world = len(workers)
    name = hg.ObjectID.random().hex()
    before = [w.call("objects") for w in workers]  # left by earlier tests
    for rank, w in enumerate(workers):
        w.send("group", name, rank, world)
    assert [w.result() for w in workers] == list(range(world))

    def everyone(cmd: str, *args: Any) -> list[Any]:
        for w in workers:
            w.send(cmd, name, *args)
        return [w.result() for w in workers]

    seeds = list(range(world))
    # 256 KiB: one tree; 3 MiB: one shard per member (777777 elements: the shards differ in size)
    for shape in [(64, 1024), (777, 1001)]:
        assert (np.prod(shape) * 4 >= owner.config.allreduce_shard_bytes) == (shape[0] == 777)
        for op in ("sum", "avg", "max"):
            results = everyone("allreduce", "float32", shape, 0, op)
            want = _expected("float32", shape, seeds, op)
            assert all(np.array_equal(r, want) for r in results), (shape, op)
    small = everyone("allreduce", "int32", (4,), 0, "sum")  # inline
    assert all(np.array_equal(r, _expected("int32", (4,), seeds)) for r in small)
    gathered = everyone("allgather", "float64", (8, 1024), 9)
    rows = [make_array("float64", (8, 1024), 9 + r) for r in range(world)]
    assert all(all(np.array_equal(a, b) for a, b in zip(g, rows, strict=True)) for g in gathered)
    gathered = everyone("gather", "float32", (3, 1000), 6, 2)
    rows = [make_array("float32", (3, 1000), 6 + r) for r in range(world)]
    assert all(np.array_equal(a, b) for a, b in zip(gathered[2], rows, strict=True))
    assert gathered[:2] + gathered[3:] == [None] * (world - 1)
    scattered = everyone("reducescatter", "int64", (1000, 33), 2, "sum")
    for rank, got in enumerate(scattered):
        parts = [make_array("int64", (1000, 33), 2 + src * 100 + rank) for src in range(world)]
        assert np.array_equal(got, np.sum(parts, axis=0))
    sent = everyone("broadcast", "float32", (512, 1024), 4, 3)
    assert all(np.array_equal(s, make_array("float32", (512, 1024), 4 + 3)) for s in sent)
    reduced = everyone("reduce_to", "float32", (512, 1024), 1, 5, "sum")
    assert np.array_equal(reduced[5], _expected("float32", (512, 1024), [1 + r for r in range(world)]))
    assert np.array_equal(reduced[0], make_array("float32", (512, 1024), 1))  # others keep theirs
    everyone("barrier")
    # Every member deleted what it created (others' drops arrive asynchronously); the final
    # barrier is no object.
    everyone("destroy")
    _eventually(lambda: [w.call("objects") for w in workers] == before)


@pytest.fixture
def ring_pair() -> Iterator[tuple[Any, Worker]]:
    """A node and a worker on the directory's ring schedule (not the direct ring, which the
    tests' members would take: no shared memory, so as if on hosts apart)."""
    node = hg.init(allreduce_schedule="ring")
    (w,) = start_workers(node.directory_address, node.token, 1, allreduce_schedule="ring")
    yield node, w
    w.kill()
    node.close()


def test_an_allreduce_lends_its_shards_and_deletes_them_when_it_returns(ring_pair: Any) -> None:
    """The sharded allreduce puts the caller's array without a copy: while it waits for the other
    member, the store serves this member's shards from the caller's memory (as the shards, or as
    the outputs its ring vertices wrote over them); once it returns they are gone (deleted at
    once, not at the group's next collective), and so is every copy in the array: the other
    member's result it received, and its own, which the other member read from it."""
    owner, w = ring_pair
    name = hg.ObjectID.random().hex()
    w.send("group", name, 1, 2)
    assert w.result() == 1
    group = coll.Group(owner, 0, 2, name, timeout=60)
    shape = (512, 1024)  # 2 MiB of float32: one shard of 1 MiB per member
    arr = make_array("float32", shape, 0)
    lent = [group.object_id(0, "allreduce-shard", j, 0) for j in range(2)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(coll.allreduce, arr, group)
        _eventually(lambda: len(_in(owner, arr)) == 2)
        w.send("allreduce", name, "float32", shape, 0, "sum")
        got = running.result(timeout=60)
    want = _expected("float32", shape, [0, 1])
    assert np.array_equal(got, want) and np.array_equal(w.result(), want)
    assert [owner._store.get(oid) for oid in lent] == [None, None]
    assert _in(owner, arr) == []
    results = [group.object_id(0, "allreduce-shard-result", j) for j in range(2)]
    assert owner._store.get(results[1]) is None
    w.send("destroy", name)
    group.destroy()
    w.result()


def _in(node: Any, arr: Any) -> list[Any]:
    """The objects of ``node``'s store whose bytes are ``arr``'s memory."""
    held = [obj.buffer.array for obj in node._store.objects()]
    return [a for a in held if isinstance(a, np.ndarray) and np.shares_memory(a, arr)]


def test_a_copy_received_into_the_callers_array_stays_in_the_store(owner: Any, workers: Any) -> None:
    """``get_into(..., received=)`` pulls the object straight into ``out``; the store's copy is
    that memory (others may read it until the caller withdraws it), not a copy made beside it."""
    shape = (2048, 1024)  # 8 MiB of float32
    oid = hg.ObjectID.from_hex(workers[2].call("put", "float32", shape, 7, ""))
    out = np.zeros(shape, np.float32)
    received: list[Any] = []
    got = owner._io.run(owner._fetcher.get_into(oid, 30, out, Route(), received))
    assert got is out and np.array_equal(out, make_array("float32", shape, 7))
    (copy,) = received
    assert owner._store.get(oid) is copy and copy.complete
    assert np.shares_memory(copy.buffer.array, out)
    owner._store.remove(oid)
    workers[2].call("delete", oid.hex())


def test_an_allreduce_that_fails_withdraws_the_shards_it_lent(owner: Any, workers: Any) -> None:
    """An allreduce that times out (the other member never calls it) returns the caller's array
    to it: no one can read the shards it lent any more."""
    name = hg.ObjectID.random().hex()
    w = workers[1]
    w.send("group", name, 1, 2)
    assert w.result() == 1
    group = coll.Group(owner, 0, 2, name, timeout=1)
    arr = make_array("float32", (512, 1024), 0)
    with pytest.raises(hg.HopliteTimeoutError):
        coll.allreduce(arr, group)
    lent = [group.object_id(0, "allreduce-shard", j, 0) for j in range(2)]
    assert [owner._store.get(oid) for oid in lent] == [None, None]
    assert _in(owner, arr) == []  # nor the outputs written over them
    w.send("get", lent[1].hex(), 2)  # the shard the other member would have reduced
    with pytest.raises(RuntimeError):
        w.result()


def test_an_allreduce_that_fails_withdraws_the_outputs_written_over_its_shards() -> None:
    """Three members; rank 1 puts its shards and is stopped (SIGSTOP) before its root reduces
    shard 1. The ring vertex here for shard 1 (rank 2's shard, then this member's) completes its
    output over this member's shard 1, which no result copy covers. When the call times out, that
    output leaves the store with the shards: nothing serves the caller's array any more."""
    import os
    import signal

    name = hg.ObjectID.random().hex()
    owner = hg.init(allreduce_schedule="ring")  # the directory's ring: its vertices write over shards
    b, c = start_workers(
        owner.directory_address, owner.token, 2, lease_timeout=60.0, allreduce_schedule="ring"
    )
    try:
        for rank, w in ((1, b), (2, c)):
            w.send("group", name, rank, 3, 4)
        assert [b.result(), c.result()] == [1, 2]
        group = coll.Group(owner, 0, 3, name, timeout=4)
        shape = (768, 1024)  # 3 MiB of float32: a shard of 1 MiB per member
        shards = {group.object_id(0, "allreduce-shard", j, 1).hex() for j in range(3)}
        b.send("allreduce", name, "float32", shape, 1, "sum")
        wait_for_events(owner, lambda evs: shards <= {e.get("object_id") for e in evs if e["kind"] == "put"})
        os.kill(b.proc.pid, signal.SIGSTOP)
        c.send("allreduce", name, "float32", shape, 2, "sum")
        arr = make_array("float32", shape, 0)
        with pytest.raises(hg.HopliteError):
            coll.allreduce(arr, group)
        assert owner.stats()["outputs_over_inputs"] > 0
        assert _in(owner, arr) == []
    finally:
        for w in (b, c):
            os.kill(w.proc.pid, signal.SIGCONT)
            w.kill()
        owner.close()


def test_a_member_destroys_its_group_without_the_others(workers: Any) -> None:
    """``destroy(wait=False)`` returns before the other members destroy theirs (Ray's contract);
    the clean-up waits for them, and the destroyed group refuses collectives."""
    world = len(workers)
    name = hg.ObjectID.random().hex()
    before = [w.call("objects") for w in workers]
    for rank, w in enumerate(workers):
        w.send("group", name, rank, world)
    assert [w.result() for w in workers] == list(range(world))
    for w in workers:
        w.send("allreduce", name, "float32", (64,), 0, "sum")
    assert all(np.array_equal(w.result(), _expected("float32", (64,), list(range(world)))) for w in workers)
    assert workers[0].call("destroy_later", name)  # answers while the others wait for nothing
    with pytest.raises(RuntimeError, match=r"InvalidArgumentError: group .* was destroyed"):
        workers[0].call("allreduce", name, "float32", (64,), 0, "sum")
    for w in workers[1:]:
        w.send("destroy", name)  # waits for every member: member 0's barrier runs in the background
    assert [w.result() for w in workers[1:]] == [None] * (world - 1)
    assert workers[0].call("destroyed", name) is None
    _eventually(lambda: [w.call("objects") for w in workers] == before)


def test_a_destroyed_group_is_cleaned_up_after_its_timeout(workers: Any) -> None:
    """A member whose group the others never destroy deletes its objects after the group's
    timeout, without them."""
    pair = workers[:2]
    name = hg.ObjectID.random().hex()
    before = [w.call("objects") for w in pair]
    for rank, w in enumerate(pair):
        w.send("group", name, rank, 2, 2.0)
    assert [w.result() for w in pair] == [0, 1]
    for w in pair:
        w.send("allgather", name, "int32", (1000,), 3)
    assert [len(w.result()) for w in pair] == [2, 2]
    assert pair[0].call("destroy_later", name)
    assert pair[0].call("destroyed", name) is None  # after the 2 s timeout of its final barrier
    assert pair[0].call("objects") <= before[0] + 1  # at most its copy of member 1's piece
    assert pair[1].call("destroy_later", name)  # its barrier times out too: member 0's was answered
    assert pair[1].call("destroyed", name) is None
    _eventually(lambda: [w.call("objects") for w in pair] == before)


def test_reduce_argument_errors_are_typed(owner: Any) -> None:
    oid = owner.put(np.zeros(4, np.float32))
    with pytest.raises(hg.InvalidArgumentError):
        owner.reduce([])
    with pytest.raises(hg.InvalidArgumentError):
        owner.reduce([oid], op="median")
    with pytest.raises(hg.InvalidArgumentError):
        owner.reduce([oid], reduction_id=oid)
    for degree in (0, 1.5, True):
        with pytest.raises(hg.InvalidArgumentError, match="degree"):
            owner.reduce([oid], degree=degree)
    with pytest.raises(hg.InvalidArgumentError):
        owner.reduce([oid.hex()])
    with pytest.raises(hg.ObjectExistsError):
        owner.reduce([hg.ObjectID.random()], reduction_id=oid)
    text = owner.put(np.zeros(4, np.complex64))
    with pytest.raises(hg.InvalidArgumentError):
        owner.reduce([text])
    rid = owner.reduce([oid], reduction_id=hg.ObjectID.random())
    assert owner.reduce([oid], reduction_id=rid) == rid  # the same request again is accepted
    with pytest.raises(hg.ObjectExistsError):
        owner.reduce([oid], op="max", reduction_id=rid)
    with pytest.raises(hg.ObjectNotFoundError):
        owner.reduced_objects(hg.ObjectID.random())
    assert np.array_equal(owner.get(rid, timeout=10), np.zeros(4, np.float32))
    for o in (oid, text, rid):
        owner.delete(o)


def test_reduce_with_shared_memory_on(owner: Any) -> None:
    """Workers that copy through shared memory on the same host reduce and get correctly."""
    workers = start_workers(owner.directory_address, owner.token, 3, shared_memory=True)
    try:
        ids = _put_inputs(workers, "float32", (2048, 1024), seed=20)  # 8 MiB
        rid = hg.ObjectID.from_hex(workers[0].call("reduce", [o.hex() for o in ids], "sum", None, "", 60))
        want = _expected("float32", (2048, 1024), [20, 21, 22])
        for w in workers:
            w.send("get", rid.hex(), 60)
        assert [w.result() for w in workers] == [digest(want)] * 3
    finally:
        for w in workers:
            w.stop()


WEIGHTS = [0.5, -1.25, 2.0, 0.75, 3.0]  # dyadic: exact in float32/float64 for these inputs


@pytest.mark.parametrize(
    ("dtype", "shape", "rtol"),
    [
        ("float64", (300, 701), 0.0),  # 1.6 MiB, not a multiple of the reduce chunk
        ("float32", (1024, 1024), 0.0),  # 4 MiB
        ("float16", (512, 512), 2e-3),
        ("bfloat16", (512, 512), 1.6e-2),
        ("float32", (4, 4), 0.0),  # 64 bytes: inline, reduced by the directory
    ],
)
def test_a_weighted_reduce_matches_numpy_through_a_tree(
    owner: Any, workers: Any, dtype: str, shape: tuple[int, ...], rtol: float
) -> None:
    ids = _put_inputs(workers[:5], dtype, shape, seed=40)
    # degree 2: vertices with a leaf child (scaled by its input's weight) and with a vertex child
    # (its output already weighted).
    rid = owner.reduce(ids, weights=WEIGHTS, degree=2, timeout=60)
    got = owner.get(rid, timeout=60)
    expected = sum(w * make_array(dtype, shape, 40 + i).astype(np.float64) for i, w in enumerate(WEIGHTS))
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=rtol, atol=rtol * 750)
    for w, oid in zip(workers, ids, strict=False):
        w.call("delete", oid.hex())


def test_weights_are_refused_for_integers_other_ops_and_the_wrong_count(owner: Any, workers: Any) -> None:
    ids = _put_inputs(workers[:2], "int64", (8, 8), seed=1)
    with pytest.raises(hg.InvalidArgumentError, match="needs floats"):
        owner.reduce(ids, weights=[1.0, 2.0], timeout=10)
    with pytest.raises(hg.InvalidArgumentError, match="op=SUM"):
        owner.reduce(ids, op="max", weights=[1.0, 2.0])
    with pytest.raises(hg.InvalidArgumentError, match="give one per id"):
        owner.reduce(ids, weights=[1.0])
    with pytest.raises(hg.InvalidArgumentError, match="finite"):
        owner.reduce(ids, weights=[1.0, float("nan")])
    for w, oid in zip(workers, ids, strict=False):
        w.call("delete", oid.hex())


def test_a_groups_objects_carry_no_digest_and_a_plain_put_does(owner: Any) -> None:
    arr = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: published before its copy ends
    group = hg.collective.Group(owner, 0, 1, "no-digest")
    hg.collective.broadcast(arr, 0, group)
    oid = group.object_id(0, "broadcast")
    assert owner._store.get(oid).digest == b""
    assert np.array_equal(owner.get(oid, timeout=10), arr)
    plain = owner.put(arr)
    assert owner._store.get(plain).digest == hg.memory.digest_of(arr.view(np.uint8))
    group.destroy()
    owner.delete(plain)
