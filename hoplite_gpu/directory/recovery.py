"""Recovery after this directory restarted and lost its records.

Nodes that lost their directory rejoin (``NodeJoined.rejoin``) and re-send what they hold as
:class:`~hoplite_gpu.protocol.Restore` messages, and their unfinished reductions with ``rejoin``.
For a lease after the first rejoin, a resumed lookup of an object not known yet waits (its source
may not have rejoined yet) instead of failing as lost; after it, such a lookup fails, and so does
a member of a watched group that has not watched again (:meth:`.watches.Watches.recovered`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .. import protocol as p
from .lookups import lost_lookup
from .records import NodeInfo, ObjectEntry, PendingLookup, Reduction

if TYPE_CHECKING:
    from .catalog import Catalog
    from .config import DirectoryConfig
    from .lookups import Lookups
    from .membership import Membership
    from .outbox import Outbox
    from .reductions import Reductions
    from .watches import Watches


class Recovery:
    """Restoring copies after a restart, and the window in which they are still coming.

    Args:
        config: The directory's settings.
        nodes: The joined nodes (read).
        objects: The objects (restored copies are added).
        reductions: The reductions by id (read: a restored result finishes one).
        outbox: Where its messages and the events it records go.
        members: Charged for restored inline bytes.
        catalog: Restored copies recorded and made ready.
        reducer: Finishes a reduction whose result was restored.
        lookups: The lookups failed once the window closes.
        watches: Told when the window closes.
    """

    def __init__(
        self,
        *,
        config: DirectoryConfig,
        nodes: dict[str, NodeInfo],
        objects: dict[bytes, ObjectEntry],
        reductions: dict[bytes, Reduction],
        outbox: Outbox,
        members: Membership,
        catalog: Catalog,
        reducer: Reductions,
        lookups: Lookups,
        watches: Watches,
    ) -> None:
        self.config = config
        self.nodes = nodes
        self.objects = objects
        self.reductions = reductions
        self.outbox = outbox
        self.members = members
        self.catalog = catalog
        self.reducer = reducer
        self.lookups = lookups
        self.watches = watches
        # Until when copies are still being restored (None: not recovering).
        self.until: float | None = None

    @property
    def recovering(self) -> bool:
        """Whether nodes may still be restoring their copies."""
        return self.until is not None

    def rejoined(self, now: float) -> None:
        """A node rejoined after losing its directory (this one, restarted): copies follow."""
        if self.until is None:
            self.until = now + self.config.lease_timeout
            self.outbox.record(now, "directory_recovering", until=self.until)

    def restore(self, node_id: str, msg: p.Restore, now: float) -> None:
        """A rejoining node's complete copy (this directory restarted and lost its records)."""
        members, oid = self.members, msg.object_id
        if len(oid) != 20 or msg.size < 0:
            return
        inline = msg.inline if msg.inline is not None and len(msg.inline) == msg.size else None
        too_big = msg.size > self.config.inline_threshold_bytes or not members.inline_fits(node_id, msg.size)
        if inline is not None and too_big:
            inline = None  # over the threshold or the quota: the node's own copy is registered
        red = self.reductions.get(oid)
        if red is not None and red.done and not red.restored and red.chooses:
            # This directory computed the result from the inputs it chose; a copy from before the
            # restart may be of others: readers must not get either at random.
            self.outbox.record(now, "restore_conflict", node=node_id, object_id=oid.hex())
            return
        entry = self.objects.get(oid)
        if entry is None:
            entry = ObjectEntry(
                oid,
                msg.size,
                msg.dtype,
                list(msg.shape),
                msg.digest,
                node_id if msg.owner else "",
                inline,
                memory=msg.memory,
            )
            if inline is not None:
                members.charge_inline(entry, node_id)
            self.objects[oid] = entry
        elif (entry.size, entry.dtype, list(entry.shape)) != (msg.size, msg.dtype, list(msg.shape)) or (
            entry.digest and msg.digest and entry.digest != msg.digest
        ):
            # Size, dtype and shape always; the content when both sides know its digest (a
            # reduction's result has none).
            self.outbox.record(now, "restore_conflict", node=node_id, object_id=oid.hex())
            return
        else:
            entry.digest = entry.digest or msg.digest
            if msg.owner and entry.owner != node_id:
                if entry.owner and entry.owner in self.nodes:
                    # Another joined node owns it: a Restore does not take it over (only the node
                    # that put an object may delete it for everyone).
                    self.outbox.record(
                        now, "restore_owner_refused", node=node_id, object_id=oid.hex(), owner=entry.owner
                    )
                else:
                    entry.owner = node_id
        if entry.inline is None:
            self.catalog.add_complete(entry, node_id, msg.segment)
        self.outbox.record(now, "restore", node=node_id, object_id=oid.hex(), owner=msg.owner)
        if red is not None and red.active:
            # The result was complete before the restart; the re-sent request's tree is not needed.
            red.restored = True
            entry.owner = red.requester  # who deletes it, as one computed here
            self.reducer.finish(red, now)  # which also marks the result final (not void on a restart)
        self.catalog.ready(oid, now)

    def deadline(self) -> float | None:
        """When the window for restoring copies closes."""
        if self.until is not None and math.isfinite(self.until):
            return self.until
        return None

    def expire(self, now: float) -> None:
        """Every live node had time to rejoin and restore its copies: a resumed lookup of an object
        still unknown was for a copy that died with the old directory's records (lost)."""
        if self.until is None or now < self.until:
            return
        lookups = self.lookups
        self.until = None
        self.outbox.record(now, "directory_recovered", objects=len(self.objects))
        self.watches.recovered(now)
        for oid in [o for o in lookups.pending if o not in self.objects]:
            red = self.reductions.get(oid)
            if red is not None and red.active:
                continue

            def fail(pl: PendingLookup, oid: bytes = oid) -> bool:
                if pl.have_bytes == 0 and not pl.resume:
                    return True  # a get before the put: it waits, as always
                self.outbox.send(pl.node_id, lost_lookup(pl.request_id, oid))
                return False

            lookups.retain(oid, fail)
