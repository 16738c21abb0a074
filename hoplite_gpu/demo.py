"""The main job, on an embedded local cluster of N worker processes, for arrays of several sizes:

* broadcast from this process to every worker;
* reduce (SUM) of one array per worker, fetched by this process;
* allreduce: every worker puts its array and gets the sum;
* fault tolerance: a broadcast during which one receiving worker is killed (SIGKILL, injected when
  its copy is half received) while others stream from it; the survivors still get every byte.

Every byte is verified. Broadcast rows carry the ratio to a plain TCP socket copy and to memcpy
measured in the same run; reduce and allreduce rows the ratio of their time to the ideal at the
socket's rate (one socket copy of the array for reduce, ``2 (N-1)/N`` for allreduce: the
bandwidth-optimal bound of ring allreduce)."""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from .baselines import (
    format_size,
    markdown_table,
    memcpy_gbps,
    parse_size,
    socket_copy_gbps,
    start_workers,
    stop_workers,
)

DEFAULT_SIZES = "1KiB,64KiB,1MiB,16MiB,64MiB,256MiB"


def pattern(size: int, seed: int) -> np.ndarray[Any, Any]:
    """Deterministic test data of ``size`` bytes (int64 where possible, else uint8)."""
    if size % 8 == 0:
        return np.arange(seed, seed + size // 8, dtype=np.int64)
    return (np.arange(size, dtype=np.int64) + seed).astype(np.uint8)


def sum_of(size: int, seeds: list[int]) -> np.ndarray[Any, Any]:
    """The elementwise sum of the patterns of ``seeds`` (wrapping like the dtype does)."""
    total = pattern(size, seeds[0]).copy()
    for seed in seeds[1:]:
        total += pattern(size, seed)
    return total


def _worker(address: str, token: str, shared_memory: bool | None, conn: Any) -> None:
    import hoplite_gpu as hg

    extra: dict[str, Any] = {} if shared_memory is None else {"shared_memory": shared_memory}
    node = hg.connect(address, token=token, **extra)
    conn.send("ready")
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            kind, oid_hex, size, seed, seeds = msg
            if kind == "arm":
                from . import faults

                faults.arm(oid_hex)  # the fault spec
                conn.send((0.0, 0.0, True))
                continue
            oid = hg.ObjectID.from_hex(oid_hex)
            data = pattern(size, seed) if kind in ("put", "allreduce") else None
            start = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes on one host
            if data is not None:
                node.put(data, oid)
                del data
            if kind == "put":
                conn.send((start, start, True))
                continue
            if kind == "delete":
                node.delete(oid)
                conn.send((start, start, True))
                continue
            result = hg.ObjectID.from_hex(seeds.pop()) if kind == "allreduce" else oid
            arr = node.get(result, timeout=120)
            done = time.monotonic()
            ok = bool(np.array_equal(arr, sum_of(size, seeds)))
            del arr
            node.delete(result)
            if kind == "allreduce":
                node.delete(oid)
            conn.send((start, done, ok))
    finally:
        node.close()


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _answers(pipes: list[Any]) -> list[tuple[float, float, bool]]:
    results = []
    for pipe in pipes:
        if not pipe.poll(180):
            raise RuntimeError("a worker did not answer within 180 s")
        results.append(pipe.recv())
    return results


def _broadcast(node: Any, pipes: list[Any], size: int, seed: int) -> tuple[float, bool]:
    """Put one object, have every worker get it; returns (put done to last get done, all exact)."""
    oid = node.put(pattern(size, seed))
    t0 = time.monotonic()
    for pipe in pipes:
        pipe.send(("get", oid.hex(), size, seed, [seed]))
    results = _answers(pipes)
    node.delete(oid)
    return max(done for _, done, _ in results) - t0, all(ok for _, _, ok in results)


def _start_workers(node: Any, n: int, shared_memory: bool | None = None) -> tuple[list[Any], list[Any]]:
    return start_workers(_worker, [(node.directory_address, node.token, shared_memory)] * n, timeout=60)


def _broadcast_with_a_kill(node: Any, workers: int, size: int) -> dict[str, Any]:
    """Broadcast ``size`` bytes to fresh workers (data plane only, no shared memory) while worker 0
    is killed half way through its copy."""
    import hoplite_gpu as hg

    pipes, procs = _start_workers(node, workers, shared_memory=False)
    try:
        return _kill_run(node, pipes, procs, size, hg.ObjectID.random())
    finally:
        stop_workers(pipes, procs)


def _kill_run(node: Any, pipes: list[Any], procs: list[Any], size: int, oid: Any) -> dict[str, Any]:
    pipes[0].send(("arm", f"receive:{oid.hex()}:0.5:KILL", 0, 0, []))
    _answers(pipes[:1])
    node.put(pattern(size, 7), oid)
    t0 = time.monotonic()
    for pipe in pipes:
        pipe.send(("get", oid.hex(), size, 7, [7]))
    survivors = _answers(pipes[1:])
    procs[0].join(10)
    if procs[0].is_alive():  # the fault was not reached: it is an ordinary receiver
        survivors += _answers(pipes[:1])
    elapsed = max(done for _, done, _ in survivors) - t0
    events = node.event_log()
    resumed = sum(
        1
        for e in events
        if e["kind"] == "transfer_start" and e["object_id"] == oid.hex() and e.get("have", 0) > 0
    )
    node.delete(oid)
    return dict(
        op="broadcast, 1 worker killed",
        size=size,
        receivers=len(pipes),
        killed=int(not procs[0].is_alive()),
        survivors=len(survivors),
        resumed=resumed,
        seconds=elapsed,
        verified=all(ok for _, _, ok in survivors) and not procs[0].is_alive(),
    )


def _reduce(node: Any, pipes: list[Any], size: int, everyone: bool) -> tuple[float, bool]:
    """Each worker puts an array; this process (or, for allreduce, every worker) gets their sum.

    Returns (last put started to last result received, all exact)."""
    import hoplite_gpu as hg

    ids = [hg.ObjectID.random() for _ in pipes]
    seeds = list(range(100, 100 + len(pipes)))
    rid = node.reduce(ids, hg.ReduceOp.SUM)  # before the puts: the tree forms as they arrive
    for pipe, oid, seed in zip(pipes, ids, seeds, strict=True):
        kind = "allreduce" if everyone else "put"
        pipe.send((kind, oid.hex(), size, seed, [*seeds, rid.hex()]))
    if everyone:
        results = _answers(pipes)
        elapsed = max(done for _, done, _ in results) - max(start for start, _, _ in results)
        verified = all(ok for _, _, ok in results)
    else:
        arr = node.get(rid, timeout=120)
        done = time.monotonic()
        verified = bool(np.array_equal(arr, sum_of(size, seeds)))
        del arr
        results = _answers(pipes)
        elapsed = done - max(start for start, _, _ in results)
        for pipe, oid in zip(pipes, ids, strict=True):
            pipe.send(("delete", oid.hex(), 0, 0, []))
        _answers(pipes)
    node.delete(rid)
    return elapsed, verified


def run_demo(workers: int = 4, sizes: str = DEFAULT_SIZES) -> list[dict[str, Any]]:
    """Run the broadcast demo and return one row per size."""
    import hoplite_gpu as hg

    size_list = [parse_size(s) for s in sizes.split(",")]
    _progress(f"starting an embedded directory and {workers} worker processes ...")
    node = hg.init()
    pipes: list[Any] = []
    procs: list[Any] = []
    rows: list[dict[str, Any]] = []
    try:
        pipes, procs = _start_workers(node, workers)
        _progress("warming up: a 1 MiB broadcast and allreduces open the data-plane connections ...")
        _broadcast(node, pipes, 1 << 20, seed=0)
        for _ in range(3):  # reduce trees connect workers to each other, in arrival order
            _reduce(node, pipes, 1 << 20, everyone=True)
        for i, size in enumerate(size_list, 1):
            _progress(f"[{i}/{len(size_list)}] broadcasting {format_size(size)} to {workers} workers ...")
            elapsed, verified = _broadcast(node, pipes, size, seed=i)
            sock = socket_copy_gbps(size, repeat=3)
            mem = memcpy_gbps(size)
            gbps = size * workers / elapsed / 1e9  # delivered: every receiver got ``size`` bytes
            rows.append(
                dict(
                    op="broadcast",
                    size=size,
                    receivers=workers,
                    seconds=elapsed,
                    gbps=gbps,
                    socket_gbps=sock,
                    memcpy_gbps=mem,
                    vs_socket=gbps / sock,
                    vs_memcpy=gbps / mem,
                    verified=verified,
                )
            )
            for op in ("reduce", "allreduce"):
                _progress(f"[{i}/{len(size_list)}] {op} of {format_size(size)} from {workers} workers ...")
                elapsed, verified = _reduce(node, pipes, size, everyone=op == "allreduce")
                ideal = size / (sock * 1e9) * (2 * (workers - 1) / workers if op == "allreduce" else 1.0)
                rows.append(
                    dict(
                        op=op,
                        size=size,
                        receivers=workers,
                        seconds=elapsed,
                        gbps=size / elapsed / 1e9,
                        socket_gbps=sock,
                        ideal_seconds=ideal,
                        vs_ideal=elapsed / ideal,
                        verified=verified,
                    )
                )
        if workers >= 2:
            size = min(max(size_list), 64 << 20)
            _progress(f"broadcasting {format_size(size)} while a worker is killed half way through ...")
            rows.append(_broadcast_with_a_kill(node, workers, size))
    finally:
        stop_workers(pipes, procs)
        node.close()
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown tables of demo rows: broadcast, then reduce and allreduce."""
    tables = [
        _broadcast_table([r for r in rows if r["op"] == "broadcast"]),
        _reduce_table([r for r in rows if r["op"] in ("reduce", "allreduce")]),
    ]
    killed = [r for r in rows if "killed" in r]
    if killed:
        tables.append(_fault_table(killed))
    return "\n\n".join(tables)


def _verified(row: dict[str, Any]) -> str:
    return "yes" if row["verified"] else "NO"


def _fault_table(rows: list[dict[str, Any]]) -> str:
    columns = [("op", "l"), ("size", "r"), ("receivers", "r"), ("killed", "r"), ("survivors", "r")]
    columns += [("resumed mid-object", "r"), ("time (s)", "r"), ("completed, verified", "c")]
    cells = [
        [
            r["op"],
            format_size(r["size"]),
            str(r["receivers"]),
            str(r["killed"]),
            str(r["survivors"]),
            str(r["resumed"]),
            f"{r['seconds']:.4f}",
            _verified(r),
        ]
        for r in rows
    ]
    return markdown_table(columns, cells)


def _reduce_table(rows: list[dict[str, Any]]) -> str:
    columns = [("op", "l"), ("size", "r"), ("workers", "r"), ("time (s)", "r"), ("size/time GB/s", "r")]
    columns += [("ideal at socket rate (s)", "r"), ("x ideal", "r"), ("verified", "c")]
    cells = [
        [
            r["op"],
            format_size(r["size"]),
            str(r["receivers"]),
            f"{r['seconds']:.4f}",
            f"{r['gbps']:.3f}",
            f"{r['ideal_seconds']:.4f}",
            f"{r['vs_ideal']:.2f}",
            _verified(r),
        ]
        for r in rows
    ]
    return markdown_table(columns, cells)


def _broadcast_table(rows: list[dict[str, Any]]) -> str:
    columns = [("size", "r"), ("receivers", "r"), ("time (s)", "r"), ("delivered GB/s", "r")]
    columns += [("socket GB/s", "r"), ("x socket", "r"), ("memcpy GB/s", "r"), ("x memcpy", "r")]
    columns += [("verified", "c")]
    cells = [
        [
            format_size(r["size"]),
            str(r["receivers"]),
            f"{r['seconds']:.4f}",
            f"{r['gbps']:.3f}",
            f"{r['socket_gbps']:.2f}",
            f"{r['vs_socket']:.2f}",
            f"{r['memcpy_gbps']:.2f}",
            f"{r['vs_memcpy']:.3f}",
            _verified(r),
        ]
        for r in rows
    ]
    return markdown_table(columns, cells)


def main(workers: int = 4, sizes: str = DEFAULT_SIZES) -> int:
    """Run the demo, print the table; exit status 1 if any byte was wrong."""
    t0 = time.perf_counter()
    rows = run_demo(workers, sizes)
    print()
    print(
        f"Broadcast from one process to {workers} workers (time = put done to last get done, after "
        "a warm-up broadcast that opened the connections; delivered GB/s = receivers x size / time; "
        "socket = best of 3 copies over a plain TCP socket between two processes, same run).\n"
        f"Reduce (SUM) of one array from each of the {workers} workers, fetched by this process, and "
        "allreduce, fetched by every worker (time = last put started to last result received; "
        "x ideal = time / ideal, 1.0 is ideal; ideal = one socket copy of the array for reduce, "
        "2(N-1)/N copies for allreduce). Last, a broadcast during which worker 0 is SIGKILLed half "
        "way through its copy (resumed = receivers that continued from the bytes they held):"
    )
    print(format_table(rows))
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    return 0 if all(r["verified"] for r in rows) else 1
