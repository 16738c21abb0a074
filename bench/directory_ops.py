"""The directory's throughput on small operations, and its latency at that load (issue 42).

A standalone directory (its own process, ``hoplite-gpu directory``, pinned to one core where the
machine has more) serves ``--clients`` processes (pinned to the other cores). Each is a raw
authenticated connection that sends ``--window`` operations at a time, back to back, and reads
their replies: an operation is a put of ``--size`` bytes (inline in the directory: small objects
are), a lookup of it and its delete, three requests, each counted as one directory operation.
Every reply is checked (an ``ErrorReply`` stops the run).

The table gives the requests answered per second of the run, the directory's CPU seconds over the
same window (``/proc/<pid>/stat``), and from the two the requests one core serves in a second of
its CPU (the capacity that the target of 25,000 a second is about); the latency of each request
(from its batch's send to its reply) is its median and 99th percentile at that load.

    python bench/directory_ops.py --clients 4 --window 16 --seconds 10 --json bench/results/directory_ops.json
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import process_cpu, write_json
from bench.directory_load import joined, read_frame, standalone_directory
from hoplite_gpu import protocol as p

#: The requests of one operation.
REQUESTS_PER_OP = 3


def _client(address: str, token: str, index: int, window: int, size: int, cpus: set[int], conn: Any) -> None:
    """A client process: operations ``window`` at a time until told to stop; sends back its
    requests answered and their latencies (seconds)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    sock = joined(address, token, f"client-{index}", 9000 + index)
    sock.settimeout(60)
    ids = itertools.count(1)
    objects = itertools.count(index << 64)
    payload = bytes(size)
    latencies: list[float] = []
    conn.send("ready")
    conn.recv()  # go
    while not conn.poll():
        frames = []
        for _ in range(window):
            oid = next(objects).to_bytes(20, "big")
            frames.append(p.encode(p.PutRequest(next(ids), oid, size, "|u1", [size], b"", payload)))
            frames.append(p.encode(p.LookupRequest(next(ids), oid, 0.0)))
            frames.append(p.encode(p.DeleteRequest(next(ids), oid)))
        sent = time.perf_counter()
        sock.sendall(b"".join(frames))
        answered = 0
        while answered < len(frames):
            msg = read_frame(sock)
            if isinstance(msg, p.ErrorReply):
                raise RuntimeError(f"the directory refused a request: {msg.message}")
            if getattr(msg, "request_id", None) is not None:
                answered += 1
                latencies.append(time.perf_counter() - sent)
    conn.send(latencies)
    sock.close()


def run(clients: int, window: int, size: int, seconds: float) -> dict[str, Any]:
    """One run: the row of the table (see the module's docstring)."""
    cpus = sorted(os.sched_getaffinity(0))
    directory_cpu, client_cpus = ({cpus[0]}, set(cpus[1:])) if len(cpus) > 1 else (set(), set())
    ctx = multiprocessing.get_context("spawn")
    with standalone_directory({}) as (address, token, pid):
        if directory_cpu:
            os.sched_setaffinity(pid, directory_cpu)
        pipes, procs = [], []
        for i in range(clients):
            here, there = ctx.Pipe()
            proc = ctx.Process(
                target=_client, args=(address, token, i, window, size, client_cpus, there), daemon=True
            )
            proc.start()
            pipes.append(here)
            procs.append(proc)
        try:
            for pipe in pipes:
                if not pipe.poll(60):
                    raise TimeoutError("a client did not start")
                pipe.recv()
            cpu0, t0 = process_cpu([pid])[pid], time.monotonic()
            for pipe in pipes:
                pipe.send("go")
            time.sleep(seconds)  # the measured window: the clients run meanwhile
            for pipe in pipes:
                pipe.send("stop")
            latencies: list[float] = []
            for pipe in pipes:
                if not pipe.poll(60):
                    raise TimeoutError("a client did not finish")
                latencies += pipe.recv()
            cpu, wall = process_cpu([pid])[pid] - cpu0, time.monotonic() - t0
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
    latencies.sort()
    n = len(latencies)
    return {
        "clients": clients,
        "window": window,
        "size": size,
        "seconds": round(wall, 2),
        "requests": n,
        "requests_per_s": round(n / wall),
        "directory_cpu_s": round(cpu, 2),
        "directory_busy": round(cpu / wall, 2),
        "per_cpu_second": round(n / cpu) if cpu > 0 else None,
        "median_us": round(latencies[n // 2] * 1e6) if n else None,
        "p99_us": round(latencies[max(0, int(n * 0.99) - 1)] * 1e6) if n else None,
        "directory_pinned": bool(directory_cpu),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="4", help="comma-separated: one run each")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = [run(int(c), args.window, args.size, args.seconds) for c in args.clients.split(",")]
    print(
        "| clients | in flight | requests/s | directory busy | requests per directory CPU second "
        "| median / p99 latency (us) |\n|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        print(
            f"| {r['clients']} | {r['clients'] * r['window'] * REQUESTS_PER_OP} | {r['requests_per_s']} "
            f"| {r['directory_busy']:.0%} | {r['per_cpu_second']} | {r['median_us']} / {r['p99_us']} |"
        )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
