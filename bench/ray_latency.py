"""Small collectives through ``ray.util.collective`` (backend ``"hoplite"``) against the same
collectives through the group API underneath, in the same Ray actors (issue 42, item 4).

``--workers`` actors on a local Ray instance join one ``ray.util.collective`` group with the
``hoplite`` backend. Each operation runs ``--rounds`` times on ``--size`` bytes of float32 NumPy
arrays, each round after an untimed barrier, first as users call Ray (``col.allreduce(a,
"group")``), then on the :class:`hoplite_gpu.collective.Group` that the Ray group wraps
(``collective.allreduce(a, group)``). A round runs from the last member entering to the last
leaving (:func:`bench.collectives.round_times`); every result is checked. The ratio is Ray's
dispatch (the group looked up by name, the arguments checked and converted) on top of ours.

    python bench/ray_latency.py --json bench/results/ray_latency.json
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.collectives import group_op, round_times
from bench.common import markdown_table, parse_size, write_json
from bench.latency import chosen_ops, median_p99_us, round_arguments

OPS = ("broadcast", "reduce", "allreduce", "barrier")
WAYS = ("ray", "group")


class Member:
    """One actor of the group: runs every op both ways and returns its (start, end) spans."""

    def __init__(self, rank: int, world: int, name: str) -> None:
        import ray.util.collective as col

        self.rank, self.world, self.name = rank, world, name
        col.init_collective_group(world, rank, backend="hoplite", group_name=name)

    def spans(self, op: str, way: str, size: int, rounds: int) -> list[tuple[float, float]]:
        import ray.util.collective as col
        from ray.util.collective.collective import get_group_handle

        group = get_group_handle(self.name).group
        arr = np.zeros(max(size // 4, 1), np.float32)
        total = self.world * (self.world - 1) // 2
        out = []
        for i in range(rounds):
            arr.fill(self.rank if op != "broadcast" else (i if self.rank == 0 else -1))
            col.barrier(self.name)
            start = time.monotonic()
            if way == "ray":
                if op == "broadcast":
                    col.broadcast(arr, 0, self.name)
                elif op == "reduce":
                    col.reduce(arr, 0, self.name)
                elif op == "allreduce":
                    col.allreduce(arr, self.name)
                else:
                    col.barrier(self.name)
            else:
                group_op(op, arr, group)
            out.append((start, time.monotonic()))
            want = {"broadcast": i, "allreduce": total, "reduce": total if self.rank == 0 else None}.get(op)
            if want is not None and not np.all(arr == want):
                raise AssertionError(
                    f"{op} ({way}) round {i}: member {self.rank} holds {arr[:4]}, not {want}"
                )
        return out

    def close(self) -> None:
        import ray.util.collective as col

        col.destroy_collective_group(self.name)


def run(workers: int, size: int, rounds: int, warmup: int, ops: list[str]) -> list[dict[str, Any]]:
    """Every op both ways on a local Ray instance: a row per (op, way) with the median and p99
    microseconds."""
    import ray

    import hoplite_gpu.ray as hgray

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        num_cpus=workers + 1,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        runtime_env={
            "worker_process_setup_hook": "hoplite_gpu.ray.register_collective_backend",
            "env_vars": {"PYTHONPATH": path, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
        },
    )
    rows = []
    try:
        hgray.register_collective_backend()
        hgray.start_directory()
        actor = ray.remote(num_cpus=1)(Member)
        members = [actor.remote(r, workers, "latency") for r in range(workers)]
        for op in ops:
            for way in WAYS:
                spans = ray.get(
                    [m.spans.remote(op, way, size, warmup + rounds) for m in members], timeout=600
                )
                times = round_times(spans, warmup, rounds)
                rows.append(
                    {
                        "op": op,
                        "way": way,
                        "workers": workers,
                        "size": size,
                        "rounds": rounds,
                        **median_p99_us(times),
                    }
                )
                print(f"{op} ({way}): median {rows[-1]['median_us']:.0f} us", file=sys.stderr, flush=True)
        ray.get([m.close.remote() for m in members], timeout=120)
    finally:
        ray.shutdown()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    by = {(r["op"], r["way"]): r for r in rows}
    cells = []
    for op in dict.fromkeys(r["op"] for r in rows):
        ray_row, ours = by[(op, "ray")], by[(op, "group")]
        cells.append(
            [
                op,
                f"{ray_row['median_us']:.0f} / {ray_row['p99_us']:.0f}",
                f"{ours['median_us']:.0f} / {ours['p99_us']:.0f}",
                f"{ray_row['median_us'] / ours['median_us']:.2f}x",
            ]
        )
    columns = [("op", "l"), ("ray.util.collective median / p99 (us)", "r"), ("group API (us)", "r")]
    return markdown_table([*columns, ("x group API", "r")], cells)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    round_arguments(ap, OPS)
    args = ap.parse_args(argv)
    ops = chosen_ops(ap, args, OPS)
    rows = run(args.workers, parse_size(args.size), args.rounds, args.warmup, ops)
    print(f"{args.workers} Ray actors on one host, {args.size} float32, median / p99 of {args.rounds} rounds")
    print(table(rows))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
