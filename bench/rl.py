"""Synchronous RL (``examples/rl.py``'s workload, :mod:`bench.workloads.rl`) moved three ways: plain
Ray's object store, Ray Direct Transport over Gloo, and hoplite_gpu (weights through its HOPLITE
transport, gradients summed by its reduce). Each iteration the learner broadcasts its weights to
every rollout worker and sums the gradients they return (the RL workload of section 5.4 of the
Hoplite paper, Zhuang et al., SIGCOMM 2021); reports the median iteration time of each,
hoplite_gpu's speedup over Ray and over Gloo, the ideal iteration time at the measured link rate (a
broadcast and a reduce, each ``S/B``), and variants that SIGKILL a worker mid-run, with the
iteration times around the failure.

Emulated cluster (the default; root): ``--hosts`` hosts of :class:`bench.cluster.Cluster` with
links of ``--rate`` each way, one Ray node per host (:class:`bench.peers.ray_peer.RayCluster`), the
learner and the hoplite directory on host 0 and one rollout worker on each other host; hoplite_gpu's
nodes use UCX over TCP without shared memory and Gloo is bound to each host's link, so that every
byte crosses the shaped links. A driver in host 0's namespace runs every variant in turn (the links
quiet before each) and reports to this process::

    flock /tmp/hg_cluster.lock python bench/rl.py --rate 100MB
    flock /tmp/hg_cluster.lock python bench/rl.py --rate 1GB

One machine (``--local``): a local Ray instance, hoplite_gpu's defaults (same-host copies through
shared memory, as Ray's shared object store)::

    flock /tmp/hg_cluster.lock python bench/rl.py --local

Results go to ``bench/results/rl_<rate>.json`` (``rl_local.json``) unless ``--json`` says otherwise,
and ``rl.md`` beside it is rewritten from every ``rl_*.json`` there. The kill variants SIGKILL worker
``--kill-worker`` right after launching iteration ``--kill-at``; Ray restarts it, the learner sums
the others' gradients, and the run goes on until the restarted process has taken part again. Gloo
has no kill variant (see :mod:`bench.workloads.rl`).
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
#: Every actor of the emulated cluster: hoplite_gpu over the links only (namespaces share /dev/shm),
#: and Gloo on the host's link (it would otherwise pick the interface of the machine's host name).
HOST_ENV = {"HOPLITE_SHARED_MEMORY": "0", "UCX_TLS": "tcp", "GLOO_SOCKET_IFNAME": "eth0"}
#: Environment of every Ray process this benchmark starts: one BLAS thread per actor (2 cores, up to
#: ten actors), no usage report.
PROCESS_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
#: ``hoplite-put``: hoplite with the weights ``put`` explicitly and their ObjectID passed to the
#: workers instead of going through the HOPLITE transport (the same broadcast tree, without Ray
#: Direct Transport's orchestration). ``hoplite-sync``: the weights as versions of
#: :mod:`hoplite_gpu.weights` (a publisher in the learner, a subscriber in each worker receiving
#: into its own array), as an RL framework would send them.
VARIANTS = ("ray", "gloo", "hoplite", "hoplite-put", "hoplite-sync", "hoplite-kill", "ray-kill")
#: How each hoplite variant sends the weights (:func:`bench.workloads.rl.run`'s ``weights_via``).
WEIGHTS_VIA = {"hoplite-put": "put", "hoplite-sync": "sync"}


def _runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The variants to run, with the arguments of :func:`bench.workloads.rl.run` they share."""
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    runs = []
    for name in names:
        kill = name.endswith("-kill")
        runs.append(
            {
                "name": name,
                "mode": name.split("-")[0],
                "kill": kill,
                "weights_via": WEIGHTS_VIA.get(name, "transport"),
                "workers": args.workers,
                "weights_bytes": args.weights_bytes,
                # A kill variant runs some iterations past the kill, and on until the restarted
                # worker took part again.
                "iterations": max(args.iterations, args.kill_at + 6) if kill else args.iterations,
                "warmup": args.warmup,
                "compute_s": args.compute_ms / 1000,
                "kill_at": args.kill_at,
                "kill_worker": args.kill_worker,
                "timeout": args.run_timeout,
            }
        )
    return runs


