"""Configuration of a node and of the directory.

Every field can be overridden by an environment variable ``HOPLITE_<FIELD_NAME_UPPER>``; explicit
keyword arguments win over the environment.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import ssl
from dataclasses import dataclass, fields
from typing import Any

from .errors import DirectoryUnavailableError, InvalidArgumentError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: UCX settings applied (unless already set in the environment) before UCX is first imported.
#: Measured on the 2-core development machines, process to process, 256 MiB in 4 MiB chunks
#: (``bench/p2p.py``; the raw-ucxx figures came from a two-process script with a reused buffer):
#:
#: - over loopback TCP the rendezvous protocol moved 0.5-1 GB/s and the eager protocol
#:   (RNDV_THRESH=inf) 2-5 GB/s depending on the day, never reliably above a plain socket;
#: - adding the shared-memory transports (``sm``: posix, sysv, cma) for peers on the same host moved
#:   6.6-7 GB/s in the same run where TCP moved 2.0 GB/s. UCX leaves shared memory out of endpoints
#:   that ask for peer-failure handling (ucxx endpoints do) unless ``UCX_MM_ERROR_HANDLING=y``; with
#:   it a SIGKILLed peer still failed a pending receive within milliseconds (through the TCP lane
#:   the endpoint keeps). But the randomized fault soak (tests/test_soak.py) then wedged nodes: after
#:   some SIGKILLs, every new endpoint to one node timed out in ucxx's peer-info exchange, on both
#:   sides, for the rest of its life (seed 3: at run 8 with ``tcp,sm``; 60 runs clean with ``tcp``,
#:   where the next failure was the test's own). Our reading: a process killed while writing into a
#:   peer's shared-memory FIFO leaves it stuck. So the default is TCP only: same-host bulk copies
#:   take hoplite_gpu's own shared-memory path (:mod:`hoplite_gpu.shm`, 5-8 GB/s), which a
#:   SIGKILL cannot wedge, and peers on other hosts use TCP either way;
#: - progress: ucxx (0.52) waits for a request without Python futures by re-polling the event
#:   loop (``asyncio.sleep(0)``) until it completes, in every mode but "thread" with
#:   ``UCXPY_ENABLE_PYTHON_FUTURE=1``. A node always has a receive posted for the next pull request,
#:   so "blocking" mode spun a whole core per idle node (60-100% measured with ``os.times``), which
#:   on a 2-core machine starved the other processes (a 4-worker broadcast of 256 MiB took 2.75 s).
#:   "thread" mode with Python futures idles at 1-2% of a core; a 64-byte round trip costs
#:   160-300 us instead of 37 us spinning, and 256 MiB moves at 4-5 GB/s instead of 5-6.
#:   "thread" mode submits requests from the progress thread (``UCXPY_ENABLE_DELAYED_SUBMISSION``,
#:   on by default there); turning that off cost 40% more CPU per byte on a loopback get (2.07 vs
#:   1.49 CPU-seconds per GiB with 1 MiB chunks, 2026-11-23).
#:
#: - TCP segment sizes: UCX's defaults (8 KiB sends, 64 KiB receives) cost a system call and a
#:   progress round per 8-64 KiB. With ``UCX_TCP_TX_SEG_SIZE=1m UCX_TCP_RX_SEG_SIZE=1m`` our UCX
#:   path (``bench/p2p.py --paths ucx``, 2026-11-23) went from 0.67/0.78/0.78 GB/s to
#:   1.17/1.81/1.86 GB/s at 16/64/256 MiB in back-to-back runs (0.32-0.47x a plain socket before,
#:   0.73-1.29x after); ``python -m ucxx.benchmarks.send_recv -n 64000000 --reuse-alloc`` went from
#:   0.79 to 1.58 GiB/s the same hour. 256 KiB segments gave 1.26-1.33 GB/s, 4 MiB 1.52-1.71 GB/s,
#:   8 MiB 1.40-1.53 GB/s; ``UCX_TCP_SNDBUF/RCVBUF=4m`` and ``UCX_TCP_MAX_IOV=128`` changed nothing
#:   measurable; the rendezvous protocol with 1 MiB segments moved 1.05-1.37 GB/s, below eager.
#:
#: Set ``UCX_TLS=tcp,sm`` to have same-host UCX transfers use shared memory anyway (faster when
#: ``shared_memory`` is off, unsafe under kills); in containers give /dev/shm room (``--shm-size``
#: or ``--ipc=host``).
UCX_DEFAULTS: dict[str, str] = {
    "UCX_TLS": "tcp",
    "UCX_MM_ERROR_HANDLING": "y",
    "UCX_RNDV_THRESH": "inf",
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCXPY_PROGRESS_MODE": "thread",
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
}


@dataclass(frozen=True, slots=True)
class Config:
    """Tunables for a node (and the embedded directory).

    Attributes:
        chunk_bytes: Size of a data-plane chunk for the first transfer from a peer; with
            ``adaptive_chunks`` later transfers size chunks from the throughput measured from that
            peer (about ``chunk_seconds`` of data each, within ``min_chunk_bytes`` and
            ``max_chunk_bytes``), so fast same-host links use large chunks (less per-chunk overhead:
            16 MiB chunks moved 64 MiB at 4.1 GB/s where 4 MiB chunks moved 2.7 GB/s) and slow
            links small ones (a chain of k receivers finishes about k chunk-times after the first).
            The first transfer's chunk is small because a relay forwards a chunk only once it has
            all of it: on the emulated cluster's 100 MB/s links, a broadcast chain of 8 hosts
            finished each hop 40 ms after the previous one with 4 MiB, 8 ms with 1 MiB (64 MiB in
            1.05 s and 0.77 s, ``bench/profile.py``), where most pairs had not been measured yet.
        adaptive_chunks: Size chunks from measured throughput (else always ``chunk_bytes``).
        chunk_seconds: Target transfer time of one chunk when adaptive. Each chunk costs a fixed
            overhead (about 0.5 ms of event-loop and UCX work on each side), and the throughput a
            receiver measures includes it, so a short target feeds back into small chunks. On the
            emulated cluster (``bench/netbench.py --hosts 4 --sizes 64MiB``, one run per setting,
            2-core machine), 4 ms gave broadcast/reduce 0.387/0.426 s at 1 GB/s links, 8 ms
            0.267/0.286 s, 16 ms 0.212/0.287 s; at 100 MB/s links 1.08/1.15x of the ideal with
            4 ms, 1.10/1.18x with 8 ms, 1.11/1.20x with 16 ms (a chain's hop lags one chunk).
            Re-measured 2026-11-23 (two runs per setting, medians of 5 rounds): at 1 GB/s, allreduce
            took 0.375/0.33/0.31/0.29 s with 8/16/32/64 ms (reduce 0.20 -> 0.175 s from 32 ms on,
            broadcast unchanged); at 100 MB/s, 16 ms cost broadcast and reduce 2-3% and 32 ms 3-8%
            (reduce 1.14x -> 1.22x). The per-chunk cost behind this, measured as CPU time of both
            processes of a loopback get with fixed chunks (``HOPLITE_ADAPTIVE_CHUNKS=0``, 40 gets of
            64 MiB): 2.3/1.3/0.95 CPU-seconds per GiB with 256 KiB/1 MiB/4 MiB chunks, about 0.4 ms
            of CPU per chunk (mostly inside ucxx: posting the tagged receive and completing its
            future), over a base of about 0.85 s per GiB. 8 ms stays: it is what slow links need,
            and on a real fast link (not four emulated hosts sharing two cores) 8 ms is 8 MiB.
        min_chunk_bytes: Smallest adaptive chunk.
        max_chunk_bytes: Largest adaptive chunk.
        chunks_in_flight: How many chunks a receiver has posted ahead of the data (and a sender
            has in flight). 16 instead of 4 gave no change above the noise at 1 GB/s (2026-11-23).
        inline_threshold_bytes: Objects up to this size live inline in the directory.
        max_object_bytes: Largest object ``put`` accepts.
        store_capacity_bytes: Total bytes a node's local store may hold.
        buffer_pool_bytes: Bytes of removed objects' buffers a node keeps for reuse by new objects
            of the same size (saves page faults; 0 disables). Not counted in the capacity.
        device_pool_bytes: Bytes of dropped device objects' exported allocations a process keeps
            for new device copies of the same size on the same device (:class:`hoplite_gpu.ipc.
            DevicePool`; 0 disables): a put then skips ``cudaMalloc`` and a delete skips
            ``cudaFree``, which waits for the whole device. Process-wide (the largest setting of
            the process's open nodes counts); not counted in the capacity.
        shared_memory: Keep objects larger than ``inline_threshold_bytes`` in ``/dev/shm``
            segments, and copy objects held by a node on the same host straight from its segment
            instead of over the data plane (:mod:`hoplite_gpu.shm`: 5-8 GB/s against 2.8 GB/s
            for a plain socket). Turn off (``HOPLITE_SHARED_MEMORY=0``) to force every transfer
            through UCX, as the emulated-cluster benchmarks do (network namespaces share
            ``/dev/shm``). When ``/dev/shm`` is full a buffer falls back to private memory.
        same_host_index: With ``shared_memory``: link each device object this node puts under a
            name same-host nodes of the cluster derive from its ObjectID, once the directory has
            registered the put, and look for such a link before asking the directory at a
            ``get`` (:func:`hoplite_gpu.ipc.open_indexed`): a same-host device ``get`` then makes
            no round trip to the directory and no hop to the I/O thread. The directory then does
            not choose the source (on a host of several GPUs, the owner's copy is read even where
            another copy sits on the reader's GPU). Off (``HOPLITE_SAME_HOST_INDEX=0``): every
            ``get`` asks the directory.
        max_control_message_bytes: Control messages larger than this are rejected (connection closed).
        connect_timeout: Seconds to connect and authenticate to the directory or a peer.
        request_timeout: Seconds to wait for a directory reply to a non-blocking request.
        stall_timeout: Seconds a transfer may make no progress before it is treated as failed.
        default_get_timeout: Timeout of ``get`` when the caller passes ``timeout=None``;
            ``0`` means wait forever.
        send_rate_limit: Bytes per second a node serves at most (0 = unlimited); for traffic shaping
            and for tests that need a slow sender.
        listen_host: Interface the embedded directory binds to, and the address a node advertises
            when ``advertise_host`` is empty. Empty (the default): an embedded directory listens on
            127.0.0.1, and a node advertises the address of its interface that routes to its
            directory (127.0.0.1 for a directory on loopback, the host's address on that network
            otherwise; see :func:`route_address`). Set (not a wildcard), it also limits the
            node's UCX to the interface that holds it, so the data-plane listener refuses peers
            arriving on other interfaces (once per process: see ``transport.ucxx_module``);
            empty, the listener accepts connections on every interface.
        advertise_host: Address peers use to reach this node's data plane (overrides the above;
            set it behind NAT, or where the route to the directory is not the one peers use).
        verify_digest: Check a received object's digest against the one recorded at ``put``.
        close_grace: Seconds ``Node.close`` lets transfers it is serving finish.
        reduce_chunk_bytes: Bytes a reduce-tree vertex reduces (and forwards) at a time; for a
            vertex whose output is in device memory, the least it reduces at a time.
        device_reduce_chunk_bytes: The most bytes a vertex whose output is in device memory
            reduces in one step, taking in what every input already holds. Its kernels are queued
            without waiting for them, and each step's bytes are forwarded once its CUDA event is
            done, while the next step is queued: fewer, longer steps cost fewer kernel launches
            and waits (each costs microseconds, more where system calls are intercepted).
        heartbeat_interval: Seconds between a node's heartbeats to the directory.
        lease_timeout: Seconds the directory waits without hearing from a node (heartbeats or any
            other message) before it declares the node dead and repairs every schedule the node
            was part of. A node whose connection closes (a killed process) is dead at once.
        reconnect_timeout: Seconds a node keeps trying (with backoff) to reach its directory again
            after losing the connection, e.g. while a standalone directory restarts at the same
            address; meanwhile requests wait, and on success the node restores its copies and
            re-sends its unfinished reductions. ``0``: give up at once.
        fault_injection: Faults to inject, for tests and benchmarks (see
            :mod:`hoplite_gpu.faults`); empty: none.
        validate_directory: A directory started with this config checks every invariant of its
            state after each event and logs what broke as an ``invariant_violated`` event
            (:meth:`~hoplite_gpu.directory.state.DirectoryState.problems`); the test suite and
            the soak turn it on. It costs a pass over the whole state per event.
        directory_unread_bytes: A directory started with this config drops a node whose replies
            and pushes it has not read pile up beyond this many bytes (a stuck or hostile
            reader would otherwise grow the directory's memory without bound); the node's
            copies and schedules are repaired as for a dead node.
        directory_max_handshakes: A directory started with this config closes new connections at
            once while this many others have not finished authenticating (each has 10 s to), so
            idle or hostile connections cannot use up its file descriptors or memory.
        directory_max_handshakes_per_address: The same bound per peer address, so one address
            cannot take every slot of ``directory_max_handshakes`` from the others.
        directory_max_pending_lookups: Quota of lookups one node may have waiting at once (gets
            of objects not there yet); beyond it a get fails with ``QuotaExceededError``.
        directory_max_reductions: Quota of reductions one node may have requested and not yet
            finished; beyond it a reduce fails with ``QuotaExceededError``.
        directory_max_inline_bytes: Quota of bytes of one node's small objects (those up to
            ``inline_threshold_bytes``) that the directory keeps inline; beyond it a put of a
            small object fails with ``QuotaExceededError`` until the node deletes some.
        directory_event_log_bytes: Bound of the directory's event log in (estimated) bytes,
            beside its bound of 100,000 events; the oldest events go first.
        directory_place_slice: Inputs a reduction places per directory event when they are
            already present: a reduce over thousands of them is placed in slices, with other
            nodes' requests served in between (about 5 ms of the directory's time per slice).
        tls_cert_file: PEM certificate chain a directory started with this config serves its
            control connections with, over TLS (with ``tls_key_file``); "" for plain TCP. For
            directories reached across networks you do not trust: the token authenticates
            either way, TLS also keeps control messages (object ids, inline objects) private.
        tls_key_file: PEM private key of ``tls_cert_file`` ("" if the chain file holds it).
        tls_ca_file: PEM certificates a node trusts for its directory's TLS certificate; set, the
            node connects over TLS and checks the certificate and the directory's host name or
            address against it. Data-plane (UCX) traffic is not encrypted either way.
    """

    chunk_bytes: int = 1 * MiB
    adaptive_chunks: bool = True
    chunk_seconds: float = 0.008
    min_chunk_bytes: int = 256 * KiB
    max_chunk_bytes: int = 16 * MiB
    chunks_in_flight: int = 4
    inline_threshold_bytes: int = 64 * KiB
    max_object_bytes: int = 16 * GiB
    store_capacity_bytes: int = 64 * GiB
    buffer_pool_bytes: int = 1 * GiB
    device_pool_bytes: int = 1 * GiB
    shared_memory: bool = True
    same_host_index: bool = True
    max_control_message_bytes: int = 0  # 0: derived from inline_threshold_bytes
    connect_timeout: float = 10.0
    request_timeout: float = 30.0
    stall_timeout: float = 30.0
    default_get_timeout: float = 0.0
    send_rate_limit: float = 0.0
    listen_host: str = ""
    advertise_host: str = ""
    verify_digest: bool = False
    close_grace: float = 10.0
    reduce_chunk_bytes: int = 1 * MiB
    device_reduce_chunk_bytes: int = 64 * MiB
    heartbeat_interval: float = 1.0
    lease_timeout: float = 5.0
    reconnect_timeout: float = 30.0
    fault_injection: str = ""
    validate_directory: bool = False
    directory_unread_bytes: int = 64 * MiB
    directory_max_handshakes: int = 256
    directory_max_handshakes_per_address: int = 64
    directory_max_pending_lookups: int = 100_000
    directory_max_reductions: int = 10_000
    directory_max_inline_bytes: int = 256 * MiB
    directory_event_log_bytes: int = 64 * MiB
    directory_place_slice: int = 256
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""

    def __post_init__(self) -> None:
        positive = (
            "directory_unread_bytes",
            "directory_max_handshakes",
            "directory_max_handshakes_per_address",
            "directory_max_pending_lookups",
            "directory_max_reductions",
            "directory_max_inline_bytes",
            "directory_event_log_bytes",
            "directory_place_slice",
            "chunk_bytes",
            "chunks_in_flight",
            "max_object_bytes",
            "store_capacity_bytes",
            "min_chunk_bytes",
            "max_chunk_bytes",
            "chunk_seconds",
            "reduce_chunk_bytes",
            "device_reduce_chunk_bytes",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"Config.{name} must be > 0", argument=name)
        for name in ("connect_timeout", "request_timeout", "stall_timeout", "heartbeat_interval"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"Config.{name} must be > 0 seconds", argument=name)
        if self.lease_timeout < 2 * self.heartbeat_interval:
            raise InvalidArgumentError(
                "Config.lease_timeout must be at least twice heartbeat_interval", argument="lease_timeout"
            )
        if self.min_chunk_bytes > self.max_chunk_bytes:
            raise InvalidArgumentError(
                "Config.min_chunk_bytes must be <= max_chunk_bytes", argument="min_chunk_bytes"
            )
        if (
            min(
                self.inline_threshold_bytes,
                self.send_rate_limit,
                self.buffer_pool_bytes,
                self.device_pool_bytes,
                self.reconnect_timeout,
            )
            < 0
        ):
            raise InvalidArgumentError("Config sizes and rates must be >= 0", argument="config")

    @property
    def control_message_limit(self) -> int:
        """Largest control message accepted, in bytes."""
        if self.max_control_message_bytes:
            return self.max_control_message_bytes
        return self.inline_threshold_bytes + 1 * MiB

    def server_tls(self) -> ssl.SSLContext | None:
        """The TLS context a directory serves with (None: plain TCP); see ``tls_cert_file``."""
        if not self.tls_cert_file:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.tls_cert_file, self.tls_key_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidArgumentError(
                f"cannot load Config.tls_cert_file={self.tls_cert_file!r} / tls_key_file: {exc}",
                argument="tls_cert_file",
            ) from None
        return ctx

    def client_tls(self) -> ssl.SSLContext | None:
        """The TLS context a node connects to its directory with (None: plain TCP)."""
        if not self.tls_ca_file:
            return None
        try:
            return ssl.create_default_context(cafile=self.tls_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidArgumentError(
                f"cannot load Config.tls_ca_file={self.tls_ca_file!r}: {exc}", argument="tls_ca_file"
            ) from None

    @property
    def directory_host(self) -> str:
        """Interface an embedded directory binds to (``listen_host``, else 127.0.0.1)."""
        return self.listen_host or "127.0.0.1"

    def data_host(self, directory_address: str) -> str:
        """Address advertised to peers for the data plane of a node whose directory is at
        ``directory_address``: ``advertise_host``, else ``listen_host`` unless it is a wildcard,
        else :func:`route_address` of the directory's host."""
        if self.advertise_host:
            return self.advertise_host
        if self.listen_host and self.listen_host not in WILDCARD_HOSTS:
            return self.listen_host
        return route_address(host_of(directory_address))

    @classmethod
    def from_env(cls, **overrides: Any) -> Config:
        """Build a Config from ``HOPLITE_*`` environment variables, then ``overrides``."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = os.environ.get("HOPLITE_" + f.name.upper())
            if raw is None:
                continue
            kind: Any = type(f.default)
            try:
                if kind is bool:
                    values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
                else:
                    values[f.name] = kind(raw)
            except ValueError as exc:
                raise InvalidArgumentError(
                    f"environment variable HOPLITE_{f.name.upper()}={raw!r} is not a {kind.__name__}",
                    argument=f.name,
                ) from exc
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise InvalidArgumentError(f"unknown Config fields: {sorted(unknown)}", argument="config")
        return cls(**values)

    def replace(self, **changes: Any) -> Config:
        """Return a copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


#: ``listen_host`` values that name every interface rather than one address peers can use.
WILDCARD_HOSTS = ("0.0.0.0", "::")


def route_address(host: str) -> str:
    """The address of this machine's interface that routes to ``host`` (what peers that reach
    ``host`` can reach us on). Opens a UDP socket and connects it, which sends nothing.

    Raises:
        DirectoryUnavailableError: ``host`` does not resolve or no interface routes to it; the
            message says to check the directory address or set ``HOPLITE_ADVERTISE_HOST``.
    """
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)
            return str(sock.getsockname()[0])
    except (OSError, IndexError) as exc:
        raise DirectoryUnavailableError(
            f"no route from this machine to the directory host {host!r} ({exc}): check the "
            "directory address, or set HOPLITE_ADVERTISE_HOST (Config.advertise_host) to an address "
            "of this machine that the other nodes can reach",
            peer=host,
            cause=f"{type(exc).__name__}: {exc}",
        ) from exc


