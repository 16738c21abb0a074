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

#: The values of ``Config.data_plane``.
DATA_PLANES = ("auto", "tcp", "ucx")
#: The values of ``Config.allreduce_schedule``.
ALLREDUCE_SCHEDULES = ("auto", "ring", "star", "direct")


@dataclass(frozen=True, slots=True)
class Config:
    """Tunables for a node (and the embedded directory).

    docs/configuration.md is generated from the list below (``make docs``), one entry per field.

    Attributes:
        chunk_bytes: Chunk size of the first transfer from a peer, before its throughput is known;
            small, as a relay forwards a chunk only once it holds all of it
            (bench/pages/defaults.md#chunk-sizes).
        adaptive_chunks: Size later chunks from the throughput measured from each peer, about
            ``chunk_seconds`` of data each: large on fast links, small on slow ones; off: ``chunk_bytes``.
        chunk_seconds: Target transfer time of one adaptive chunk: long enough to amortise a chunk's
            fixed cost, short enough for chains over slow links to pipeline
            (bench/pages/defaults.md#chunk-sizes).
        min_chunk_bytes: Smallest adaptive chunk.
        max_chunk_bytes: Largest adaptive chunk.
        chunks_in_flight: Chunks a receiver posts ahead of the data (and a sender keeps in flight);
            more gave nothing measurable (bench/pages/defaults.md#chunk-sizes).
        inline_threshold_bytes: Objects up to this size live inline in the directory and come with
            the lookup.
        max_object_bytes: Largest object ``put`` accepts.
        store_capacity_bytes: Total bytes a node's local store may hold.
        buffer_pool_bytes: Bytes of removed objects' buffers kept for new objects of the same size
            (fewer page faults: bench/pages/defaults.md#same-host-shared-memory); not counted in the
            capacity; 0 disables.
        device_pool_bytes: Bytes of dropped device allocations a process keeps for new device copies
            of the same size and device (no ``cudaMalloc`` per put, no device-wide ``cudaFree`` per
            delete); the largest of the process's open nodes counts; not in the capacity; 0 disables.
        shared_memory: Keep objects above ``inline_threshold_bytes`` in ``/dev/shm`` segments that
            same-host nodes copy from directly (bench/pages/defaults.md#same-host-shared-memory); off: every
            transfer goes through UCX, as network-namespace benchmarks need.
        host_tag: Set apart this node's host: nodes that see one ``/dev/shm`` but carry different
            tags treat each other as on different hosts (each keeps its shared memory to itself,
            and they never map each other's segments), as network namespaces that emulate hosts
            need (``bench/netbench.py --shared-memory``); "" (the default): nodes are on one host
            exactly when they share ``/dev/shm``. Up to 64 printable characters, no spaces.
        same_host_index: With ``shared_memory``, link each device object under a name derived from
            its ObjectID, so a same-host ``get`` skips the directory
            (bench/pages/gpu.md#same-host-device-gets-without-a-lookup); off: every ``get`` asks it.
        caller_channels: A blocking ``put`` or ``get`` of an object stored inline in the directory,
            a blocking ``delete`` of one, and a group's barrier are sent by the caller's thread on
            a connection of its own (one per thread), not through the node's I/O thread: two
            thread hops fewer (bench/pages/small-operations.md#caller-channels); off: every request
            goes through the node's connection.
        local_channels: A caller channel to a directory on this host (in this network namespace)
            that serves without TLS goes over the directory's abstract Unix socket, not TCP
            loopback (bench/pages/small-operations.md#local-channels); off: always TCP.
        max_control_message_bytes: Largest control message accepted (a larger one closes the
            connection); 0: ``inline_threshold_bytes`` + 1 MiB.
        connect_timeout: Seconds to connect and authenticate to the directory or a peer.
        request_timeout: Seconds to wait for a directory reply to a non-blocking request.
        stall_timeout: Seconds a transfer may make no progress before it is treated as failed.
        default_get_timeout: Timeout of ``get`` called with ``timeout=None``; 0 waits forever.
        send_rate_limit: Bytes per second a node serves at most (0: unlimited), for traffic shaping
            and for tests that need a slow sender.
        listen_host: Interface the embedded directory binds to and the address a node advertises,
            which also limits the node's UCX to that interface; empty: 127.0.0.1 for the directory,
            the interface that routes to the directory for the node (docs/across-hosts.md#addresses).
        advertise_host: Address peers use to reach this node's data plane, overriding the above:
            behind NAT, or where peers reach this host on another network.
        verify_digest: Check a received object's digest against the one recorded at ``put``.
        close_grace: Seconds ``Node.close`` lets transfers it is serving finish.
        reduce_chunk_bytes: Bytes a reduce vertex reduces and forwards at a time (with its output in
            device memory, the least it reduces at a time).
        device_reduce_chunk_bytes: Most bytes a vertex with its output in device memory reduces in one
            step, taking in what its inputs hold: fewer, longer steps cost fewer launches and waits.
        reduce_threads: Threads a reduce vertex splits a run of host chunks among once every input
            holds several chunks past it (the root of a one-host star, after the last put); 0: the
            cores this process may use, at most 4; 1: one chunk at a time on the node's event loop.
        heartbeat_interval: Seconds between a node's heartbeats to the directory.
        lease_timeout: Seconds the directory waits without any message from a node before it declares
            it dead and repairs its schedules (a node whose connection closes is dead at once).
        reconnect_timeout: Seconds a node keeps trying, with backoff, to reach a lost directory again
            (one restarting at the same address); requests wait meanwhile; 0: give up at once.
        fault_injection: Faults to inject, for tests and benchmarks (:mod:`hoplite_gpu.faults`);
            empty: none.
        validate_directory: A directory started with this config checks its invariants after each
            event and logs what broke as ``invariant_violated`` (the tests turn it on; it costs a
            pass over the state per event).
        directory_violation_log: With ``validate_directory``, a directory also appends one line
            per broken invariant to this file, so that a harness (the tests, a soak) sees those
            of directories in other processes; empty: none.
        directory_unread_bytes: A directory drops a node whose unread replies pile up beyond this
            (a stuck or hostile reader would grow its memory); the node is repaired as a dead one.
        directory_max_handshakes: A directory closes new connections at once while this many have not
            finished authenticating, TLS included (10 s each from the accept), so they cannot use up
            its descriptors or memory; at most half the files the process may open.
        directory_max_handshakes_per_address: The same bound per peer address, so one address cannot
            take every slot of ``directory_max_handshakes``.
        directory_max_pending_lookups: Quota of lookups one node may have waiting (gets of objects
            not there yet); beyond it a get fails with ``QuotaExceededError``.
        directory_max_reductions: Quota of reductions one node may have requested and not seen
            finish; beyond it a reduce fails with ``QuotaExceededError``.
        directory_max_reduce_inputs: Quota of inputs of one node's reductions the directory holds,
            finished ones it still remembers included (each weight and each number of an encoding
            row counts as one more; about 400 bytes each): its oldest finished ones are forgotten to
            make room, and beyond it a reduce fails with ``QuotaExceededError``.
        directory_max_inline_bytes: Quota of bytes of one node's small objects the directory keeps
            inline; beyond it a small ``put`` fails with ``QuotaExceededError`` until it deletes some.
        directory_event_log_bytes: Bound of the directory's event log in estimated bytes, beside its
            bound of 100,000 events; the oldest go first.
        directory_place_slice: Present inputs a reduction places per directory event, with other
            nodes' requests served in between (bench/pages/defaults.md#reductions-placed-in-slices).
        tls_cert_file: PEM certificate chain a directory serves its control connections with, over
            TLS (with ``tls_key_file``); "": plain TCP (SECURITY.md).
        tls_key_file: PEM private key of ``tls_cert_file`` ("" if the chain file holds it).
        tls_ca_file: PEM certificates a node trusts for its directory's certificate; set, the node
            connects over TLS and checks the directory's host name or address against it.
        data_plane: How bytes cross between nodes: ``tcp`` (sockets; the kernel moves each chunk
            into place), ``ucx`` (UCX, for RDMA and CUDA transports), ``auto``: ``ucx`` where UCX
            lists RDMA transports or with ``HOPLITE_UCX_CUDA=1``, else ``tcp``
            (bench/pages/collectives.md#the-tcp-data-plane); every node of a cluster must choose the same.
        tcp_congestion: The congestion control of the TCP data plane's connections
            (``TCP_CONGESTION``; a transfer is paced by its sender's): ``cubic`` by default. BBR,
            where a host sets it, starts each transfer on a kept connection at the bandwidth it
            measured the round before, when other transfers shared the link: reduce and
            allreduce of 64 MiB at 1 GB/s took 6-10% longer with it, 16 MiB within the noise
            (bench/pages/collectives.md#tcp-congestion-control).
            "": the host's. One the kernel refuses (not loaded, or not allowed to this user)
            leaves the host's.
        allreduce_schedule: How a group's allreduce of a large array moves its shards
            (:func:`hoplite_gpu.collective.allreduce`): ``direct`` (member to member over the
            data plane, each pulling the running sums from the one before it, with no message
            to the directory per round: :mod:`hoplite_gpu.collective.ring`; on the TCP data
            plane, on the caller's thread over connections kept along the ring:
            :mod:`hoplite_gpu.collective.wire`), ``ring`` (each
            shard an ordinary reduction along the ring of members, placed by the directory, its
            result read along it), ``star`` (each shard reduced at its member from every other at
            once, the results read straight from it), ``auto``: ``direct`` when no two members
            share a host's memory and all run the TCP data plane; through shared memory when all
            members share one host's memory, at any size, signalled member to member over Unix
            sockets with no message to the directory per round (:mod:`hoplite_gpu.collective.host`;
            device arrays take ``ring``: CUDA IPC;
            bench/pages/collectives.md#one-host-allreduce-through-shared-memory); else ``ring``
            (whose reductions the directory turns into one host's shared memory; UCX's RDMA and
            device transports are not measured with the direct ring yet;
            bench/pages/collectives.md#the-direct-ring).
            ``ring`` and ``star`` may be mixed, each shard's schedule its own member's; a group
            takes ``direct`` only where no member asks for one of those. A large
            :func:`~hoplite_gpu.collective.reduce` goes through shared memory where all members
            share one host's memory under ``auto`` (as the allreduce, at any size); else it passes along a
            chain of the members to its root under ``direct``, and under ``auto`` wherever all
            members run the TCP data plane, members that share a host's memory too (device
            arrays; over loopback it took 0.45-0.75x the time of the directory's shared-memory
            tree with 2-4 members of one host, within 5% with 6-8 on 2 cores:
            bench/pages/collectives.md#the-chain-on-one-host); under ``ring`` or ``star`` it
            goes through the directory's tree.
        allreduce_shard_bytes: A group's allreduce of at least this many bytes (C-contiguous)
            goes in shards, one per member; a smaller one as one reduce read as it is computed,
            whose time is latency (1-4 MiB: 1.2-1.9x faster that way on 4 hosts at 100 MB/s and
            1 GB/s; bench/pages/collectives.md#ring-allreduce). Every member of a group must use the same.
        allreduce_direct_bytes: A group's allreduce of at least this many bytes (C-contiguous)
            takes the direct ring where the members' schedules agree on it (see
            ``allreduce_schedule``), smaller ones the paths above; 0 (the default): every
            allreduce of more than ``inline_threshold_bytes``, whose objects the directory would
            not keep inline. From 1 MiB the direct ring was 1.2-1.5x faster than one reduce on
            4 hosts at 100 MB/s, and as fast at 1 GB/s (bench/pages/collectives.md#the-direct-ring);
            at 128-512 KiB 1.1-4.1x faster, at 16 KiB slower, and at 64 KiB either
            (bench/pages/collectives.md#small-arrays-take-the-direct-paths-too). So does a group's
            reduce of at least this many bytes, by the direct chain
            (bench/pages/collectives.md#the-direct-chain-reduce). Every member of a group must use
            the same.
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
    host_tag: str = ""
    same_host_index: bool = True
    caller_channels: bool = True
    local_channels: bool = True
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
    reduce_threads: int = 0
    heartbeat_interval: float = 1.0
    lease_timeout: float = 5.0
    reconnect_timeout: float = 30.0
    fault_injection: str = ""
    validate_directory: bool = False
    directory_violation_log: str = ""
    directory_unread_bytes: int = 64 * MiB
    directory_max_handshakes: int = 256
    directory_max_handshakes_per_address: int = 64
    directory_max_pending_lookups: int = 100_000
    directory_max_reductions: int = 10_000
    directory_max_reduce_inputs: int = 262_144
    directory_max_inline_bytes: int = 256 * MiB
    directory_event_log_bytes: int = 64 * MiB
    directory_place_slice: int = 256
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    data_plane: str = "auto"
    tcp_congestion: str = "cubic"
    allreduce_schedule: str = "auto"
    allreduce_shard_bytes: int = 8 * MiB
    allreduce_direct_bytes: int = 0  # 0: inline_threshold_bytes + 1

    def __post_init__(self) -> None:
        positive = (
            "directory_unread_bytes",
            "directory_max_handshakes",
            "directory_max_handshakes_per_address",
            "directory_max_pending_lookups",
            "directory_max_reductions",
            "directory_max_reduce_inputs",
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
            "allreduce_shard_bytes",
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
        if self.data_plane not in DATA_PLANES:
            raise InvalidArgumentError(
                f"Config.data_plane must be one of {', '.join(DATA_PLANES)}, not {self.data_plane!r}",
                argument="data_plane",
            )
        cc = self.tcp_congestion
        if not (_word(cc, 15) and cc.isascii()):
            raise InvalidArgumentError(
                f"Config.tcp_congestion must be a congestion control's name (up to 15 characters) or "
                f'"", not {cc!r}',
                argument="tcp_congestion",
            )
        if self.allreduce_schedule not in ALLREDUCE_SCHEDULES:
            raise InvalidArgumentError(
                f"Config.allreduce_schedule must be one of {', '.join(ALLREDUCE_SCHEDULES)}, "
                f"not {self.allreduce_schedule!r}",
                argument="allreduce_schedule",
            )
        if not _word(self.host_tag, 64):
            raise InvalidArgumentError(
                "Config.host_tag must be up to 64 printable characters without spaces", argument="host_tag"
            )
        if self.min_chunk_bytes > self.max_chunk_bytes:
            raise InvalidArgumentError(
                "Config.min_chunk_bytes must be <= max_chunk_bytes", argument="min_chunk_bytes"
            )
        for name in (
            "inline_threshold_bytes",
            "allreduce_direct_bytes",
            "send_rate_limit",
            "buffer_pool_bytes",
            "device_pool_bytes",
            "reconnect_timeout",
            "reduce_threads",
        ):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"Config.{name} must be >= 0", argument=name)

    @property
    def control_message_limit(self) -> int:
        """Largest control message accepted, in bytes."""
        if self.max_control_message_bytes:
            return self.max_control_message_bytes
        return self.inline_threshold_bytes + 1 * MiB

    @property
    def direct_min_bytes(self) -> int:
        """The fewest bytes a group's allreduce or reduce takes a direct path with (see
        ``allreduce_direct_bytes``)."""
        return self.allreduce_direct_bytes or self.inline_threshold_bytes + 1

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


def _word(value: Any, most: int) -> bool:
    """Whether ``value`` is a string of up to ``most`` printable characters without spaces."""
    return isinstance(value, str) and len(value) <= most and value.isprintable() and " " not in value


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


def check_port(port: Any, argument: str = "port", any_free: bool = True) -> int:
    """``port`` as an int, checked: 1..65535, or 0 (any free port) where ``any_free``.

    Raises:
        InvalidArgumentError: not an int in that range (a socket would raise a bare
            ``OverflowError`` for 99999).
    """
    low = 0 if any_free else 1
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
        raise InvalidArgumentError(
            f"{argument} must be an int in {low}..65535, got {port!r}", argument=argument
        )
    return port


def host_of(address: str) -> str:
    """The host part of a ``host:port`` address (brackets of an IPv6 literal removed)."""
    return address.rsplit(":", 1)[0].strip("[]")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost``."""
    return host == "localhost" or host.startswith("127.") or host == "::1"
