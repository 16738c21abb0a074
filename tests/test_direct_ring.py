"""The direct ring (``hoplite_gpu.collective.ring``) on real processes: members on hosts apart pass
a large allreduce, or a large reduce along a chain to its root, member to member over the data
plane with no directory message per round; exact results for every operator, size and group
size; members of one host reduce along the chain too; a member SIGKILLed half way through serving
its running sum fails every survivor (the reduce's root at least) with a typed error and leaves
nothing in their stores; members whose schedules differ agree on one."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu.collective.ring import Peer, goes_direct
from tests.procs import Worker, make_array, make_strided, owner_and_workers_group, start_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

TIMEOUT = 60.0
SHARDED = {"shared_memory": False, "allreduce_direct_bytes": 1 << 16}  # hosts apart, no shared memory


def _group(n: int, name: str, watch: bool = False, **config: Any) -> Any:
    """An owner and ``n - 1`` workers without shared memory (each as if on its own host), in one
    group; the workers are killed and the owner closed after the block."""
    return owner_and_workers_group(n, name, {**SHARDED, **config}, watch, TIMEOUT)


def _allreduce(
    group: Any, workers: list[Worker], dtype: str, shape: tuple[int, ...], seed: int, op: str
) -> Any:
    """One allreduce of every member; the owner's result (checked equal on every member), and
    nothing left in the owner's store that reads its array, which it lent while the call ran."""
    for w in workers:
        w.send("allreduce", group.name, dtype, shape, seed, op)
    got = hg.collective.allreduce(make_array(dtype, shape, seed), group, op)
    for w in workers:
        assert np.array_equal(w.result(), got)
    held = [a for obj in group.node._store.objects() for a in (*obj.buffer.pieces, obj.buffer.array)]
    assert not [a for a in held if isinstance(a, np.ndarray) and np.shares_memory(a, got)]
    return got


def _handled(owner: Any) -> dict[str, int]:
    """The messages the directory handled, by type, but for the nodes' heartbeats and these
    requests themselves."""
    handled = owner.directory_summary()["handled"]
    return {kind: count for kind, count in handled.items() if kind not in ("heartbeat", "summary")}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_operator_sums_exactly_without_a_directory_message_per_round(n: int) -> None:
    with _group(n, f"direct-{n}") as (owner, group, workers):
        shape = (100_003,)  # chunks of unequal sizes
        for op in ("sum", "max", "min", "prod", "avg"):
            got = _allreduce(group, workers, "int64", shape, 3, op)
            inputs = np.stack([make_array("int64", shape, 3 + r) for r in range(n)])
            want = {
                "sum": inputs.sum(0),
                "max": inputs.max(0),
                "min": inputs.min(0),
                "prod": inputs.prod(0),
                "avg": inputs.sum(0) // n,  # integers: truncated toward zero (non-negative here)
            }[op]
            assert np.array_equal(got, want), op
        assert goes_direct(group._peers)
        assert group._wire is not None and group._wire.out is not None  # (collective.wire)
        # Once the members know each other a round sends the directory nothing: the ring's
        # objects never reach it, and a member puts nothing else a later round would delete.
        before = _handled(owner)
        for seed in range(5):
            _allreduce(group, workers, "float32", (1 << 18,), seed, "sum")
        assert _handled(owner) == before


def test_a_member_that_starts_later_than_the_stall_timeout_still_gets_the_sum() -> None:
    # A straggler (a rank busy elsewhere) has not lent what it sends when its successor asks:
    # the successor asks again rather than failing the call.
    n = 3
    with _group(n, "direct-late", stall_timeout=1.0) as (_owner, group, workers):
        shape = (1 << 18,)
        _allreduce(group, workers, "float32", shape, 0, "sum")  # the members learn each other
        for w in workers:
            w.send("allreduce", group.name, "float32", shape, 7, "sum")
        time.sleep(2.5)  # the scenario, not a synchronisation: rank 0 comes 2.5 stall timeouts late
        got = hg.collective.allreduce(make_array("float32", shape, 7), group)
        want = sum(make_array("float32", shape, 7 + r).astype(np.float64) for r in range(n))
        assert np.allclose(got, want)
        for w in workers:
            assert np.array_equal(w.result(), got)


