"""Fault tolerance over real processes and real UCX: SIGKILL and SIGSTOP at chosen byte offsets.

Faults are injected deterministically (:mod:`hoplite_gpu.faults`): a worker kills or stops itself
when a chosen transfer or reduction reaches a chosen offset. Every wait has a deadline.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from tests.procs import Worker, digest, make_array, start_workers, wait_for_events

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

LEASE = 8.0  # long enough not to matter in the tests that must finish without it
SMALL_CHUNKS = {"adaptive_chunks": False, "chunk_bytes": 256 << 10}  # offsets hit within 256 KiB
SIZE_SHAPE = ("int64", (8 << 20,))  # 64 MiB
SIZE = 64 << 20


@pytest.fixture(scope="module")
def owner() -> Iterator[Any]:
    node = hg.init(lease_timeout=LEASE)
    yield node
    node.close()


def dead(worker: Worker, timeout: float = 60.0) -> bool:
    """Wait (with a deadline) until the worker process has exited."""
    worker.proc.join(timeout)
    return not worker.proc.is_alive()


def events_since(owner: Any, start: int) -> list[dict[str, Any]]:
    return [e for e in owner.event_log() if e["seq"] > start]


def last_seq(owner: Any) -> int:
    return int(owner.event_log()[-1]["seq"])


# ---------------------------------------------------------------- broadcast
@pytest.mark.parametrize("at", [0.0, 0.5, 0.99])
@pytest.mark.parametrize("victim", ["head", "middle", "tail"])
def test_broadcast_chain_survives_a_killed_receiver(owner: Any, victim: str, at: float) -> None:
    """Eight receivers in a pipelined chain; one dies at a byte offset; the others finish
    bit-exact, resuming from the bytes they hold (nothing is sent twice)."""
    sender = start_workers(owner.directory_address, owner.token, 1, send_rate_limit=48 << 20)[0]
    receivers = start_workers(owner.directory_address, owner.token, 8, **SMALL_CHUNKS)
    index = {"head": 0, "middle": 3, "tail": 7}[victim]
    try:
        oid = hg.ObjectID.random()
        receivers[index].call("arm", f"receive:{oid.hex()}:{at}:KILL")
        expected = digest(make_array(*SIZE_SHAPE, seed=11))
        sender.call("put", *SIZE_SHAPE, 11, oid.hex())
        start = last_seq(owner)
        for r in receivers:  # one at a time, so each joins the chain behind the previous one
            r.send("get", oid.hex(), 120)
            wait_for_events(
                owner,
                lambda evs, r=r: any(
                    e["seq"] > start
                    and e["kind"] in ("transfer_start", "node_left")
                    and r.node_id in (e.get("receiver"), e.get("node"))
                    for e in evs
                ),
            )
        assert dead(receivers[index])
        survivors = [r for i, r in enumerate(receivers) if i != index]
        assert [r.result() for r in survivors] == [expected] * 7
        evs = events_since(owner, start)
        starts = {e["transfer_id"]: e for e in evs if e["kind"] == "transfer_start"}
        firsts = [starts_for(starts, r)[0]["sender"] for r in receivers]
        relays = {r.node_id for r in receivers}
        assert sum(sender in relays for sender in firsts) >= 5  # pipelined: receivers relayed it
        finals = {
            e["transfer_id"]: e
            for e in evs
            if e["kind"] == "transfer_done" and e["ok"] and e["receiver"] in {r.node_id for r in survivors}
        }
        assert len(finals) == 7
        served = wait_for_events(
            owner,
            lambda es: {e["transfer_id"] for e in es if e["kind"] == "serve_done"} >= set(finals),
        )
        sent = {e["transfer_id"]: e["bytes_sent"] for e in served if e["kind"] == "serve_done"}
        for tid in finals:
            assert sent[tid] == SIZE - starts[tid]["have"]  # resumed after the bytes it held
        resumed = [starts[tid]["have"] for tid in finals if starts[tid]["have"] > 0]
        if victim != "tail" and at > 0:
            assert resumed, "a receiver behind the victim should have resumed mid-object"
        moved = sum(sent[tid] for tid in finals)
        print(f"{victim} killed at {at:.0%}: {moved / SIZE:.2f} x object bytes moved to 7 survivors")
    finally:
        for w in [sender, *receivers]:
            w.kill()


def starts_for(starts: dict[int, dict[str, Any]], worker: Worker) -> list[dict[str, Any]]:
    return [e for _, e in sorted(starts.items()) if e["receiver"] == worker.node_id]


def test_a_broadcast_whose_only_copy_dies_raises_object_lost_then_recovers_on_reput(owner: Any) -> None:
    sender = start_workers(owner.directory_address, owner.token, 1, send_rate_limit=48 << 20)[0]
    receivers = start_workers(owner.directory_address, owner.token, 3, **SMALL_CHUNKS)
    try:
        oid = hg.ObjectID.random()
        sender.call("arm", f"serve:{oid.hex()}:0.5:KILL")
        sender.call("put", *SIZE_SHAPE, 5, oid.hex())
        for r in receivers[:2]:
            r.send("get", oid.hex(), 60)
        assert dead(sender)
        for r in receivers[:2]:
            with pytest.raises(RuntimeError, match="ObjectLostError"):
                r.result()
        # The restarted task puts it again under the same id: gets work again.
        again = start_workers(owner.directory_address, owner.token, 1)[0]
        receivers.append(again)
        again.call("put", *SIZE_SHAPE, 5, oid.hex())
        expected = digest(make_array(*SIZE_SHAPE, seed=5))
        assert receivers[0].call("get", oid.hex(), 60) == expected
        assert receivers[2].call("get", oid.hex(), 60) == expected
    finally:
        for w in [sender, *receivers]:
            w.kill()


def test_a_stopped_sender_is_replaced_within_the_stall_timeout(owner: Any) -> None:
    """SIGSTOP (a hung peer: its connections stay open): the receiver's stall timeout makes it
    switch to another copy and resume, long before the stopped node's lease ends."""
    holder, copy = start_workers(owner.directory_address, owner.token, 2)
    receiver = start_workers(owner.directory_address, owner.token, 1, stall_timeout=1.5, **SMALL_CHUNKS)[0]
    try:
        oid = hg.ObjectID.random()
        expected = digest(make_array(*SIZE_SHAPE, seed=8))
        holder.call("put", *SIZE_SHAPE, 8, oid.hex())
        assert copy.call("get", oid.hex(), 60) == expected
        # The receiver's endpoint to the copy exists before the stop: a new UCX endpoint made while
        # one to a stopped peer is being aborted was seen to stall (see the issue 4 note).
        warm = hg.ObjectID.random()
        copy.call("put", "uint8", (1 << 20,), 1, warm.hex())
        receiver.call("get", warm.hex(), 60)
        holder.call("arm", f"serve:{oid.hex()}:0.5:STOP")  # the holder is chosen first (the owner)
        start = last_seq(owner)
        assert receiver.call("get", oid.hex(), 60) == expected
        evs = events_since(owner, start)
        failed = [e for e in evs if e["kind"] == "transfer_done" and not e["ok"]]
        assert failed and failed[0]["sender"] == holder.node_id
        assert any(e["kind"] == "node_suspect" and e["node"] == holder.node_id for e in evs)
        switch = next(
            e
            for e in evs
            if e["kind"] == "transfer_start"
            and e["receiver"] == receiver.node_id
            and e["seq"] > failed[0]["seq"]
        )
        # It resumes after what it held, mid-object. (Chunks the stopped sender had queued may be
        # missing; one CI run also saw 3 chunks beyond the stop offset: open, see the issue 4 note.)
        assert switch["sender"] == copy.node_id and SIZE // 4 <= switch["have"] < SIZE
        assert not any(e["kind"] == "node_left" for e in evs)  # switched before the lease ended
        # The stopped node misses its lease and is declared dead.
        wait_for_events(
            owner,
            lambda es: any(e["kind"] == "node_left" and e["node"] == holder.node_id for e in es),
            timeout=LEASE * 4,
        )
    finally:
        for w in (holder, copy, receiver):
            w.kill()


