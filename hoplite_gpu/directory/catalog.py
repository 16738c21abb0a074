"""The objects the directory knows and where their copies are: puts, copies added, deletes, and
objects lost with their last complete copy.

An object has locations: nodes holding a *complete* copy, or a *partial* copy still filling.
Objects of at most ``inline_threshold_bytes`` are stored here and returned with the lookup. When
a dead node held the last complete copy of an object (and nobody is computing it), the object is
*lost*: partial holders drop it and waiting lookups fail with ``ObjectLostError``; a later put of
the same ObjectID (a restarted task) makes it available again. A lookup that reaches the
directory within ``lease_timeout`` of the loss fails with ``ObjectLostError`` too: it was most
likely sent while the object was there (its message raced the holder's death on another
connection); a later one is a get before the next put, and waits for it. The ids of the latest
:data:`DELETES_KEPT` deletes are kept, so that a lookup of a deleted object fails at once with
``ObjectDeletedError`` instead of waiting for a put that will not come (until the id is put again).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from .. import protocol as p
from .lookups import deleted_lookup, lost_lookup
from .records import Location, LocationState, NodeInfo, ObjectEntry, Reduction

if TYPE_CHECKING:
    from .config import DirectoryConfig
    from .lookups import Lookups
    from .membership import Membership
    from .outbox import Outbox
    from .reductions import Reductions

#: Deleted ObjectIDs the directory remembers, the latest (about 100 bytes each).
DELETES_KEPT = 65_536


class Catalog:
    """What happens to the objects (the table ``objects`` is shared: every part reads it).

    Args:
        config: The directory's settings.
        nodes: The joined nodes (read).
        objects: The objects by id (this part adds and removes them).
        reductions: The reductions by id (read: a reduction's result is no object to put).
        outbox: Where its messages and the events it records go.
        members: Charged and released for the bytes of inline objects.

    Its collaborators made after it come through :meth:`connect`.
    """

    lookups: Lookups
    reducer: Reductions

    def __init__(
        self,
        *,
        config: DirectoryConfig,
        nodes: dict[str, NodeInfo],
        objects: dict[bytes, ObjectEntry],
        reductions: dict[bytes, Reduction],
        outbox: Outbox,
        members: Membership,
    ) -> None:
        self.config = config
        self.nodes = nodes
        self.objects = objects
        self.reductions = reductions
        self.outbox = outbox
        self.members = members
        self.deleted: OrderedDict[bytes, None] = OrderedDict()  # the latest deletes, oldest first
        self.lost: OrderedDict[bytes, float] = OrderedDict()  # recent losses and when, oldest first

    def connect(self, *, lookups: Lookups, reducer: Reductions) -> None:
        """Hand it the parts it tells that an object is ready or gone: the lookups waiting for
        objects, and the reductions waiting for inputs (which may fail, or be forgotten, on a
        delete)."""
        self.lookups = lookups
        self.reducer = reducer

    # ------------------------------------------------------------ requests
    def put(self, node_id: str, msg: p.PutRequest, now: float) -> None:
        """A node put an object: register its complete copy (or keep its bytes inline)."""
        oid = msg.object_id

        def refuse(kind: str, text: str) -> None:
            self.outbox.send(node_id, p.PutReply(request_id=msg.request_id, error=text, error_kind=kind))

        if msg.size < 0 or len(oid) != 20:
            refuse("ProtocolError", "invalid put")
            return
        if msg.inline is not None and (
            len(msg.inline) != msg.size or msg.size > self.config.inline_threshold_bytes
        ):
            refuse("ProtocolError", "inline data does not match the announced size or exceeds the threshold")
            return
        if oid in self.reductions and oid not in self.objects:
            refuse(
                "ObjectExistsError", f"object {oid.hex()} is the result of a reduction; use another ObjectID"
            )
            return
        entry = self.objects.get(oid)
        if entry is not None:
            same = (
                entry.size == msg.size
                and entry.dtype == msg.dtype
                and list(entry.shape) == list(msg.shape)
                and entry.digest == msg.digest
            )
            if not same:
                self.outbox.record(now, "put_conflict", node=node_id, object_id=oid.hex())
                refuse(
                    "ObjectExistsError",
                    f"object {oid.hex()} already exists with different content "
                    f"(size {entry.size}, dtype {entry.dtype}, shape {list(entry.shape)}); "
                    "use a new ObjectID or delete the old object first",
                )
                return
            if entry.inline is None:
                self.add_complete(entry, node_id, msg.segment, copying=msg.copying)
            self.outbox.send(node_id, p.PutReply(request_id=msg.request_id))
            self.outbox.record(now, "put", node=node_id, object_id=oid.hex(), size=msg.size, again=True)
            self.ready(oid, now)
            return
        members = self.members
        if msg.inline is not None and not members.inline_fits(node_id, msg.size):
            text = (
                f"the objects this node stored inline in the directory hold {members.inline_bytes[node_id]} "
                f"bytes, and {msg.size} more pass its quota of {self.config.max_inline_bytes} "
                "(Config.directory_max_inline_bytes); delete some"
            )
            self.outbox.record(now, "quota_exceeded", node=node_id, quota="inline_bytes")
            refuse("QuotaExceededError", text)
            return
        entry = ObjectEntry(
            object_id=oid,
            size=msg.size,
            dtype=msg.dtype,
            shape=list(msg.shape),
            digest=msg.digest,
            owner=node_id,
            inline=msg.inline,
            memory=msg.memory,
        )
        if msg.inline is None:
            self.add_complete(entry, node_id, msg.segment, copying=msg.copying)
        else:
            members.charge_inline(entry, node_id)
        self.objects[oid] = entry
        self.deleted.pop(oid, None)  # put again: a lookup waits for it as for any put
        self.lost.pop(oid, None)
        self.outbox.send(node_id, p.PutReply(request_id=msg.request_id))
        self.outbox.record(
            now, "put", node=node_id, object_id=oid.hex(), size=msg.size, inline=msg.inline is not None
        )
        self.ready(oid, now)

    def copy_added(self, node_id: str, msg: p.CopyAdded, now: float) -> None:
        """A node copied an object from a same-host segment: one more complete copy."""
        entry = self.objects.get(msg.object_id)
        if entry is None or entry.inline is not None:
            # Deleted while the node copied it: the node was not on record as a holder when the
            # owner's delete went out, so tell it now.
            self.outbox.send(node_id, p.DropObject(object_id=msg.object_id))
            return
        self.add_complete(entry, node_id, msg.segment)
        self.outbox.record(now, "copy_added", node=node_id, object_id=msg.object_id.hex())
        self.ready(msg.object_id, now)

    def delete(self, node_id: str, msg: p.DeleteRequest, now: float) -> None:
        """The owner deletes an object everywhere; another node drops its own copy; the same for
        each object of ``msg.also``, in order; one ``DeleteReply`` answers for them all."""
        deleted, kept = self.delete_one(node_id, msg.object_id, now)
        more = [self.delete_one(node_id, oid, now) for oid in msg.also]
        done = p.DeleteReply(
            request_id=msg.request_id,
            deleted=deleted,
            kept=kept,
            deleted_also=[d for d, _ in more],
            kept_also=[k for _, k in more],
        )
        self.outbox.send(node_id, done)

    def delete_one(self, node_id: str, oid: bytes, now: float) -> tuple[bool, bool]:
        """``node_id`` deletes ``oid`` (its owner: everywhere; another node: its own copy), with
        no reply (a barrier's release: the node learns from its ``ok``); whether it was deleted
        everywhere, and whether the requester must keep its copy (the only one)."""
        red = self.reductions.get(oid)
        if red is not None and red.requester == node_id:
            text = f"reduction {oid.hex()} was deleted"
            self.reducer.fail(red, "ObjectDeletedError", text, now, drop="deleted")
            self.reducer.forget(oid)
            if oid not in self.objects:  # the result was never placed, or dropped above
                self.remember_delete(oid)
                self.outbox.record(now, "delete", node=node_id, object_id=oid.hex())
                return True, False
        entry = self.objects.get(oid)
        if entry is None:
            return False, False
        if entry.owner != node_id:
            loc = entry.locations.get(node_id)
            if loc is not None and self.sole_copy(entry, loc):
                # E.g. a reduction's result on the node that computed it, owned by the node that
                # asked for it: dropping it would lose it; it goes when its owner deletes it.
                self.outbox.record(now, "delete_kept", node=node_id, object_id=oid.hex())
                return False, True
            # Even while it serves a transfer: that transfer goes on from the array it holds, but
            # nobody may be sent to (or told to use) the dropped copy any more.
            entry.locations.pop(node_id, None)
            self.outbox.record(now, "delete_local", node=node_id, object_id=oid.hex())
            return False, False
        if self._running_intermediate(entry):
            # Its tree's parent reads it; it goes when the tree finishes, fails or is rebuilt.
            self.outbox.record(now, "delete_kept", node=node_id, object_id=oid.hex())
            return False, True
        self.remove(oid, now, skip=node_id)
        self.remember_delete(oid)
        self.outbox.record(now, "delete", node=node_id, object_id=oid.hex())
        return True, False

    def _running_intermediate(self, entry: ObjectEntry) -> bool:
        """Whether ``entry`` is the output of a non-root vertex of an active reduction's tree."""
        red = self.reductions.get(entry.reduction) if entry.reduction != entry.object_id else None
        return (
            red is not None
            and red.active
            and any(pl.output_id == entry.object_id for pl in red.plan.intermediates())
        )

    # ------------------------------------------------------------ copies
    def ready(self, oid: bytes, now: float) -> None:
        """``oid`` has a new complete copy (or a new source): answer waiting lookups, then offer it
        to the reductions waiting for it."""
        self.lookups.serve(oid, now)
        self.reducer.object_ready(oid, now)

    def add_complete(self, entry: ObjectEntry, node_id: str, segment: str, copying: bool = False) -> None:
        """Record ``node_id``'s copy of ``entry`` as complete (in ``segment``, if any)."""
        loc = entry.locations.get(node_id)
        if loc is None:
            loc = Location(node_id, LocationState.COMPLETE, entry.size)
            entry.locations[node_id] = loc
        loc.state = LocationState.COMPLETE
        loc.progress = entry.size
        loc.upstream = None
        loc.segment = segment
        loc.producing = False
        loc.copying = copying and bool(segment)

    def sole_copy(self, entry: ObjectEntry, loc: Location) -> bool:
        """Whether ``loc`` is the only complete copy of a non-inline object (or the node producing
        it), so dropping it would lose the object."""
        if entry.inline is not None:
            return False
        if loc.state is LocationState.PARTIAL and not loc.producing:
            return False  # a copy still being received from elsewhere
        return not any(
            other.state is LocationState.COMPLETE
            and other.node_id != loc.node_id
            and other.node_id in self.nodes
            for other in entry.locations.values()
        )

    # ------------------------------------------------------------ forgetting
    def remove(
        self,
        oid: bytes,
        now: float,
        skip: str = "",
        reason: str = "deleted",
        error: tuple[str, str] = ("", ""),
    ) -> None:
        """Forget an object everywhere: its transfers end and its holders (but ``skip``) drop it,
        told ``reason`` and, for ``"failed"``, the ``error`` (kind, message; see
        :class:`~hoplite_gpu.protocol.DropObject`)."""
        kind, message = error if reason == "failed" else ("", "")
        entry = self.objects.pop(oid, None)
        if entry is None:
            return
        self.members.release_inline(entry)
        self.lookups.drop_transfers(oid)
        for holder in entry.locations:
            if holder != skip and holder in self.nodes:
                drop = p.DropObject(object_id=oid, reason=reason, error_kind=kind, error=message)
                self.outbox.send(holder, drop)

    def remember_delete(self, oid: bytes) -> None:
        """Its owner deleted ``oid``: lookups waiting for it, and later ones (among the latest
        :data:`DELETES_KEPT` deletes, until it is put again), fail with ``ObjectDeletedError``."""
        deleted = self.deleted
        deleted[oid] = None
        deleted.move_to_end(oid)
        while len(deleted) > DELETES_KEPT:
            deleted.popitem(last=False)
        self.lookups.fail(oid, lambda pl: deleted_lookup(pl.request_id, oid))

    def lose(self, oid: bytes, now: float) -> None:
        """No live complete copy of ``oid`` is left and nobody computes it: partial holders drop
        it and waiting lookups fail. A later put of the same id makes it available again."""
        partial = len(self.objects[oid].locations)
        self.outbox.record(now, "object_lost", object_id=oid.hex(), partial_copies=partial)
        self.remove(oid, now, reason="lost")
        self._remember_loss(oid, now)
        self.lookups.fail(oid, lambda pl: lost_lookup(pl.request_id, oid))
        red = self.reductions.get(oid)
        if red is not None and red.done:  # a finished result cannot be put again: fail its readers
            red.error = ("ObjectLostError", f"the result of reduction {oid.hex()} was lost", oid)

    def _remember_loss(self, oid: bytes, now: float) -> None:
        """Keep ``oid``'s loss for :meth:`lost_recently` (the oldest go once past the window, or
        beyond :data:`DELETES_KEPT` ids)."""
        lost = self.lost
        lost[oid] = now
        lost.move_to_end(oid)
        window = self.config.lease_timeout
        while lost and (len(lost) > DELETES_KEPT or next(iter(lost.values())) < now - window):
            lost.popitem(last=False)

    def lost_recently(self, oid: bytes, now: float) -> bool:
        """Whether ``oid`` was lost (and not put again) within ``lease_timeout`` before ``now``: a
        first lookup of it then fails as the ones waiting at the loss did (see the module's text)."""
        when = self.lost.get(oid)
        return when is not None and now - when <= self.config.lease_timeout

    def forget_node(self, node_id: str) -> set[bytes]:
        """``node_id`` left: drop its copies. The ids of the objects it held a copy of."""
        touched: set[bytes] = set()
        for oid, entry in list(self.objects.items()):
            if entry.locations.pop(node_id, None) is not None:
                touched.add(oid)
        return touched

    def settle(self, touched: set[bytes], now: float) -> None:
        """After a node left: each object of ``touched`` without a complete copy or a producer is
        lost; the others may serve their waiting lookups from another source."""
        for oid in touched:
            entry = self.objects.get(oid)
            if entry is None or entry.inline is not None:
                continue
            if not any(
                loc.state is LocationState.COMPLETE or loc.producing for loc in entry.locations.values()
            ):
                self.lose(oid, now)
            else:
                self.lookups.serve(oid, now)
