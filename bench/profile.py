"""Where the time of one collective goes on the emulated cluster: a timeline from the directory's
event log (puts, reduce placements, every transfer's start and end), relative to the timed round.

Runs ``--warmup`` untimed rounds and one timed round of one op with hoplite_gpu on a
:class:`bench.cluster.Cluster`, like :mod:`bench.netbench`, then prints each event of the timed
round with its time in milliseconds from the last member entering it. Objects are named after the
group's ObjectIDs (``allreduce-shard 2/3`` is rank 3's shard 2; ``v1(...)`` is vertex 1 of a
reduction) and nodes after the rank whose inputs they put.

    python bench/profile.py --hosts 4 --rate 100MB --op allreduce --size 64MiB

``--before broadcast`` runs ``--before-rounds`` rounds of another op in the same processes first
(at 1 GB/s a reduce after broadcasts has been slower than one without).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cluster import Cluster, ClusterUnavailable
from bench.common import parse_rate, parse_size
from bench.netbench import DIRECTORY_PORT, HOST_ENV, OPS, Member, ideal_seconds, stop_all

#: Event kinds shown in the timeline.
SHOWN = ("put", "reduce", "reduce_place", "transfer_start", "transfer_done", "vertex_done", "reduce_done")


def _labels(name: str, hosts: int, last_seq: int) -> dict[str, str]:
    """Readable names of the group's object ids (and their reductions' vertices)."""
    from hoplite_gpu.directory.reduce import vertex_object_id
    from hoplite_gpu.object_id import ObjectID

    labels: dict[str, str] = {}

    def add(label: str, seq: int, kind: str, *parts: int) -> None:
        tail = "/".join(str(x) for x in parts)
        oid = ObjectID.from_name(f"hoplite-group/{name}/{seq}/{kind}/{tail}").binary()
        labels[oid.hex()] = label
        if "result" in kind:
            for v in range(1, hosts):
                labels[vertex_object_id(oid, v).hex()] = f"v{v}({label})"

    for seq in range(max(0, last_seq - 4), last_seq + 2):
        for r in range(hosts):
            for kind in ("allreduce", "reduce", "gather", "allgather"):
                add(f"{kind} {r}", seq, kind, r)
            add(f"shard-result {r}", seq, "allreduce-shard-result", r)
            for j in range(hosts):
                add(f"shard {j}/{r}", seq, "allreduce-shard", j, r)
        for kind in ("allreduce-result", "reduce-result", "broadcast"):
            add(kind, seq, kind)
    return labels


def timeline(events: list[dict[str, Any]], start: float, labels: dict[str, str]) -> list[str]:
    """One line per shown event at or after ``start`` (monotonic seconds)."""
    nodes: dict[str, str] = {}
    for e in events:  # a node is named after the rank of the first input it put
        label = labels.get(e.get("object_id", ""), "")
        if e["kind"] == "put" and label.split(" ")[-1].split("/")[-1].isdigit():
            nodes.setdefault(e["node"], "r" + label.split(" ")[-1].split("/")[-1])
    lines = []
    for e in events:
        if e["t"] < start - 0.05 or e["kind"] not in SHOWN:
            continue
        obj = labels.get(e.get("object_id", ""), e.get("object_id", "")[:8])
        who = {k: nodes.get(v, str(v)[:6]) for k, v in e.items() if k in ("node", "sender", "receiver")}
        extra = " ".join(f"{k}={v}" for k, v in who.items())
        if e["kind"] == "reduce_place":
            extra += f" input={labels.get(e['input'], e['input'][:8])} vertex={e['vertex']}"
        if e["kind"] == "transfer_done":
            extra += f" ok={e.get('ok')} bytes={e.get('progress')}"
        lines.append(f"{(e['t'] - start) * 1e3:9.1f} ms  {e['kind']:<15} {obj:<28} {extra}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", default="100MB")
    ap.add_argument("--op", default="allreduce", choices=OPS)
    ap.add_argument("--size", default="64MiB")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--before", choices=OPS, help="run --before-rounds rounds of this op first")
    ap.add_argument("--before-rounds", type=int, default=2)
    args = ap.parse_args(argv)
    from hoplite_gpu.auth import new_token
    from hoplite_gpu.directory import DirectoryProcess

    rate = parse_rate(args.rate)
    size = parse_size(args.size)
    try:
        with Cluster(args.hosts, rate) as cluster:
            token = new_token()
            directory = DirectoryProcess(
                token, host=cluster.address(0), port=DIRECTORY_PORT, env=HOST_ENV, wrap=cluster.command(0, [])
            )
            directory.start()
            members = []
            try:
                members = [
                    Member(cluster, "hoplite_gpu", r, directory.address, token) for r in range(args.hosts)
                ]
                if [m.recv() for m in members] != ["ready"] * args.hosts:
                    raise RuntimeError("a member did not start")
                if args.before:
                    for m in members:
                        m.send([args.before, size, args.before_rounds])
                    for m in members:
                        m.recv()
                for m in members:
                    m.send([args.op, size, args.warmup + 1])
                spans = [m.recv() for m in members]
                start = max(s[-1][0] for s in spans)
                end = max(s[-1][1] for s in spans)
                members[0].send("events")
                events = members[0].recv()
            finally:
                stop_all(members)
                directory.stop()
    except ClusterUnavailable as exc:
        print(f"cannot build the emulated cluster: {exc}", file=sys.stderr)
        return 2
    # bench.collectives._member: a connecting allgather (collective 0), then a barrier before each
    # round, so the timed round (the last) is collective 2 * (rounds before it + 1).
    last_seq = 2 * ((args.before_rounds if args.before else 0) + args.warmup + 1)
    labels = _labels("bench-" + directory.address, args.hosts, last_seq)
    print("\n".join(timeline(events, start, labels)))
    ideal = ideal_seconds(args.op, size, args.hosts, rate)
    print(f"round: {(end - start) * 1e3:.1f} ms (ideal {ideal * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
