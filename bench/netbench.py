"""Collectives on an emulated cluster (:mod:`bench.cluster`): N hosts as network namespaces whose
links are shaped to a chosen bandwidth, against the physical limit of those links.

One directory runs on host 0 and one hoplite_gpu process on every host, all over UCX on TCP
(``UCX_TLS=tcp``, ``HOPLITE_SHARED_MEMORY=0``: namespaces share ``/dev/shm``, and a real cluster
has no shared memory between hosts). Members time each collective as in
:mod:`bench.collectives` (from the last member entering to the last leaving, CLOCK_MONOTONIC is
shared by every namespace of the machine). The ideal of each operation, for link bandwidth ``B``
and ``S`` bytes:

* broadcast and reduce: ``S / B`` (each byte crosses the root's link once, pipelined);
* allreduce: ``2 (N-1)/N * S / B`` (the bandwidth-optimal bound).

The link bandwidth is also measured in the same run (one TCP stream between two hosts) and shown.
Needs root (``sudo``) and iproute2.

    python bench/netbench.py --hosts 4 --rate 100MB --sizes 1KiB,1MiB,64MiB --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cluster import Cluster, ClusterUnavailable, link_throughput
from bench.collectives import round_times
from bench.common import format_size, markdown_table, parse_size

OPS = ("broadcast", "reduce", "allreduce")
DIRECTORY_PORT = 7070
GLOO_PORT = 29500
SYSTEMS = ("hoplite_gpu", "gloo")
#: Every hoplite process on the cluster: TCP only, no shared memory between "hosts".
HOST_ENV = {"UCX_TLS": "tcp", "HOPLITE_SHARED_MEMORY": "0", "GLOO_SOCKET_IFNAME": "eth0"}


class _Stdio:
    """The pipe interface :func:`bench.collectives._member` expects, over JSON lines on stdio
    (a member in another network namespace is a child of ``ip netns exec``)."""

    def send(self, obj: Any) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    def recv(self) -> Any:
        line = sys.stdin.readline()
        return json.loads(line) if line else None


def _gloo_member(master: str, rank: int, world: int, conn: Any) -> None:
    """The same protocol as :func:`bench.collectives._member`, with ``torch.distributed``'s gloo."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{GLOO_PORT}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    conn.send("ready")
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            op, size, rounds = msg
            t = torch.ones(size // 4, dtype=torch.float32)
            spans = []
            for _ in range(rounds):
                dist.barrier()
                start = time.monotonic()
                if op == "broadcast":
                    dist.broadcast(t, src=0)
                elif op == "reduce":
                    dist.reduce(t, dst=0)
                elif op == "allreduce":
                    dist.all_reduce(t)
                else:
                    raise ValueError(op)
                spans.append((start, time.monotonic()))
                t.fill_(1)
            conn.send(spans)
    finally:
        dist.destroy_process_group()


def _member_main(system: str, address: str, rank: int, world: int) -> None:
    if system == "hoplite_gpu":
        from bench.collectives import _member

        _member(address, os.environ["HOPLITE_TOKEN"], rank, world, False, _Stdio())
    elif system == "gloo":
        _gloo_member(address, rank, world, _Stdio())
    else:
        raise ValueError(system)


class Member:
    """A hoplite process on one host of the cluster, driven over its stdin/stdout."""

    def __init__(self, cluster: Cluster, system: str, rank: int, address: str, token: str) -> None:
        env = {**HOST_ENV, "HOPLITE_LISTEN_HOST": cluster.address(rank), "HOPLITE_TOKEN": token}
        argv = [sys.executable, os.path.abspath(__file__), "--member", system, address]
        argv += [str(rank), str(cluster.hosts)]
        self.proc = cluster.popen(
            rank, argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"member {self.proc.pid} exited (code {self.proc.poll()})")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(None)
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def run(
    hosts: int,
    rate: float,
    sizes: list[int],
    repeat: int,
    warmup: int,
    systems: list[str],
    ops: Sequence[str] = OPS,
) -> dict[str, Any]:
    """Every op at every size, for every system, on one cluster; rows with the median time and its
    ratio to the ideal."""
    rows: list[dict[str, Any]] = []
    with Cluster(hosts, rate) as cluster:
        measured = link_throughput(cluster)
        print(f"link: {measured / 1e6:.1f} MB/s measured ({rate / 1e6:.0f} MB/s set)", file=sys.stderr)
        for system in systems:
            rows += _run_system(cluster, system, sizes, repeat, warmup, ops)
    return {"hosts": hosts, "rate_bytes": rate, "link_measured_bytes": measured, "rows": rows}


def _run_system(
    cluster: Cluster, system: str, sizes: list[int], repeat: int, warmup: int, ops: Sequence[str]
) -> list[dict[str, Any]]:
    from hoplite_gpu.auth import new_token
    from hoplite_gpu.directory import DirectoryProcess

    hosts, rate = cluster.hosts, cluster.rate_bytes
    rows: list[dict[str, Any]] = []
    token = new_token()
    directory: DirectoryProcess | None = None
    address = cluster.address(0)
    if system == "hoplite_gpu":
        directory = DirectoryProcess(
            token, host=address, port=DIRECTORY_PORT, env=HOST_ENV, wrap=cluster.command(0, [])
        )
        directory.start()
        address = directory.address
    members: list[Member] = []
    try:
        members = [Member(cluster, system, r, address, token) for r in range(hosts)]
        for m in members:
            if m.recv() != "ready":
                raise RuntimeError(f"a {system} member did not start")
        for size in sizes:
            print(f"{system} {format_size(size)} ...", file=sys.stderr, flush=True)
            ideal = {"broadcast": size / rate, "reduce": size / rate}
            ideal["allreduce"] = 2 * (hosts - 1) / hosts * size / rate
            for op in ops:
                for m in members:
                    m.send([op, size, warmup + repeat])
                spans = [m.recv() for m in members]
                seconds = statistics.median(round_times(spans, warmup, repeat))
                rows.append(
                    {
                        "system": system,
                        "op": op,
                        "hosts": hosts,
                        "size": size,
                        "seconds": seconds,
                        "ideal_seconds": ideal[op],
                        "x_ideal": seconds / ideal[op],
                    }
                )
    finally:
        for m in members:
            m.stop()
        if directory is not None:
            directory.stop()
    return rows


def format_table(result: dict[str, Any]) -> str:
    """Markdown table of a run."""
    columns = [("system", "l"), ("op", "l"), ("N", "r"), ("size", "r"), ("median s", "r")]
    columns += [("ideal s", "r"), ("x ideal", "r")]
    cells = [
        [
            r["system"],
            r["op"],
            str(r["hosts"]),
            format_size(r["size"]),
            f"{r['seconds']:.4f}",
            f"{r['ideal_seconds']:.4f}",
            f"{r['x_ideal']:.2f}",
        ]
        for r in result["rows"]
    ]
    return markdown_table(columns, cells)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--member"]:
        _member_main(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", default="100MB", help="link bandwidth per direction (bytes/s: 100MB, 1GB)")
    ap.add_argument("--sizes", default="1KiB,1MiB,16MiB,64MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated: {', '.join(SYSTEMS)}")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated: {', '.join(OPS)}")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    rate = float(args.rate.upper().replace("GB", "e9").replace("MB", "e6"))
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    started = time.monotonic()
    try:
        result = run(
            args.hosts, rate, sizes, args.repeat, args.warmup, args.systems.split(","), args.ops.split(",")
        )
    except ClusterUnavailable as exc:
        print(f"cannot build the emulated cluster: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
