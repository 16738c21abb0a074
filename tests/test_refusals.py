"""What the directory refuses (issue 39, findings 4 and 5): a request too large for a control
frame, or failing the directory's checks, fails its caller at once with InvalidArgumentError and
is never sent again; connections that never start TLS are capped from the moment they are accepted.
Real directories (embedded or a child process), real connections on loopback; every wait has a
deadline."""

from __future__ import annotations

import math
import shutil
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu import protocol as p
from hoplite_gpu.auth import new_token
from hoplite_gpu.directory import DirectoryProcess
from hoplite_gpu.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(120)


def _kinds(node: Any, kind: str) -> list[dict[str, Any]]:
    return [e for e in node.event_log() if e["kind"] == kind]


def _fails_fast(call: Callable[[], Any], match: str) -> float:
    """Seconds ``call`` took to raise InvalidArgumentError matching ``match``."""
    start = time.monotonic()
    with pytest.raises(InvalidArgumentError, match=match):
        call()
    return time.monotonic() - start


# --------------------------------------------------------------------------- finding 5
REQUESTS: dict[str, Callable[[Any], Any]] = {
    "a reduce over 60,000 ids": lambda node: node.reduce([hg.ObjectID.random() for _ in range(60_000)]),
    "a reduce with coding of 40 x 4096": lambda node: node.reduce(
        [hg.ObjectID.random() for _ in range(40)], coding=np.ones((40, 4096))
    ),
}


@pytest.mark.parametrize("what", list(REQUESTS))
def test_a_request_over_the_frame_limit_fails_in_the_caller_and_is_never_sent(what: str) -> None:
    node = hg.init(request_timeout=5.0)
    try:
        assert _fails_fast(lambda: REQUESTS[what](node), "control message limit") < 2.0
        assert node._session.generation == 0  # not one reconnection
        assert len(_kinds(node, "node_joined")) == 1 and _kinds(node, "node_left") == []
        oid = node.put(np.arange(3))  # the connection serves on
        assert np.array_equal(node.get(oid, timeout=5), np.arange(3))
    finally:
        node.close()


def test_a_directory_with_a_smaller_limit_refuses_the_request_and_keeps_the_connection() -> None:
    # The node's own limit lets the frame pass; the directory's does not: it skips the frame and
    # answers it, where it closed the connection and the node re-sent it about 150 times a second.
    node = hg.init(max_control_message_bytes=256 << 10)
    peer = hg.connect(
        node.directory_address, token=node.token, max_control_message_bytes=4 << 20, request_timeout=5.0
    )
    try:
        assert _fails_fast(lambda: REQUESTS["a reduce over 60,000 ids"](peer), "directory refused") < 2.0
        assert peer._session.generation == 0
        assert len(_kinds(node, "node_joined")) == 2 and _kinds(node, "node_left") == []
        (refused,) = _kinds(node, "request_refused")
        assert refused["node"] == peer.node_id and refused["request"] == "reduce"
        oid = peer.put(np.arange(3))
        assert np.array_equal(node.get(oid, timeout=5), np.arange(3))
    finally:
        peer.close()
        node.close()


RAW: dict[str, Callable[[int], p.Message]] = {
    "a reduce with an infinite timeout": lambda rid: p.ReduceRequest(
        request_id=rid,
        reduction_id=b"r" * 20,
        object_ids=[b"i" * 20],
        op="sum",
        num_objects=1,
        timeout=math.inf,
    ),
    "a delete of a 21-byte id": lambda rid: p.DeleteRequest(request_id=rid, object_id=b"d" * 21),
    "a lookup with a NaN timeout": lambda rid: p.LookupRequest(
        request_id=rid, object_id=b"o" * 20, timeout=math.nan
    ),
    "a put whose size is not its shape's": lambda rid: p.PutRequest(
        request_id=rid, object_id=b"p" * 20, size=12, dtype="<f4", shape=[2], digest=b""
    ),
}


@pytest.mark.parametrize("what", list(RAW))
def test_a_raw_request_failing_the_directorys_checks_fails_in_the_caller(what: str) -> None:
    node = hg.init(request_timeout=5.0)
    try:
        request = node._session.request(RAW[what], 5.0)
        assert _fails_fast(lambda: node._io.run(request), "directory refused") < 2.0
        assert node._session.generation == 0
        assert len(_kinds(node, "node_joined")) == 1 and len(_kinds(node, "request_refused")) == 1
    finally:
        node.close()


