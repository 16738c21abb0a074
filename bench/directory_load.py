"""How much of the directory's time one request takes when the directory holds a lot: a reduce
over ``n`` inputs that are all present, and single events while tens of thousands of lookups are
pending. Everything the directory does on one event runs on its one event loop, so every other
node's round trip waits behind it.

The first two tables drive :class:`~hoplite_gpu.directory.state.DirectoryState` directly (no
sockets: the times are the state machine's own CPU time per event, which the service adds to every
other request). A reduce over present inputs is placed :data:`PLACE_SLICE` inputs per event (see
``state.Resume``): the table gives the whole reduce and its longest event.

The deadline table (``--nodes``) times ``next_deadline``, which the service asks after every event,
with that many nodes joined and as many reductions kept (``--parts`` picks the tables).

The last table is the service as nodes see it: a real directory on loopback, one peer holding
``--pending`` lookups that wait, one that puts ``--service-inputs`` objects and reduces them all, and
one that measures its round trips (a lookup of a small object) meanwhile, with the reduce placed a
slice per event and, for comparison in the same run, all at once.

    python bench/directory_load.py --inputs 1000,2000,4000,8000,10000 --pending 20000
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import multiprocessing
import socket
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

from hoplite_gpu import auth
from hoplite_gpu import protocol as p
from hoplite_gpu.directory.config import DirectoryConfig
from hoplite_gpu.directory.state import (
    PLACE_SLICE,
    ContinueReduce,
    DirectoryState,
    NodeJoined,
    Request,
    Resume,
    Tick,
)


def _oid(i: int) -> bytes:
    return i.to_bytes(20, "big")


def reduce_seconds(n: int) -> tuple[float, float]:
    """Seconds one ReduceRequest over ``n`` present 1 MiB inputs (on two nodes) takes, all its
    events together and the longest one."""
    state = DirectoryState(DirectoryConfig(inline_threshold_bytes=64 * 1024, lease_timeout=math.inf))
    for node, port in (("A", 7000), ("B", 7001)):
        state.handle(NodeJoined(node, "127.0.0.1", port, 0.0))
    ids = [_oid(i) for i in range(1, n + 1)]
    for k, oid in enumerate(ids):
        put = p.PutRequest(
            request_id=k + 1, object_id=oid, size=1 << 20, dtype="|u1", shape=[1 << 20], digest=b""
        )
        state.handle(Request("AB"[k % 2], put, 0.0))
    rid = b"r" * 20
    event: object = Request(
        "A", p.ReduceRequest(request_id=0, reduction_id=rid, object_ids=ids, op="sum", num_objects=n), 1.0
    )
    total = longest = 0.0
    while True:
        started = time.perf_counter()
        out = state.handle(event)  # type: ignore[arg-type]
        took = time.perf_counter() - started
        total, longest = total + took, max(longest, took)
        if not any(isinstance(i, Resume) for i in out):
            return total, longest
        event = ContinueReduce(rid, 1.0)


def per_event_ms(pending: int) -> dict[str, float]:
    """Milliseconds of single events with ``pending`` lookups waiting (half with a deadline)."""
    state = DirectoryState(DirectoryConfig(inline_threshold_bytes=64 * 1024, lease_timeout=math.inf))
    state.handle(NodeJoined("A", "127.0.0.1", 7000, 0.0))
    for k in range(pending):
        timeout = 30.0 if k % 2 else 0.0
        state.handle(
            Request("A", p.LookupRequest(request_id=k + 1, object_id=_oid(10**7 + k), timeout=timeout), 1.0)
        )

    def timed(step: object, rounds: int = 100) -> float:
        started = time.perf_counter()
        for i in range(rounds):
            step(i)  # type: ignore[operator]
        return (time.perf_counter() - started) / rounds * 1000

    def put(i: int) -> None:
        msg = p.PutRequest(
            request_id=10**6 + i,
            object_id=_oid(2 * 10**7 + i),
            size=4,
            dtype="|u1",
            shape=[4],
            digest=b"",
            inline=b"abcd",
        )
        state.handle(Request("A", msg, 2.0))

    def cancel(i: int) -> None:
        state.handle(Request("A", p.CancelLookup(request_id=pending - i), 2.0))

    return {
        "put of an unrelated object": timed(put),
        "next_deadline (after every event)": timed(lambda i: state.next_deadline()),
        "Tick before any deadline": timed(lambda i: state.handle(Tick(2.0 + i * 1e-6))),
        "CancelLookup": timed(cancel),
    }


def _exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("closed")
        data += part
    return bytes(data)


def read_frame(sock: socket.socket) -> p.Message:
    """The next message on a blocking socket to the directory."""
    (length,) = p.FRAME_HEADER.unpack(_exact(sock, p.FRAME_HEADER.size))
    return p.decode(_exact(sock, length))


def joined(address: str, token: str, node_id: str, port: int) -> socket.socket:
    """A blocking socket to the directory at ``address``, authenticated and joined as node
    ``node_id`` (data port ``port``, never dialled by these benchmarks' requests)."""
    host, port_text = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port_text)), timeout=30)
    challenge = read_frame(sock)
    assert isinstance(challenge, p.Challenge)
    mine = auth.new_nonce()
    proof = auth.mac(token, b"client", challenge.nonce, mine)
    sock.sendall(p.encode(p.Hello(node_id=node_id, nonce=mine, proof=proof, data_host=host, data_port=port)))
    assert isinstance(read_frame(sock), p.Welcome)
    return sock


