"""Asynchronous SGD (``examples/async_sgd.py``'s workload, run by :mod:`bench.workloads.asgd`) with
hoplite_gpu against plain Ray: samples per second of each, their ratio, the loss each reaches after
the same number of updates, and a variant that SIGKILLs a worker mid-run, with the update times
around the failure (the workload of section 5.3 of the Hoplite paper, Zhuang et al., SIGCOMM 2021).

Emulated cluster (the default; root): ``--hosts`` hosts of :class:`bench.cluster.Cluster` with links
of ``--rate`` each way, one Ray node per host (:class:`bench.peers.ray_peer.RayCluster`), the PS and
the hoplite directory on host 0 and one worker on each other host; hoplite_gpu's nodes use UCX over
TCP without shared memory, so that every byte crosses the shaped links. A driver in host 0's
namespace runs every variant in turn (the links quiet before each) and reports to this process::

    flock /tmp/hg_cluster.lock python bench/asgd.py --json bench/results/asgd.json

One machine (``--local``): a local Ray instance, hoplite_gpu's defaults (same-host copies through
shared memory, as Ray's shared object store)::

    flock /tmp/hg_cluster.lock python bench/asgd.py --local --json bench/results/asgd_local.json

Throughput counts ``k * batch`` samples per update over the updates after ``--warmup``. The kill
variant SIGKILLs worker ``--kill-worker`` once ``--kill-at`` updates are done; Ray restarts it (the
PS relaunches its task) while the others go on.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Every actor of the emulated cluster: hoplite_gpu over the links only (namespaces share /dev/shm).
HOST_ENV = {"HOPLITE_SHARED_MEMORY": "0", "UCX_TLS": "tcp"}
#: Environment of every Ray process this benchmark starts: one BLAS thread per actor (2 cores, up to
#: ten actors), and this repository importable (the actors' classes live in ``bench.workloads``).
PROCESS_ENV = {"OPENBLAS_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
VARIANTS = ("hoplite", "ray", "hoplite-kill", "ray-kill")


def _runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The variants to run, with the arguments of :func:`bench.workloads.asgd.run` they share."""
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    return [
        {
            "name": name,
            "mode": name.split("-")[0],
            "kill": name.endswith("-kill"),
            "workers": args.workers,
            "k": args.k,
            "grad_bytes": args.grad_bytes,
            "steps": args.steps,
            "batch": args.batch,
            "lr": args.lr,
            "warmup": args.warmup,
            "kill_at": args.kill_at,
            "kill_worker": args.kill_worker,
        }
        for name in names
    ]


def run_variant(spec: dict[str, Any], **placement: Any) -> dict[str, Any]:
    """Run one variant (Ray initialised) and return its record, with ``failure`` for a kill."""
    from bench.workloads import asgd

    record = asgd.run(
        spec["mode"],
        spec["workers"],
        spec["k"],
        spec["grad_bytes"],
        spec["steps"],
        batch=spec["batch"],
        lr=spec["lr"],
        warmup=spec["warmup"],
        kill_worker=spec["kill_worker"] if spec["kill"] else None,
        kill_at_step=spec["kill_at"] if spec["kill"] else None,
        **placement,
    )
    record["name"] = spec["name"]
    if spec["kill"]:
        record["failure"] = asgd.failure_summary(record)
    return record


