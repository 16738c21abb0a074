"""Bounded, named failures: a get or collective that cannot finish raises within its timeout, and its
error says who is missing or slow: the ObjectID, the node and its address, the rank."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu.collective import Group
from tests.procs import MARGIN, make_array, start_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_a_get_of_an_object_nobody_put_says_so(owner: Any) -> None:
    oid = hg.ObjectID.random()
    started = time.monotonic()
    with pytest.raises(hg.HopliteTimeoutError, match="no node has put it") as info:
        owner.get(oid, timeout=0.5)
    assert time.monotonic() - started < 0.5 + MARGIN
    assert info.value.object_id == oid.hex() and oid.hex() in str(info.value)


def test_a_timeout_of_zero_answers_at_once_and_never_waits_forever(owner: Any) -> None:
    """``timeout=0`` is a wait with no time left (on the wire, 0 means none): what is there is
    answered, what is not times out at once, for get, reduce, barrier and reduced_objects. A
    group's timeout of 0 is no limit, as a Config's is."""
    other = start_workers(owner.directory_address, owner.token, 1)[0]
    try:
        theirs = hg.ObjectID.from_hex(other.call("put_array", make_array("float32", (4096,), 1), None))
        started = time.monotonic()
        assert np.array_equal(owner.get(theirs, timeout=0), make_array("float32", (4096,), 1))
        with pytest.raises(hg.HopliteTimeoutError, match="no node has put it"):
            owner.get(hg.ObjectID.random(), timeout=0)
        mine = owner.put(np.ones(4))
        with pytest.raises(hg.HopliteTimeoutError, match="only 1 of 2 inputs"):
            owner.get(owner.reduce([mine, hg.ObjectID.random()], timeout=0), timeout=5)
        rid = owner.reduce([mine, owner.put(np.ones(4))], num_objects=1, timeout=0)
        assert len(owner.reduced_objects(rid, timeout=0)) == 1
        with pytest.raises(hg.HopliteTimeoutError, match="1 of 2 members did not come"):
            owner.barrier(hg.ObjectID.random(), 0, 2, timeout=0)
        assert time.monotonic() - started < MARGIN
        other.call("group", "zero-timeout", 1, 2, 0)
        _in_step(Group(owner, 0, 2, "zero-timeout", timeout=0), other, 3)  # a group's 0: no limit
    finally:
        other.kill()


def test_a_get_from_a_slow_source_names_it_and_the_progress(owner: Any) -> None:
    slow = start_workers(owner.directory_address, owner.token, 1, send_rate_limit=2 << 20)[0]
    try:
        oid = hg.ObjectID.from_hex(slow.call("put_array", make_array("int64", (2 << 20,), 3), None))
        address = slow.call("stats")["data_address"]
        with pytest.raises(hg.HopliteTimeoutError) as info:
            owner.get(oid, timeout=1.0)  # 16 MiB at 2 MiB/s: 8 s
        text = str(info.value)
        assert f"node {slow.node_id[:8]} at {address}" in text, text
        assert "bytes so far" in text and "complete there" in text, text
    finally:
        slow.kill()


def test_a_get_that_gives_up_leaves_another_get_of_the_object_to_finish(owner: Any) -> None:
    """Two gets of one object in this process share its copy while it arrives (16 MiB from a
    source sending 8 MiB/s). The first times out, or is cancelled, and its copy goes; the other,
    with time left, starts again and gets every byte, rather than fail with the first's error."""
    slow = start_workers(owner.directory_address, owner.token, 1, send_rate_limit=8 << 20)[0]
    want = make_array("float32", (4 << 20,), 5)
    try:
        oid = hg.ObjectID.from_hex(slow.call("put_array", want, None))
        first: dict[str, Any] = {}

        def impatient() -> None:
            with pytest.raises(hg.HopliteTimeoutError) as info:
                owner.get(oid, timeout=0.5)
            first["error"] = info.value

        thread = threading.Thread(target=impatient)
        thread.start()
        until = time.monotonic() + 5
        while owner._store.get(oid) is None and time.monotonic() < until:
            time.sleep(0.005)  # until the first get's copy is arriving (the test holds either way)
        got = owner.get(oid, timeout=30)
        thread.join(30)
        assert "within 0.5 s" in str(first["error"])
        assert np.array_equal(got, want)

        async def cancelled_then_again() -> Any:
            again = hg.ObjectID.from_hex(slow.call("put_array", want, None))
            first = asyncio.ensure_future(owner.get_async(again, timeout=30))
            second = asyncio.ensure_future(owner.get_async(again, timeout=30))
            await asyncio.sleep(0.3)
            first.cancel()
            return await second

        assert np.array_equal(asyncio.run(cancelled_then_again()), want)
    finally:
        slow.kill()