class _Peer:
    """A raw authenticated connection to a directory, with a thread that reads every frame and
    completes the request whose id it answers (pushes are read and dropped)."""

    def __init__(self, address: str, token: str, node_id: str, port: int) -> None:
        self.sock = joined(address, token, node_id, port)
        self.replies: dict[int, float] = {}  # request id -> when its reply arrived
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _frame(self) -> p.Message:
        return read_frame(self.sock)

    def _read(self) -> None:
        try:
            while True:
                msg = self._frame()
                rid = getattr(msg, "request_id", None)
                if rid is not None:
                    with self.cond:
                        self.replies[rid] = time.perf_counter()
                        self.cond.notify_all()
        except (OSError, ConnectionError):
            pass

    def send(self, msg: p.Message) -> None:
        self.sock.sendall(p.encode(msg))

    def wait(self, request_id: int, timeout: float = 120.0) -> float:
        with self.cond:
            if not self.cond.wait_for(lambda: request_id in self.replies, timeout):
                raise TimeoutError(f"no reply to request {request_id}")
            return self.replies[request_id]


@contextlib.contextmanager
def standalone_directory(env: dict[str, str]) -> Iterator[tuple[str, str, int]]:
    """A directory in its own process (``hoplite-gpu directory``, invariant checks off), with
    these extra environment variables: its address, token and process id."""
    token = auth.new_token()
    env = {**os.environ, "HOPLITE_TOKEN": token, "HOPLITE_VALIDATE_DIRECTORY": "0", **env}
    cli = [sys.executable, "-m", "hoplite_gpu.cli", "directory", "--port", "0"]
    proc = subprocess.Popen(cli, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"the directory did not start: {line!r}")
        yield line.split()[-1], token, proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def service_round_trips(inputs: int, pending: int, place_slice: int) -> dict[str, float]:
    """Round trips (ms) of a third node's lookups while a standalone directory (its own process,
    ``hoplite-gpu directory``) holds ``pending`` waiting lookups and places a reduce over
    ``inputs`` present objects, ``place_slice`` of them per event."""
    with standalone_directory({"HOPLITE_DIRECTORY_PLACE_SLICE": str(place_slice)}) as (address, token, _):
        waiter = _Peer(address, token, "waiter", 9001)
        maker = _Peer(address, token, "maker", 9002)
        ctx = multiprocessing.get_context("spawn")
        here, there = ctx.Pipe()
        # The prober runs in a process of its own: in this one, the threads reading the maker's
        # thousands of pushes would hold the GIL while the prober's replies wait.
        prober = ctx.Process(target=_probe, args=(address, token, there), daemon=True)
        prober.start()
        for k in range(pending):
            waiter.send(p.LookupRequest(request_id=k + 1, object_id=_oid(10**7 + k), timeout=600.0))
        ids = [_oid(i) for i in range(1, inputs + 1)]
        for k, oid in enumerate(ids):
            maker.send(p.PutRequest(k + 1, oid, 1 << 20, "|u1", [1 << 20], b""))
        maker.wait(inputs)
        here.send("go")
        if not here.poll(120):
            raise TimeoutError("the prober did not start")
        idle = here.recv()  # sent as it starts the probes that the reduce below overlaps
        maker.send(p.ReduceRequest(10**6, b"r" * 20, ids, "sum", inputs))
        maker.wait(10**6)
        if not here.poll(120):
            raise TimeoutError("the prober did not finish")
        busy = sorted(here.recv())
        prober.join(30)
        return {
            "idle median": statistics_median(idle),
            "during median": statistics_median(busy),
            "during p99": busy[int(len(busy) * 0.99) - 1],
            "during max": busy[-1],
        }


