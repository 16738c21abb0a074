"""Watched groups with real processes: a member SIGKILLed or giving up breaks the others'
collectives at once (not at their timeout); scatter, alltoall and tagged point-to-point messages."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu.node import Agreement
from tests.procs import Worker, make_array, start_workers, wait_for_events

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

#: The groups' own timeout: a watched group must fail long before it.
TIMEOUT = 60.0


@pytest.fixture
def owner() -> Iterator[Any]:
    node = hg.init()
    yield node
    node.close()


def join(owner: Any, workers: list[Worker], name: str, watch: bool = True) -> hg.collective.Group:
    n = len(workers) + 1
    for rank, w in enumerate(workers, start=1):
        w.send("group", name, rank, n, TIMEOUT, watch)
    assert [w.result() for w in workers] == list(range(1, n))
    return hg.collective.Group(owner, 0, n, name, timeout=TIMEOUT, watch=watch)


def test_a_member_killed_mid_allreduce_fails_every_survivor_at_once(owner: Any) -> None:
    workers = start_workers(owner.directory_address, owner.token, 3)
    try:
        group = join(owner, workers, "killed")
        shape = (1 << 20,)  # 4 MiB of float32: sharded
        for w in workers[:2]:
            w.send("allreduce", "killed", "float32", shape, 0, "sum")
        workers[2].kill()  # rank 3: never contributes
        start = time.monotonic()
        with pytest.raises(hg.MemberLostError) as err:
            hg.collective.allreduce(make_array("float32", shape, 0), group)
        assert time.monotonic() - start < TIMEOUT / 3
        assert (
            err.value.lost_ranks == [3]
            and err.value.rank == 0
            and "rank 3's node is gone (its connection closed)" in str(err.value)
        )
        for w in workers[:2]:
            with pytest.raises(RuntimeError, match="MemberLostError"):
                w.result(timeout=TIMEOUT / 3)
        # Later collectives fail at once, on every survivor.
        start = time.monotonic()
        with pytest.raises(hg.MemberLostError):
            hg.collective.barrier(group)
        assert time.monotonic() - start < 1.0
        assert workers[0].call("lost", "killed")[1] == "MemberLostError"
        assert group.lost.keys() == {3} and isinstance(group.error, hg.MemberLostError)
        group.destroy()  # a broken group is destroyed without waiting for the others
    finally:
        for w in workers:
            w.kill()


def test_a_member_that_gives_up_fails_the_others_with_its_reason(owner: Any) -> None:
    workers = start_workers(owner.directory_address, owner.token, 1)
    try:
        group = join(owner, workers, "gives-up")
        seen: list[hg.HopliteError] = []
        group.add_lost_callback(seen.append)
        workers[0].send("broadcast", "gives-up", "float32", (1000,), 0, 0)  # waits for rank 0's put
        group.abort("the input had the wrong shape")
        with pytest.raises(RuntimeError, match="gave up on the group: the input had the wrong shape"):
            workers[0].result(timeout=TIMEOUT / 3)
        assert len(seen) == 1 and seen[0].lost_ranks == [0]
        with pytest.raises(hg.MemberLostError):
            hg.collective.broadcast(make_array("float32", (1000,), 0), 0, group)
    finally:
        for w in workers:
            w.kill()


def test_members_agree_without_one_killed_and_all_hear_the_same(owner: Any) -> None:
    """An agreement waits for every member until it comes or is lost: rank 3, SIGKILLed, is left
    out, the others get the same members and the least vote; a later one is decided at once."""
    workers = start_workers(owner.directory_address, owner.token, 3)
    try:
        group = join(owner, workers, "agreeing")
        workers[0].send("agree", "agreeing", "step-1", 7)
        workers[1].send("agree", "agreeing", "step-1", 5)
        workers[2].kill()
        decided = owner.agree(group.watch_id, hg.ObjectID.from_name("step-1"), 0, 4, vote=9, timeout=TIMEOUT)
        assert decided == Agreement((0, 1, 2), 5)
        assert [w.result(timeout=TIMEOUT / 3) for w in workers[:2]] == [([0, 1, 2], 5)] * 2
        for w in workers[:2]:
            w.send("agree", "agreeing", "step-2", 1)
        again = owner.agree(group.watch_id, hg.ObjectID.from_name("step-2"), 0, 4, timeout=TIMEOUT)
        assert again == Agreement((0, 1, 2), 1)
        assert [w.result(timeout=TIMEOUT / 3) for w in workers[:2]] == [([0, 1, 2], 1)] * 2
        with pytest.raises(hg.InvalidArgumentError):
            owner.agree(group.watch_id, hg.ObjectID.from_name("step-3"), 0, 4, vote=-1)
    finally:
        for w in workers:
            w.stop()


def test_members_that_destroy_their_group_leave_it_cleanly(owner: Any) -> None:
    workers = start_workers(owner.directory_address, owner.token, 1)
    try:
        group = join(owner, workers, "clean")
        workers[0].send("allreduce", "clean", "float32", (256,), 0, "sum")
        hg.collective.allreduce(make_array("float32", (256,), 0), group)
        workers[0].result()
        workers[0].send("destroy", "clean")
        group.destroy()
        workers[0].result()
        other = join(owner, workers, "clean-next")  # the process lives on, in another group
        workers[0].stop()
        assert not group.watching and group.error is None
        # Its node left after it had left "clean"; "clean-next", which it never destroyed, breaks.
        with pytest.raises(hg.MemberLostError):
            hg.collective.barrier(other)
    finally:
        for w in workers:
            w.kill()


def test_a_member_whose_destroy_finds_the_group_broken_still_deletes_its_objects(owner: Any) -> None:
    # The soak on the Ray directory actor: the others had passed the final barrier and left when
    # the directory restarted; this member's arrival was lost with it, its barrier then failed
    # with MemberLostError, and its objects were left behind.
    workers = start_workers(owner.directory_address, owner.token, 2)
    try:
        group = join(owner, workers, "broken-destroy")
        for w in workers:
            w.send("allreduce", "broken-destroy", "float32", (256,), 0, "sum")
        hg.collective.allreduce(make_array("float32", (256,), 0), group)
        for w in workers:
            w.result()
        mine = workers[0].node_id

        def owned() -> list[str]:
            return [o["object_id"] for o in owner.directory_summary()["objects"] if o["owner"] == mine]

        assert owned()
        workers[0].send("destroy", "broken-destroy")  # rank 1 waits at the barrier for 0 and 2
        wait_for_events(owner, lambda evs: any(e["kind"] == "barrier" and e["rank"] == 1 for e in evs))
        workers[1].kill()  # rank 2 never comes
        with pytest.raises(RuntimeError, match="MemberLostError"):
            workers[0].result(timeout=TIMEOUT / 3)
        assert owned() == []
    finally:
        for w in workers:
            w.kill()


def test_scatter_alltoall_and_tagged_messages(owner: Any) -> None:
    workers = start_workers(owner.directory_address, owner.token, 2)
    try:
        group = join(owner, workers, "data", watch=False)
        n, shape = 3, (5, 7)

        def piece(src: int, dst: int) -> np.ndarray[Any, Any]:
            return make_array("int64", shape, 4 + src * 100 + dst)

        for w in workers:
            w.send("scatter", "data", "int64", shape, 4, 1)
        got = hg.collective.scatter(np.empty(shape, np.int64), None, 1, group)
        assert np.array_equal(got, piece(1, 0))
        for rank, w in enumerate(workers, start=1):
            assert np.array_equal(w.result(), piece(1, rank))

        for w in workers:
            w.send("alltoall", "data", "int64", shape, 4)
        mine = [piece(0, dst) for dst in range(n)]
        out = hg.collective.alltoall([np.empty(shape, np.int64) for _ in range(n)], mine, group)
        assert all(np.array_equal(out[src], piece(src, 0)) for src in range(n))
        for rank, w in enumerate(workers, start=1):
            assert all(np.array_equal(got, piece(src, rank)) for src, got in enumerate(w.result()))

        # Two tags between the same pair: received in the other order than sent, each intact.
        a, b = make_array("float32", (64,), 1), make_array("float32", (64,), 2)
        workers[0].send("recv", "data", "float32", (64,), 0, 8)
        workers[1].send("recv", "data", "float32", (64,), 0, 0)
        hg.collective.send(b, 2, group)  # tag 0, to rank 2
        hg.collective.send(a, 1, group, tag=8)
        assert np.array_equal(workers[0].result(), a) and np.array_equal(workers[1].result(), b)
        with pytest.raises(hg.InvalidArgumentError):
            hg.collective.send(a, 1, group, tag="x")  # type: ignore[arg-type]
    finally:
        for w in workers:
            w.kill()


def test_a_loss_raised_before_the_watch_reports_it_names_the_member(owner: Any) -> None:
    """A collective of a watched group may learn that a member's object is lost (every copy died
    with the member) a moment before the directory's word that the member is gone: it raises the
    group's MemberLostError all the same (the soak saw a torch all_gather raise the loss)."""
    (worker,) = start_workers(owner.directory_address, owner.token, 1)
    try:
        group = join(owner, [worker], "lost-first")
        oid = group.object_id(0, "allgather", 1)

        async def collective() -> None:
            # the member dies, and the loss is raised before the loop can hear of the death
            os.kill(worker.proc.pid, signal.SIGKILL)
            raise hg.ObjectLostError(f"object {oid} was lost: every complete copy died", object_id=oid.hex())

        start = time.monotonic()
        with pytest.raises(hg.MemberLostError) as err:
            owner.io.run(group._guarded(collective()))
        assert err.value.lost_ranks == [1]
        assert isinstance(err.value.__cause__, hg.ObjectLostError)
        assert time.monotonic() - start < owner.config.lease_timeout + 2 * owner.config.heartbeat_interval
    finally:
        worker.kill()


