"""The ring allreduce (``Config.allreduce_schedule``) on real processes over the data plane: each
shard reduced along the ring of members and its result read along it, so that every byte goes
from a member to the next one; exact sums; the star schedule beside it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from tests.procs import Worker, make_array, start_workers

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 60.0
SHAPE = (1 << 20,)  # 4 MiB of float32: sharded, one shard of 1 MiB per member


@pytest.fixture(params=["ring", "star"])
def owner(request: Any) -> Iterator[Any]:
    # No shared memory: every copy crosses the data plane, as between hosts.
    node = hg.init(shared_memory=False, allreduce_schedule=request.param)
    yield node
    node.close()


def _join(owner: Any, workers: list[Worker], name: str) -> hg.collective.Group:
    n = len(workers) + 1
    for rank, w in enumerate(workers, start=1):
        w.send("group", name, rank, n, TIMEOUT)
    assert [w.result() for w in workers] == list(range(1, n))
    return hg.collective.Group(owner, 0, n, name, timeout=TIMEOUT)


def _destroy(group: hg.collective.Group, workers: list[Worker]) -> None:
    for w in workers:
        w.send("destroy", group.name)
    group.destroy()
    for w in workers:
        w.result()


def _two_exact_rounds(group: hg.collective.Group, workers: list[Worker], shape: tuple[int, ...]) -> None:
    """Two allreduces of every member (the second on a group whose members all know each other),
    each summed exactly on every member."""
    for seed in (0, 10):
        for w in workers:
            w.send("allreduce", group.name, "float32", shape, seed, "sum")
        got = hg.collective.allreduce(make_array("float32", shape, seed), group)
        want = sum(make_array("float32", shape, seed + r).astype(np.float64) for r in range(group.world_size))
        assert np.array_equal(got, want.astype(np.float32))
        for w in workers:
            assert np.array_equal(w.result(), got)


@contextlib.contextmanager
def _ring_of(owner: Any, n: int, name: str) -> Iterator[tuple[hg.collective.Group, list[Worker]]]:
    """A group of ``owner`` and ``n - 1`` worker processes on ``owner``'s schedule, without shared
    memory; destroyed after the block (the workers killed in any case)."""
    schedule = owner.config.allreduce_schedule
    workers = start_workers(
        owner.directory_address, owner.token, n - 1, shared_memory=False, allreduce_schedule=schedule
    )
    try:
        group = _join(owner, workers, f"{name}-{schedule}")
        yield group, workers
        _destroy(group, workers)
    finally:
        for w in workers:
            w.kill()


def _rounds(group: hg.collective.Group, workers: list[Worker], rounds: int) -> None:
    """``rounds`` allreduces of every member (results not checked)."""
    for seed in range(rounds):
        for w in workers:
            w.send("allreduce", group.name, "float32", SHAPE, seed, "sum")
        hg.collective.allreduce(make_array("float32", SHAPE, seed), group)
        for w in workers:
            w.result()


def _rank_of(events: list[dict[str, Any]], group: hg.collective.Group, seq: int, n: int) -> dict[str, int]:
    """Node id -> rank, from who put each member's shard ``r`` of collective ``seq``."""
    shards = {group.object_id(seq, "allreduce-shard", 0, r).hex(): r for r in range(n)}
    return {
        e["node"]: shards[e["object_id"]] for e in events if e["kind"] == "put" and e["object_id"] in shards
    }


def test_a_sharded_allreduce_sums_exactly_and_the_ring_sends_only_to_the_next_member(owner: Any) -> None:
    n, schedule = 4, owner.config.allreduce_schedule
    workers = start_workers(
        owner.directory_address, owner.token, n - 1, shared_memory=False, allreduce_schedule=schedule
    )
    try:
        group = _join(owner, workers, f"ring-{schedule}")
        since = len(owner.event_log())
        _two_exact_rounds(group, workers, SHAPE)
        events = owner.event_log()[since:]
        ranks = {**_rank_of(events, group, 0, n), **_rank_of(events, group, 1, n)}
        hops = {(ranks[e["sender"]], ranks[e["receiver"]]) for e in events if e["kind"] == "transfer_start"}
        ring = {(r, (r + 1) % n) for r in range(n)}
        over = owner.stats()["outputs_over_inputs"]
        if schedule == "ring":
            assert hops == ring, f"transfers off the ring: {sorted(hops - ring)}"
            # each member's vertices (n - 1 a round) wrote their outputs over its shards
            assert over >= 2 * (n - 1), over
        else:  # each shard's root pulls from every member, and every member reads every root
            assert hops == {(a, b) for a in range(n) for b in range(n) if a != b}
            assert over == 0  # its root's output is a buffer of the store's, copied to the caller
        _destroy(group, workers)
    finally:
        for w in workers:
            w.kill()