def host_of(address: str) -> str:
    """The host part of a ``host:port`` address (brackets of an IPv6 literal removed)."""
    return address.rsplit(":", 1)[0].strip("[]")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost``."""
    return host == "localhost" or host.startswith("127.") or host == "::1"


#: Environment variable: ``1`` hands device chunks to UCX as they are (its ``cuda_copy`` transport
#: moves them), instead of staging them through pinned host buffers here. It adds ``cuda_copy`` to
#: ``UCX_TLS`` (unless that lists ``all`` or ``cuda``, or is an exclusion list, ``^...``).
#: Read when UCX is first loaded; create a CUDA context before the node starts (UCX looks for one).
#: Off by default: ``bench/gpu.py``'s ``wire`` part measured both ways on an H100 (2026-11-24):
#: staged, a device get over the data plane ran at 0.87-1.08x of a host get, through ``cuda_copy``
#: at 0.65-0.86x. On a machine whose UCX has no CUDA transports, UCX warns and device chunks fail.
UCX_CUDA_ENV = "HOPLITE_UCX_CUDA"


def ucx_cuda() -> bool:
    """Whether device chunks go to UCX as they are (:data:`UCX_CUDA_ENV` is ``1``)."""
    return os.environ.get(UCX_CUDA_ENV, "") == "1"


def default_ucx_tls() -> str:
    """The UCX transports used where ``UCX_TLS`` is not set: ``UCX_DEFAULTS``'s, plus ``cuda_copy``
    with :data:`UCX_CUDA_ENV`."""
    return _with_cuda_copy(UCX_DEFAULTS["UCX_TLS"]) if ucx_cuda() else UCX_DEFAULTS["UCX_TLS"]


def _with_cuda_copy(tls: str) -> str:
    """``tls`` listing ``cuda_copy`` (kept as it is where it already does, or where it is ``all``
    or an exclusion list, ``^...``)."""
    names = [t.strip() for t in tls.split(",") if t.strip()]
    if not names or names[0].startswith("^") or {"all", "cuda", "cuda_copy"} & set(names):
        return tls
    return ",".join([*names, "cuda_copy"])


def apply_ucx_defaults() -> None:
    """Set the measured UCX defaults in the environment unless the user set them already. With
    :data:`UCX_CUDA_ENV`, ``UCX_TLS`` lists ``cuda_copy`` even where it was set (a process started
    by a node inherits the node's ``UCX_TLS=tcp``): ucxx refuses device buffers without it."""
    os.environ.setdefault("UCX_TLS", default_ucx_tls())
    if ucx_cuda():
        os.environ["UCX_TLS"] = _with_cuda_copy(os.environ["UCX_TLS"])
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)