# ---------------------------------------------------------------- reduce
def put_inputs(workers: list[Worker], shape: tuple[int, ...]) -> tuple[list[str], list[np.ndarray[Any, Any]]]:
    ids = [hg.ObjectID.random().hex() for _ in workers]
    arrays = [make_array("float32", shape, seed=10 + i) for i in range(len(workers))]
    for w, oid, i in zip(workers, ids, range(len(workers)), strict=True):
        w.call("put_array", arrays[i], oid)
    return ids, arrays


SHAPE = (4 << 20,)  # 16 MiB of float32


def reduce_workers(owner: Any) -> list[Worker]:
    """Eight input holders; the first serves slowly (8 MiB/s), so that the inner vertex killed at
    10% of its reduction dies before the first one is half way through serving its input."""
    slow = start_workers(owner.directory_address, owner.token, 1, send_rate_limit=8 << 20, **SMALL_CHUNKS)
    return slow + start_workers(owner.directory_address, owner.token, 7, **SMALL_CHUNKS)


def arm_victims(workers: list[Worker], ids: list[str], rid: hg.ObjectID) -> None:
    """Inputs ready before the request are placed in order: input 1 is an inner vertex in every
    tree shape, input 0 a leaf (streamed by its parent) in the first tree and in the rebuilt one."""
    workers[1].call("arm", f"reduce:{rid.hex()}:0.1:KILL")
    workers[0].call("arm", f"serve:{ids[0]}:0.5:KILL")


