"""Time to recover from a failure: detection and repair, measured on real processes.

Each scenario runs ``--repeat`` times with a fault and, alternately, as many times without one, in
the same run. A fault is injected deterministically (:mod:`hoplite_gpu.faults`) and logs the moment
it fires with ``time.monotonic()`` (``HOPLITE_FAULT_LOG``); the directory's event log uses the same
host-wide CLOCK_MONOTONIC, so the figures are differences of the two:

* ``relay killed``: a broadcast to a chain of receivers; the first relay is SIGKILLed half way
  through its copy. *detect*: the kill until the directory declares it dead; *repair*: the kill
  until its downstream receiver resumes from another source (its next ``transfer_start``).
* ``vertex killed``: a first-k reduce (k = n-1); the node computing the root vertex is SIGKILLed
  half way through reducing. *detect* as above; *repair*: the kill until the rebuilt tree's result
  is complete (``reduce_done``).
* ``relay stopped``: the first relay is SIGSTOPped half way (a hung peer: its connection stays
  open). *detect*: the stop until a receiver reports it stalled (``node_suspect``, bounded by
  ``stall_timeout``); *repair*: the stop until that receiver resumes from another source.
* ``directory killed``: a standalone directory is SIGKILLed half way through a broadcast and
  restarted at the same address. *detect*: the kill until the restarted directory hears from the
  first node again; *repair*: the kill until every node rejoined and restored its copies.

*extra* is the median operation time with the fault minus the median without it: what the failure
cost the operation end to end (for the directory, this includes starting a new directory process).

    python bench/recovery.py --size 64MiB --repeat 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import format_size, markdown_table, parse_size, write_json

RECEIVERS = 4
#: Worker settings: transfers over UCX (not same-host shared memory, which a kill mid-copy does not
#: interrupt), a sender throttled so a transfer lasts long enough to fail half way, and a short
#: stall timeout for the hung-peer scenario.
WORKER_CONFIG = {
    "shared_memory": False,
    "send_rate_limit": 256 << 20,
    "adaptive_chunks": False,
    "chunk_bytes": 1 << 20,
    "stall_timeout": 1.0,
}


def _worker(address: str, token: str, conn: Any) -> None:
    import hoplite_gpu as hg
    from hoplite_gpu import faults

    node = hg.connect(address, token=token, **WORKER_CONFIG)
    conn.send(node.node_id)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            cmd, args = msg
            try:
                if cmd == "put":
                    size, value, oid_hex = args
                    arr = np.full(size // 4, value, np.float32)
                    node.put(arr, hg.ObjectID.from_hex(oid_hex))
                    result: Any = True
                elif cmd == "get":
                    got = node.get(hg.ObjectID.from_hex(args[0]), timeout=120)
                    done = time.monotonic()
                    result = (done, float(got[0]), float(got[-1]))
                elif cmd == "arm":
                    faults.arm(args[0])
                    result = True
                else:
                    raise ValueError(cmd)
                conn.send(("ok", result))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        node.close()


class Worker:
    """A node in its own process, driven over a pipe."""

    def __init__(self, address: str, token: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(address, token, child), daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            raise RuntimeError("a worker did not start")
        self.node_id: str = self.conn.recv()

    def send(self, cmd: str, *args: Any) -> None:
        self.conn.send((cmd, args))

    def result(self, timeout: float = 120.0) -> Any:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"worker {self.proc.pid} did not answer within {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def call(self, cmd: str, *args: Any) -> Any:
        self.send(cmd, *args)
        return self.result()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def _fault_times(path: str) -> list[float]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line)["t"] for line in fh if line.strip()]


def _first(events: list[dict[str, Any]], after: float, kind: str, **fields: Any) -> float:
    """Time of the first ``kind`` event at or after ``after`` whose fields match (a set: any of)."""

    def matches(e: dict[str, Any]) -> bool:
        return e["kind"] == kind and all(
            e.get(k) in v if isinstance(v, set) else e.get(k) == v for k, v in fields.items()
        )

    times = [e["t"] for e in events if e["t"] >= after and matches(e)]
    if not times:
        raise RuntimeError(f"no {kind} event {fields} after the fault")
    return float(min(times))


def _broadcast(owner: Any, workers: list[Worker], size: int, fault: str | None) -> tuple[float, str]:
    """Worker 0 puts, the others get one after another (a chain); ``fault`` is armed on worker 1
    (the first relay) with ``{oid}`` filled in. Returns (seconds, object hex)."""
    import hoplite_gpu as hg

    oid = hg.ObjectID.random().hex()
    workers[0].call("put", size, 3.0, oid)
    if fault:
        workers[1].call("arm", fault.format(oid=oid))
    start = time.monotonic()
    for w in workers[1:]:  # one at a time, so each joins the chain behind the previous one
        w.send("get", oid)
        _wait_event(owner, "transfer_start", object_id=oid, receiver=w.node_id)
    ends = []
    for i, w in enumerate(workers[1:], start=1):
        if i == 1 and fault:
            continue  # the victim
        done, first, last = w.result()
        if (first, last) != (3.0, 3.0):
            raise RuntimeError("a broadcast delivered wrong data")
        ends.append(done)
    return max(ends) - start, oid


def relay(owner: Any, size: int, repeat: int, log: str, signal_name: str) -> dict[str, list[float]]:
    """A chain broadcast whose first relay is killed (KILL) or stopped (STOP) half way."""
    figures: dict[str, list[float]] = {"base": [], "fault": [], "detect": [], "repair": []}
    for _ in range(repeat):
        workers = [Worker(owner.directory_address, owner.token) for _ in range(RECEIVERS + 1)]
        try:
            _broadcast(owner, workers, size, None)  # untimed: sets up the endpoints
            figures["base"].append(_broadcast(owner, workers, size, None)[0])
            before = len(_fault_times(log))
            seconds, oid = _broadcast(owner, workers, size, f"receive:{{oid}}:0.5:{signal_name}")
            fired = _fault_times(log)[before]
            events = owner.event_log()
            victim = workers[1].node_id
            seen = "node_left" if signal_name == "KILL" else "node_suspect"
            detected = _first(events, fired, seen, node=victim)
            orphans = {
                e["receiver"]
                for e in events
                if e["kind"] == "transfer_start" and e["object_id"] == oid and e["sender"] == victim
            }
            resumed = _first(events, fired, "transfer_start", object_id=oid, receiver=orphans)
            figures["fault"].append(seconds)
            figures["detect"].append(detected - fired)
            figures["repair"].append(resumed - fired)
        finally:
            for w in workers:
                w.kill()  # also the stopped one
    return figures


def vertex(owner: Any, size: int, repeat: int, log: str) -> dict[str, list[float]]:
    """A first-k reduce (k = n-1) whose root vertex's node is killed half way through reducing."""
    import hoplite_gpu as hg

    figures: dict[str, list[float]] = {"base": [], "fault": [], "detect": [], "repair": []}
    n = RECEIVERS
    for _ in range(repeat):
        workers = [Worker(owner.directory_address, owner.token) for _ in range(n)]
        try:
            for faulty in (None, False, True):  # None: untimed, sets up the endpoints
                ids = [hg.ObjectID.random() for _ in range(n)]
                for w, oid in zip(workers, ids, strict=True):
                    w.call("put", size, 1.0, oid.hex())
                rid = hg.ObjectID.random()
                before = len(_fault_times(log))
                start = time.monotonic()
                owner.reduce(ids, "sum", num_objects=n - 1, reduction_id=rid)
                if faulty:  # the node given the root vertex dies half way through reducing
                    root = _wait_event(owner, "reduce_place", object_id=rid.hex(), vertex=0)
                    next(w for w in workers if w.node_id == root["node"]).call(
                        "arm", f"reduce:{rid.hex()}:0.5:KILL"
                    )
                got = owner.get(rid, timeout=120)
                seconds = time.monotonic() - start
                if float(got[0]) != n - 1:
                    raise RuntimeError("a reduction gave a wrong result")
                owner.delete(rid)
                if faulty is None:
                    continue
                if not faulty:
                    figures["base"].append(seconds)
                    continue
                fired = _fault_times(log)[before]
                events = owner.event_log()
                dead = {w.node_id for w in workers if not w.proc.is_alive()}
                detected = _first(events, fired, "node_left", node=dead)
                done = _first(events, fired, "reduce_done", object_id=rid.hex())
                figures["fault"].append(seconds)
                figures["detect"].append(detected - fired)
                figures["repair"].append(done - fired)
        finally:
            for w in workers:
                w.kill()
    return figures


