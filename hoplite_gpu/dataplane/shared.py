"""What both data planes share: the throughput measured per peer and the chunk size it asks for
(``Config.adaptive_chunks``), the bounds of a pull request, and a refused pull as a typed error."""

from __future__ import annotations

from .. import protocol as p
from ..config import Config
from ..errors import HopliteError, ObjectNotFoundError, PeerLostError
from ..memory import LocalObject

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


def refusal(status: int, size: int, obj: LocalObject, address: str) -> HopliteError | None:
    """The error a pull response's ``status`` and ``size`` mean for ``obj`` (None: go on)."""
    if status == p.PULL_NOT_FOUND:
        return ObjectNotFoundError(
            f"peer {address} does not hold object {obj.object_id}",
            peer=address,
            object_id=obj.object_id.hex(),
        )
    if status != p.PULL_OK or size != obj.size:
        return PeerLostError(
            f"peer {address} refused the pull of {obj.object_id} (status {status})",
            peer=address,
            cause=f"status {status}",
        )
    return None


__all__ = ["MAX_WIRE_CHUNK", "MIN_WIRE_CHUNK", "RATE_SAMPLE_MIN_BYTES", "LinkRates", "refusal"]