def test_repeated_allreduces_reuse_the_data_planes_connections(owner: Any) -> None:
    """A vertex is done once every byte of its child is here, and stops its fetch while the pull
    is still acknowledging them: the pull keeps its connection for the next one. Cut instead,
    each member opened and authenticated a new connection for each of its vertices, every round
    (three a round with four members on the ring)."""
    n, rounds = 4, 10
    schedule = owner.config.allreduce_schedule
    workers = start_workers(
        owner.directory_address, owner.token, n - 1, shared_memory=False, allreduce_schedule=schedule
    )

    def opened() -> list[int]:
        for w in workers:
            w.send("stats")
        return [
            owner.stats()["data_connections_opened"],
            *(w.result()["data_connections_opened"] for w in workers),
        ]

    try:
        group = _join(owner, workers, f"reuse-{schedule}")
        _two_exact_rounds(group, workers, SHAPE)  # every member has pulled from its peers
        before = opened()
        _rounds(group, workers, rounds)
        grown = [after - then for after, then in zip(opened(), before, strict=True)]
        # Only a round with more pulls from one peer at once than any before opens one more.
        assert all(g < rounds // 2 for g in grown), (grown, before)
        _destroy(group, workers)
    finally:
        for w in workers:
            w.kill()


def test_a_member_deletes_a_rounds_objects_with_one_request(owner: Any) -> None:
    """At the end of an allreduce a member deletes its shards, the copies of others' results it
    received in place, and its objects of the rounds before, with one request: one a round, where
    each used to go alone (five or more a round on each member). The only other deletes are the
    reduce vertices' copies of their children, one each."""
    n, rounds = 4, 5
    with _ring_of(owner, n, "deletes") as (group, workers):
        _two_exact_rounds(group, workers, SHAPE)
        since, before = len(owner.event_log()), owner.directory_summary()["handled"].get("delete", 0)
        _rounds(group, workers, rounds)
        requests = owner.directory_summary()["handled"]["delete"] - before
        events = owner.event_log()[since:]
    deleted = sum(e["kind"] in ("delete", "delete_local", "delete_kept") for e in events)
    fetched = sum(e["kind"] == "reduce_place" and e["vertex"] != 0 for e in events)  # vertices' copies
    assert requests <= n * rounds + fetched, (requests, deleted, fetched)
    assert deleted >= 2 * requests, (requests, deleted)


def test_a_vertex_that_lets_go_of_its_child_leaves_no_partial_holder(owner: Any) -> None:
    """A vertex done with its child stops its fetch while the pull still acknowledges the last
    bytes; the copy leaves the node, so the directory must not keep the node as a holder of
    those bytes (it would offer it to readers). Every such report said all its bytes had landed."""
    with _ring_of(owner, 4, "let-go") as (group, workers):
        since = len(owner.event_log())
        _two_exact_rounds(group, workers, SHAPE)
        _rounds(group, workers, 3)
        events = owner.event_log()[since:]
    kept = [e for e in events if e["kind"] == "transfer_done" and not e["ok"] and e["progress"]]
    assert kept == [], kept[:3]


def test_an_allreduce_under_the_shard_size_is_one_reduction(owner: Any) -> None:
    # 4 MiB under a shard size of 8 MiB (the default): one reduction, no shards put.
    workers = start_workers(owner.directory_address, owner.token, 1, allreduce_shard_bytes=8 << 20)
    owner.config = owner.config.replace(allreduce_shard_bytes=8 << 20)
    try:
        group = _join(owner, workers, "unsharded")
        since = len(owner.event_log())
        workers[0].send("allreduce", group.name, "float32", SHAPE, 0, "sum")
        got = hg.collective.allreduce(make_array("float32", SHAPE, 0), group)
        assert np.array_equal(got, make_array("float32", SHAPE, 0) + make_array("float32", SHAPE, 1))
        assert np.array_equal(workers[0].result(), got)
        shard = group.object_id(0, "allreduce-shard", 0, 0).hex()
        whole = group.object_id(0, "allreduce", 0).hex()
        puts = {e["object_id"] for e in owner.event_log()[since:] if e["kind"] == "put"}
        assert whole in puts and shard not in puts
        _destroy(group, workers)
    finally:
        for w in workers:
            w.kill()


#: 16 MiB: shards of 4 MiB, which a borrowed put on a node that shares copies into a segment.
BIG = (1 << 22,)


def test_on_one_host_the_ring_schedule_reduces_each_shard_as_that_hosts_star() -> None:
    node = hg.init(shared_memory=True, allreduce_schedule="ring")
    workers = start_workers(
        node.directory_address, node.token, 3, shared_memory=True, allreduce_schedule="ring"
    )
    try:
        group = _join(node, workers, "one-host")
        since = len(node.event_log())
        for w in workers:
            w.send("allreduce", group.name, "float32", BIG, 0, "sum")
        got = hg.collective.allreduce(make_array("float32", BIG, 0), group)
        want = sum(make_array("float32", BIG, r).astype(np.float64) for r in range(4)).astype(np.float32)
        assert np.array_equal(got, want)
        for w in workers:
            assert np.array_equal(w.result(), want)
        trees = [e for e in node.event_log()[since:] if e["kind"] == "reduce_tree"]
        assert [(e["degree"], e["reason"][:20]) for e in trees] == [(3, "every node on one ho")] * 4
        _destroy(group, workers)
    finally:
        for w in workers:
            w.kill()
        node.close()


def test_members_alone_on_their_hosts_lend_shards_in_place_with_shared_memory_on() -> None:
    # Each member its own host (Config.host_tag), shared memory on as on real hosts: told it is
    # alone (protocol.HostPeers), a member keeps its 4 MiB shards where they are instead of copying
    # them into segments, so its vertices write their outputs over them.
    n = 4
    node = hg.init(shared_memory=True, allreduce_schedule="ring", host_tag="member0")
    workers = [
        Worker(node.directory_address, node.token, shared_memory=True, host_tag=f"member{r}")
        for r in (1, 2, 3)
    ]
    try:
        for w in workers:
            w.wait_ready()
        group = _join(node, workers, "apart")
        _two_exact_rounds(group, workers, BIG)
        assert node._memory.host_peers == 0
        assert node.stats()["outputs_over_inputs"] >= 2 * (n - 1)
        _destroy(group, workers)
    finally:
        for w in workers:
            w.kill()
        node.close()


def test_a_result_copy_served_at_the_end_is_kept_once_its_pull_is_done() -> None:
    # The end of a ring allreduce keeps the result copies its successor has not read whole and
    # withdraws the rest. A pull starting between waiting for serves and keeping (a slow
    # successor) used to be skipped as "being served" and cut by the withdrawal, leaving its
    # reader no copy. Now the check and the keep have no wait between them.
    import asyncio
    import types

    from hoplite_gpu.collective.operations import _keep_unread
    from hoplite_gpu.memory import Buffer, LocalObject

    def copy() -> LocalObject:
        return LocalObject(hg.ObjectID.random(), 8, "|u1", (8,), b"", Buffer.wrap(np.zeros(8, np.uint8)), 8)

    idle, read_whole, late, other = copy(), copy(), copy(), copy()
    moved: list[tuple[list[Any], list[int]]] = []

    def keep_served(objs: list[Any]) -> list[Any]:
        moved.append((list(objs), [o.serving for o in objs]))
        return list(objs)

    node = types.SimpleNamespace(config=types.SimpleNamespace(stall_timeout=10.0), keep_served=keep_served)
    group: Any = types.SimpleNamespace(node=node)

    async def turns() -> None:  # turns of the loop enough for a task to go on, unless it waits
        for _ in range(20):
            await asyncio.sleep(0)

    async def run() -> list[Any]:
        serving_whole = read_whole.being_served()
        serving_whole.__enter__()  # its successor is reading it
        unread = {o.object_id for o in (idle, read_whole, late)}
        keeping = asyncio.ensure_future(_keep_unread(group, [idle, read_whole, late, other], unread))
        await turns()
        assert not keeping.done()  # waits for the pull in progress
        serving_late = late.being_served()
        serving_late.__enter__()  # a pull that starts meanwhile
        serving_whole.__exit__(None, None, None)  # read whole
        await turns()
        assert not keeping.done()  # and waits for that one too
        with contextlib.suppress(ConnectionError):  # cut short: not read whole
            serving_late.__exit__(ConnectionError, ConnectionError(), None)
        return await asyncio.wait_for(keeping, 5)

    kept = asyncio.run(run())
    assert kept == [idle, late]  # read whole: withdrawn; not of the unread results: withdrawn
    assert moved == [([idle, late], [0, 0])]  # kept once, none of them being served
