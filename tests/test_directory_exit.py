"""A node connected to a directory hosted by another process: that process exiting normally is not
reported as a failure (the directory says ``Goodbye`` before it closes), while a directory lost
without one (its process SIGKILLed) still is.

Real processes: the directory's host is a child running ``hg.init()`` (the embedded directory),
and the connected node is this test's.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

#: The directory's host: an embedded directory and a node that puts one object, then exits
#: normally (atexit closes the node and its directory) once a line arrives on stdin.
HOST = """
import sys
import numpy as np
import hoplite_gpu as hg

node = hg.init()
node.put(np.arange(1 << 18, dtype=np.float32), hg.ObjectID.from_name("exit-test"))
print(node.directory_address, node.token, flush=True)
sys.stdin.readline()
"""


class Records(logging.Handler):
    """Every record of the ``hoplite_gpu`` loggers, from any thread."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def wait_for(self, found: Callable[[logging.LogRecord], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(found(r) for r in self.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in self.records]
            time.sleep(0.05)  # polling with a deadline

    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= logging.WARNING]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("hoplite_gpu")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def host() -> Iterator[subprocess.Popen[str]]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def _connect(host: subprocess.Popen[str]) -> hg.Node:
    assert host.stdout is not None
    address, token = host.stdout.readline().split()
    node = hg.connect(address, token=token)
    # A real connection: a pull over the data plane from the host's node, as a worker makes.
    arr = node.get(hg.ObjectID.from_name("exit-test"), timeout=60)
    assert np.array_equal(arr, np.arange(1 << 18, dtype=np.float32))
    return node


def test_a_normal_exit_of_the_directorys_host_logs_no_warning(
    host: subprocess.Popen[str], records: Records
) -> None:
    node = _connect(host)
    try:
        assert host.stdin is not None
        host.stdin.write("exit\n")
        host.stdin.flush()
        assert host.wait(60) == 0
        records.wait_for(lambda r: "shut down" in r.getMessage())  # the node noticed
        assert not records.warnings()
    finally:
        node.close()
    assert not records.warnings()


def test_a_killed_directory_is_still_reported(host: subprocess.Popen[str], records: Records) -> None:
    node = _connect(host)
    try:
        host.kill()
        host.wait(30)
        records.wait_for(lambda r: r.levelno == logging.WARNING and "lost the directory" in r.getMessage())
    finally:
        node.close()


def _connect_resolving(host: subprocess.Popen[str], resolve: Any) -> hg.Node:
    """A node of the host's directory with a resolver (as the Ray integration's nodes have)."""
    assert host.stdout is not None
    address, token = host.stdout.readline().split()
    return hg.Node(address, token, hg.Config.from_env(), resolve_directory=resolve)


def test_a_directory_its_resolver_says_is_gone_for_good_is_lost_quietly(
    host: subprocess.Popen[str], records: Records
) -> None:
    """The Ray directory actor of a Ray that shut down (its resolver says so): no warning, no
    retries for reconnect_timeout; requests fail at once."""

    def resolve(seconds: float) -> str:
        raise hg.DirectoryUnavailableError("Ray was shut down", peer="hoplite", cause="shutdown")

    node = _connect_resolving(host, resolve)
    try:
        host.kill()
        host.wait(30)
        records.wait_for(lambda r: "gone for good" in r.getMessage())
        with pytest.raises(hg.DirectoryUnavailableError, match="Ray was shut down"):
            node.get(hg.ObjectID.from_name("exit-test"), timeout=5)
        assert not records.warnings()
    finally:
        node.close()


def test_a_directory_its_resolver_still_finds_is_reported(
    host: subprocess.Popen[str], records: Records
) -> None:
    """A resolver that still names the directory (a Ray actor restarting): warned once."""
    found: list[str] = []

    def resolve(seconds: float) -> str:
        found.append("asked")
        return node.directory_address

    node = _connect_resolving(host, resolve)
    try:
        host.kill()
        host.wait(30)
        records.wait_for(lambda r: r.levelno == logging.WARNING and "lost the directory" in r.getMessage())
        assert found
    finally:
        node.close()
