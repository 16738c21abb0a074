"""The package's layout: what its pure parts load.

The directory is a pure state machine: importing it (its state and rooms, and the wire protocol it
speaks) must load nothing of the node side (memory, the data plane, sessions, fetch, vertices) and
neither ucxx nor CuPy, so that it runs where those are missing and stays testable on its own.
Each check imports in a fresh interpreter, where nothing else was loaded before.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

#: Modules of the node side (and their heavy dependencies) the pure parts must not load.
NODE_SIDE = (
    "hoplite_gpu.buffers",
    "hoplite_gpu.device",
    "hoplite_gpu.gpu",
    "hoplite_gpu.shm",
    "hoplite_gpu.ipc",
    "hoplite_gpu.store",
    "hoplite_gpu.fetch",
    "hoplite_gpu.sources",
    "hoplite_gpu.puts",
    "hoplite_gpu.vertex",
    "hoplite_gpu.transport",
    "hoplite_gpu.session",
    "hoplite_gpu.node",
    "hoplite_gpu.memory",
    "ucxx",
    "cupy",
)

#: The directory's pure rooms and the protocol (the service and the child process are not pure:
#: they host the state over sockets).
PURE = (
    "hoplite_gpu.directory.state",
    "hoplite_gpu.directory.events",
    "hoplite_gpu.directory.records",
    "hoplite_gpu.directory.config",
    "hoplite_gpu.directory.eventlog",
    "hoplite_gpu.directory.invariants",
    "hoplite_gpu.directory.membership",
    "hoplite_gpu.directory.catalog",
    "hoplite_gpu.directory.lookups",
    "hoplite_gpu.directory.scheduling",
    "hoplite_gpu.directory.reductions",
    "hoplite_gpu.directory.combine",
    "hoplite_gpu.directory.repair",
    "hoplite_gpu.directory.recovery",
    "hoplite_gpu.directory.reduce",
    "hoplite_gpu.protocol",
)


def _loaded_after_import(module: str) -> list[str]:
    """The names in ``sys.modules`` after a fresh interpreter imports ``module``."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def _node_side(loaded: list[str]) -> list[str]:
    return [m for m in loaded if any(m == bad or m.startswith(bad + ".") for bad in NODE_SIDE)]


@pytest.mark.parametrize("module", PURE)
def test_the_pure_directory_and_protocol_load_nothing_of_the_node_side(module: str) -> None:
    loaded = _loaded_after_import(module)
    assert module in loaded
    assert _node_side(loaded) == [], f"importing {module} loads the node side"