def directory(size: int, repeat: int) -> dict[str, list[float]]:
    """A broadcast during which the standalone directory is killed and restarted."""
    import hoplite_gpu as hg
    from hoplite_gpu.auth import new_token
    from hoplite_gpu.directory import DirectoryProcess

    figures: dict[str, list[float]] = {"base": [], "fault": [], "detect": [], "repair": []}
    for _ in range(repeat):
        d = DirectoryProcess(new_token())
        d.start()
        owner = hg.connect(d.address, token=d.token)
        workers = [Worker(d.address, d.token) for _ in range(RECEIVERS + 1)]
        try:
            _broadcast(owner, workers, size, None)  # untimed: sets up the endpoints
            figures["base"].append(_broadcast(owner, workers, size, None)[0])
            oid = hg.ObjectID.random().hex()
            workers[0].call("put", size, 3.0, oid)
            start = time.monotonic()
            for w in workers[1:]:
                w.send("get", oid)
            _wait_event(owner, "transfer_start", RECEIVERS, object_id=oid)  # every receiver streams
            killed = time.monotonic()
            d.kill()
            d.start()
            ends = [w.result()[0] for w in workers[1:]]
            # The restarted directory's log, once every node (the workers and this one) rejoined.
            _wait_event(owner, "node_joined", len(workers) + 1)
            events = owner.event_log()
            joined = [e["t"] for e in events if e["kind"] == "node_joined"]
            restored = [e["t"] for e in events if e["kind"] == "restore"]
            figures["fault"].append(max(ends) - start)
            figures["detect"].append(min(joined) - killed)
            figures["repair"].append(max(joined + restored) - killed)
        finally:
            for w in workers:
                w.kill()
            owner.close()
            d.kill()
    return figures


