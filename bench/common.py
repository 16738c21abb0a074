"""Shared helpers of the benchmarks (partly re-exported from :mod:`hoplite_gpu.baselines`), and the
CPU cost per byte that every benchmark reports beside its times.

CPU per byte: each process of a run measures its own CPU time (user + system, every thread) over
the measured window (:func:`cpu_seconds`, with other processes it samples from ``/proc`` when a
process of the run, such as a directory, has no window of its own); the benchmark sums them over
the run's processes and divides by the GiB of payload (:func:`cpu_per_gib`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import time
from collections.abc import Iterable

from hoplite_gpu.baselines import (
    format_size,
    markdown_table,
    memcpy_gbps,
    parse_size,
    socket_copy,
    socket_copy_gbps,
    socket_copy_times,
    start_workers,
    stop_workers,
)

GiB = 1 << 30
#: Environment variable naming other processes (comma-separated pids) whose CPU a benchmark process
#: adds to its own over its window: processes of the run with no window of their own.
CPU_PIDS_VAR = "BENCH_CPU_PIDS"
_TICK = os.sysconf("SC_CLK_TCK")

__all__ = [
    "CPU_PIDS_VAR",
    "GiB",
    "cluster_arguments",
    "cluster_options",
    "cpu_per_gib",
    "cpu_pids_from_env",
    "cpu_seconds",
    "cpu_since",
    "format_size",
    "markdown_table",
    "memcpy_gbps",
    "parse_rate",
    "parse_size",
    "process_cpu",
    "round_counters",
    "round_counters_since",
    "socket_copy",
    "socket_copy_gbps",
    "socket_copy_times",
    "start_workers",
    "stop_workers",
    "tcp_counters",
    "write_json",
]

#: TCP counters of this network namespace that :func:`tcp_counters` reads: segments sent again,
#: retransmission timeouts (each stalls a flow for at least the 200 ms minimum RTO), tail-loss
#: probes and fast retransmits: what a shaped link's drops cost a round.
TCP_COUNTERS = ("RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPFastRetrans")


def process_cpu(pids: Iterable[int]) -> dict[int, float]:
    """User + system CPU seconds so far of other processes, every thread, by pid
    (``/proc/<pid>/stat``, in clock ticks: 10 ms resolution); a process gone meanwhile is left out."""
    found = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        found[pid] = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15 of proc(5))
    return found


def cpu_since(before: dict[int, float], now: dict[int, float]) -> float:
    """CPU seconds the processes of ``now`` used since ``before`` (two :func:`process_cpu` readings):
    a process started in between counts in full, one gone in between is left out."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in now.items())


def cpu_seconds(also: Iterable[int] = ()) -> float:
    """This process's CPU seconds so far, user + system over all its threads (nanosecond resolution,
    where :func:`os.times` counts clock ticks), plus those of the processes ``also``
    (:func:`process_cpu`). The difference of two readings is the CPU used in between."""
    return time.process_time() + sum(process_cpu(also).values())


def tcp_counters() -> dict[str, int]:
    """This network namespace's :data:`TCP_COUNTERS` so far (from ``/proc/net/snmp`` and
    ``/proc/net/netstat``; 0 where the kernel lacks one)."""
    found: dict[str, int] = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        with open(path) as f:
            lines = f.read().splitlines()
        for names, values in zip(lines[::2], lines[1::2], strict=False):
            found.update(zip(names.split()[1:], map(int, values.split()[1:]), strict=False))
    return {name: found.get(name, 0) for name in TCP_COUNTERS}


def round_counters() -> dict[str, int]:
    """What can make one round of a run slower than the others, counted so far: this namespace's
    :func:`tcp_counters`, this process's page faults (every thread; new memory costs about 2.4 ms
    of system time per MiB on these VMs) and its garbage collections (all, and of the oldest
    generation, which walks every object)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    stats = gc.get_stats()
    return {
        **tcp_counters(),
        "MinorFaults": usage.ru_minflt,
        "MajorFaults": usage.ru_majflt,
        "GcCollections": sum(s["collections"] for s in stats),
        "GcOldest": stats[-1]["collections"],
    }


def round_counters_since(before: dict[str, int]) -> dict[str, int]:
    """:func:`round_counters` now less ``before``."""
    return {name: value - before.get(name, 0) for name, value in round_counters().items()}


def cpu_pids_from_env() -> list[int]:
    """The pids in :data:`CPU_PIDS_VAR` (none if unset)."""
    return [int(p) for p in os.environ.get(CPU_PIDS_VAR, "").split(",") if p.strip()]


def cpu_per_gib(cpu: float, nbytes: float) -> float:
    """CPU seconds per GiB: ``cpu`` seconds spent on ``nbytes`` bytes of payload."""
    return cpu / (nbytes / GiB) if nbytes else float("nan")


def parse_rate(text: str) -> float:
    """A link rate in bytes/s from ``"100MB"``, ``"1GB"`` or a plain number."""
    return float(text.upper().replace("GB", "e9").replace("MB", "e6"))


def cluster_options(
    description: str, prefix: str, hosts: int, hosts_help: str | None = None
) -> argparse.ArgumentParser:
    """A parser with the emulated cluster's options: ``--hosts``, ``--rate`` and ``--prefix``."""
    formatter = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(description=description, formatter_class=formatter)
    ap.add_argument("--hosts", type=int, default=hosts, help=hosts_help)
    ap.add_argument("--rate", default="100MB", help="link bandwidth per direction (bytes/s: 100MB, 1GB)")
    ap.add_argument("--prefix", default=prefix, help="namespace prefix of the emulated cluster")
    return ap


def cluster_arguments(description: str, sizes: str, prefix: str) -> argparse.ArgumentParser:
    """The command-line options shared by the emulated-cluster benchmarks run on their own."""
    ap = cluster_options(description, prefix, hosts=4)
    ap.add_argument("--sizes", default=sizes)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    return ap


def write_json(path: str | None, data: object) -> None:
    """Write a benchmark's record to ``path`` as JSON (nothing when ``path`` is empty: no
    ``--json`` was given)."""
    if path:
        with open(path, "w") as fh:
            json.dump(data, fh, indent=2)
