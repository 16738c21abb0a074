"""Point-to-point throughput: hoplite_gpu get vs a plain TCP socket copy vs memcpy, in one run.

Two processes on one host. For each size, the receiver process gets a fresh object (put by the
sender process) ``--repeat`` times after ``--warmup`` untimed gets of that size, and deletes it
after each get (as a training loop does; the loop holds the previous array until the next get
returns, so buffers are recycled from the third get on). The plain Python TCP socket baseline
moves the same bytes ``--repeat`` times between two processes over a connection opened before
timing, into a reused buffer. Both are reported as median and best GB/s; the ratios compare median
with median and best with best. memcpy is an in-process ``np.copyto`` into a pre-faulted buffer.

Three paths are measured by default (``--paths``): ``shm``, where the receiver copies from the
sender's shared-memory segment, and ``tcp`` and ``ucx``, with ``shared_memory=False``, where every
byte goes through the data plane between hosts: the TCP one (``Config.data_plane="tcp"``, the
default on hosts without RDMA) or the UCX one. ``tcp-shared`` is ``tcp`` with the receiver's
shared memory on, a host's default: what it pulls lands in a new shared-memory segment, which
same-host processes could map.

Two more take device objects in simulated device memory (``HOPLITE_DEVICE_BACKEND=sim``:
:class:`hoplite_gpu.memory.sim.SimBackend`, host memory behind the CUDA IPC code path): the receiver
opens the sender's memory through its ticket and copies it into a new array, as a GPU reader does
through CUDA IPC. ``sim-index`` finds the ticket through its index link
(``Config.same_host_index``, the default), ``sim-lookup`` asks the directory for it
(``same_host_index=False``). Their difference at small sizes is what a same-host device get saves
without the lookup and the hop to the I/O thread; the copy itself is host memory here, not a GPU's.

The receiver's treatment of the objects (``--patterns``) is ``deleted`` by default, the loop
above. ``kept`` is a get as users write it: a fresh object each round, kept by the receiver (and
by the sender) until every round of the size is done, no warm-up, the first round timed (the first
size's first round also opens the connection between the two nodes). ``out`` is the same with
``get(out=...)`` into an array the receiver allocated and touched once per size before timing. The
socket baseline is the same in every pattern. Run ``kept`` and ``out`` with ``--paths tcp,ucx`` (what
``HOPLITE_SHARED_MEMORY=0`` does) for the data plane between hosts.

CPU per byte (``CPU s/GiB``): user + system CPU seconds of both processes over each timed get (the
receiver's over its ``get``; the sender's, with the embedded directory, from handing over the
ObjectID to the receiver's answer), summed over the timed rounds and divided by the GiB got; for
the socket, both processes over each copy.

    python bench/p2p.py --sizes 16MiB,64MiB,256MiB --repeat 9
    python bench/p2p.py --paths tcp,ucx --patterns kept,out --sizes 1MiB,16MiB,64MiB,256MiB --repeat 3
    python bench/p2p.py --paths sim-index,sim-lookup --sizes 1MiB,16MiB,64MiB --repeat 21
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (
    cpu_per_gib,
    cpu_seconds,
    memcpy_gbps,
    parse_size,
    socket_copy,
    stop_workers,
    write_json,
)

PATHS = ("shm", "tcp", "ucx", "tcp-shared", "sim-index", "sim-lookup")
#: The paths through the data plane between hosts (no shared memory), by ``Config.data_plane``.
WIRE = {"tcp": "tcp", "ucx": "ucx", "tcp-shared": "tcp"}
#: Wire paths whose receiver keeps shared memory on (a host's default), so what it pulls lands in
#: a new shared-memory segment; the sender's memory is private, so the bytes take the data plane.
RECEIVER_SHARES = {"tcp-shared"}
#: How the receiver treats each object: ``deleted`` as a training loop that frees it (after warm-up
#: rounds), ``kept`` and ``out`` as users write a get (no warm-up, every object kept; ``out``: into a
#: preallocated array).
PATTERNS = ("deleted", "kept", "out")


def _receiver(address: str, token: str, path: str, pattern: str, conn: Any) -> None:
    if path.startswith("sim"):
        os.environ["HOPLITE_DEVICE_BACKEND"] = "sim"
    import hoplite_gpu as hg
    from hoplite_gpu.memory import to_host

    node = hg.connect(
        address,
        token=token,
        shared_memory=path not in WIRE or path in RECEIVER_SHARES,
        same_host_index=path != "sim-lookup",
        data_plane=WIRE.get(path, "auto"),
    )
    kept: list[tuple[Any, Any]] = []  # (ObjectID, array) of every object got, until the size is done
    out: np.ndarray | None = None
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            kind, hex_id, size = msg
            if kind == "drop":  # the size is done: let go of what was kept (untimed)
                for oid, _ in kept:
                    node.delete(oid)
                kept.clear()
                out = None
                conn.send("dropped")
                continue
            oid = hg.ObjectID.from_hex(hex_id)
            if pattern == "out" and out is None:  # allocated and touched once per size, before timing
                out = np.zeros(size // 8, np.int64)
                out.fill(1)
            c0 = cpu_seconds()
            t0 = time.perf_counter()
            arr = node.get(oid, timeout=120, out=out)
            dt = time.perf_counter() - t0
            cpu = cpu_seconds() - c0
            arr = to_host(arr).view(np.ndarray).reshape(-1)
            ok = bool(arr[-1] == arr.size - 1) if arr.size else True
            if pattern == "deleted":
                node.delete(oid)
            else:
                kept.append((oid, arr if pattern == "kept" else None))
            conn.send((dt, cpu, ok))
    finally:
        node.close()


def run(
    sizes: list[int], repeat: int, warmup: int = 3, path: str = "shm", pattern: str = "deleted"
) -> list[dict[str, Any]]:
    """Measure each size over ``path`` (one of :data:`PATHS`) with the receiver treating objects as
    ``pattern`` says (one of :data:`PATTERNS`; ``kept`` and ``out`` run no warm-up); one row per size."""
    import hoplite_gpu as hg
    from hoplite_gpu.memory import sim

    if pattern != "deleted":
        warmup = 0
    node = hg.init(shared_memory=path not in WIRE, data_plane=WIRE.get(path, "auto"))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(node.directory_address, node.token, path, pattern, child))
    proc.start()
    rows = []
    try:
        for size in sizes:
            times, cpus, sent = [], [], []
            for i in range(warmup + repeat):
                arr = np.arange(size // 8, dtype=np.int64)
                oid = node.put(sim.sim_array(arr) if path.startswith("sim") else arr)
                c0 = cpu_seconds()  # this process (the sender, the directory) over the receiver's get
                parent.send(("get", oid.hex(), size))
                if not parent.poll(180):
                    raise TimeoutError("receiver did not answer")
                dt, cpu, ok = parent.recv()
                cpu += cpu_seconds() - c0
                if not ok:
                    raise AssertionError("received data is wrong")
                if pattern == "deleted":
                    node.delete(oid)
                else:
                    sent.append(oid)
                if i >= warmup:
                    times.append(dt)
                    cpus.append(cpu)
            if sent:  # kept until every round of the size is done, then freed on both sides
                parent.send(("drop", "", 0))
                if not parent.poll(180) or parent.recv() != "dropped":
                    raise TimeoutError("receiver did not drop its objects")
                for oid in sent:
                    node.delete(oid)
            sock = socket_copy(size, repeat=repeat + 1)[1:]
            sock_times = [t for t, _ in sock]
            mem = memcpy_gbps(size)
            ours = (size / statistics.median(times) / 1e9, size / min(times) / 1e9)
            theirs = (size / statistics.median(sock_times) / 1e9, size / min(sock_times) / 1e9)
            our_cpu = cpu_per_gib(sum(cpus), size * len(cpus))
            sock_cpu = cpu_per_gib(sum(c for _, c in sock), size * len(sock))
            rows.append(
                {
                    "path": path,
                    "pattern": pattern,
                    "size": size,
                    "hoplite_seconds_median": statistics.median(times),
                    "hoplite_seconds_rounds": times,
                    "hoplite_gbps_median": ours[0],
                    "hoplite_gbps_best": ours[1],
                    "hoplite_gbps_mean": size * len(times) / sum(times) / 1e9,
                    "socket_gbps_median": theirs[0],
                    "socket_gbps_best": theirs[1],
                    "socket_gbps_mean": size * len(sock_times) / sum(sock_times) / 1e9,
                    "memcpy_gbps": mem,
                    "ratio_vs_socket_median": ours[0] / theirs[0],
                    "ratio_vs_socket_best": ours[1] / theirs[1],
                    "ratio_vs_memcpy": ours[0] / mem,
                    "hoplite_cpu_s_per_gib": our_cpu,
                    "hoplite_cpu_seconds_rounds": cpus,
                    "socket_cpu_s_per_gib": sock_cpu,
                    "cpu_ratio_vs_socket": our_cpu / sock_cpu,
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
    ap.add_argument(
        "--warmup", type=int, default=3, help="untimed gets per size before timing (pattern deleted)"
    )
    ap.add_argument("--paths", default="shm,tcp,ucx", help="comma-separated: " + ", ".join(PATHS))
    ap.add_argument("--patterns", default="deleted", help="comma-separated: " + ", ".join(PATTERNS))
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    patterns = [x.strip() for x in args.patterns.split(",") if x.strip()]
    if not paths or set(paths) - set(PATHS):
        ap.error(f"--paths takes some of {', '.join(PATHS)}")
    if not patterns or set(patterns) - set(PATTERNS):
        ap.error(f"--patterns takes some of {', '.join(PATTERNS)}")
    if set(patterns) - {"deleted"} and set(paths) - {"shm", *WIRE}:
        ap.error("--patterns kept and out run on the host paths only (shm, ucx)")
    rows = [
        r
        for path in paths
        for pattern in patterns
        for r in run(sizes, args.repeat, args.warmup, path, pattern)
    ]
    print(
        f"{'path':>10} {'pattern':>8} {'size':>8} {'hoplite GB/s':>16} {'socket GB/s':>16} {'x socket':>14} "
        f"{'memcpy GB/s':>12} {'x memcpy':>9} {'get ms':>7} {'CPU s/GiB':>14}"
    )
    print(
        f"{'':>10} {'':>8} {'':>8} {'median / best':>16} {'median / best':>16} {'median / best':>14}", end=""
    )
    print(f"{'':>31} {'ours / socket':>14}")
    for r in rows:
        print(
            f"{r['path']:>10} {r['pattern']:>8} {r['size'] / 2**20:>6.0f}Mi"
            f" {r['hoplite_gbps_median']:>7.2f} / {r['hoplite_gbps_best']:<6.2f}"
            f" {r['socket_gbps_median']:>7.2f} / {r['socket_gbps_best']:<6.2f}"
            f" {r['ratio_vs_socket_median']:>6.2f} / {r['ratio_vs_socket_best']:<5.2f}"
            f" {r['memcpy_gbps']:>12.2f} {r['ratio_vs_memcpy']:>9.2f}"
            f" {r['hoplite_seconds_median'] * 1e3:>7.3f}"
            f" {r['hoplite_cpu_s_per_gib']:>6.2f} / {r['socket_cpu_s_per_gib']:<5.2f}"
        )
    write_json(args.json, rows)
    return 0


__all__ = ["main", "run"]

if __name__ == "__main__":
    raise SystemExit(main())
