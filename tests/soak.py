"""The randomized fault soak's engine: every operation users call, a member killed or stopped at a
random point, every outcome judged.

A run picks an operation (:data:`OPERATIONS`), a victim among the workers, a fault point (an event
of :mod:`hoplite_gpu.faults` on any object at a random offset, or ``now``: the soak signals the
victim itself just after the operation started) and a signal (``KILL``, or ``STOP``: a hung
member, left stopped for longer than the lease and the stall timeout). It runs the operation with
deadlines and judges every member that was not the victim, and the victim too when the fault
never fired:

* **exact**: the result equals the one computed here (bit for bit: every array holds small
  integers, so sums are exact in any order); a reduction equals NumPy's over the inputs
  ``reduced_objects`` reports;
* **lost**: a typed error naming the lost object or member (:data:`TYPED`), only after the fault
  fired, within :data:`ERROR_BOUND` of it (the fault log's time: ``HOPLITE_FAULT_LOG``);
* **failed**: anything else: a wrong result, a wait past its deadline (a hang), another error,
  a typed error without a fault or too late, or something left behind (see :meth:`Soak.leaks`).

With a standalone directory (``Soak(..., directory=DirectoryProcess)``) a third fault joins
them, ``DIRECTORY``: the directory is SIGKILLed a random moment after the operation started and
restarted at once at the same address (or, with the Ray directory actor, SIGKILLed and restarted
by Ray at a new address its nodes find through the actor). No member dies, so every member must
end **exact**: the nodes reconnect, restore their copies and re-send what they wait for; the one
exception is a sharded allreduce in flight, which lends the caller's array and raises
``ObjectLostError`` (:data:`RESTARTED`) within the bound. Its workers share memory (same-host
copies through ``/dev/shm``, the default on one host), and no segment of a process the soak started
may outlive it once the run settled.

A failed run writes the directory's event log (``HOPLITE_SOAK_LOG``), replaces every worker and
the soak goes on; :meth:`Soak.table` prints the counts per operation and fault.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

import hoplite_gpu as hg
from hoplite_gpu.coding import GradientCode
from hoplite_gpu.memory import sweep_orphans
from tests.procs import Worker, digest, make_array, start_workers, weights_state

WORKERS = 4
DEADLINE = 60.0  # any wait longer than this is a hang
STALL = 5.0  # the workers' stall timeout
LEASE = 5.0  # the directory's lease
#: A survivor's typed error comes at most this long after the fault (the stall timeout + 5 s).
ERROR_BOUND = STALL + 5.0
CONFIG = {
    "adaptive_chunks": False,
    "chunk_bytes": 256 << 10,
    "send_rate_limit": 64 << 20,
    "stall_timeout": STALL,
}
SHAPE = (1 << 20,)  # 4 MiB of float32: sharded collectives, many chunks
SMALL = (1 << 14,)  # 64 KiB: the small-allreduce path (one tree), above the inline threshold
#: Weights: three tensors in buckets of 1 MiB.
LAYOUT = [("a", "float32", (256, 1024)), ("b", "float32", (300, 500)), ("c", "int32", (1000, 300))]
EVENTS = ("serve", "receive", "reduce", "report", "now")
AT = (0.0, 0.25, 0.5, 0.75, 0.99, 1.0)
SIGNALS = ("KILL", "STOP")
#: The directory fault (a standalone directory killed and restarted) comes at most this long after
#: the operation started.
RESTART_WITHIN = 0.5
SHM = "/dev/shm"
_SEGMENT = re.compile(r"hoplite-\d+-(\d+)-\d+-[0-9a-f]+")  # a process's segment (memory/shm.py)
#: What the one error a directory's restart may cause says (a sharded allreduce in flight).
RESTARTED = "the directory restarted during allreduce"
#: Errors that say what was lost: the soak's "lost" outcome.
TYPED = ("MemberLostError", "ObjectLostError", "WeightSyncError", "RankLostError")


class Failure(AssertionError):
    """A run ended in something the oracle does not accept."""


@dataclass
class Run:
    """One run: what it does, to whom, and what came of it."""

    number: int
    op: str
    victim: int
    event: str
    at: float
    sig: str
    pid: int = 0
    node_id: str = ""
    fired_at: float | None = None  # time.monotonic() of the fault (the fault log's clock)
    restarted: threading.Thread | None = None  # DIRECTORY: the thread killing and restarting it
    restart_at: float | None = None  # DIRECTORY: time.monotonic() of the kill
    outcomes: list[str] = field(default_factory=list)  # per member judged: "exact" / "lost"
    worst: float = 0.0  # longest time from the fault to a survivor's typed error

    @property
    def spec(self) -> str:
        return f"{self.event}:*:{self.at}:{self.sig}"

    def __str__(self) -> str:
        if self.sig == "DIRECTORY":
            return f"run {self.number}: {self.op}, the directory restarted"
        return f"run {self.number}: {self.op}, worker {self.victim} {self.sig} at {self.event} {self.at}"


def _read(conn: Any) -> tuple[str, Any, float]:
    """One answer from a worker's pipe (see :meth:`Soak.answers`), with the time it came."""
    try:
        status, value = conn.recv()
    except (EOFError, OSError):
        return ("dead", None, time.monotonic())
    return (status, value[0] + ": " + value[1] if status == "error" else value, time.monotonic())