def run_variant(spec: dict[str, Any], **placement: Any) -> dict[str, Any]:
    """Run one variant (Ray initialised) and return its record, with ``failure`` for a kill."""
    from bench.workloads import rl

    record = rl.run(
        spec["mode"],
        spec["workers"],
        spec["weights_bytes"],
        spec["iterations"],
        warmup=spec["warmup"],
        compute_s=spec["compute_s"],
        kill_worker=spec["kill_worker"] if spec["kill"] else None,
        kill_at=spec["kill_at"] if spec["kill"] else None,
        until_rejoined=spec["kill"],
        weights_via=spec.get("weights_via", "transport"),
        timeout=spec["timeout"],
        **placement,
    )
    record["name"] = spec["name"]
    if spec["kill"]:
        record["failure"] = rl.failure_summary(record, window=6)
    return record


# ---------------------------------------------------------------------------------------- one machine
def run_local(args: argparse.Namespace) -> dict[str, Any]:
    """Every variant on a local Ray instance."""
    import ray

    os.environ.update(PROCESS_ENV)
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        num_cpus=args.workers + 2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        runtime_env={"env_vars": {"PYTHONPATH": path, **PROCESS_ENV}},
    )
    records = []
    try:
        for spec in _runs(args):
            print(f"{spec['name']} ...", file=sys.stderr, flush=True)
            records.append(run_variant(spec))
            _print_record(records[-1])
    finally:
        ray.shutdown()
    return {"setting": "local", "cpus": os.cpu_count(), "records": records}


# ---------------------------------------------------------------------------------------- the cluster
def _driver(config: dict[str, Any]) -> None:
    """Runs in host 0's namespace: every variant, the learner and the directory on host 0, worker
    ``i`` on host ``i + 1`` (see :func:`bench.peers.ray_peer.drive_variants`)."""
    from bench.peers.ray_peer import drive_variants, on_host

    drive_variants(
        config,
        lambda spec: run_variant(
            spec,
            env=HOST_ENV,
            learner_options=on_host(0),
            worker_options=[on_host(i + 1) for i in range(spec["workers"])],
            directory_options=on_host(0),
        ),
    )


def run_cluster(args: argparse.Namespace) -> dict[str, Any]:
    """Every variant on an emulated cluster of ``args.hosts`` hosts."""
    from bench.common import parse_rate
    from bench.peers.ray_peer import variants_on_cluster

    result = variants_on_cluster(
        args.hosts,
        parse_rate(args.rate),
        args.prefix,
        _runs(args),
        __file__,
        # The learner's node holds a few versions of the weights and, in Ray mode, every gradient.
        max(1 << 30, (args.workers + 6) * args.weights_bytes),
        args.run_timeout + 120,
        _print_record,
        PROCESS_ENV,
        aggregate=True,
    )
    return {**result, "rate": args.rate}


