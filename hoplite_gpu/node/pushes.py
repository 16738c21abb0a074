"""What the directory tells a node unasked: the messages it pushes (reduce tasks, dropped copies,
aborted transfers, how many nodes share its host), the loss of its connection, and the node's
rejoining a restarted directory. They are :class:`~hoplite_gpu.node.Node` methods."""

from __future__ import annotations

from collections.abc import Callable

from .. import protocol as p
from ..errors import HopliteError, ObjectDeletedError, ObjectLostError, ObjectReset, PeerLostError, from_kind
from ..memory import LocalStore, Memory
from ..object_id import ObjectID
from .channel import Channels
from .fetch import Fetcher
from .session import DirectorySession
from .vertex import VertexRunner


class DirectoryPushes:
    """The handlers of what the directory pushes, of :class:`~hoplite_gpu.node.Node` (a part of it)."""

    _token: str
    _indexes: bool
    _memory: Memory
    _store: LocalStore
    _session: DirectorySession
    _fetcher: Fetcher
    _vertices: VertexRunner
    _channels: Channels
    _rejoin_callbacks: set[Callable[[], None]]

    def _on_served(self, transfer_id: int, sent: int, while_incomplete: int, failed: bool) -> None:
        if not transfer_id:  # a pull the directory did not arrange (hoplite_gpu.collective.ring)
            return
        self._session.send(p.ServeDone(transfer_id, sent, while_incomplete, failed))

    def _on_push(self, msg: p.Message) -> None:
        if isinstance(msg, p.ReduceTask):
            self._vertices.start(msg)
        elif isinstance(msg, p.ReduceChild):
            self._vertices.set_child(msg)
        elif isinstance(msg, p.ReduceWeights):
            self._vertices.set_weights(msg)
        elif isinstance(msg, p.DropObject):
            self._drop(ObjectID(msg.object_id), msg.reason, msg.error_kind, msg.error)
        elif isinstance(msg, p.AbortTransfer):
            self._fetcher.abort(msg.transfer_id, PeerLostError(msg.reason, peer="", cause="sender died"))
        elif isinstance(msg, p.HostPeers):
            self._memory.host_peers = msg.peers

    def _drop(self, oid: ObjectID, reason: str, kind: str = "", message: str = "") -> None:
        """The directory dropped this node's copy of ``oid`` (see :class:`protocol.DropObject`)."""
        self._vertices.cancel(oid)  # the reduction failed, was deleted, or its tree is rebuilt
        local = self._store.get(oid)
        error: HopliteError
        if reason == "reset":
            if local is not None and local.complete:
                # Finished before the failure (a get may have returned it): exact for the inputs
                # it reduced. Kept; its report, sent before this reset came, has the directory
                # adopt the tree that computed it (directory/repair.py), or tell it to drop it.
                return
            error = ObjectReset(f"partial copy of {oid} was reset", object_id=oid.hex())
        elif reason == "failed":
            error = from_kind(kind, message, reduction_id=oid.hex())
        elif reason == "lost":
            error = ObjectLostError(
                f"object {oid} was lost: every complete copy died while it was being received; put it again",
                object_id=oid.hex(),
            )
        else:
            error = ObjectDeletedError(f"object {oid} was deleted by its owner", object_id=oid.hex())
        self._store.remove(oid, error)

    def _on_lost(self, reconnecting: bool) -> None:
        """The directory connection was lost (see :class:`DirectorySession`)."""
        # Nobody can tell a vertex any more that its reduction failed: stop them.
        self._vertices.cancel()
        self._channels.reset()  # their threads wait on the node's connection, which reconnects
        if not reconnecting:
            return
        # A restarted directory rebuilds every unfinished reduction from scratch: copies of what
        # the old trees computed are void (pulls of ordinary objects go on meanwhile).
        for obj in self._store.objects():
            if obj.reduction and (obj.object_id.binary() != obj.reduction or not obj.complete):
                self._store.remove(
                    obj.object_id,
                    ObjectReset(
                        f"{obj.object_id} was being reduced when the directory was lost",
                        object_id=obj.object_id.hex(),
                    ),
                )

    def _index_joined(self) -> None:
        """Index device objects under the key of the directory instance joined now: a restarted
        directory (another instance id) gets new index names, and the links made under the old
        key go (see :meth:`Memory.rekey <hoplite_gpu.memory.Memory.rekey>`)."""
        if self._indexes:
            key = Memory.cluster_key(self._token, self._session.control.directory_id)
            self._memory.rekey(key, (obj.buffer for obj in self._store.objects()))

    def _on_rejoined(self) -> None:
        """Reconnected to a restarted directory: index under its key, and tell it about every
        complete copy held here: ordinary objects and finished reduction results (which the
        reductions re-sent next then need not compute again, perhaps from other inputs)."""
        self._index_joined()
        for callback in list(self._rejoin_callbacks):
            callback()
        for obj in self._store.objects():
            if obj.complete and obj.reduction in (b"", obj.object_id.binary()):
                self._fetcher.restore(obj)