def test_a_reduction_that_fails_fails_the_call_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # An error of the reduction on the receiving thread is final: the pull is not asked again
    # (as a stalled one is), and every member hears of it well before the group's timeout.
    from hoplite_gpu.collective import wire

    n = 3
    with _group(n, "direct-broken") as (_owner, group, workers):
        shape = (1 << 18,)
        _allreduce(group, workers, "float32", shape, 0, "sum")

        def broken(*args: Any, **kwargs: Any) -> None:
            raise ValueError("no such reduction")

        monkeypatch.setattr(wire, "reduce_chunk", broken)  # the owner's only (rank 0)
        for w in workers:
            w.send("allreduce", group.name, "float32", shape, 1, "sum")
        start = time.monotonic()
        with pytest.raises(hg.HopliteError, match="the reduction failed"):
            hg.collective.allreduce(make_array("float32", shape, 1), group)
        for w in workers:
            with pytest.raises(RuntimeError, match="Error"):
                w.result(timeout=TIMEOUT / 2)
        assert time.monotonic() - start < TIMEOUT / 3


@pytest.mark.parametrize("signal", ["KILL", "STOP"])
def test_a_member_killed_while_serving_its_running_sum_fails_every_survivor_typed(signal: str) -> None:
    # KILL: its connections close at once; STOP (a hung member): the others' pulls stall, and
    # they wait for the directory to declare it lost when its lease runs out.
    n = 4
    quick = {"lease_timeout": 3.0, "stall_timeout": 3.0}
    with _group(n, f"direct-{signal}", watch=True, **quick) as (owner, group, workers):
        shape = (1 << 20,)  # 4 MiB of float32
        _allreduce(group, workers, "float32", shape, 0, "sum")  # the members learn each other
        seq = group.seq  # the next allreduce's
        # Rank 2 serves rank 3 its chunk and its running sums, and dies half way through them.
        victim = workers[1]
        victim.call("arm", f"serve:{group.object_id(seq, 'ring-out', 2).hex()}:0.5:{signal}")
        for w in workers:
            w.send("allreduce", group.name, "float32", shape, 1, "sum")
        start = time.monotonic()
        want = sum(make_array("float32", shape, 1 + r).astype(np.float64) for r in range(n))
        # Each survivor gets the exact sum (it had every byte it needed before the member was
        # lost) or MemberLostError naming it, never a wrong sum; those that waited on it fail.
        outcomes: list[str] = []
        try:
            got = hg.collective.allreduce(make_array("float32", shape, 1), group)
            assert np.array_equal(got, want.astype(np.float32))
            outcomes.append("sum")
        except hg.HopliteError as exc:
            assert isinstance(exc, hg.MemberLostError) and exc.lost_ranks == [2], exc
            outcomes.append("lost")
        assert time.monotonic() - start < TIMEOUT / 3, "the survivors must not wait for their timeout"
        for w in (workers[0], workers[2]):
            try:
                assert np.array_equal(w.result(timeout=TIMEOUT / 3), want.astype(np.float32))
                outcomes.append("sum")
            except RuntimeError as exc:
                assert "MemberLostError" in str(exc) and "member 2 lost" in str(exc), exc
                outcomes.append("lost")
        # Rank 1 waits for the member to have read all it lent; rank 3 may have every byte (a
        # pull cut early is asked again, and a second serve may finish before the first stops).
        assert "lost" in outcomes, outcomes
        assert signal == "STOP" or not victim.proc.is_alive()
        # Nothing of the ring stays in the owner's store (it lent its own array).
        ring = {group.object_id(seq, "ring-out", r) for r in range(n)}
        assert not [oid for oid in ring if owner._store.get(oid) is not None]


