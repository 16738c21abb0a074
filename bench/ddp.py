"""DDP and FSDP2 training steps over torch.distributed's backend "hoplite" against "gloo", on the
emulated cluster (bench/cluster.py: N hosts, links shaped to a rate).

One rank per host trains a generated model of about 25 M parameters (two convolutions and three
linear layers, 100 MB of float32 gradients a step) on synthetic data (no downloads) with SGD, under
``DistributedDataParallel`` (its default 25 MiB buckets) or FSDP2's ``fully_shard``. For each
system, in the same cluster and run, one after the other:

* ``first_seconds``: the first step, from the barrier after the model was wrapped to the moment
  every rank finished it (nothing warmed up: the backend's connections, DDP's first buckets);
* ``seconds``: the median of the next steps (each from the previous step's end on the last rank
  to this one's; CLOCK_MONOTONIC is shared by the namespaces of one machine);
* ``cpu_seconds``: user + system CPU per step, summed over the ranks' processes (the hoplite
  directory lives in rank 0's);
* ``sent_bytes``: what each host's interface sent per step (mean over hosts).

With ``--bucket`` the hoplite ranks also time a 25 MiB ``all_reduce`` through the backend against
``hoplite_gpu.collective.allreduce`` of the same array on the backend's own group, alternating,
after a barrier each: what the backend adds to a plain allreduce.

The hoplite nodes are not told their address (rank 0's directory listens where the route to
``MASTER_ADDR`` leaves; the others find theirs the same way). Needs root and iproute2::

    python bench/ddp.py --hosts 4 --rate 100MB,1GB --steps 8 --bucket --json bench/results/ddp.json
    python bench/ddp.py --hosts 4 --rate 1GB --fsdp --steps 8 --json bench/results/fsdp.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

# The repository instead of bench/ on the path: bench/profile.py would hide the standard
# library's profile module, which torch imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from bench.common import cpu_seconds, markdown_table, parse_rate, write_json  # noqa: E402

#: Every rank's environment: UCX over TCP only, no same-host shortcuts, Gloo on the host's link.
HOST_ENV = {
    "UCX_TLS": "tcp",
    "HOPLITE_SHARED_MEMORY": "0",
    "GLOO_SOCKET_IFNAME": "eth0",
    "OMP_NUM_THREADS": "1",
}
PORT = 29577
SYSTEMS = ("hoplite", "gloo")
BUCKET_BYTES = 25 << 20


# ---------------------------------------------------------------------------- a rank
def _model() -> Any:
    """About 25 M parameters: 16.8 M + 8.4 M in two linear layers, the rest small."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(8),
        nn.Flatten(),
        nn.Linear(4096, 4096),
        nn.ReLU(),
        nn.Linear(4096, 2048),
        nn.ReLU(),
        nn.Linear(2048, 10),
    )


def _sent_bytes() -> int:
    """Bytes this namespace's ``eth0`` sent so far."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return int(rest.split()[8])
    return 0


def member(system: str, master: str, rank: int, world: int, steps: int, fsdp: bool, bucket: bool) -> None:
    """One rank: train ``steps`` steps, print one JSON line with its timestamps and counters."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        system,
        init_method=f"tcp://{master}:{PORT}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    model = _model()
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    dist.barrier()
    ends, cpu, sent = [time.monotonic()], [cpu_seconds()], [_sent_bytes()]
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        ends.append(time.monotonic())
        cpu.append(cpu_seconds())
        sent.append(_sent_bytes())
    found: dict[str, Any] = {"rank": rank, "ends": ends, "cpu": cpu, "sent": sent}
    if bucket and system == "hoplite":
        found["bucket"] = _bucket_overhead()
    print(json.dumps(found), flush=True)
    dist.destroy_process_group()


