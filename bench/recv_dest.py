"""The receiver's CPU per byte of a TCP stream, by where the bytes land: consecutive chunks of a
large destination (what a pull into an object's buffer does), or one small buffer used again for
every chunk (what a receiver that consumes each chunk at once, as Gloo's ring reduce does, can do).

A thread sends ``--size`` bytes over loopback TCP; the receiver lands them ``--chunk`` bytes at a
time with ``recv_into(..., MSG_WAITALL)``, as the TCP data plane does, and its thread's CPU time
is measured. The large destination is written once before, so no page is faulted in during the
receive: what differs is only whether the kernel's copy writes to memory already in the cache.
Each way runs ``--repeat`` times, alternated; the table gives the median CPU time and the bytes
received per CPU second.

    python bench/recv_dest.py --size 256MiB --chunk 1MiB --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parse_size

WAYS = ("large", "reused")


def receive_cpu(size: int, chunk: int, way: str) -> float:
    """CPU seconds of the receiving thread for ``size`` bytes landed the ``way`` given."""
    src = np.ones(size, np.uint8)
    dest = np.ones(size if way == "large" else chunk, np.uint8)  # written: its pages exist
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(memoryview(src))

        sender = threading.Thread(target=send)
        sender.start()
        conn, _ = listener.accept()
        with conn:
            start, pos = time.thread_time(), 0
            while pos < size:
                n = min(chunk, size - pos)
                view = memoryview(dest)[pos : pos + n] if way == "large" else memoryview(dest)[:n]
                got = conn.recv_into(view, n, socket.MSG_WAITALL)
                if got <= 0:
                    raise RuntimeError("the sender closed early")
                pos += got
            cpu = time.thread_time() - start
        sender.join()
    return cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--chunk", default="1MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default="", help="also write the results to this file")
    args = ap.parse_args(argv)
    size, chunk = parse_size(args.size), parse_size(args.chunk)
    cpu: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.repeat):
        for way in WAYS:
            cpu[way].append(receive_cpu(size, chunk, way))
    rows = [
        {
            "way": way,
            "size": size,
            "chunk": chunk,
            "cpu_s": statistics.median(cpu[way]),
            "gb_per_cpu_s": size / statistics.median(cpu[way]) / 1e9,
            "runs": cpu[way],
        }
        for way in WAYS
    ]
    print(f"{args.size} over loopback TCP in {args.chunk} receives, median of {args.repeat}")
    print("| destination | receiver CPU (ms) | GB per CPU second |")
    print("|---|---:|---:|")
    for r in rows:
        print(f"| {r['way']} | {r['cpu_s'] * 1e3:.1f} | {r['gb_per_cpu_s']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