def _wait_event(
    owner: Any, kind: str, count: int = 1, timeout: float = 60.0, **fields: Any
) -> dict[str, Any]:
    """Poll the directory until ``count`` events of ``kind`` with ``fields`` happened (with a
    deadline); the last of them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = owner.event_log()
        found = [e for e in events if e["kind"] == kind and all(e.get(k) == v for k, v in fields.items())]
        if len(found) >= count:
            return found[count - 1]
        time.sleep(0.005)  # polling interval
    raise RuntimeError(f"no {kind} event {fields} within {timeout} s")


def summarize(name: str, figures: dict[str, list[float]]) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in figures.items()}
    return {
        "scenario": name,
        "runs": len(figures["fault"]),
        "detect_s": round(med["detect"], 4),
        "repair_s": round(med["repair"], 4),
        "repair_max_s": round(max(figures["repair"]), 4),
        "op_s": round(med["base"], 4),
        "op_with_fault_s": round(med["fault"], 4),
        "extra_s": round(med["fault"] - med["base"], 4),
        "samples": {k: [round(x, 4) for x in v] for k, v in figures.items()},
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    header = [
        ("scenario", "l"),
        ("runs", "r"),
        ("detect (s)", "r"),
        ("repair (s)", "r"),
        ("repair max (s)", "r"),
        ("op (s)", "r"),
        ("op with fault (s)", "r"),
        ("extra (s)", "r"),
    ]
    body = [
        [
            r["scenario"],
            str(r["runs"]),
            f"{r['detect_s']:.3f}",
            f"{r['repair_s']:.3f}",
            f"{r['repair_max_s']:.3f}",
            f"{r['op_s']:.3f}",
            f"{r['op_with_fault_s']:.3f}",
            f"{r['extra_s']:+.3f}",
        ]
        for r in rows
    ]
    return markdown_table(header, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="64MiB", help="object size")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    os.environ.setdefault("HOPLITE_SHARED_MEMORY", "0")
    log = os.path.join(tempfile.mkdtemp(prefix="hoplite-faults-"), "faults.jsonl")
    os.environ["HOPLITE_FAULT_LOG"] = log  # inherited by the workers
    import hoplite_gpu as hg

    owner = hg.init(shared_memory=False)
    rows = []
    try:
        print(f"recovery benchmark: {format_size(size)}, {args.repeat} runs per scenario", flush=True)
        for name, run in (
            ("relay killed (broadcast)", lambda: relay(owner, size, args.repeat, log, "KILL")),
            ("vertex killed (reduce, k=n-1)", lambda: vertex(owner, size, args.repeat, log)),
            ("relay stopped (broadcast)", lambda: relay(owner, size, args.repeat, log, "STOP")),
            ("directory killed (broadcast)", lambda: directory(size, args.repeat)),
        ):
            print(f"  {name} ...", flush=True)
            rows.append(summarize(name, run()))
    finally:
        owner.close()
    print(format_table(rows))
    write_json(args.json, {"size": size, "repeat": args.repeat, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
