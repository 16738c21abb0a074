"""An emulated cluster on one machine: N hosts as network namespaces on one bridge, each host's link
limited by ``tc tbf`` in both directions.

Layout (``prefix`` defaults to ``hgb``): a switch namespace ``<prefix>sw`` holds the bridge; host
``i`` is namespace ``<prefix>i`` with a veth pair to the bridge and the address ``10.77.0.(i+1)/24``.
Its upload is shaped on its own veth end, its download on the bridge's end, both at the chosen
bandwidth. Nothing is added to the machine's own namespace: every packet stays between namespaces
the harness created, and :meth:`Cluster.close` (also run on Ctrl-C, SIGTERM and exit) deletes them
all, which removes their links, qdiscs and addresses with them.

Needs root and ``ip``/``tc`` (Debian's iproute2); :func:`check` says what is missing.

    with Cluster(hosts=4, rate_bytes=100e6) as c:
        c.run(0, ["python3", "-c", "print('hello from host 0')"])
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from types import FrameType, TracebackType
from typing import Any

SUBNET = "10.77.0"


class ClusterUnavailable(RuntimeError):
    """The emulated cluster cannot be built here (not root, or iproute2 missing)."""


def check() -> None:
    """Raise :class:`ClusterUnavailable` saying what is missing to build a cluster here."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterUnavailable(f"{' and '.join(missing)} not found: install Debian's iproute2")
    if os.geteuid() != 0:
        raise ClusterUnavailable("network namespaces need root: run the benchmark as root")


def _sh(*args: str) -> None:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterUnavailable(f"`{' '.join(args)}` failed: {done.stderr.strip()}")


