"""Ensemble model serving (the Hoplite paper's section 5.4 workload): a front end sends each query to
``M`` model actors and sums their outputs.

A query is a float32 batch of images (default 64 x 3 x 256 x 256, 48 MiB). Each model is a Ray
actor holding a fixed random linear classifier on a pooled view of the images (sums over
``pool x pool`` blocks, which reads every byte of the query, then a matrix product and a softmax):
little compute, so moving the query dominates. Its output is one row of class probabilities per
image (64 x 1000 float32, 250 KiB), quantized to multiples of 2**-16 so that the ensemble's sum is
exact in any order (for ``M`` up to 256) and the two modes can be compared bit for bit.

* ``hoplite``: the front end ``put``s the query in its hoplite_gpu node and passes the ObjectID to
  every model; each model ``get``s it (receivers that are still receiving relay to later ones, a
  broadcast tree), computes and ``put``s its output under an ObjectID the front end chose. The
  front end has asked for the ``reduce`` (sum) of those ids before calling the models, and ``get``s
  the sum. It then deletes the query and the sum; each model deletes its output when its next call
  (or the final release) tells it that query is done.
* ``ray``: the front end ``ray.put``s the query and passes the ObjectRef to every model (Ray
  fetches it to the model's node before the call runs); the models return their outputs, which the
  front end ``ray.get``s and sums.

Queries are issued one after another (``--inflight K`` keeps ``K`` in flight, from ``K`` front-end
threads) after ``--warmup`` untimed ones; queries/s is the number of timed queries over the time
they took. Both modes serve the same sequence of queries; the first query's sum of each mode is
checked against the NumPy reference computed in the front end.

Two settings:

* ``--local``: one machine, a local ``ray.init``; the front end is the driver, every model an actor
  on the same node (hoplite_gpu copies through shared memory unless ``HOPLITE_SHARED_MEMORY=0``).
* the emulated cluster (the default; needs root): ``--hosts`` network namespaces (default 9,
  :mod:`bench.cluster`) whose links are shaped to ``--rate``, one Ray node per host
  (:class:`bench.peers.ray_peer.RayCluster`); the driver runs in host 0's namespace and is the front
  end, the hoplite directory actor lives on host 0 and model ``i`` on host ``i`` (``--models``
  defaults to ``hosts - 1``). hoplite_gpu moves data over UCX on TCP (``UCX_TLS=tcp``,
  ``HOPLITE_SHARED_MEMORY=0``: the namespaces share ``/dev/shm``). The ideal queries/s is the link
  rate over the query size: the front end's link must carry each query at least once.

    python bench/serving.py --local --json bench/results/serving.json
    flock /tmp/hg_cluster.lock python bench/serving.py --json bench/results/serving.json

``--json PATH`` merges this setting's figures into PATH (the other setting's stay) and writes a
Markdown table of every setting to PATH with ``.md``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import cluster_options, format_size, markdown_table, parse_rate

CHANNELS = 3
#: Model outputs are multiples of this, so that sums of up to 256 of them (each at most 1) are exact
#: in float32.
QUANTUM = 2.0**-16
#: Environment of every process of the emulated cluster (see bench/netbench.py). Ray's token
#: authentication off: ``ray start --head`` turns it on when ``~/.ray/auth_token`` exists (any local
#: ``ray.init`` of Ray 2.60 writes one) but a joining node does not, and is then refused by the head.
HOST_ENV = {"UCX_TLS": "tcp", "HOPLITE_SHARED_MEMORY": "0", "RAY_AUTH_MODE": "disabled"}
#: Seconds a front end waits for one query at most (the cluster driver derives its own).
QUERY_TIMEOUT = 120.0


@dataclass(frozen=True)
class Workload:
    """The ensemble and its queries.

    Attributes:
        models: Number of model actors (``M``).
        batch: Images per query.
        image: Side of a square image, pixels (a query is ``batch x 3 x image x image`` float32).
        pool: Side of the pooled blocks the models read the images through (divides ``image``).
        classes: Class scores per image in each model's output.
        seed: Seed of the weights and of the queries.
    """

    models: int = 8
    batch: int = 64
    image: int = 256
    pool: int = 16
    classes: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.models <= 256:
            raise ValueError("models must be in 1..256 (sums of more are not exact)")
        if min(self.batch, self.image, self.pool, self.classes) < 1 or self.image % self.pool:
            raise ValueError("batch, image, pool and classes must be >= 1, and pool must divide image")

    @property
    def query_shape(self) -> tuple[int, int, int, int]:
        """Shape of a query array."""
        return (self.batch, CHANNELS, self.image, self.image)

    @property
    def query_bytes(self) -> int:
        """Bytes of a query."""
        return self.batch * CHANNELS * self.image * self.image * 4

    @property
    def output_bytes(self) -> int:
        """Bytes of one model's output."""
        return self.batch * self.classes * 4

    @property
    def features(self) -> int:
        """Inputs of each model's linear layer (pooled pixels per image)."""
        return CHANNELS * (self.image // self.pool) ** 2


def model_weights(workload: Workload, index: int) -> np.ndarray:
    """Model ``index``'s weights (``features x classes`` float64), the same in every process."""
    rng = np.random.default_rng([workload.seed, index])
    scale = 4.0 / (workload.pool * workload.pool * np.sqrt(workload.features))
    return rng.standard_normal((workload.features, workload.classes)) * scale


def make_query(workload: Workload, number: int) -> np.ndarray:
    """Query ``number``: uniform float32 pixels in [0, 1) (multiples of 2**-24, so the models' block
    sums are exact in float64 in any order)."""
    rng = np.random.default_rng([workload.seed, 1 << 20, number])
    return rng.random(workload.query_shape, dtype=np.float32)


def infer(workload: Workload, weights: np.ndarray, query: np.ndarray) -> np.ndarray:
    """One model's output for ``query``: class probabilities per image (``batch x classes``
    float32), quantized to multiples of :data:`QUANTUM`."""
    b, c, side, p = workload.batch, CHANNELS, workload.image, workload.pool
    n = side // p
    rows = query.reshape(b, c, n, p, side).sum(axis=3, dtype=np.float64)  # pools the rows ...
    pooled = rows.reshape(b, c, n, n, p).sum(axis=4)  # ... then the columns
    logits = pooled.reshape(b, -1) @ weights
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    return (np.round(probs / QUANTUM) * QUANTUM).astype(np.float32)


def reference(workload: Workload, query: np.ndarray) -> np.ndarray:
    """The ensemble's summed output for ``query``, computed here with NumPy."""
    total = np.zeros((workload.batch, workload.classes), np.float32)
    for i in range(workload.models):
        total += infer(workload, model_weights(workload, i), query)
    return total


# ---------------------------------------------------------------------------------------- the models
class Model:
    """One model of the ensemble (made a Ray actor by :func:`start_models`)."""

    def __init__(self, workload: dict[str, Any], index: int) -> None:
        self.workload = Workload(**workload)
        self.index = index
        self.weights = model_weights(self.workload, index)

    def where(self) -> str:
        """Connect this process's hoplite_gpu node; returns the address of the Ray node."""
        import ray

        import hoplite_gpu.ray as hgray

        hgray.node()
        return str(ray.util.get_node_ip_address())

    def infer_ray(self, query: np.ndarray) -> np.ndarray:
        """The output for ``query`` (Ray fetched it before the call)."""
        return infer(self.workload, self.weights, query)

    def infer_hoplite(self, query_id: Any, output_id: Any, done: list[Any], timeout: float) -> None:
        """Delete the outputs ``done`` (their queries are answered), get the query ``query_id``
        from hoplite_gpu and put the output under ``output_id``."""
        import hoplite_gpu.ray as hgray

        node = hgray.node()
        self.release(done)
        query = node.get(query_id, timeout=timeout)
        node.put(infer(self.workload, self.weights, query), output_id)

    def release(self, done: list[Any]) -> int:
        """Delete the outputs ``done``; returns how many objects this node still holds."""
        import hoplite_gpu.ray as hgray

        node = hgray.node()
        for oid in done:
            node.delete(oid)
        return int(node.stats()["objects"])


def start_models(
    workload: Workload, placement: list[dict[str, Any]] | None = None, inflight: int = 1
) -> list[Any]:
    """Start the ensemble's actors (``placement[i]``: more Ray options of model ``i``, e.g. its
    resources) and wait until each has connected its hoplite_gpu node; returns their handles."""
    import ray

    actor = ray.remote(Model)
    options = placement or [{} for _ in range(workload.models)]
    models = [
        actor.options(num_cpus=0, max_concurrency=inflight, **options[i]).remote(
            dataclasses.asdict(workload), i
        )
        for i in range(workload.models)
    ]
    ray.get([m.where.remote() for m in models], timeout=180)
    return models


# ---------------------------------------------------------------------------------------- front ends
class Releases:
    """Outputs of answered queries each model still has to delete (handed over with its next call)."""

    def __init__(self, models: int) -> None:
        self._lock = threading.Lock()
        self._pending: list[list[Any]] = [[] for _ in range(models)]

    def add(self, outputs: list[Any]) -> None:
        """Model ``i`` may delete ``outputs[i]``."""
        with self._lock:
            for pending, oid in zip(self._pending, outputs, strict=True):
                pending.append(oid)

    def take(self, index: int) -> list[Any]:
        """What model ``index`` may delete now (forgotten here)."""
        with self._lock:
            taken, self._pending[index] = self._pending[index], []
        return taken


def query_hoplite(
    models: list[Any], query: np.ndarray, releases: Releases, timeout: float = QUERY_TIMEOUT
) -> np.ndarray:
    """Serve one query with hoplite_gpu (see the module docstring); returns the summed output."""
    import ray

    import hoplite_gpu.ray as hgray
    from hoplite_gpu import ObjectID

    node = hgray.node()
    query_id = node.put(query)
    outputs = [ObjectID.random() for _ in models]
    total_id = node.reduce(outputs, op="sum", timeout=timeout)
    calls = [
        m.infer_hoplite.remote(query_id, out, releases.take(i), timeout)
        for i, (m, out) in enumerate(zip(models, outputs, strict=True))
    ]
    total = np.array(node.get(total_id, timeout=timeout))
    ray.get(calls, timeout=timeout)
    node.delete(total_id)
    node.delete(query_id)
    releases.add(outputs)
    return total


def query_ray(models: list[Any], query: np.ndarray, timeout: float = QUERY_TIMEOUT) -> np.ndarray:
    """Serve one query with Ray's object store (see the module docstring); returns the summed output."""
    import ray

    ref = ray.put(query)
    outputs = ray.get([m.infer_ray.remote(ref) for m in models], timeout=timeout)
    total = np.zeros_like(outputs[0])
    for out in outputs:
        total += out
    return total


def finish_hoplite(models: list[Any], releases: Releases) -> list[int]:
    """Let every model delete its outputs still kept; returns how many objects each still holds."""
    import ray

    return list(ray.get([m.release.remote(releases.take(i)) for i, m in enumerate(models)], timeout=60))


def run_mode(
    mode: str,
    models: list[Any],
    queries: list[np.ndarray],
    count: int,
    warmup: int,
    inflight: int = 1,
    timeout: float = QUERY_TIMEOUT,
) -> dict[str, Any]:
    """Serve ``warmup`` untimed then ``count`` timed queries (query ``k`` is ``queries[k %
    len(queries)]``) in ``mode`` (``"hoplite"`` or ``"ray"``), ``inflight`` at a time.

    Returns ``{"mode", "queries", "seconds", "qps", "latency": [seconds per timed query],
    "first": the sum of query 0, "held": objects each model's hoplite node still holds}``.
    """
    releases = Releases(len(models))
    serve: Callable[[np.ndarray], np.ndarray]
    if mode == "hoplite":

        def serve(q: np.ndarray) -> np.ndarray:
            return query_hoplite(models, q, releases, timeout)

    elif mode == "ray":

        def serve(q: np.ndarray) -> np.ndarray:
            return query_ray(models, q, timeout)

    else:
        raise ValueError(f"unknown mode {mode!r}")

    def one(k: int) -> tuple[np.ndarray, float]:
        started = time.perf_counter()
        total = serve(queries[k % len(queries)])
        return total, time.perf_counter() - started

    first, _ = one(0)
    for k in range(1, warmup):
        one(k)
    started = time.perf_counter()
    if inflight == 1:
        timed = [one(k) for k in range(warmup, warmup + count)]
    else:
        with ThreadPoolExecutor(inflight) as pool:
            timed = list(pool.map(one, range(warmup, warmup + count)))
    seconds = time.perf_counter() - started
    held = finish_hoplite(models, releases) if mode == "hoplite" else []
    return {
        "mode": mode,
        "queries": count,
        "seconds": seconds,
        "qps": count / seconds,
        "latency": [t for _, t in timed],
        "first": first,
        "held": held,
    }


def serve_both(
    workload: Workload,
    models: list[Any],
    count: int,
    warmup: int,
    inflight: int = 1,
    timeout: float = QUERY_TIMEOUT,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run both modes (hoplite first) on the same queries and check that each one's sum of query 0
    equals the NumPy reference exactly (raises AssertionError otherwise).

    Returns ``{"hoplite": ..., "ray": ...}`` as :func:`run_mode` gives them, without ``"first"``.
    """
    warmup = max(warmup, 1)  # query 0 is the checked one, never timed
    queries = [make_query(workload, k) for k in range(min(3, warmup + count))]
    expected = reference(workload, queries[0])
    results: dict[str, Any] = {}
    for mode in ("hoplite", "ray"):
        if log is not None:
            log(f"{mode}: {warmup} warm-up and {count} timed queries ...")
        result = run_mode(mode, models, queries, count, warmup, inflight, timeout)
        first = result.pop("first")
        if first.dtype != expected.dtype or first.shape != expected.shape:
            raise AssertionError(f"{mode}: the ensemble's sum of query 0 is {first.dtype} {first.shape}")
        if not np.array_equal(first, expected):
            worst = float(np.abs(first.astype(np.float64) - expected).max())
            raise AssertionError(f"{mode}: the ensemble's sum of query 0 is wrong (max difference {worst})")
        if log is not None:
            log(f"{mode}: {result['qps']:.2f} queries/s")
        results[mode] = result
    return results


def summarize(workload: Workload, results: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """One setting's figures: the workload, queries/s and median latency of each mode, the ratio."""
    row: dict[str, Any] = {
        **extra,
        "models": workload.models,
        "query_bytes": workload.query_bytes,
        "output_bytes": workload.output_bytes,
        "workload": dataclasses.asdict(workload),
    }
    for mode in ("hoplite", "ray"):
        r = results[mode]
        row[mode] = {
            "qps": r["qps"],
            "queries": r["queries"],
            "seconds": r["seconds"],
            "median_latency": statistics.median(r["latency"]),
            "latency": r["latency"],
        }
    # Objects each model's hoplite node held once it deleted its outputs (copies of the queries go
    # when the front end deletes them: the directory tells every holder, asynchronously).
    row["hoplite"]["model_objects_after"] = results["hoplite"]["held"]
    row["ratio"] = row["hoplite"]["qps"] / row["ray"]["qps"]
    return row


# ---------------------------------------------------------------------------------------- settings
def run_local(workload: Workload, count: int, warmup: int, inflight: int) -> dict[str, Any]:
    """Both modes on a local Ray instance started here; returns :func:`summarize`'s figures."""
    import ray

    import hoplite_gpu.ray as hgray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=max(2, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    try:
        hgray.start_directory()
        models = start_models(workload, inflight=inflight)
        results = serve_both(workload, models, count, warmup, inflight, log=_log)
    finally:
        hgray.stop_directory()  # closes this process's node first: it would try to reconnect
        ray.shutdown()
    shared = os.environ.get("HOPLITE_SHARED_MEMORY", "1") not in ("0", "false", "no", "off")
    return summarize(workload, results, setting="local", hoplite_shared_memory=shared)


def _emit(obj: dict[str, Any]) -> None:
    from bench.peers.ray_peer import MARK

    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _driver(config: dict[str, Any]) -> None:
    """The front end on the emulated cluster (runs in host 0's namespace): connects to the head,
    starts the directory on host 0 and model ``i`` on host ``i``, serves the queries and reports
    ``{"event": "result", "row": ...}`` on stdout."""
    import ray

    import hoplite_gpu.ray as hgray
    from bench.peers.ray_peer import connect_driver

    workload = Workload(**config["workload"])
    hosts, address = config["hosts"], config["addresses"][0]
    connect_driver(address, hosts)
    try:
        hgray.start_directory(actor_options={"resources": {"host0": 1}})
        placement = [{"resources": {f"host{1 + i % (hosts - 1)}": 1e-3}} for i in range(workload.models)]
        models = start_models(workload, placement, config["inflight"])
        placed = ray.get([m.where.remote() for m in models], timeout=60)
        want = [config["addresses"][1 + i % (hosts - 1)] for i in range(workload.models)]
        if placed != want:
            raise RuntimeError(f"models are on {placed}, not on {want}")
        _emit({"event": "ready"})
        results = serve_both(
            workload,
            models,
            config["queries"],
            config["warmup"],
            config["inflight"],
            config["timeout"],
            log=lambda text: _emit({"event": "log", "text": text}),
        )
        _emit({"event": "result", "results": _jsonable(results)})
    finally:
        hgray.stop_directory()  # closes this process's node first: it would try to reconnect
        ray.shutdown()


def _jsonable(results: dict[str, Any]) -> dict[str, Any]:
    return {mode: {k: v for k, v in r.items() if k != "first"} for mode, r in results.items()}


def run_cluster(
    workload: Workload, hosts: int, rate: float, prefix: str, count: int, warmup: int, inflight: int
) -> dict[str, Any]:
    """Both modes on an emulated cluster of ``hosts`` hosts (front end on host 0, models on the
    others); returns :func:`summarize`'s figures. Removes every namespace and process it made."""
    from bench.cluster import Cluster, link_throughput
    from bench.peers.ray_peer import RayCluster

    os.environ.update(HOST_ENV)  # inherited by the Ray nodes, hence by their workers
    # A query crosses the front end's link once per model at worst (Ray), plus slack.
    timeout = 60 + 2 * workload.models * workload.query_bytes / rate
    config = {
        "workload": dataclasses.asdict(workload),
        "hosts": hosts,
        "addresses": [],
        "queries": count,
        "warmup": warmup,
        "inflight": inflight,
        "timeout": timeout,
    }
    driver = [sys.executable, os.path.abspath(__file__), "--driver"]
    started = time.monotonic()
    with Cluster(hosts, rate, prefix=prefix) as cluster:
        measured = link_throughput(cluster)
        _log(f"link: {measured / 1e6:.1f} MB/s of {rate / 1e6:.0f} MB/s set")
        config["addresses"] = [cluster.address(i) for i in range(hosts)]
        object_store = min(2 << 30, max(512 << 20, 6 * workload.query_bytes))
        ray_cluster = RayCluster(cluster, object_store)
        try:
            ray_cluster.start(config, driver=[*driver, json.dumps(config)])
            _log(f"ray nodes started ({time.monotonic() - started:.0f} s)")
            waiting = 300.0
            while (msg := ray_cluster.recv(waiting))["event"] != "result":
                if msg["event"] == "ready":
                    waiting = 120 + (warmup + count + 1) * timeout
                elif msg["event"] == "log":
                    _log(msg["text"])
                else:
                    raise RuntimeError(f"unexpected report from the driver: {msg}")
            results = msg["results"]
        finally:
            ray_cluster.stop()
    return summarize(
        workload,
        results,
        setting="cluster",
        hosts=hosts,
        rate_bytes=rate,
        link_bytes_per_s=measured,
        ideal_qps=measured / workload.query_bytes,
        seconds=time.monotonic() - started,
    )


# ---------------------------------------------------------------------------------------- reporting
def format_table(rows: dict[str, dict[str, Any]]) -> str:
    """A Markdown table of the settings' figures."""
    columns = [
        ("setting", "l"),
        ("models", "r"),
        ("query", "r"),
        ("hoplite q/s", "r"),
        ("ray q/s", "r"),
        ("hoplite/ray", "r"),
        ("ideal q/s", "r"),
        ("hoplite latency", "r"),
        ("ray latency", "r"),
    ]
    body = []
    for name, row in rows.items():
        if row["setting"] == "cluster":
            name = f"{row['hosts']} hosts, {row['rate_bytes'] / 1e6:.0f} MB/s links"
        ideal = row.get("ideal_qps")
        body.append(
            [
                name,
                str(row["models"]),
                format_size(row["query_bytes"]),
                f"{row['hoplite']['qps']:.2f}",
                f"{row['ray']['qps']:.2f}",
                f"**{row['ratio']:.2f}x**",
                f"{ideal:.2f}" if ideal else "-",
                f"{row['hoplite']['median_latency'] * 1e3:.0f} ms",
                f"{row['ray']['median_latency'] * 1e3:.0f} ms",
            ]
        )
    return markdown_table(columns, body)


def write_results(path: str, row: dict[str, Any]) -> None:
    """Merge ``row`` (under its setting) into the JSON file ``path`` and write the Markdown table of
    all its settings to ``path`` with ``.md``."""
    rows: dict[str, dict[str, Any]] = {}
    if os.path.exists(path):
        with open(path) as fh:
            rows = json.load(fh).get("settings", {})
    rows[row["setting"]] = row
    with open(path, "w") as fh:
        json.dump({"settings": rows}, fh, indent=2)
        fh.write("\n")
    notes = (
        "Queries/s of the ensemble serving benchmark (`bench/serving.py`): each query goes to every "
        "model, the outputs are summed at the front end; latency is the median per query; the ideal "
        "is the measured link rate over the query size."
    )
    commands = "\n".join(
        f"- {name}: `{row.get('command', '?')}`, {row['hoplite']['queries']} timed queries per mode, "
        f"{row.get('inflight', 1)} in flight"
        for name, row in rows.items()
    )
    with open(os.path.splitext(path)[0] + ".md", "w") as fh:
        fh.write(f"{notes}\n\n{format_table(rows)}\n\n{commands}\n")


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--driver"]:
        _driver(json.loads(argv[1]))
        return 0
    ap = cluster_options(
        __doc__ or "", "hgs", hosts=9, hosts_help="hosts of the emulated cluster (front end + models)"
    )
    ap.add_argument("--local", action="store_true", help="one machine, a local Ray instance")
    ap.add_argument("--models", type=int, help="model actors (default: 8 locally, hosts - 1 on the cluster)")
    ap.add_argument("--batch", type=int, default=64, help="images per query (3 x image x image float32)")
    ap.add_argument("--image", type=int, default=256)
    ap.add_argument("--pool", type=int, default=16)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--queries", type=int, default=10, help="timed queries per mode")
    ap.add_argument("--warmup", type=int, default=2, help="untimed queries per mode first (at least 1)")
    ap.add_argument("--inflight", type=int, default=1, help="queries in flight at once")
    ap.add_argument("--json", help="merge the figures into this file (and write its .md table)")
    args = ap.parse_args(argv)
    models = args.models or (8 if args.local else args.hosts - 1)
    workload = Workload(models, args.batch, args.image, args.pool, args.classes)
    _log(
        f"{models} models, queries of {format_size(workload.query_bytes)} "
        f"({args.batch} x {CHANNELS} x {args.image} x {args.image} float32), "
        f"outputs of {format_size(workload.output_bytes)}"
    )
    if args.local:
        row = run_local(workload, args.queries, args.warmup, args.inflight)
    else:
        rate = parse_rate(args.rate)
        row = run_cluster(workload, args.hosts, rate, args.prefix, args.queries, args.warmup, args.inflight)
    row["inflight"] = args.inflight
    row["command"] = " ".join(["python bench/serving.py", *argv])
    print(json.dumps(row))
    _log(format_table({row["setting"]: row}))
    if args.json:
        write_results(args.json, row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
