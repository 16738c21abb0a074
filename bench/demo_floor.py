"""`make demo`'s reduce beside the floor of its memory work, in one run (one host).

The demo reports its reduce (every worker puts a fresh array, this process gets their sum) as a
multiple of one warm socket copy of the array. Every such round is a first round: each put fills
new shared memory, and so does the reduction's result. This bench runs, alternated for each size:

* ``ours``: the demo's reduce itself (:func:`hoplite_gpu.demo._reduce`), with the workers' buffer
  pools off (``HOPLITE_BUFFER_POOL_BYTES=0``) so that every trial is a first round, as the demo's is;
* ``floor``: that round's memory work alone, in the same shape and with no control: each worker
  writes its array into a new ``/dev/shm`` file (through the file, the cheapest way into new
  shared pages, as a put into a new segment does), then worker 0 maps the four files and sums them
  into a new result file (scratch memory written through the file, on ``--threads`` threads, as the
  star's root does), and this process maps the result. Barriers separate the phases;
* ``ideal``: the demo's, the best of three warm copies over a plain TCP socket.

A schedule that keeps every put in new shared memory cannot go below the floor on this machine.
Each trial is timed from the last put starting to the result mapped here; the table gives the
medians and the first trial, every result checked.

    python bench/demo_floor.py --sizes 64MiB,256MiB --trials 5 --json bench/results/demo_floor.json
"""

from __future__ import annotations

import argparse
import itertools
import mmap
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import format_size, markdown_table, parse_size, socket_copy_gbps, write_json
from hoplite_gpu.baselines import start_workers, stop_workers
from hoplite_gpu.demo import _reduce, _start_workers, pattern, sum_of

STEP = 1 << 20


def _new_file(path: str, data: np.ndarray[Any, Any]) -> None:
    """``data`` into a new file at ``path``, space reserved first, written through the file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(data.nbytes, 1))
        view = memoryview(data.reshape(-1).view(np.uint8))
        while view:
            view = view[os.pwrite(fd, view, data.nbytes - len(view)) :]
    finally:
        os.close(fd)


def _mapped(path: str) -> tuple[mmap.mmap, np.ndarray[Any, Any]]:
    """``path`` mapped whole, read only, its pages mapped now, as int64."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    return mm, np.frombuffer(mm, np.int64)


