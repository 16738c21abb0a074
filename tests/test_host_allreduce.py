"""Members that all share one host (``hoplite_gpu.collective.host``) on real processes: a large
allreduce goes through shared memory, signalled over Unix sockets between the members, with no
directory message per round; exact and bit-identical results for every operator, dtype and group
size; arrays that differ fail typed on every member and the next round still runs there; a member
with a device array takes the whole group to the directory's schedule for that round; a member
SIGKILLed between rounds fails the survivors' round typed well before their timeout (in a watched
group: ``MemberLostError``); a member that does not come fails the round by the timeout, after
which the group's rounds run on the directory's schedule; nothing is left in ``/dev/shm``."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu.collective.host import goes_host
from tests.procs import Worker, make_array, make_strided, owner_and_workers_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

TIMEOUT = 60.0
ONE_HOST = {"shared_memory": True, "allreduce_direct_bytes": 1 << 16}


def _group(n: int, name: str, watch: bool = False, timeout: float = TIMEOUT, **config: Any) -> Any:
    """An owner and ``n - 1`` workers of this host, with shared memory, in one group."""
    return owner_and_workers_group(n, name, {**ONE_HOST, **config}, watch, timeout)


def _allreduce(
    group: Any, workers: list[Worker], dtype: str, shape: tuple[int, ...], seed: int, op: str
) -> Any:
    """One allreduce of every member; the owner's result, checked bit-identical on every member."""
    for w in workers:
        w.send("allreduce", group.name, dtype, shape, seed, op)
    got = hg.collective.allreduce(make_array(dtype, shape, seed), group, op)
    for w in workers:
        assert w.result().tobytes() == got.tobytes()
    return got


def _handled(owner: Any) -> dict[str, int]:
    handled = owner.directory_summary()["handled"]
    return {kind: count for kind, count in handled.items() if kind not in ("heartbeat", "summary")}


def _ours() -> set[str]:
    """This process's files in ``/dev/shm`` (segments and sockets are named by their pid)."""
    mark = f"-{os.getpid()}-"
    return {name for name in os.listdir("/dev/shm") if name.startswith("hoplite-") and mark in name}


def _want(op: str, dtype: str, shape: tuple[int, ...], seed: int, n: int) -> Any:
    inputs = np.stack([make_array(dtype, shape, seed + r) for r in range(n)])
    if op == "avg":
        total = inputs.sum(0)
        return total // n if np.issubdtype(total.dtype, np.integer) else total / total.dtype.type(n)
    return {"sum": inputs.sum(0), "max": inputs.max(0), "min": inputs.min(0), "prod": inputs.prod(0)}[op]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_operator_reduces_exactly_through_shared_memory_with_no_directory_message(n: int) -> None:
    before_files = _ours()
    with _group(n, f"host-{n}") as (owner, group, workers):
        shape = (100_003,)  # shards of unequal sizes
        for op in ("sum", "max", "min", "prod", "avg"):
            got = _allreduce(group, workers, "int64", shape, 3, op)
            assert np.array_equal(got, _want(op, "int64", shape, 3, n)), op
        assert goes_host(group._peers) and group._mesh is not None and not group._mesh.broken
        # Once the mesh is made a round sends the directory nothing, whatever its array.
        before = _handled(owner)
        for seed, (dtype, shape) in enumerate(
            [("float32", (1 << 18,)), ("float64", (300, 301)), ("int32", (1 << 20,))]
        ):
            got = _allreduce(group, workers, dtype, shape, seed, "sum")
            want = _want("sum", dtype, shape, seed, n)
            assert got.shape == shape and np.allclose(got, want, rtol=1e-5), dtype
        assert _handled(owner) == before
        for w in workers:
            w.send("destroy", group.name)
        group.destroy()
        for w in workers:
            w.result()
        assert _ours() == before_files  # the listening socket and the segment are gone


def test_arrays_that_differ_fail_typed_on_every_member_and_the_next_round_runs() -> None:
    n = 3
    with _group(n, "host-differ") as (_owner, group, workers):
        shape = (1 << 16,)
        _allreduce(group, workers, "float32", shape, 0, "sum")
        for w in workers:
            w.send("allreduce", group.name, "float64", shape, 1, "sum")
        with pytest.raises(hg.CollectiveArgumentError, match="must match"):
            hg.collective.allreduce(make_array("float32", shape, 1), group)
        for w in workers:
            with pytest.raises(RuntimeError, match="CollectiveArgumentError"):
                w.result()
        got = _allreduce(group, workers, "float32", shape, 2, "sum")
        assert np.allclose(got, _want("sum", "float32", shape, 2, n))
        assert not group._mesh.broken