def interface_of(host: str) -> str:
    """The name of the local network interface that holds the address ``host`` ("lo" for a
    loopback address, "" when no interface holds it or it is a wildcard or a name).

    IPv4 addresses are read with the ``SIOCGIFADDR`` ioctl (an interface's primary address),
    IPv6 ones from ``/proc/net/if_inet6``; on systems without either it returns "".
    """
    if host in WILDCARD_HOSTS or not host:
        return ""
    if is_loopback(host):
        return _loopback_interface()
    try:
        packed = socket.inet_pton(socket.AF_INET, host)
    except OSError:
        packed = b""
    if packed:
        return _ipv4_interface(packed)
    try:
        wanted = socket.inet_pton(socket.AF_INET6, host).hex()
    except OSError:
        return ""  # a name, not an address
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                cols = line.split()
                if len(cols) >= 6 and cols[0] == wanted:
                    return cols[5]
    except OSError:
        pass
    return ""


def _interfaces() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def _loopback_interface() -> str:
    names = _interfaces()
    return "lo" if "lo" in names or not names else _ipv4_interface(socket.inet_aton("127.0.0.1"))


def _ipv4_interface(packed: bytes) -> str:
    try:
        import fcntl
        import struct
    except ImportError:  # pragma: no cover - not a POSIX system
        return ""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in _interfaces():
            try:
                reply = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # down, or no IPv4 address
            if reply[20:24] == packed:
                return name
    return ""