def _reduce(group: Any, workers: list[Worker], shape: tuple[int, ...], seed: int, dst: int, op: str) -> Any:
    """One reduce to ``dst`` on every member; ``dst``'s result (every other member's array is
    returned unchanged), and nothing left in the owner's store."""
    seq = group.seq
    for w in workers:
        w.send("reduce_to", group.name, "int64", shape, seed, dst, op)
    mine = make_array("int64", shape, seed)
    got = hg.collective.reduce(mine.copy(), dst, group, op)
    results = [got] + [w.result() for w in workers]
    for rank, result in enumerate(results):
        if rank != dst:
            assert np.array_equal(result, make_array("int64", shape, seed + rank)), rank
    chain = {group.object_id(seq, "chain-out", r) for r in range(group.world_size)}
    assert not [obj for obj in group.node._store.objects() if obj.object_id in chain]
    held = [a for obj in group.node._store.objects() for a in (*obj.buffer.pieces, obj.buffer.array)]
    assert not [a for a in held if isinstance(a, np.ndarray) and np.shares_memory(a, got)]
    return results[dst]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_reduce_goes_member_to_member_to_its_root_exactly(n: int) -> None:
    with _group(n, f"chain-{n}") as (owner, group, workers):
        shape = (300_007,)  # several chunks, the last one short
        inputs = np.stack([make_array("int64", shape, 3 + r) for r in range(n)])
        for dst, op in zip(range(n), ("sum", "max", "min", "avg"), strict=False):
            want = {
                "sum": inputs.sum(0),
                "max": inputs.max(0),
                "min": inputs.min(0),
                "avg": inputs.sum(0) // n,  # integers: truncated toward zero (non-negative here)
            }[op]
            assert np.array_equal(_reduce(group, workers, shape, 3, dst, op), want), (dst, op)
        assert np.array_equal(_reduce(group, workers, shape, 3, n - 1, "prod"), inputs.prod(0))
        assert goes_direct(group._peers)
        # Once the members know each other a round sends the directory nothing.
        before = _handled(owner)
        for seed in range(3):
            _reduce(group, workers, shape, seed, seed % n, "sum")
        assert _handled(owner) == before


def test_members_of_one_host_reduce_along_the_chain_exactly() -> None:
    # Shared memory on, every member on this host: the reduce takes the chain over loopback
    # (the allreduce keeps the directory's shared-memory schedule).
    n = 3
    with _group(n, "chain-one-host", shared_memory=True) as (owner, group, workers):
        shape = (1 << 18,)  # 2 MiB of int64
        for seed in (5, 6):  # (the second deletes what the members put to learn each other)
            want = sum(make_array("int64", shape, seed + r) for r in range(n))
            assert np.array_equal(_reduce(group, workers, shape, seed, 1, "sum"), want)
        assert group._peers[0].host_key and len({p.host_key for p in group._peers}) == 1
        assert goes_direct(group._peers, sharing=True) and not goes_direct(group._peers)
        before = _handled(owner)
        for seed in range(3):
            want = sum(make_array("int64", shape, seed + r) for r in range(n))
            assert np.array_equal(_reduce(group, workers, shape, seed, seed % n, "sum"), want)
        assert _handled(owner) == before


