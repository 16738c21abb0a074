"""Broadcast, reduce and allreduce among N local processes, against the ideal for the same bytes.

N worker processes join an embedded directory and form one :class:`hoplite_gpu.collective.Group`.
For each size, each collective runs ``--warmup`` untimed and ``--repeat`` timed times, each after a
barrier; its time runs from the moment the last member entered it to the moment the last member
returned (``time.monotonic`` is CLOCK_MONOTONIC, comparable across processes on one host), so the
skew with which the barrier releases members does not count. The point-to-point time of the same size
is measured in the same run (a ``get`` between two members, median of ``--repeat``), and the ideal
of each collective is derived from it:

* broadcast and reduce: one point-to-point time (``put`` by one member and ``get`` by another; a
  pipelined chain moves ``S`` bytes over each link once);
* allreduce: ``2 (N-1)/N`` point-to-point times (the bandwidth-optimal bound of ring allreduce).

``x ideal`` is measured median time over ideal time: 1.0 is ideal, larger is slower. On a 2-core
machine every member shares the same cores and memory bus, so the ideal is a reference point, not a
reachable target once N > 2.

    python bench/collectives.py --workers 4 --sizes 1KiB,1MiB,64MiB,256MiB --paths ucx
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (
    cpu_seconds,
    format_size,
    markdown_table,
    parse_size,
    round_counters,
    round_counters_since,
    start_workers,
    stop_workers,
    write_json,
)

OPS = ("broadcast", "reduce", "allreduce")


def check_result(op: str, rank: int, world: int, arr: Any, outs: list[Any]) -> None:
    """Raise if a benchmark round's result is wrong: member ``r`` entered it with ``r + 1``
    everywhere (its ``arr``, and its piece for gather and allgather)."""
    total = world * (world + 1) / 2
    if op == "broadcast":
        want = [(arr, 1.0)]
    elif op in ("reduce", "allreduce"):
        want = [(arr, total)] if op == "allreduce" or rank == 0 else []
    elif op in ("gather", "allgather"):
        want = [(out, r + 1.0) for r, out in enumerate(outs)] if op == "allgather" or rank == 0 else []
    else:
        want = []
    for got, value in want:
        if len(got) and not (float(got.min()) == float(got.max()) == value):
            raise AssertionError(f"{op}: member {rank} got values in [{got.min()}, {got.max()}], not {value}")


#: Seconds a member waits before each round's barrier (``netbench.py --idle``).
IDLE_VAR = "HOPLITE_BENCH_IDLE"


def idle_before_round() -> None:
    """Wait :data:`IDLE_VAR` seconds: the emulated links' token buckets refill meanwhile (a
    pause in the workload, not a synchronisation)."""
    idle = float(os.environ.get(IDLE_VAR, "0") or 0)
    if idle > 0:
        time.sleep(idle)


def group_op(op: str, arr: Any, group: Any, outs: Any = None, piece: Any = None) -> bool:
    """Run collective ``op`` of :mod:`hoplite_gpu.collective` on this member of ``group``:
    broadcast, reduce and gather rooted at rank 0; gather and allgather contribute ``piece``
    (``arr`` if None) into ``outs``. False for an op it does not know (nothing runs)."""
    from hoplite_gpu import collective as coll

    piece = arr if piece is None else piece
    if op == "broadcast":
        coll.broadcast(arr, 0, group)
    elif op == "reduce":
        coll.reduce(arr, 0, group)
    elif op == "allreduce":
        coll.allreduce(arr, group)
    elif op == "gather":
        coll.gather(outs, piece, 0, group)
    elif op == "allgather":
        coll.allgather(outs, piece, group)
    elif op == "barrier":
        coll.barrier(group)
    else:
        return False
    return True


def _member(
    address: str, token: str, rank: int, world: int, shared: bool, conn: Any, cpu_pids: Sequence[int] = ()
) -> None:
    """One member: for each ``(op, size, rounds)`` it reads, answers ``(start, end, CPU seconds,
    counters)`` of every round: the CPU of this process and of the processes ``cpu_pids`` from its
    start until every member has left the op (a barrier after it: a member that returned may still
    serve), and the :func:`~bench.common.round_counters` of the same window."""
    import hoplite_gpu as hg
    from hoplite_gpu import collective as coll

    node = hg.connect(address, token=token, shared_memory=shared)
    group = coll.Group(node, rank, world, "bench-" + address, timeout=300)
    # Connect every member to every other before anything is timed, as Gloo does when its group is
    # made: an allgather of 1 MiB pieces read straight from each member opens (and warms up) the
    # data-plane endpoint from each member to each other one. Otherwise a round whose chain pairs
    # members in a new way pays for an endpoint.
    piece = np.zeros(1 << 18, np.float32)
    coll.allgather([np.empty_like(piece) for _ in range(world)], piece, group)
    conn.send("ready")
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            if msg == "events":  # the directory's event log, for profiling (bench/profile.py)
                conn.send(node.event_log())
                continue
            op, size, rounds = msg
            arr = np.empty(size // 4, np.float32)
            piece = np.full(size // 4 // world, rank + 1, np.float32)  # gather: size is the total
            outs = [np.empty_like(piece) for _ in range(world)]
            spans = []
            sent: list[Any] = []
            for _ in range(rounds):
                arr.fill(rank + 1)
                idle_before_round()
                coll.barrier(group)
                for oid in sent:  # every member is past the barrier: the receiver has it
                    node.delete(oid)
                sent.clear()
                cpu, counted = cpu_seconds(cpu_pids), round_counters()
                start = time.monotonic()
                if op == "p2p":  # member 0 puts, member 1 gets; the others idle
                    oid = hg.ObjectID.from_name(f"{group.name}/p2p/{group.seq}")
                    if rank == 0:
                        sent.append(node.put(arr, oid))
                    elif rank == 1:
                        node.get(oid, timeout=300)
                else:
                    group_op(op, arr, group, outs, piece)
                end = time.monotonic()
                coll.barrier(group)  # every member has left the op: what it served after returning counts
                spans.append((start, end, cpu_seconds(cpu_pids) - cpu, round_counters_since(counted)))
                check_result(op, rank, world, arr, outs)
            coll.barrier(group)
            for oid in sent:
                node.delete(oid)
            conn.send(spans)
        group.destroy()
    finally:
        node.close()


def round_times(spans: list[list[Any]], warmup: int, repeat: int) -> list[float]:
    """Seconds of each timed round: from the last member entering the collective (every member has
    left the barrier, so its release skew does not count) to the last member leaving it.
    ``spans[member][round]`` is that member's (start, end)."""
    return [max(s[i][1] for s in spans) - max(s[i][0] for s in spans) for i in range(warmup, warmup + repeat)]


