"""``bench/peers/pyring.py``, the bound our direct ring is measured against: its ring sums
exactly, for any world size and for arrays that do not split evenly."""

from __future__ import annotations

import concurrent.futures
import socket
import threading

import numpy as np
import pytest

from bench.peers import pyring

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("world", "size"), [(2, 10), (3, 1001), (4, 1 << 18)])
def test_the_ring_sums_every_members_array_in_place(world: int, size: int) -> None:
    links = [socket.socketpair() for _ in range(world)]  # link r: rank r sends, rank r+1 receives
    arrays = [np.arange(size, dtype=np.float32) * (r + 1) for r in range(world)]
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        with concurrent.futures.ThreadPoolExecutor(1) as sender:
            try:
                scratch = np.empty(size // world + 1, np.float32)
                out, inn = links[rank][0], links[(rank - 1) % world][1]
                pyring.allreduce(arrays[rank], rank, world, out, inn, sender, scratch)
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for a, b in links:
        a.close()
        b.close()
    assert not errors
    want = np.arange(size, dtype=np.float32) * (world * (world + 1) / 2)
    for got in arrays:
        np.testing.assert_array_equal(got, want)