def test_by_default_the_direct_paths_take_what_the_directory_would_not_keep_inline() -> None:
    # The defaults (hosts apart): an array one element past the directory's inline objects goes
    # member to member, one of exactly that size through the directory (inline: faster there).
    config = hg.Config()
    assert config.allreduce_direct_bytes == 0
    assert config.direct_min_bytes == config.inline_threshold_bytes + 1
    assert hg.Config(allreduce_direct_bytes=1 << 20).direct_min_bytes == 1 << 20
    with pytest.raises(hg.InvalidArgumentError, match="allreduce_direct_bytes must be >= 0"):
        hg.Config(allreduce_direct_bytes=-1)
    inline = config.inline_threshold_bytes // 8  # int64 elements
    with owner_and_workers_group(3, "direct-default", {"shared_memory": False}, False, TIMEOUT) as (
        owner,
        group,
        workers,
    ):
        for shape, direct in (((inline + 1,), True), ((inline,), False)):
            for seed in (0, 1):  # (the members learn each other; the second deletes what they put)
                _allreduce(group, workers, "int64", shape, seed, "sum")
            before = _handled(owner)
            got = _allreduce(group, workers, "int64", shape, 2, "sum")
            assert np.array_equal(got, sum(make_array("int64", shape, 2 + r) for r in range(3)))
            reduced = _reduce(group, workers, shape, 3, 1, "sum")
            assert np.array_equal(reduced, sum(make_array("int64", shape, 3 + r) for r in range(3)))
            assert (_handled(owner) == before) == direct, shape


def test_a_reduce_waits_for_a_root_later_than_the_stall_timeout() -> None:
    # The root (a rank busy elsewhere) comes late: the members before it wait for it to read.
    n = 3
    with _group(n, "chain-late", stall_timeout=1.0) as (_owner, group, workers):
        shape = (1 << 18,)
        _reduce(group, workers, shape, 0, 0, "sum")  # the members learn each other
        for w in workers:
            w.send("reduce_to", group.name, "int64", shape, 7, 0, "sum")
        time.sleep(2.5)  # the scenario, not a synchronisation: rank 0 comes 2.5 stall timeouts late
        got = hg.collective.reduce(make_array("int64", shape, 7), 0, group)
        assert np.array_equal(got, sum(make_array("int64", shape, 7 + r) for r in range(n)))
        for rank, w in enumerate(workers, start=1):
            assert np.array_equal(w.result(), make_array("int64", shape, 7 + rank))


@pytest.mark.parametrize("victim", [1, 2])
def test_a_member_killed_while_serving_its_partial_reduce_fails_the_root_typed(victim: int) -> None:
    # A chain 1 -> 2 -> 3 -> 0: the first member or a middle one dies half way through serving
    # what it sends; the root and the members after it fail typed, the root at once.
    n = 4
    quick = {"lease_timeout": 3.0, "stall_timeout": 3.0}
    with _group(n, f"chain-kill-{victim}", watch=True, **quick) as (owner, group, workers):
        shape = (1 << 19,)  # 4 MiB of int64
        _reduce(group, workers, shape, 0, 0, "sum")  # the members learn each other
        seq = group.seq
        workers[victim - 1].call("arm", f"serve:{group.object_id(seq, 'chain-out', victim).hex()}:0.5:KILL")
        for w in workers:
            w.send("reduce_to", group.name, "int64", shape, 1, 0, "sum")
        start = time.monotonic()
        with pytest.raises(hg.MemberLostError) as caught:
            hg.collective.reduce(make_array("int64", shape, 1), 0, group)
        assert caught.value.lost_ranks == [victim]
        assert time.monotonic() - start < TIMEOUT / 3, "the root must not wait for its timeout"
        for rank in range(victim + 1, n):  # those after it in the chain
            with pytest.raises(RuntimeError, match="MemberLostError"):
                workers[rank - 1].result(timeout=TIMEOUT / 3)
        assert not workers[victim - 1].proc.is_alive()
        chain = {group.object_id(seq, "chain-out", r) for r in range(n)}
        assert not [oid for oid in chain if owner._store.get(oid) is not None]


