"""Randomized fault soak over every operation (the engine and its oracle: :mod:`tests.soak`).

``HOPLITE_SOAK_RUNS`` sets the runs per seed (``make test``: 30; ``make soak``: 2000),
``HOPLITE_SOAK_RESTART_RUNS`` those of the soak on a standalone directory that is also killed and
restarted (``make test``: 15; ``make soak``: 500), ``HOPLITE_SOAK_SEEDS`` the seeds (default
``1``; ``make soak SEEDS="1 2 3 4 5"``), ``HOPLITE_SOAK_OPS`` a comma-separated subset of the
operations. The counts per operation and fault are printed at the end (``pytest -s``);
``HOPLITE_SOAK_LOG`` names a file the directory's event log of each failed run is appended to.
A failed run does not stop the soak: the workers are replaced and it goes on (at most
:data:`MAX_FAILURES`), and the test fails at the end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

import hoplite_gpu as hg
from hoplite_gpu.auth import new_token
from hoplite_gpu.directory import DirectoryProcess
from tests.soak import LEASE, OPERATIONS, STALL, Soak

RUNS = int(os.environ.get("HOPLITE_SOAK_RUNS", "30"))
#: Runs per seed of the soak on a standalone directory that is also killed and restarted.
RESTART_RUNS = int(os.environ.get("HOPLITE_SOAK_RESTART_RUNS", "15"))
SEEDS = [
    int(s)
    for s in os.environ.get("HOPLITE_SOAK_SEEDS", os.environ.get("HOPLITE_SOAK_SEED", "1"))
    .replace(",", " ")
    .split()
]
OPS = tuple(o for o in os.environ.get("HOPLITE_SOAK_OPS", "").split(",") if o) or None
MAX_FAILURES = 5
PROGRESS = 100  # runs between the partial counts printed

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(max(300, max(RUNS, RESTART_RUNS) * len(SEEDS) * 15)),
]


@pytest.fixture(scope="module")
def owner() -> Iterator[Any]:
    node = hg.init(lease_timeout=LEASE, stall_timeout=STALL)
    yield node
    node.close()


def dump_events(owner: Any, title: str) -> None:
    """Append the directory's event log of a failed run where HOPLITE_SOAK_LOG points."""
    path = os.environ.get("HOPLITE_SOAK_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"=== {title}\n")
            for event in owner.event_log():
                f.write(f"{event}\n")


@pytest.mark.skipif(RUNS == 0, reason="HOPLITE_SOAK_RUNS=0")
def test_every_operation_survives_random_faults(owner: Any) -> None:
    soak_every_seed(owner, RUNS)


@pytest.mark.skipif(RESTART_RUNS == 0, reason="HOPLITE_SOAK_RESTART_RUNS=0")
def test_every_operation_survives_faults_and_directory_restarts() -> None:
    """The same soak on a standalone directory, which a third of the runs kill and restart."""
    directory = DirectoryProcess(new_token(), env={"HOPLITE_LEASE_TIMEOUT": str(LEASE)})
    directory.start()
    try:
        node = hg.connect(directory.address, token=directory.token, stall_timeout=STALL)
        try:
            soak_every_seed(node, RESTART_RUNS, directory)
        finally:
            node.close()
    finally:
        directory.kill()


def soak_every_seed(owner: Any, runs: int, directory: DirectoryProcess | None = None) -> None:
    """``runs`` runs of each seed of :data:`SEEDS` on ``owner``'s directory: the counts printed,
    every failure recorded (at most :data:`MAX_FAILURES`) and raised at the end."""
    assert not OPS or set(OPS) <= set(OPERATIONS), f"unknown operations in HOPLITE_SOAK_OPS: {OPS}"
    started = time.monotonic()
    soaks = []
    failures: list[str] = []
    for seed in SEEDS:
        soak = Soak(owner, seed, OPS, directory)
        soaks.append(soak)
        try:
            for number in range(1, runs + 1):
                try:
                    soak.once(number)
                except Exception as exc:  # a failed run: record it, start over with fresh workers
                    failures.append(f"seed {seed}: {type(exc).__name__}: {exc}"[:1500])
                    print(f"\nFAILED seed {seed} run {number}: {failures[-1]}", flush=True)
                    dump_events(owner, f"seed {seed} run {number}: {exc}"[:300])
                    soak.restart()
                    if len(failures) >= MAX_FAILURES:
                        break
                if number % PROGRESS == 0:  # a long soak stopped early still tells its counts
                    print(
                        f"\nseed {seed}: {number} runs, {time.monotonic() - started:.0f} s, "
                        f"{len(failures)} failed\n{soak.table()}",
                        flush=True,
                    )
        finally:
            soak.finish_soak()
        if len(failures) >= MAX_FAILURES:
            break
    total = soaks[0]
    for other in soaks[1:]:
        total.counts.update(other.counts)
        for op, worst in other.worst.items():
            total.worst[op] = max(total.worst.get(op, 0.0), worst)
    total.failures = failures
    done = sum(total.counts.values())
    where = "a standalone directory restarted" if directory else "an embedded directory"
    took = time.monotonic() - started
    print(f"\nsoak on {where}, seeds {SEEDS}, {done} runs in {took:.0f} s\n{total.table()}")
    assert not failures, "\n".join(failures)
    fired = sum(n for (_, fault, _), n in total.counts.items() if fault != "missed")
    assert fired > done // 3, total.counts  # most runs really killed or stopped a member
