"""Collectives on an emulated cluster (:mod:`bench.cluster`): N hosts as network namespaces whose
links are shaped to a chosen bandwidth, hoplite_gpu beside the systems it replaces, against the
physical limit of those links.

Systems, each with one process per host talking only over the cluster's links:

* ``hoplite_gpu``: one directory on host 0, one node per host, UCX on TCP (``UCX_TLS=tcp``,
  ``HOPLITE_SHARED_MEMORY=0``: namespaces share ``/dev/shm``, and a real cluster has no shared
  memory between hosts; with ``--shared-memory`` each node keeps its shared memory, as on a real
  host, and a host tag per namespace, ``Config.host_tag``, keeps the others from mapping it);
* ``mpi``: Open MPI + mpi4py, ``--mca btl tcp,self`` (:mod:`bench.peers.mpi`);
* ``gloo``: ``torch.distributed`` with the gloo backend;
* ``ray``: a Ray node per host, object-store put/get as the Hoplite paper's Ray baseline
  (:mod:`bench.peers.ray_peer`).
* ``pyring`` (only when named in ``--systems``, allreduce only): not a peer but a bound for our
  direct ring, the same ring in Python on each member's calling thread over blocking sockets
  (:mod:`bench.peers.pyring`).

Each collective is timed from the last member entering it to the last leaving it (members pass a
barrier first; CLOCK_MONOTONIC is shared by every namespace of the machine), as in
:mod:`bench.collectives`; the median of ``--repeat`` rounds after ``--warmup`` is reported (with
the 99th percentile where there are at least 20 rounds: ``--small-repeat`` for the small sizes), and
every round's result is checked. For link bandwidth ``B`` and ``S`` bytes, the ideal
(:func:`ideal_seconds`) is:

* broadcast and reduce: ``S / B`` (each byte crosses the root's link once, pipelined);
* allreduce: ``2 (N-1)/N * S / B`` (the bandwidth-optimal bound);
* gather and allgather, where ``S`` is the gathered total (``S/N`` per member):
  ``(N-1)/N * S / B`` (what the root's, or every member's, download must carry).

A barrier is timed too, at the smallest size only: it moves no payload, so its rows have no ideal
and no CPU per byte (Ray's peer has no barrier and skips it).

The link bandwidth is also measured in each run (one TCP stream between two hosts) and shown.

The links are shaped with ``tc tbf``, whose bucket lets 10 ms of bytes through at once and refills
at the link's rate: a system whose rounds follow each other more quickly starts each with less of
it. ``--idle`` makes hoplite_gpu's and Gloo's members wait that long before each round's barrier,
so both start every round with a full bucket.

CPU per byte (``cpu_seconds``, ``cpu_s_per_gib``): user + system CPU seconds of a timed round,
summed over the run's processes, per GiB of ``S``; the mean of the timed rounds. Each member counts
its own from its start of the collective until a barrier after it has returned, so that what a
member serves after it returned counts (a hoplite_gpu broadcast's root returns once its object is
put); the barrier before the round and the checks after it are left out, the one after it is in.
hoplite_gpu's member 0 adds the directory process's over the same window; for Open MPI the ranks
(``mpirun`` and its daemons carry no data); for Ray every process in the cluster's namespaces (its
nodes, workers and driver), from the driver's start of the round to its report of the round's end.
Needs root and iproute2; the peers need ``make bench-cluster``'s installs.

    python bench/netbench.py --hosts 4,8 --rate 100MB --sizes 1KiB,1MiB,64MiB --repeat 3 \
        --json bench/results/netbench.json --plots bench/results
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cluster import Cluster, ClusterUnavailable, link_throughput
from bench.collectives import IDLE_VAR, check_result, idle_before_round, round_counts, round_cpu, round_times
from bench.common import (
    CPU_PIDS_VAR,
    cpu_per_gib,
    cpu_pids_from_env,
    cpu_seconds,
    format_size,
    markdown_table,
    parse_rate,
    parse_size,
    round_counters,
    round_counters_since,
)

#: ``barrier`` runs at the smallest size only (its size is not used), where the peer has one.
OPS = ("broadcast", "reduce", "allreduce", "gather", "allgather", "barrier")
DIRECTORY_PORT = 7070
GLOO_PORT = 29500
SYSTEMS = ("hoplite_gpu", "mpi", "gloo", "ray", "pyring")
#: What runs unless ``--systems`` says otherwise: ``pyring`` is a bound for our ring
#: (:mod:`bench.peers.pyring`, allreduce only), not a peer.
DEFAULT_SYSTEMS = ("hoplite_gpu", "mpi", "gloo", "ray")
#: Peers run by a module of bench/peers (``run(cluster, sizes, ops, repeat, warmup) -> rows``).
PEER_MODULES = {"mpi": "bench.peers.mpi", "ray": "bench.peers.ray_peer"}
#: Sizes below this are "small": more rounds (latency-bound, noisy, cheap).
SMALL_BYTES = 4 << 20
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


def _gloo_member(
    master: str,
    rank: int,
    world: int,
    conn: Any,
    port: int = GLOO_PORT,
    ring: Callable[..., Any] | None = None,
) -> None:
    """The same protocol as :func:`bench.collectives._member`, with ``torch.distributed``'s gloo;
    with ``ring``, allreduce is ``ring(dist, rank, world)(array)`` instead (``pyring``)."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    allreduce = None if ring is None else ring(dist, rank, world)
    conn.send("ready")
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            op, size, rounds = msg
            t = torch.empty(size // 4, dtype=torch.float32)
            piece = torch.full((size // 4 // world,), rank + 1.0)  # gather: size is the total
            outs = [torch.empty_like(piece) for _ in range(world)]
            spans = []
            for _ in range(rounds):
                t.fill_(rank + 1)
                idle_before_round()
                dist.barrier()
                cpu, counted = cpu_seconds(), round_counters()
                start = time.monotonic()
                if op == "broadcast":
                    dist.broadcast(t, src=0)
                elif op == "reduce":
                    dist.reduce(t, dst=0)
                elif op == "allreduce" and allreduce is not None:
                    allreduce(t.numpy())
                elif op == "allreduce":
                    dist.all_reduce(t)
                elif op == "gather":
                    dist.gather(piece, outs if rank == 0 else None, dst=0)
                elif op == "allgather":
                    dist.all_gather(outs, piece)
                elif op == "barrier":
                    dist.barrier()
                else:
                    raise ValueError(op)
                end = time.monotonic()
                dist.barrier()  # CPU until every member has left the op, as the other systems
                spans.append((start, end, cpu_seconds() - cpu, round_counters_since(counted)))
                check_result(op, rank, world, t.numpy(), [o.numpy() for o in outs])
            conn.send(spans)
    finally:
        dist.destroy_process_group()


def _member_main(system: str, address: str, rank: int, world: int) -> None:
    if system == "hoplite_gpu":
        from bench.collectives import _member

        _member(address, os.environ["HOPLITE_TOKEN"], rank, world, False, _Stdio(), cpu_pids_from_env())
    elif system == "gloo":
        _gloo_member(address, rank, world, _Stdio())
    elif system == "pyring":  # a bound for our ring, not a peer (allreduce only)
        from bench.peers.pyring import STORE_PORT, ring

        _gloo_member(address, rank, world, _Stdio(), STORE_PORT, ring)
    else:
        raise ValueError(system)


class Member:
    """A hoplite process on one host of the cluster, driven over its stdin/stdout."""

    def __init__(
        self, cluster: Cluster, system: str, rank: int, address: str, token: str, cpu_pids: Sequence[int] = ()
    ) -> None:
        env = {**HOST_ENV, "HOPLITE_LISTEN_HOST": cluster.address(rank), "HOPLITE_TOKEN": token}
        env["HOPLITE_HOST_TAG"] = f"host{rank}"  # (with --shared-memory: each namespace its own host)
        env[CPU_PIDS_VAR] = ",".join(str(p) for p in cpu_pids)  # other processes it counts the CPU of
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
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"member {self.proc.pid} exited (code {self.proc.poll()})")
            try:
                return json.loads(line)
            except ValueError:  # a library's log line on stdout (ucxx's C++ warnings go there)
                sys.stderr.write(f"member {self.proc.pid}: {line}")

    def ask_to_stop(self) -> None:
        """Tell the member to leave (its group's ``destroy`` is a barrier: tell every member
        before waiting for any, or each waits for the next to be told, until it is killed)."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.send(None)

    def stop(self) -> None:
        self.ask_to_stop()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def stop_all(members: Sequence[Member]) -> None:
    """Stop every member: all are told first (see :meth:`Member.ask_to_stop`)."""
    for m in members:
        m.ask_to_stop()
    for m in members:
        m.stop()


def ideal_seconds(op: str, size: int, hosts: int, rate: float) -> float:
    """The physical limit of ``op`` on ``size`` bytes over links of ``rate`` bytes/s (see the module
    docstring): every byte crosses the busiest link's direction once (broadcast, reduce), or
    ``(N-1)/N`` of the data does (gather, allgather: ``size`` is the gathered total), or twice that
    (allreduce); 0 for a barrier, which moves no payload (its rows have no ratio)."""
    share = (hosts - 1) / hosts
    factor = {
        "broadcast": 1.0,
        "reduce": 1.0,
        "allreduce": 2 * share,
        "gather": share,
        "allgather": share,
        "barrier": 0.0,
    }
    return factor[op] * size / rate


def run(
    hosts: int,
    rate: float,
    sizes: list[int],
    repeat: int,
    warmup: int,
    systems: Sequence[str],
    ops: Sequence[str] = OPS,
    small_rounds: tuple[int, int] = (20, 5),
    prefix: str = "hgb",
) -> dict[str, Any]:
    """Every op at every size, for every system, on one cluster; rows with the median time and its
    ratio to the ideal. Sizes under :data:`SMALL_BYTES` run ``small_rounds`` (repeat, warm-up)
    rounds instead: they are cheap, and their median needs more samples."""
    rows: list[dict[str, Any]] = []
    with Cluster(hosts, rate, prefix=prefix) as cluster:
        measured = link_throughput(cluster)
        note = f"N={hosts} link: {measured / 1e6:.1f} MB/s measured ({rate / 1e6:.0f} MB/s set)"
        print(note, file=sys.stderr, flush=True)
        for system in systems:
            started = time.monotonic()
            found = []
            small = [s for s in sizes if s < SMALL_BYTES]
            large = [s for s in sizes if s >= SMALL_BYTES]
            first = min(sizes)
            for group, (reps, warm) in ((small, small_rounds), (large, (repeat, warmup))):
                if not group:
                    continue
                for these in ([s for s in group if s == first], [s for s in group if s != first]):
                    chosen = [o for o in ops if o != "barrier" or first in these]
                    if system == "pyring":
                        chosen = [o for o in chosen if o == "allreduce"]
                    if not these or not chosen:
                        continue
                    if system in PEER_MODULES:
                        peer = importlib.import_module(PEER_MODULES[system])
                        mine = [o for o in chosen if o in peer.OPS]  # Ray's peer has no barrier
                        found += peer.run(cluster, these, mine, reps, warm) if mine else []
                    else:
                        found += _run_system(cluster, system, these, reps, warm, chosen)
            for row in found:
                ideal = ideal_seconds(row["op"], row["size"], hosts, rate)
                row.update(
                    hosts=hosts, ideal_seconds=ideal, x_ideal=row["seconds"] / ideal if ideal else None
                )
                if "cpu_seconds" in row and row["op"] != "barrier":
                    row["cpu_s_per_gib"] = cpu_per_gib(row["cpu_seconds"], row["size"])
            rows += found
            print(f"N={hosts} {system}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return {"hosts": hosts, "rate_bytes": rate, "link_measured_bytes": measured, "rows": rows}


#: Fewest timed rounds of a size for which its 99th percentile is reported (``p99_seconds``).
P99_MIN_ROUNDS = 20


def _run_system(
    cluster: Cluster, system: str, sizes: list[int], repeat: int, warmup: int, ops: Sequence[str]
) -> list[dict[str, Any]]:
    from hoplite_gpu.auth import new_token
    from hoplite_gpu.directory import DirectoryProcess

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
        # Member 0 counts the directory's CPU over its rounds with its own (the directory is on its host).
        extra = [directory.proc.pid] if directory is not None and directory.proc is not None else []
        members = [
            Member(cluster, system, r, address, token, extra if r == 0 else ()) for r in range(cluster.hosts)
        ]
        for m in members:
            if m.recv() != "ready":
                raise RuntimeError(f"a {system} member did not start")
        for size in sizes:
            for op in ops:
                print(f"N={cluster.hosts} {system} {op} {format_size(size)} ...", file=sys.stderr, flush=True)
                for m in members:
                    m.send([op, size, warmup + repeat])
                spans = [m.recv() for m in members]
                every = round_times(spans, 0, warmup + repeat)
                times = sorted(every[warmup:])
                cpu = statistics.mean(round_cpu(spans, warmup, repeat))
                row = {"system": system, "op": op, "size": size, "seconds": statistics.median(times)}
                # The first round of a fresh group on fresh arrays, as a user's first call meets it.
                row.update(first_seconds=every[0], rounds=every[warmup:])
                # What may make a round slower than the others: the shaped links' retransmissions
                # (a timeout stalls a flow for 200 ms), page faults, garbage collections.
                row["rounds_counted"] = round_counts(spans, warmup, repeat)
                timed = range(warmup, warmup + repeat)
                row["rounds_faults_by_member"] = [[s[i][3]["MinorFaults"] for s in spans] for i in timed]
                if repeat >= P99_MIN_ROUNDS:  # (of fewer rounds, the 99th percentile is the slowest)
                    row["p99_seconds"] = times[min(len(times) - 1, int(0.99 * len(times)))]
                rows.append({**row, "cpu_seconds": cpu})
    finally:
        stop_all(members)
        if directory is not None:
            directory.stop()
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: one row per (N, op, size), each system's median seconds and its ratio to
    the ideal, then each system's CPU seconds per GiB of payload."""
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    ideals = {(r["hosts"], OPS.index(r["op"]), r["size"]): r["ideal_seconds"] for r in rows}
    by_key = {(r["hosts"], OPS.index(r["op"]), r["size"], r["system"]): r for r in rows}
    columns = [("N", "r"), ("op", "l"), ("size", "r"), ("ideal s", "r")]
    columns += [(f"{s} s (x ideal)", "r") for s in systems]
    columns += [(f"{s} CPU s/GiB", "r") for s in systems]
    tails = [s for s in systems if any("p99_seconds" in r for r in rows if r["system"] == s)]
    columns += [(f"{s} p99 s (x median)", "r") for s in tails]
    cells = []
    for (hosts, op, size), ideal in sorted(ideals.items()):
        line = [str(hosts), OPS[op], format_size(size), f"{ideal:.3g}" if ideal else "-"]
        for system in systems:
            r = by_key.get((hosts, op, size, system))
            ratio = f" ({r['x_ideal']:.3g})" if r is not None and r["x_ideal"] is not None else ""
            line.append("-" if r is None else f"{r['seconds']:.3g}{ratio}")
        for system in systems:
            r = by_key.get((hosts, op, size, system))
            line.append("-" if r is None or "cpu_s_per_gib" not in r else f"{r['cpu_s_per_gib']:.3g}")
        for system in tails:
            r = by_key.get((hosts, op, size, system))
            tail = None if r is None else r.get("p99_seconds")
            line.append("-" if tail is None else f"{tail:.3g} ({tail / r['seconds']:.2g})")
        cells.append(line)
    return markdown_table(columns, cells)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--member"]:
        _member_main(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="4", help="comma-separated host counts (2-8), one cluster each")
    ap.add_argument("--rate", default="100MB", help="link bandwidth per direction (bytes/s: 100MB, 1GB)")
    ap.add_argument("--sizes", default="1KiB,1MiB,16MiB,64MiB,256MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--small-repeat", type=int, default=20, help="timed rounds of sizes under 4 MiB")
    ap.add_argument("--small-warmup", type=int, default=5, help="untimed rounds of sizes under 4 MiB")
    ap.add_argument(
        "--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated: {', '.join(SYSTEMS)}"
    )
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated: {', '.join(OPS)}")
    ap.add_argument("--prefix", default="hgb", help="namespace prefix of the emulated cluster")
    ap.add_argument(
        "--shared-memory",
        action="store_true",
        help="hoplite nodes keep shared memory (Config.shared_memory, on by default on real hosts), "
        "each namespace tagged as its own host",
    )
    ap.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="seconds hoplite_gpu's and Gloo's members wait before each round's barrier, so the links' "
        "token buckets (tc tbf passes 10 ms of bytes at once) are full when every round starts, "
        "whichever system's barrier is quicker",
    )
    ap.add_argument("--json", help="also write the results to this file (and the table beside it, .md)")
    ap.add_argument("--plots", help="also draw one PNG per (N, op) into this directory (bench/plot.py)")
    args = ap.parse_args(argv)
    if args.shared_memory:
        HOST_ENV["HOPLITE_SHARED_MEMORY"] = "1"
    HOST_ENV[IDLE_VAR] = str(args.idle)
    rate = parse_rate(args.rate)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    systems, ops = args.systems.split(","), args.ops.split(",")
    unknown = [x for x in systems if x not in SYSTEMS] + [x for x in ops if x not in OPS]
    if unknown:
        ap.error(f"unknown system or op: {', '.join(unknown)}")
    started = time.monotonic()
    runs = []
    try:
        for hosts in [int(h) for h in args.hosts.split(",")]:
            small = (args.small_repeat, args.small_warmup)
            runs.append(run(hosts, rate, sizes, args.repeat, args.warmup, systems, ops, small, args.prefix))
    except ClusterUnavailable as exc:
        print(f"cannot build the emulated cluster: {exc}", file=sys.stderr)
        return 2
    rows = [r for result in runs for r in result["rows"]]
    table = format_table(rows)
    print(table)
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    result = {"rate_bytes": rate, "runs": runs, "rows": rows, "seconds": time.monotonic() - started}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
        with open(os.path.splitext(args.json)[0] + ".md", "w") as fh:
            fh.write(table + "\n")
    if args.plots:
        from bench.plot import plot

        for path in plot(result, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
