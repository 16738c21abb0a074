"""Randomized fault soak over every operation (the engine and its oracle: :mod:`tests.soak`).

``HOPLITE_SOAK_RUNS`` sets the runs per seed (``make test``: 30; ``make soak``: 2000),
``HOPLITE_SOAK_RESTART_RUNS`` those of the soak on a standalone directory that is also killed and
restarted (``make test``: 15; ``make soak``: 500), ``HOPLITE_SOAK_RAY_RUNS`` those of the soak on
the Ray directory actor, which Ray restarts (``make test``: 5; ``make soak``: 200; skipped without
Ray), ``HOPLITE_SOAK_SEEDS`` the seeds (default
``1``; ``make soak SEEDS="1 2 3 4 5"``), ``HOPLITE_SOAK_OPS`` a comma-separated subset of the
operations. The counts per operation and fault are printed at the end (``pytest -s``);
``HOPLITE_SOAK_LOG`` names a file the directory's event log of each failed run is appended to.
A failed run does not stop the soak: the workers are replaced and it goes on (at most
:data:`MAX_FAILURES`), and the test fails at the end.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

import hoplite_gpu as hg
from hoplite_gpu.auth import new_token
from hoplite_gpu.directory import DirectoryProcess
from tests.soak import DEADLINE, LEASE, OPERATIONS, STALL, Restartable, Soak

RUNS = int(os.environ.get("HOPLITE_SOAK_RUNS", "30"))
#: Runs per seed of the soak on a standalone directory that is also killed and restarted.
RESTART_RUNS = int(os.environ.get("HOPLITE_SOAK_RESTART_RUNS", "15"))
#: Runs per seed of the soak on the Ray directory actor, also killed (Ray restarts it).
RAY_RUNS = int(os.environ.get("HOPLITE_SOAK_RAY_RUNS", "5"))
RAY_NAME = "hoplite-soak"
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
    pytest.mark.timeout(max(300, max(RUNS, RESTART_RUNS, RAY_RUNS) * len(SEEDS) * 15)),
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


class RayDirectoryActor:
    """The Ray directory actor ``name`` as the soak's restartable directory: :meth:`kill`
    SIGKILLs its process, :meth:`start` waits until Ray restarted it (at a new address)."""

    def __init__(self, ray: Any, name: str) -> None:
        self.ray, self.name = ray, name
        self.killed_at, self.restarts, self.slowest = 0.0, 0, 0.0
        self.address, self.pid = self.start()

    def kill(self) -> None:
        self.killed_at = time.monotonic()
        os.kill(self.pid, signal.SIGKILL)

    def start(self) -> tuple[str, int]:
        """The actor's address and process once it answers at an address other than before."""
        import hoplite_gpu.ray as hgray

        deadline = time.monotonic() + DEADLINE
        before = getattr(self, "address", "")
        while True:
            try:
                address = hgray.directory_info(self.name, timeout=max(0.1, deadline - time.monotonic()))[0]
                if address != before:
                    actor = self.ray.get_actor(self.name)
                    pid = self.ray.get(actor.__ray_call__.remote(lambda actor: os.getpid()), timeout=DEADLINE)
                    self.address, self.pid = address, int(pid)
                    if self.killed_at:
                        self.restarts += 1
                        self.slowest = max(self.slowest, time.monotonic() - self.killed_at)
                    return self.address, self.pid
            except hg.DirectoryUnavailableError:
                pass  # asked the dead process before Ray saw it die: ask again
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray did not restart the directory actor within {DEADLINE} s")
            time.sleep(0.05)  # polling with a deadline


@pytest.mark.skipif(RAY_RUNS == 0, reason="HOPLITE_SOAK_RAY_RUNS=0")
def test_every_operation_survives_faults_and_ray_directory_actor_restarts(ray_session: Any) -> None:
    """The same soak on the Ray directory actor, which a third of the runs SIGKILL: Ray restarts
    it at a new address, and the workers (Ray drivers of the same cluster) find it again."""
    import hoplite_gpu.ray as hgray

    ray = ray_session
    hgray.start_directory(RAY_NAME, max_restarts=-1, config=hg.Config.from_env().replace(lease_timeout=LEASE))
    try:
        config = hg.Config.from_env().replace(stall_timeout=STALL, reconnect_timeout=DEADLINE)
        node = hgray.node(RAY_NAME, config=config)
        context = ray.get_runtime_context()
        # Ray restarts the actor in seconds, but in over 30 s (the default) on a busy machine.
        connect = {
            "ray_directory": (context.gcs_address, context.namespace, RAY_NAME),
            "reconnect_timeout": DEADLINE,
        }
        actor = RayDirectoryActor(ray, RAY_NAME)
        try:
            soak_every_seed(node, RAY_RUNS, actor, connect)
        finally:
            took = f"the slowest in {actor.slowest:.1f} s"
            print(f"Ray restarted the directory actor {actor.restarts} times, {took}")
    finally:
        hgray.stop_directory(RAY_NAME)


def soak_every_seed(
    owner: Any, runs: int, directory: Restartable | None = None, connect: dict[str, Any] | None = None
) -> None:
    """``runs`` runs of each seed of :data:`SEEDS` on ``owner``'s directory: the counts printed,
    every failure recorded (at most :data:`MAX_FAILURES`) and raised at the end."""
    assert not OPS or set(OPS) <= set(OPERATIONS), f"unknown operations in HOPLITE_SOAK_OPS: {OPS}"
    started = time.monotonic()
    soaks = []
    failures: list[str] = []
    for seed in SEEDS:
        soak = Soak(owner, seed, OPS, directory, connect)
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
    where = "an embedded directory" if directory is None else f"a restarted {type(directory).__name__}"
    took = time.monotonic() - started
    print(f"\nsoak on {where}, seeds {SEEDS}, {done} runs in {took:.0f} s\n{total.table()}")
    assert not failures, "\n".join(failures)
    fired = sum(n for (_, fault, _), n in total.counts.items() if fault != "missed")
    if done >= 20:  # (a few runs may all miss their fault point by chance)
        assert fired > done // 3, total.counts  # most runs really killed or stopped a member
