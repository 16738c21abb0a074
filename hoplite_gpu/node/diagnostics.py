"""What a node and its directory hold, for diagnostics, tests and leak checks: the directory's
event log and summary, the local store's figures. They are :class:`~hoplite_gpu.node.Node` methods."""

from __future__ import annotations

import os
from typing import Any

from ..dataplane.base import DataPlane
from ..iothread import IOThread
from ..memory import LocalStore, Memory
from .session import DirectorySession
from .vertex import VertexRunner


class Diagnostics:
    """The diagnostic methods of :class:`~hoplite_gpu.node.Node` (a part of it)."""

    node_id: str
    _io: IOThread
    _session: DirectorySession
    _store: LocalStore
    _memory: Memory
    _data: DataPlane
    _vertices: VertexRunner

    def _check_open(self) -> None:  # (the node's)
        raise NotImplementedError

    def event_log(self, since: int = 0) -> list[dict[str, Any]]:
        """The directory's event log from sequence number ``since`` (diagnostics, tests); fetched
        in pages of :data:`~hoplite_gpu.protocol.EVENT_LOG_PAGE` events."""
        self._check_open()
        return self._io.run(self._session.event_log(since))

    def directory_summary(self) -> dict[str, Any]:
        """What the directory holds now, in brief (diagnostics, leak checks): its live ``nodes``;
        its ``objects`` (each with ``object_id``, ``owner``, ``size``, the live ``holders`` of a complete
        copy and those still ``receiving`` one, and whether it is ``inline``); the objects with
        ``lookups`` waiting; the ``transfers`` under way; the unfinished ``reductions``; the
        counts of open ``barriers`` and ``watched_groups``. Lists stop at
        :data:`~hoplite_gpu.protocol.SUMMARY_PAGE` entries; ``objects_total``, ``lookups_total``,
        ``transfers_total`` and ``reductions_total`` count all. Raises
        :class:`~hoplite_gpu.errors.DirectoryUnavailableError` as other requests do."""
        self._check_open()
        return self._io.run(self._session.summary())

    def stats(self) -> dict[str, Any]:
        """Local store figures: objects, bytes used, capacity, data-plane auth failures, the
        unreceived messages the data plane dropped (``stale_*``: see ``UcxDataPlane._sweep_unexpected``),
        the device bytes it sent and received staged through host buffers (``staged_*``; none
        with ``HOPLITE_UCX_CUDA=1``, where UCX moves device memory itself), the connections (UCX:
        endpoints) the data plane opened for this node's pulls (``data_connections_opened``; idle
        ones are kept per peer and reused, so this grows with new peers, not with pulls), the process's
        pool of device allocations (``device_pool_*``: bytes held, allocations handed out again)
        and its reads of same-host processes' device memory (``device_ipc_*``: mappings opened,
        reads from a mapping kept open, gets that found the memory through an index link with no
        lookup, mappings kept now; see :mod:`hoplite_gpu.memory.ipc`), and how many reduce
        vertices here wrote their output over a consumable input (``outputs_over_inputs``)."""
        return {
            "node_id": self.node_id,
            "objects": len(self._store),
            "used_bytes": self._store.used_bytes,
            "capacity_bytes": self._store.capacity_bytes,
            "data_auth_failures": self._data.auth_failures,
            "stale_messages_dropped": self._data.stale_messages,
            "stale_bytes_dropped": self._data.stale_bytes,
            "staged_bytes_sent": self._data.staged_sent,
            "staged_bytes_received": self._data.staged_received,
            "data_connections_opened": self._data.connections_opened,
            "outputs_over_inputs": self._vertices.taken_over,
            **self._memory.stats(),
            "pid": os.getpid(),
        }