def expected_reduce(arrays: list[np.ndarray[Any, Any]], op: str) -> np.ndarray[Any, Any]:
    """The reduction of ``arrays`` by ``op`` (``sum`` or ``max``), in float32 like the library's."""
    return np.sum(arrays, axis=0, dtype=arrays[0].dtype) if op == "sum" else np.max(arrays, axis=0)


class Restartable(Protocol):
    """A directory the soak kills and restarts: a standalone ``DirectoryProcess``, or the Ray
    directory actor (``tests/test_soak.py``)."""

    def kill(self) -> None:
        """SIGKILL it."""

    def start(self) -> Any:
        """Start it again (or wait until it was), at an address its nodes find."""


class Soak:
    """Runs of the soak on ``owner``'s directory with :data:`WORKERS` worker processes; with
    ``directory`` (the one ``owner`` is connected to), runs restart it too. ``connect``: more
    settings of the workers' nodes (``ray_directory``: see ``tests.procs``)."""

    def __init__(
        self,
        owner: Any,
        seed: int,
        operations: tuple[str, ...] | None = None,
        directory: Restartable | None = None,
        connect: dict[str, Any] | None = None,
    ) -> None:
        self.owner = owner
        self.directory = directory
        self.connect = connect or {}  # how workers find the directory, besides its address
        self.signals = SIGNALS if directory is None else (*SIGNALS, "DIRECTORY")
        # Same-host copies through /dev/shm (the default on one host) with the standalone directory.
        self.config = {**CONFIG, "shared_memory": directory is not None and os.path.isdir(SHM)}
        self.pids: set[int] = set()  # every worker process started
        self.seed = seed
        self.rng = random.Random(seed)
        # Torch ranks find the directory at its address: not the Ray actor's, which moves. Not
        # with directory restarts either: a rank that joined as the directory restarted failed
        # (make test, restart soak seed 1 run 3: its node gone, the others' RankLostError).
        torch = importlib.util.find_spec("torch") is not None and directory is None
        self.operations = operations or tuple(o for o in OPERATIONS if torch or o != "torch")
        self.counts: Counter[tuple[str, str, str]] = Counter()  # (op, fault, outcome)
        self.worst: dict[str, float] = {}
        self.failures: list[str] = []
        # The workers append each fault to this file when it fires (they inherit the variable).
        self._set_log = "HOPLITE_FAULT_LOG" not in os.environ
        self._log = os.environ.setdefault(
            "HOPLITE_FAULT_LOG", os.path.join(tempfile.mkdtemp(prefix="hoplite-soak-"), "faults")
        )
        self._log_at = os.path.getsize(self._log) if os.path.exists(self._log) else 0
        self.workers = self._start(WORKERS)

    # ------------------------------------------------------------ workers
    def _start(self, n: int) -> list[Worker]:
        workers = start_workers(
            self.owner.directory_address, self.owner.token, n, **self.config, **self.connect
        )
        self.pids.update(w.proc.pid for w in workers)
        return workers

    def replace(self, i: int) -> Worker:
        """Kill worker ``i`` (stopped or not) and start a fresh one (a restarted task)."""
        self.workers[i].kill()
        self.workers[i] = self._start(1)[0]
        return self.workers[i]

    def close(self) -> None:
        """Kill the workers (the soak may go on with fresh ones: :meth:`restart`)."""
        for w in self.workers:
            w.kill()

    def restart(self) -> None:
        """Fresh workers, after a failed run."""
        self.close()
        self.workers = self._start(WORKERS)

    def finish_soak(self) -> None:
        """Kill the workers, sweep the segments they could not unlink (killed) and unset the
        fault log (if this soak set it)."""
        self.close()
        if self.config["shared_memory"]:
            sweep_orphans()
        if self._set_log:
            os.environ.pop("HOPLITE_FAULT_LOG", None)

    def fired(self, pid: int) -> float | None:
        """When the fault armed in process ``pid`` fired (None: not yet)."""
        with open(self._log) if os.path.exists(self._log) else open(os.devnull) as log:
            log.seek(self._log_at)
            for line in log:
                entry = json.loads(line)
                if entry["pid"] == pid:
                    return float(entry["t"])
        return None

    def _signal(self, run: Run) -> None:
        """The ``now`` fault: signal the victim from here, logged like one it fired itself."""
        line = json.dumps(
            {
                "event": "now",
                "object_id": "*",
                "offset": 0,
                "signal": run.sig,
                "pid": run.pid,
                "t": time.monotonic(),
            }
        )
        with open(self._log, "a") as log:
            log.write(line + "\n")
        os.kill(run.pid, signal.SIGKILL if run.sig == "KILL" else signal.SIGSTOP)

    # ------------------------------------------------------------ one run
    def once(self, number: int) -> Run:
        """One run; raises :class:`Failure` (after which the workers are replaced)."""
        rng = self.rng
        op = rng.choice(self.operations)
        run = Run(
            number, op, rng.randrange(WORKERS), rng.choice(EVENTS), rng.choice(AT), rng.choice(self.signals)
        )
        if run.sig == "DIRECTORY":  # no member is the victim
            run.victim, run.event = -1, "now"
        else:
            run.pid = self.workers[run.victim].proc.pid
            run.node_id = self.workers[run.victim].node_id
        self._log_at = os.path.getsize(self._log) if os.path.exists(self._log) else 0
        try:
            OPERATIONS[op](self, run, rng)
        finally:
            self._restarted(run)
        self.settle(run)
        fault = (
            "DIRECTORY" if run.restarted is not None else run.sig if run.fired_at is not None else "missed"
        )
        outcome = "lost" if "lost" in run.outcomes else "exact"
        self.counts[op, fault, outcome] += 1
        if run.fired_at is not None:
            self.worst[op] = max(self.worst.get(op, 0.0), run.worst)
        return run

    def arm(self, run: Run) -> None:
        if run.event != "now" and run.sig != "DIRECTORY":
            self.workers[run.victim].call("arm", run.spec)

    def start(self, run: Run) -> None:
        """Just after the operation's commands went out: the ``now`` fault, or the directory's
        restart a random moment later (on a thread: the operation goes on meanwhile)."""
        if run.sig == "DIRECTORY":
            delay = self.rng.uniform(0.0, RESTART_WITHIN)
            run.restarted = threading.Thread(target=self._restart_directory, args=(run, delay), daemon=True)
            run.restarted.start()
        elif run.event == "now":
            self._signal(run)

    def _restart_directory(self, run: Run, delay: float) -> None:
        assert self.directory is not None
        time.sleep(delay)  # not synchronisation: a random moment of the operation for the fault
        run.restart_at = time.monotonic()
        self.directory.kill()
        self.directory.start()

    def _restarted(self, run: Run) -> None:
        """Wait for the directory's restart to be over (a run's end, before anything is checked)."""
        if run.restarted is not None:
            run.restarted.join(DEADLINE)
            if run.restarted.is_alive():
                raise Failure(f"{run}: the directory did not restart within {DEADLINE} s")

    def judge(self, run: Run, i: int, answer: tuple[str, Any, float], check: Callable[[Any], bool]) -> None:
        """Judge member ``i``'s answer (status, value or error text, time it came)."""
        status, value, when = answer
        if status == "dead" and i == run.victim and run.fired_at is not None:
            return  # the victim: nothing to judge
        if status == "ok":
            if not check(value):
                raise Failure(f"{run}: wrong result on worker {i}")
            run.outcomes.append("exact")
            return
        if status == "error" and value.split(":", 1)[0] in TYPED:
            fault_at = run.fired_at
            if fault_at is None and run.restart_at is not None and RESTARTED in value:
                fault_at = run.restart_at  # a sharded allreduce in flight: documented, typed
            if fault_at is None:
                raise Failure(f"{run}: worker {i} raised without a fault: {value[:400]}")
            took = when - fault_at
            run.worst = max(run.worst, took)
            if took > ERROR_BOUND:
                raise Failure(
                    f"{run}: worker {i}'s typed error came {took:.1f} s after the fault: {value[:200]}"
                )
            run.outcomes.append("lost")
            return
        raise Failure(f"{run}: worker {i}: {status}: {str(value)[:800]}")

    def answers(
        self, run: Run, members: list[int], deadline: float = DEADLINE
    ) -> dict[int, tuple[str, Any, float]]:
        """The answers of ``members`` to the commands sent them: (``"ok"``, value) or (``"error"``,
        ``"Kind: text"``) or (``"dead"``, None) for the victim if its fault fired, with the time
        each came. Waits past the victim's fault only as long as a survivor may."""
        # Each answer is read on a thread of its own: a member stopped in the middle of sending one
        # leaves a pipe that is readable but never complete (a blocking read there hung the soak).
        readers = concurrent.futures.ThreadPoolExecutor(len(members))
        reading = {i: readers.submit(_read, self.workers[i].conn) for i in members}
        readers.shutdown(wait=False)
        got: dict[int, tuple[str, Any, float]] = {}
        end = time.monotonic() + deadline
        dumped = False
        while len(got) < len(members):
            if run.fired_at is None:
                run.fired_at = self.fired(run.pid)
            fault = run.fired_at if run.fired_at is not None else run.restart_at
            if not dumped and fault is not None and time.monotonic() > fault + ERROR_BOUND:
                dumped = True  # already late: the coroutines of those not done, for the failure
                for i in members:
                    if i not in got and i != run.victim and not reading[i].done():
                        os.kill(self.workers[i].proc.pid, signal.SIGUSR2)
            for i, fut in reading.items():
                if i in got:
                    continue
                if fut.done():
                    got[i] = fut.result()
                elif i == run.victim and run.fired_at is not None:
                    got[i] = ("dead", None, time.monotonic())  # not read: it may never be whole
            if len(got) == len(members):
                break
            if time.monotonic() > end:
                late = [i for i in members if i not in got]
                for i in late:  # their threads' stacks, on stderr (tests/procs.py registers it)
                    os.kill(self.workers[i].proc.pid, signal.SIGUSR1)
                    os.kill(self.workers[i].proc.pid, signal.SIGUSR2)  # and their coroutines'
                raise Failure(f"{run}: hang: workers {late} did not answer within {deadline} s")
            pending = [f for i, f in reading.items() if i not in got]
            concurrent.futures.wait(pending, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
        if run.fired_at is None:
            run.fired_at = self.fired(run.pid)
        return got

    def finish(self, run: Run, got: dict[int, tuple[str, Any, float]]) -> None:
        """After the operation: the victim is replaced if its fault fired (a dead victim must have
        fired), disarmed otherwise."""
        if run.fired_at is None:
            run.fired_at = self.fired(run.pid)
        if run.fired_at is None and got.get(run.victim, ("",))[0] == "dead":
            run.fired_at = self.fired(run.pid)
            if run.fired_at is None:
                raise Failure(f"{run}: the victim died without its fault firing")
        if run.fired_at is not None:
            if self.workers[run.victim].proc.pid == run.pid:
                self.replace(run.victim)
        elif run.event != "now":
            try:
                self.workers[run.victim].call("disarm", timeout=30)
            except (EOFError, OSError, RuntimeError, TimeoutError):  # it fired after all, late
                run.fired_at = self.fired(run.pid)
                self.replace(run.victim)

    def survivors(self, run: Run) -> list[int]:
        return [i for i in range(WORKERS) if i != run.victim or run.fired_at is None]

    # ------------------------------------------------------------ leaks
    def leaks(self) -> list[str]:
        """What the directory still holds that nobody alive should (its public summary, so a
        standalone directory is checked the same way): objects put by live nodes (every
        operation deletes what it put), objects with no copy on a live node, waiting lookups,
        transfers, unfinished reductions."""
        summary = self.owner.directory_summary()
        live = {w.node_id for w in self.workers} | {self.owner.node_id}
        found = [
            f"object {o['object_id'][:12]} ({o['size']} B) of {o['owner'][:8]} held by "
            f"{len(o['holders'] + o['receiving'])}"
            for o in summary["objects"]
            if o["owner"] in live or not (o["inline"] or o["holders"] or o["receiving"])
        ]
        found += [f"lookup of {oid[:12]}" for oid in summary["lookups"]]
        found += [
            f"transfer of {t['object_id'][:12]} {t['sender'][:8]} -> {t['receiver'][:8]}"
            for t in summary["transfers"]
        ]
        found += [f"reduction {rid[:12]}" for rid in summary["reductions"]]
        return found

    def orphans(self) -> list[str]:
        """Shared-memory segments of worker processes that are gone (a killed one cannot unlink
        its own: the next node to start on the host sweeps them, see ``sweep_orphans``)."""
        if not self.config["shared_memory"]:
            return []
        live = {w.proc.pid for w in self.workers}
        found = []
        for name in os.listdir(SHM):
            m = _SEGMENT.fullmatch(name)
            if m is not None and int(m.group(1)) in self.pids - live:
                found.append(f"/dev/shm/{name}")
        return found

    def settle(self, run: Run) -> None:
        """Wait (with a deadline) until :meth:`leaks` finds nothing: deletes run in the background."""
        end = time.monotonic() + 30
        while True:
            found = self.leaks() + self.orphans()
            if not found:
                return
            if time.monotonic() > end:
                raise Failure(f"{run}: left behind: {found[:5]} ({len(found)} in all)")
            time.sleep(0.05)  # polling with a deadline

    # ------------------------------------------------------------ reporting
    def table(self) -> str:
        """Counts per operation and fault (``missed``: the fault point was never reached)."""
        rows = ["operation        fault      exact  lost  worst s"]
        for op in sorted({k[0] for k in self.counts}):
            for fault in ("KILL", "STOP", "DIRECTORY", "missed"):
                exact, lost = self.counts[op, fault, "exact"], self.counts[op, fault, "lost"]
                if exact or lost:
                    worst = f"{self.worst.get(op, 0):.1f}" if fault != "missed" else ""
                    rows.append(f"{op:<16} {fault:<10} {exact:>5} {lost:>5}  {worst}")
        rows.append(f"failed: {len(self.failures)}")
        return "\n".join(rows)


# ---------------------------------------------------------------- operations
def _group(soak: Soak, run: Run) -> str:
    name = f"soak-{soak.seed}-{run.number}"
    for i, w in enumerate(soak.workers):
        w.send("group", name, i, WORKERS, DEADLINE, True)
    for w in soak.workers:
        w.result(30)
    return name


def _close_group(soak: Soak, run: Run, name: str) -> None:
    """Every live member destroys the group (a broken one cleans up at once)."""
    members = soak.survivors(run)
    for i in members:
        soak.workers[i].send("destroy", name)
    got = soak.answers(run, members, 30)
    for i, (status, value, _) in got.items():
        if status == "error" and not value.startswith(TYPED):
            raise Failure(f"{run}: destroy on worker {i}: {value[:400]}")


def collective(
    cmd: str, shape: tuple[int, ...], result: Callable[[Run, int, int, str], Any]
) -> Callable[..., None]:
    """A group collective every member calls: ``result(run, rank, seed, op)`` is what rank gets
    (None: anything)."""

    def go(soak: Soak, run: Run, rng: random.Random) -> None:
        seed, op, root = rng.randrange(1 << 30), rng.choice(["sum", "max"]), rng.randrange(WORKERS)
        name = _group(soak, run)
        soak.arm(run)
        extra = {"broadcast": (root,), "reduce_to": (root, op), "allgather": ()}.get(cmd, (op,))
        for w in soak.workers:
            w.send(cmd, name, "float32", shape, seed, *extra)
        soak.start(run)
        got = soak.answers(run, list(range(WORKERS)))
        for i, answer in got.items():
            want = result(run, i, seed, f"{op}:{root}")
            soak.judge(run, i, answer, lambda v, want=want: want is None or _same(v, want))
        soak.finish(run, got)
        _close_group(soak, run, name)

    return go


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want, strict=True))
    return digest(np.asarray(got)) == digest(want)