def test_calls_refused_on_one_member_fail_every_member_alike_and_the_mesh_stays() -> None:
    """A dtype reductions lack, a call refused at once (on one member), a read-only array for
    the result (that member alone fails: the round ran on a copy)."""
    n = 3
    with _group(n, "host-refused") as (owner, group, workers):
        shape = (1 << 10,)
        for seed in range(2):  # the mesh is made, then what its making put is deleted
            _allreduce(group, workers, "float32", shape, seed, "sum")
        before = _handled(owner)
        match = "reductions support .* got int8"
        for w in workers:
            w.send("allreduce", group.name, "int8", shape, 1, "sum")
        with pytest.raises(hg.CollectiveArgumentError, match=match):
            hg.collective.allreduce(make_array("int8", shape, 1), group)
        for w in workers:
            with pytest.raises(RuntimeError, match=f"CollectiveArgumentError: allreduce #.*{match}"):
                w.result()
        # A read-only array where the result goes: that member runs the round on a copy, so the
        # others get the sum, and it alone fails; so does a reduce's read-only root.
        for cmd, extra in [("allreduce", ("sum",)), ("reduce_to", (1, "sum"))]:
            for w, dtype in zip(workers, ["readonly:float32", "float32"], strict=True):
                w.send(cmd, group.name, dtype, shape, 1, *extra)
            mine = make_array("float32", shape, 1)
            got = hg.collective.allreduce(mine, group) if cmd == "allreduce" else None
            if got is None:
                hg.collective.reduce(mine, 1, group)
            with pytest.raises(RuntimeError, match=r"CollectiveArgumentError: .* #.*array is read-only"):
                workers[0].result()
            theirs = workers[1].result()
            if got is not None:
                assert np.allclose(got, _want("sum", "float32", shape, 1, n))
                assert np.array_equal(theirs, got)
        # A member whose call is refused at once (an unknown operator, a root out of range) tells
        # the others through the mesh: they fail that round at once, not by their timeout.
        for cmd, bad, mine_ok in [("allreduce", ("xor",), ("sum",)), ("reduce_to", (9, "sum"), (0, "sum"))]:
            workers[0].send(cmd, group.name, "float32", shape, 4, *bad)
            workers[1].send(cmd, group.name, "float32", shape, 4, *mine_ok)
            started = time.monotonic()
            with pytest.raises(hg.CollectiveArgumentError, match="rank 1 refused its call"):
                if cmd == "allreduce":
                    hg.collective.allreduce(make_array("float32", shape, 4), group)
                else:
                    hg.collective.reduce(make_array("float32", shape, 4), 0, group)
            assert time.monotonic() - started < TIMEOUT / 2
            with pytest.raises(RuntimeError, match="InvalidArgumentError"):
                workers[0].result()
            with pytest.raises(RuntimeError, match=r"CollectiveArgumentError: .*rank 1 refused its call"):
                workers[1].result()
        # A reduce writes into its root's array only: the others' may be read-only.
        for w in workers:
            w.send("reduce_to", group.name, "readonly:int64", shape, 2, 0, "sum")
        got = hg.collective.reduce(make_array("int64", shape, 2), 0, group)
        assert np.array_equal(got, _want("sum", "int64", shape, 2, n))
        for rank, w in enumerate(workers, start=1):
            assert w.result().tobytes() == make_array("int64", shape, 2 + rank).tobytes()
        got = _allreduce(group, workers, "float32", shape, 3, "sum")  # the mesh is still there
        assert np.allclose(got, _want("sum", "float32", shape, 3, n)) and not group._mesh.broken
        assert _handled(owner) == before  # none of it went to the directory


