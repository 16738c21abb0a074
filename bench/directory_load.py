"""How much of the directory's time one request takes when the directory holds a lot: a reduce
over ``n`` inputs that are all present, and single events while tens of thousands of lookups are
pending. Everything the directory does on one event runs on its one event loop, so every other
node's round trip waits behind it.

Drives :class:`~hoplite_gpu.directory.state.DirectoryState` directly (no sockets: the times are
the state machine's own CPU time per event, which the service adds to every other request).

    python bench/directory_load.py --inputs 1000,2000,4000,8000,10000 --pending 20000
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hoplite_gpu import protocol as p
from hoplite_gpu.directory.state import DirectoryState, NodeJoined, Request, Tick


def _oid(i: int) -> bytes:
    return i.to_bytes(20, "big")


def reduce_seconds(n: int) -> float:
    """Seconds one ReduceRequest over ``n`` present 1 MiB inputs (on two nodes) takes."""
    state = DirectoryState(inline_threshold_bytes=64 * 1024, lease_timeout=math.inf)
    for node, port in (("A", 7000), ("B", 7001)):
        state.handle(NodeJoined(node, "127.0.0.1", port, 0.0))
    ids = [_oid(i) for i in range(1, n + 1)]
    for k, oid in enumerate(ids):
        put = p.PutRequest(
            request_id=k + 1, object_id=oid, size=1 << 20, dtype="|u1", shape=[1 << 20], digest=b""
        )
        state.handle(Request("AB"[k % 2], put, 0.0))
    started = time.perf_counter()
    state.handle(
        Request(
            "A",
            p.ReduceRequest(request_id=0, reduction_id=b"r" * 20, object_ids=ids, op="sum", num_objects=n),
            1.0,
        )
    )
    return time.perf_counter() - started


def per_event_ms(pending: int) -> dict[str, float]:
    """Milliseconds of single events with ``pending`` lookups waiting (half with a deadline)."""
    state = DirectoryState(inline_threshold_bytes=64 * 1024, lease_timeout=math.inf)
    state.handle(NodeJoined("A", "127.0.0.1", 7000, 0.0))
    for k in range(pending):
        timeout = 30.0 if k % 2 else 0.0
        state.handle(
            Request("A", p.LookupRequest(request_id=k + 1, object_id=_oid(10**7 + k), timeout=timeout), 1.0)
        )

    def timed(step: object, rounds: int = 100) -> float:
        started = time.perf_counter()
        for i in range(rounds):
            step(i)  # type: ignore[operator]
        return (time.perf_counter() - started) / rounds * 1000

    def put(i: int) -> None:
        msg = p.PutRequest(
            request_id=10**6 + i,
            object_id=_oid(2 * 10**7 + i),
            size=4,
            dtype="|u1",
            shape=[4],
            digest=b"",
            inline=b"abcd",
        )
        state.handle(Request("A", msg, 2.0))

    def cancel(i: int) -> None:
        state.handle(Request("A", p.CancelLookup(request_id=pending - i), 2.0))

    return {
        "put of an unrelated object": timed(put),
        "next_deadline (after every event)": timed(lambda i: state.next_deadline()),
        "Tick before any deadline": timed(lambda i: state.handle(Tick(2.0 + i * 1e-6))),
        "CancelLookup": timed(cancel),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", default="1000,2000,4000,8000,10000")
    parser.add_argument("--pending", type=int, default=20000)
    args = parser.parse_args(argv)
    print("| reduce inputs (all present) | directory seconds |\n|---:|---:|")
    for n in (int(x) for x in args.inputs.split(",")):
        print(f"| {n} | {reduce_seconds(n):.3f} |", flush=True)
    print(f"\n| event, with {args.pending} lookups pending | ms |\n|---|---:|")
    for name, ms in per_event_ms(args.pending).items():
        print(f"| {name} | {ms:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
