"""Point-to-point throughput: hoplite_gpu get vs a plain TCP socket copy vs memcpy, in one run.

Two processes on one host. For each size, the receiver process gets a fresh object (put by the
sender process) ``--repeat`` times after ``--warmup`` untimed gets of that size, and deletes it
after each get (as a training loop does; the loop holds the previous array until the next get
returns, so buffers are recycled from the third get on). The plain Python TCP socket baseline
moves the same bytes ``--repeat`` times between two processes over a connection opened before
timing, into a reused buffer. Both are reported as median and best GB/s; the ratios compare median
with median and best with best. memcpy is an in-process ``np.copyto`` into a pre-faulted buffer.

Two paths are measured by default (``--paths``): ``shm``, where the receiver copies from the
sender's shared-memory segment, and ``ucx``, with ``shared_memory=False``, where every byte goes
through the UCX data plane (the path between hosts).

Two more take device objects in simulated device memory (``HOPLITE_DEVICE_BACKEND=sim``:
:class:`hoplite_gpu.memory.sim.SimBackend`, host memory behind the CUDA IPC code path): the receiver
opens the sender's memory through its ticket and copies it into a new array, as a GPU reader does
through CUDA IPC. ``sim-index`` finds the ticket through its index link
(``Config.same_host_index``, the default), ``sim-lookup`` asks the directory for it
(``same_host_index=False``). Their difference at small sizes is what a same-host device get saves
without the lookup and the hop to the I/O thread; the copy itself is host memory here, not a GPU's.

    python bench/p2p.py --sizes 16MiB,64MiB,256MiB --repeat 9
    python bench/p2p.py --paths sim-index,sim-lookup --sizes 1MiB,16MiB,64MiB --repeat 21
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

PATHS = ("shm", "ucx", "sim-index", "sim-lookup")


def _receiver(address: str, token: str, path: str, conn: Any) -> None:
    if path.startswith("sim"):
        os.environ["HOPLITE_DEVICE_BACKEND"] = "sim"
    import hoplite_gpu as hg
    from hoplite_gpu.memory import to_host

    node = hg.connect(address, token=token, shared_memory=path != "ucx", same_host_index=path != "sim-lookup")
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            oid = hg.ObjectID.from_hex(msg)
            t0 = time.perf_counter()
            arr = node.get(oid, timeout=120)
            dt = time.perf_counter() - t0
            arr = to_host(arr).view(np.ndarray).reshape(-1)
            ok = bool(arr[-1] == arr.size - 1) if arr.size else True
            node.delete(oid)
            conn.send((dt, ok))
    finally:
        node.close()


def run(sizes: list[int], repeat: int, warmup: int = 3, path: str = "shm") -> list[dict[str, Any]]:
    """Measure each size over ``path`` (one of :data:`PATHS`); one row per size."""
    import hoplite_gpu as hg
    from hoplite_gpu.memory import sim

    node = hg.init(shared_memory=path != "ucx")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(node.directory_address, node.token, path, child))
    proc.start()
    rows = []
    try:
        for size in sizes:
            times = []
            for i in range(warmup + repeat):
                arr = np.arange(size // 8, dtype=np.int64)
                oid = node.put(sim.sim_array(arr) if path.startswith("sim") else arr)
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
                    "hoplite_seconds_median": statistics.median(times),
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
    ap.add_argument("--paths", default="shm,ucx", help="comma-separated: " + ", ".join(PATHS))
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not paths or set(paths) - set(PATHS):
        ap.error(f"--paths takes some of {', '.join(PATHS)}")
    rows = [r for path in paths for r in run(sizes, args.repeat, args.warmup, path)]
    print(
        f"{'path':>10} {'size':>8} {'hoplite GB/s':>16} {'socket GB/s':>16} {'x socket':>14} "
        f"{'memcpy GB/s':>12} {'x memcpy':>9} {'get ms':>7}"
    )
    print(f"{'':>10} {'':>8} {'median / best':>16} {'median / best':>16} {'median / best':>14}")
    for r in rows:
        print(
            f"{r['path']:>10} {r['size'] / 2**20:>6.0f}Mi"
            f" {r['hoplite_gbps_median']:>7.2f} / {r['hoplite_gbps_best']:<6.2f}"
            f" {r['socket_gbps_median']:>7.2f} / {r['socket_gbps_best']:<6.2f}"
            f" {r['ratio_vs_socket_median']:>6.2f} / {r['ratio_vs_socket_best']:<5.2f}"
            f" {r['memcpy_gbps']:>12.2f} {r['ratio_vs_memcpy']:>9.2f}"
            f" {r['hoplite_seconds_median'] * 1e3:>7.3f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


__all__ = ["main", "run"]

if __name__ == "__main__":
    raise SystemExit(main())
