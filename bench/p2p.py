"""Point-to-point throughput: hoplite_gpu get vs a plain TCP socket copy vs memcpy, in one run.

Two processes on loopback. For each size, the receiver process gets a fresh object (put by the
sender process) ``--repeat`` times; the best and median GB/s are reported with the ratio to a plain
Python TCP socket moving the same bytes between the same two processes, and to an in-process memcpy.

    python bench/p2p.py --sizes 64MiB,256MiB --repeat 5
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

from bench.common import memcpy_gbps, parse_size, socket_copy_gbps


def _receiver(address: str, token: str, conn: Any) -> None:
    import hoplite_gpu as hg

    node = hg.connect(address, token=token)
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


def run(sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    import hoplite_gpu as hg

    node = hg.init()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(node.directory_address, node.token, child))
    proc.start()
    rows = []
    try:
        for size in sizes:
            times = []
            for _ in range(repeat):
                arr = np.arange(size // 8, dtype=np.int64)
                oid = node.put(arr)
                parent.send(oid.hex())
                if not parent.poll(180):
                    raise TimeoutError("receiver did not answer")
                dt, ok = parent.recv()
                if not ok:
                    raise AssertionError("received data is wrong")
                node.delete(oid)
                times.append(dt)
            sock = socket_copy_gbps(size, repeat=max(2, repeat // 2))
            mem = memcpy_gbps(size)
            best = size / min(times) / 1e9
            median = size / statistics.median(times) / 1e9
            rows.append(
                {
                    "size": size,
                    "hoplite_gbps_best": best,
                    "hoplite_gbps_median": median,
                    "socket_gbps": sock,
                    "memcpy_gbps": mem,
                    "ratio_vs_socket": median / sock,
                    "ratio_vs_memcpy": median / mem,
                }
            )
    finally:
        parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        node.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16MiB,64MiB,256MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows = run(sizes, args.repeat)
    print(
        f"{'size':>10} {'hoplite GB/s (median/best)':>28} {'socket GB/s':>12} {'x socket':>9} "
        f"{'memcpy GB/s':>12} {'x memcpy':>9}"
    )
    for r in rows:
        print(
            f"{r['size'] / 2**20:>8.0f}Mi {r['hoplite_gbps_median']:>14.2f} / {r['hoplite_gbps_best']:<11.2f}"
            f"{r['socket_gbps']:>12.2f} {r['ratio_vs_socket']:>9.2f} {r['memcpy_gbps']:>12.2f} "
            f"{r['ratio_vs_memcpy']:>9.2f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


__all__ = ["main", "run"]

if __name__ == "__main__":
    raise SystemExit(main())