def test_a_reduction_that_times_out_names_the_inputs_not_ready(owner: Any) -> None:
    present = owner.put(np.ones(1000, np.float32))
    absent = hg.ObjectID.random()
    rid = owner.reduce([present, absent], "sum", timeout=1.0)
    with pytest.raises(hg.HopliteTimeoutError) as info:
        owner.get(rid, timeout=30)
    text = str(info.value)
    assert "only 1 of 2 inputs" in text and f"not ready: {absent.hex()}" in text, text
    owner.delete(rid)
    owner.delete(present)


@pytest.mark.parametrize("op", ["allreduce", "broadcast", "allgather", "barrier"])
def test_a_collective_with_a_member_missing_names_its_rank(owner: Any, op: str) -> None:
    """Ranks 0 and 2 of a group of 3 enter the collective; rank 1 never does."""
    name = f"named-{op}"
    other = start_workers(owner.directory_address, owner.token, 1)[0]
    try:
        other.call("group", name, 2, 3)
        group = Group(owner, 0, 3, name, timeout=1.5)
        arr = make_array("float32", (64,), 0)
        if op == "allreduce":
            other.send("allreduce", name, "float32", (64,), 0, "sum")
            run = lambda: hg.collective.allreduce(arr, group)  # noqa: E731
        elif op == "broadcast":  # the root is the missing one
            other.send("broadcast", name, "float32", (64,), 0, 1)
            run = lambda: hg.collective.broadcast(arr, 1, group)  # noqa: E731
        elif op == "allgather":
            other.send("allgather", name, "float32", (64,), 0)
            run = lambda: hg.collective.allgather([np.empty_like(arr) for _ in range(3)], arr, group)  # noqa: E731
        else:
            other.send("barrier", name)
            run = lambda: hg.collective.barrier(group)  # noqa: E731
        started = time.monotonic()
        with pytest.raises(hg.HopliteTimeoutError) as info:
            run()
        assert time.monotonic() - started < 1.5 + MARGIN  # the group's timeout
        text = str(info.value)
        assert f"group {name!r}, rank 0 of 3" in text, text
        assert info.value.waiting_for_ranks == [1], text
        assert "rank 1's" in text, text
    finally:
        other.kill()


def _in_step(group: Group, other: Any, seed: int) -> None:
    """An allreduce of this member (rank 0) and ``other`` (rank 1) runs and sums exactly."""
    other.send("allreduce", group.name, "float32", (64,), seed, "sum")
    got = hg.collective.allreduce(make_array("float32", (64,), seed), group)
    assert np.array_equal(got, make_array("float32", (64,), seed) + make_array("float32", (64,), seed + 1))
    assert other.result().tobytes() == got.tobytes()


def test_a_call_refused_on_one_member_keeps_the_group_in_step(owner: Any) -> None:
    """Rank 0's allgather is refused before it starts (a list of the wrong length); rank 1's
    times out waiting for it, naming rank 0; their next allreduce runs, in step."""
    name = "refused-in-step"
    other = start_workers(owner.directory_address, owner.token, 1)[0]
    try:
        other.call("group", name, 1, 2, 1.5)
        group = Group(owner, 0, 2, name, timeout=1.5)
        other.send("allgather", name, "float32", (64,), 0)
        arr = make_array("float32", (64,), 0)
        with pytest.raises(hg.InvalidArgumentError, match="list_out must be a list of 2"):
            hg.collective.allgather([np.empty_like(arr)], arr, group)
        with pytest.raises(RuntimeError, match=r"HopliteTimeoutError.*rank 0's allgather"):
            other.result()
        _in_step(group, other, 5)
    finally:
        other.kill()


def test_members_that_ask_for_other_operators_fail_typed_and_stay_in_step(owner: Any) -> None:
    """Rank 0 asks for MAX where rank 1 asks for SUM, on the directory's path (no shared
    memory between them): whichever asked second fails with CollectiveArgumentError, the
    other gets what it asked for; the next allreduce runs."""
    name = "other-operators"
    other = start_workers(owner.directory_address, owner.token, 1, shared_memory=False)[0]
    try:
        other.call("group", name, 1, 2, 5.0)
        group = Group(owner, 0, 2, name, timeout=5.0)
        mine, theirs = make_array("float32", (64,), 0), make_array("float32", (64,), 1)
        other.send("allreduce", name, "float32", (64,), 0, "sum")
        refused = []
        try:
            got = hg.collective.allreduce(mine.copy(), group, "max")
            assert np.array_equal(got, np.maximum(mine, theirs))
        except hg.CollectiveArgumentError as exc:
            assert "another operator" in str(exc)
            refused.append(0)
        try:
            assert np.array_equal(other.result(), mine + theirs)
        except RuntimeError as exc:
            assert "CollectiveArgumentError" in str(exc) and "another operator" in str(exc)
            refused.append(1)
        assert len(refused) == 1, refused
        _in_step(group, other, 7)
    finally:
        other.kill()