def round_counts(spans: list[list[Any]], warmup: int, repeat: int) -> list[dict[str, int]]:
    """:func:`~bench.common.round_counters` of each timed round, summed over the members (the TCP
    ones: each host's, where each member has a network namespace of its own, as in netbench.py)."""
    return [
        {name: sum(s[i][3][name] for s in spans) for name in spans[0][i][3]}
        for i in range(warmup, warmup + repeat)
    ]


def round_cpu(spans: list[list[Any]], warmup: int, repeat: int) -> list[float]:
    """CPU seconds of each timed round, summed over the members: ``spans[member][round]`` is that
    member's (start, end, CPU seconds), as :func:`round_times` reads it."""
    return [sum(s[i][2] for s in spans) for i in range(warmup, warmup + repeat)]


def run(workers: int, sizes: list[int], repeat: int, warmup: int, path: str) -> list[dict[str, Any]]:
    """One row per (size, collective): median seconds and the ratio to the ideal."""
    import hoplite_gpu as hg

    shared = path == "shm"
    node = hg.init(shared_memory=shared)
    pipes: list[Any] = []
    procs: list[Any] = []
    rows: list[dict[str, Any]] = []
    try:
        pipes, procs = start_workers(
            _member,
            [(node.directory_address, node.token, rank, workers, shared) for rank in range(workers)],
            daemon=False,
        )

        def timed(op: str, size: int) -> float:
            for pipe in pipes:
                pipe.send((op, size, warmup + repeat))
            spans = []
            for pipe in pipes:
                if not pipe.poll(900):
                    raise TimeoutError(f"{op} of {size} bytes did not finish")
                spans.append(pipe.recv())
            return statistics.median(round_times(spans, warmup, repeat))

        for size in sizes:
            print(f"{format_size(size)} ...", file=sys.stderr, flush=True)
            p2p = timed("p2p", size)
            ideal = {"broadcast": p2p, "reduce": p2p, "allreduce": 2 * (workers - 1) / workers * p2p}
            for op in OPS:
                seconds = timed(op, size)
                rows.append(
                    {
                        "path": path,
                        "op": op,
                        "workers": workers,
                        "size": size,
                        "seconds": seconds,
                        "p2p_seconds": p2p,
                        "ideal_seconds": ideal[op],
                        "x_ideal": seconds / ideal[op],
                        "algbw_gbps": size / seconds / 1e9,
                    }
                )
    finally:
        stop_workers(pipes, procs, timeout=60)
        node.close()
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of benchmark rows."""
    columns = [("path", "l"), ("op", "l"), ("N", "r"), ("size", "r"), ("median s", "r"), ("p2p s", "r")]
    columns += [("ideal s", "r"), ("x ideal", "r"), ("algbw GB/s", "r")]
    cells = [
        [
            r["path"],
            r["op"],
            str(r["workers"]),
            format_size(r["size"]),
            f"{r['seconds']:.4f}",
            f"{r['p2p_seconds']:.4f}",
            f"{r['ideal_seconds']:.4f}",
            f"{r['x_ideal']:.2f}",
            f"{r['algbw_gbps']:.2f}",
        ]
        for r in rows
    ]
    return markdown_table(columns, cells)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--sizes", default="1KiB,64KiB,1MiB,16MiB,64MiB,256MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--paths", default="ucx", help="comma-separated: shm, ucx")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    if args.workers < 2:
        ap.error("--workers must be >= 2")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not paths or set(paths) - {"shm", "ucx"}:
        ap.error("--paths takes shm and/or ucx")
    rows = [r for path in paths for r in run(args.workers, sizes, args.repeat, args.warmup, path)]
    print(format_table(rows))
    write_json(args.json, rows)
    return 0


__all__ = ["format_table", "main", "round_times", "run"]

if __name__ == "__main__":
    raise SystemExit(main())
