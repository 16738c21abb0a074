"""The command line's container-facing parts: ``hoplite-gpu health`` and tokens from files."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu.auth import MIN_TOKEN_CHARS, token_from_env
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
    secret.write_text("  from-file-0123456789\n")
    direct = {"HOPLITE_TOKEN": "direct-0123456789", "HOPLITE_TOKEN_FILE": str(secret)}
    assert token_from_env(direct) == "direct-0123456789"
    assert token_from_env({"HOPLITE_TOKEN_FILE": str(secret)}) == "from-file-0123456789"
    # A named file that is missing is refused (issue 39: it was no token, and the directory then
    # made one of its own: fail-open).
    with pytest.raises(AuthenticationError, match="does not exist"):
        token_from_env({"HOPLITE_TOKEN_FILE": str(tmp_path / "absent")})
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
    proc, address = _start_directory({**os.environ, "HOPLITE_TOKEN": "tok-health-0123456789"})
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
    secret.write_text("file-token-0123456789\n")
    secret.chmod(0o600)  # a secret only its owner reads (other users' access is warned about)
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


# ---------------------------------------------------------------- issue 39, finding 8: tokens
def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``hoplite-gpu ARGV``, run to its end (the test's bound: 30 s)."""
    return subprocess.run(
        [sys.executable, "-m", "hoplite_gpu.cli", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env=env if env is not None else dict(os.environ),
    )


def _without_token() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("HOPLITE_TOKEN", "HOPLITE_TOKEN_FILE")}


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The single line a refused command printed (no traceback)."""
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], done.stdout + done.stderr
    return lines[0]


@pytest.mark.parametrize("token", [" ", "a", "Qz7-never-shown", " \t\n"])
def test_a_blank_or_short_token_is_refused(tmp_path: Path, token: str) -> None:
    with pytest.raises(AuthenticationError, match=f"at least {MIN_TOKEN_CHARS}") as refused:
        token_from_env({"HOPLITE_TOKEN": token})
    assert len("Qz7-never-shown") == MIN_TOKEN_CHARS - 1
    assert "Qz7" not in str(refused.value)  # the token is never shown
    secret = tmp_path / "token"
    secret.write_text(token + "\n" if token.strip() else token + "x")
    with pytest.raises(AuthenticationError, match=f"at least {MIN_TOKEN_CHARS}"):
        token_from_env({"HOPLITE_TOKEN_FILE": str(secret)})
    with pytest.raises(AuthenticationError, match=f"at least {MIN_TOKEN_CHARS}"):
        hg.start_directory(token)
    done = _cli("directory", "--port", "0", env={**_without_token(), "HOPLITE_TOKEN": token})
    assert done.returncode == 2
    assert f"at least {MIN_TOKEN_CHARS}" in _one_line(done)


def test_the_environment_token_is_stripped_as_a_file_token_is() -> None:
    token = "k" * MIN_TOKEN_CHARS
    assert token_from_env({"HOPLITE_TOKEN": f"  {token}\n"}) == token


def test_a_token_file_other_users_can_read_or_write_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = tmp_path / "token"
    secret.write_text("t" * 32)
    for mode, warned in ((0o600, False), (0o640, False), (0o644, True), (0o602, True)):
        secret.chmod(mode)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hoplite_gpu.auth"):
            assert token_from_env({"HOPLITE_TOKEN_FILE": str(secret)}) == "t" * 32
        assert any("every user" in r.getMessage() for r in caplog.records) == warned, oct(mode)
        assert all("t" * 32 not in r.getMessage() for r in caplog.records)


def test_a_fifo_or_a_directory_as_token_file_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes to it: opening it blocked start-up
    for path in (fifo, tmp_path):
        with pytest.raises(AuthenticationError, match="not a regular file"):
            token_from_env({"HOPLITE_TOKEN_FILE": str(path)})
    done = _cli("directory", "--port", "0", env={**_without_token(), "HOPLITE_TOKEN_FILE": str(fifo)})
    assert done.returncode == 2 and "not a regular file" in _one_line(done)


def test_a_token_file_named_but_missing_refuses_to_start(tmp_path: Path) -> None:
    absent = str(tmp_path / "hoplite_token")
    done = _cli("directory", "--port", "0", env={**_without_token(), "HOPLITE_TOKEN_FILE": absent})
    assert done.returncode == 2
    assert "does not exist" in _one_line(done)  # and no generated HOPLITE_TOKEN=... printed
    done = _cli("directory", "--port", "0", "--token-file", absent, env=_without_token())
    assert done.returncode == 2 and "does not exist" in _one_line(done)


# ---------------------------------------------------------------- ports and certificates
def test_an_out_of_range_port_is_a_typed_one_line_error(tmp_path: Path) -> None:
    token = {**_without_token(), "HOPLITE_TOKEN": "p" * 32}
    done = _cli("directory", "--port", "99999", env=token)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "not a port number" in done.stderr.splitlines()[-1]
    done = _cli("health", "--address", "127.0.0.1:99999")
    assert done.returncode == 1 and "1..65535" in _one_line(done)
    with pytest.raises(hg.DirectoryUnavailableError, match=r"1\.\.65535"):
        hg.connect("127.0.0.1:99999", token="p" * 32)
    with pytest.raises(hg.InvalidArgumentError, match=r"0\.\.65535"):
        hg.start_directory(port=99999)


def test_a_certificate_that_does_not_load_is_a_one_line_error(tmp_path: Path) -> None:
    env = {**_without_token(), "HOPLITE_TOKEN": "c" * 32, "HOPLITE_TLS_CERT_FILE": str(tmp_path / "no.pem")}
    done = _cli("directory", "--port", "0", env=env)
    assert done.returncode == 2 and "tls_cert_file" in _one_line(done)
    done = _cli("health", "--tls-ca-file", str(tmp_path / "no.pem"))
    assert done.returncode == 1 and "tls_ca_file" in _one_line(done)


# ---------------------------------------------------------------- health and nodes over TLS
@pytest.fixture
def tls_directory(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A ``hoplite-gpu directory`` serving TLS with a self-signed certificate: its address, and the
    environment that configures it (``HOPLITE_TLS_CERT_FILE`` and ``_KEY_FILE``)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    from tests.test_hardening import _self_signed

    cert, key = _self_signed(tmp_path, "directory")
    tls_env = {"HOPLITE_TLS_CERT_FILE": cert, "HOPLITE_TLS_KEY_FILE": key}
    proc, address = _start_directory({**_without_token(), "HOPLITE_TOKEN": "s" * 32, **tls_env})
    try:
        yield address, tls_env
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_health_of_a_tls_directory(tls_directory: tuple[str, dict[str, str]]) -> None:
    address, tls_env = tls_directory
    # The image's health check runs beside the directory, with its environment: TLS then.
    beside = _cli("health", "--address", address, "--timeout", "5", env={**os.environ, **tls_env})
    assert beside.returncode == 0, beside.stderr
    assert "(TLS)" in beside.stdout
    checked = _cli("health", "--address", address, "--tls-ca-file", tls_env["HOPLITE_TLS_CERT_FILE"])
    assert checked.returncode == 0, checked.stderr
    plain = _cli("health", "--address", address, "--timeout", "2", "--no-tls")
    assert plain.returncode == 1 and "--tls" in _one_line(plain)
    proc, plain_address = _start_directory({**_without_token(), "HOPLITE_TOKEN": "s" * 32})
    try:
        wrong = _cli("health", "--address", plain_address, "--tls")
        assert wrong.returncode == 1 and "--no-tls" in _one_line(wrong)
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_a_plain_node_against_a_tls_directory_is_told_of_tls(
    tls_directory: tuple[str, dict[str, str]],
) -> None:
    address, _ = tls_directory
    with pytest.raises(hg.DirectoryUnavailableError, match=r"serves TLS.*tls_ca_file"):
        hg.connect(address, token="s" * 32, connect_timeout=2, reconnect_timeout=0)