def test_allreduce_survives_a_killed_input_holder_and_a_killed_inner_vertex(owner: Any) -> None:
    """An inner vertex dies mid-reduction, then an input holder while its input is streamed; their
    tasks restart and put the inputs again; every reader gets the exact sum."""
    workers = reduce_workers(owner)
    extra: list[Worker] = []
    try:
        ids, arrays = put_inputs(workers, SHAPE)
        rid = hg.ObjectID.random()
        arm_victims(workers, ids, rid)
        start = last_seq(owner)
        owner.reduce([hg.ObjectID.from_hex(h) for h in ids], "sum", reduction_id=rid)
        for w in workers[2:]:  # the allreduce: every member reads the result while it is reduced
            w.send("get_array", rid.hex(), 120)
        assert dead(workers[0]) and dead(workers[1])
        extra = start_workers(owner.directory_address, owner.token, 2)
        for w, i in zip(extra, (0, 1), strict=True):  # the restarted tasks put their inputs again
            w.call("put_array", arrays[i], ids[i])
        expected = np.sum(arrays, axis=0, dtype=np.float32)
        got = owner.get(rid, timeout=120)
        assert np.array_equal(got, expected)
        for w in workers[2:]:
            assert np.array_equal(w.result(), expected)
        assert sorted(o.hex() for o in owner.reduced_objects(rid, timeout=10)) == sorted(ids)
        assert any(e["kind"] == "reduce_repair" for e in events_since(owner, start))
        owner.delete(rid)
    finally:
        for w in workers + extra:
            w.kill()


def test_first_k_completes_without_the_lease_when_two_holders_die(owner: Any) -> None:
    workers = reduce_workers(owner)
    try:
        ids, arrays = put_inputs(workers, SHAPE)
        rid = hg.ObjectID.random()
        arm_victims(workers, ids, rid)
        owner.reduce([hg.ObjectID.from_hex(h) for h in ids], "sum", num_objects=6, reduction_id=rid)
        # Well within the lease: the killed processes' connections close, so repair starts at once.
        got = owner.get(rid, timeout=LEASE)
        chosen = [o.hex() for o in owner.reduced_objects(rid, timeout=10)]
        assert len(chosen) == 6 and ids[0] not in chosen and ids[1] not in chosen
        expected = np.sum([arrays[ids.index(h)] for h in chosen], axis=0, dtype=np.float32)
        assert np.array_equal(got, expected)
        assert not workers[0].proc.is_alive() and not workers[1].proc.is_alive()
        owner.delete(rid)
    finally:
        for w in workers:
            w.kill()