def test_a_member_of_the_group_before_that_dies_before_it_watches_is_lost(owner: Any) -> None:
    """A group formed among the members of another (``parent``): a member that dies before it
    watches the new group, while it is expected there or before the group is formed, is lost in
    it at once, where without the parent the others would wait for it until their timeout (an
    elastic step, tests/test_torch_elastic.py, waited out two)."""
    workers = start_workers(owner.directory_address, owner.token, 2)
    try:
        first = join(owner, workers, "first")
        # Ranks 1 and 2 of the new group are ranks 2 and 1 of the first; neither watches it yet.
        second = hg.collective.Group(
            owner, 0, 3, "second", timeout=TIMEOUT, watch=True, parent=first, parent_ranks=[0, 2, 1]
        )
        workers[1].kill()  # rank 2 of the first group: rank 1 of the second
        start = time.monotonic()
        with pytest.raises(hg.MemberLostError) as err:
            hg.collective.barrier(second)
        assert time.monotonic() - start < TIMEOUT / 3
        assert err.value.lost_ranks == [1] and "rank 1's node is gone before it watched" in str(err.value)
        # Formed after the death: lost at once; a member not of the first (-1) is waited for.
        third = hg.collective.Group(
            owner, 0, 3, "third", timeout=TIMEOUT, watch=True, parent=first, parent_ranks=[0, -1, 2]
        )
        with pytest.raises(hg.MemberLostError) as err:
            hg.collective.barrier(third)
        assert err.value.lost_ranks == [2] and "rank 2 of the group before it" in str(err.value)
        for group in (first, second, third):
            group.destroy(wait=False)
        with pytest.raises(hg.InvalidArgumentError, match="parent_ranks"):
            hg.collective.Group(owner, 0, 2, "bad", watch=True, parent=first, parent_ranks=[0])
        with pytest.raises(hg.InvalidArgumentError, match="parent"):
            hg.collective.Group(owner, 0, 2, "bad", parent=first, parent_ranks=[0, 1])  # not watched
        with pytest.raises(hg.InvalidArgumentError, match="parent_ranks needs a parent"):
            hg.collective.Group(owner, 0, 2, "bad", watch=True, parent_ranks=[0, 1])
    finally:
        for w in workers:
            w.kill()
