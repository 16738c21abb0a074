"""Admitting and authenticating the directory service's connections.

A connection just accepted counts against the caps of those still authenticating
(:class:`Admission`); it is then challenged, and must answer with a ``Hello`` proving it knows the
token, within :data:`HANDSHAKE_TIMEOUT` of its accept; the directory's ``Welcome`` proves it
knows the token too (:class:`Greeter`). Which node or caller channel the connection then is, is
the service's business.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

from .. import auth
from .. import protocol as p
from ..errors import ProtocolError
from ..topology import Inventory
from .config import DirectoryConfig
from .events import NodeJoined

log = logging.getLogger("hoplite_gpu.directory")

#: Seconds a connection has, from its accept, to finish TLS (if served) and authenticate.
HANDSHAKE_TIMEOUT = 10.0
#: The caps of connections still authenticating take at most 1/this of the descriptors the
#: process may open, so that they never leave none for the nodes that authenticated.
HANDSHAKE_SHARE_OF_FILES = 2


def handshake_caps(config: DirectoryConfig) -> tuple[int, int]:
    """The caps of connections still authenticating, in all and per address: the configured
    ones, within :data:`HANDSHAKE_SHARE_OF_FILES` of the descriptors this process may open."""
    most, per_address = config.max_handshakes, config.max_handshakes_per_address
    try:
        files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        files = resource.RLIM_INFINITY
    if files != resource.RLIM_INFINITY and most > max(1, files // HANDSHAKE_SHARE_OF_FILES):
        most = max(1, files // HANDSHAKE_SHARE_OF_FILES)
        log.warning(
            "at most %d connections may authenticate at once (Config.directory_max_handshakes is %d): "
            "this process may open %d files",
            most,
            config.max_handshakes,
            files,
        )
    return most, min(per_address, most)


class Admission:
    """The connections still authenticating, counted in all and per address against their caps
    (:func:`handshake_caps`), and those refused for passing one."""

    def __init__(self, config: DirectoryConfig) -> None:
        self.most, self.per_address = handshake_caps(config)
        self.handshaking = 0
        self.refused = 0
        self._from: dict[str, int] = {}  # peer address -> connections authenticating

    def admit(self, host: str) -> bool:
        """Count a connection from ``host`` just accepted; False if it would pass a cap (it is
        then counted as refused, not as authenticating)."""
        from_address = self.waiting_from(host)
        if self.handshaking >= self.most or from_address >= self.per_address:
            self.refused += 1
            return False
        self.handshaking += 1
        self._from[host] = from_address + 1
        return True

    def waiting_from(self, host: str) -> int:
        """How many connections from ``host`` are still authenticating."""
        return self._from.get(host, 0)

    def done(self, host: str) -> None:
        """A connection :meth:`admit` counted authenticated, failed or closed."""
        self.handshaking -= 1
        left = self._from[host] - 1
        if left:
            self._from[host] = left
        else:
            del self._from[host]


class Greeter:
    """The challenge, the node's ``Hello`` and the directory's ``Welcome``.

    Args:
        token: The shared secret.
        directory_id: This directory's id, sent in the ``Welcome``.
        inline_threshold_bytes: The most bytes of an object kept inline, sent in the ``Welcome``.
        warn: Logs a warning of a kind at a bounded rate: ``warn(kind, text, *args)``.
        failed: Told the peer of each connection that failed authentication.
    """

    def __init__(
        self,
        token: str,
        directory_id: str,
        inline_threshold_bytes: int,
        warn: Callable[..., None],
        failed: Callable[[str], None],
    ) -> None:
        self.token = token
        self.directory_id = directory_id
        self.inline_threshold_bytes = inline_threshold_bytes
        self.failures = 0
        self._warn = warn
        self._failed = failed

    async def hello(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str, deadline: float
    ) -> tuple[p.Hello, bytes] | None:
        """Challenge the connection and read its ``Hello`` by ``deadline`` (monotonic): the
        hello and the nonce it answered, or None if it failed (counted in :attr:`failures`) or
        closed before a byte (a probe, such as ``hoplite-gpu health``)."""
        nonce = auth.new_nonce()
        writer.write(p.encode(p.Challenge(nonce=nonce)))
        await writer.drain()
        try:
            left = max(0.0, deadline - time.monotonic())
            hello = await asyncio.wait_for(p.read_frame(reader, p.MAX_HELLO_BYTES), left)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                self._fail("hello", "dropping %s: no valid hello (%s)", peer, type(exc).__name__)
            else:
                log.debug("%s closed the connection after the challenge", peer)
            return None
        except (asyncio.TimeoutError, ProtocolError) as exc:
            self._fail("hello", "dropping %s: no valid hello (%s)", peer, type(exc).__name__)
            return None
        if not isinstance(hello, p.Hello) or not auth.verify(
            self.token, b"client", nonce, hello.nonce, hello.proof
        ):
            self._fail("auth", "dropping %s: authentication failed (wrong token?)", peer)
            return None
        return hello, nonce

    async def welcome(self, writer: asyncio.StreamWriter, hello: p.Hello, nonce: bytes) -> None:
        """Prove to the node that sent ``hello`` (answering ``nonce``) that the directory knows
        the token too."""
        proof = auth.mac(self.token, b"server", nonce, hello.nonce)
        welcome = p.Welcome(
            proof=proof, directory_id=self.directory_id, inline_threshold_bytes=self.inline_threshold_bytes
        )
        writer.write(p.encode(welcome))
        await writer.drain()

    def joined(self, hello: p.Hello) -> NodeJoined:
        """The event of the node that sent ``hello`` joining, now."""
        return NodeJoined(
            hello.node_id,
            hello.data_host,
            hello.data_port,
            time.monotonic(),
            hello.host_key,
            # A restart of this directory, not a node it declared dead coming back.
            rejoin=bool(hello.previous_directory) and hello.previous_directory != self.directory_id,
            gpu=hello.gpu,
            gpus=Inventory.from_dict(hello.gpus) if hello.gpu else None,  # checked by Hello
        )

    def _fail(self, kind: str, text: str, peer: str, *args: Any) -> None:
        self.failures += 1
        self._warn(kind, text, peer, *args)
        self._failed(peer)