# ---------------------------------------------------------------------------------------- one machine
def run_local(args: argparse.Namespace) -> dict[str, Any]:
    """Every variant on a local Ray instance."""
    import ray

    import hoplite_gpu.ray as hgray

    os.environ.update(PROCESS_ENV)
    ray.init(
        num_cpus=args.workers + 2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    records = []
    try:
        hgray.start_directory()
        for spec in _runs(args):
            print(f"{spec['name']} ...", file=sys.stderr, flush=True)
            records.append(run_variant(spec))
            _print_record(records[-1])
    finally:
        ray.shutdown()
    return {"setting": "local", "cpus": os.cpu_count(), "records": records}


# ---------------------------------------------------------------------------------------- the cluster
def _driver(config: dict[str, Any]) -> None:
    """Runs in host 0's namespace: every variant, the PS and the directory on host 0, worker ``i``
    on host ``i + 1`` (see :func:`bench.peers.ray_peer.drive_variants`)."""
    from bench.peers.ray_peer import drive_variants, on_host

    drive_variants(
        config,
        lambda spec: run_variant(
            spec,
            env=HOST_ENV,
            ps_options=on_host(0),
            worker_options=[on_host(i + 1) for i in range(spec["workers"])],
            directory_options=on_host(0),
        ),
    )


def run_cluster(args: argparse.Namespace) -> dict[str, Any]:
    """Every variant on an emulated cluster of ``args.hosts`` hosts."""
    from bench.common import parse_rate
    from bench.peers.ray_peer import variants_on_cluster

    return variants_on_cluster(
        args.hosts,
        parse_rate(args.rate),
        args.prefix,
        _runs(args),
        __file__,
        # The PS's node holds a few versions of the parameters and up to N gradients being fetched.
        max(1 << 30, (args.workers + 6) * args.grad_bytes),
        args.run_timeout,
        _print_record,
        {**PROCESS_ENV, **HOST_ENV},
    )


# ---------------------------------------------------------------------------------------- reporting
def _print_record(rec: dict[str, Any]) -> None:
    line = (
        f"  {rec['name']}: {rec['samples_per_s']:.1f} samples/s, median update "
        f"{statistics.median(rec['step_seconds']):.3f} s, "
        f"loss {rec['initial_loss']:.4g} -> {rec['final_loss']:.4g}"
    )
    print(line, file=sys.stderr, flush=True)
    if "failure" in rec:
        print(f"    failure: {json.dumps(rec['failure'])}", file=sys.stderr, flush=True)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures: samples/s and final loss per variant, and hoplite / ray ratios."""
    by = {r["name"]: r for r in result["records"] if "error" not in r}
    out: dict[str, Any] = {
        name: {
            "samples_per_s": r["samples_per_s"],
            "median_step_s": statistics.median(r["step_seconds"]),
            "initial_loss": r["initial_loss"],
            "final_loss": r["final_loss"],
            **({"failure": r["failure"]} if "failure" in r else {}),
        }
        for name, r in by.items()
    }
    for suffix in ("", "-kill"):
        h, r = by.get("hoplite" + suffix), by.get("ray" + suffix)
        if h and r:
            out["ratio" + suffix.replace("-", "_")] = h["samples_per_s"] / r["samples_per_s"]
    return out


def markdown(result: dict[str, Any]) -> str:
    """A short Markdown report of a run."""
    recs = [r for r in result["records"] if "error" not in r]
    if not recs:
        return "every variant failed: " + "; ".join(f"{r['name']}: {r['error']}" for r in result["records"])
    first = recs[0]
    if result["setting"] == "cluster":
        where = (
            f"emulated cluster: {result['hosts']} hosts (PS on host 0, a worker on each other), links "
            f"{result['rate_bytes'] / 1e6:.0f} MB/s (measured {result['link_bytes_per_s'] / 1e6:.1f} MB/s)"
        )
    else:
        where = f"one machine ({result['cpus']} cores), local Ray"
    lines = [
        f"# Asynchronous SGD: hoplite_gpu vs Ray ({result['setting']})",
        "",
        f"{where}; {first['workers']} workers, first {first['k']} gradients per update, "
        f"gradient {first['grad_bytes'] / 1e6:.1f} MB ({first['params']} float32 parameters), "
        f"batch {first['batch']} per worker, {first['steps']} updates ({first['warmup']} warm-up updates "
        f"left out of samples/s), lr {first['lr']}.",
        "",
        "| variant | samples/s | median update (s) | of which summing k gradients (s) | loss before | "
        "loss after |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in recs:
        lines.append(
            f"| {r['name']} | {r['samples_per_s']:.1f} | {statistics.median(r['step_seconds']):.3f} | "
            f"{statistics.median(r['reduce_seconds']):.3f} | "
            f"{r['initial_loss']:.4g} | {r['final_loss']:.4g} |"
        )
    s = summary(result)
    for key, label in (("ratio", "no failure"), ("ratio_kill", "with a worker killed")):
        if key in s:
            lines.append(f"\nhoplite / ray samples/s ({label}): **{s[key]:.2f}x**")
    kills = [r for r in recs if "failure" in r]
    if kills:
        lines += [
            "",
            f"Worker {kills[0]['kill']['worker']} SIGKILLed after {kills[0]['kill']['step']} updates:",
            "",
            "| variant | median update before (s) | next updates (s) | relaunched after (s) | "
            "restarted worker's gradient used after (s) |",
            "|---|---:|---|---:|---:|",
        ]
        for r in kills:
            f = r["failure"]
            nxt = ", ".join(f"{x:.2f}" for x in f["steps_after_s"])
            lines.append(
                f"| {r['name']} | {_num(f['median_step_s_before'])} | {nxt} | "
                f"{_num(f['relaunched_after_s'])} | {_num(f['rejoined_after_s'])} |"
            )
    lines += ["", f"`{result['command']}` ({result['date']}, {result['seconds']:.0f} s in all)"]
    return "\n".join(lines) + "\n"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--driver"]:
        _driver(json.loads(argv[1]))
        return 0
    from bench.common import cluster_options
    from bench.workloads.asgd import parse_bytes

    ap = cluster_options(
        __doc__ or "", "hga", hosts=9, hosts_help="cluster hosts: the PS's and one per worker"
    )
    ap.add_argument("--local", action="store_true", help="one machine, local Ray (no root needed)")
    ap.add_argument("--workers", type=int, default=None, help="workers (default: hosts - 1)")
    ap.add_argument("-k", type=int, default=4, help="gradients summed per update")
    ap.add_argument("--grad-bytes", default="100MB", help="gradient size (100MB, 64MiB, ...)")
    ap.add_argument("--steps", type=int, default=20, help="updates per variant")
    ap.add_argument("--warmup", type=int, default=3, help="updates left out of samples/s")
    ap.add_argument("--batch", type=int, default=8, help="samples per worker batch")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--kill-at", type=int, default=8, help="kill variants: updates before the kill")
    ap.add_argument("--kill-worker", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {','.join(VARIANTS)}")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds one variant may take")
    ap.add_argument("--json", default=None, help="write the results here (and a .md beside)")
    ap.add_argument("--report", default=None, metavar="JSON", help="only rewrite the .md of a results file")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as fh:
            report = markdown(json.load(fh))
        with open(os.path.splitext(args.report)[0] + ".md", "w") as fh:
            fh.write(report)
        print(report)
        return 0
    args.grad_bytes = parse_bytes(args.grad_bytes)
    if args.workers is None:
        args.workers = args.hosts - 1
    if not args.local and args.workers != args.hosts - 1:
        raise SystemExit("on the cluster there is one worker per host but host 0: --workers = --hosts - 1")

    started = time.monotonic()
    result = run_local(args) if args.local else run_cluster(args)
    result["summary"] = summary(result)
    result["command"] = " ".join(["python", "bench/asgd.py", *argv])
    result["date"] = time.strftime("%Y-%m-%d")
    result["seconds"] = time.monotonic() - started
    report = markdown(result)
    print(report)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
        with open(os.path.splitext(args.json)[0] + ".md", "w") as fh:
            fh.write(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
