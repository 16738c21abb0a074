"""Weight sync for RL on the emulated cluster (:mod:`bench.cluster`): a trainer on host 0 sends a
transformer-like state dict to N rollout engines, one per host, as RL frameworks do after each
training step, and the engines fill their own tensors with it.

* ``hoplite_gpu``: :class:`hoplite_gpu.weights.WeightPublisher` / ``WeightSubscriber`` (engines
  wait in ``receive(version=v, into=...)`` before the trainer publishes; the default bucket size);
* ``gloo``: what vLLM's ``nccl`` weight-transfer backend does, on CPU: ``torch.distributed``
  (gloo) broadcasts of the tensors packed into buckets of ``--gloo-bucket`` bytes (1 GiB in vLLM;
  here the state's size, capped there), unpacked into the engines' tensors.
* ``ray`` and ``rdt``: a trainer actor and engine actors, one Ray node per host
  (:class:`bench.peers.ray_peer.RayCluster`): the object store (``ray.put`` once, ``ray.get`` in
  every engine) and Ray Direct Transport over Gloo (:mod:`bench.workloads.weight_sync_ray`).

Timed from the trainer's start (after a barrier; its packing included) until the last engine has
its tensors filled, each round a new version; no warm-up round. Every round's tensors are checked
(each tensor is filled with its own value per version). Ideal: ``S / B`` (the trainer's link carries
the state once). Needs root and iproute2; gloo needs torch (``make bench-cluster``).

    python bench/weight_sync.py --engines 2,4,8 --rate 100MB,1GB --state 512MiB --repeat 3 \\
        --json bench/results/weight_sync.json
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cluster import Cluster, link_throughput
from bench.common import cluster_options, format_size, markdown_table, parse_rate, parse_size, write_json
from bench.netbench import Member

DIRECTORY_PORT = 7071
GLOO_PORT = 29501
HOST_ENV = {"UCX_TLS": "tcp", "HOPLITE_SHARED_MEMORY": "0", "GLOO_SOCKET_IFNAME": "eth0"}
SYSTEMS = ("hoplite_gpu", "gloo")
RAY_SYSTEMS = ("ray", "rdt")  # through Ray actors (bench/workloads/weight_sync_ray.py)


def layout(total: int, layers: int = 16) -> list[tuple[str, tuple[int, ...]]]:
    """Names and float32 shapes of a transformer of about ``total`` bytes: per layer q/k/v/o, an
    MLP of 4x width, norms and biases (12 tensors), plus embedding and head: about 200 tensors."""
    width = max(8, int((total / 4 / (12 * layers + 2 * 8)) ** 0.5))
    vocab = 8 * width
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed", (vocab, width))]
    for i in range(layers):
        shapes += [(f"l{i}.{p}", (width, width)) for p in ("q", "k", "v", "o")]
        shapes += [(f"l{i}.up", (4 * width, width)), (f"l{i}.down", (width, 4 * width))]
        shapes += [(f"l{i}.{p}", (width,)) for p in ("ln1", "ln2", "bq", "bk", "bv")]
        shapes += [(f"l{i}.bup", (4 * width,))]
    return [*shapes, ("head", (vocab, width))]


def new_state(shapes: Sequence[tuple[str, Sequence[int]]]) -> dict[str, Any]:
    """Zeroed float32 arrays of ``shapes`` (from :func:`layout`), by name."""
    import numpy as np

    return {name: np.zeros(shape, np.float32) for name, shape in shapes}


def fill_version(state: dict[str, Any], version: int) -> None:
    """Fill each array with its own value for ``version`` (what :func:`holds_version` checks)."""
    for i, arr in enumerate(state.values()):
        arr.fill(version * 1000 + i)


def holds_version(state: dict[str, Any], version: int) -> bool:
    """Whether every array holds its value of ``version`` (see :func:`fill_version`)."""
    return all(
        arr.size == 0 or (arr.flat[0] == arr.flat[-1] == version * 1000 + i)
        for i, arr in enumerate(state.values())
    )


def _rss() -> int:
    """This process's resident memory, bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _commands(send: Any) -> Iterator[Any]:
    """The commands on stdin, but ``"rss"``, which is answered here."""
    for line in sys.stdin:
        command = json.loads(line)
        if command == "rss":
            send(_rss())
        else:
            yield command


