"""What a process pays to write fresh memory, by the kind of pages it gets: NumPy's arrays (which
ask the kernel for huge pages, ``madvise(MADV_HUGEPAGE)``) against anonymous pages mapped without
that request (:func:`hoplite_gpu.memory.buffers.private_pages`, 4 KiB pages where the kernel's
THP policy is ``madvise``).

Each trial allocates ``--count`` arrays of ``--size`` bytes and writes one byte per 4 KiB page of
each (the cost of a first write, as a receive into a new buffer pays it), then frees them; the two
kinds alternate, each trial either right after the previous one or after ``--idle`` seconds
doing nothing. With each time it prints what ``/proc/vmstat`` counted meanwhile: huge pages
faulted in, faults that fell back to small pages, and compaction stalls. The kernel's free page
reporting order is shown where it has one (a VM whose balloon device hands free blocks of that
order back to its host, which must then back them again when they are next written).

    python bench/fresh_memory.py --size 64MiB --count 4 --trials 2 --idle 6
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parse_size
from hoplite_gpu.memory.buffers import private_pages

COUNTERS = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall")
REPORTING_ORDER = "/sys/module/page_reporting/parameters/page_reporting_order"


def vmstat() -> dict[str, int]:
    """The :data:`COUNTERS` of ``/proc/vmstat`` now (0 where the kernel lacks one)."""
    found: dict[str, int] = {}
    with open("/proc/vmstat") as f:
        for line in f:
            name, _, value = line.partition(" ")
            found[name] = int(value)
    return {name: found.get(name, 0) for name in COUNTERS}


def reporting_order() -> int | None:
    """The order of the free blocks the kernel reports to its hypervisor (None: none here)."""
    try:
        with open(REPORTING_ORDER) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


KINDS: dict[str, Callable[[int], Any]] = {
    "numpy": lambda n: np.empty(n, np.uint8),
    "private_pages": private_pages,
}


def trial(kind: str, size: int, count: int) -> tuple[float, dict[str, int]]:
    """Milliseconds to allocate ``count`` arrays of ``kind`` and write each page once, and the
    vmstat counters' growth meanwhile."""
    before = vmstat()
    start = time.perf_counter()
    arrays = [KINDS[kind](size) for _ in range(count)]
    for a in arrays:
        a[::4096] = 1
    ms = (time.perf_counter() - start) * 1e3
    after = vmstat()
    del arrays
    return ms, {name: after[name] - before[name] for name in COUNTERS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="64MiB")
    ap.add_argument("--count", type=int, default=4)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--idle", type=float, default=6.0, help="seconds idle before an idle trial")
    ap.add_argument("--json", default="", help="also write the results to this file")
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    rows = []
    print(f"free page reporting order: {reporting_order()}")
    print(f"| when | pages | ms, {args.count} x {args.size} | huge faults | fallbacks | compaction stalls |")
    print("|---|---|---:|---:|---:|---:|")
    for _ in range(args.trials):
        for when, gap in (("right after", 0.0), (f"after {args.idle:g} s idle", args.idle)):
            for kind in KINDS:
                time.sleep(gap)
                ms, grew = trial(kind, size, args.count)
                rows.append({"when": when, "kind": kind, "size": size, "count": args.count, "ms": ms, **grew})
                print(
                    f"| {when} | {kind} | {ms:.1f} | {grew['thp_fault_alloc']} | "
                    f"{grew['thp_fault_fallback']} | {grew['compact_stall']} |"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"reporting_order": reporting_order(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