@pytest.mark.parametrize("op", ["allreduce", "reduce_to"])
@pytest.mark.parametrize("differs", ["dtype", "size"])
def test_arrays_that_differ_between_members_fail_typed_never_summed(op: str, differs: str) -> None:
    # The same bytes in another dtype would add up as the wrong numbers; another size would
    # make the stream's size differ. The member that reads such a stream fails at once with
    # CollectiveArgumentError; the others fail typed (the one it would have read from waits
    # for its reads until its patience runs out).
    quick = {"stall_timeout": 1.0, "lease_timeout": 1.0, "heartbeat_interval": 0.5}
    with _group(2, f"direct-{op}-{differs}", **quick) as (_owner, group, workers):
        shape = (1 << 18,)
        call = {"allreduce": ("sum",), "reduce_to": (0, "sum")}[op]
        workers[0].send(op, group.name, "float32", shape, 1, *call)
        mine = make_array("float32", shape, 1)
        if op == "allreduce":
            hg.collective.allreduce(mine, group)
        else:
            hg.collective.reduce(mine, 0, group)
        workers[0].result()  # the members learn each other
        workers[0].send(op, group.name, "float32", shape, 2, *call)
        other = {"dtype": make_array("int32", shape, 2), "size": make_array("float32", (3 << 17,), 2)}[
            differs
        ]
        start = time.monotonic()
        with pytest.raises(hg.HopliteError) as caught:
            if op == "allreduce":
                hg.collective.allreduce(other, group)
            else:
                hg.collective.reduce(other, 0, group)
        assert time.monotonic() - start < TIMEOUT / 3
        with pytest.raises(
            RuntimeError, match=r"CollectiveArgumentError|HopliteTimeoutError|ObjectLostError"
        ) as theirs:
            workers[0].result(timeout=TIMEOUT / 2)
        # Whoever reads the other's stream first fails with CollectiveArgumentError, and withdraws
        # what it sends: the other may find it gone first (ObjectLostError). A reduce's root
        # (the owner) is the one reader.
        told = [
            isinstance(caught.value, hg.CollectiveArgumentError),
            "CollectiveArgumentError" in str(theirs.value),
        ]
        assert told[0] if op == "reduce_to" else any(told), (caught.value, theirs.value)
        if told[0]:
            assert "every member's array must match" in str(caught.value)


def test_a_read_only_array_for_the_result_fails_that_member_alone_and_at_once() -> None:
    # The member runs the round on a copy and then raises, so no member waits for it (the
    # chain's predecessor of a read-only root waited out its patience before) and the group
    # stays in step; arrays that only the collective reads may be read-only.
    n = 3
    with _group(n, "direct-read-only") as (_owner, group, workers):
        shape = (1 << 18,)
        _allreduce(group, workers, "float32", shape, 0, "sum")  # the members learn each other
        calls = {
            "allreduce": ("sum",),
            "reduce_to": (1, "sum"),  # workers[0] is rank 1: the root
            "allgather": (),
            "alltoall": (),
            "reducescatter": ("sum",),
        }
        for cmd, extra in calls.items():
            started = time.monotonic()
            for w, dtype in zip(workers, ["readonly:float32", "float32"], strict=True):
                w.send(cmd, group.name, dtype, shape, 1, *extra)
            mine = make_array("float32", shape, 1)
            outs = [np.empty_like(mine) for _ in range(n)]
            pieces = [make_array("float32", shape, 1 + dst) for dst in range(n)]
            if cmd == "allreduce":
                hg.collective.allreduce(mine, group)
                assert np.allclose(mine, sum(make_array("float32", shape, 1 + r) for r in range(n)))
            elif cmd == "reduce_to":
                hg.collective.reduce(mine, 1, group)
            elif cmd == "allgather":
                hg.collective.allgather(outs, mine, group)
                for r, got in enumerate(outs):
                    assert np.array_equal(got, make_array("float32", shape, 1 + r))
            elif cmd == "alltoall":
                hg.collective.alltoall(outs, pieces, group)
            else:
                hg.collective.reducescatter(outs[0], pieces, group)
            with pytest.raises(RuntimeError, match=r"CollectiveArgumentError: \w+ #\d+: .*read-only"):
                workers[0].result()
            workers[1].result()
            assert time.monotonic() - started < TIMEOUT / 3, cmd
        got = _allreduce(group, workers, "float32", shape, 2, "sum")  # in step
        want = sum(make_array("float32", shape, 2 + r) for r in range(n))
        assert np.allclose(got, want)
        for w in workers:
            w.send("reduce_to", group.name, "readonly:float32", shape, 3, 0, "sum")
        reduced = hg.collective.reduce(make_array("float32", shape, 3), 0, group)
        for w in workers:
            w.result()  # the members but the root only read their arrays
        assert np.allclose(reduced, sum(make_array("float32", shape, 3 + r) for r in range(n)))


