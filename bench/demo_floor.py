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
* ``private`` (with ``--private``): the floor of another schedule, not built: each worker copies
  its array into new private memory (NumPy's, huge pages), and worker 0 reads the others'
  with ``process_vm_readv``, a step at a time into scratch memory, summing as the floor does;
* ``ideal``: the demo's, the best of three warm copies over a plain TCP socket.

A schedule that keeps every put in new shared memory cannot go below the floor on this machine.
Each trial is timed from the last put starting to the result mapped here; the table gives the
medians and the first trial, every result checked.

    python bench/demo_floor.py --sizes 64MiB,256MiB --trials 5 --json bench/results/demo_floor.json
"""

from __future__ import annotations

import argparse
import ctypes
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
from hoplite_gpu.demo import _answers, _reduce, _start_workers, pattern, sum_of

STEP = 1 << 20
POOL_VAR = "HOPLITE_BUFFER_POOL_BYTES"


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.process_vm_readv.restype = ctypes.c_ssize_t


def _read_remote(pid: int, address: int, into: np.ndarray[Any, Any]) -> None:
    """``into.nbytes`` bytes of process ``pid``'s memory at ``address``, into ``into``."""
    local = _IOVec(into.ctypes.data, into.nbytes)
    remote = _IOVec(address, into.nbytes)
    got = _LIBC.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got != into.nbytes:
        raise OSError(ctypes.get_errno(), f"process_vm_readv read {got} of {into.nbytes} bytes")


def reads_others() -> bool:
    """Whether processes of this user may read each other's memory with ``process_vm_readv``, as
    the private floor's worker 0 reads its siblings': the call works here, and Yama, where the
    kernel has it, lets any process of the user do it (``ptrace_scope`` 0)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            if f.read().strip() != "0":
                return False
    except FileNotFoundError:
        pass
    data = np.arange(16, dtype=np.int64)
    into = np.zeros(16, np.int64)
    try:
        _read_remote(os.getpid(), data.ctypes.data, into)
    except OSError:
        return False
    return bool(np.array_equal(into, data))


def _new_file(path: str, data: np.ndarray[Any, Any]) -> None:
    """``data`` into a new file at ``path``, space reserved first, written through the file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(data.nbytes, 1))
        view = memoryview(data.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        while view:
            view = view[os.pwrite(fd, view, data.nbytes - len(view)) :]
    finally:
        os.close(fd)


def _mapped(path: str) -> tuple[mmap.mmap, np.ndarray[Any, Any]]:
    """``path`` mapped whole, read only, its pages mapped now, as int64."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    return mm, np.frombuffer(mm, np.int64)


def _sum_into_file(
    path: str, inputs: list[np.ndarray[Any, Any]], threads: int, remote: tuple[tuple[int, int], ...] = ()
) -> None:
    """The sum of ``inputs`` and of the int64 arrays at ``remote`` (pid, address; as many bytes)
    into a new file: each step summed in scratch memory and written through the file (one
    writer at a time), the steps split among ``threads`` threads."""
    nbytes = inputs[0].nbytes
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    lock = threading.Lock()

    def part(lo: int, hi: int) -> None:
        scratch = np.empty(STEP // 8, np.int64)
        landed = np.empty(STEP // 8, np.int64)
        for pos in range(lo, hi, STEP):
            end = min(pos + STEP, hi)
            out = scratch[: (end - pos) // 8]
            a, b = pos // 8, end // 8
            np.copyto(out, inputs[0][a:b])
            for other in inputs[1:]:
                np.add(out, other[a:b], out=out)
            for pid, address in remote:
                piece = landed[: b - a]
                _read_remote(pid, address + pos, piece)
                np.add(out, piece, out=out)
            with lock:
                os.pwrite(fd, memoryview(out.view(np.uint8)), pos)  # type: ignore[arg-type]

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
        size, seeds, prefix, private = msg
        data = pattern(size, seeds[rank])
        barrier.wait()
        start = time.monotonic()
        if private:
            kept = data.copy()  # the put, into new private memory
            with open(f"{prefix}-at-{rank}", "w") as f:
                f.write(f"{os.getpid()} {kept.ctypes.data}")
        else:
            _new_file(f"{prefix}-{rank}", data)
        del data
        barrier.wait()  # every put is in
        if rank == 0 and private:
            remote = []
            for r in range(1, world):
                with open(f"{prefix}-at-{r}") as f:
                    pid, address = f.read().split()
                remote.append((int(pid), int(address)))
            _sum_into_file(f"{prefix}-sum", [kept], threads, tuple(remote))
        elif rank == 0:
            maps = [_mapped(f"{prefix}-{r}") for r in range(world)]
            _sum_into_file(f"{prefix}-sum", [arr for _, arr in maps], threads)
            del maps
        if private:
            barrier.wait()  # worker 0 has read every array
            del kept
        conn.send((start, start, True))  # as the demo's workers answer (demo._answers)


def _floor_trial(
    pipes: list[Any], size: int, seeds: list[int], trial: int, private: bool = False
) -> tuple[float, bool]:
    """One first round of the floor (``private``: of the schedule not built): (last put started
    to the result mapped here, exact)."""
    prefix = f"/dev/shm/demo-floor-{os.getpid()}-{trial}"
    try:
        for pipe in pipes:
            pipe.send((size, seeds, prefix, private))
        answers = _answers(pipes[:1])  # worker 0 answers once the sum is written
        mm, arr = _mapped(f"{prefix}-sum")
        done = time.monotonic()
        exact = bool(np.array_equal(arr, sum_of(size, seeds)))
        del arr
        mm.close()
        answers += _answers(pipes[1:])
        return done - max(start for start, _, _ in answers), exact
    finally:
        names = [f"{r}" for r in range(len(pipes))] + [f"at-{r}" for r in range(len(pipes))] + ["sum"]
        for path in (f"{prefix}-{name}" for name in names):
            if os.path.exists(path):
                os.unlink(path)


def run(
    workers: int, sizes: list[int], trials: int, threads: int, private: bool = False
) -> list[dict[str, Any]]:
    """Per size: the ideal, then ``trials`` alternated rounds of ours, the floor and (with
    ``private``) the floor of private puts."""
    import multiprocessing as mp

    import hoplite_gpu as hg

    before = os.environ.get(POOL_VAR)
    os.environ[POOL_VAR] = "0"  # every round of ours a first round (read as the nodes start)
    node = hg.init()
    barrier = mp.get_context("spawn").Barrier(workers)
    ours_pipes: list[Any] = []
    ours_procs: list[Any] = []
    floor_pipes: list[Any] = []
    floor_procs: list[Any] = []
    rows = []
    try:
        try:
            ours_pipes, ours_procs = _start_workers(node, workers)
        finally:
            if before is None:
                del os.environ[POOL_VAR]
            else:
                os.environ[POOL_VAR] = before
        floor_pipes, floor_procs = start_workers(
            _floor_worker, [(barrier, r, workers, threads) for r in range(workers)], timeout=60
        )
        _reduce(node, ours_pipes, 1 << 20, everyone=True)  # the demo's warm-up opens connections
        for size in sizes:
            ideal = size / (socket_copy_gbps(size, repeat=3) * 1e9)
            seeds = list(range(100, 100 + workers))
            ours, floor, kept = [], [], []
            for trial in range(trials):
                ours.append(_reduce(node, ours_pipes, size, everyone=False))
                floor.append(_floor_trial(floor_pipes, size, seeds, trial))
                if private:
                    kept.append(_floor_trial(floor_pipes, size, seeds, trial, private=True))
            rows.append(
                dict(
                    size=size,
                    workers=workers,
                    threads=threads,
                    ideal_seconds=ideal,
                    ours_seconds=[s for s, _ in ours],
                    floor_seconds=[s for s, _ in floor],
                    private_seconds=[s for s, _ in kept],
                    verified=all(ok for _, ok in ours + floor + kept),
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
        ("private puts' floor ms (x ideal)", "r"),
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
                _cell(r["private_seconds"], ideal),
                "yes" if r["verified"] else "NO",
            ]
        )
    return markdown_table(columns, table)


def _cell(seconds: list[float], ideal: float) -> str:
    if not seconds:
        return "-"
    median = statistics.median(seconds)
    return f"{1e3 * median:.1f} ({median / ideal:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--sizes", default="64MiB,256MiB")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="the floor's summing threads")
    parser.add_argument("--private", action="store_true", help="also the floor of private puts")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows = run(args.workers, sizes, args.trials, args.threads, args.private)
    write_json(args.json, {"command": " ".join(sys.argv), "rows": rows})


if __name__ == "__main__":
    main()