def _member(system: str, address: str, rank: int, world: int, total: int) -> None:
    """One host's process: JSON commands on stdin, JSON answers on stdout."""

    def send(obj: Any) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    state = new_state(layout(total))
    if system == "gloo":
        _gloo_member(address, rank, world, state, send)
        return
    import hoplite_gpu as hg
    from hoplite_gpu.weights import WeightPublisher, WeightSubscriber

    node = hg.connect(address, token=os.environ["HOPLITE_TOKEN"])
    pub = WeightPublisher(node, "policy", bucket_bytes=int(os.environ["BUCKET"])) if rank == 0 else None
    sub = WeightSubscriber(node, "policy") if rank else None
    send("ready")
    try:
        for version in _commands(send):
            if isinstance(version, list) and version[0] == "arm":  # die part way through a receive
                from hoplite_gpu import faults

                faults.arm(version[1])
                send("armed")
                continue
            if isinstance(version, list):  # ["late", delay, v]: join a round already under way
                assert sub is not None
                send("waiting")
                time.sleep(version[1])  # where in the round the joiner comes (a scenario, not a wait)
                joined = time.monotonic()  # then it wants the current version: v, once announced
                got, _ = sub.receive(sub.latest(600, newer_than=version[2] - 1), into=state, timeout=600)
                send([joined, time.monotonic(), holds_version(state, got), got])
                continue
            if pub is not None:
                fill_version(state, version)
                send("filled")
                json.loads(sys.stdin.readline())  # go: every engine waits in receive
                start = time.monotonic()
                pub.publish(state, version)
                send([start, time.monotonic() - start])
            else:
                assert sub is not None
                send("waiting")
                got, _ = sub.receive(version, into=state, timeout=600)
                send([time.monotonic(), got == version and holds_version(state, version)])
    finally:
        if pub is not None:
            pub.close()
        node.close()


