"""Who is in: joined nodes, their leases, suspicion of a failed sender, and per-node quotas of
bytes kept inline and of reduction inputs held.

A node is dead when its connection closes or when it sends nothing (heartbeats included) for
``lease_timeout`` seconds. A directory that itself stalled (``Tick.lag``) renews every lease
instead of declaring everyone dead. A node a receiver reported as a failed sender is *suspect*: it
serves nobody until a heartbeat shows it is alive.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .. import protocol as p
from .config import SUSPECT_GRACE
from .events import NodeJoined
from .records import NodeInfo, ObjectEntry, Reduction, unindex

if TYPE_CHECKING:
    from .config import DirectoryConfig
    from .outbox import Outbox


class Membership:
    """What happens to the joined nodes (the table ``nodes`` is shared: every part reads it), and
    the inline bytes and reduction inputs each node holds against its quotas.

    Args:
        config: The directory's settings.
        nodes: The joined nodes by id (this part adds and removes them).
        outbox: Where the events it records go.
    """

    def __init__(self, *, config: DirectoryConfig, nodes: dict[str, NodeInfo], outbox: Outbox) -> None:
        self.config = config
        self.nodes = nodes
        self.outbox = outbox
        # What each node's inline objects hold now (Config.directory_max_inline_bytes); no zeros.
        self.inline_bytes: dict[str, int] = {}
        # The inputs of the reductions each node requested that are held here, finished ones
        # included (Config.directory_max_reduce_inputs); no zeros.
        self.reduce_inputs: dict[str, int] = {}
        # At most the oldest last_seen of the nodes (None: not known): the service asks for the
        # first lease expiry after every event, which must not walk every node. Heartbeats only
        # raise last_seen, so it stays a lower bound (an expiry found early costs a Tick) until
        # the Tick that checks the leases recomputes it.
        self._oldest: float | None = None
        # The joined nodes of each host key (none for ""), so that a join or a leave tells that
        # host's nodes without walking every node.
        self._by_host: dict[str, set[str]] = {}

    # ------------------------------------------------------------ joining and leaving
    def join(self, ev: NodeJoined) -> None:
        """Record a node that authenticated."""
        before = self.nodes.get(ev.node_id)
        if before is not None and before.host_key != ev.host_key:
            unindex(self._by_host, before.host_key, ev.node_id)  # joined again from another host
            self._tell_host(before.host_key)
        self.nodes[ev.node_id] = NodeInfo(
            ev.node_id,
            ev.data_host,
            ev.data_port,
            ev.now,
            ev.host_key,
            ev.now,
            gpu=ev.gpu,
            gpus=ev.gpus,
        )
        if self._oldest is not None:
            self._oldest = min(self._oldest, ev.now)
        self.outbox.record(ev.now, "node_joined", node=ev.node_id, rejoin=ev.rejoin, gpu=ev.gpu)
        if ev.host_key:
            self._by_host.setdefault(ev.host_key, set()).add(ev.node_id)
        self._tell_host(ev.host_key)

    def leave(self, node_id: str) -> bool:
        """Forget a node; False if it was not joined."""
        info = self.nodes.pop(node_id, None)
        if info is None:
            return False
        unindex(self._by_host, info.host_key, node_id)
        self._tell_host(info.host_key)
        return True

    def host_nodes(self, host_key: str) -> set[str]:
        """The joined nodes of host ``host_key`` (empty for "": a node that shares no memory)."""
        return self._by_host.get(host_key, set()) if host_key else set()

    def _tell_host(self, host_key: str) -> None:
        """Tell each node of host ``host_key`` how many others share it (:class:`protocol.HostPeers`:
        one alone keeps what it lends in its own memory)."""
        same = self.host_nodes(host_key)
        for node_id in sorted(same):
            self.outbox.send(node_id, p.HostPeers(peers=len(same) - 1))

    def seen(self, node_id: str, now: float) -> NodeInfo | None:
        """A message from ``node_id`` arrived: renew its lease. None if it is not joined (not
        authenticated, or declared dead: nothing it sends is acted on)."""
        info = self.nodes.get(node_id)
        if info is not None:
            info.last_seen = max(info.last_seen, now)
        return info

    # ------------------------------------------------------------ leases
    def renew_if_stalled(self, now: float, lag: float) -> None:
        """The host woke ``lag`` seconds late for a tick: if that is a fair part of a lease, the
        directory was stalled, not its nodes, so every lease is renewed."""
        if lag > self.config.lease_timeout / 4:
            for info in self.nodes.values():
                info.last_seen = max(info.last_seen, now)
            self.outbox.record(now, "directory_stalled", lag=round(lag, 3))

    def expired(self, now: float) -> list[NodeInfo]:
        """The nodes silent for a whole lease at ``now``."""
        self._oldest = None  # (these leave; the others' leases were renewed since)
        return [i for i in self.nodes.values() if now - i.last_seen >= self.config.lease_timeout]

    def lease_deadline(self) -> float | None:
        """When the first lease runs out, or earlier (see ``_oldest``); None: no node, or leases
        never do."""
        if self.nodes and math.isfinite(self.config.lease_timeout):
            if self._oldest is None:
                self._oldest = min(info.last_seen for info in self.nodes.values())
            return self._oldest + self.config.lease_timeout
        return None

    # ------------------------------------------------------------ suspects
    def suspect(self, node_id: str, now: float, reporter: str, reason: str) -> None:
        """A receiver reported ``node_id`` failed as its sender: it serves nobody until it shows
        it is alive."""
        info = self.nodes.get(node_id)
        if info is not None and info.suspect_since is None:
            info.suspect_since = now
            self.outbox.record(now, "node_suspect", node=node_id, reporter=reporter, reason=reason)

    def trust(self, node_id: str, now: float) -> bool:
        """A heartbeat from ``node_id``: if it was suspect long enough ago (one sent just before
        it stopped may still have been in flight), it may serve again. True if it was cleared."""
        info = self.nodes.get(node_id)
        if info is None or info.suspect_since is None or now - info.suspect_since < SUSPECT_GRACE:
            return False
        info.suspect_since = None
        self.outbox.record(now, "node_trusted", node=node_id)
        return True

    # ------------------------------------------------------------ inline quota
    def inline_fits(self, node_id: str, size: int) -> bool:
        """Whether ``size`` more inline bytes stay within ``node_id``'s quota."""
        return self.inline_bytes.get(node_id, 0) + size <= self.config.max_inline_bytes

    def charge_inline(self, entry: ObjectEntry, node_id: str) -> None:
        """Count ``entry``'s inline bytes against ``node_id``'s quota."""
        entry.charged = node_id
        if entry.size:  # (the per-node counts hold no zeros)
            self.inline_bytes[node_id] = self.inline_bytes.get(node_id, 0) + entry.size

    def release_inline(self, entry: ObjectEntry) -> None:
        """``entry`` was forgotten: its inline bytes no longer count against its node's quota."""
        if entry.inline is not None and entry.charged and entry.size:
            left = self.inline_bytes[entry.charged] - entry.size
            if left:
                self.inline_bytes[entry.charged] = left
            else:
                del self.inline_bytes[entry.charged]

    # ------------------------------------------------------------ reduction inputs quota
    def reduce_inputs_fit(self, node_id: str, count: int) -> bool:
        """Whether a reduction of ``count`` inputs (see :func:`reduction_cost`) stays within
        ``node_id``'s quota."""
        return self.reduce_inputs.get(node_id, 0) + count <= self.config.max_reduce_inputs

    def charge_reduction(self, red: Reduction, count: int) -> None:
        """Count ``red``'s ``count`` inputs against its requester's quota."""
        red.charged = count
        if count:
            self.reduce_inputs[red.requester] = self.reduce_inputs.get(red.requester, 0) + count

    def release_reduction(self, red: Reduction) -> None:
        """``red`` was forgotten: its inputs no longer count against its requester's quota."""
        if red.charged:
            left = self.reduce_inputs[red.requester] - red.charged
            red.charged = 0
            if left:
                self.reduce_inputs[red.requester] = left
            else:
                del self.reduce_inputs[red.requester]


def reduction_cost(msg: p.ReduceRequest) -> int:
    """What a requested reduction counts against its node's quota of inputs
    (``Config.directory_max_reduce_inputs``): its inputs, its weights and the numbers of its
    encoding rows, each held here for as long as the reduction is."""
    return len(msg.object_ids) + len(msg.weights) + sum(len(row) for row in msg.coding)
