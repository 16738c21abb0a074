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

With ``--elastic`` the hoplite ranks also train in elastic mode (``hoplite_gpu.torch.Elastic``,
system ``hoplite-elastic``) for the steady step time, and ``--events`` runs elastic training
through a kill and a join (a standalone directory on host 0, so any rank may die): the last host's
rank SIGKILLs itself half way into step ``--kill-step``; once it is gone, a joiner starts on that
host (a restarted rank: a process group of its own, ``Elastic(join=True)``). It reports the
survivors' steady step, the time from the kill to their next completed step, the joiner's time
from its start (and from its ``Elastic``) to its first step against the state's size over the
link rate, the survivors' step while it joins, and a plot of their step times
(``--plot``, PNG).

With ``--one-host`` the ranks run as plain processes of this machine instead (no namespaces, no
link shaping: Gloo over loopback, the hoplite ranks with shared memory, as on one multi-GPU
server with host tensors).

The hoplite nodes are not told their address (rank 0's directory listens where the route to
``MASTER_ADDR`` leaves; the others find theirs the same way). Needs root and iproute2::

    python bench/ddp.py --hosts 4 --rate 100MB,1GB --steps 8 --bucket --json bench/results/ddp.json
    python bench/ddp.py --hosts 4 --rate 1GB --fsdp --steps 8 --json bench/results/fsdp.json
    python bench/ddp.py --hosts 4 --rate 100MB,1GB --steps 8 --elastic --events \
        --json bench/results/ddp_elastic.json --plot bench/results
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

BORN = time.monotonic()  # this process's start (a joiner's time to its first step counts from it)

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
ELASTIC = "hoplite-elastic"
BUCKET_BYTES = 25 << 20
DIRECTORY_PORT = 29599


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


