"""Point-to-point throughput: hoplite_gpu get vs a plain TCP socket copy vs memcpy, in one run.

Two processes on one host. For each size, the receiver process gets a fresh object (put by the
sender process) ``--repeat`` times after ``--warmup`` untimed gets of that size, and deletes it
after each get (as a training loop does; the loop holds the previous array until the next get
returns, so buffers are recycled from the third get on). The plain Python TCP socket baseline
moves the same bytes ``--repeat`` times between two processes over a connection opened before
timing, into a reused buffer. Both are reported as median and best GB/s; the ratios compare median
with median and best with best. memcpy is an in-process ``np.copyto`` into a pre-faulted buffer.

Two paths are measured (``--paths``): ``shm``, the default, where the receiver copies from the
sender's shared-memory segment, and ``ucx``, with ``shared_memory=False``, where every byte goes
through the UCX data plane (the path between hosts).

    python bench/p2p.py --sizes 16MiB,64MiB,256MiB --repeat 9
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import memcpy_gbps, parse_size, socket_copy_times, stop_workers


def _receiver(address: str, token: str, shared_memory: bool, conn: Any) -> None:
    import hoplite_gpu as hg

    node = hg.connect(address, token=token, shared_memory=shared_memory)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            oid = hg.ObjectID.from_hex(msg)
            t0 = time.perf_counter()
            arr = node.get(oid, timeout=120)
            dt = time.perf_counter() - t0
            ok = bool(arr.reshape(-1)[-1] == arr.size - 1) if arr.size else True
            node.delete(oid)
            conn.send((dt, ok))
    finally:
        node.close()


def run(sizes: list[int], repeat: int, warmup: int = 3, path: str = "shm") -> list[dict[str, Any]]:
    """Measure each size over ``path`` ("shm" or "ucx"); one row per size."""
    import hoplite_gpu as hg

    shared = path == "shm"
    node = hg.init(shared_memory=shared)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(node.directory_address, node.token, shared, child))
    proc.start()
    rows = []
    try:
        for size in sizes:
            times = []
            for i in range(warmup + repeat):
                arr = np.arange(size // 8, dtype=np.int64)
                oid = node.put(arr)
                parent.send(oid.hex())
                if not parent.poll(180):
                    raise TimeoutError("receiver did not answer")
                dt, ok = parent.recv()
                if not ok:
                    raise AssertionError("received data is wrong")
                node.delete(oid)
                if i >= warmup:
                    times.append(dt)
            sock = socket_copy_times(size, repeat=repeat + 1)[1:]
            mem = memcpy_gbps(size)
            ours = (size / statistics.median(times) / 1e9, size / min(times) / 1e9)
            theirs = (size / statistics.median(sock) / 1e9, size / min(sock) / 1e9)
            rows.append(
                {
                    "path": path,
                    "size": size,
                    "hoplite_gbps_median": ours[0],
                    "hoplite_gbps_best": ours[1],
                    "socket_gbps_median": theirs[0],
                    "socket_gbps_best": theirs[1],
                    "memcpy_gbps": mem,
                    "ratio_vs_socket_median": ours[0] / theirs[0],
                    "ratio_vs_socket_best": ours[1] / theirs[1],
                    "ratio_vs_memcpy": ours[0] / mem,
                }
            )
    finally:
        stop_workers([parent], [proc])
        node.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16MiB,64MiB,256MiB")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=3, help="untimed gets per size before timing")
    ap.add_argument("--paths", default="shm,ucx", help="comma-separated: shm, ucx")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not paths or set(paths) - {"shm", "ucx"}:
        ap.error("--paths takes shm and/or ucx")
    rows = [r for path in paths for r in run(sizes, args.repeat, args.warmup, path)]
    print(
        f"{'path':>4} {'size':>8} {'hoplite GB/s':>16} {'socket GB/s':>16} {'x socket':>14} "
        f"{'memcpy GB/s':>12} {'x memcpy':>9}"
    )
    print(f"{'':>4} {'':>8} {'median / best':>16} {'median / best':>16} {'median / best':>14}")
    for r in rows:
        print(
            f"{r['path']:>4} {r['size'] / 2**20:>6.0f}Mi"
            f" {r['hoplite_gbps_median']:>7.2f} / {r['hoplite_gbps_best']:<6.2f}"
            f" {r['socket_gbps_median']:>7.2f} / {r['socket_gbps_best']:<6.2f}"
            f" {r['ratio_vs_socket_median']:>6.2f} / {r['ratio_vs_socket_best']:<5.2f}"
            f" {r['memcpy_gbps']:>12.2f} {r['ratio_vs_memcpy']:>9.2f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


__all__ = ["main", "run"]

if __name__ == "__main__":
    raise SystemExit(main())
