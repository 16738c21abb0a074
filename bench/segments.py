"""What new shared memory costs: ways to fill a new ``/dev/shm`` segment, and ``put`` as users call it.

A node that shares (``Config.shared_memory``, the default) keeps every large object in a segment
of its own under ``/dev/shm``, so a put of a fresh object, a reduce's output and a pull from another
host each fill new shared memory unless the pool has a removed object's buffer of the same size.
Part one times the kernel's ways to fill a new segment of ``--size`` bytes with a copy of an array,
each ``--repeat`` times, against a ``memcpy`` into memory already mapped:

* ``populate + copy``: ``posix_fallocate``, ``mmap(MAP_POPULATE)``, then a copy through the
  mapping (what :func:`hoplite_gpu.memory.shm.create` did for every segment before);
* ``fault + copy``: ``posix_fallocate``, ``mmap`` without populating, the copy faulting each page;
* ``pwrite``: ``posix_fallocate``, then ``pwrite`` of the bytes into the file, the mapping left
  unpopulated (what a put, a reduce's output and a TCP pull do now: :meth:`Segment.write_file
  <hoplite_gpu.memory.shm.Segment.write_file>`).

Part two: ``put`` of a fresh ``--size`` array, kept (no pool reuse), ``--repeat`` times on one node
with shared memory on, median wall time and CPU per put::

    python bench/segments.py --size 64MiB --repeat 9 --json bench/results/segments.json
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import cpu_seconds, parse_size, write_json


def _populate_copy(fd: int, src: np.ndarray[Any, Any]) -> None:
    os.posix_fallocate(fd, 0, src.nbytes)
    m = mmap.mmap(fd, src.nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    np.frombuffer(m, np.uint8)[:] = src


def _fault_copy(fd: int, src: np.ndarray[Any, Any]) -> None:
    os.posix_fallocate(fd, 0, src.nbytes)
    m = mmap.mmap(fd, src.nbytes, flags=mmap.MAP_SHARED)
    np.frombuffer(m, np.uint8)[:] = src


def _pwrite(fd: int, src: np.ndarray[Any, Any]) -> None:
    os.posix_fallocate(fd, 0, src.nbytes)
    view, pos = src.data, 0
    while pos < src.nbytes:
        pos += os.pwrite(fd, view[pos:], pos)
    mmap.mmap(fd, src.nbytes, flags=mmap.MAP_SHARED)


WAYS: dict[str, Callable[[int, np.ndarray[Any, Any]], None]] = {
    "populate + copy": _populate_copy,
    "fault + copy": _fault_copy,
    "pwrite": _pwrite,
}


def fill_ways(size: int, repeat: int) -> list[dict[str, Any]]:
    """Median seconds of each way to fill a new segment of ``size`` bytes, and of a memcpy."""
    src = (np.arange(size, dtype=np.uint64) % 251).astype(np.uint8)
    warm = np.empty_like(src)
    warm.fill(0)
    rows = []
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(warm, src)
        times.append(time.perf_counter() - t0)
    memcpy = statistics.median(times)
    rows.append(dict(way="memcpy into mapped memory", size=size, seconds=memcpy, x_memcpy=1.0))
    for name, way in WAYS.items():
        times = []
        for i in range(repeat):
            path = f"/dev/shm/hoplite-bench-{os.getpid()}-{i}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                t0 = time.perf_counter()
                way(fd, src)
                times.append(time.perf_counter() - t0)
            finally:
                os.close(fd)
                os.unlink(path)
        median = statistics.median(times)
        rows.append(dict(way=name, size=size, seconds=median, x_memcpy=median / memcpy))
    return rows


def fresh_puts(size: int, repeat: int) -> dict[str, Any]:
    """Median wall seconds and mean CPU seconds of a put of a fresh array that is kept."""
    import hoplite_gpu as hg

    node = hg.init(shared_memory=True)
    try:
        data = np.arange(size // 8, dtype=np.int64)
        kept, times = [], []
        c0 = cpu_seconds()
        for _ in range(repeat):
            t0 = time.perf_counter()
            kept.append(node.put(data))
            times.append(time.perf_counter() - t0)
        cpu = (cpu_seconds() - c0) / repeat
    finally:
        node.close()
    return dict(size=size, put_seconds=statistics.median(times), cpu_seconds=cpu)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="64MiB")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    size = parse_size(args.size)
    ways = fill_ways(size, args.repeat)
    print(f"| way to fill a new {args.size} segment | median ms | x memcpy |\n|---|---:|---:|")
    for r in ways:
        print(f"| {r['way']} | {1e3 * r['seconds']:.1f} | {r['x_memcpy']:.1f} |")
    puts = fresh_puts(size, args.repeat)
    wall, cpu = 1e3 * puts["put_seconds"], 1e3 * puts["cpu_seconds"]
    print(f"\nput of a fresh {args.size} array, kept, shared memory on: {wall:.1f} ms, {cpu:.1f} ms CPU")
    write_json(args.json, dict(fill=ways, put=puts, command=" ".join(sys.argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