def _bucket_overhead(rounds: int = 15) -> dict[str, float]:
    """Seconds of a 25 MiB allreduce through the backend and through the library on the same
    group, alternating which goes first (median of ``rounds`` each)."""
    import torch
    import torch.distributed as dist

    from hoplite_gpu import collective

    group = dist.group.WORLD.group  # the backend's hoplite_gpu.collective.Group
    t = torch.ones(BUCKET_BYTES // 4)
    times: dict[str, list[float]] = {"backend": [], "library": []}
    runs = {"backend": lambda: dist.all_reduce(t), "library": lambda: collective.allreduce(t.numpy(), group)}
    for i in range(rounds):
        for name in ("backend", "library") if i % 2 == 0 else ("library", "backend"):
            dist.barrier()
            start = time.monotonic()
            runs[name]()
            times[name].append(time.monotonic() - start)
    return {f"{name}_seconds": statistics.median(found) for name, found in times.items()}


# ---------------------------------------------------------------------------- the driver
def run_system(cluster: Any, system: str, steps: int, fsdp: bool, bucket: bool) -> dict[str, Any]:
    """Train on every host of ``cluster`` with ``system``; the row of the run."""
    procs = []
    argv = [sys.executable, os.path.abspath(__file__), "--member", system, cluster.address(0)]
    for rank in range(cluster.hosts):
        args = [*argv, str(rank), str(cluster.hosts), str(steps), str(int(fsdp)), str(int(bucket))]
        procs.append(cluster.popen(rank, args, env=HOST_ENV, stdout=subprocess.PIPE, text=True))
    ranks = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"a {system} rank failed (exit {proc.returncode})")
        ranks.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
    ends = [max(r["ends"][k] for r in ranks) for k in range(steps + 1)]
    spans = [b - a for a, b in itertools.pairwise(ends)]
    cpu = [sum(r["cpu"][k + 1] - r["cpu"][k] for r in ranks) for k in range(steps)]
    sent = [statistics.mean(r["sent"][k + 1] - r["sent"][k] for r in ranks) for k in range(steps)]
    row: dict[str, Any] = {
        "system": system,
        "mode": "fsdp2" if fsdp else "ddp",
        "first_seconds": spans[0],
        "seconds": statistics.median(spans[1:]),
        "step_seconds": spans,
        "cpu_seconds": statistics.median(cpu[1:]),
        "first_cpu_seconds": cpu[0],
        "sent_bytes": statistics.median(sent[1:]),
    }
    buckets = [r["bucket"] for r in ranks if "bucket" in r]
    if buckets:
        row["bucket_backend_seconds"] = statistics.median(b["backend_seconds"] for b in buckets)
        row["bucket_library_seconds"] = statistics.median(b["library_seconds"] for b in buckets)
        row["bucket_overhead"] = row["bucket_backend_seconds"] / row["bucket_library_seconds"]
    return row


def run(hosts: int, rate: float, steps: int, fsdp: bool, bucket: bool, prefix: str) -> list[dict[str, Any]]:
    from bench.cluster import Cluster, link_throughput

    rows = []
    with Cluster(hosts, rate, prefix=prefix) as cluster:
        measured = link_throughput(cluster)
        print(
            f"N={hosts} link: {measured / 1e6:.1f} MB/s measured ({rate / 1e6:.0f} MB/s set)", file=sys.stderr
        )
        for system in SYSTEMS:
            started = time.monotonic()
            row = run_system(cluster, system, steps, fsdp, bucket)
            rows.append({**row, "hosts": hosts, "rate_bytes": rate, "link_measured_bytes": measured})
            print(f"N={hosts} {system}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    base = {(r["hosts"], r["rate_bytes"]): r for r in rows if r["system"] == "gloo"}
    for r in rows:
        gloo = base[(r["hosts"], r["rate_bytes"])]
        r["x_gloo"] = r["seconds"] / gloo["seconds"]
        r["cpu_x_gloo"] = r["cpu_seconds"] / gloo["cpu_seconds"]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    head = [("mode", "l"), ("hosts", "r"), ("link", "r"), ("system", "l"), ("first step s", "r")]
    head += [("step s", "r"), ("x gloo", "r"), ("CPU s/step", "r"), ("CPU x gloo", "r")]
    head += [("MB sent/step/host", "r"), ("25 MiB bucket: backend / library s", "r")]
    body = []
    for r in rows:
        bucket = ""
        if "bucket_overhead" in r:
            bucket = f"{r['bucket_backend_seconds']:.3f} / {r['bucket_library_seconds']:.3f}"
            bucket += f" = {r['bucket_overhead']:.2f}x"
        body.append(
            [
                r["mode"],
                str(r["hosts"]),
                f"{r['rate_bytes'] / 1e6:.0f} MB/s",
                r["system"],
                f"{r['first_seconds']:.3f}",
                f"{r['seconds']:.3f}",
                f"{r['x_gloo']:.2f}",
                f"{r['cpu_seconds']:.2f}",
                f"{r['cpu_x_gloo']:.2f}",
                f"{r['sent_bytes'] / 1e6:.0f}",
                bucket,
            ]
        )
    return markdown_table(head, body)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--member":
        system, master, rank, world, steps, fsdp, bucket = args[1:8]
        member(system, master, int(rank), int(world), int(steps), fsdp == "1", bucket == "1")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", default="100MB,1GB", help="link rates, comma-separated (100MB, 1GB)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    ap.add_argument("--bucket", action="store_true", help="also time a 25 MiB bucket's allreduce")
    ap.add_argument("--prefix", default="hgd")
    ap.add_argument("--json")
    opts = ap.parse_args(args)
    rows: list[dict[str, Any]] = []
    for rate in opts.rate.split(","):
        rows += run(opts.hosts, parse_rate(rate), opts.steps, opts.fsdp, opts.bucket, opts.prefix)
        write_json(opts.json, {"command": " ".join(["python bench/ddp.py", *args]), "rows": rows})
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