def _inputs(seed: int, shape: tuple[int, ...]) -> list[np.ndarray[Any, Any]]:
    return [make_array("float32", shape, seed + r) for r in range(WORKERS)]


def _allreduce(shape: tuple[int, ...]) -> Callable[[Run, int, int, str], Any]:
    return lambda run, rank, seed, how: expected_reduce(_inputs(seed, shape), how.split(":")[0])


def _reduce_to(run: Run, rank: int, seed: int, how: str) -> Any:
    op, root = how.split(":")
    return expected_reduce(_inputs(seed, SHAPE), op) if rank == int(root) else None


def _reducescatter(run: Run, rank: int, seed: int, how: str) -> Any:
    pieces = [make_array("float32", SHAPE, seed + src * 100 + rank) for src in range(WORKERS)]
    return expected_reduce(pieces, how.split(":")[0])


def sendrecv(soak: Soak, run: Run, rng: random.Random) -> None:
    """Two pairs: each sender sends a message to its receiver, which receives it."""
    order = list(range(WORKERS))
    rng.shuffle(order)
    pairs = [(order[0], order[1]), (order[2], order[3])]
    seed, tag = rng.randrange(1 << 30), rng.randrange(3)
    name = _group(soak, run)
    soak.arm(run)
    for src, dst in pairs:
        soak.workers[src].send("send", name, "float32", SHAPE, seed + src, dst, tag)
        soak.workers[dst].send("recv", name, "float32", SHAPE, src, tag)
    soak.start(run)
    got = soak.answers(run, list(range(WORKERS)))
    for src, dst in pairs:
        want = make_array("float32", SHAPE, seed + src)
        for i, check in ((src, lambda v: v is True), (dst, lambda v, want=want: _same(v, want))):
            soak.judge(run, i, got[i], check)
    soak.finish(run, got)
    _close_group(soak, run, name)


