"""What a node asks of its data plane, whichever it runs: the :class:`DataPlane` protocol.

Both planes implement it (:class:`~hoplite_gpu.dataplane.tcp.TcpDataPlane` and
:class:`~hoplite_gpu.dataplane.ucx.plane.UcxDataPlane`); the node, its diagnostics and its gets
name only it. ``tests/test_dataplane_contract.py`` runs one suite of tests against each plane.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..memory import LocalObject

#: Called as each chunk of a pull lands, with its byte range ``(start, end)``, before the
#: object's progress covers it: work on the bytes while they are in cache (a ring's reduction).
#: It runs on the thread that received them (the TCP plane's worker, the UCX plane's loop), so it
#: must not touch the loop's objects; what it raises fails the pull. A pull given one advances the
#: progress on that thread too (``LocalObject.advance_from_thread``): the loop then wakes only for
#: coroutines that wait for the bytes, and reads a progress that moves between its steps.
ChunkCallback = Callable[[int, int], None]


@runtime_checkable
class DataPlane(Protocol):
    """One node's data plane: a listener that serves pulls of the objects of the node's local store
    (complete or still filling) to authenticated peers, and the pulls this node makes from theirs.

    A plane is built with the node's store, the cluster's token, the node's ``Config`` and a
    callback after each served transfer (:data:`~hoplite_gpu.dataplane.shared.ServeCallback`);
    :func:`~hoplite_gpu.dataplane.selection.make_data_plane` builds the one ``Config.data_plane``
    chooses. ``isinstance(plane, DataPlane)`` checks that the members are there (not their types).
    """

    #: The port the listener took (0 before :meth:`start`): the node advertises it to the directory.
    port: int
    #: Peers dropped before they authenticated: the node reports it (``data_auth_failures``).
    auth_failures: int
    #: Unreceived messages dropped after waiting a whole sweep (UCX only; 0 on TCP): reported.
    stale_messages: int
    #: Bytes of those messages: reported with them.
    stale_bytes: int
    #: Device bytes this node sent through host staging buffers: reported, to see the staging cost.
    staged_sent: int
    #: Device bytes it received through them: reported with them.
    staged_received: int
    #: Connections (UCX: endpoints) it opened to peers for its pulls: reported, to see how many
    #: pulls found none idle (each new one costs a handshake).
    connections_opened: int

    async def start(self, host: str = "") -> int:
        """Listen on ``host`` ("" for every interface) on a free port and return it; the node
        starts its plane before it registers, so peers can pull as soon as it is known."""
        ...

    async def close(self, grace: float = 0.0) -> None:
        """Stop listening and close every connection and task; transfers being served get up to
        ``grace`` seconds to finish, so an orderly shutdown does not cut receivers off. Calling it
        again does nothing more."""
        ...

    async def pull(
        self,
        host: str,
        port: int,
        obj: LocalObject,
        transfer_id: int,
        abort: asyncio.Future[None] | None = None,
        on_chunk: ChunkCallback | None = None,
        chunk_bytes: int = 0,
    ) -> None:
        """Stream ``obj`` from the peer at ``host:port`` into ``obj.buffer``, from ``obj.progress``
        on, advancing the progress as bytes land (readers of a partial copy go on meanwhile); the
        peer may itself still be filling it. The get's way to copy an object from another node.
        ``on_chunk`` (a :data:`ChunkCallback`) sees each chunk land before the progress covers it.
        ``chunk_bytes`` asks for chunks of that size (within the plane's bounds) instead of the
        plane's choice from the link's measured rate (``Config.adaptive_chunks``).

        Raises:
            ObjectNotFoundError: the peer does not hold the object.
            AuthenticationError: the peer does not know this node's token, or refuses it.
            TransportError: the peer cannot be reached, dies or stalls past ``stall_timeout``
                (:class:`~hoplite_gpu.errors.PeerLostError` once connected); the bytes landed stay
                valid and a later pull resumes after them. ``obj`` failing, or ``abort`` failing,
                stops the pull with that error.
        """
        ...


__all__ = ["ChunkCallback", "DataPlane"]
