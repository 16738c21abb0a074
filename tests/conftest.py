"""Shared fixtures: an embedded directory in the test process and worker processes."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

# Same-host copies through shared memory would bypass the data plane that most multi-process tests
# exercise (chains, pipelining, auth); tests/test_shm.py turns it on explicitly.
os.environ.setdefault("HOPLITE_SHARED_MEMORY", "0")
# Allreduces of 1 MiB and more go in shards, so that the tests' arrays of a few MiB take the
# sharded path (by default it starts at 8 MiB: Config.allreduce_shard_bytes).
os.environ.setdefault("HOPLITE_ALLREDUCE_SHARD_BYTES", str(1 << 20))
# Every directory the tests start (embedded, standalone, in a Ray actor) checks its invariants
# after each event (Config.validate_directory); see broken_invariants below.
os.environ.setdefault("HOPLITE_VALIDATE_DIRECTORY", "1")
# ... and those in other processes (workers, standalone, the Ray actor, torch ranks; they inherit
# this environment) append what broke to this file (Config.directory_violation_log).
VIOLATIONS = os.environ.setdefault(
    "HOPLITE_DIRECTORY_VIOLATION_LOG", os.path.join(tempfile.mkdtemp(prefix="hoplite-tests-"), "violations")
)

from tests.procs import Worker, start_workers  # noqa: E402  (after the environment above)


class _Broken(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.found: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "invariants broken" in record.getMessage():
            self.found.append(record.getMessage())


def _violations_since(offset: int) -> list[str]:
    """Lines directories in other processes appended to :data:`VIOLATIONS` after ``offset``."""
    try:
        with open(VIOLATIONS) as report:
            report.seek(offset)
            return report.read().splitlines()
    except FileNotFoundError:
        return []


def _violations_end() -> int:
    try:
        return os.path.getsize(VIOLATIONS)
    except FileNotFoundError:
        return 0


@pytest.fixture(autouse=True)
def broken_invariants() -> Iterator[list[str]]:
    """Fail any test during which a directory broke an invariant: one in this process (it logs
    it), or one in another process (it appends it to :data:`VIOLATIONS`)."""
    handler = _Broken()
    logger = logging.getLogger("hoplite_gpu.directory")
    logger.addHandler(handler)
    start = _violations_end()
    try:
        yield handler.found
    finally:
        logger.removeHandler(handler)
    assert not handler.found, handler.found[0]
    elsewhere = _violations_since(start)
    assert not elsewhere, f"a directory in another process broke an invariant: {elsewhere[0]}"


def _gpu() -> bool:
    from hoplite_gpu.memory import kernels

    return kernels.available()


@pytest.fixture(
    scope="module",
    params=[
        "sim",
        pytest.param("cupy", marks=[pytest.mark.gpu, pytest.mark.skipif(not _gpu(), reason="no GPU")]),
    ],
)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """The device backend (:mod:`hoplite_gpu.memory.device`) of this process and of the workers it spawns
    while the module's tests run: ``sim`` (host memory treated as device memory) everywhere, and
    ``cupy`` (CUDA) where CuPy sees a GPU; without one the ``cupy`` cases skip."""
    from hoplite_gpu.memory import device

    mp = pytest.MonkeyPatch()
    mp.setenv(device.BACKEND_ENV, request.param)
    device.default_backend.cache_clear()
    yield str(request.param)
    mp.undo()
    device.default_backend.cache_clear()


@pytest.fixture(scope="module")
def owner() -> Iterator[Any]:
    """A node with an embedded directory, living in the test process."""
    import hoplite_gpu as hg

    node = hg.init()
    yield node
    node.close()


@pytest.fixture(scope="module")
def workers(owner: Any) -> Iterator[list[Worker]]:
    """Eight worker processes joined to ``owner``'s directory."""
    ws = start_workers(owner.directory_address, owner.token, 8)
    yield ws
    for w in ws:
        w.stop()


#: Environment of every Ray process the tests start: no usage report, no waiting on shutdown.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
#: The setup hook imports torch and NumPy before Ray limits a worker's threads: one BLAS thread each,
#: or every worker runs two on the two cores (measured: a task's compute 5 ms -> 19 ms).
WORKER_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """A local Ray instance (this process is its driver) with the hoplite directory actor started
    and the "hoplite" collective backend registered in every worker; shut down after the session.
    Skips where Ray is not installed."""
    ray = pytest.importorskip("ray")
    import hoplite_gpu.ray as hgray

    os.environ.update(RAY_ENV)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        num_cpus=8,  # actors and tasks of the tests are mostly waiting; 2 real cores suffice
        include_dashboard=False,
        log_to_driver=False,
        logging_level="WARNING",
        runtime_env={  # workers import the tests' and examples' modules from the checkout
            "worker_process_setup_hook": "hoplite_gpu.ray.register_collective_backend",
            "env_vars": {"PYTHONPATH": path, **WORKER_ENV},
        },
    )
    try:
        hgray.register_collective_backend()
        hgray.start_directory()
        yield ray
    finally:
        ray.shutdown()
