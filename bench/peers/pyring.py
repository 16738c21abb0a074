"""``pyring``: the floor of a ring allreduce run on the caller's thread, in Python and NumPy.

Not a system anyone runs: a measure of what :mod:`hoplite_gpu.collective.ring` could reach if its
rounds ran as Gloo's do, on the calling thread over blocking sockets kept to the member before
and after, with no hand-off to an I/O thread, no pull request and no ack. Each member sends on
one helper thread while its caller's thread receives and adds, region by region (Gloo's plain
ring: ``N-1`` reduce-scatter steps, then ``N-1`` allgather steps). No chunking within a step, no
failure handling, no authentication: a bound to measure our ring against in the same run
(bench/pages/collectives.md#where-a-1-mib-round-goes-100-mbs-4-hosts-2026-12-01), run by
``bench/netbench.py --systems pyring`` (allreduce only; a gloo process group of the same members
serves its barriers and its address exchange: :func:`bench.netbench._gloo_member` with
:func:`ring`).
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
from collections.abc import Callable
from typing import Any

import numpy as np

from hoplite_gpu.dataplane.sockets import recv_exact

#: Where each member listens for the member before it (the barrier's gloo group uses another).
RING_PORT = 29610
#: The gloo group's port (not netbench's gloo system's: both may run in one cluster).
STORE_PORT = 29611


def _connect(rank: int, world: int, store: Any) -> tuple[socket.socket, socket.socket]:
    """This member's socket to the member after it and from the member before it."""
    mine = os.environ.get("HOPLITE_LISTEN_HOST", "127.0.0.1")
    listener = socket.create_server((mine, RING_PORT))
    store.set(f"pyring/{rank}", mine)
    after = store.get(f"pyring/{(rank + 1) % world}").decode()
    out = socket.create_connection((after, RING_PORT), timeout=60)
    listener.settimeout(60)
    inn, _ = listener.accept()
    listener.close()
    for sock in (out, inn):
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return out, inn


def allreduce(
    flat: Any,
    rank: int,
    world: int,
    out: socket.socket,
    inn: socket.socket,
    sender: concurrent.futures.Executor,
    scratch: Any,
) -> None:
    """Sum ``flat`` (1-D float32) over the ring in place: rank ``r`` sends to ``r+1``."""
    cuts = [flat.size * j // world for j in range(world + 1)]

    def region(c: int) -> Any:
        return flat[cuts[c % world] : cuts[c % world + 1]]

    for s in range(world - 1):
        sent = sender.submit(out.sendall, memoryview(region(rank - s)).cast("B"))
        into = region(rank - s - 1)
        buf = scratch[: into.size]
        recv_exact(inn, memoryview(buf).cast("B"))
        np.add(into, buf, out=into)
        sent.result()
    for s in range(world - 1):
        sent = sender.submit(out.sendall, memoryview(region(rank + 1 - s)).cast("B"))
        recv_exact(inn, memoryview(region(rank - s)).cast("B"))
        sent.result()


def ring(dist: Any, rank: int, world: int) -> Callable[[Any], None]:
    """This member's allreduce of a 1-D float32 NumPy array, over connections it makes now to
    the members before and after it (``dist``: the gloo process group's module, whose store
    carries the addresses)."""
    store = dist.distributed_c10d._get_default_store()
    out, inn = _connect(rank, world, store)
    sender = concurrent.futures.ThreadPoolExecutor(1)
    scratch: dict[int, Any] = {}

    def run(flat: Any) -> None:
        buf = scratch.get(flat.size)
        if buf is None:
            buf = scratch[flat.size] = np.empty(flat.size // world + 1, np.float32)
        allreduce(flat, rank, world, out, inn, sender, buf)

    return run