def test_a_non_contiguous_array_on_one_member_takes_the_ring_with_the_others() -> None:
    # It took the directory's path while the others took the ring, until the group's timeout.
    n = 3
    with _group(n, "direct-strided") as (_owner, group, workers):
        shape = (1 << 18,)
        _allreduce(group, workers, "float32", shape, 0, "sum")
        for cmd, extra in [("allreduce", ("sum",)), ("reduce_to", (0, "sum"))]:
            started = time.monotonic()
            for w, dtype in zip(workers, ["strided:float32", "float32"], strict=True):
                w.send(cmd, group.name, dtype, shape, 1, *extra)
            mine = make_strided("float32", shape, 1)
            if cmd == "allreduce":
                assert hg.collective.allreduce(mine, group) is mine
            else:
                assert hg.collective.reduce(mine, 0, group) is mine
            theirs = [w.result() for w in workers]
            assert np.allclose(mine, sum(make_array("float32", shape, 1 + r) for r in range(n)))
            assert not mine.base[..., 1].any()
            if cmd == "allreduce":
                assert all(np.array_equal(t, mine) for t in theirs)
            assert time.monotonic() - started < TIMEOUT / 3, cmd


@pytest.mark.parametrize("how", ["refused", "dtype", "reduction"])
def test_after_a_round_fails_on_the_ring_the_next_one_sums_exactly(how: str, monkeypatch: Any) -> None:
    # A round that fails closes the members' connections along the ring (collective.wire): each
    # member makes them again at its next round, and that round sums exactly on every member.
    from hoplite_gpu.collective import wire

    n = 3
    with _group(n, f"direct-again-{how}") as (_owner, group, workers):
        shape = (1 << 18,)
        _allreduce(group, workers, "float32", shape, 0, "sum")  # the members connect
        assert group._wire is not None and group._wire.out is not None
        for w in workers:
            w.send("allreduce", group.name, "float32", shape, 1, "sum")
        start = time.monotonic()
        if how == "refused":
            with pytest.raises(hg.CollectiveArgumentError, match="not mine"):
                group.refuse(hg.CollectiveArgumentError("not mine"))
        elif how == "dtype":
            with pytest.raises(hg.CollectiveArgumentError, match="every member's array must match"):
                hg.collective.allreduce(make_array("int32", shape, 1), group)
        else:

            def broken(*args: Any, **kwargs: Any) -> None:
                raise ValueError("no such reduction")

            with monkeypatch.context() as patched:
                patched.setattr(wire, "reduce_chunk", broken)
                with pytest.raises(hg.HopliteError, match="the reduction failed"):
                    hg.collective.allreduce(make_array("float32", shape, 1), group)
        # The member after rank 0 reads its refusal (or its dtype) first: it names the cause.
        with pytest.raises(RuntimeError, match="CollectiveArgumentError" if how != "reduction" else "Error"):
            workers[0].result(timeout=TIMEOUT / 2)
        with pytest.raises(RuntimeError, match="Error"):
            workers[1].result(timeout=TIMEOUT / 2)
        assert time.monotonic() - start < TIMEOUT / 3
        for seed in (2, 3):  # the first round after remakes the connections, the next keeps them
            got = _allreduce(group, workers, "float32", shape, seed, "sum")
            want = sum(make_array("float32", shape, seed + r).astype(np.float64) for r in range(n))
            assert np.allclose(got, want)


