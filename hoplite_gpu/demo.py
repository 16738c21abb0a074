"""The main job: broadcast arrays of several sizes from this process to N local worker processes
over an embedded directory, verify every byte, and print a table with the ratio to a plain TCP
socket copy and to memcpy measured in the same run."""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from typing import Any

import numpy as np

from .baselines import format_size, memcpy_gbps, parse_size, socket_copy_gbps

DEFAULT_SIZES = "1KiB,64KiB,1MiB,16MiB,64MiB,256MiB"


def pattern(size: int, seed: int) -> np.ndarray[Any, Any]:
    """Deterministic test data of ``size`` bytes (int64 where possible, else uint8)."""
    if size % 8 == 0:
        return np.arange(seed, seed + size // 8, dtype=np.int64)
    return (np.arange(size, dtype=np.int64) + seed).astype(np.uint8)


def _worker(address: str, token: str, conn: Any) -> None:
    import hoplite_gpu as hg

    node = hg.connect(address, token=token)
    conn.send("ready")
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            oid_hex, size, seed = msg
            arr = node.get(hg.ObjectID.from_hex(oid_hex), timeout=120)
            done = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes on one host
            ok = bool(np.array_equal(arr, pattern(size, seed)))
            del arr
            node.delete(hg.ObjectID.from_hex(oid_hex))
            conn.send((done, ok))
    finally:
        node.close()


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _broadcast(node: Any, pipes: list[Any], size: int, seed: int) -> tuple[float, bool]:
    """Put one object, have every worker get it; returns (put done to last get done, all exact)."""
    oid = node.put(pattern(size, seed))
    t0 = time.monotonic()
    for pipe in pipes:
        pipe.send((oid.hex(), size, seed))
    results = []
    for pipe in pipes:
        if not pipe.poll(180):
            raise RuntimeError("a worker did not answer within 180 s")
        results.append(pipe.recv())
    node.delete(oid)
    return max(done for done, _ in results) - t0, all(ok for _, ok in results)


def run_demo(workers: int = 4, sizes: str = DEFAULT_SIZES) -> list[dict[str, Any]]:
    """Run the broadcast demo and return one row per size."""
    import hoplite_gpu as hg

    size_list = [parse_size(s) for s in sizes.split(",")]
    _progress(f"starting an embedded directory and {workers} worker processes ...")
    node = hg.init()
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    rows: list[dict[str, Any]] = []
    try:
        for _ in range(workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(node.directory_address, node.token, child), daemon=True)
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        for pipe in pipes:
            if not pipe.poll(60) or pipe.recv() != "ready":
                raise RuntimeError("a worker did not start")
        _progress("warming up: one 1 MiB broadcast opens the data-plane connections ...")
        _broadcast(node, pipes, 1 << 20, seed=0)
        for i, size in enumerate(size_list, 1):
            _progress(f"[{i}/{len(size_list)}] broadcasting {format_size(size)} to {workers} workers ...")
            elapsed, verified = _broadcast(node, pipes, size, seed=i)
            sock = socket_copy_gbps(size, repeat=3)
            mem = memcpy_gbps(size)
            gbps = size * workers / elapsed / 1e9  # delivered: every receiver got ``size`` bytes
            rows.append(
                dict(
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
    finally:
        for pipe in pipes:
            try:
                pipe.send(None)
            except (OSError, BrokenPipeError):
                pass
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        node.close()
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of demo rows."""
    lines = [
        "| size | receivers | time (s) | delivered GB/s | socket GB/s | x socket | memcpy GB/s | x memcpy "
        "| verified |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in rows:
        lines.append(
            f"| {format_size(r['size'])} | {r['receivers']} | {r['seconds']:.4f} | {r['gbps']:.3f} | "
            f"{r['socket_gbps']:.2f} | {r['vs_socket']:.2f} | {r['memcpy_gbps']:.2f} | "
            f"{r['vs_memcpy']:.3f} | {'yes' if r['verified'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(workers: int = 4, sizes: str = DEFAULT_SIZES) -> int:
    """Run the demo, print the table; exit status 1 if any byte was wrong."""
    t0 = time.perf_counter()
    rows = run_demo(workers, sizes)
    print()
    print(
        f"Broadcast from one process to {workers} workers (time = put done to last get done, after "
        "a warm-up broadcast that opened the connections; delivered GB/s = receivers x size / time; "
        "socket = best of 3 copies over a plain TCP socket between two processes, same run):"
    )
    print(format_table(rows))
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    return 0 if all(r["verified"] for r in rows) else 1
