"""A node's link to its directory: one authenticated connection at a time, heartbeats, and the
reconnection to a restarted directory.

:class:`DirectorySession` owns the :class:`~hoplite_gpu.node.control.ControlClient` of the moment. A
request made through it (:meth:`~DirectorySession.request`, :meth:`~DirectorySession.lookup`) that
fails because the connection was lost waits for the reconnection and is made again on the new
connection, within its timeout. After a reconnection the node restores its copies (its
``on_rejoined`` callback) and the session re-sends the reductions the node requested, so a
restarted directory rebuilds them (one it refuses is forgotten). A request the directory refuses
(too large, or failing its checks) fails its caller with the directory's error and is never
made again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from .. import protocol as p
from ..config import Config
from ..errors import DirectoryUnavailableError, HopliteError, ProtocolError, from_kind
from ..iothread import bounded
from ..object_id import ObjectID
from ..topology import GpuPlace
from .control import ControlClient, within
from .sources import ANY_SOURCE, Route

log = logging.getLogger("hoplite_gpu")

T = TypeVar("T")

#: Reductions a node requested that it remembers, to re-send them to a restarted directory.
REQUESTED_KEPT = 1000

#: Longest pause between two attempts to reach a lost directory again.
MAX_RECONNECT_BACKOFF = 1.0


class DirectorySession:
    """The directory link of one node.

    Args:
        address: ``host:port`` of the directory.
        token: Shared secret.
        node_id: This node's id.
        data_host: Address advertised for this node's data plane.
        data_port: Port of this node's data plane.
        config: Timeouts, heartbeat interval, reconnection time, control message limit.
        host_key: See :func:`hoplite_gpu.memory.shm.host_key` ("" without shared memory).
        on_push: Called on the event loop with every message the directory pushes.
        on_lost: Called on the event loop when the connection is lost, with whether the session
            reconnects (else every later request fails).
        on_rejoined: Called once a reconnection succeeded, before the reductions are re-sent (the
            node restores its copies).
        resolve: Where the directory is now: called (on a worker thread, with the seconds left)
            before each attempt to reach a lost directory, for one that may come back at another
            address (a restarted Ray actor); None: it comes back at ``address``.
        place: This node's GPU (:func:`hoplite_gpu.memory.placement.node_place`), told at every join.
    """

    def __init__(
        self,
        address: str,
        token: str,
        node_id: str,
        data_host: str,
        data_port: int,
        config: Config,
        host_key: str,
        on_push: Callable[[p.Message], None],
        on_lost: Callable[[bool], None],
        on_rejoined: Callable[[], None],
        resolve: Callable[[float], str] | None = None,
        place: GpuPlace | None = None,
    ) -> None:
        self.address = address
        self._place = place
        self._resolve = resolve
        self.config = config
        self._token = token
        self._node_id = node_id
        self._data_host = data_host
        self.data_port = data_port  # may be set after construction, before start()
        self._host_key = host_key
        self.tls = config.client_tls()  # None: plain TCP (Config.tls_ca_file); channels use it too
        self._on_push = on_push
        self._on_lost = on_lost
        self._on_rejoined = on_rejoined
        self.control = self._new_control()
        # Which connection this is: a pull that began under an earlier one reports its copy with
        # Restore (the restarted directory never heard of it).
        self.generation = 0
        self._closed = False
        self._beat: asyncio.Future[None] | None = None
        self._reconnecting: asyncio.Future[None] | None = None  # resolved when it ends
        self._unreachable: HopliteError | None = None  # set once reconnecting gave up
        self._requested: dict[bytes, p.ReduceRequest] = {}

    @property
    def inline_threshold_bytes(self) -> int:
        """The directory's inline threshold (objects up to this size travel in control messages)."""
        return self.control.inline_threshold_bytes

    def next_id(self) -> int:
        """A fresh request id (from any thread: every connection of this node shares them)."""
        return self.control.next_id()

    def channel_hello(self, nonce: bytes, proof: bytes) -> p.Hello:
        """The ``Hello`` of a caller channel of this node (:mod:`hoplite_gpu.node.channel`)."""
        return p.Hello(
            node_id=self._node_id,
            nonce=nonce,
            proof=proof,
            data_host=self._data_host,
            data_port=self.data_port,
            channel=True,
        )

    # ------------------------------------------------------------ lifecycle
    def _new_control(self, ids: itertools.count[int] | None = None) -> ControlClient:
        return ControlClient(self._on_push, self.config.control_message_limit, on_lost=self._lost, ids=ids)

    async def _join(self, client: ControlClient, previous_directory: str = "") -> None:
        """Connect ``client`` to the directory and introduce this node (see ``Hello``)."""
        await client.connect(
            self.address,
            self._token,
            self._node_id,
            self._data_host,
            self.data_port,
            self.config.connect_timeout,
            host_key=self._host_key,
            previous_directory=previous_directory,
            tls=self.tls,
            place=self._place,
        )

    async def start(self) -> None:
        """Connect and start heartbeats."""
        await self._join(self.control)
        self._beat = asyncio.ensure_future(self._heartbeats())

    async def _heartbeats(self) -> None:
        """Tell the directory this node is alive, every ``Config.heartbeat_interval`` seconds."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)  # a period, not synchronisation
            self.send(p.Heartbeat())  # lost: the next connection's turn comes

    def closing(self) -> None:
        """Stop heartbeats and any reconnection; the connection stays for the node's last reports
        (transfers it serves while it closes)."""
        self._closed = True
        if self._beat is not None:
            self._beat.cancel()
        if self._reconnecting is not None and not self._reconnecting.done():
            self._reconnecting.cancel()

    async def close(self, error: HopliteError | None = None) -> None:
        """:meth:`closing`, then close the connection (requests waiting fail with ``error``:
        see :meth:`ControlClient.close`)."""
        self.closing()
        await self.control.close(error)

    def send(self, msg: p.Message) -> None:
        """Send a message that expects no reply; dropped if the connection is lost (a restarted
        directory learns what it needs from the node's restore)."""
        with contextlib.suppress(HopliteError):
            self.control.send(msg)

    # ------------------------------------------------------------ reconnection
    def _lost(self, error: HopliteError) -> None:
        if self._closed:
            self._on_lost(False)
            return
        if self.config.reconnect_timeout <= 0:
            self._unreachable = error
            self._on_lost(False)
            return
        if getattr(error, "cause", "") == "shutdown":  # it said Goodbye: stopped, not lost
            log.debug("the directory at %s shut down; reconnecting in case it comes back", self.address)
        elif self._resolve is None:
            log.warning("lost the directory at %s (%s); reconnecting", self.address, error)
        # else: said once the resolver was asked, which knows a directory that is gone for good
        # (the Ray directory actor of a Ray that shut down) from one that may come back.
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = asyncio.ensure_future(self._reconnect(error))
        self._on_lost(True)

    async def _reconnect(self, error: HopliteError) -> None:
        """Reach the directory again (it may be restarting at the same address), with backoff,
        for up to ``Config.reconnect_timeout`` s; then let the node restore its copies and re-send
        its reductions. On giving up, every waiting and later request fails with the error."""
        lost = self.control
        give_up = time.monotonic() + self.config.reconnect_timeout
        pause = 0.05
        said = self._resolve is None or getattr(error, "cause", "") == "shutdown"  # (see _lost)

        def say() -> None:  # the warning _lost left to this first attempt, once
            nonlocal said
            if not said:
                said = True
                log.warning("lost the directory at %s (%s); reconnecting", self.address, error)

        while True:
            client = self._new_control(ids=lost.ids)
            try:
                if self._resolve is not None:
                    try:
                        await self._resolve_address(give_up)
                    except HopliteError as exc:
                        if getattr(exc, "cause", "") == "shutdown":  # gone for good: quietly
                            log.debug("the directory at %s is gone for good: %s", self.address, exc)
                            self._unreachable = exc
                            return
                        raise
                    say()
                await self._join(client, previous_directory=lost.directory_id)
                break
            except HopliteError as exc:
                # Also an AuthenticationError: a directory dying as it authenticated us looks
                # like a refusal; a real one (another token) fails when the time is up.
                say()
                error = exc
            except Exception as exc:  # not expected; retried all the same, and said
                log.exception("reconnecting to the directory failed unexpectedly")
                error = DirectoryUnavailableError(str(exc), peer=self.address, cause="error")
            if time.monotonic() + pause > give_up:
                break
            await asyncio.sleep(pause)  # backoff between attempts, not synchronisation
            pause = min(2 * pause, MAX_RECONNECT_BACKOFF)
        if client.directory_id == "":
            self._unreachable = DirectoryUnavailableError(
                f"the directory at {self.address} did not come back within "
                f"{self.config.reconnect_timeout} s: {error}",
                peer=self.address,
                cause="unreachable",
            )
            log.error("%s", self._unreachable)
            return
        self.control = client
        self.generation += 1
        self._on_rejoined()
        for msg in list(self._requested.values()):
            self._resend(client, msg)
        log.warning("rejoined the directory at %s (%s)", self.address, client.directory_id[:8])

    def _resend(self, client: ControlClient, msg: p.ReduceRequest) -> None:
        """Send a remembered reduction to a restarted directory; one it refuses is forgotten,
        never sent again."""
        request_id = client.next_id()
        try:
            reply = client.expect(request_id)
            client.send(dataclasses.replace(msg, request_id=request_id, rejoin=True))
        except HopliteError as exc:  # lost already (the next connection re-sends), or too large
            client.forget(request_id)
            if not isinstance(exc, DirectoryUnavailableError):
                self._refused(msg, str(exc))
            return

        def answered(fut: asyncio.Future[p.Message]) -> None:
            if fut.cancelled() or fut.exception() is not None:
                return  # the connection was lost: the next one re-sends it
            answer = fut.result()
            if isinstance(answer, p.ErrorReply):
                self._refused(msg, answer.message)
            elif isinstance(answer, p.ReduceReply) and answer.error:
                self._refused(msg, answer.error)

        reply.add_done_callback(answered)

    def _refused(self, msg: p.ReduceRequest, why: str) -> None:
        """Forget a remembered reduction the directory refused (unless asked for again since)."""
        if self._requested.get(msg.reduction_id) is msg:
            del self._requested[msg.reduction_id]
        log.warning("the directory refused reduction %s when re-sent: %s", msg.reduction_id.hex(), why)

    async def _resolve_address(self, give_up: float) -> None:
        """Ask ``resolve`` where the directory is now (bounded by the reconnection's time left)."""
        resolve = self._resolve
        assert resolve is not None
        left = max(0.1, give_up - time.monotonic())
        answer: concurrent.futures.Future[str] = concurrent.futures.Future()

        def work() -> None:
            try:
                value = resolve(left)
            except BaseException as exc:
                with contextlib.suppress(concurrent.futures.InvalidStateError):  # given up on
                    answer.set_exception(exc)
            else:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    answer.set_result(value)

        # A daemon thread, not the loop's executor: a resolver that never returns (Ray's get in a
        # worker whose raylet died spins past its timeout) must not keep the process from exiting.
        threading.Thread(target=work, name="hoplite-resolve", daemon=True).start()
        try:
            address = await bounded(asyncio.wrap_future(answer), left + 1.0)
        except HopliteError:
            raise
        except asyncio.TimeoutError:
            raise DirectoryUnavailableError(
                f"could not find where the directory (last at {self.address}) is now within {left:.1f} s",
                peer=self.address,
                cause="timeout",
            ) from None
        except Exception as exc:
            raise DirectoryUnavailableError(
                "could not find where the directory (last at "
                f"{self.address}) is now: {str(exc) or type(exc).__name__}",
                peer=self.address,
                cause="unreachable",
            ) from exc
        if address != self.address:
            log.warning("the directory moved from %s to %s", self.address, address)
            self.address = address

    def _will_reconnect(self, control: ControlClient) -> bool:
        """Whether a request that failed on ``control`` should wait for the next connection."""
        return (
            control.lost
            and not self._closed
            and self._unreachable is None
            and (control is not self.control or self._reconnecting is not None)
        )

    async def _await_directory(self, timeout: float | None) -> None:
        """Return once connected to the directory (at once, normally); wait for a reconnection
        in progress for up to ``timeout`` s."""
        if self._unreachable is not None:
            raise self._unreachable
        pending = self._reconnecting
        if pending is None or pending.done():
            return
        try:  # (not asyncio.wait_for: before 3.12 it loses a cancellation as the reconnection ends)
            await bounded(asyncio.shield(pending), timeout)
        except asyncio.TimeoutError:
            raise DirectoryUnavailableError(
                f"the directory at {self.address} is unreachable (reconnecting)",
                peer=self.address,
                cause="timeout",
            ) from None
        if self._unreachable is not None:
            raise self._unreachable

    # ------------------------------------------------------------ requests
    async def with_directory(
        self, call: Callable[[ControlClient, float | None], Awaitable[T]], timeout: float | None
    ) -> T:
        """``await call(connection, seconds_left)``; if the directory is lost meanwhile, call it
        again on the reconnected one (a restarted directory), within ``timeout`` in all."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            await self._await_directory(left)
            control = self.control
            try:
                return await call(control, left)
            except DirectoryUnavailableError as exc:
                if exc.fields.get("cause") == "closed" and not control.lost:
                    # A write found the connection closed before its read loop did: let it see
                    # the loss (and the reconnection begin) rather than fail (the restart soak).
                    await control.settled(self.config.request_timeout)
                if not self._will_reconnect(control):
                    raise

    async def request(self, make: Callable[[int], p.Message], timeout: float | None) -> p.Message:
        """Send the request ``make(request_id)`` and return its reply (see :meth:`with_directory`)."""
        return await self.with_directory(
            lambda control, left: control.request(make(control.next_id()), left), timeout
        )

    async def lookup(
        self,
        oid: ObjectID,
        timeout: float | None,
        have: int,
        shared_memory: bool = False,
        route: Route = ANY_SOURCE,
        device_ipc: bool = False,
        resume: bool = False,
    ) -> p.LookupReply:
        """Ask where ``oid`` is (see :class:`~hoplite_gpu.protocol.LookupRequest`); the directory
        answers once a source is free, or at ``timeout``."""
        return await self.with_directory(
            lambda control, left: self._lookup_once(
                control, oid, left, have, shared_memory, route, device_ipc, resume
            ),
            timeout,
        )

    async def _lookup_once(
        self,
        control: ControlClient,
        oid: ObjectID,
        timeout: float | None,
        have: int,
        shared_memory: bool,
        route: Route,
        device_ipc: bool,
        resume: bool,
    ) -> p.LookupReply:
        rid = control.next_id()
        request = p.LookupRequest(
            request_id=rid,
            object_id=oid.binary(),
            timeout=p.wire_timeout(timeout),
            have_bytes=have,
            shared_memory=shared_memory,
            direct=route.direct,
            via=route.via,
            device_ipc=device_ipc,
            resume=resume,
        )
        reply = await self._wait_for_reply(
            control, request, timeout, f"a lookup of {oid}", object_id=oid.hex()
        )
        if not isinstance(reply, p.LookupReply):
            raise ProtocolError(f"unexpected reply to lookup: {reply.TYPE}")
        return reply

    async def event_log(self, since: int) -> list[dict[str, Any]]:
        """The directory's event log from sequence number ``since``, fetched in pages of
        :data:`~hoplite_gpu.protocol.EVENT_LOG_PAGE` events."""
        events: list[dict[str, Any]] = []
        while True:
            request = functools.partial(p.EventLogRequest, since=since)
            reply = await self.request(request, self.config.request_timeout)
            if not isinstance(reply, p.EventLogReply):
                raise ProtocolError(f"unexpected reply to event_log: {reply.TYPE}")
            events += reply.events
            if len(reply.events) < p.EVENT_LOG_PAGE:
                return events
            since = reply.events[-1]["seq"] + 1

    async def summary(self) -> dict[str, Any]:
        """What the directory holds now, in brief (:meth:`.DirectoryState.summary`)."""
        reply = await self.request(p.SummaryRequest, self.config.request_timeout)
        if not isinstance(reply, p.SummaryReply):
            raise ProtocolError(f"unexpected reply to summary: {reply.TYPE}")
        return reply.summary

    async def barrier(
        self,
        barrier_id: bytes,
        rank: int,
        count: int,
        timeout: float | None,
        release: Sequence[bytes] = (),
        group_id: bytes = b"",
        vote: int = 1,
    ) -> p.BarrierReply:
        """Member ``rank`` of ``count`` reached barrier ``barrier_id``: the directory's reply
        once all have, or at ``timeout``; ``release``: objects of this node's it deletes once all
        have; ``group_id`` and ``vote``: an agreement's (see
        :class:`~hoplite_gpu.protocol.BarrierRequest`)."""

        async def once(control: ControlClient, left: float | None) -> p.BarrierReply:
            rid = control.next_id()
            request = p.BarrierRequest(
                request_id=rid,
                barrier_id=barrier_id,
                rank=rank,
                count=count,
                timeout=p.wire_timeout(left),
                release=list(release),
                group_id=group_id,
                vote=vote,
            )
            reply = await self._wait_for_reply(control, request, left, "a barrier")
            if not isinstance(reply, p.BarrierReply):
                raise ProtocolError(f"unexpected reply to barrier: {reply.TYPE}")
            return reply

        return await self.with_directory(once, timeout)

    async def watch(
        self,
        group_id: bytes,
        rank: int,
        count: int,
        abort: str = "",
        registered: asyncio.Future[None] | None = None,
        parent: bytes = b"",
        parent_ranks: Sequence[int] = (),
    ) -> p.WatchReply:
        """Member ``rank`` of ``count`` watches group ``group_id``: the directory's reply once a
        member is lost (held until then; cancel to withdraw); with ``abort``, gives up on the
        group and returns at once (see :class:`~hoplite_gpu.protocol.WatchRequest`, and for
        ``parent`` and ``parent_ranks``). ``registered`` is resolved once the directory holds
        the watch (a ping after it on the same connection came back)."""

        tries = itertools.count()

        async def confirm(control: ControlClient) -> None:
            if registered is not None and not registered.done():
                await control.request(
                    p.PingRequest(request_id=control.next_id()), self.config.request_timeout
                )
                if not registered.done():
                    registered.set_result(None)

        async def once(control: ControlClient, left: float | None) -> p.WatchReply:
            request = p.WatchRequest(
                request_id=control.next_id(),
                group_id=group_id,
                rank=rank,
                count=count,
                abort=abort,
                again=next(tries) > 0,  # to a restarted directory: see Watches.recovered
                parent=parent,
                parent_ranks=list(parent_ranks),
            )
            reply = await self._wait_for_reply(control, request, left, "a watch", sent=confirm)
            if not isinstance(reply, p.WatchReply):
                raise ProtocolError(f"unexpected reply to watch: {reply.TYPE}")
            return reply

        return await self.with_directory(once, self.config.request_timeout if abort else None)

    async def _wait_for_reply(
        self,
        control: ControlClient,
        request: Any,
        timeout: float | None,
        what: str,
        sent: Callable[[ControlClient], Awaitable[None]] | None = None,
        **fields: Any,
    ) -> p.Message:
        """Send ``request`` (one the directory holds until it can answer, or until its own
        ``timeout``) and return the reply; withdrawn (``CancelLookup``) if the caller gives up.
        ``sent(control)`` is awaited once it is sent."""
        rid = request.request_id
        fut = control.expect(rid)
        try:
            control.send(request)
            if sent is not None:
                await sent(control)
            # The directory enforces the deadline; the margin covers a directory that went silent.
            guard = None if timeout is None else timeout + self.config.request_timeout
            reply = await within(fut, guard)
        except asyncio.TimeoutError:
            raise DirectoryUnavailableError(
                f"the directory did not answer {what}", peer=self.address, cause="timeout"
            ) from None
        except BaseException:
            with contextlib.suppress(HopliteError):
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    control.unwanted(fut.result())  # cancelled as the answer came: it is void
                else:
                    control.send(p.CancelLookup(request_id=rid))
            raise
        finally:
            control.forget(rid)
        if isinstance(reply, p.ErrorReply):
            raise from_kind(reply.kind, reply.message, **fields)
        return reply

    # ------------------------------------------------------------ reductions to re-send
    def remember(self, msg: p.ReduceRequest) -> None:
        """Keep a reduction this node requested, to re-send it to a restarted directory (the
        newest :data:`REQUESTED_KEPT`)."""
        self._requested.pop(msg.reduction_id, None)
        self._requested[msg.reduction_id] = msg
        if len(self._requested) > REQUESTED_KEPT:
            del self._requested[next(iter(self._requested))]

    def requested(self, reduction_id: bytes) -> bool:
        """Whether this node requested the reduction ``reduction_id`` (and re-sends it)."""
        return reduction_id in self._requested

    def forget(self, reduction_id: bytes) -> None:
        """Stop re-sending a reduction (it was deleted)."""
        self._requested.pop(reduction_id, None)