def barrier(soak: Soak, run: Run, rng: random.Random) -> None:
    """A barrier moves no bytes: its fault is always ``now``."""
    run.event = "now"
    name = _group(soak, run)
    for w in soak.workers:
        w.send("barrier", name)
    soak.start(run)
    got = soak.answers(run, list(range(WORKERS)))
    for i, answer in got.items():
        soak.judge(run, i, answer, lambda v: True)
    soak.finish(run, got)
    _close_group(soak, run, name)


def broadcast_get(soak: Soak, run: Run, rng: random.Random) -> None:
    """put on one worker, get on the others (the object store's broadcast)."""
    src = rng.randrange(WORKERS)
    if run.victim == src and run.event in ("receive", "report"):
        run.event = "serve"
    oid = hg.ObjectID.random()
    seed = rng.randrange(1 << 30)
    expected = digest(make_array("float32", SHAPE, seed))
    soak.workers[src].call("put", "float32", SHAPE, seed, oid.hex())
    soak.arm(run)
    receivers = [i for i in range(WORKERS) if i != src]
    for i in receivers:
        soak.workers[i].send("get", oid.hex(), DEADLINE)
    soak.start(run)
    got = soak.answers(run, receivers)
    judge_receivers(soak, run, got, src, lambda v: v == expected)
    src_pid = soak.workers[src].proc.pid
    soak.finish(run, got)
    holders = [i for i in range(WORKERS) if soak.workers[i].proc.pid != run.pid or run.fired_at is None]
    if soak.workers[src].proc.pid == src_pid:  # its owner deletes it everywhere
        soak.workers[src].call("delete", oid.hex(), timeout=30)
    else:  # its owner died: the copies left stay readable; drop them (the last one stays kept)
        for i in holders:
            soak.workers[i].call("delete", oid.hex(), timeout=30)


