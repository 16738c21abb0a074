"""Small operations on one host: the latency of each, against Gloo's, and what the directory does
for it (issue 42's baseline).

``--workers`` processes (default 4) on this machine run each small operation ``--rounds`` times on
``--size`` bytes of float32 (default 1 KiB), each round after an untimed barrier; a round runs
from the last member entering the operation to the last member leaving it (``time.monotonic`` is
one clock for every process of the host, :func:`bench.collectives.round_times`). The operations:

* ``put+get``: member 0 puts a fresh object, member 1 ``get``\\ s it (Gloo: a ``send`` and a
  ``recv`` of the same bytes);
* ``broadcast``, ``reduce`` (SUM to member 0), ``allreduce``, ``allgather``: the
  :mod:`hoplite_gpu.collective` group API (Gloo: ``torch.distributed``'s);
* ``barrier``: the barrier itself;
* ``delete`` (hoplite_gpu only: Gloo keeps no objects): member 0 deletes an object of 1 KiB it put
  before the round (timed on member 0 alone; its events per op count that put too).

hoplite_gpu: an embedded directory in this process, one node per worker, the library's defaults
(same-host copies through shared memory; with ``--apart`` each node is tagged its own host,
``Config.host_tag``, so bytes cross loopback TCP as on a cluster, shared memory still on, and the
CPU a cross-host operation costs shows without link emulation). Gloo: ``torch.distributed`` over
loopback. ``floor`` (``--systems ...,floor``; reduce and allreduce only): the memory work alone of
our same-host schedule, in NumPy over files in ``/dev/shm``, with a barrier between its phases and
no control at all: every member copies its array into shared memory (the put); for reduce member 0
sums the copies into its array; for allreduce member ``r`` sums shard ``r`` of every copy into a
result segment (the star of shard ``r``), and every member copies the ``N`` results into its array.
It is the time our schedule cannot go below on this machine, measured in the same run
(:func:`floor_rounds`). Every result is checked (the barrier's has none). With ``--breakdown``,
every control message is stamped as it is encoded and decoded (:func:`stamp_messages`), and
put+get's round is cut into its steps: the putter's call to its request leaving, the wire and wake
to the directory, the directory's event, the reply's way to the getter, and the getter's way out to
its caller (:func:`put_get_steps`).

Besides the median and the 99th percentile of each, the table gives the directory's events per
operation: its event log over the rounds (requests, replies it sent and what it decided; by kind in
the JSON), divided by the rounds, less the untimed barriers' share (one barrier's events are half
the barrier row's: two a round). Each is work on the directory's one event loop, and a request in it
a round trip for some member.

    python bench/latency.py --breakdown --json bench/results/latency.json
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.collectives import group_op, round_times
from bench.common import format_size, markdown_table, parse_size, start_workers, stop_workers, write_json

OPS = ("put+get", "broadcast", "reduce", "allreduce", "allgather", "barrier", "delete")
#: Operations Gloo has no counterpart of.
OURS_ONLY = ("delete",)
SYSTEMS = ("hoplite_gpu", "gloo")
#: The memory work alone of our same-host schedule (see the module's text), and the ops it models.
FLOOR = "floor"
FLOOR_OPS = ("reduce", "allreduce")
GLOO_PORT = 29533


def _expected(op: str, rank: int, world: int, arr: np.ndarray, round_: int) -> Any:
    """What member ``rank`` holds after ``op`` of round ``round_`` (every member starts from
    ``round_ + rank``), or None where nothing is checked."""
    base = np.full_like(arr, round_)
    if op in ("broadcast", "put+get"):
        return base if (op == "broadcast" or rank == 1) else None
    total = base * world + world * (world - 1) // 2
    if op == "reduce":
        return total if rank == 0 else None
    return total if op == "allreduce" else None


def stamp_messages(log: list[tuple[float, str, str]]) -> None:
    """Append ``(time.monotonic(), "send" or "recv", message type)`` to ``log`` for every control
    message this process encodes or decodes from now on: the breakdown's probes, on the codec,
    which every message of a node or a directory passes (a few microseconds each)."""
    import hoplite_gpu.protocol as wire
    import hoplite_gpu.protocol.codec as codec

    encode, decode = codec.encode, codec.decode

    def stamped_encode(msg: Any) -> bytes:
        log.append((time.monotonic(), "send", msg.TYPE))
        return encode(msg)

    def stamped_decode(payload: bytes) -> Any:
        msg = decode(payload)
        log.append((time.monotonic(), "recv", msg.TYPE))
        return msg

    codec.encode = wire.encode = stamped_encode  # type: ignore[assignment]
    codec.decode = wire.decode = stamped_decode  # type: ignore[assignment]


def _member(
    system: str, address: str, token: str, rank: int, world: int, stamps: bool, apart: bool, conn: Any
) -> None:
    """A worker: runs ``(op, size, rounds)`` commands and answers each with its (start, end) spans
    and, with ``stamps``, the control messages it sent and received meanwhile (see
    :func:`stamp_messages`)."""
    log: list[tuple[float, str, str]] = []
    if stamps:
        stamp_messages(log)
    if system == "gloo":
        import torch
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{GLOO_PORT}", rank=rank, world_size=world
        )
        torch.set_num_threads(1)
        node = group = None
    else:
        import hoplite_gpu as hg
        from hoplite_gpu import collective as coll

        node = hg.connect(address, token=token, host_tag=f"member{rank}" if apart else "")
        group = coll.Group(node, rank, world, f"latency-{address}", timeout=60)
        coll.barrier(group)  # every member has joined
    conn.send("ready")
    try:
        while (msg := conn.recv()) is not None:
            op, size, rounds = msg
            del log[:]
            conn.send((_rounds(system, node, group, op, size, rounds, rank, world), list(log)))
    finally:
        if system == "gloo":
            import torch.distributed as dist

            dist.destroy_process_group()
        elif node is not None:
            node.close()


def _rounds(
    system: str, node: Any, group: Any, op: str, size: int, rounds: int, rank: int, world: int
) -> list[tuple[float, float]]:
    arr = np.zeros(max(size // 4, 1), np.float32)
    spans = []
    if system == "gloo":
        import torch
        import torch.distributed as dist

        t = torch.from_numpy(arr)
        pieces = [torch.empty_like(t) for _ in range(world)]
        for i in range(rounds):
            t.fill_(i + rank if op != "broadcast" else (i if rank == 0 else -1))
            dist.barrier()
            start = time.monotonic()
            if op == "put+get":
                if rank == 0:
                    dist.send(t, 1)
                elif rank == 1:
                    dist.recv(t, 0)
            elif op == "broadcast":
                dist.broadcast(t, 0)
            elif op == "reduce":
                dist.reduce(t, 0)
            elif op == "allreduce":
                dist.all_reduce(t)
            elif op == "allgather":
                dist.all_gather(pieces, t)
            else:
                dist.barrier()
            spans.append((start, time.monotonic()))
            _check(op, rank, world, t.numpy(), i, [p.numpy() for p in pieces])
        return spans
    import hoplite_gpu as hg
    from hoplite_gpu import collective as coll

    outs = [np.empty_like(arr) for _ in range(world)]
    for i in range(rounds):
        arr.fill(i + rank if op != "broadcast" else (i if rank == 0 else -1))
        oid = hg.ObjectID.from_name(f"latency/{node.directory_address}/{op}/{i}")
        if op == "delete" and rank == 0:
            node.put(arr, oid)
        coll.barrier(group)
        start = time.monotonic()
        got = arr
        if op == "delete":
            if rank == 0 and not node.delete(oid):
                raise AssertionError(f"delete round {i}: the object was not deleted")
        elif op == "put+get":
            if rank == 0:
                node.put(arr, oid)
            elif rank == 1:
                got = np.asarray(node.get(oid, timeout=60))
        else:
            group_op(op, arr, group, outs)
        spans.append((start, time.monotonic()))
        if op != "delete":
            _check(op, rank, world, got, i, outs)
        if op == "put+get" and rank == 0:
            coll.barrier(group)  # member 1 has it: a fresh id each round, the last one deleted
            node.delete(oid)
        elif op == "put+get":
            coll.barrier(group)
    return spans


def _floor_member(paths: list[str], barrier: Any, rank: int, world: int, conn: Any) -> None:
    """A worker of the ``floor`` system: maps the run's shared files (``world`` inputs, then
    ``world`` results) and runs ``(op, size, rounds)`` commands as :func:`_member` does."""
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        op, size, rounds = msg
        count = max(size // 4, 1)
        cuts = [count * j // world for j in range(world + 1)]
        inputs = [np.memmap(path, np.float32, "r+", shape=(count,)) for path in paths[:world]]
        results = [
            np.memmap(path, np.float32, "r+", shape=(cuts[j + 1] - cuts[j],))
            for j, path in enumerate(paths[world:])
        ]
        conn.send((floor_rounds(inputs, results, barrier, op, rounds, rank, world), []))
        del inputs, results


def floor_rounds(
    inputs: list[np.ndarray],
    results: list[np.ndarray],
    barrier: Any,
    op: str,
    rounds: int,
    rank: int,
    world: int,
) -> list[tuple[float, float]]:
    """Member ``rank``'s rounds of the ``floor`` system (see the module's text): its (start, end)
    spans. ``inputs``: one shared array per member (its put); ``results``: one shared shard per
    member (the allreduce's reductions)."""
    arr = np.zeros(inputs[0].shape, np.float32)
    cuts = [arr.size * j // world for j in range(world + 1)]
    spans = []
    for i in range(rounds):
        arr.fill(i + rank)
        barrier.wait()  # (the last round's readers are done with the shared arrays)
        start = time.monotonic()
        np.copyto(inputs[rank], arr)  # the put
        barrier.wait()
        if op == "reduce":
            if rank == 0:  # the star's root, into the caller's array
                np.add(inputs[0], inputs[1], out=arr)
                for other in inputs[2:]:
                    np.add(arr, other, out=arr)
        else:
            lo, hi = cuts[rank], cuts[rank + 1]
            out = results[rank]  # shard rank's star, into its result
            np.add(inputs[0][lo:hi], inputs[1][lo:hi], out=out)
            for other in inputs[2:]:
                np.add(out, other[lo:hi], out=out)
            barrier.wait()
            for j in range(world):  # every result, into the caller's array
                np.copyto(arr[cuts[j] : cuts[j + 1]], results[j])
        spans.append((start, time.monotonic()))
        _check(op, rank, world, arr, i, [])
    return spans


def _floor_files(workers: int, size: int) -> list[str]:
    """The ``floor`` system's shared files: an input per member, then a result shard per member."""
    count = max(size // 4, 1)
    shards = [count * (j + 1) // workers - count * j // workers for j in range(workers)]
    sizes = [count * 4] * workers + [shard * 4 for shard in shards]
    paths = []
    for i, nbytes in enumerate(sizes):
        path = f"/dev/shm/latency-floor-{os.getpid()}-{i}"
        with open(path, "wb") as f:
            f.truncate(max(nbytes, 4))
        paths.append(path)
    return paths


def _check(op: str, rank: int, world: int, got: np.ndarray, round_: int, pieces: list[np.ndarray]) -> None:
    """Raise unless member ``rank`` holds what ``op`` of round ``round_`` gives it."""
    if op == "allgather" and not all(np.all(p == round_ + r) for r, p in enumerate(pieces)):
        raise AssertionError(f"allgather round {round_}: member {rank} gathered other pieces")
    want = _expected(op, rank, world, got, round_)
    if want is not None and not np.array_equal(got, want):
        raise AssertionError(f"{op} round {round_}: member {rank} holds {got[:4]}, not {want[:4]}")


def run(
    system: str,
    workers: int,
    size: int,
    rounds: int,
    warmup: int,
    ops: list[str],
    breakdown: bool = False,
    apart: bool = False,
) -> list[dict[str, Any]]:
    """Every op of ``ops`` with ``system``: a row each (median and p99 microseconds, and for
    hoplite_gpu the directory's events per op, by kind; with ``breakdown``, put+get's round cut
    into the steps of :func:`put_get_steps`; with ``apart``, each hoplite member tagged its own host,
    ``Config.host_tag``)."""
    import hoplite_gpu as hg

    if system == FLOOR:
        return _run_floor(workers, size, rounds, warmup, ops)
    stamps = breakdown and system == "hoplite_gpu"
    directory_log: list[tuple[float, str, str]] = []
    if stamps:
        stamp_messages(directory_log)  # the embedded directory below lives in this process
    owner = hg.init() if system == "hoplite_gpu" else None
    address, token = (owner.directory_address, owner.token) if owner is not None else ("", "")
    args = [(system, address, token, r, workers, stamps, apart) for r in range(workers)]
    pipes, procs = start_workers(_member, args)
    rows = []
    try:
        for op in ops:
            if system == "gloo" and op in OURS_ONLY:
                continue
            since = owner.event_log()[-1]["seq"] + 1 if owner is not None else 0
            del directory_log[:]
            for pipe in pipes:
                pipe.send((op, size, warmup + rounds))
            spans, logs = zip(*[pipe.recv() for pipe in pipes], strict=True)
            spans = list(spans)
            if op == "put+get":  # the two members of the operation
                spans = spans[:2]
            elif op == "delete":
                spans = spans[:1]
            times = round_times(spans, warmup, rounds)
            kinds: collections.Counter[str] = collections.Counter()
            if owner is not None:
                kinds.update(e["kind"] for e in owner.event_log(since))
            rows.append(
                {
                    "system": system,
                    "op": op,
                    "workers": workers,
                    "size": size,
                    "rounds": rounds,
                    **median_p99_us(times),
                    # The untimed barriers count too: the ones before every round (and, for
                    # put+get, after it); the barrier row is two barriers a round.
                    "directory_events_per_round": sum(kinds.values()) / (warmup + rounds) if owner else None,
                    "directory_events": dict(kinds),
                }
            )
            if stamps and op == "put+get":
                rows[-1]["steps_us"] = put_get_steps(spans, logs[0], logs[1], directory_log, warmup)
            print(_line(rows[-1]), file=sys.stderr, flush=True)
    finally:
        stop_workers(pipes, procs)
        if owner is not None:
            owner.close()
    return rows


def _run_floor(workers: int, size: int, rounds: int, warmup: int, ops: list[str]) -> list[dict[str, Any]]:
    """:func:`run` of the ``floor`` system (the ops of :data:`FLOOR_OPS` among ``ops``)."""
    import multiprocessing as mp

    paths = _floor_files(workers, size)
    barrier = mp.get_context("spawn").Barrier(workers, timeout=60)
    rows = []
    try:
        pipes, procs = start_workers(_floor_member, [(paths, barrier, r, workers) for r in range(workers)])
        try:
            for op in (op for op in ops if op in FLOOR_OPS):
                for pipe in pipes:
                    pipe.send((op, size, warmup + rounds))
                spans = [pipe.recv()[0] for pipe in pipes]
                row = {"system": FLOOR, "op": op, "workers": workers, "size": size, "rounds": rounds}
                rows.append({**row, **median_p99_us(round_times(spans, warmup, rounds))})
                rows[-1]["directory_events_per_round"] = None
                print(_line(rows[-1]), file=sys.stderr, flush=True)
        finally:
            stop_workers(pipes, procs)
    finally:
        for path in paths:
            os.unlink(path)
    return rows


#: The steps of a put+get round (:func:`put_get_steps`), in order.
STEPS = (
    "put: call to request sent",
    "request to the directory",
    "directory: put in to the get's reply out",
    "reply to the getter",
    "getter: reply in to get returned",
)


def put_get_steps(
    spans: list[list[Any]], putter: list[Any], getter: list[Any], directory: list[Any], warmup: int
) -> dict[str, Any]:
    """Median microseconds of each step of the put+get rounds (:data:`STEPS`), from the members'
    spans and the control messages stamped in the putter, the getter and the directory (one
    clock: ``time.monotonic`` on one host). Rounds whose get asked after the put arrived (its
    reply then follows its own lookup) are left out, and counted."""

    def times(log: list[Any], way: str, kind: str) -> list[float]:
        return [t for t, w, k in log if w == way and k == kind]

    puts_sent, puts_in = times(putter, "send", "put"), times(directory, "recv", "put")
    replies_out, replies_in = times(directory, "send", "lookup_reply"), times(getter, "recv", "lookup_reply")
    lookups_in = times(directory, "recv", "lookup")

    def first(after: float, stamps: list[float]) -> float | None:
        i = bisect.bisect_left(stamps, after)
        return stamps[i] if i < len(stamps) else None

    steps: list[list[float]] = [[] for _ in STEPS]
    late = 0
    for (put_start, _), (get_start, get_end) in zip(spans[0][warmup:], spans[1][warmup:], strict=True):
        sent = first(put_start, puts_sent)
        arrived = first(sent, puts_in) if sent is not None else None
        asked = first(get_start, lookups_in)
        out = first(arrived, replies_out) if arrived is not None else None
        got = first(out, replies_in) if out is not None else None
        if None in (sent, arrived, asked, out, got):
            continue
        assert sent is not None and arrived is not None and asked is not None
        assert out is not None and got is not None
        if asked > arrived:
            late += 1
            continue
        for i, step in enumerate((sent - put_start, arrived - sent, out - arrived, got - out, get_end - got)):
            steps[i].append(step)
    medians = {name: statistics.median(s) * 1e6 if s else None for name, s in zip(STEPS, steps, strict=True)}
    return {**medians, "rounds": len(steps[0]), "late_gets": late}


def _line(r: dict[str, Any]) -> str:
    events = r["directory_events_per_round"]
    more = f", {events:.1f} directory events a round" if events is not None else ""
    return f"{r['system']} {r['op']}: median {r['median_us']:.0f} us, p99 {r['p99_us']:.0f} us{more}"


#: Untimed barriers in a round of each op besides the op itself (the barrier row: its own two).
UNTIMED_BARRIERS = {"put+get": 2, "barrier": 2}


def op_events(rows: list[dict[str, Any]], row: dict[str, Any]) -> float | None:
    """The directory's events of one ``row``'s operation: its events a round less the untimed
    barriers' (one barrier's: half the barrier row's), where the barrier was measured."""
    barrier = next((r for r in rows if r["system"] == row["system"] and r["op"] == "barrier"), None)
    events = row["directory_events_per_round"]
    if events is None or barrier is None:
        return None
    one = barrier["directory_events_per_round"] / 2
    return float(events - UNTIMED_BARRIERS.get(row["op"], 1) * one + (one if row["op"] == "barrier" else 0))


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, an op a line; with ``floor`` rows, our time as a multiple of
    the floor's and the floor's as a multiple of Gloo's too."""
    by = {(r["system"], r["op"]): r for r in rows}
    floors = any(r["system"] == FLOOR for r in rows)
    cells = []
    for op in dict.fromkeys(r["op"] for r in rows):
        ours, gloo, floor = by.get(("hoplite_gpu", op)), by.get(("gloo", op)), by.get((FLOOR, op))
        events = op_events(rows, ours) if ours else None
        cells.append(
            [
                op,
                f"{ours['median_us']:.0f} / {ours['p99_us']:.0f}" if ours else "-",
                f"{gloo['median_us']:.0f} / {gloo['p99_us']:.0f}" if gloo else "-",
                f"{ours['median_us'] / gloo['median_us']:.2f}x" if ours and gloo else "-",
                f"{events:.1f}" if events is not None else "-",
            ]
        )
        if floors:
            cells[-1] += [
                f"{floor['median_us']:.0f}" if floor else "-",
                f"{ours['median_us'] / floor['median_us']:.2f}x" if ours and floor else "-",
                f"{floor['median_us'] / gloo['median_us']:.2f}x" if gloo and floor else "-",
            ]
    columns = [("op", "l"), ("hoplite_gpu median / p99 (us)", "r"), ("Gloo median / p99 (us)", "r")]
    columns += [("x Gloo", "r"), ("directory events per op", "r")]
    if floors:
        columns += [("floor median (us)", "r"), ("ours x floor", "r"), ("floor x Gloo", "r")]
    return markdown_table(columns, cells)


def median_p99_us(times: list[float]) -> dict[str, float]:
    """The median and the 99th percentile of ``times`` (seconds, in the order of their rounds),
    and the first (with ``--warmup 0`` a group's first round: what it sets up on the way), in
    microseconds."""
    ordered = sorted(times)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p99_us": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6,
        "first_us": times[0] * 1e6 if times else float("nan"),
    }


def round_arguments(ap: argparse.ArgumentParser, ops: tuple[str, ...]) -> None:
    """The arguments of a benchmark of small operations in rounds (this one, bench/ray_latency.py)."""
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--size", default="1KiB")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--ops", default=",".join(ops))
    ap.add_argument("--json", help="also write the rows here")


def chosen_ops(ap: argparse.ArgumentParser, args: argparse.Namespace, ops: tuple[str, ...]) -> list[str]:
    """The ops ``--ops`` names (an argument error for one not in ``ops``, or under 2 workers)."""
    chosen = args.ops.split(",")
    if set(chosen) - set(ops) or args.workers < 2:
        ap.error(f"--ops takes {', '.join(ops)}; --workers at least 2")
    return chosen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    round_arguments(ap, OPS)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {', '.join(SYSTEMS)}, {FLOOR}")
    ap.add_argument(
        "--breakdown", action="store_true", help="also cut put+get into its steps (stamping every message)"
    )
    ap.add_argument(
        "--apart",
        action="store_true",
        help="each hoplite member its own host (Config.host_tag): the cross-host path over loopback",
    )
    args = ap.parse_args(argv)
    ops = chosen_ops(ap, args, OPS)
    if set(args.systems.split(",")) - {*SYSTEMS, FLOOR}:
        ap.error(f"--systems takes {', '.join(SYSTEMS)}, {FLOOR}")
    size = parse_size(args.size)
    rows = [
        r
        for s in args.systems.split(",")
        for r in run(s, args.workers, size, args.rounds, args.warmup, ops, args.breakdown, args.apart)
    ]
    what = f"{args.workers} processes on one host, {format_size(size)} float32"
    what += ", each hoplite member its own host (--apart)" if args.apart else ""
    print(f"{what}, median / p99 of {args.rounds} rounds")
    print(table(rows))
    for r in rows:
        if "steps_us" in r:
            steps = r["steps_us"]
            print(
                f"\nput+get step by step: median us of {steps['rounds']} rounds "
                f"({steps['late_gets']} left out)"
            )
            cells = [[n, f"{steps[n]:.0f}"] for n in STEPS if steps[n] is not None]
            print(markdown_table([("step", "l"), ("us", "r")], cells))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