def _probe(address: str, token: str, conn: Any) -> None:
    """The prober process: an inline object, then lookups of it, timed one at a time: 200 before
    the reduce (sent back first), then 300 that the reduce overlaps."""
    peer = _Peer(address, token, "prober", 9003)
    small = _oid(3 * 10**7)
    peer.send(p.PutRequest(1, small, 8, "|u1", [8], b"", bytes(8)))
    peer.wait(1)
    conn.recv()  # "go": the other peers are set up

    def probe(first: int, count: int) -> list[float]:
        rtts = []
        for k in range(first, first + count):
            sent = time.perf_counter()
            peer.send(p.LookupRequest(request_id=k, object_id=small, timeout=0.0))
            rtts.append((peer.wait(k) - sent) * 1000)
        return rtts

    conn.send(probe(2, 200))
    conn.send(probe(1000, 300))


def statistics_median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def deadline_us(nodes: int, reductions: int) -> dict[str, float]:
    """Microseconds of ``next_deadline`` (the service asks after every event) with ``nodes``
    joined, heard of since, and ``reductions`` kept, each with a timeout and its inputs present
    (its plan full: it waits for no input), and of a Tick that checks the leases."""
    state = DirectoryState(DirectoryConfig(inline_threshold_bytes=64 * 1024, lease_timeout=30.0))
    for i in range(nodes):
        state.handle(NodeJoined(f"n{i}", "127.0.0.1", 7000 + i % 50000, 0.0))
    state.next_deadline()
    for i in range(nodes):
        state.handle(Request(f"n{i}", p.Heartbeat(), 1.0))
    for r in range(reductions):
        inputs = [_oid(3 * 10**7 + 2 * r), _oid(3 * 10**7 + 2 * r + 1)]
        for k, oid in enumerate(inputs):
            put = p.PutRequest(1, oid, size=1 << 20, dtype="|u1", shape=[1 << 20], digest=b"")
            state.handle(Request(f"n{(2 * r + k) % nodes}", put, 1.0))
        request = p.ReduceRequest(2, _oid(4 * 10**7 + r), inputs, "sum", 2, timeout=60.0)
        state.handle(Request(f"n{r % nodes}", request, 1.0))
    first = time.perf_counter()
    state.next_deadline()  # (on this code, the first call forgets the reductions that wait for nothing)
    first = time.perf_counter() - first
    rounds = 200
    started = time.perf_counter()
    for _ in range(rounds):
        state.next_deadline()
    each = (time.perf_counter() - started) / rounds * 1e6
    started = time.perf_counter()
    state.handle(Tick(2.0))
    return {"first": first * 1e6, "next_deadline": each, "Tick": (time.perf_counter() - started) * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", default="1000,2000,4000,8000,10000")
    parser.add_argument("--pending", type=int, default=20000)
    parser.add_argument("--service-inputs", type=int, default=10000)
    parser.add_argument("--nodes", default="10,1000", help="nodes joined, for the deadline table")
    parser.add_argument("--parts", default="reduce,events,deadline,service", help="tables to print")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if "deadline" in parts:
        print(
            "| nodes | reductions kept | next_deadline, us: first | then each | a Tick, us |\n"
            "|---:|---:|---:|---:|---:|"
        )
        for n in (int(x) for x in args.nodes.split(",")):
            r = deadline_us(n, n)
            cells = f"{r['first']:.1f} | {r['next_deadline']:.1f} | {r['Tick']:.0f}"
            print(f"| {n} | {n} | {cells} |", flush=True)
        print()
    print("| reduce inputs (all present) | directory seconds | longest event, ms |\n|---:|---:|---:|")
    for n in (int(x) for x in args.inputs.split(",") if "reduce" in parts):
        total, longest = reduce_seconds(n)
        print(f"| {n} | {total:.3f} | {longest * 1000:.1f} |", flush=True)
    print(f"\n| event, with {args.pending} lookups pending | ms |\n|---|---:|")
    for name, ms in per_event_ms(args.pending).items() if "events" in parts else ():
        print(f"| {name} | {ms:.3f} |", flush=True)
    print(
        f"\nA node's lookup round trips (ms) on a directory with {args.pending} lookups waiting, while "
        f"it places a reduce over {args.service_inputs} present inputs\n"
        "| placement | idle median | during: median | p99 | max |\n|---|---:|---:|---:|---:|"
    )
    for place_slice in (PLACE_SLICE, 10**9) if "service" in parts else ():
        r = service_round_trips(args.service_inputs, args.pending, place_slice)
        name = f"{place_slice} inputs per event" if place_slice < 10**9 else "all in one event (before)"
        print(
            f"| {name} | {r['idle median']:.2f} | {r['during median']:.2f} | {r['during p99']:.2f} | "
            f"{r['during max']:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