def judge_receivers(
    soak: Soak, run: Run, got: dict[int, tuple[str, Any, float]], source: int, check: Callable[[Any], bool]
) -> None:
    """Judge the receivers of one source's object (a get, a weights version): while the source's
    complete copy lives, every receiver must get it; only its death may end one with an error."""
    source_died = run.fired_at is not None and run.victim == source
    for i, answer in got.items():
        if answer[0] == "error" and not source_died:
            raise Failure(f"{run}: receiver {i} failed though the source lives: {answer[1][:400]}")
        soak.judge(run, i, answer, check)


def reduce_objects(soak: Soak, run: Run, rng: random.Random) -> None:
    """The owner reduces every worker's object (or the first n-1); a dead task puts its inputs
    again. Every other run, one worker puts a second input, so that one node runs a vertex and
    its child (drawn without the run's random stream: the other runs stay as they were)."""
    owner, n = soak.owner, WORKERS
    k = rng.choice([n - 1, n])
    if run.event == "report":
        run.event = "reduce"
    ids = [hg.ObjectID.random() for _ in range(n)]
    arrays = [make_array("float32", SHAPE, rng.randrange(1 << 30)) for _ in range(n)]
    holders = list(range(n))
    if run.number % 2:
        holders.append(run.number // 2 % n)
        ids.append(hg.ObjectID.random())
        arrays.append(make_array("float32", SHAPE, run.number))
        k += 1
    for i, h in enumerate(holders):
        soak.workers[h].call("put_array", arrays[i], ids[i].hex())
    rid = hg.ObjectID.random()
    soak.arm(run)
    op = rng.choice(["sum", "max"])
    owner.reduce(ids, op, num_objects=k, reduction_id=rid)
    soak.start(run)
    reput = False
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        result = ex.submit(owner.get, rid, DEADLINE)
        while not result.done():
            if run.fired_at is None:
                run.fired_at = soak.fired(run.pid)
            if not reput and run.fired_at is not None and _gone(soak, run):
                # The task restarts and puts its inputs again (needed when all are reduced).
                task = soak.replace(run.victim)
                for i in (i for i, h in enumerate(holders) if h == run.victim):
                    task.call("put_array", arrays[i], ids[i].hex())
                reput = True
            concurrent.futures.wait([result], timeout=0.05)
        try:
            got = np.array(result.result())
        except hg.HopliteError as exc:
            result_lost(soak, run, rid, exc)
            got = None
    try:
        if got is not None:
            check_reduction(soak, run, owner, rid, ids, arrays, k, op, got)
    finally:
        owner.delete(rid)  # (a failed run's too: the next runs start clean)
    if not reput:
        soak.finish(run, {})
    for i, h in enumerate(holders):
        soak.workers[h].call("delete", ids[i].hex(), timeout=30)


def check_reduction(
    soak: Soak, run: Run, owner: Any, rid: Any, ids: list[Any], arrays: list[Any], k: int, op: str, got: Any
) -> None:
    """The reduction equals NumPy's over the inputs ``reduced_objects`` reports; a result of ``k <
    n`` inputs finished before the directory restarted is kept, and which inputs it reduced is
    then not known (documented): it must equal the reduction of some ``k`` of them."""
    try:
        chosen = owner.reduced_objects(rid, timeout=10)
    except hg.ObjectNotFoundError as exc:
        if run.restart_at is None or k == len(ids) or "is not known" not in str(exc):
            raise Failure(f"{run}: reduced_objects failed: {exc}") from exc
        subsets = itertools.combinations(arrays, k)
        if not any(np.array_equal(got, expected_reduce(list(s), op)) for s in subsets):
            raise Failure(f"{run}: wrong reduction (k={k}, inputs not known after the restart)") from None
        run.outcomes.append("exact")
        return
    picked = [arrays[ids.index(o)] for o in chosen]
    if len(chosen) != k or not np.array_equal(got, expected_reduce(picked, op)):
        raise Failure(f"{run}: wrong reduction (k={k})")
    run.outcomes.append("exact")


def result_lost(soak: Soak, run: Run, rid: Any, exc: Exception) -> None:
    """A reduction's get failed: only the loss of its finished result with the victim (its sole
    copy: the root died serving it) is a typed outcome; the library does not compute it again."""
    text = f"{type(exc).__name__}: {exc}"
    if run.fired_at is None:
        run.fired_at = soak.fired(run.pid)
    if not (isinstance(exc, hg.ObjectLostError) and rid.hex() in str(exc)):
        raise Failure(f"{run}: the reduction failed: {text}"[:800]) from exc
    soak.judge(run, -1, ("error", text, time.monotonic()), lambda v: False)


def _gone(soak: Soak, run: Run) -> bool:
    """Whether the directory no longer counts the victim's node (a killed one closes its
    connection; a stopped one misses its lease)."""
    return run.sig == "KILL" or run.node_id not in soak.owner.directory_summary()["nodes"]


def coded(soak: Soak, run: Run, rng: random.Random) -> None:
    """Gradient coding (fractional repetition, n=4, s=1): the owner decodes the first messages that
    decode; one lost worker never changes the exact sum."""
    code = GradientCode.fractional_repetition(WORKERS, 1)
    if run.event == "report":
        run.event = "serve"
    seed = rng.randrange(1 << 30)
    grads = {p: make_array("float32", SHAPE, seed + p) for p in range(WORKERS)}
    ids = {w: hg.ObjectID.random() for w in range(WORKERS)}
    rid = code.reduce(soak.owner, ids, timeout=DEADLINE)
    soak.arm(run)
    for w in range(WORKERS):
        message = code.encode(w, {p: grads[p] for p in code.partitions(w)})
        soak.workers[w].call("put_array", message, ids[w].hex())
    soak.start(run)
    try:
        got = np.array(soak.owner.get(rid, DEADLINE))
    except hg.HopliteError as exc:
        result_lost(soak, run, rid, exc)
    else:
        if not np.array_equal(got, np.sum(list(grads.values()), axis=0, dtype=np.float32)):
            raise Failure(f"{run}: wrong decoded sum")
        run.outcomes.append("exact")
    finally:
        soak.owner.delete(rid)  # (a failed run's too: the next runs start clean)
    soak.finish(run, {})
    for w in range(WORKERS):
        soak.workers[w].call("delete", ids[w].hex(), timeout=30)


def weights(soak: Soak, run: Run, rng: random.Random) -> None:
    """One publisher, three subscribers receiving the version it published."""
    pub, seed = rng.randrange(WORKERS), rng.randrange(1 << 30)
    name = f"soak-{soak.seed}-{run.number}"
    soak.workers[pub].call("publish", name, 1, LAYOUT, seed, {"bucket_bytes": 1 << 20})
    want = (1, {k: digest(v) for k, v in weights_state(LAYOUT, seed).items()})
    soak.arm(run)
    subs = [i for i in range(WORKERS) if i != pub]
    for i in subs:
        soak.workers[i].send("receive_weights", name, 1, DEADLINE, None)
    soak.start(run)
    got = soak.answers(run, subs)
    judge_receivers(soak, run, got, pub, lambda v: tuple(v) == want)
    soak.finish(run, got)
    for i in range(WORKERS):
        soak.workers[i].call("close_weights", name, timeout=30)


#: The torch.distributed collectives of :func:`torch_collective` (``tests/torch_ranks.py``, ``soak``).
TORCH_OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")


def torch_collective(soak: Soak, run: Run, rng: random.Random) -> None:
    """A collective of ``torch.distributed`` on the hoplite backend, in four fresh rank processes
    joined to the soak's directory (``HOPLITE_DIRECTORY``); the victim's own fault injection kills
    or stops it. Survivors get the exact output or ``RankLostError``."""
    from tests.torch_ranks import ROOT, SOAK_ELEMENTS

    op, seed = rng.choice(TORCH_OPS), rng.randrange(1 << 30)
    if run.event == "now":
        run.event = "serve"  # (a fresh process: signalled at once, it would die before joining)
    n = SOAK_ELEMENTS
    inputs = [make_array("float32", (n,), seed + r) for r in range(WORKERS)]
    if op == "all_reduce":
        want = [digest(np.sum(inputs, axis=0, dtype=np.float32))] * WORKERS
    elif op == "broadcast":
        want = [digest(inputs[0])] * WORKERS
    elif op == "all_gather":
        want = [digest(np.concatenate(inputs))] * WORKERS
    else:
        pieces = [
            [make_array("float32", (n,), seed + r * 100 + j) for j in range(WORKERS)] for r in range(WORKERS)
        ]
        want = [
            digest(np.sum([pieces[r][j] for r in range(WORKERS)], axis=0, dtype=np.float32))
            for j in range(WORKERS)
        ]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
        "HOPLITE_DIRECTORY": soak.owner.directory_address,
        "HOPLITE_TOKEN": soak.owner.token,
        "HOPLITE_STALL_TIMEOUT": str(STALL),
        "TEST_PG_TIMEOUT": str(DEADLINE),
    }
    with tempfile.TemporaryDirectory(prefix="hoplite-soak-torch-") as tmp:
        out = os.path.join(tmp, "rank")
        procs = []
        try:
            for rank in range(WORKERS):
                fault = {"HOPLITE_FAULT_INJECTION": run.spec} if rank == run.victim else {}
                cmd = [sys.executable, "-m", "tests.torch_ranks", "soak", str(rank), str(WORKERS), str(port)]
                procs.append(subprocess.Popen([*cmd, out, f"{op}:{seed}"], env={**env, **fault}, cwd=ROOT))
            if run.sig != "DIRECTORY":
                run.pid = procs[run.victim].pid
            soak.start(run)
            _await_ranks(soak, run, procs)
        finally:
            for proc in procs:  # the stopped victim, or any left at the deadline
                if proc.poll() is None:
                    proc.kill()
                proc.wait(30)
        if run.sig != "DIRECTORY":
            run.fired_at = soak.fired(run.pid)
        for rank in range(WORKERS):
            path = f"{out}.{rank}.json"
            if not os.path.exists(path):
                answer: tuple[str, Any, float] = ("dead", None, time.monotonic())
            else:
                with open(path) as f:
                    found = json.load(f)
                if "result" in found:
                    answer = ("ok", found["result"], time.monotonic())
                else:
                    answer = ("error", f"{found['error']}: {found['message']}", found["at"])
            soak.judge(run, rank, answer, lambda got, rank=rank: got == want[rank])