# ---------------------------------------------------------------------------------------- reporting
def _print_record(rec: dict[str, Any]) -> None:
    times = " ".join(f"{r['seconds']:.2f}" for r in rec["iterations"])
    print(
        f"  {rec['name']}: median iteration {rec['median_s']:.3f} s (weights via {rec['weights_via']}); "
        f"iterations: {times}",
        file=sys.stderr,
        flush=True,
    )
    if "failure" in rec:
        print(f"    failure: {json.dumps(rec['failure'])}", file=sys.stderr, flush=True)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures: median iteration time per variant (with the medians of the time until
    the sum was at the learner and of the learner's exact check), the ideal iteration time where
    the link was measured, and hoplite_gpu's speedups (``ray_time / hoplite_time``, and over Gloo)."""
    by = {r["name"]: r for r in result["records"] if "error" not in r}
    out: dict[str, Any] = {}
    ideal = None
    if result.get("link_bytes_per_s"):
        first = next(iter(by.values()), None)
        if first is not None:
            ideal = 2 * first["weights_bytes"] / result["link_bytes_per_s"]
            out["ideal_s"] = ideal
            if result.get("aggregate_bytes_per_s"):
                # Every worker receives the weights and sends a gradient: 2 N S bytes cross the
                # switch in any system, at most at the rate the machine moves in total.
                moved = 2 * first["workers"] * first["weights_bytes"]
                out["machine_limit_s"] = moved / result["aggregate_bytes_per_s"]
    for name, r in by.items():
        timed = r["iterations"][r["warmup"] :]
        out[name] = {
            "median_s": r["median_s"],
            "median_full_s": r.get("median_full_s"),
            "median_reduce_s": statistics.median(x["reduce_s"] for x in timed),
            "median_check_s": statistics.median(x["check_s"] for x in timed),
            **({"x_ideal": r["median_s"] / ideal} if ideal else {}),
            **({"failure": r["failure"]} if "failure" in r else {}),
        }
    for base in ("ray", "gloo"):
        for suffix in ("", "-kill"):
            h, b = by.get("hoplite" + suffix), by.get(base + suffix)
            if h and b:
                key = "median_full_s" if suffix else "median_s"  # kill: the iterations with all workers
                if h.get(key) and b.get(key):
                    out[f"speedup_over_{base}{suffix.replace('-', '_')}"] = b[key] / h[key]
        for variant in ("put", "sync"):
            h, b = by.get(f"hoplite-{variant}"), by.get(base)
            if h and b:
                out[f"{variant}_speedup_over_{base}"] = b["median_s"] / h["median_s"]
    return out


def _where(result: dict[str, Any]) -> str:
    if result["setting"] == "cluster":
        return (
            f"emulated cluster, {result['hosts']} hosts (learner and directory on host 0, one rollout "
            f"worker on each other), links {result['rate_bytes'] / 1e6:.0f} MB/s set, "
            f"{result['link_bytes_per_s'] / 1e6:.1f} MB/s measured (one TCP stream)"
        )
    return f"one machine ({result['cpus']} cores), local Ray"


def markdown_one(result: dict[str, Any]) -> list[str]:
    """The Markdown section of one run."""
    recs = [r for r in result["records"] if "error" not in r]
    s = summary(result)
    title = f"{result['rate']} links" if result["setting"] == "cluster" else "one machine"
    lines = [f"## {title}", ""]
    if not recs:
        return [*lines, "every variant failed", ""]
    first = recs[0]
    lines += [
        f"{_where(result)}; {first['workers']} workers, weights and gradients "
        f"{first['weights_bytes'] / (1 << 20):.0f} MiB float32, median over the iterations after "
        f"the first {first['warmup']}; emulated rollout compute {first['compute_s'] * 1000:.0f} ms.",
        "",
    ]
    if "ideal_s" in s:
        lines += [
            f"Ideal iteration (broadcast S/B + reduce S/B at the measured rate): **{s['ideal_s']:.3f} s**.",
            "",
        ]
    if "machine_limit_s" in s:
        lines += [
            f"What this machine moves in total with every link busy at once (a ring of TCP streams, "
            f"measured in the same run): {result['aggregate_bytes_per_s'] / 1e6:.0f} MB/s, so the "
            f"2 N S bytes of an iteration (each worker receives the weights and sends a gradient) "
            f"take at least **{s['machine_limit_s']:.3f} s** here, whatever the system. Where this "
            "exceeds the ideal, the 2 cores that all hosts share, not the links, set the pace.",
            "",
        ]
    lines += [
        "| variant | weights via | median iteration (s) | x ideal | with every worker (s) | of which until "
        "the sum was at the learner (s) | exact check (s) | iterations |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in recs:
        f = s[r["name"]]
        x = f"{f['x_ideal']:.2f}" if "x_ideal" in f else "-"
        full = _num(r.get("median_full_s"), 3)
        lines.append(
            f"| {r['name']} | {r['weights_via']} | {r['median_s']:.3f} | {x} | {full} | "
            f"{f['median_reduce_s']:.3f} | {f['median_check_s']:.3f} | {len(r['iterations'])} |"
        )
    for r in result["records"]:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} | | | | | | |")
    lines += [
        "",
        "With every worker: the median over the iterations that summed every worker's gradient (a kill "
        "variant's others ran with one worker fewer, while it restarted). The sum column is the "
        "learner's call until it held the sum (gloo: only adding the gradients, which Ray received "
        "over Gloo before the call ran); the check compares the sum with the learner's own "
        "recomputation, element by element.",
    ]
    ratios = [
        (
            f"speedup_over_{b}{k}",
            f"hoplite_gpu over {'Ray' if b == 'ray' else 'Gloo'}{' (kill)' if k else ''}",
        )
        for b in ("ray", "gloo")
        for k in ("", "_kill")
    ]
    ratios += [
        (f"{v}_speedup_over_{b}", f"hoplite-{v} over {'Ray' if b == 'ray' else 'Gloo'}")
        for v in ("put", "sync")
        for b in ("ray", "gloo")
    ]
    found = [f"{label}: **{s[key]:.2f}x**" for key, label in ratios if key in s]
    if found:
        lines += [
            "",
            "Speedup (other's median iteration / hoplite_gpu's; kill variants: with every worker): "
            + "; ".join(found)
            + ".",
        ]
    kills = [r for r in recs if "failure" in r]
    if kills:
        lines += [
            "",
            "Worker killed (SIGKILL) right after its iteration was launched:",
            "",
            "| variant | killed in iteration | median before (s) | that iteration (s) | next iterations (s) "
            "| restarted worker back in iteration | back after (s) |",
            "|---|---:|---:|---:|---|---:|---:|",
        ]
        for r in kills:
            f = r["failure"]
            nxt = ", ".join(f"{x:.2f}" for x in f["after_s"])
            lines.append(
                f"| {r['name']} | {f['kill_iteration']} | {_num(f['median_s_before'])} | "
                f"{f['killed_iteration_s']:.2f} | {nxt} | {_opt(f['rejoined_iteration'])} | "
                f"{_num(f['rejoined_after_s'])} |"
            )
    lines += ["", f"`{result['command']}` ({result['date']}, {result['seconds']:.0f} s in all)", ""]
    return lines


def markdown(results: list[dict[str, Any]]) -> str:
    """The Markdown report of several runs (one per rate, one machine last)."""
    order = sorted(results, key=lambda r: (r["setting"] != "cluster", r.get("rate_bytes", 0)))
    lines = [
        "# Synchronous RL: hoplite_gpu vs Ray and Gloo (Ray Direct Transport)",
        "",
        "`bench/workloads/rl.py`: each iteration the learner broadcasts its weights to every rollout worker "
        "and sums their gradients (as large as the weights), checking the sum bit-exactly. "
        'ray: object store (`ray.put`/`ray.get`); gloo: `@ray.method(tensor_transport="gloo")` '
        "point to point; hoplite: weights through the HOPLITE transport, gradients by hoplite's "
        "reduce; hoplite-put: the same with the weights `put` explicitly and their ObjectID passed "
        "to the workers (no Ray Direct Transport); hoplite-sync: the weights as versions of "
        "`hoplite_gpu.weights`, received into each worker's own array.",
        "",
    ]
    for result in order:
        lines += markdown_one(result)
    return "\n".join(lines)


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _opt(x: int | None) -> str:
    return "-" if x is None else str(x)


def write_report(json_path: str) -> str:
    """Rewrite ``rl.md`` beside ``json_path`` from every ``rl_*.json`` there; returns the report."""
    folder = os.path.dirname(os.path.abspath(json_path))
    results = []
    for path in sorted(glob.glob(os.path.join(folder, "rl_*.json"))):
        with open(path) as fh:
            results.append(json.load(fh))
    report = markdown(results)
    with open(os.path.join(folder, "rl.md"), "w") as fh:
        fh.write(report)
    return report


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--driver"]:
        _driver(json.loads(argv[1]))
        return 0
    from bench.common import cluster_options

    ap = cluster_options(
        __doc__ or "", "hgl", hosts=9, hosts_help="cluster hosts: the learner's and one per worker"
    )
    ap.add_argument("--local", action="store_true", help="one machine, local Ray (no root needed)")
    ap.add_argument("--workers", type=int, default=None, help="rollout workers (default: hosts - 1)")
    ap.add_argument("--weights-mib", type=float, default=32.0, help="size of the weights, MiB")
    ap.add_argument("--iterations", type=int, default=10, help="iterations per variant")
    ap.add_argument("--warmup", type=int, default=2, help="iterations left out of the median")
    ap.add_argument("--compute-ms", type=float, default=0.0, help="emulated compute per rollout")
    ap.add_argument("--kill-at", type=int, default=5, help="kill variants: the iteration of the kill")
    ap.add_argument("--kill-worker", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {','.join(VARIANTS)}")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds one variant may take")
    ap.add_argument("--json", default=None, help="results file (default bench/results/rl_<rate>.json)")
    ap.add_argument("--report", action="store_true", help="only rewrite rl.md from the results files")
    args = ap.parse_args(argv)
    label = "local" if args.local else args.rate
    path = args.json or os.path.join(RESULTS, f"rl_{label}.json")
    if args.report:
        print(write_report(path))
        return 0
    args.weights_bytes = int(args.weights_mib * (1 << 20)) // 4 * 4
    if args.workers is None:
        args.workers = 4 if args.local else args.hosts - 1
    if not args.local and args.workers != args.hosts - 1:
        raise SystemExit("on the cluster there is one worker per host but host 0: --workers = --hosts - 1")
    if not 0 <= args.kill_worker < args.workers:
        raise SystemExit(f"--kill-worker must be in 0..{args.workers - 1}")

    started = time.monotonic()
    result = run_local(args) if args.local else run_cluster(args)
    result["command"] = " ".join(["python", "bench/rl.py", *argv])
    result["date"] = time.strftime("%Y-%m-%d")
    result["seconds"] = time.monotonic() - started
    result["summary"] = summary(result)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print("\n".join(markdown_one(result)))
    write_report(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