class Cluster:
    """The namespaces, links and shaping of an emulated cluster (see the module docstring).

    Args:
        hosts: Number of hosts (2 to 16).
        rate_bytes: Bandwidth of each host's link, bytes per second, each direction.
        prefix: Namespace name prefix (another one lets two clusters coexist).
    """

    def __init__(self, hosts: int = 4, rate_bytes: float = 100e6, prefix: str = "hgb") -> None:
        if not 2 <= hosts <= 16:
            raise ValueError("hosts must be in 2..16")
        self.hosts = hosts
        self.rate_bytes = rate_bytes
        self.prefix = prefix
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []  # started by popen, killed by close
        self._old_handlers: dict[int, Any] = {}

    # ------------------------------------------------------------ addresses and names
    def namespace(self, i: int) -> str:
        """Namespace name of host ``i``."""
        return f"{self.prefix}{i}"

    def address(self, i: int) -> str:
        """IPv4 address of host ``i``."""
        return f"{SUBNET}.{i + 1}"

    @property
    def switch(self) -> str:
        """Namespace that holds the bridge."""
        return f"{self.prefix}sw"

    # ------------------------------------------------------------ life cycle
    def __enter__(self) -> Cluster:
        self.open()
        return self

    def __exit__(self, *exc: object | TracebackType | None) -> None:
        self.close()

    def open(self) -> None:
        """Create the namespaces, the bridge, the links and the shaping."""
        check()
        self._remove_leftovers()
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        rate = f"{int(self.rate_bytes * 8)}bit"
        # A burst of ~10 ms of traffic (at least 64 KiB) and a queue of up to 50 ms: the rate holds
        # over any interval longer than a few ms, as on a real link.
        burst = max(64 * 1024, int(self.rate_bytes / 100))
        shaping = ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
        sw = self.switch
        self._add_namespace(sw)
        _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", sw, "link", "set", "br0", "up")
        for i in range(self.hosts):
            ns = self.namespace(i)
            self._add_namespace(ns)
            host_end, switch_end = "eth0", f"p{i}"
            _sh(
                "ip",
                "link",
                "add",
                host_end,
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                switch_end,
                "netns",
                sw,
            )
            _sh("ip", "-n", sw, "link", "set", switch_end, "master", "br0")
            _sh("ip", "-n", sw, "link", "set", switch_end, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", host_end)
            _sh("ip", "-n", ns, "link", "set", host_end, "up")
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", host_end, "root", *shaping)
            _sh("ip", "netns", "exec", sw, "tc", "qdisc", "add", "dev", switch_end, "root", *shaping)

    def _add_namespace(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._made.append(name)

    def _remove_leftovers(self) -> None:
        """Delete namespaces of this prefix left by a run that was killed before it cleaned up."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for line in listed.splitlines():
            name = line.split()[0] if line.strip() else ""
            if name == self.switch or (name.startswith(self.prefix) and name[len(self.prefix) :].isdigit()):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def close(self) -> None:
        """Kill the processes :meth:`popen` started that still run, and delete everything this
        cluster created (idempotent)."""
        while self._procs:
            proc = self._procs.pop()
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
        atexit.unregister(self.close)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.close()
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    # ------------------------------------------------------------ running things on a host
    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run inside host ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(i), *argv]

    def popen(
        self, i: int, argv: list[str], env: dict[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on host ``i`` (the environment: this process's, updated with ``env``)."""
        proc = subprocess.Popen(self.command(i, argv), env={**os.environ, **(env or {})}, **kwargs)
        self._procs = [p for p in self._procs if p.poll() is None] + [proc]
        return proc

    def pids(self) -> list[int]:
        """Every process in the hosts' namespaces (``ip netns pids``), to sample their CPU time or to
        find what is left of a run."""
        found = []
        for i in range(self.hosts):
            out = subprocess.run(["ip", "netns", "pids", self.namespace(i)], capture_output=True, text=True)
            found += [int(p) for p in out.stdout.split()]
        return found

    def run(self, i: int, argv: list[str], timeout: float = 60.0) -> str:
        """Run ``argv`` on host ``i`` and return its output (raises on a non-zero exit)."""
        done = subprocess.run(self.command(i, argv), capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"host {i}: {' '.join(argv)} failed: {done.stderr.strip()}")
        return done.stdout


def link_throughput(cluster: Cluster, nbytes: int = 128 << 20) -> float:
    """Bytes per second one TCP stream moves from host 0 to host 1 (checks the shaping)."""
    port = 5999
    server = cluster.popen(
        1,
        [sys.executable, "-c", _SINK_TIMED, cluster.address(1), str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        cluster.run(
            0, [sys.executable, "-c", _SOURCE, cluster.address(1), str(port), str(nbytes)], timeout=120
        )
        out, _ = server.communicate(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
    received, start, end = (float(x) for x in out.split())
    return received / (end - start)


def aggregate_throughput(cluster: Cluster, nbytes: int = 64 << 20) -> float:
    """Bytes per second the whole cluster moves when every host sends to the next one and receives
    from the previous one at once (a ring of TCP streams: every link busy in both directions).

    On one machine the namespaces share its cores, so at fast link rates this, not a link, bounds
    what any system can move in total: a workload that must move ``X`` bytes across the switch
    takes at least ``X`` over this."""
    port = 5998
    n = cluster.hosts
    sinks = [
        cluster.popen(
            (i + 1) % n,
            [sys.executable, "-c", _SINK_TIMED, cluster.address((i + 1) % n), str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    sources = []
    try:
        for sink in sinks:  # each prints an empty line once it listens
            assert sink.stdout is not None
            sink.stdout.readline()
        sources = [
            cluster.popen(
                i, [sys.executable, "-c", _SOURCE, cluster.address((i + 1) % n), str(port), str(nbytes)]
            )
            for i in range(n)
        ]
        reports = [sink.communicate(timeout=300)[0].split() for sink in sinks]
    finally:
        for proc in [*sinks, *sources]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
    total = sum(float(r[0]) for r in reports)
    return total / (max(float(r[2]) for r in reports) - min(float(r[1]) for r in reports))


_SINK_TIMED = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print("", flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); n = 0; t0 = None
while True:
    k = c.recv_into(buf)
    if not k: break
    t0 = t0 or time.monotonic(); n += k
print(n, t0, time.monotonic())
"""

_SOURCE = """
import socket, sys, time
for _ in range(200):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError:
        time.sleep(0.02)
data = b"x" * (1 << 20)
for _ in range(int(sys.argv[3]) >> 20): c.sendall(data)
c.close()
"""