def _sum_into_file(path: str, inputs: list[np.ndarray[Any, Any]], threads: int) -> None:
    """The sum of ``inputs`` into a new file: each step summed in scratch memory and written
    through the file (one writer at a time), the steps split among ``threads`` threads."""
    nbytes = inputs[0].nbytes
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    lock = threading.Lock()

    def part(lo: int, hi: int) -> None:
        scratch = np.empty(STEP // 8, np.int64)
        for pos in range(lo, hi, STEP):
            end = min(pos + STEP, hi)
            out = scratch[: (end - pos) // 8]
            a, b = pos // 8, end // 8
            np.add(inputs[0][a:b], inputs[1][a:b], out=out)
            for other in inputs[2:]:
                np.add(out, other[a:b], out=out)
            with lock:
                os.pwrite(fd, out.view(np.uint8), pos)

    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
        steps = -(-nbytes // STEP)
        per = -(-steps // threads)
        cuts = [min(nbytes, i * per * STEP) for i in range(threads + 1)]
        with ThreadPoolExecutor(threads) as pool:
            for done in [pool.submit(part, lo, hi) for lo, hi in itertools.pairwise(cuts) if lo < hi]:
                done.result()
    finally:
        os.close(fd)


def _floor_worker(barrier: Any, rank: int, world: int, threads: int, conn: Any) -> None:
    """A worker of the floor: for each ``(size, seeds, prefix)``, its put, and on worker 0 the sum."""
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        size, seeds, prefix = msg
        data = pattern(size, seeds[rank])
        barrier.wait()
        start = time.monotonic()
        _new_file(f"{prefix}-{rank}", data)
        del data
        barrier.wait()  # every put is in
        if rank == 0:
            maps = [_mapped(f"{prefix}-{r}") for r in range(world)]
            _sum_into_file(f"{prefix}-sum", [arr for _, arr in maps], threads)
            del maps
        conn.send(start)


def _floor_trial(pipes: list[Any], size: int, seeds: list[int], trial: int) -> tuple[float, bool]:
    """One first round of the floor: (last put started to the result mapped here, exact)."""
    prefix = f"/dev/shm/demo-floor-{os.getpid()}-{trial}"
    try:
        for pipe in pipes:
            pipe.send((size, seeds, prefix))
        if not pipes[0].poll(180):
            raise RuntimeError("the floor's worker 0 did not answer within 180 s")
        starts = [pipes[0].recv()]
        mm, arr = _mapped(f"{prefix}-sum")
        done = time.monotonic()
        exact = bool(np.array_equal(arr, sum_of(size, seeds)))
        del arr
        mm.close()
        starts += [pipe.recv() for pipe in pipes[1:]]
        return done - max(starts), exact
    finally:
        for path in [f"{prefix}-{r}" for r in range(len(pipes))] + [f"{prefix}-sum"]:
            if os.path.exists(path):
                os.unlink(path)


def run(workers: int, sizes: list[int], trials: int, threads: int) -> list[dict[str, Any]]:
    """Per size: the ideal, then ``trials`` alternated rounds of ours and of the floor."""
    import multiprocessing as mp

    import hoplite_gpu as hg

    os.environ["HOPLITE_BUFFER_POOL_BYTES"] = "0"  # the workers' every round a first round
    node = hg.init()
    barrier = mp.get_context("spawn").Barrier(workers)
    ours_pipes, ours_procs = _start_workers(node, workers)
    floor_pipes, floor_procs = start_workers(
        _floor_worker, [(barrier, r, workers, threads) for r in range(workers)], timeout=60
    )
    rows = []
    try:
        _reduce(node, ours_pipes, 1 << 20, everyone=True)  # the demo's warm-up opens connections
        for size in sizes:
            ideal = size / (socket_copy_gbps(size, repeat=3) * 1e9)
            seeds = list(range(100, 100 + workers))
            ours, floor = [], []
            for trial in range(trials):
                ours.append(_reduce(node, ours_pipes, size, everyone=False))
                floor.append(_floor_trial(floor_pipes, size, seeds, trial))
            rows.append(
                dict(
                    size=size,
                    workers=workers,
                    threads=threads,
                    ideal_seconds=ideal,
                    ours_seconds=[s for s, _ in ours],
                    floor_seconds=[s for s, _ in floor],
                    verified=all(ok for _, ok in ours + floor),
                )
            )
            print(_table(rows[-1:]), flush=True)
    finally:
        stop_workers(ours_pipes, ours_procs)
        stop_workers(floor_pipes, floor_procs)
        node.close()
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    columns = [
        ("size", "r"),
        ("ideal ms", "r"),
        ("ours ms (x ideal)", "r"),
        ("floor ms (x ideal)", "r"),
        ("ours x floor", "r"),
        ("first trial: ours / floor ms", "r"),
        ("verified", "c"),
    ]
    table = []
    for r in rows:
        ideal = r["ideal_seconds"]
        ours, floor = statistics.median(r["ours_seconds"]), statistics.median(r["floor_seconds"])
        table.append(
            [
                format_size(r["size"]),
                f"{1e3 * ideal:.1f}",
                f"{1e3 * ours:.1f} ({ours / ideal:.2f})",
                f"{1e3 * floor:.1f} ({floor / ideal:.2f})",
                f"{ours / floor:.2f}",
                f"{1e3 * r['ours_seconds'][0]:.1f} / {1e3 * r['floor_seconds'][0]:.1f}",
                "yes" if r["verified"] else "NO",
            ]
        )
    return markdown_table(columns, table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--sizes", default="64MiB,256MiB")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="the floor's summing threads")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = run(args.workers, [parse_size(s) for s in args.sizes.split(",")], args.trials, args.threads)
    write_json(args.json, {"command": " ".join(sys.argv), "rows": rows})


if __name__ == "__main__":
    main()
