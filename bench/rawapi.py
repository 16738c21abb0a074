"""The plain object-store API as users of a task system call it, on the emulated cluster.

Not a tuned collective harness: every round uses fresh ObjectIDs, there is no warm-up round, the
nodes are not told their own address (they find it from the route to the directory), and the
timer covers what a user waits for.

* ``broadcast``: hosts 1..N-1 are already waiting in ``get`` (the root sees their lookups in the
  directory's event log) when host 0 calls ``put``; timed from the start of the put until the last
  ``get`` returned. Ideal: ``S / B``.
* ``reduce``: host 0 calls ``reduce`` over N fresh ids and waits in ``get`` of the result; then
  every host ``put``\\ s its array at once; timed from the first put's start until the root's
  ``get`` returned. Ideal: ``S / B`` (the root's link carries the reduced bytes once).

CLOCK_MONOTONIC is shared by every namespace of the machine, so times from different hosts
compare. Each round's result is checked. Needs root and iproute2.

CPU per byte (``cpu_seconds``, ``cpu_s_per_gib``): user + system CPU seconds of a round, summed
over the hosts' processes and the directory's, per GiB of ``S``; the mean of the rounds. Each host
counts its own from the start of its part (its ``put``, or a receiver's ``get``) until the round is
over (asked after the last ``get`` returned, so a relay's serving counts); host 0 adds the directory
process's over its own window.

    python bench/rawapi.py --hosts 4 --rate 100MB,1GB --sizes 64MiB --repeat 5 \\
        --json bench/results/rawapi.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cluster import Cluster, link_throughput
from bench.common import (
    CPU_PIDS_VAR,
    cluster_options,
    cpu_per_gib,
    cpu_pids_from_env,
    cpu_seconds,
    format_size,
    markdown_table,
    parse_rate,
    parse_size,
    write_json,
)
from bench.netbench import Member

DIRECTORY_PORT = 7072
#: Every process on the cluster: TCP only, no shared memory between "hosts", no address given.
HOST_ENV = {"UCX_TLS": "tcp", "HOPLITE_SHARED_MEMORY": "0"}
PATTERNS = ("broadcast", "reduce")


def _member(address: str, rank: int) -> None:
    """One host's process: JSON commands on stdin, JSON answers on stdout."""
    import numpy as np

    import hoplite_gpu as hg

    def send(obj: Any) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    node = hg.connect(address, token=os.environ["HOPLITE_TOKEN"])
    others = cpu_pids_from_env()  # the directory's pid on host 0: counted with this process's CPU
    window = cpu_seconds(others)  # CPU so far at the start of this host's part of the round
    send(["ready", node.data_address])
    try:
        for line in sys.stdin:
            cmd, arg, size = json.loads(line)
            if cmd == "cpu":  # the round is over: CPU seconds since this host's part started
                send(cpu_seconds(others) - window)
            elif cmd == "get":  # broadcast receiver: announce, then wait in get
                send("waiting")
                window = cpu_seconds(others)
                arr = node.get(hg.ObjectID.from_hex(arg), timeout=300)
                end = time.monotonic()
                send([end, bool(arr[-1] == size // 4 - 1)])
            elif cmd == "put_after_lookups":  # broadcast root
                oid = hg.ObjectID.from_hex(arg)
                arr = np.arange(size // 4, dtype=np.float32)
                # The receivers' lookups may reach the directory before this command does: read the
                # whole log once, then only what is new (the id is fresh each round).
                since, lookups = 0, set()
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # poll with a deadline for the receivers' lookups
                    events = node.event_log(since)
                    since = events[-1]["seq"] + 1 if events else since
                    lookups |= {e["node"] for e in events if e["kind"] == "lookup" and e["object_id"] == arg}
                    if len(lookups) >= int(os.environ["HOSTS"]) - 1:
                        break
                    time.sleep(0.002)
                else:
                    raise TimeoutError("the receivers' lookups did not reach the directory within 60 s")
                window = cpu_seconds(others)
                start = time.monotonic()
                node.put(arr, oid)
                send(start)
            elif cmd == "reduce_get":  # reduce root: request, put its own input, wait for the result
                ids = [hg.ObjectID.from_hex(h) for h in arg]
                rid = node.reduce(ids, hg.ReduceOp.SUM)
                send("waiting")
                _, mine, _ = json.loads(sys.stdin.readline())  # the "put" of its own input
                arr = np.full(size // 4, rank + 1.0, dtype=np.float32)
                window = cpu_seconds(others)
                start = time.monotonic()
                node.put(arr, hg.ObjectID.from_hex(mine))
                send(start)
                out = node.get(rid, timeout=300)
                end = time.monotonic()
                hosts = len(ids)
                send([end, bool(out[-1] == hosts * (hosts + 1) / 2)])
                node.delete(rid)
            elif cmd == "put":  # a reduce input
                arr = np.full(size // 4, rank + 1.0, dtype=np.float32)
                window = cpu_seconds(others)
                start = time.monotonic()
                node.put(arr, hg.ObjectID.from_hex(arg))
                send(start)
            elif cmd == "delete":
                node.delete(hg.ObjectID.from_hex(arg))
                send("deleted")
    finally:
        node.close()


class _Host(Member):
    """A host's process, driven over its stdin/stdout like a netbench member."""

    def __init__(self, cluster: Cluster, rank: int, address: str, token: str, cpu_pids: list[int]) -> None:
        env = {**HOST_ENV, "HOPLITE_TOKEN": token, "HOSTS": str(cluster.hosts)}
        env[CPU_PIDS_VAR] = ",".join(str(p) for p in cpu_pids)
        argv = [sys.executable, os.path.abspath(__file__), "--member", address, str(rank)]
        self.proc = cluster.popen(
            rank, argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )


def _round_cpu(hosts: list[_Host]) -> float:
    """CPU seconds of the round just over, summed over the hosts (see the module docstring)."""
    for h in hosts:
        h.send(["cpu", "", 0])
    return float(sum(h.recv() for h in hosts))


def _broadcast_round(hosts: list[_Host], size: int) -> tuple[float, float]:
    from hoplite_gpu import ObjectID

    oid = ObjectID.random().hex()
    for h in hosts[1:]:
        h.send(["get", oid, size])
    for h in hosts[1:]:
        assert h.recv() == "waiting"
    hosts[0].send(["put_after_lookups", oid, size])
    start = hosts[0].recv()
    ends = [h.recv() for h in hosts[1:]]
    if not all(ok for _, ok in ends):
        raise AssertionError("a receiver got wrong data")
    cpu = _round_cpu(hosts)
    hosts[0].send(["delete", oid, 0])
    assert hosts[0].recv() == "deleted"
    return max(end for end, _ in ends) - start, cpu


def _reduce_round(hosts: list[_Host], size: int) -> tuple[float, float]:
    from hoplite_gpu import ObjectID

    ids = [ObjectID.random().hex() for _ in hosts]
    hosts[0].send(["reduce_get", ids, size])
    assert hosts[0].recv() == "waiting"
    for h, oid in zip(hosts, ids, strict=True):
        h.send(["put", oid, size])
    starts = [h.recv() for h in hosts]
    end, ok = hosts[0].recv()
    if not ok:
        raise AssertionError("the reduction is wrong")
    cpu = _round_cpu(hosts)
    for h, oid in zip(hosts, ids, strict=True):
        h.send(["delete", oid, 0])
    for h in hosts:
        assert h.recv() == "deleted"
    return float(end - min(starts)), cpu


def run(hosts: int, rate: float, sizes: list[int], repeat: int, prefix: str = "hgr") -> list[dict[str, Any]]:
    """Every pattern at every size on one cluster; the median of ``repeat`` rounds (no warm-up)."""
    from hoplite_gpu.auth import new_token
    from hoplite_gpu.directory import DirectoryProcess

    rows = []
    with Cluster(hosts, rate, prefix=prefix) as cluster:
        measured = link_throughput(cluster)
        print(f"N={hosts} link: {measured / 1e6:.1f} MB/s measured ({rate / 1e6:.0f} set)", file=sys.stderr)
        token = new_token()
        directory = DirectoryProcess(
            token, host=cluster.address(0), port=DIRECTORY_PORT, env=HOST_ENV, wrap=cluster.command(0, [])
        )
        directory.start()
        members: list[_Host] = []
        try:
            assert directory.proc is not None
            members = [
                _Host(cluster, r, directory.address, token, [directory.proc.pid] if r == 0 else [])
                for r in range(hosts)
            ]
            for r, m in enumerate(members):
                ready, data_address = m.recv()
                if ready != "ready" or not data_address.startswith(cluster.address(r) + ":"):
                    raise RuntimeError(f"host {r} advertises {data_address}")
            for size in sizes:
                for pattern in PATTERNS:
                    step = _broadcast_round if pattern == "broadcast" else _reduce_round
                    rounds = [step(members, size) for _ in range(repeat)]
                    times, cpus = [t for t, _ in rounds], [c for _, c in rounds]
                    ideal = size / rate
                    rows.append(
                        {
                            "pattern": pattern,
                            "hosts": hosts,
                            "rate_bytes": rate,
                            "link_measured_bytes": measured,
                            "size": size,
                            "seconds": statistics.median(times),
                            "rounds": times,
                            "ideal_seconds": ideal,
                            "x_ideal": statistics.median(times) / ideal,
                            "cpu_seconds": statistics.mean(cpus),
                            "cpu_rounds": cpus,
                            "cpu_s_per_gib": cpu_per_gib(statistics.mean(cpus), size),
                        }
                    )
                    print(
                        f"{pattern} {format_size(size)} @ {rate / 1e6:.0f} MB/s: "
                        f"{rows[-1]['seconds']:.3f} s, {rows[-1]['x_ideal']:.2f}x ideal, "
                        f"{rows[-1]['cpu_s_per_gib']:.2f} CPU s/GiB "
                        f"(rounds {', '.join(f'{t:.3f}' for t in times)})",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            for m in members:
                if m.proc.stdin is not None:
                    m.proc.stdin.close()
                try:
                    m.proc.wait(30)
                except subprocess.TimeoutExpired:
                    m.proc.kill()
            directory.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--member"]:
        _member(argv[1], int(argv[2]))
        return 0
    ap = cluster_options(__doc__ or "", prefix="hgr", hosts=4)
    ap.set_defaults(rate="100MB,1GB")
    ap.add_argument("--sizes", default="64MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    for key in ("HOPLITE_LISTEN_HOST", "HOPLITE_ADVERTISE_HOST"):  # nodes find their address
        os.environ.pop(key, None)
    rows = []
    for rate in args.rate.split(","):
        rows += run(args.hosts, parse_rate(rate), sizes, args.repeat, args.prefix)
    table = [
        [
            r["pattern"],
            str(r["hosts"]),
            f"{r['rate_bytes'] / 1e6:.0f} MB/s",
            format_size(r["size"]),
            f"{r['seconds']:.3f}",
            f"{r['ideal_seconds']:.3f}",
            f"{r['x_ideal']:.2f}x",
            f"{r['cpu_s_per_gib']:.2f}",
        ]
        for r in rows
    ]
    columns = [("pattern", "l"), ("N", "r"), ("link", "r"), ("size", "r"), ("seconds", "r")]
    print(markdown_table([*columns, ("ideal", "r"), ("x ideal", "r"), ("CPU s/GiB", "r")], table))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
