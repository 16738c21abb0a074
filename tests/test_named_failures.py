"""Bounded, named failures: a get or collective that cannot finish raises within its timeout, and its
error says who is missing or slow: the ObjectID, the node and its address, the rank."""

from __future__ import annotations

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
