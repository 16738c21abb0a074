"""Randomized fault soak: broadcasts and reductions with a random node killed at a random point.

Each run picks a scenario, a victim, an event (serving, receiving or reducing) and a byte offset,
arms the fault, and runs the operation with deadlines. Every outcome must be exact: a broadcast
either delivers bit-exact data or, only when the sole complete copy died, raises
``ObjectLostError``; a reduction equals NumPy's over the inputs ``reduced_objects`` reports. A
wait that hits its deadline is a hang and fails the soak.

``HOPLITE_SOAK_RUNS`` sets the number of runs (``make test``: 100, ``make soak``: 1000) and
``HOPLITE_SOAK_SEED`` the seed (default 1). The counts are printed at the end (``pytest -s``), and
``HOPLITE_SOAK_LOG`` names a file for the directory's event log of a failed run.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from tests.procs import Worker, digest, make_array, start_workers

RUNS = int(os.environ.get("HOPLITE_SOAK_RUNS", "100"))
SEED = int(os.environ.get("HOPLITE_SOAK_SEED", "1"))
WORKERS = 4
DEADLINE = 60.0  # any wait longer than this is a hang
SMALL = {"adaptive_chunks": False, "chunk_bytes": 256 << 10, "send_rate_limit": 64 << 20}
SHAPE = (1 << 20,)  # 4 MiB of float32

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(max(240, RUNS * 12)),
    pytest.mark.skipif(RUNS == 0, reason="HOPLITE_SOAK_RUNS=0"),
]


@pytest.fixture(scope="module")
def owner() -> Iterator[Any]:
    node = hg.init(lease_timeout=8.0)
    yield node
    node.close()


class Pool:
    """Worker processes; a killed one is replaced by a fresh process (a restarted task)."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.workers = start_workers(owner.directory_address, owner.token, WORKERS, **SMALL)

    def replace(self, i: int) -> Worker:
        self.workers[i].kill()
        self.workers[i] = start_workers(self.owner.directory_address, self.owner.token, 1, **SMALL)[0]
        return self.workers[i]

    def heal(self, counts: Counter[str]) -> None:
        """Replace workers that died after their run was counted (a fault that fired late)."""
        for i, w in enumerate(self.workers):
            if not w.proc.is_alive():
                counts["late_kills"] += 1
                self.replace(i)

    def close(self) -> None:
        for w in self.workers:
            w.kill()


def wait_until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"hang: {what} did not happen within {DEADLINE} s")
        time.sleep(0.02)  # polling with a deadline


def broadcast_run(pool: Pool, rng: random.Random, counts: Counter[str]) -> None:
    src = rng.randrange(WORKERS)
    victim = rng.randrange(WORKERS)
    event = "serve" if victim == src else rng.choice(["serve", "receive"])
    at = rng.choice([0.0, 0.25, 0.5, 0.75, 0.99])
    oid = hg.ObjectID.random()
    seed = rng.randrange(1 << 30)
    expected = digest(make_array("float32", SHAPE, seed))
    pool.workers[src].call("put", "float32", SHAPE, seed, oid.hex())
    pool.workers[victim].call("arm", f"{event}:{oid.hex()}:{at}:KILL")
    victim_pid = pool.workers[victim].proc.pid
    receivers = [i for i in range(WORKERS) if i != src]
    for i in receivers:
        pool.workers[i].send("get", oid.hex(), DEADLINE)
    for i in receivers:
        w = pool.workers[i]
        if i == victim:
            continue
        try:
            got = w.result(DEADLINE + 10)
        except TimeoutError as exc:
            raise AssertionError(f"hang: receiver {i} of a broadcast ({event} at {at})") from exc
        except RuntimeError as exc:
            # Only the death of the sole complete copy (the source, before anyone finished) loses it.
            assert "ObjectLostError" in str(exc) and victim == src, str(exc)[:500]
            counts["broadcast_lost"] += 1
            continue
        assert got == expected, f"wrong data in a broadcast ({event} at {at})"
        counts["broadcast_exact"] += 1
    died = not pool.workers[victim].proc.is_alive()
    if victim != src and not died:
        try:  # its own get, if it was not killed
            assert pool.workers[victim].result(DEADLINE + 10) == expected
            counts["broadcast_exact"] += 1
        except (EOFError, OSError):
            died = True
        except RuntimeError as exc:
            assert "ObjectLostError" in str(exc), str(exc)[:500]
    finish(pool, victim, died, counts, victim_pid)