def test_a_connection_handed_over_reaches_the_node_it_names() -> None:
    # The TCP data plane's hand-over (dataplane.wire): authenticated with the cluster's token,
    # taken by its key on the other node, then a plain two-way stream that neither plane reads.
    from hoplite_gpu.object_id import ObjectID

    a = hg.init(**SHARDED)
    b = hg.init(a.directory_address, token=a.token, **SHARDED)
    try:
        key, other = ObjectID.from_name("wire-test/a"), ObjectID.from_name("wire-test/b")
        assert b.take_handed(key, 0.05) is None
        host, _, port = b.data_address.rpartition(":")
        sock = a.hand_over(host, int(port), key)
        theirs = b.take_handed(key, TIMEOUT)
        assert theirs is not None and b.take_handed(key, 0.05) is None  # taken once
        sock.sendall(b"ping")
        assert theirs.recv(4, __import__("socket").MSG_WAITALL) == b"ping"
        theirs.sendall(b"pong")
        assert sock.recv(4, __import__("socket").MSG_WAITALL) == b"pong"
        later = a.hand_over(host, int(port), other)
        b.drop_handed([other])  # not taken: closed
        later.settimeout(TIMEOUT)
        assert later.recv(1) == b""
        for s in (sock, theirs, later):
            s.close()
    finally:
        b.close()
        a.close()


def test_members_whose_schedules_differ_agree_on_the_directorys() -> None:
    # Rank 0 asks for the directory's ring, the others are on auto: every member must take the
    # same schedule (the direct ring would wait for rank 0's running sums, which never come).
    owner = hg.init(**SHARDED, allreduce_schedule="ring")
    workers = start_workers(owner.directory_address, owner.token, 2, **SHARDED)
    try:
        for rank, w in enumerate(workers, start=1):
            w.send("group", "mixed", rank, 3, TIMEOUT, False)
        assert [w.result() for w in workers] == [1, 2]
        group = hg.collective.Group(owner, 0, 3, "mixed", timeout=TIMEOUT)
        got = _allreduce(group, workers, "float32", (1 << 18,), 5, "sum")
        want = sum(make_array("float32", (1 << 18,), 5 + r).astype(np.float64) for r in range(3))
        assert np.array_equal(got, want.astype(np.float32))
        assert not goes_direct(group._peers)
    finally:
        for w in workers:
            w.kill()
        owner.close()


def test_which_schedule_members_take() -> None:
    def peers(*rows: tuple[str, str], plane: str = "tcp") -> list[Peer]:
        return [
            Peer(schedule, "", key, plane, "10.0.0.1", 1000 + i) for i, (schedule, key) in enumerate(rows)
        ]

    assert goes_direct(peers(("auto", ""), ("auto", "")))  # no shared memory: hosts apart
    assert goes_direct(peers(("auto", "a"), ("auto", "b")))
    assert not goes_direct(peers(("auto", "a"), ("auto", "a"), ("auto", "b")))  # two share a host
    assert goes_direct(peers(("direct", "a"), ("auto", "a")))  # asked for
    assert not goes_direct(peers(("ring", ""), ("auto", "")))
    assert not goes_direct(peers(("star", "a"), ("direct", "b")))
    assert not goes_direct(peers(("auto", "a"), ("auto", "b"), plane="ucx"))  # RDMA, device transports
    assert goes_direct(peers(("direct", "a"), ("auto", "b"), plane="ucx"))
    # A reduce's chain takes members that share a host too, but not another schedule or plane.
    assert goes_direct(peers(("auto", "a"), ("auto", "a"), ("auto", "b")), sharing=True)
    assert not goes_direct(peers(("ring", "a"), ("auto", "a")), sharing=True)
    assert not goes_direct(peers(("auto", "a"), ("auto", "a"), plane="ucx"), sharing=True)
