"""Control-plane client: a node's authenticated TCP connection to the directory."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
from collections.abc import Callable
from typing import Any, TypeVar

from .. import auth
from .. import protocol as p
from ..config import MiB
from ..errors import (
    AuthenticationError,
    DirectoryUnavailableError,
    HopliteError,
    InvalidArgumentError,
    ProtocolError,
    from_kind,
)
from ..iothread import bounded
from ..topology import GpuPlace

log = logging.getLogger("hoplite_gpu.control")


def parse_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (raises DirectoryUnavailableError on a malformed address)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise DirectoryUnavailableError(
            f"directory address {address!r} is not host:port (a port in 1..65535)",
            peer=address,
            cause="bad address",
        )
    return host.strip("[]"), int(port)


def _too_large(msg: p.Message, size: int, limit: int) -> InvalidArgumentError:
    """The error for a message of ``size`` bytes, over the control message ``limit``."""
    argument, hint = "request", ""
    if isinstance(msg, p.ReduceRequest):
        argument = "coding" if msg.coding else "object_ids"
        hint = "; reduce fewer objects at a time (a reduction's result can be an input of another)"
        if msg.coding:
            hint = "; give fewer objects or shorter encoding rows"
    return InvalidArgumentError(
        f"this {msg.TYPE} request encodes to {size} bytes, over the control message limit of {limit} "
        f"(Config.control_message_limit){hint}",
        argument=argument,
    )


T = TypeVar("T")


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


async def within(fut: asyncio.Future[T], timeout: float | None) -> T:
    """``await fut``, failed with :class:`asyncio.TimeoutError` after ``timeout`` s (None: no
    limit). A timer on the future itself: ``asyncio.wait_for`` wraps it in a task and a second
    future, which cost more than the rest of a small request."""
    if timeout is None:
        return await fut
    timer = fut.get_loop().call_later(timeout, _expire, fut)
    try:
        return await fut
    finally:
        timer.cancel()


class ControlClient:
    """Request/response and push messages over one directory connection.

    Args:
        on_push: Called on the event loop with every message that is not a reply.
        limit: Largest frame accepted from the directory.
        on_lost: Called on the event loop with the error once the connection is lost or closed.
        ids: Request-id counter to continue (a reconnection's client shares its predecessor's, so
            an id taken before the loss never names another request).
    """

    def __init__(
        self,
        on_push: Callable[[p.Message], None],
        limit: int,
        on_lost: Callable[[HopliteError], None] | None = None,
        ids: itertools.count[int] | None = None,
    ) -> None:
        self.on_push = on_push
        self.on_lost = on_lost
        self.limit = limit
        self.address = ""
        self.directory_id = ""
        self.inline_threshold_bytes = 0
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[p.Message]] = {}
        self.ids = ids or itertools.count(1)
        self._read_task: asyncio.Task[None] | None = None
        self._lost: HopliteError | None = None
        self._goodbye = False  # the directory said it is stopping (p.Goodbye)
        self._closed_with: HopliteError | None = None  # what close() fails waiting requests with

    async def connect(
        self,
        address: str,
        token: str,
        node_id: str,
        data_host: str,
        data_port: int,
        timeout: float,
        host_key: str = "",
        previous_directory: str = "",
        tls: ssl.SSLContext | None = None,
        place: GpuPlace | None = None,
    ) -> None:
        """Connect, authenticate both ways, and start reading (``host_key``: see
        :func:`hoplite_gpu.memory.shm.host_key`; ``previous_directory``: see
        :class:`~hoplite_gpu.protocol.Hello`; ``tls``: connect over TLS with this context, which
        checks the directory's certificate and host; ``place``: the node's GPU, see
        :func:`hoplite_gpu.memory.placement.node_place`)."""
        place = place or GpuPlace()
        self.address = address
        host, port = parse_address(address)
        try:
            opening = asyncio.open_connection(host, port, ssl=tls, server_hostname=host if tls else None)
            reader, writer = await bounded(opening, timeout)
        except ssl.SSLError as exc:  # before OSError: it is one
            raise DirectoryUnavailableError(
                f"TLS with the directory at {address} failed: {exc}; check Config.tls_ca_file "
                "(and that the directory serves TLS: Config.tls_cert_file)",
                peer=address,
                cause="tls",
            ) from exc
        except (OSError, asyncio.TimeoutError) as exc:
            raise DirectoryUnavailableError(
                f"cannot reach the directory at {address}: {str(exc) or type(exc).__name__}; is it running?",
                peer=address,
                cause=type(exc).__name__,
            ) from exc
        try:
            challenge = await bounded(p.read_frame(reader, 4096), timeout)
            if not isinstance(challenge, p.Challenge):
                raise ProtocolError(f"expected a challenge from {address}, got {challenge.TYPE}")
            mine = auth.new_nonce()
            proof = auth.mac(token, b"client", challenge.nonce, mine)
            writer.write(
                p.encode(
                    p.Hello(
                        node_id=node_id,
                        nonce=mine,
                        proof=proof,
                        data_host=data_host,
                        data_port=data_port,
                        host_key=host_key,
                        previous_directory=previous_directory,
                        gpu=place.uuid,
                        gpus=place.inventory,
                    )
                )
            )
            await writer.drain()
            try:
                welcome = await bounded(p.read_frame(reader, 4096), timeout)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                raise AuthenticationError(
                    f"the directory at {address} refused our token (connection closed during authentication)",
                    peer=address,
                ) from exc
            if not isinstance(welcome, p.Welcome) or not auth.verify(
                token, b"server", challenge.nonce, mine, welcome.proof
            ):
                raise AuthenticationError(
                    f"the directory at {address} could not prove it knows our token", peer=address
                )
        except asyncio.TimeoutError as exc:
            writer.close()
            # A TLS directory waits for a TLS hello and sends nothing to a plain-TCP client.
            hint = "" if tls else "; if it serves TLS, set Config.tls_ca_file (HOPLITE_TLS_CA_FILE) here"
            raise DirectoryUnavailableError(
                f"the directory at {address} did not complete the handshake in {timeout} s{hint}",
                peer=address,
                cause="timeout",
            ) from exc
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            writer.close()  # e.g. a directory that died (or was restarting) as we connected
            raise DirectoryUnavailableError(
                f"the directory at {address} closed the connection during the handshake",
                peer=address,
                cause="closed",
            ) from exc
        except BaseException:
            writer.close()
            raise
        self.directory_id = welcome.directory_id
        self.inline_threshold_bytes = welcome.inline_threshold_bytes
        self._reader, self._writer = reader, writer
        self._read_task = asyncio.create_task(self._read_loop())

    def next_id(self) -> int:
        """A fresh request id."""
        return next(self.ids)

    @property
    def lost(self) -> bool:
        """Whether the connection was lost or closed."""
        return self._lost is not None

    def send(self, msg: p.Message) -> None:
        """Send a message that expects no reply.

        Raises:
            InvalidArgumentError: it encodes to more than the control message limit (ours, or
                what the directory's inline threshold implies if larger), which the directory
                would refuse (nothing is sent).
            DirectoryUnavailableError: the connection is lost or closed.
        """
        if self._lost is not None:
            raise self._lost
        assert self._writer is not None
        frame = p.encode(msg)
        # A put carries objects up to the directory's inline threshold, which may exceed ours.
        limit = max(self.limit, self.inline_threshold_bytes + MiB)
        if len(frame) - p.FRAME_HEADER.size > limit:
            raise _too_large(msg, len(frame) - p.FRAME_HEADER.size, limit)
        try:
            self._writer.write(frame)
        except (RuntimeError, OSError) as exc:  # closed under us (uvloop: "the handler is closed")
            # before the read loop saw it: the directory was killed (the soak saw this)
            raise DirectoryUnavailableError(
                f"the connection to the directory at {self.address} is closed",
                peer=self.address,
                cause="closed",
            ) from exc

    def expect(self, request_id: int) -> asyncio.Future[p.Message]:
        """Register interest in the reply to ``request_id`` (call before :meth:`send`)."""
        if self._lost is not None:
            raise self._lost
        fut: asyncio.Future[p.Message] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = fut
        return fut

    def forget(self, request_id: int) -> None:
        """Stop waiting for the reply to ``request_id``."""
        self._pending.pop(request_id, None)

    def unwanted(self, reply: p.Message) -> None:
        """A reply its asker no longer waits for: end the transfer a lookup's answer began, or it
        stays on record and its sender busy (tests/test_soak.py found it both when the answer
        crossed the asker's ``CancelLookup`` and when the asker was cancelled as it came)."""
        if isinstance(reply, p.LookupReply) and reply.transfer_id and self._lost is None:
            self.send(p.TransferDone(transfer_id=reply.transfer_id, ok=False, progress=0))

    async def request(self, msg: p.Message, timeout: float | None) -> p.Message:
        """Send a request (it must have ``request_id``) and wait for its reply (``timeout`` None:
        as long as the connection lives)."""
        request_id = int(getattr(msg, "request_id", 0))
        fut = self.expect(request_id)
        try:
            self.send(msg)
            reply = await within(fut, timeout)
        except asyncio.TimeoutError:
            raise DirectoryUnavailableError(
                f"the directory at {self.address} did not answer a {msg.TYPE} request in {timeout} s",
                peer=self.address,
                cause="timeout",
            ) from None
        finally:
            self.forget(request_id)
        if isinstance(reply, p.ErrorReply):  # the directory could not serve this one request
            raise from_kind(reply.kind, reply.message)
        return reply

    async def _read_loop(self) -> None:
        assert self._reader is not None
        error: HopliteError
        try:
            while True:
                msg = await p.read_frame(self._reader, self.limit)
                if isinstance(msg, p.Goodbye):
                    self._goodbye = True
                    continue
                request_id = getattr(msg, "request_id", None)
                fut = self._pending.pop(request_id, None) if request_id is not None else None
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                elif request_id is None:
                    self.on_push(msg)
                else:  # its asker gave up (cancelled) as the answer crossed the CancelLookup
                    self.unwanted(msg)
            # unreachable
        except ProtocolError as exc:
            log.error("bad message from the directory: %s", exc)
            error = exc
        except asyncio.CancelledError:
            error = self._closed_with or DirectoryUnavailableError(
                "the directory connection was closed", peer=self.address, cause="closed"
            )
        except Exception as exc:
            if self._goodbye:  # what ends the connection after a Goodbye is the shutdown itself
                error = DirectoryUnavailableError(
                    f"the directory at {self.address} shut down", peer=self.address, cause="shutdown"
                )
            else:
                error = DirectoryUnavailableError(
                    f"lost the connection to the directory at {self.address}: {type(exc).__name__}",
                    peer=self.address,
                    cause=type(exc).__name__,
                )
        self._lost = error
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)
        self._pending.clear()
        if self.on_lost is not None:
            try:
                self.on_lost(error)
            except Exception:  # a bug there must not pass silently with this task
                log.exception("handling the loss of the directory connection failed")

    async def settled(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until the read loop has ended: the connection's loss is
        then known (:attr:`lost`) and told (``on_lost``)."""
        if self._read_task is not None and not self._read_task.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await bounded(asyncio.shield(self._read_task), timeout)

    async def close(self, error: HopliteError | None = None) -> None:
        """Close the connection; requests waiting for a reply fail with ``error`` (by default
        ``DirectoryUnavailableError``, "the directory connection was closed")."""
        self._closed_with = error
        if self._read_task is not None:
            self._read_task.cancel()
            with contextlib.suppress(BaseException):
                await self._read_task
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._writer.wait_closed(), 1.0)
