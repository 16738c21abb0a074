"""A peer without the token at a node's data-plane listener, speaking UCX itself (a C program on
UCP's and UCT's APIs, tests/data/ucp_intruder.c, built here against the libucx wheel): it must
neither read nor write the node's memory, nor leave memory or a broken node behind.

The node ("victim") is a process of its own, joined to the test's directory, holding a secret in a
NumPy array whose address it tells the test (a cheat an attacker would not have, enough to show
the primitive). Every node here runs the UCX data plane (``Config.data_plane="ucx"``, what RDMA
and CUDA hosts run); hosts with TCP only run the TCP one, which no UCX peer reaches at all
(tests/test_tcp_plane.py).
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

UCX_PLANE = {"HOPLITE_DATA_PLANE": "ucx"}


@pytest.fixture(scope="module")
def owner() -> Iterator[Any]:
    """A node with an embedded directory in the test process, on the UCX data plane."""
    import hoplite_gpu as hg

    node = hg.init(data_plane="ucx")
    yield node
    node.close()


SECRET = b"HOPLITE-SECRET-0123456789abcdef!"  # 32 bytes
PUT_VALUE = b"PWNED-BY-AN-UNAUTHENTICATED-PEER"  # the same length
UCT_VALUE = b"UCT-PUT-BY-UNAUTHENTICATED-PEER!"

# The node. Commands on stdin, answers with a prefix on a pipe of their own (fd argv[4]): UCX prints
# its own warnings on stdout, from C, with its own buffering.
_VICTIM = r"""
import os, sys
import numpy as np
import hoplite_gpu as hg

node = hg.connect(sys.argv[1], token=sys.argv[2], listen_host="127.0.0.1", shared_memory=False)
secret = np.frombuffer(sys.argv[3].encode(), np.uint8).copy()
answers = os.fdopen(int(sys.argv[4]), "w")
data_port = int(node.data_address.rsplit(":", 1)[1])


def listening():
    # This process's own listening TCP ports but the data plane's: UCX's TCP interface.
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return sorted(ports - {data_port})


print("V:READY", node.data_address, hex(secret.ctypes.data), file=answers, flush=True)
for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == "quit":
        break
    if cmd[0] == "secret":
        print("V:SECRET", secret.tobytes().hex(), file=answers, flush=True)
    elif cmd[0] == "ports":
        print("V:PORTS", ",".join(map(str, listening())) or "-", file=answers, flush=True)
    elif cmd[0] == "put":
        print("V:OID", node.put(np.arange(1 << 18, dtype=np.int64)).hex(), file=answers, flush=True)
    elif cmd[0] == "get":
        got = node.get(hg.ObjectID.from_hex(cmd[1]), timeout=30)
        print("V:GOT", int(np.asarray(got).sum()), file=answers, flush=True)