def member(
    system: str,
    master: str,
    rank: int,
    world: int,
    steps: int,
    fsdp: bool,
    bucket: bool,
    plan: dict[str, Any] | None = None,
) -> None:
    """One rank: train ``steps`` steps, print one JSON line with its timestamps and counters.
    ``plan`` (elastic mode): the group's ``name``; ``victim``, ``kill_step``, ``kill_after``: who
    SIGKILLs itself when; ``joiner``: this process joins (its own address in ``own``)."""
    import datetime

    import torch
    import torch.distributed as dist

    plan = plan or {}
    torch.set_num_threads(1)
    joiner = bool(plan.get("joiner"))
    dist.init_process_group(
        "hoplite" if system == ELASTIC else system,
        init_method=f"tcp://{plan['own'] if joiner else master}:{PORT + 1 if joiner else PORT}",
        rank=0 if joiner else rank,
        world_size=1 if joiner else world,
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
        model = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=system != ELASTIC)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    elastic = None
    found: dict[str, Any] = {"rank": rank, "born": BORN}
    if system == ELASTIC:
        from hoplite_gpu.torch import Elastic

        found["elastic_at"] = time.monotonic()
        elastic = Elastic(model, optimizer=opt, name=plan.get("name", "ddp-bench"), join=joiner)
        found["join_seconds"] = elastic.join_seconds
        found["state_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    if not joiner:
        dist.barrier()
    first = elastic.steps if elastic is not None else 0
    ends, cpu, sent = [time.monotonic()], [cpu_seconds()], [_sent_bytes()]
    for step in range(first, steps):
        if rank == plan.get("victim") and step == plan.get("kill_step"):
            found["kill_at"] = time.monotonic() + float(plan.get("kill_after", 0.0))
            print(json.dumps(found), flush=True)  # what the driver learns of a rank about to die
            threading.Timer(
                float(plan.get("kill_after", 0.0)), os.kill, (os.getpid(), signal.SIGKILL)
            ).start()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        ends.append(time.monotonic())
        cpu.append(cpu_seconds())
        sent.append(_sent_bytes())
    found.update({"first": first, "ends": ends, "cpu": cpu, "sent": sent})
    if elastic is not None:
        found["reports"] = [[r.step, list(r.contributors)] for r in [elastic.last_step] if r]
    if bucket and system == "hoplite":
        found["bucket"] = _bucket_overhead()
    print(json.dumps(found), flush=True)
    if elastic is not None:
        elastic.close()
    if not (elastic is not None and plan.get("victim") is not None):  # (its group lost a rank)
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
class OneHost:
    """``--one-host``: the ranks as plain processes of this machine, in place of
    :class:`bench.cluster.Cluster` (the same ``hosts``, ``address`` and ``popen``)."""

    rate_bytes = 0.0

    def __init__(self, hosts: int) -> None:
        self.hosts = hosts

    def __enter__(self) -> OneHost:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def address(self, i: int) -> str:
        return "127.0.0.1"

    def popen(self, i: int, argv: list[str], env: dict[str, str] | None = None, **kwargs: Any) -> Any:
        """``argv`` here, with ``env`` but for what sets hosts apart (shared memory off, eth0)."""
        mine = {
            k: v for k, v in (env or {}).items() if k not in ("HOPLITE_SHARED_MEMORY", "GLOO_SOCKET_IFNAME")
        }
        return subprocess.Popen(argv, env={**os.environ, **mine, "GLOO_SOCKET_IFNAME": "lo"}, **kwargs)


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


def run(
    hosts: int,
    rate: float,
    steps: int,
    fsdp: bool,
    bucket: bool,
    prefix: str,
    systems: tuple[str, ...] = SYSTEMS,
    events: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Every system in one cluster (``rate`` 0: on this machine, :class:`OneHost`; then, with
    ``events``, elastic training through a kill and a join: :func:`run_events`'s arguments)."""
    from bench.cluster import Cluster, link_throughput

    rows = []
    with OneHost(hosts) if not rate else Cluster(hosts, rate, prefix=prefix) as cluster:
        measured = link_throughput(cluster) if rate else 0.0
        print(
            f"N={hosts} link: {measured / 1e6:.1f} MB/s measured ({rate / 1e6:.0f} MB/s set)", file=sys.stderr
        )
        for system in systems:
            started = time.monotonic()
            row = run_system(cluster, system, steps, fsdp, bucket)
            rows.append({**row, "hosts": hosts, "rate_bytes": rate, "link_measured_bytes": measured})
            print(f"N={hosts} {system}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        if events is not None:
            row = run_events(cluster, **events)
            rows.append({**row, "hosts": hosts, "rate_bytes": rate, "link_measured_bytes": measured})
    base = {(r["hosts"], r["rate_bytes"]): r for r in rows if r["system"] == "gloo"}
    for r in rows:
        gloo = base.get((r["hosts"], r["rate_bytes"]))
        if gloo is None or r["mode"] == "events":
            continue
        r["x_gloo"] = r["seconds"] / gloo["seconds"]
        r["cpu_x_gloo"] = r["cpu_seconds"] / gloo["cpu_seconds"]
    return rows


def run_events(cluster: Any, steps: int, kill_step: int) -> dict[str, Any]:
    """Elastic training on every host with a standalone directory on host 0: the last host's
    rank dies half way into ``kill_step``, and a joiner starts on that host once it is gone."""
    token = secrets.token_urlsafe(24)
    where = f"{cluster.address(0)}:{DIRECTORY_PORT}"
    directory = cluster.popen(
        0,
        [
            sys.executable,
            "-m",
            "hoplite_gpu.cli",
            "directory",
            "--host",
            cluster.address(0),
            "--port",
            str(DIRECTORY_PORT),
        ],
        env={"HOPLITE_TOKEN": token},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert directory.stdout is not None and "listening" in directory.stdout.readline()
        env = {**HOST_ENV, "HOPLITE_DIRECTORY": where, "HOPLITE_TOKEN": token}
        victim = cluster.hosts - 1
        plan = {"name": f"ddp-bench-{secrets.token_hex(4)}", "victim": victim, "kill_step": kill_step}
        plan["kill_after"] = 0.5 * _steady_guess(cluster.rate_bytes)
        argv = [sys.executable, os.path.abspath(__file__), "--member", ELASTIC, cluster.address(0)]
        procs = []
        for rank in range(cluster.hosts):
            args = [*argv, str(rank), str(cluster.hosts), str(steps), "0", "0", json.dumps(plan)]
            procs.append(cluster.popen(rank, args, env=env, stdout=subprocess.PIPE, text=True))
        victim_out, _ = procs[victim].communicate(timeout=1800)
        joiner_plan = {"name": plan["name"], "joiner": True, "own": cluster.address(victim)}
        args = [*argv, str(cluster.hosts), str(cluster.hosts), str(steps), "0", "0", json.dumps(joiner_plan)]
        joiner = cluster.popen(victim, args, env=env, stdout=subprocess.PIPE, text=True)
        outs = [proc.communicate(timeout=1800)[0] for proc in [*procs[:victim], joiner]]
    finally:
        directory.send_signal(signal.SIGTERM)
        directory.wait(30)
    killed = json.loads([line for line in victim_out.splitlines() if line.startswith("{")][-1])
    found = [json.loads([line for line in out.splitlines() if line.startswith("{")][-1]) for out in outs]
    return events_row(found[:-1], found[-1], killed["kill_at"], cluster.rate_bytes, steps)


def _steady_guess(rate: float) -> float:
    """About a step's seconds at ``rate`` (bench/pages/ddp.md's runs), to kill half way into one."""
    return 2.0 if rate < 500e6 else 0.9


def events_row(
    survivors: list[dict[str, Any]], joiner: dict[str, Any], kill_at: float, rate: float, steps: int
) -> dict[str, Any]:
    """The measures of an events run (see the module's docstring)."""
    ends = [max(r["ends"][k] for r in survivors) for k in range(steps + 1)]  # step k ends at ends[k+1]
    spans = [b - a for a, b in itertools.pairwise(ends)]
    killed = next(k for k in range(steps) if ends[k + 1] > kill_at)
    joined = int(joiner["first"])
    steady = statistics.median(spans[1:killed] + spans[joined + 1 :])
    state = float(joiner["state_bytes"])
    first_end = joiner["ends"][1]
    return {
        "system": ELASTIC,
        "mode": "events",
        "step_seconds": spans,
        "steady_seconds": steady,
        "kill_step": killed,
        "kill_to_next_step_seconds": ends[killed + 1] - kill_at,
        "kill_step_x_steady": spans[killed] / steady,
        "join_step": joined,
        "join_step_x_steady": spans[joined] / steady,
        "joiner_start_to_first_step_seconds": first_end - joiner["born"],
        "joiner_elastic_to_first_step_seconds": first_end - joiner["elastic_at"],
        "joiner_admitted_seconds": joiner["join_seconds"].get("admitted"),
        "joiner_state_seconds": joiner["join_seconds"].get("state"),
        "joiner_state_published_seconds": joiner["join_seconds"].get("published"),
        "joiner_state_pulled_seconds": joiner["join_seconds"].get("pulled"),
        "joiner_state_loaded_seconds": joiner["join_seconds"].get("loaded"),
        "state_bytes": state,
        "state_x_link_bound": joiner["join_seconds"].get("state", 0.0) / (state / rate),
        "pulled_x_link_bound": joiner["join_seconds"].get("pulled", 0.0) / (state / rate),
    }


def plot_events(rows: list[dict[str, Any]], directory: str) -> list[str]:
    """``ddp_elastic_events.png``: the survivors' step times of each events run, the kill and the
    join marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in rows if r["mode"] == "events"]
    if not runs:
        return []
    fig, axes = plt.subplots(len(runs), 1, figsize=(7, 2.8 * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs, strict=True):
        ax.plot(range(len(r["step_seconds"])), r["step_seconds"], "o-", label="step (slowest survivor)")
        ax.axvline(r["kill_step"], color="red", linestyle="--", label="rank 3 SIGKILLed")
        ax.axvline(r["join_step"], color="green", linestyle="--", label="joiner's first step")
        ax.set_title(f"elastic DDP, {r['hosts']} hosts, {r['rate_bytes'] / 1e6:.0f} MB/s links")
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(directory, "ddp_elastic_events.png")
    fig.savefig(path, dpi=90)
    return [path]


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    head = [("mode", "l"), ("hosts", "r"), ("link", "r"), ("system", "l"), ("first step s", "r")]
    head += [("step s", "r"), ("x gloo", "r"), ("CPU s/step", "r"), ("CPU x gloo", "r")]
    head += [("MB sent/step/host", "r"), ("25 MiB bucket: backend / library s", "r")]
    body = []
    for r in rows:
        if r["mode"] == "events":
            continue
        bucket = ""
        if "bucket_overhead" in r:
            bucket = f"{r['bucket_backend_seconds']:.3f} / {r['bucket_library_seconds']:.3f}"
            bucket += f" = {r['bucket_overhead']:.2f}x"
        body.append(
            [
                r["mode"],
                str(r["hosts"]),
                f"{r['rate_bytes'] / 1e6:.0f} MB/s" if r["rate_bytes"] else "one host",
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
        plan = json.loads(args[8]) if len(args) > 8 else None
        member(system, master, int(rank), int(world), int(steps), fsdp == "1", bucket == "1", plan)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", default="100MB,1GB", help="link rates, comma-separated (100MB, 1GB)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    ap.add_argument("--bucket", action="store_true", help="also time a 25 MiB bucket's allreduce")
    ap.add_argument("--elastic", action="store_true", help="also train in elastic mode")
    ap.add_argument("--events", action="store_true", help="elastic training through a kill and a join")
    ap.add_argument("--event-steps", type=int, default=24, help="steps of the events run")
    ap.add_argument("--kill-step", type=int, default=6)
    ap.add_argument("--plot", help="directory for the events run's PNG")
    ap.add_argument("--one-host", action="store_true", help="the ranks on this machine (no --rate)")
    ap.add_argument("--prefix", default="hgd")
    ap.add_argument("--json")
    opts = ap.parse_args(args)
    if opts.one_host and opts.events:
        ap.error("--events needs the emulated cluster (its links' rate): not with --one-host")
    systems = (SYSTEMS[0], ELASTIC, *SYSTEMS[1:]) if opts.elastic else SYSTEMS
    events = {"steps": opts.event_steps, "kill_step": opts.kill_step} if opts.events else None
    rows: list[dict[str, Any]] = []
    for rate in ["0"] if opts.one_host else opts.rate.split(","):
        rate_bytes = parse_rate(rate) if rate != "0" else 0.0
        rows += run(opts.hosts, rate_bytes, opts.steps, opts.fsdp, opts.bucket, opts.prefix, systems, events)
        write_json(opts.json, {"command": " ".join(["python bench/ddp.py", *args]), "rows": rows})
    print(table(rows))
    for r in rows:
        if r["mode"] == "events":
            print(json.dumps({k: v for k, v in r.items() if k != "step_seconds"}))
    if opts.plot:
        print(plot_events(rows, opts.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
