"""PNG plots of an emulated-cluster run (:mod:`bench.netbench`): for each (N, op), time against
size on log-log axes, one line per system and the ideal (the links' physical limit) as a dashed
line.

    python bench/plot.py bench/results/netbench.json bench/results
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import format_size
from bench.netbench import OPS, SYSTEMS, ideal_seconds

STYLE = {"hoplite_gpu": "o-", "mpi": "s-", "gloo": "^-", "ray": "D-"}


def plot(result: dict[str, Any], directory: str) -> list[str]:
    """Draw ``netbench_n{N}_{op}.png`` for every (N, op) in ``result``; return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    rows = result["rows"]
    rate = result["rate_bytes"]
    paths = []
    for hosts in sorted({r["hosts"] for r in rows}):
        for op in [
            o for o in OPS if o != "barrier" and any(r["op"] == o and r["hosts"] == hosts for r in rows)
        ]:
            mine = [r for r in rows if r["hosts"] == hosts and r["op"] == op]
            sizes = sorted({r["size"] for r in mine})
            fig, ax = plt.subplots(figsize=(6.4, 4.4))
            ax.plot(sizes, [ideal_seconds(op, s, hosts, rate) for s in sizes], "k--", label="ideal")
            for system in [s for s in SYSTEMS if any(r["system"] == s for r in mine)]:
                points = sorted((r["size"], r["seconds"]) for r in mine if r["system"] == system)
                ax.plot(*zip(*points, strict=True), STYLE.get(system, "x-"), label=system)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=30)
            ax.set_xlabel("size" + (" (gathered total)" if "gather" in op else ""))
            ax.set_ylabel("seconds (median)")
            ax.set_title(f"{op}, N = {hosts}, {rate / 1e6:.0f} MB/s links")
            ax.grid(True, which="major", alpha=0.3)
            ax.legend()
            fig.tight_layout()
            path = os.path.join(directory, f"netbench_n{hosts}_{op}.png")
            fig.savefig(path, dpi=90)
            plt.close(fig)
            paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as fh:
        result = json.load(fh)
    for path in plot(result, argv[1]):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
