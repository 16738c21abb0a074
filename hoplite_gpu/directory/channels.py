"""The directory service's authenticated connections, and the caller channels of each node.

A node holds one connection, and may open caller channels (:mod:`hoplite_gpu.node.channel`):
one thread's requests, one at a time, whose replies go back on the channel the request came on
(:class:`Channels` keeps the routes). A reply whose channel closed, or that its caller gave up on,
goes to the node's own connection, which drops it.
"""

from __future__ import annotations

import asyncio


class Conn:
    """An authenticated connection: a node's own, or one of its caller channels (``channel``),
    with the frames held for it while a batch of requests is handled."""

    __slots__ = ("channel", "held", "node_id", "out", "peer", "waiting", "writer")

    def __init__(self, node_id: str, writer: asyncio.StreamWriter, peer: str, channel: bool = False) -> None:
        self.node_id = node_id
        self.writer = writer
        self.peer = peer
        self.out: list[bytes] = []  # frames held while a batch of requests is handled
        self.held = 0  # their bytes
        # A caller channel of the node (Hello.channel): the request it waits on (0: none), whose
        # reply goes back on it.
        self.channel = channel
        self.waiting = 0

    def take(self) -> bytes:
        """The frames held for this connection, joined; it holds none after."""
        frames, self.out, self.held = self.out, [], 0
        return b"".join(frames)


class Channels:
    """The caller channels open per node (:attr:`by_node`), and the channel each reply goes
    back on."""

    def __init__(self) -> None:
        self.by_node: dict[str, list[Conn]] = {}  # node id -> its caller channels
        self.routes: dict[tuple[str, int], Conn] = {}  # (node, request id) -> channel it came on

    def fits(self, node_id: str, most: int) -> bool:
        """Whether ``node_id`` holds fewer than ``most`` channels."""
        return len(self.by_node.get(node_id, ())) < most

    def add(self, conn: Conn) -> None:
        """A channel authenticated."""
        self.by_node.setdefault(conn.node_id, []).append(conn)

    def route(self, conn: Conn, request_id: int) -> None:
        """The reply to ``request_id`` goes back on the channel ``conn`` (one request at a time:
        its caller waits; a reply it gave up on goes to the node's connection, which drops it)."""
        if conn.waiting:
            self.routes.pop((conn.node_id, conn.waiting), None)
        conn.waiting = request_id
        if request_id:
            self.routes[(conn.node_id, request_id)] = conn

    def reply_on(self, node_id: str, request_id: int) -> Conn | None:
        """The channel the reply to ``node_id``'s ``request_id`` goes back on (its route is then
        forgotten), or None: the node's own connection."""
        routed = self.routes.pop((node_id, request_id), None)
        if routed is None:
            return None
        routed.waiting = 0
        return routed if not routed.writer.is_closing() else None

    def closed(self, conn: Conn) -> int:
        """The channel ``conn`` closed: forget it. The request it waited on that is still to be
        answered (to withdraw: a lookup, a barrier arrival), or 0."""
        chans = self.by_node.get(conn.node_id, [])
        if conn in chans:
            chans.remove(conn)
            if not chans:
                del self.by_node[conn.node_id]
        rid, conn.waiting = conn.waiting, 0
        if rid and self.routes.pop((conn.node_id, rid), None) is conn:
            return rid
        return 0

    def close_all(self, node_id: str) -> None:
        """The node left: close its channels."""
        for conn in self.by_node.get(node_id, []):
            conn.writer.close()

    def every(self) -> list[Conn]:
        """Every channel open."""
        return [conn for chans in self.by_node.values() for conn in chans]
