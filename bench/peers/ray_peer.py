"""Ray as a peer of the emulated-cluster benchmark: collectives built from ``ray.put`` and ``ray.get``
between actors, as the Ray baseline of the Hoplite paper (Zhuang et al., SIGCOMM 2021) did them.

One Ray node per host of the :class:`bench.cluster.Cluster`: the head (``ray start --head``) in host
0's namespace, bound to its ``10.77.0.1`` address, and a node joining it in every other namespace,
each with a custom resource ``host<i>`` so that one actor lands on each host, and a temporary
directory of its own so that nodes of one machine do not collide. A driver in host 0's namespace
runs the benchmark and reports JSON lines on its stdout. One actor per host holds a float32 array of
ones (the whole ``S`` bytes, and its ``S/N`` piece for the gathers):

* broadcast: actor 0 puts its array (the method returns the ObjectRef inside a list, so Ray passes
  the reference on without resolving it), every other actor gets it;
* reduce: every other actor puts its array; actor 0 gets them one by one and adds them to a copy of
  its own;
* allreduce: that reduce, then actor 0 puts the sum and every other actor gets it;
* gather: every actor puts its piece, actor 0 gets all ``N``; allgather: every actor gets all ``N``.

Timing as the other systems of the benchmark. Before each round every actor has finished the
previous one (the driver waited for a trivial call on each, which also returns the actor's span), and
the links carry no bulk traffic any more (the parent watches the bridge's counters: Ray re-requests a
pull that takes longer than its ``object_manager_pull_timeout_ms``, and the duplicate pushes can
outlive the round); then the driver issues the round's calls. Each actor records
``time.monotonic()`` when its first call of the round starts and when its last one ends; the round
is ``max(end) - max(start)`` (:func:`bench.collectives.round_times`). Getters receive the producer's
reference boxed in a list, so their call starts at once and its span includes waiting for the
producer's ``put``, as a receiver's span does in MPI. A getter's array is the zero-copy view of its
node's object store (the object has crossed the link when ``ray.get`` returns). Every object goes
out of scope at the end of its round, so the store frees it. Results are checked on the first round
of each (op, size).

    python bench/peers/ray_peer.py --hosts 4 --rate 100MB --sizes 1KiB,1MiB,64MiB

Needs root, iproute2 and ``pip install ray==2.60.0``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

if TYPE_CHECKING:
    from bench.cluster import Cluster

NAME = "ray"
OPS = ("broadcast", "reduce", "allreduce", "gather", "allgather")
GCS_PORT = 6380
#: Every Ray process of the cluster: no usage report (there is no network), unbuffered output, and a
#: node stops at once on SIGTERM (by default it first drains for up to 30 s).
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "PYTHONUNBUFFERED": "1",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    # hoplite_gpu in Ray workers (bench/asgd.py, bench/serving.py): as bench/netbench.py's hosts,
    # TCP only and no shared memory (the namespaces share /dev/shm; a real cluster does not).
    "UCX_TLS": "tcp",
    "HOPLITE_SHARED_MEMORY": "0",
    # Once any local ray.init has written ~/.ray/auth_token, `ray start --head` turns token
    # authentication on but joining nodes do not, and the head refuses them.
    "RAY_AUTH_MODE": "disabled",
}
#: Before each round the links count as quiet once all ports together carry less than this in 0.1 s,
#: twice in a row (Ray's own control traffic is a few kB/s per node).
QUIET_BYTES = 20_000
#: The driver marks its report lines with this, so that anything else Ray prints is ignored.
MARK = "@@ray_peer "


def object_store_bytes(sizes: list[int]) -> int:
    """Object store of each node: room for six objects of the largest size (a reduce root holds its
    own, one being fetched, the sum and last round's copies not yet freed), 512 MiB to 2 GiB."""
    return min(2 << 30, max(512 << 20, 6 * max(sizes)))


def piece_bytes(size: int, world: int) -> int:
    """Bytes each member contributes to a gather of ``size`` bytes in all (a multiple of 4)."""
    return size // world // 4 * 4


# ---------------------------------------------------------------------------------------- the actor
class Member:
    """One host's member (made a Ray actor by the driver): holds its arrays, records its span of each
    round, and checks what it receives when asked to."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world
        self.whole = np.ones(0, np.float32)
        self.piece = np.ones(0, np.float32)
        self.span: list[float] | None = None

    def prepare(self, size: int) -> str:
        """Allocate the arrays for ``size`` bytes (all ones); returns the address of its node."""
        import ray

        self.whole = np.ones(size // 4, np.float32)
        self.piece = np.ones(piece_bytes(size, self.world) // 4, np.float32)
        return str(ray.util.get_node_ip_address())

    def barrier(self) -> list[float] | None:
        """The barrier's trivial call: returns the span of the round before it, and forgets it."""
        span, self.span = self.span, None
        return span

    def _begin(self) -> None:
        if self.span is None:
            self.span = [time.monotonic(), 0.0]

    def _end(self) -> None:
        assert self.span is not None
        self.span[1] = time.monotonic()

    def put(self, piece: bool) -> list[Any]:
        """Put the whole array or its piece; returns its ObjectRef in a list (not resolved when passed)."""
        import ray

        self._begin()
        ref = ray.put(self.piece if piece else self.whole)
        self._end()
        return [ref]

    def get_one(self, box: list[Any], check: float | None) -> None:
        """Get the object whose boxed reference the ``box[0]`` call returns; check that it holds
        ``check`` everywhere (unless None)."""
        import ray

        self._begin()
        arr = ray.get(ray.get(box[0])[0])
        self._end()
        if check is not None:
            _verify(arr, self.whole.size, check, f"rank {self.rank}")

    def reduce_from(self, boxes: list[Any], put: bool, check: bool) -> list[Any] | None:
        """Sum the boxed objects into a copy of the own array, one get after the other; put the sum
        and return its reference in a list when ``put``."""
        import ray

        self._begin()
        total = self.whole.copy()
        for box in boxes:
            total += ray.get(ray.get(box)[0])
        out = [ray.put(total)] if put else None
        self._end()
        if check:
            _verify(total, self.whole.size, float(self.world), f"the sum at rank {self.rank}")
        return out

    def get_all(self, boxes: list[Any], check: bool) -> None:
        """Get every boxed object at once (the pieces of a gather)."""
        import ray

        self._begin()
        pieces = ray.get([b[0] for b in ray.get(boxes)])
        self._end()
        if check:
            if len(pieces) != self.world:
                raise AssertionError(f"rank {self.rank} got {len(pieces)} pieces of {self.world}")
            for i, p in enumerate(pieces):
                _verify(p, self.piece.size, 1.0, f"piece {i} at rank {self.rank}")


def _verify(arr: np.ndarray, n: int, value: float, what: str) -> None:
    if arr.dtype != np.float32 or arr.size != n or not bool((arr == value).all()):
        raise AssertionError(f"{what} is wrong: {arr.dtype}, {arr.size} elements (want {n} of {value})")


# ---------------------------------------------------------------------------------------- the driver
def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _settle() -> None:
    """Ask the parent to wait until the links are quiet, and wait for its answer."""
    _emit({"event": "settle"})
    if not sys.stdin.readline():
        raise SystemExit("the benchmark went away")


def connect_driver(address: str, hosts: int, timeout: float = 120.0) -> None:
    """``ray.init`` a driver in host 0's namespace (``address``) and wait until the ``hosts`` Ray
    nodes of the cluster have joined."""
    import ray

    ray.init(
        address=f"{address}:{GCS_PORT}",
        _node_ip_address=address,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    deadline = time.monotonic() + timeout
    while (alive := sum(1 for n in ray.nodes() if n["Alive"])) < hosts:
        if time.monotonic() > deadline:
            ray.shutdown()
            raise TimeoutError(f"only {alive} of {hosts} ray nodes joined")
        time.sleep(0.2)


def _driver(config: dict[str, Any]) -> None:
    """Runs in host 0's namespace: connects to the head, places one actor per host, runs the rounds
    and reports ``{"op", "size", "spans"}`` per (op, size) on stdout."""
    import ray

    world, address = config["hosts"], config["address"]
    connect_driver(address, world)
    try:
        actor = ray.remote(Member)
        members: list[Any] = [  # actor handles
            actor.options(num_cpus=0, resources={f"host{i}": 1}).remote(i, world) for i in range(world)
        ]
        ray.get([m.barrier.remote() for m in members], timeout=180)
        _emit({"event": "ready"})
        rounds = config["warmup"] + config["repeat"]
        for size in config["sizes"]:
            placed = ray.get([m.prepare.remote(size) for m in members], timeout=120)
            if placed != config["addresses"]:
                raise RuntimeError(f"actors are on {placed}, not one on each of {config['addresses']}")
            for op in config["ops"]:
                _emit({"event": "start", "op": op, "size": size})
                limit = config["round_timeout"][str(size)]
                spans: list[list[Any]] = [[] for _ in range(world)]
                for r in range(rounds):
                    _settle()
                    _round(members, op, size, check=r == 0, timeout=limit)
                    for rank, span in enumerate(ray.get([m.barrier.remote() for m in members], timeout=60)):
                        spans[rank].append(span)
                _emit({"event": "spans", "op": op, "size": size, "spans": spans})
        _emit({"event": "done"})
    finally:
        ray.shutdown()


def _round(members: list[Any], op: str, size: int, check: bool, timeout: float) -> None:
    """Issue one round's calls and wait for them all (raises what an actor raised)."""
    import ray

    first, rest = members[0], members[1:]
    world = len(members)
    if op == "broadcast":
        box = first.put.remote(False)
        boxes = [box]
        results = [m.get_one.remote([box], 1.0 if check else None) for m in rest]
    elif op in ("reduce", "allreduce"):
        boxes = [m.put.remote(False) for m in rest]
        total = first.reduce_from.remote(boxes, op == "allreduce", check)
        results = [total]
        if op == "allreduce":
            results += [m.get_one.remote([total], float(world) if check else None) for m in rest]
    elif op in ("gather", "allgather"):
        boxes = [m.put.remote(True) for m in members]
        getters = members if op == "allgather" else [first]
        results = [m.get_all.remote(boxes, check) for m in getters]
    else:
        raise ValueError(f"unknown op {op!r}")
    waiting = boxes + results
    ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=timeout, fetch_local=False)
    if len(ready) != len(waiting):
        raise TimeoutError(f"{op} of {size} bytes did not finish within {timeout:.0f} s")
    ray.get(results, timeout=60)


# ---------------------------------------------------------------------------------------- the nodes
class RayCluster:
    """The Ray nodes and the driver started on a :class:`Cluster` (see the module docstring); stops
    every process it started, and any left in the cluster's namespaces."""

    def __init__(self, cluster: Cluster, object_store: int) -> None:
        self.cluster = cluster
        self.object_store = object_store
        self.root = f"/tmp/{cluster.prefix}_ray"
        self.nodes: list[subprocess.Popen[Any]] = []
        self.driver: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()

    def _ray_start(self, i: int) -> subprocess.Popen[Any]:
        c = self.cluster
        argv = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block"]
        if i == 0:
            argv += ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
        else:
            argv += [f"--address={c.address(0)}:{GCS_PORT}"]
        argv += [
            f"--node-ip-address={c.address(i)}",
            "--num-cpus=1",
            f"--object-store-memory={self.object_store}",
            f"--temp-dir={self.root}/{i}",
            f"--resources={json.dumps({f'host{i}': 1})}",
            "--disable-usage-stats",
        ]
        with open(f"{self.root}/start{i}.log", "w") as log:
            # A session of its own: the node's processes share its process group.
            return c.popen(i, argv, env=RAY_ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_started(self, i: int, timeout: float) -> None:
        path = f"{self.root}/start{i}.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(path) as fh:
                text = fh.read()
            if "Ray runtime started" in text:
                return
            if self.nodes[i].poll() is not None:
                raise RuntimeError(f"ray node {i} exited ({self.nodes[i].returncode}):\n{text[-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"ray node {i} did not start within {timeout:.0f} s (see {path})")

    def start(self, config: dict[str, Any], driver: list[str] | None = None) -> None:
        """Start the head, the other nodes, then the driver: this module's with ``config``, or the
        command ``driver`` (run in host 0's namespace; its stdout lines that start with
        :data:`MARK` are its reports, read with :meth:`recv`)."""
        shutil.rmtree(self.root, ignore_errors=True)
        os.makedirs(self.root)
        self.nodes.append(self._ray_start(0))
        self._wait_started(0, 120)
        for i in range(1, self.cluster.hosts):
            self.nodes.append(self._ray_start(i))
        for i in range(1, self.cluster.hosts):
            self._wait_started(i, 180)
        argv = driver or [sys.executable, os.path.abspath(__file__), "--driver", json.dumps(config)]
        self.driver = self.cluster.popen(
            0,
            argv,
            env=RAY_ENV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, args=(self.driver.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            if line.startswith(MARK):
                self._lines.put(line[len(MARK) :])
        self._lines.put(None)

    def recv(self, timeout: float) -> dict[str, Any]:
        """The driver's next report line (raises if it exits or stays silent ``timeout`` seconds)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the ray driver reported nothing for {timeout:.0f} s") from None
        if line is None:
            assert self.driver is not None
            raise RuntimeError(f"the ray driver exited (code {self.driver.wait(30)})")
        return json.loads(line)

    def settle(self, timeout: float = 300.0) -> float:
        """Wait until the links carry no bulk traffic (see :data:`QUIET_BYTES`), then let the driver
        go on; returns the seconds waited."""
        waited = self.wait_quiet(timeout)
        self.go()
        return waited

    def wait_quiet(self, timeout: float = 300.0) -> float:
        """The first half of :meth:`settle`: wait until the links are quiet; returns the seconds waited."""
        started = time.monotonic()
        last, quiet = _switch_bytes(self.cluster), 0
        while quiet < 2 and time.monotonic() - started < timeout:
            time.sleep(0.1)
            now = _switch_bytes(self.cluster)
            quiet = quiet + 1 if now - last < QUIET_BYTES else 0
            last = now
        return time.monotonic() - started

    def go(self) -> None:
        """The second half of :meth:`settle`: let the driver go on."""
        assert self.driver is not None and self.driver.stdin is not None
        self.driver.stdin.write("go\n")
        self.driver.stdin.flush()

    def stop(self) -> None:
        """Stop the driver and the nodes (SIGTERM, then SIGKILL), then kill anything still in the
        cluster's namespaces: every process there was started by this run."""
        if self.driver is not None and self.driver.poll() is None:
            try:
                assert self.driver.stdin is not None
                self.driver.stdin.close()  # a driver waiting for "go" exits
                self.driver.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                _kill_group(self.driver.pid, signal.SIGKILL)
                self.driver.wait(10)
        for node in self.nodes:
            if node.poll() is None:
                _kill_group(node.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for node in self.nodes:
            try:
                node.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill_group(node.pid, signal.SIGKILL)
            if node.poll() is None:
                node.wait(10)
        # Workers have process groups of their own but stay in their node's session; the sweep of the
        # namespaces finds the rest (the cluster may have deleted them already, on a signal).
        sessions = {p.pid for p in [*self.nodes, *([self.driver] if self.driver else [])]}
        _kill_pids(_session_pids(sessions))
        self._sweep()
        shutil.rmtree(self.root, ignore_errors=True)

    def _sweep(self) -> None:
        deadline = time.monotonic() + 15
        while True:
            pids = self.cluster.pids()
            if not pids:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes left in the cluster's namespaces: {pids}")
            _kill_pids(pids)
            time.sleep(0.2)


def _switch_bytes(cluster: Cluster) -> int:
    """Bytes the bridge's ports have carried so far, both directions, all hosts."""
    out = subprocess.run(
        ["ip", "-n", cluster.switch, "-s", "-j", "link", "show"], capture_output=True, text=True, timeout=10
    ).stdout
    ports = {f"p{i}" for i in range(cluster.hosts)}
    return sum(
        link["stats64"]["tx"]["bytes"] + link["stats64"]["rx"]["bytes"]
        for link in json.loads(out)
        if link.get("ifname") in ports
    )


def _session_pids(sessions: set[int]) -> list[int]:
    """Processes whose session is one of ``sessions``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) in sessions:  # state, ppid, pgrp, session
                found.append(int(entry))
    return found


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------------------- entry point
def run(cluster: Cluster, sizes: list[int], ops: list[str], repeat: int, warmup: int) -> list[dict[str, Any]]:
    """Every op in ``ops`` at every size in ``sizes`` with Ray on all the cluster's hosts: one row
    ``{"system", "op", "size", "seconds", "cpu_seconds"}`` per (op, size), the median of ``repeat``
    timed rounds after ``warmup`` untimed ones, and the mean CPU seconds of those rounds summed
    over every process in the cluster's namespaces."""
    from bench.collectives import round_times
    from bench.common import cpu_since, format_size, process_cpu

    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"unknown ops {unknown}: ray runs {', '.join(OPS)}")
    # One round moves at most N objects of S bytes over one link (reduce, allgather), twice for
    # allreduce; allow four times that at the set rate, plus overhead.
    round_timeout = {str(s): 60 + 8 * cluster.hosts * s / cluster.rate_bytes for s in sizes}
    config = {
        "address": cluster.address(0),
        "addresses": [cluster.address(i) for i in range(cluster.hosts)],
        "hosts": cluster.hosts,
        "sizes": sizes,
        "ops": ops,
        "warmup": warmup,
        "repeat": repeat,
        "round_timeout": round_timeout,
    }
    rows: list[dict[str, Any]] = []
    ray_cluster = RayCluster(cluster, object_store_bytes(sizes))
    try:
        ray_cluster.start(config)
        msg = ray_cluster.recv(300)
        if msg.get("event") != "ready":
            raise RuntimeError(f"unexpected report from the ray driver: {msg}")
        timeout = 180.0
        # CPU of every process on the cluster (Ray's nodes, its workers, the driver) over each round:
        # from the driver's go to its next report.
        cpu: list[float] = []
        mark: dict[int, float] | None = None
        while (msg := ray_cluster.recv(timeout))["event"] != "done":
            if mark is not None and msg["event"] in ("settle", "spans"):
                cpu.append(cpu_since(mark, process_cpu(cluster.pids())))
                mark = None
            if msg["event"] == "start":
                print(f"{NAME} {msg['op']} {format_size(msg['size'])} ...", file=sys.stderr, flush=True)
                timeout = 180 + round_timeout[str(msg["size"])]
                cpu = []
            elif msg["event"] == "settle":
                waited = ray_cluster.wait_quiet()
                if waited > 1:
                    print(f"{NAME}: {waited:.1f} s for the links to go quiet", file=sys.stderr, flush=True)
                mark = process_cpu(cluster.pids())
                ray_cluster.go()
            elif msg["event"] == "spans":
                seconds = statistics.median(round_times(msg["spans"], warmup, repeat))
                row = {"system": NAME, "op": msg["op"], "size": msg["size"], "seconds": seconds}
                rows.append({**row, "cpu_seconds": statistics.mean(cpu[warmup : warmup + repeat])})
            else:
                raise RuntimeError(f"unexpected report from the ray driver: {msg}")
    finally:
        ray_cluster.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line: build a cluster, run Ray on it and print the rows (or run the driver)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--driver"]:
        _driver(json.loads(argv[1]))
        return 0
    from bench.cluster import Cluster
    from bench.common import cluster_arguments, format_size, parse_rate, parse_size

    ap = cluster_arguments(__doc__ or "", "1KiB,1MiB,64MiB", "hgr")
    ap.add_argument("--ops", default=",".join(OPS))
    args = ap.parse_args(argv)
    rate = parse_rate(args.rate)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    started = time.monotonic()
    with Cluster(args.hosts, rate, prefix=args.prefix) as cluster:
        rows = run(cluster, sizes, args.ops.split(","), args.repeat, args.warmup)
    for row in rows:
        print(json.dumps(row))
        print(f"  {row['op']:>9} {format_size(row['size']):>8}  {row['seconds']:.4f} s", file=sys.stderr)
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# ------------------------------------------------------------------ variants run by a driver on the cluster
def emit(obj: dict[str, Any]) -> None:
    """Report ``obj`` from a driver in a namespace to the benchmark (``RayCluster.recv`` reads it)."""
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def on_host(i: int) -> dict[str, Any]:
    """Ray options that place an actor on host ``i`` (a share of its ``host<i>`` resource, so that
    the directory and a benchmark's central actor share host 0)."""
    return {"resources": {f"host{i}": 0.01}}


def drive_variants(config: dict[str, Any], run_one: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """A benchmark's driver in host 0's namespace: connect to the head, start the hoplite directory
    on host 0, then for each spec of ``config["runs"]`` wait until the benchmark saw the links go
    quiet (a line on stdin) and report ``run_one(spec)``; a variant that raises is reported as an
    ``error`` record and the others still run."""
    import ray

    import hoplite_gpu.ray as hgray

    connect_driver(config["address"], config["hosts"])
    try:
        hgray.start_directory(actor_options=on_host(0))
        emit({"event": "ready"})
        for spec in config["runs"]:
            emit({"event": "settle"})
            if not sys.stdin.readline():
                raise SystemExit("the benchmark went away")
            emit({"event": "start", "name": spec["name"]})
            try:
                record = run_one(spec)
            except Exception as exc:
                logging.getLogger(__name__).exception("variant %s failed", spec["name"])
                record = {"name": spec["name"], "error": f"{type(exc).__name__}: {exc}"}
            emit({"event": "result", "record": record})
        emit({"event": "done"})
    finally:
        ray.shutdown()


def collect_variants(
    ray_cluster: RayCluster,
    config: dict[str, Any],
    script: str,
    run_timeout: float,
    on_record: Callable[[dict[str, Any]], None],
) -> list[dict[str, Any]]:
    """Start ``script --driver <config>`` on ``ray_cluster`` (see :func:`drive_variants`), let the
    links settle before each variant, and return the records it reports (each shown with
    ``on_record``, a failed variant's error here)."""
    records: list[dict[str, Any]] = []
    ray_cluster.start(
        config, driver=[sys.executable, os.path.abspath(script), "--driver", json.dumps(config)]
    )
    msg = ray_cluster.recv(300)
    if msg.get("event") != "ready":
        raise RuntimeError(f"unexpected report from the driver: {msg}")
    while (msg := ray_cluster.recv(run_timeout))["event"] != "done":
        if msg["event"] == "settle":
            ray_cluster.settle()
        elif msg["event"] == "start":
            print(f"{msg['name']} ...", file=sys.stderr, flush=True)
        elif msg["event"] == "result":
            record = msg["record"]
            records.append(record)
            if "error" in record:
                print(f"  {record['name']}: FAILED: {record['error']}", file=sys.stderr, flush=True)
            else:
                on_record(record)
        else:
            raise RuntimeError(f"unexpected report from the driver: {msg}")
    return records


#: A benchmark's own processes on the cluster: no token authentication. Ray 2.60 enables it when
#: ~/.ray/auth_token exists (a local ``ray.init`` writes one), and then the nodes joining the head
#: fail to authenticate.
CLUSTER_ENV = {"RAY_AUTH_MODE": "disabled"}


def variants_on_cluster(
    hosts: int,
    rate: float,
    prefix: str,
    runs: list[dict[str, Any]],
    script: str,
    store_bytes: int,
    run_timeout: float,
    on_record: Callable[[dict[str, Any]], None],
    env: dict[str, str],
    aggregate: bool = False,
) -> dict[str, Any]:
    """Run a benchmark's variants (``runs``, see :func:`drive_variants`) on an emulated cluster of
    ``hosts`` hosts with links of ``rate`` bytes/s, one Ray node per host with ``store_bytes`` of
    object store, its driver ``script --driver`` in host 0's namespace (``env`` added to this
    process's environment, which the cluster's processes inherit). Returns the records with the
    link's throughput measured first, and with ``aggregate`` what every link at once carries
    (:func:`bench.cluster.aggregate_throughput`)."""
    from bench.cluster import Cluster, aggregate_throughput, link_throughput

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ.update({**env, **CLUSTER_ENV})
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    config: dict[str, Any] = {"hosts": hosts, "address": "", "runs": runs}
    result: dict[str, Any] = {"setting": "cluster", "hosts": hosts, "rate_bytes": rate}
    with Cluster(hosts, rate, prefix=prefix) as cluster:
        link = result["link_bytes_per_s"] = link_throughput(cluster)
        line = f"link: {link / 1e6:.1f} MB/s (set {rate / 1e6:.0f} MB/s)"
        if aggregate:
            total = result["aggregate_bytes_per_s"] = aggregate_throughput(cluster)
            line += f"; all links at once: {total / 1e6:.1f} MB/s in total"
        print(line, file=sys.stderr, flush=True)
        config["address"] = cluster.address(0)
        ray_cluster = RayCluster(cluster, store_bytes)
        try:
            result["records"] = collect_variants(ray_cluster, config, script, run_timeout, on_record)
        finally:
            ray_cluster.stop()
    return result