def _gloo_member(address: str, rank: int, world: int, state: dict[str, Any], send: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{address}:{GLOO_PORT}", rank=rank, world_size=world)
    bucket_bytes = int(os.environ["GLOO_BUCKET"])
    tensors = [torch.from_numpy(a) for a in state.values()]
    groups: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:  # pack in order, as vLLM's packed broadcast does
        if groups[-1] and size + t.numel() * 4 > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.numel() * 4
    send("ready")
    try:
        for version in _commands(send):
            if rank == 0:
                fill_version(state, version)
            dist.barrier()
            start = time.monotonic()
            for group in groups:
                flat = torch.cat([t.reshape(-1) for t in group]) if rank == 0 else None
                if flat is None:
                    flat = torch.empty(sum(t.numel() for t in group), dtype=torch.float32)
                dist.broadcast(flat, 0)
                if rank:
                    offset = 0
                    for t in group:
                        t.reshape(-1).copy_(flat[offset : offset + t.numel()])
                        offset += t.numel()
            end = time.monotonic()
            send([start, 0.0] if rank == 0 else [end, holds_version(state, version)])
    finally:
        dist.destroy_process_group()


class _Host(Member):
    """A host's process, driven over its stdin/stdout like a netbench member."""

    def __init__(
        self,
        cluster: Cluster,
        system: str,
        rank: int,
        address: str,
        env: dict[str, str],
        total: int,
        world: int,
        host: int,
        own_shm: bool = False,
    ) -> None:
        argv = [sys.executable, os.path.abspath(__file__), "--member", system, address, str(rank)]
        argv += [str(world), str(total)]
        if own_shm:  # this host's /dev/shm: a directory of the machine's, bound over it
            shm = _shm_dir(cluster, host)
            os.makedirs(shm, exist_ok=True)
            argv = ["sh", "-c", f'mount --bind {shm} /dev/shm && exec "$@"', "sh", *argv]
        self.proc = cluster.popen(
            host, argv, env={**HOST_ENV, **env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )


def _shm_dir(cluster: Cluster, host: int) -> str:
    """Host ``host``'s shared memory with ``--per-host`` above 1. ``ip netns exec`` gives each
    process a mount namespace of its own, where it binds this over ``/dev/shm``: the processes of
    one host then share memory (the same ``host_key``), those of two hosts do not."""
    return f"/dev/shm/{cluster.prefix}-shm{host}"


def _round(system: str, hosts: list[_Host], version: int) -> tuple[float, float]:
    """One version to every engine: its time, and how long the trainer's own call took (the
    packing and the puts; 0 for gloo, whose broadcasts are the whole round)."""
    for h in hosts:
        h.send(version)
    if system == "hoplite_gpu":
        assert [h.recv() for h in hosts] == ["filled"] + ["waiting"] * (len(hosts) - 1)
        hosts[0].send("go")
    start, publish = hosts[0].recv()
    ends = [h.recv() for h in hosts[1:]]
    if not all(ok for _, ok in ends):
        raise AssertionError(f"{system}: an engine got wrong weights in version {version}")
    return float(max(end for end, _ in ends) - start), publish


def _fault_round(
    hosts: list[_Host], version: int, victim: int | None, joiner: _Host | None, delay: float
) -> Any:
    """A round in which engine ``victim`` (armed before) dies, or ``joiner`` joins ``delay``
    seconds after the trainer's start: the survivors' time, and the joiner's from its join."""
    for h in hosts:
        h.send(version)
    if joiner is not None:
        joiner.send(["late", delay, version])
    assert [h.recv() for h in hosts] == ["filled"] + ["waiting"] * (len(hosts) - 1)
    if joiner is not None:
        assert joiner.recv() == "waiting"
    hosts[0].send("go")
    start, _ = hosts[0].recv()
    ends = [h.recv() for i, h in enumerate(hosts) if i and i != victim]
    if not all(ok for _, ok in ends):
        raise AssertionError(f"an engine got wrong weights in version {version}")
    if victim is not None:
        hosts[victim].proc.wait(60)
    late = None
    if joiner is not None:
        joined, end, ok, got = joiner.recv()
        if not ok or got != version:
            raise AssertionError(f"the late joiner got version {got} (wrong: {not ok}), not {version}")
        late = end - joined
    return float(max(end for end, _ in ends) - start), late


@contextlib.contextmanager
def _members(
    cluster: Cluster, system: str, env: dict[str, str], total: int, per_host: int = 1
) -> Iterator[list[_Host]]:
    """The trainer of ``system`` on host 0 and ``per_host`` engines on every other host of
    ``cluster`` (and hoplite_gpu's directory on host 0), all started; on leaving, their stdin
    closed (they exit) and, last, the directory stopped. With ``per_host`` above 1, hoplite_gpu's
    members share memory with those of their host, as on a real machine."""
    from hoplite_gpu.auth import new_token
    from hoplite_gpu.directory import DirectoryProcess

    directory = None
    address = cluster.address(0)
    if system == "hoplite_gpu":
        token = new_token()
        directory = DirectoryProcess(
            token, host=address, port=DIRECTORY_PORT, env=HOST_ENV, wrap=cluster.command(0, [])
        )
        directory.start()
        address, env = directory.address, {**env, "HOPLITE_TOKEN": token}
    members: list[_Host] = []
    world = 1 + (cluster.hosts - 1) * per_host
    own_shm = per_host > 1 and directory is not None
    if own_shm:
        env = {**env, "HOPLITE_SHARED_MEMORY": "1"}
    try:
        for r in range(world):
            host = 0 if r == 0 else 1 + (r - 1) // per_host
            extra = {"HOPLITE_LISTEN_HOST": cluster.address(host)} if directory is not None else {}
            members.append(_Host(cluster, system, r, address, {**env, **extra}, total, world, host, own_shm))
        for m in members:
            if m.recv() != "ready":
                raise RuntimeError("a member did not start")
        yield members
    finally:
        for m in members:
            if m.proc.stdin is not None:
                with contextlib.suppress(OSError):  # a killed engine's pipe
                    m.proc.stdin.close()
        for m in members:
            try:
                m.proc.wait(30)
            except subprocess.TimeoutExpired:
                m.proc.kill()
        if directory is not None:
            directory.stop()
        for host in range(cluster.hosts) if own_shm else ():
            shutil.rmtree(_shm_dir(cluster, host), ignore_errors=True)


def run_faults(engines: int, rate: float, total: int, prefix: str, bucket: int) -> dict[str, Any]:
    """hoplite_gpu only: three warm rounds; then one in which an engine is SIGKILLed half way
    through its first bucket (the others' time); then one that a new engine joins half way
    through and wants the version being sent (its time from joining until it has it, the others'
    time)."""
    from hoplite_gpu.weights.manifest import object_id

    ideal = total / rate
    with Cluster(engines + 2, rate, prefix=prefix) as cluster:
        with _members(cluster, "hoplite_gpu", {"BUCKET": str(bucket), "GLOO_BUCKET": "0"}, total) as members:
            hosts, joiner = members[:-1], members[-1]
            warm = [_round("hoplite_gpu", hosts, v)[0] for v in (1, 2, 3)]
            hosts[1].send(["arm", f"receive:{object_id('policy', 'bucket', 4, 0, 0).hex()}:0.5:KILL"])
            assert hosts[1].recv() == "armed"
            killed, _ = _fault_round(hosts, 4, 1, None, 0.0)
            survivors = [h for i, h in enumerate(hosts) if i != 1]
            others, late = _fault_round(survivors, 5, None, joiner, 0.5 * ideal)
    row = {
        "engines": engines,
        "rate_bytes": rate,
        "state_bytes": total,
        "ideal_seconds": ideal,
        "warm_rounds": warm,
        "killed_round_seconds": killed,
        "killed_x_ideal": killed / ideal,
        "late_joiner_seconds": late,
        "late_joiner_x_ideal": late / ideal,
        "late_round_others_seconds": others,
    }
    print(
        f"faults N={engines} @ {rate / 1e6:.0f} MB/s: warm rounds {', '.join(f'{t:.3f}' for t in warm)}; "
        f"an engine killed: the others {killed:.3f} s ({row['killed_x_ideal']:.2f}x S/B); "
        f"a late joiner current {late:.3f} s after joining ({row['late_joiner_x_ideal']:.2f}x S/B), "
        f"the others {others:.3f} s",
        file=sys.stderr,
        flush=True,
    )
    return row


def _ray_driver(config: dict[str, Any]) -> None:
    """In host 0's namespace: the trainer there, engine ``i`` on host ``i + 1``."""
    from bench.peers.ray_peer import drive_variants, on_host
    from bench.workloads import weight_sync_ray

    drive_variants(
        config,
        lambda spec: weight_sync_ray.run(
            spec["system"],
            [(name, list(shape)) for name, shape in layout(spec["total"])],
            spec["repeat"],
            HOST_ENV,
            on_host(0),
            [on_host(i + 1) for i in range(spec["engines"])],
        ),
    )


def _run_ray(system: str, engines: int, rate: float, total: int, repeat: int, prefix: str) -> dict[str, Any]:
    """``run`` of a Ray system: a Ray node per host, the rounds driven from host 0's namespace."""
    from bench.peers.ray_peer import variants_on_cluster

    spec = {"name": system, "system": system, "engines": engines, "total": total, "repeat": repeat}
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    result = variants_on_cluster(
        engines + 1, rate, prefix, [spec], __file__, max(1 << 30, 3 * total), 1800, lambda _: None, env
    )
    record = result["records"][0]
    if "error" in record:
        raise RuntimeError(f"{system}: {record['error']}")
    return {**record, "link_measured_bytes": result["link_bytes_per_s"], "rss_trainer_bytes": None}


def run(
    system: str,
    engines: int,
    rate: float,
    total: int,
    repeat: int,
    prefix: str,
    buckets: tuple[int, int],
    per_host: int = 1,
) -> dict[str, Any]:
    """``repeat`` rounds of one system with ``engines`` engines (``per_host`` on each host but the
    trainer's); the median, against ``S / B``."""
    if engines % per_host:
        raise ValueError(f"{engines} engines do not fill hosts of {per_host}")
    if system in RAY_SYSTEMS:
        if per_host != 1:
            raise ValueError("the Ray systems place one engine per host")
        ray_row = _run_ray(system, engines, rate, total, repeat, prefix)
        ray_row.update(
            rate_bytes=rate, state_bytes=total, tensors=len(layout(total)), ideal_seconds=total / rate
        )
        ray_row.update(x_ideal=ray_row["seconds"] / ray_row["ideal_seconds"], rss_engine_bytes=None)
        print(
            f"{system} N={engines} @ {rate / 1e6:.0f} MB/s: {ray_row['seconds']:.3f} s, "
            f"{ray_row['x_ideal']:.2f}x S/B (rounds {', '.join(f'{t:.3f}' for t in ray_row['rounds'])})",
            file=sys.stderr,
            flush=True,
        )
        return ray_row
    with Cluster(engines // per_host + 1, rate, prefix=prefix) as cluster:
        measured = link_throughput(cluster)
        env = {"BUCKET": str(buckets[0]), "GLOO_BUCKET": str(buckets[1])}
        with _members(cluster, system, env, total, per_host) as members:
            rounds = [_round(system, members, v) for v in range(1, repeat + 1)]
            for m in members:
                m.send("rss")
            rss = [m.recv() for m in members]
    ideal = total / rate
    times = [t for t, _ in rounds]
    row = {
        "system": system,
        "engines": engines,
        "engines_per_host": per_host,
        "rate_bytes": rate,
        "link_measured_bytes": measured,
        "state_bytes": total,
        "tensors": len(layout(total)),
        "seconds": statistics.median(times),
        "rounds": times,
        "publish_rounds": [p for _, p in rounds],
        "ideal_seconds": ideal,
        "x_ideal": statistics.median(times) / ideal,
        # resident memory after the rounds: the trainer's, and the largest engine's
        "rss_trainer_bytes": rss[0],
        "rss_engine_bytes": max(rss[1:]),
    }
    print(
        f"{system} N={engines} @ {rate / 1e6:.0f} MB/s: {row['seconds']:.3f} s, {row['x_ideal']:.2f}x S/B "
        f"(rounds {', '.join(f'{t:.3f}' for t in times)}; the trainer's call "
        f"{', '.join(f'{p:.3f}' for p in row['publish_rounds'])}; resident MiB: trainer "
        f"{rss[0] >> 20}, engine {max(rss[1:]) >> 20})",
        file=sys.stderr,
        flush=True,
    )
    return row


STYLE = {"hoplite_gpu": "o-", "gloo": "^-", "ray": "D-", "rdt": "s-"}


def plot(rows: list[dict[str, Any]], directory: str) -> list[str]:
    """``weight_sync_<rate>.png`` for each link rate of ``rows``: seconds to bring every engine to
    a version against N, one line per system, and ``S / B`` dashed; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for rate in sorted({r["rate_bytes"] for r in rows}):
        mine = [r for r in rows if r["rate_bytes"] == rate]
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        counts = sorted({r["engines"] for r in mine})
        ax.plot(counts, [mine[0]["ideal_seconds"]] * len(counts), "k--", label="S/B")
        for system in dict.fromkeys(r["system"] for r in mine):
            points = sorted((r["engines"], r["seconds"]) for r in mine if r["system"] == system)
            ax.plot(*zip(*points, strict=True), STYLE.get(system, "x-"), label=system)
        ax.set_xlabel("rollout engines")
        ax.set_ylabel("seconds to a new version on every engine")
        ax.set_title(f"weight sync, {format_size(mine[0]['state_bytes'])}, {rate / 1e6:.0f} MB/s links")
        ax.set_xticks(counts)
        ax.set_ylim(bottom=0)
        ax.legend()
        path = os.path.join(directory, f"weight_sync_{rate / 1e6:.0f}MBps.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--member"]:
        _member(argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5]))
        return 0
    if argv[:1] == ["--driver"]:  # a Ray system's driver, in host 0's namespace
        _ray_driver(json.loads(argv[1]))
        return 0
    ap = cluster_options(__doc__ or "", prefix="hgw", hosts=0)
    ap.set_defaults(rate="100MB,1GB")
    ap.add_argument("--engines", default="2,4,8", help="rollout engines (at most 15 hosts of them)")
    ap.add_argument(
        "--per-host", type=int, default=1, help="engines per host (above 1: they share the host's memory)"
    )
    ap.add_argument("--state", default="512MiB", help="size of the state dict")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"some of {','.join(SYSTEMS + RAY_SYSTEMS)}")
    ap.add_argument("--bucket", default="64MiB", help="hoplite_gpu's bucket size")
    ap.add_argument("--gloo-bucket", default="1GiB", help="gloo's packed bucket size")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--plot", metavar="DIR", help="also draw weight_sync_<rate>.png there")
    ap.add_argument(
        "--faults",
        action="store_true",
        help="instead: an engine killed mid-sync, a late joiner (hoplite_gpu)",
    )
    args = ap.parse_args(argv)
    total = parse_size(args.state)
    for key in ("HOPLITE_LISTEN_HOST", "HOPLITE_ADVERTISE_HOST"):
        os.environ.pop(key, None)
    buckets = (parse_size(args.bucket), parse_size(args.gloo_bucket))
    if args.faults:
        rows = [
            run_faults(int(n), parse_rate(rate), total, args.prefix, buckets[0])
            for rate in args.rate.split(",")
            for n in args.engines.split(",")
        ]
        write_json(args.json, rows)
        return 0
    rows = [
        run(system, int(n), parse_rate(rate), total, args.repeat, args.prefix, buckets, args.per_host)
        for rate in args.rate.split(",")
        for n in args.engines.split(",")
        for system in args.systems.split(",")
    ]
    by = {(r["rate_bytes"], r["engines"], r["system"]): r for r in rows}
    table = []
    peers = ("gloo", "ray", "rdt")
    for r in rows:
        ratios = []
        for peer in peers:
            other = by.get((r["rate_bytes"], r["engines"], peer))
            ratios.append(f"{r['seconds'] / other['seconds']:.2f}x" if other else "-")
        table.append(
            [
                r["system"],
                str(r["engines"]),
                f"{r['rate_bytes'] / 1e6:.0f} MB/s",
                format_size(r["state_bytes"]),
                f"{r['seconds']:.3f}",
                f"{r['x_ideal']:.2f}x",
                *ratios,
            ]
        )
    columns = [("system", "l"), ("N", "r"), ("link", "r"), ("state", "r"), ("seconds", "r"), ("x S/B", "r")]
    print(markdown_table([*columns, *((f"x {peer}", "r") for peer in peers)], table))
    if args.plot:
        print("\n".join(plot(rows, args.plot)), file=sys.stderr)
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