def test_fault_specs_are_validated() -> None:
    from hoplite_gpu import faults

    (f,) = faults.parse("serve:ABcd:0.25:stop")
    assert (f.event, f.object_prefix, f.signal_name, f.byte_offset(1000)) == ("serve", "abcd", "STOP", 250)
    assert faults.parse("reduce:*:4096B")[0].byte_offset(1 << 20) == 4096
    for bad in ("serve:x:0.5", "send:*:0.5", "serve:*:1.5", "serve:*:0.5:HUP", "serve:*"):
        with pytest.raises(hg.InvalidArgumentError):
            faults.parse(bad)
    injector = faults.FaultInjector()
    injector.arm("serve:ab:100B")
    assert injector.next_offset("serve", "abff", 0, 1000) == 100
    assert injector.next_offset("serve", "cd", 0, 1000) is None
    assert injector.next_offset("serve", "abff", 100, 1000) is None


def test_a_sharded_allreduce_with_a_member_killed_after_its_puts_fails_typed() -> None:
    """Rank 1 puts its shards (lent: its own array) and is SIGKILLed; ranks 0 and 2 then raise a
    typed error within the group's timeout, never a result, and rank 0 holds none of the shards it
    lent once its call returned. (The directory's ring; tests/test_direct_ring.py kills a member
    of the direct one.)"""
    name = hg.ObjectID.random().hex()
    owner = hg.init(lease_timeout=LEASE, allreduce_schedule="ring")
    a, b = start_workers(owner.directory_address, owner.token, 2, allreduce_schedule="ring")
    try:
        for rank, w in ((1, a), (2, b)):
            w.send("group", name, rank, 3, 5)
        assert [a.result(), b.result()] == [1, 2]
        group = hg.collective.Group(owner, 0, 3, name, timeout=5)
        shape = (1024, 1024)  # 4 MiB of float32: sharded
        shards = {group.object_id(0, "allreduce-shard", j, 1).hex() for j in range(3)}
        a.send("allreduce", name, "float32", shape, 0, "sum")
        wait_for_events(owner, lambda evs: shards <= {e.get("object_id") for e in evs if e["kind"] == "put"})
        a.kill()
        b.send("allreduce", name, "float32", shape, 0, "sum")
        arr = make_array("float32", shape, 0)
        with pytest.raises(hg.HopliteError):
            hg.collective.allreduce(arr, group)
        with pytest.raises(RuntimeError):
            b.result(timeout=60)
        lent = [group.object_id(0, "allreduce-shard", j, 0) for j in range(3)]
        assert [owner._store.get(oid) for oid in lent] == [None] * 3
    finally:
        for w in (a, b):
            w.kill()
        owner.close()


def test_receivers_of_a_stopped_sole_source_learn_of_the_loss_with_the_lease() -> None:
    """Found by tests/test_soak.py: the source is stopped (SIGSTOP) before it serves a byte. Its
    kernel still accepts connections, so the receiver pulling from it waited in the handshake for
    the whole connect timeout after the directory had declared the object lost. Every receiver
    now raises ObjectLostError once the source's lease runs out."""
    import os
    import signal
    import time

    lease = 3.0
    owner = hg.init(lease_timeout=lease)
    slow = {"connect_timeout": 30.0, "stall_timeout": 30.0}  # far beyond the lease
    workers = start_workers(owner.directory_address, owner.token, 4, **slow)
    try:
        oid = hg.ObjectID.random()
        workers[0].call("put", "float32", (1 << 20,), 5, oid.hex())
        for w in workers[1:]:
            w.send("get", oid.hex(), 60)
        stopped = time.monotonic()
        os.kill(workers[0].proc.pid, signal.SIGSTOP)
        for w in workers[1:]:
            with pytest.raises(RuntimeError, match="ObjectLostError"):
                w.result(60)
            assert time.monotonic() - stopped < lease + 3.0
    finally:
        for w in workers:
            w.kill()
        owner.close()