def test_a_non_contiguous_array_on_one_member_keeps_the_round_on_the_mesh() -> None:
    # It went by the directory's schedule while the others waited on the mesh, until the
    # group's timeout; now it is worked on as a contiguous copy, the result copied back.
    n = 3
    with _group(n, "host-strided") as (owner, group, workers):
        shape = (1 << 12,)
        for seed in range(2):  # the mesh is made, then what its making put is deleted
            _allreduce(group, workers, "float32", shape, seed, "sum")
        before = _handled(owner)
        for cmd, extra in [("allreduce", ("sum",)), ("reduce_to", (1, "sum"))]:
            started = time.monotonic()
            for w, dtype in zip(workers, ["strided:float32", "float32"], strict=True):
                w.send(cmd, group.name, dtype, shape, 1, *extra)
            mine = make_strided("float32", shape, 1)
            got = hg.collective.allreduce(mine, group) if cmd == "allreduce" else None
            if got is None:
                assert hg.collective.reduce(mine, 1, group) is mine
            theirs = [w.result() for w in workers]
            want = _want("sum", "float32", shape, 1, n)
            if got is not None:
                assert got is mine and np.allclose(mine, want)
                assert not mine.base[..., 1].any()  # written in place, nothing beside it
            assert np.allclose(theirs[0], want)  # rank 1: the root of the reduce, or a member
            assert time.monotonic() - started < TIMEOUT / 3
        assert _handled(owner) == before and not group._mesh.broken
        # An array no result can be written into (a list) on one member is refused at once,
        # and the others are told through the mesh.
        workers[0].send("allreduce", group.name, "float32", shape, 2, "sum")
        workers[1].send("allreduce", group.name, "float32", shape, 2, "sum")
        with pytest.raises(hg.InvalidArgumentError, match="must be a NumPy or CuPy array"):
            hg.collective.allreduce(make_array("float32", shape, 2).tolist(), group)
        for w in workers:
            with pytest.raises(RuntimeError, match="rank 0 refused its call"):
                w.result()
        got = _allreduce(group, workers, "float32", shape, 3, "sum")
        assert np.allclose(got, _want("sum", "float32", shape, 3, n)) and not group._mesh.broken


def test_a_device_array_on_one_member_takes_the_round_to_the_directorys_schedule() -> None:
    n = 3
    with _group(n, "host-device") as (owner, group, workers):
        shape = (1 << 16,)
        _allreduce(group, workers, "float32", shape, 0, "sum")
        workers[0].send("allreduce", group.name, "sim:float32", shape, 4, "sum")
        workers[1].send("allreduce", group.name, "float32", shape, 4, "sum")
        before = _handled(owner)
        got = hg.collective.allreduce(make_array("float32", shape, 4), group)
        kind, device_result = workers[0].result()
        assert kind.endswith("SimDeviceArray") and device_result.tobytes() == got.tobytes()
        assert workers[1].result().tobytes() == got.tobytes()
        assert np.allclose(got, _want("sum", "float32", shape, 4, n))
        assert _handled(owner) != before  # the directory ran it
        got = _allreduce(group, workers, "float32", shape, 5, "sum")  # and the next is ours again
        assert np.allclose(got, _want("sum", "float32", shape, 5, n)) and not group._mesh.broken


@pytest.mark.parametrize("watch", [False, True])
def test_a_member_killed_between_rounds_fails_the_survivors_typed_before_their_timeout(watch: bool) -> None:
    n = 3
    with _group(n, f"host-kill-{watch}", watch=watch) as (_owner, group, workers):
        shape = (1 << 16,)
        _allreduce(group, workers, "float32", shape, 0, "sum")
        workers[0].send("allreduce", group.name, "float32", shape, 1, "sum")
        workers[1].kill()  # rank 2: never comes to the round
        started = time.monotonic()
        expected = hg.MemberLostError if watch else hg.ObjectLostError
        with pytest.raises(expected) as caught:
            hg.collective.allreduce(make_array("float32", shape, 1), group)
        assert 2 in caught.value.fields["lost_ranks"]
        with pytest.raises(RuntimeError, match=expected.__name__):
            workers[0].result()
        assert time.monotonic() - started < TIMEOUT / 2


def test_a_member_that_does_not_come_fails_the_round_by_the_timeout_then_rounds_go_on() -> None:
    n = 3
    with _group(n, "host-late", timeout=2.0) as (_owner, group, workers):
        shape = (1 << 16,)
        _allreduce(group, workers, "float32", shape, 0, "sum")
        workers[0].send("allreduce", group.name, "float32", shape, 1, "sum")
        started = time.monotonic()
        with pytest.raises(hg.HopliteTimeoutError) as caught:
            hg.collective.allreduce(make_array("float32", shape, 1), group)
        assert caught.value.fields["waiting_for_ranks"] == [2]
        assert time.monotonic() - started < 10
        with pytest.raises(RuntimeError, match=r"HopliteTimeoutError|HopliteError"):
            workers[0].result()  # it timed out too, or rank 0 left the mesh first: it fails
        # Rank 2 comes late: the round fails there too, never summed with a part of another's.
        workers[1].send("allreduce", group.name, "float32", shape, 1, "sum")
        with pytest.raises(RuntimeError, match="HopliteError"):
            workers[1].result()
        # The next rounds run on the directory's schedule, every member alike.
        got = _allreduce(group, workers, "float32", shape, 2, "sum")
        assert np.allclose(got, _want("sum", "float32", shape, 2, n)) and group._mesh.broken


