"""A standalone directory (``hoplite-gpu directory``) in a child process that can be killed and
restarted at the same address: for scripts, tests and benchmarks of a directory restart."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time

from ..errors import DirectoryUnavailableError


class DirectoryProcess:
    """Run ``hoplite-gpu directory`` as a child process.

    Args:
        token: The shared token (passed as ``HOPLITE_TOKEN``).
        host: Interface to bind.
        port: TCP port; 0 picks a free one now, kept across restarts.
        env: Extra environment variables (e.g. ``HOPLITE_LEASE_TIMEOUT``).
        wrap: A command prefix, e.g. ``["ip", "netns", "exec", "host0"]`` to run it in a network
            namespace.
    """

    def __init__(
        self,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        env: dict[str, str] | None = None,
        wrap: list[str] | None = None,
    ):
        if not port:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.token = token
        self.host = host
        self.port = port
        self.env = dict(env or {})
        self.wrap = list(wrap or [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """``host:port`` nodes connect to."""
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the child process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 30.0) -> None:
        """Start the directory and wait until it listens.

        Raises:
            DirectoryUnavailableError: it exited or did not listen within ``timeout`` seconds.
        """
        cmd = [*self.wrap, sys.executable, "-m", "hoplite_gpu.cli", "directory", "--host", self.host]
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(self.port)],
            env={**os.environ, **self.env, "HOPLITE_TOKEN": self.token},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            bufsize=0,  # unbuffered: a line read never takes the next one out of the pipe's sight
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        said: list[str] = []
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline and sel.select(deadline - time.monotonic()):
                line = self.proc.stdout.readline().decode(errors="replace")
                if "listening on" in line:
                    return
                if not line:
                    break
                said.append(line.strip())
        code = self.proc.poll()
        self.kill()
        raise DirectoryUnavailableError(
            f"the directory on {self.address} did not start (exit code {code}); it said: "
            f"{' | '.join(said[-5:]) or 'nothing'}",
            peer=self.address,
            cause="start",
        )

    def kill(self) -> None:
        """SIGKILL the directory (a crash) and reap it."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        """Stop the directory (SIGTERM; SIGKILL if it does not exit within 10 s)."""
        self._end(signal.SIGTERM)

    def _end(self, sig: int) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
        self.proc = None
