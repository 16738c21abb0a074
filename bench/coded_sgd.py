"""Straggler-exact aggregation (issue 20): synchronous SGD of ``examples/coded_sgd.py``'s problem
(:mod:`bench.workloads.coded_sgd`) in four modes (wait-for-all, first-k, gradient coding,
partial-straggler coding) under seeded stragglers, every mode seeing the same straggler draws, on
one machine (n worker processes and a parameter server with an embedded directory, hoplite over UCX
on loopback, no shared memory).

For each scenario and mode: median and mean iteration time, the ratio of each to wait-for-all
and of partial to plain gradient coding (measured, and what the emulated compute alone allows:
``modelled``), the relative error of the aggregated gradient against the full gradient, and the
time to reach the target loss (least-squares optimum + 0.1 %). Plots: loss against wall-clock
time, and iteration times, per scenario::

    python bench/coded_sgd.py --json bench/results/coded_sgd.json --plots bench/results

Scenarios (n = 8, codes for s = 2, per-partition time ``--partition-seconds`` with a log-normal
jitter of sigma 0.1):

* ``slow``: each iteration 2 random workers are ``--slowdown`` (5) times slower: partial
  stragglers, whose finished partitions count in the partial protocol;
* ``failed``: 2 random workers deliver nothing (full stragglers); wait-for-all cannot finish;
* ``slow3``: 3 workers 5x slower, one more than the codes tolerate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import markdown_table

SCENARIOS = {
    "slow": {"kind": "slow", "slow_workers": 2},
    "failed": {"kind": "failed", "slow_workers": 2},
    "slow3": {"kind": "slow", "slow_workers": 3},
}
MODES = ("all", "firstk", "gc", "partial")
LABEL = {"all": "wait-for-all", "firstk": "first-k", "gc": "gradient coding", "partial": "partial coding"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (scenario, mode) in turn; the records of :func:`bench.workloads.coded_sgd.run`."""
    from bench.workloads import coded_sgd

    records = []
    for scenario in args.scenarios.split(","):
        spec = SCENARIOS[scenario]
        for mode in args.modes.split(","):
            if mode == "all" and spec["kind"] == "failed":
                continue  # cannot finish an iteration
            print(f"[coded_sgd] {scenario}: {mode} ...", file=sys.stderr, flush=True)
            record = coded_sgd.run(
                mode,
                workers=args.workers,
                stragglers=args.stragglers,
                kind=str(spec["kind"]),
                slowdown=args.slowdown,
                partition_seconds=args.partition_seconds,
                iterations=args.iterations,
                seed=args.seed,
                slow_workers=int(spec["slow_workers"]),
            )
            record["scenario"] = scenario
            records.append(record)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python bench/coded_sgd.py " + " ".join(sys.argv[1:]),
        "workers": args.workers,
        "stragglers": args.stragglers,
        "slowdown": args.slowdown,
        "partition_seconds": args.partition_seconds,
        "iterations": args.iterations,
        "seed": args.seed,
        "records": records,
    }


