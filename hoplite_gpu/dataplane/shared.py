"""What both data planes share: their common state (:class:`PlaneBase`), the throughput measured
per peer and the chunk size it asks for (``Config.adaptive_chunks``), the bounds of a pull request,
and the typed errors of a refused pull and of a peer that cannot be reached."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from .. import protocol as p
from ..config import Config
from ..errors import HopliteError, ObjectNotFoundError, PeerLostError, TransportError
from ..memory import LocalObject, LocalStore

#: Bounds of the chunk size a receiver may ask for (checked by the sender).
MIN_WIRE_CHUNK = 64 * 1024
MAX_WIRE_CHUNK = 256 * 1024 * 1024
#: Transfers smaller than this do not update a peer's measured throughput: they measure latency.
RATE_SAMPLE_MIN_BYTES = 2 * 1024 * 1024


class LinkRates:
    """Measured pull throughput by peer address, bytes/s (an even mix of the last sample and the
    estimate before it)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._rates: dict[str, float] = {}

    def chunk_size(self, address: str) -> int:
        """Chunk size for the next pull from ``address``: ``Config.chunk_bytes`` until a rate is
        known, then about ``chunk_seconds`` of data within the configured bounds."""
        cfg = self.config
        rate = self._rates.get(address)
        if not cfg.adaptive_chunks or rate is None:
            return max(MIN_WIRE_CHUNK, min(cfg.chunk_bytes, MAX_WIRE_CHUNK))
        want = int(rate * cfg.chunk_seconds)
        want = max(cfg.min_chunk_bytes, min(want, cfg.max_chunk_bytes))
        want -= want % MIN_WIRE_CHUNK
        return max(MIN_WIRE_CHUNK, min(want, MAX_WIRE_CHUNK))

    def record(self, address: str, nbytes: int, seconds: float) -> None:
        """A pull of ``nbytes`` from ``address`` took ``seconds``."""
        if nbytes < RATE_SAMPLE_MIN_BYTES or seconds <= 0:
            return
        sample = nbytes / seconds
        old = self._rates.get(address)
        self._rates[address] = sample if old is None else 0.5 * old + 0.5 * sample


#: Called after each served transfer: (transfer_id, bytes_sent, bytes_sent_while_incomplete, failed).
ServeCallback = Callable[[int, int, int, bool], None]


class PlaneBase:
    """The state both data planes keep: what they serve and how, the counters a node reports,
    the measured link rates, and the tasks they run.

    Args:
        store: The node's local store, read when serving.
        token: Shared secret for peer authentication.
        config: Chunk size, timeouts, rate limit.
        on_served: Callback after each served transfer.
    """

    def __init__(
        self, store: LocalStore, token: str, config: Config, on_served: ServeCallback | None = None
    ) -> None:
        self.store = store
        self.token = token
        self.config = config
        self.on_served = on_served
        self.port = 0
        self.auth_failures = 0
        self.stale_messages = 0  # unexpected messages dropped (the UCX plane's sweep; none on TCP)
        self.stale_bytes = 0
        self.staged_sent = 0  # device bytes this node sent through host staging buffers
        self.staged_received = 0  # ... and received through them
        self.connections_opened = 0  # connections (endpoints) opened for this node's pulls
        self.rates = LinkRates(config)  # measured throughput by peer, and the chunk sizes it sets
        self._tasks: set[asyncio.Task[Any]] = set()
        self._serving: set[asyncio.Task[Any]] = set()  # transfers being served: close(grace) waits
        self._closed = False

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _spawn_served(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """Spawn a task that ``close(grace)`` lets finish: a transfer being served, or an ack."""
        task = self._spawn(coro)
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)
        return task

    def chunk_size(self, address: str, asked: int = 0) -> int:
        """Chunk size for the next pull from ``address``: ``asked`` within the wire's bounds, or
        with 0, the plane's choice (see ``Config.adaptive_chunks``)."""
        if asked:
            return max(MIN_WIRE_CHUNK, min(asked, MAX_WIRE_CHUNK))
        return self.rates.chunk_size(address)


def pull_status(obj: LocalObject | None, offset: int, chunk: int) -> int:
    """How a holder answers a pull of ``obj`` (None: not held) from ``offset`` in ``chunk``-byte
    steps: ``PULL_OK``, ``PULL_NOT_FOUND`` or ``PULL_BAD_REQUEST``."""
    if obj is None or obj.error is not None:
        return p.PULL_NOT_FOUND
    if offset > obj.size or not MIN_WIRE_CHUNK <= chunk <= MAX_WIRE_CHUNK:
        return p.PULL_BAD_REQUEST
    return p.PULL_OK


def unreachable(address: str, exc: BaseException) -> TransportError:
    """The error of a connection to data-plane peer ``address`` that failed with ``exc``."""
    return TransportError(
        f"cannot connect to data-plane peer {address}: {type(exc).__name__}: {exc} (the "
        "address is the one that node advertised: if it is not reachable from here, set "
        "HOPLITE_ADVERTISE_HOST on that node to one that is)",
        peer=address,
        cause=f"{type(exc).__name__}: {exc}",
    )


class SizeMismatch(PeerLostError):
    """A peer answered a pull with an object of the id asked for but of another size (``size``
    field): a :class:`PeerLostError` (a get goes to another source), which a pull of an
    unlisted object (:meth:`~hoplite_gpu.node.Node.pull_unlisted`) may take as final."""

    size: int


def refusal(status: int, size: int, obj: LocalObject, address: str) -> HopliteError | None:
    """The error a pull response's ``status`` and ``size`` mean for ``obj`` (None: go on)."""
    if status == p.PULL_NOT_FOUND:
        return ObjectNotFoundError(
            f"peer {address} does not hold object {obj.object_id}",
            peer=address,
            object_id=obj.object_id.hex(),
        )
    if status == p.PULL_OK and size != obj.size:
        return SizeMismatch(
            f"peer {address} holds {size} bytes of object {obj.object_id}, not {obj.size}",
            peer=address,
            cause=f"size {size}",
            size=size,
        )
    if status != p.PULL_OK:
        return PeerLostError(
            f"peer {address} refused the pull of {obj.object_id} (status {status})",
            peer=address,
            cause=f"status {status}",
        )
    return None


__all__ = [
    "MAX_WIRE_CHUNK",
    "MIN_WIRE_CHUNK",
    "RATE_SAMPLE_MIN_BYTES",
    "LinkRates",
    "PlaneBase",
    "ServeCallback",
    "SizeMismatch",
    "pull_status",
    "refusal",
    "unreachable",
]