@pytest.mark.multiprocess
def test_a_remembered_reduction_a_restarted_directory_refuses_is_not_sent_again() -> None:
    directory = DirectoryProcess(new_token())
    directory.start()
    node = None
    try:
        node = hg.connect(directory.address, token=directory.token)
        rid = node.reduce([hg.ObjectID.random() for _ in range(50)])  # waits for inputs nobody puts
        assert rid.binary() in node._session._requested
        # The directory comes back with a quota the remembered reduction exceeds: it refuses it.
        directory.kill()
        directory.env["HOPLITE_DIRECTORY_MAX_REDUCE_INPUTS"] = "10"
        directory.start()
        deadline = time.monotonic() + 30
        while rid.binary() in node._session._requested:  # forgotten once refused: poll with a deadline
            assert time.monotonic() < deadline, "the refused reduction is still remembered"
            time.sleep(0.05)
        assert node._session.generation == 1
    finally:
        if node is not None:
            node.close()
        directory.kill()


# --------------------------------------------------------------------------- finding 4
# Runs the directory with at most 256 open files, as the issue did.
_LIMITED = (
    "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def _idle_connections(host: str, port: int, count: int, source: str) -> list[socket.socket]:
    """``count`` TCP connections from ``source`` that never send a byte (no TLS either); not
    waited for, since a directory out of descriptors leaves them in its backlog."""
    out = []
    for _ in range(count):
        sock = socket.socket()
        out.append(sock)
        sock.bind((source, 0))
        sock.setblocking(False)
        sock.connect_ex((host, port))
    return out


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False  # open, and silent
    except OSError:
        return True  # reset, or never connected


@pytest.mark.multiprocess
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_idle_connections_that_never_start_tls_are_capped_from_accept(tmp_path: Any) -> None:
    from tests.test_hardening import _self_signed

    cert, key = _self_signed(tmp_path, "directory")
    tls = {"HOPLITE_TLS_CERT_FILE": cert, "HOPLITE_TLS_KEY_FILE": key}
    directory = DirectoryProcess(new_token(), env=tls, wrap=[sys.executable, "-c", _LIMITED])
    directory.start()
    idle: list[socket.socket] = []
    node = None
    try:
        # 400 connections from one address that never begin TLS: 64 (the cap per address) wait
        # for their handshake, the rest are closed as they are accepted.
        idle = _idle_connections(directory.host, directory.port, 400, "127.0.0.2")
        deadline = time.monotonic() + 20
        while sum(_closed_by_peer(s) for s in idle) < 400 - 64:  # poll with a deadline
            assert time.monotonic() < deadline, f"{sum(_closed_by_peer(s) for s in idle)} of 400 closed"
            time.sleep(0.1)
        # A node from another address joins over TLS while they are held (before the fix it
        # failed with DirectoryUnavailableError: every descriptor was held).
        node = hg.connect(directory.address, token=directory.token, tls_ca_file=cert, reconnect_timeout=0)
        oid = node.put(np.arange(5))
        assert np.array_equal(node.get(oid, timeout=10), np.arange(5))
        # The cap's 64 wait for their handshake until 10 s after their accept, then go too.
        assert sum(_closed_by_peer(s) for s in idle) >= 400 - 64
    finally:
        for sock in idle:
            sock.close()
        if node is not None:
            node.close()
        directory.kill()


# A directory in a process whose every descriptor is taken: prints its port, then, 3 s after the
# test connected, how many tries to accept it made and how many log lines said so; then frees the
# descriptors and serves on.
_OUT_OF_FILES = r"""
import asyncio, logging, os, resource, sys
from hoplite_gpu.directory.service import DirectoryService

lines = []
class Count(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger().addHandler(Count())
logging.getLogger().setLevel(logging.WARNING)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

async def main():
    service = DirectoryService("token")
    await service.start()
    taken = []
    try:
        while True:
            taken.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    print("port", service.port, flush=True)
    sys.stdin.readline()  # the test connected
    await asyncio.sleep(3)
    tries = getattr(service, "accept_errors", -1)
    print("tries", tries, "lines", sum("accept" in line for line in lines), "listeners",
          len(service._listeners), flush=True)
    for fd in taken:
        os.close(fd)
    await asyncio.to_thread(sys.stdin.readline)  # the test got its challenge
    await service.stop()

asyncio.run(main())
"""


@pytest.mark.multiprocess
def test_a_directory_out_of_descriptors_backs_off_and_serves_once_they_are_free() -> None:
    import subprocess

    child = subprocess.Popen(
        [sys.executable, "-c", _OUT_OF_FILES], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    waiting: list[socket.socket] = []
    try:
        port = int(child.stdout.readline().split()[1])
        waiting = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(5)]
        child.stdin.write("connected\n")
        child.stdin.flush()
        _, tries, _, lines, _, listeners = child.stdout.readline().split()
        # Backed off: asyncio's accept loop logged about 100 errors a second, with tracebacks.
        # Each listener's loop backs off on its own (its local socket's too: accept(2) fails
        # for want of a descriptor before it looks for a connection).
        assert 1 <= int(tries) <= 15 * int(listeners) and 1 <= int(lines) <= 4, (tries, lines)
        waiting[0].settimeout(5)
        assert waiting[0].recv(4096)  # its challenge, once descriptors are free again
        child.stdin.write("done\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        for sock in waiting:
            sock.close()
        child.kill()
        child.wait()