def summary_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (scenario, mode) with medians and ratios."""
    rows = []
    by_key = {(r["scenario"], r["mode"]): r for r in result["records"]}
    for r in result["records"]:
        med = statistics.median(r["iteration_seconds"])
        model = statistics.median(r["modelled_seconds"])
        base = by_key.get((r["scenario"], "all"))
        gc = by_key.get((r["scenario"], "gc"))
        rows.append(
            {
                "scenario": r["scenario"],
                "mode": r["mode"],
                "median_s": med,
                "mean_s": statistics.fmean(r["iteration_seconds"]),
                "modelled_median_s": model,
                "overhead_s": med - model,
                "vs_all": med / statistics.median(base["iteration_seconds"]) if base else None,
                "vs_all_modelled": model / statistics.median(base["modelled_seconds"]) if base else None,
                "vs_gc": med / statistics.median(gc["iteration_seconds"]) if gc else None,
                "max_error": max(r["gradient_errors"]),
                "median_error": statistics.median(r["gradient_errors"]),
                "final_loss_over_best": r["losses"][-1] / r["best_loss"],
                "time_to_target": r["time_to_target"],
                "iterations_to_target": r["iterations_to_target"],
                "inputs_used": statistics.median(r["inputs_used"]),
            }
        )
    return rows


def markdown(result: dict[str, Any]) -> str:
    """The tables of a run."""

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    out = [
        f"# Coded SGD under stragglers ({result['date']})",
        "",
        f"`{result['command']}`: n = {result['workers']} workers, codes for s = {result['stragglers']}, "
        f"{result['partition_seconds']} s per partition (log-normal jitter, sigma 0.1), stragglers "
        f"{result['slowdown']}x slower or failed, {result['iterations']} iterations per mode, seed "
        f"{result['seed']} (every mode sees the same straggler draws). `modelled`: the time the emulated "
        "compute alone allows (when the first results that suffice are computed); the difference is "
        "hoplite's share (puts, the reduce, the get) plus the real gradient compute of 8 processes on "
        "2 cores. Error: relative L2 error of the aggregated gradient against the sum of the float32 "
        "partition gradients (the full gradient).",
        "",
    ]
    columns = [
        ("scenario", "l"),
        ("mode", "l"),
        ("median s", "r"),
        ("modelled s", "r"),
        ("vs wait-for-all", "r"),
        ("modelled vs wait-for-all", "r"),
        ("vs gradient coding", "r"),
        ("inputs used", "r"),
        ("max gradient error", "r"),
        ("loss / optimum at end", "r"),
        ("time to target (s)", "r"),
    ]
    cells = [
        [
            r["scenario"],
            LABEL[r["mode"]],
            f"{r['median_s']:.3f}",
            f"{r['modelled_median_s']:.3f}",
            ratio(r["vs_all"]),
            ratio(r["vs_all_modelled"]),
            ratio(r["vs_gc"]),
            f"{r['inputs_used']:g}",
            f"{r['max_error']:.1e}",
            f"{r['final_loss_over_best']:.5f}",
            "never"
            if r["time_to_target"] is None
            else f"{r['time_to_target']:.1f} ({r['iterations_to_target']} it.)",
        ]
        for r in summary_rows(result)
    ]
    out.append(markdown_table(columns, cells))
    return "\n".join(out) + "\n"


def plot(result: dict[str, Any], directory: str) -> list[str]:
    """``coded_sgd_<scenario>.png``: loss against wall-clock time (left) and iteration times
    (right), one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for scenario in dict.fromkeys(r["scenario"] for r in result["records"]):
        mine = [r for r in result["records"] if r["scenario"] == scenario]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
        for r in mine:
            elapsed, total = [], 0.0
            for t in r["iteration_seconds"]:
                total += t
                elapsed.append(total)
            excess = [max(loss / r["best_loss"] - 1.0, 1e-9) for loss in r["losses"]]
            left.plot(elapsed, excess, ".-", label=LABEL[r["mode"]])
            right.plot(
                range(1, len(r["iteration_seconds"]) + 1),
                r["iteration_seconds"],
                ".-",
                label=LABEL[r["mode"]],
            )
        target = mine[0]["target_loss"] / mine[0]["best_loss"] - 1.0
        left.axhline(target, color="k", ls="--", lw=0.8, label="target")
        left.set(
            xlabel="wall-clock seconds", ylabel="loss / optimum - 1", yscale="log", title=f"{scenario}: loss"
        )
        right.set(xlabel="iteration", ylabel="seconds", title=f"{scenario}: iteration time")
        left.legend(fontsize=8)
        right.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(directory, f"coded_sgd_{scenario}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--stragglers", type=int, default=2)
    parser.add_argument("--slowdown", type=float, default=5.0)
    parser.add_argument("--partition-seconds", type=float, default=0.2)
    parser.add_argument("--iterations", type=int, default=25)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the records here (and a .md table beside it)")
    parser.add_argument("--plots", help="write PNG plots into this directory")
    args = parser.parse_args(argv)
    unknown = [s for s in args.scenarios.split(",") if s not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    result = run(args)
    text = markdown(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
            f.write(text)
    if args.plots:
        for path in plot(result, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