node.close()
print("V:CLOSED", file=answers, flush=True)
"""


class Victim:
    """The node's process, driven line by line."""

    def __init__(self, directory: str, token: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_TCP_PUT")} | UCX_PLANE
        theirs, ours = os.pipe()[::-1]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _VICTIM, directory, token, SECRET.decode(), str(theirs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            pass_fds=(theirs,),
        )
        os.close(theirs)
        self._answers = os.fdopen(ours, "r")
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.wait("V:READY", 60).split()
        self.host, port = ready[1].rsplit(":", 1)
        self.port = int(port)
        self.secret_address = ready[2]

    def _read(self) -> None:
        with self._answers:
            for line in self._answers:
                self._lines.put(line.rstrip("\n"))
        self._lines.put("")  # end of output

    def wait(self, prefix: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the node said no {prefix} in {timeout} s") from None
            if line.startswith(prefix):
                return line
            assert line or self.proc.poll() is None, f"the node exited ({self.proc.poll()})"

    def ask(self, cmd: str, prefix: str, timeout: float = 30) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.wait(prefix, timeout)

    def rss(self) -> int:
        """Resident memory of the node's process, bytes."""
        with open(f"/proc/{self.proc.pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def secret(self) -> bytes:
        line = self.ask("secret", "V:SECRET")
        try:
            return bytes.fromhex(line.split()[1])
        except (IndexError, ValueError):
            raise AssertionError(f"not a secret: {line!r}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("quit", "V:CLOSED", 30)
            except (AssertionError, OSError):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def intruder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The C program, built against the libucx wheel's headers and libraries."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    try:
        import libucx
    except ImportError:
        pytest.skip("no libucx wheel (its headers build the intruder)")
    root = Path(libucx.__file__).parent
    if not (root / "include" / "ucp" / "api" / "ucp.h").exists():
        pytest.skip("the libucx wheel has no headers")
    out = tmp_path_factory.mktemp("intruder") / "ucp_intruder"
    source = Path(__file__).parent / "data" / "ucp_intruder.c"
    lib = root / "lib"
    link = [f"-L{lib}", "-lucp", "-luct", "-lucs", f"-Wl,-rpath,{lib}"]
    built = subprocess.run(
        [cc, "-O1", "-o", str(out), str(source), f"-I{root / 'include'}", *link],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr
    return out


def attack(intruder: Path, *args: str) -> list[str]:
    """Run the intruder; its lines of output (UCX's own warnings left out)."""
    env = dict(os.environ, UCX_TLS="tcp", UCX_TCP_PUT_ENABLE="y")
    env.pop("UCX_NET_DEVICES", None)
    done = subprocess.run([str(intruder), *args], capture_output=True, text=True, timeout=90, env=env)
    lines = [line for line in done.stdout.splitlines() if not line.startswith("[")]
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    return lines


@pytest.fixture
def victim(owner: Any) -> Iterator[Victim]:
    v = Victim(owner.directory_address, owner.token)
    try:
        yield v
    finally:
        v.stop()


def still_serves(victim: Victim, owner: Any) -> None:
    """The node still answers, and serves and pulls over its data plane with a peer that has the token."""
    oid = victim.ask("put", "V:OID").split()[1]
    import hoplite_gpu as hg

    got = owner.get(hg.ObjectID.from_hex(oid), timeout=30)
    assert int(np.asarray(got).sum()) == (1 << 18) * ((1 << 18) - 1) // 2
    mine = owner.put(np.full(1 << 16, 3, np.int64))
    assert int(victim.ask(f"get {mine.hex()}", "V:GOT").split()[1]) == 3 << 16


def test_an_unauthenticated_ucp_peer_can_neither_read_nor_write_node_memory(
    intruder: Path, victim: Victim, owner: Any
) -> None:
    """The finding: ucxx asked UCX for RMA by default, and over TCP UCX served a peer's get and
    put at any address it named, before hoplite's authentication (its GOT was the secret, and
    its put replaced it)."""
    assert victim.secret() == SECRET
    got = attack(intruder, "get", victim.host, str(victim.port), victim.secret_address, str(len(SECRET)))
    assert got[0] == "CONNECTED", got  # UCX let it in: the refusal is not a connection failure
    assert not any(line.startswith("GOT") for line in got), got
    assert SECRET.hex() not in "\n".join(got)
    put = attack(intruder, "put", victim.host, str(victim.port), victim.secret_address, PUT_VALUE.hex())
    assert put[0] == "CONNECTED", put
    assert victim.secret() == SECRET, put
    still_serves(victim, owner)


def test_junk_and_an_abrupt_exit_leave_the_node_serving(intruder: Path, victim: Victim, owner: Any) -> None:
    """Stream, tagged and active messages of junk, a put to a wild address (the node would crash
    if UCX served it), then an exit without closing: the node is alive and serves."""
    for _ in range(3):
        assert attack(intruder, "junk", victim.host, str(victim.port))[-1] == "SENT"
    assert victim.proc.poll() is None
    assert victim.secret() == SECRET
    still_serves(victim, owner)


class UctPutServed(Exception):
    """The node's memory took a UCT-level put."""


@pytest.mark.xfail(
    strict=True,
    raises=UctPutServed,
    reason="UCX's TCP transport writes a PUT request's bytes at the address it names, whatever "
    "its settings (uct_tcp_ep_handle_put_req, UCX 1.21): only the network keeps such a peer out",
)
def test_a_peer_speaking_uct_tcp_cannot_write_node_memory(intruder: Path, victim: Victim) -> None:
    """One level down: UCT's own TCP connection to the node worker's TCP interface (its port is
    in the worker address UCX hands any peer that connects), no listener, no ucxx. A known hole,
    kept in view: when UCX checks the address this passes, fails as strict, and SECURITY.md
    changes."""
    ports = victim.ask("ports", "V:PORTS").split()[1]
    assert ports != "-", "no UCX TCP interface found"
    for port in ports.split(","):
        lines = attack(intruder, "uct-put", port, victim.secret_address, UCT_VALUE.hex())
        assert lines[0] == "CONNECTED", lines
    secret = victim.secret()
    if secret == UCT_VALUE:
        raise UctPutServed(lines)
    assert secret == SECRET


_AM_FLOOD = r"""
import asyncio, os, sys
import numpy as np
from hoplite_gpu.dataplane.ucx.settings import apply_ucx_defaults

apply_ucx_defaults()  # a node's UCX settings, and ucxx's own features (active messages among them)
import ucxx


async def main() -> None:
    host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    try:
        ep = await asyncio.wait_for(ucxx.create_endpoint(host, port), 20)
        block = np.ones(1 << 20, np.uint8)
        for _ in range(count):
            await asyncio.wait_for(ep.am_send(block), 20)
        await asyncio.wait_for(ep.close(), 20)  # flushes: every message reached the node
    except Exception as exc:
        print("FAILED", type(exc).__name__, exc, flush=True)
        os._exit(0)
    print("SENT", flush=True)
    os._exit(0)  # ucxx's shutdown can hang on an endpoint the node dropped


asyncio.run(main())
"""


def test_active_messages_from_an_unauthenticated_peer_are_not_kept(victim: Victim) -> None:
    """ucxx, asked for UCX's active messages, keeps each one that arrives until the application
    receives it; hoplite_gpu never does (the finding: +100 MiB of the node's memory per flood of
    100 x 1 MiB, for good). Without that feature UCX drops them as they arrive."""
    per_round, rounds = 32, 3
    after = []
    for _ in range(rounds):
        done = subprocess.run(
            [sys.executable, "-c", _AM_FLOOD, victim.host, str(victim.port), str(per_round)],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert "SENT" in done.stdout, (done.stdout, done.stderr)
        after.append(victim.rss())
    # Later rounds add nothing (UCX's pools from the first are reused); kept messages would add
    # 32 MiB a round.
    assert after[-1] - after[0] < (per_round << 20) // 2, [f"{b / 2**20:.0f} MiB" for b in after]


def test_a_node_refuses_to_listen_on_a_ucx_context_that_serves_rma() -> None:
    """ucxx started before hoplite_gpu in the same process (with its default features, RMA
    among them): the node refuses to start its data plane rather than expose the process."""
    script = (
        "import ucxx\n"
        "ucxx.init()\n"
        "import hoplite_gpu as hg\n"
        "try:\n"
        "    hg.init(listen_host='127.0.0.1', shared_memory=False)\n"
        "except Exception as exc:\n"
        "    print('REFUSED', type(exc).__name__, exc, flush=True)\n"
        "else:\n"
        "    print('STARTED', flush=True)\n"
        "import os; os._exit(0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=90,
        env=os.environ | UCX_PLANE,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(("REFUSED", "STARTED"))]
    assert lines, (done.stdout, done.stderr)
    assert lines[-1].startswith("REFUSED HopliteError") and "with RMA" in lines[-1], lines
