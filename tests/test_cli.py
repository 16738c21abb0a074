"""The command line's container-facing parts: ``hoplite-gpu health`` and tokens from files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu.auth import token_from_env
from hoplite_gpu.errors import AuthenticationError

pytestmark = pytest.mark.timeout(60)


def _health(address: str, timeout: float = 5.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hoplite_gpu.cli", "health", "--address", address, "--timeout", str(timeout)],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_token_from_env_order(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("  from-file\n")
    assert token_from_env({"HOPLITE_TOKEN": "direct", "HOPLITE_TOKEN_FILE": str(secret)}) == "direct"
    assert token_from_env({"HOPLITE_TOKEN_FILE": str(secret)}) == "from-file"
    assert token_from_env({"HOPLITE_TOKEN_FILE": str(tmp_path / "absent")}) == ""
    assert token_from_env({}) == ""
    secret.write_text("\n")
    with pytest.raises(AuthenticationError, match="empty"):
        token_from_env({"HOPLITE_TOKEN_FILE": str(secret)})
    secret.write_bytes(b"\xff\xfe")
    with pytest.raises(AuthenticationError, match="cannot read"):
        token_from_env({"HOPLITE_TOKEN_FILE": str(secret)})


def _start_directory(env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """``hoplite-gpu directory`` on a free loopback port; returns once it listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "hoplite_gpu.cli", "directory", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # blocks until it listens or exits (the test's timeout bounds it)
    if "listening on" not in first:
        proc.kill()
        raise AssertionError(first + proc.communicate()[0])
    return proc, f"127.0.0.1:{port}"


def test_health_of_a_running_directory_then_a_stopped_one() -> None:
    proc, address = _start_directory({**os.environ, "HOPLITE_TOKEN": "tok-health"})
    try:
        for _ in range(3):
            ok = _health(address)
            assert ok.returncode == 0, ok.stderr
            assert "serving" in ok.stdout
    finally:
        proc.terminate()
        log = proc.communicate(timeout=10)[0]
    assert "dropping" not in log  # a probe is not an authentication failure
    gone = _health(address, timeout=2)
    assert gone.returncode == 1
    assert "unhealthy" in gone.stderr and address in gone.stderr


def test_health_of_something_else() -> None:
    """A server that is not a directory (it closes at once, or says something else) is unhealthy."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        probe = subprocess.Popen(
            [sys.executable, "-m", "hoplite_gpu.cli", "health", "--address", address, "--timeout", "10"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        conn, _ = server.accept()
        conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
        conn.close()
        _, err = probe.communicate(timeout=30)
    assert probe.returncode == 1
    assert "unhealthy" in err


def test_directory_and_node_take_the_token_from_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "hoplite_token"
    secret.write_text("file-token\n")
    env = {k: v for k, v in os.environ.items() if k != "HOPLITE_TOKEN"}
    proc, address = _start_directory({**env, "HOPLITE_TOKEN_FILE": str(secret)})
    try:
        monkeypatch.delenv("HOPLITE_TOKEN", raising=False)
        monkeypatch.setenv("HOPLITE_TOKEN_FILE", str(secret))
        with hg.connect(address) as node:
            oid = node.put(np.arange(10))
            assert np.array_equal(node.get(oid, timeout=10), np.arange(10))
        with pytest.raises(AuthenticationError):
            hg.connect(address, token="another-token")
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_directory_refuses_an_empty_token_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "hoplite_gpu.cli", "directory", "--port", "0", "--token-file", str(empty)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "empty" in done.stderr