def reduce_run(pool: Pool, rng: random.Random, counts: Counter[str]) -> None:
    owner = pool.owner
    n = WORKERS
    k = rng.choice([n - 1, n])
    victim = rng.randrange(WORKERS)
    at = rng.choice([0.0, 0.25, 0.5, 0.75, 0.99])
    ids = [hg.ObjectID.random() for _ in range(n)]
    arrays = [make_array("float32", SHAPE, rng.randrange(1 << 30)) for _ in range(n)]
    for i, w in enumerate(pool.workers):
        try:
            w.call("put_array", arrays[i], ids[i].hex())
        except BrokenPipeError:
            w.proc.join(5)
            raise AssertionError(f"worker {i} died: exit code {w.proc.exitcode}") from None
    rid = hg.ObjectID.random()
    event = rng.choice(["serve", "reduce"])
    target = ids[victim].hex() if event == "serve" else rid.hex()
    pool.workers[victim].call("arm", f"{event}:{target}:{at}:KILL")
    victim_pid = pool.workers[victim].proc.pid
    op = rng.choice(["sum", "max"])
    owner.reduce(ids, op, num_objects=k, reduction_id=rid)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        result = ex.submit(owner.get, rid, DEADLINE)
        reput = False
        while not result.done():
            if not reput and not pool.workers[victim].proc.is_alive():
                # The task restarts and puts its input again (needed when all n are reduced).
                pool.replace(victim).call("put_array", arrays[victim], ids[victim].hex())
                reput = True
            concurrent.futures.wait([result], timeout=0.05)
        try:
            got = np.array(result.result())
        except hg.HopliteTimeoutError as exc:
            raise AssertionError(f"hang: reduction ({event} at {at}, k={k})") from exc
    chosen = owner.reduced_objects(rid, timeout=10)
    assert len(chosen) == k
    picked = [arrays[ids.index(o)] for o in chosen]
    expected = np.sum(picked, axis=0, dtype=np.float32) if op == "sum" else np.max(picked, axis=0)
    assert np.array_equal(got, expected), f"wrong reduction ({event} at {at}, k={k})"
    counts["reduce_exact"] += 1
    owner.delete(rid)
    finish(pool, victim, reput or not pool.workers[victim].proc.is_alive(), counts, victim_pid)


def finish(pool: Pool, victim: int, died: bool, counts: Counter[str], pid: int) -> None:
    """Count whether the fault fired; disarm the victim (process ``pid``), or replace it, for the
    next run."""
    w = pool.workers[victim]
    if not died:
        try:
            w.call("disarm", timeout=30)  # the operation never reached the armed point
        except (EOFError, OSError, RuntimeError):
            died = True  # it fired after all, late (e.g. serving a copy once the others were done)
    if died:
        counts["killed"] += 1
        if w.proc.pid == pid:
            # Not replaced yet. Its pipe may report EOF a moment before the process is reaped, so
            # replace (kill, join) it now rather than asking is_alive().
            pool.replace(victim)
    else:
        counts["fault_not_reached"] += 1


def dump_events(owner: Any, run: int) -> None:
    """Write the directory's event log of a failed run where HOPLITE_SOAK_LOG points."""
    path = os.environ.get("HOPLITE_SOAK_LOG")
    if path:
        with open(path, "w") as f:
            f.write(f"run {run}\n")
            for event in owner.event_log():
                f.write(f"{event}\n")


def test_random_kills_never_hang_or_corrupt(owner: Any) -> None:
    rng = random.Random(SEED)
    counts: Counter[str] = Counter()
    pool = Pool(owner)
    started = time.monotonic()
    try:
        for _ in range(RUNS):
            counts["runs"] += 1
            pool.heal(counts)
            try:
                if rng.random() < 0.5:
                    broadcast_run(pool, rng, counts)
                else:
                    reduce_run(pool, rng, counts)
            except BaseException:
                dump_events(owner, counts["runs"])
                raise
    finally:
        pool.close()
        print(f"\nsoak (seed {SEED}) in {time.monotonic() - started:.0f} s: {dict(sorted(counts.items()))}")
    assert counts["killed"] > RUNS // 4  # most runs really killed a node
