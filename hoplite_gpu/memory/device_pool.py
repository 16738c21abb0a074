"""The process's pool of exported device allocations (:class:`DevicePool`), reused by new device
copies of the same size on the same device: a training loop that puts same-sized gradients every
step allocates once, rather than paying ``cudaMalloc`` at every put and ``cudaFree`` (which waits
for the whole device) at every delete, and its readers see the same allocation again."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import shm
from .backend import DeviceBackend


@dataclass(slots=True)
class Spare:
    """An allocation :class:`DevicePool` holds: its memory (a flat ``uint8`` array of its
    backend), its pin (see :mod:`hoplite_gpu.memory.ipc`), and the payload of the retired ticket that
    named it last (its next object's ticket, written for this allocation already)."""

    backend: DeviceBackend
    device: int
    array: Any
    pin: shm.Segment | None
    record: np.ndarray[Any, Any] | None = None


class DevicePool:
    """Recycles the exported device allocations of dropped objects for new device copies of the
    same size on the same device (puts, received copies, reduce outputs).

    An allocation is handed out again only once nothing refers to it any more
    (:meth:`DeviceBackend.references <hoplite_gpu.memory.backend.DeviceBackend.references>` against the
    count of an allocation only the pool holds, measured once per backend): a transfer still
    sending from it or a vertex still reading it keeps it out of use. Beyond ``max_bytes`` the
    oldest are freed. Process-wide like the tickets: every node of a process shares it, sized by
    the largest ``Config.device_pool_bytes`` of the nodes open (:meth:`attach`; 0 without any).
    Thread-safe.
    """

    def __init__(self, discard: Callable[[Spare], None]) -> None:
        self._discard = discard  # frees an allocation the pool does not keep (see ProcessIpc.discard)
        self.held_bytes = 0
        self.reused = 0
        self._sizes: dict[str, int] = {}
        self._spares: list[Spare] = []
        self._unreferenced: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    @property
    def users(self) -> int:
        """How many nodes are attached."""
        return len(self._sizes)

    @property
    def max_bytes(self) -> int:
        """Bytes the pool keeps at most."""
        return max(self._sizes.values(), default=0)

    def attach(self, user: str, max_bytes: int) -> None:
        """A node opened: ``user`` (its ID) wants up to ``max_bytes`` kept."""
        with self._lock:
            self._sizes[user] = max_bytes

    def detach(self, user: str) -> None:
        """A node closed: what it asked for no longer counts (spares beyond the rest are freed)."""
        with self._lock:
            self._sizes.pop(user, None)
            self._trim()

    def __len__(self) -> int:
        return len(self._spares)

    def take(self, backend: DeviceBackend, nbytes: int, dev: int) -> Spare | None:
        """An unreferenced allocation of exactly ``nbytes`` on ``dev`` of ``backend``, or None."""
        with self._lock:
            if not self._spares:
                return None
            unreferenced = self._baseline(backend, dev)
            for i, spare in enumerate(self._spares):
                if (
                    spare.backend is backend
                    and spare.device == dev
                    and spare.array.nbytes == nbytes
                    and _not_above(backend.references(spare.array), unreferenced)
                ):
                    del self._spares[i]
                    self.held_bytes -= nbytes
                    self.reused += 1
                    return spare
        return None

    def give(
        self,
        backend: DeviceBackend,
        array: Any,
        pin: shm.Segment | None = None,
        record: np.ndarray[Any, Any] | None = None,
    ) -> None:
        """Offer an allocation no object uses any more (it may still be referenced elsewhere),
        with its pin and its last ticket's payload (retired)."""
        nbytes = int(array.nbytes)
        if not 0 < nbytes <= self.max_bytes:
            self._discard(Spare(backend, 0, array, pin, record))
            return
        with self._lock:
            self._spares.append(Spare(backend, backend.device_of(array), array, pin, record))
            self.held_bytes += nbytes
            self._trim()

    def clear(self) -> None:
        """Free every held allocation (once readers that keep one open have closed it)."""
        with self._lock:
            for spare in self._spares:
                self._discard(spare)
            self._spares.clear()
            self.held_bytes = 0

    def _trim(self) -> None:
        limit = self.max_bytes
        while self.held_bytes > limit:
            spare = self._spares.pop(0)
            self.held_bytes -= int(spare.array.nbytes)
            self._discard(spare)

    def _baseline(self, backend: DeviceBackend, dev: int) -> tuple[int, ...]:
        """What :meth:`DeviceBackend.references` says of an allocation only a pool entry holds,
        seen from :meth:`take`'s loop (measured on a one-byte allocation of the backend's own)."""
        known = self._unreferenced.get(backend.name)
        if known is None:
            probe = [Spare(backend, dev, backend.empty_shared(1, dev), None)]
            for spare in probe:  # the same shape as take's loop
                known = self._unreferenced[backend.name] = backend.references(spare.array)
            assert known is not None
        return known


def _not_above(counts: tuple[int, ...], limits: tuple[int, ...]) -> bool:
    return len(counts) == len(limits) and all(c <= limit for c, limit in zip(counts, limits, strict=True))