def _await_ranks(soak: Soak, run: Run, procs: list[subprocess.Popen[bytes]]) -> None:
    """Until every rank exited but a victim whose fault fired (a hang past the deadline fails)."""
    deadline = time.monotonic() + DEADLINE + 60  # (starting a rank imports torch: tens of s here)
    victim = procs[run.victim] if run.sig != "DIRECTORY" else None
    while True:
        running = [p for p in procs if p.poll() is None and p is not victim]
        if victim is not None and victim.poll() is None and soak.fired(victim.pid) is None:
            running.append(victim)
        if not running:
            return
        if time.monotonic() > deadline:
            raise Failure(f"{run}: torch ranks still running after {DEADLINE + 60:.0f} s")
        time.sleep(0.05)  # polling with a deadline


#: Every operation of the soak, by name.
OPERATIONS: dict[str, Callable[[Soak, Run, random.Random], None]] = {
    "get": broadcast_get,
    "reduce": reduce_objects,
    "coded": coded,
    "weights": weights,
    "allreduce": collective("allreduce", SHAPE, _allreduce(SHAPE)),
    "allreduce_small": collective("allreduce", SMALL, _allreduce(SMALL)),
    "reduce_to": collective("reduce_to", SHAPE, _reduce_to),
    "reducescatter": collective("reducescatter", SHAPE, _reducescatter),
    "allgather": collective("allgather", SHAPE, lambda run, rank, seed, how: _inputs(seed, SHAPE)),
    "torch": torch_collective,
    "broadcast": collective(
        "broadcast",
        SHAPE,
        lambda run, rank, seed, how: make_array("float32", SHAPE, seed + int(how.split(":")[1])),
    ),
    "sendrecv": sendrecv,
    "barrier": barrier,
}
