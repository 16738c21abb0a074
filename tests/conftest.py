"""Shared fixtures: an embedded directory in the test process and worker processes."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest

# Same-host copies through shared memory would bypass the data plane that most multi-process tests
# exercise (chains, pipelining, auth); tests/test_shm.py turns it on explicitly.
os.environ.setdefault("HOPLITE_SHARED_MEMORY", "0")
# Every directory the tests start (embedded, standalone, in a Ray actor) checks its invariants
# after each event (Config.validate_directory); see broken_invariants below.
os.environ.setdefault("HOPLITE_VALIDATE_DIRECTORY", "1")

from tests.procs import Worker, start_workers


class _Broken(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.found: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "invariants broken" in record.getMessage():
            self.found.append(record.getMessage())


@pytest.fixture(autouse=True)
def broken_invariants() -> Iterator[list[str]]:
    """Fail any test during which a directory in this process broke an invariant (directories in
    other processes log it and record an ``invariant_violated`` event; the soak checks those)."""
    handler = _Broken()
    logger = logging.getLogger("hoplite_gpu.directory")
    logger.addHandler(handler)
    try:
        yield handler.found
    finally:
        logger.removeHandler(handler)
    assert not handler.found, handler.found[0]


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
