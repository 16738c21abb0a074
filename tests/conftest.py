"""Shared fixtures: an embedded directory in the test process and worker processes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

# Same-host copies through shared memory would bypass the data plane that most multi-process tests
# exercise (chains, pipelining, auth); tests/test_shm.py turns it on explicitly.
os.environ.setdefault("HOPLITE_SHARED_MEMORY", "0")

from tests.procs import Worker, start_workers


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