def test_which_groups_go_through_shared_memory() -> None:
    from hoplite_gpu.collective.ring import Peer

    def peers(*rows: tuple[str, str, str]) -> list[Peer]:
        return [
            Peer(schedule, meet, key, "tcp", "10.0.0.1", 1000 + i)
            for i, (schedule, meet, key) in enumerate(rows)
        ]

    assert goes_host(peers(("auto", "/a", "k"), ("auto", "/b", "k")))
    assert not goes_host(peers(("auto", "/a", "k")))  # alone
    assert not goes_host(peers(("auto", "/a", "k"), ("auto", "/b", "k2")))  # hosts apart
    assert not goes_host(peers(("auto", "/a", ""), ("auto", "/b", "")))  # no shared memory
    assert not goes_host(peers(("auto", "/a", "k"), ("auto", "", "k")))  # one does not listen
    assert not goes_host(peers(("auto", "/a", "k"), ("ring", "/b", "k")))  # one asks for the directory's
    assert not goes_host(peers(("direct", "/a", "k"), ("auto", "/b", "k")))  # or for the data plane's


def _reduce_to(
    group: Any, workers: list[Worker], dtype: str, shape: tuple[int, ...], seed: int, op: str, root: int
) -> Any:
    """One reduce to ``root`` of every member; the root's result, every other member's array
    checked unchanged."""
    for w in workers:
        w.send("reduce_to", group.name, dtype, shape, seed, root, op)
    arr = make_array(dtype, shape, seed)
    got = hg.collective.reduce(arr, root, group, op)
    answers = {rank: w.result() for rank, w in enumerate(workers, start=1)}
    answers[0] = got
    for rank, answer in answers.items():
        if rank != root:
            assert answer.tobytes() == make_array(dtype, shape, seed + rank).tobytes(), rank
    return answers[root]


def test_a_reduce_goes_through_shared_memory_to_any_root_and_leaves_the_others_arrays() -> None:
    n = 4
    with _group(n, "host-reduce") as (owner, group, workers):
        shape = (50_001,)
        for seed in range(2):  # the mesh is made, then what its making put is deleted
            _allreduce(group, workers, "float32", (1 << 16,), seed, "sum")
        before = _handled(owner)
        for root, op, dtype in [
            (0, "sum", "int64"),
            (2, "avg", "float64"),
            (3, "max", "int32"),
            (1, "prod", "int64"),
        ]:
            got = _reduce_to(group, workers, dtype, shape, 5 + root, op, root)
            assert np.allclose(got, _want(op, dtype, shape, 5 + root, n)), (root, op)
            got = _allreduce(group, workers, "float32", shape, root, "sum")  # rounds of both mix
            assert np.allclose(got, _want("sum", "float32", shape, root, n), rtol=1e-5)
        assert _handled(owner) == before and not group._mesh.broken
        for w in workers:  # members that name other roots fail alike, and the next round runs
            w.send("reduce_to", group.name, "int64", shape, 1, 2, "sum")
        with pytest.raises(hg.CollectiveArgumentError, match="reduce to rank 1"):
            hg.collective.reduce(make_array("int64", shape, 1), 1, group)
        for w in workers:
            with pytest.raises(RuntimeError, match="CollectiveArgumentError"):
                w.result()
        got = _reduce_to(group, workers, "int64", shape, 9, "sum", 0)
        assert np.array_equal(got, _want("sum", "int64", shape, 9, n))


def test_small_arrays_and_scalars_go_through_shared_memory_with_the_defaults() -> None:
    n = 3
    with owner_and_workers_group(n, "host-small", {"shared_memory": True}) as (owner, group, workers):
        for seed in range(2):  # the mesh is made, then what its making put is deleted
            _allreduce(group, workers, "float32", (256,), seed, "sum")
        before = _handled(owner)
        for shape in [(256,), (2,), ()]:  # 1 KiB; fewer elements than members; a scalar
            got = _allreduce(group, workers, "int64", shape, 4, "sum")
            assert got.shape == shape and np.array_equal(got, _want("sum", "int64", shape, 4, n)), shape
            got = _reduce_to(group, workers, "int64", shape, 6, "max", 1)
            assert np.array_equal(got, _want("max", "int64", shape, 6, n)), shape
        assert _handled(owner) == before and not group._mesh.broken
