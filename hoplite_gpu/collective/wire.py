"""The direct ring on the caller's thread: a group's large allreduce (and reduce, along the chain
to its root) passed member to member over connections each member keeps to the next, as Gloo's
ring is, with no I/O thread and no pull request in a round
(bench/pages/collectives.md#the-ring-on-the-callers-thread).

It takes the rounds of :mod:`.ring`'s direct ring and chain where every member runs the TCP data
plane. Each member makes ``out``, a connection to the member after it, at the group's first such
round (over that member's data plane, authenticated: :meth:`~hoplite_gpu.Node.hand_over`), and
keeps ``inn``, the one the member before made to it. A round is Gloo's plain ring cut into
pieces: the caller's thread receives each piece of the running sums from ``inn``, adds its own
chunk in place and lets a helper thread send the sum on to ``out``; then the whole sums go round
the same way, into the caller's array. Every stream starts with :data:`WIRE`: the round's number
and the sender's dtype, operator and element count, checked against the receiver's before it
adds anything in (``CollectiveArgumentError``); a member acknowledges a round once it landed
whole (:data:`ACK`), and the member before returns only then.

Failures: a member whose round fails closes both its connections (the member after it then reads
the end of its stream and fails too, and so on round the ring), and makes them again at its next
round; one that finds ``inn`` closed before a round's first byte waits for the new one. A member
lost fails the call (``MemberLostError`` in a watched group, whose error every wait checks every
:data:`~.host.WATCH_SLICE` seconds; ``ObjectLostError`` otherwise). Every wait ends by the
group's timeout. Nothing of a round is known to the directory, so nothing of it is repaired."""

from __future__ import annotations

import contextlib
import queue
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import memory
from ..dataplane.sockets import blocking_with_timeouts, shut, stale
from ..dataplane.sockets import flat as flat_bytes
from ..errors import (
    CollectiveArgumentError,
    HopliteError,
    HopliteTimeoutError,
    ObjectLostError,
    PeerLostError,
    TransportError,
)
from ..faults import INJECTOR
from ..object_id import ObjectID
from ..reduce_ops import ReduceOp, reduce_chunk
from .host import WATCH_SLICE, goes_host, wait_limit
from .ring import HEADER, Peer, _described, goes_direct

if TYPE_CHECKING:
    from .group import Group

#: What each round's stream starts with: the round's number, a flag (:data:`DATA`, or
#: :data:`REFUSED`: no data follows), then :data:`.ring.HEADER`'s dtype, operator and count.
WIRE = struct.Struct("<QB7x" + HEADER.format.lstrip("<"))
DATA, REFUSED = 0, 1
#: What a member sends back once a round landed whole: the round's number.
ACK = struct.Struct("<Q")
#: Bytes received, added and passed on at a time: a step's sum goes on to the next member after
#: its first piece, not its whole chunk.
PIECE = 512 << 10


class _Round:
    """One round's stream to ``out``, shared by the caller's thread (which says how much of it is
    ready) and the sender (which sends it as it is)."""

    def __init__(self, sock: socket.socket, header: bytes, views: list[memoryview], ready: int, fault: str):
        self.sock, self.header, self.views, self.fault = sock, header, views, fault
        self.total = sum(len(v) for v in views)
        self.ready = ready
        self.cond = threading.Condition()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.abort = False

    def advance(self, ready: int) -> None:
        with self.cond:
            self.ready = ready
            self.cond.notify()

    def send(self) -> None:
        """On the sender's thread: ``header``, then the stream's bytes as they are ready."""
        try:
            self._send_all(memoryview(self.header))
            pos = 0
            for view in self.views:
                base, end = pos, pos + len(view)
                while pos < end:
                    with self.cond:
                        while self.ready <= pos and not self.abort:
                            self.cond.wait(WATCH_SLICE)
                        ready = self.ready
                    if self.abort:
                        return
                    if self.fault and INJECTOR.armed:
                        INJECTOR.check("serve", self.fault, pos, self.total)
                    stop = min(ready, end, pos + PIECE)  # (a fault fires between pieces)
                    self._send_all(view[pos - base : stop - base])
                    pos = stop
            if self.fault and INJECTOR.armed:
                INJECTOR.check("serve", self.fault, pos, self.total)
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def _send_all(self, data: memoryview) -> None:
        while len(data):
            try:
                data = data[self.sock.send(data) :]
            except BlockingIOError:  # a slice of SO_SNDTIMEO: the next member reads slowly
                if self.abort:
                    raise
                continue


class Wire:
    """A member's connections along its group's ring and the thread that sends (see the module's
    text). Its rounds run one at a time, on the caller's thread."""

    def __init__(self, g: Group) -> None:
        self.node = g.node
        self.rank, self.world = g.rank, g.world_size
        self._oid = g.object_id
        self.pred, self.succ = (g.rank - 1) % g.world_size, (g.rank + 1) % g.world_size
        # What the member after takes ``out`` by, and this one ``inn``. A group destroyed and made
        # again under its name has the same (destroy drops what was handed over and not taken).
        self.out_key = ObjectID.from_name(f"hoplite-wire/{g.name}/{g.rank}")
        self.in_key = ObjectID.from_name(f"hoplite-wire/{g.name}/{self.pred}")
        self.out: socket.socket | None = None
        self.inn: socket.socket | None = None
        self._jobs: queue.SimpleQueue[_Round | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._scratch = np.empty(0, np.uint8)  # a piece received, to add in
        self._partial = np.empty(0, np.uint8)  # a reduce's partial reduction, passed on
        self._what = "allreduce"  # the round's collective, for errors
        self._lock = threading.Lock()

    def allreduce(
        self, seq: int, flat: Any, op: ReduceOp, peers: list[Peer], limit: float, check: Callable[[], None]
    ) -> None:
        """Round ``seq``: allreduce ``flat`` (a C-contiguous 1-D host array of at least one
        element per member) in place. ``limit``: seconds the round may wait in all; ``check``
        raises the watched group's error."""
        deadline = time.monotonic() + limit
        n, me = self.world, self.rank
        cuts = [flat.size * j // n for j in range(n + 1)]

        def region(c: int) -> Any:
            return flat[cuts[c % n] : cuts[c % n + 1]]

        # What this member sends: its own chunk, the running sums it made, then the whole sums it
        # relays; what it receives: the running sums to add its chunk to, then the whole sums.
        sends = [region(me - i) for i in range(n)] + [region(me + 1 - t) for t in range(1, n - 1)]
        lands = [region(me - 1 - j) for j in range(n - 1)] + [region(me - t) for t in range(n - 1)]
        head = region(me).nbytes
        relayed = sum(a.nbytes for a in lands[:-1])
        with self._taken(seq, flat, op, "allreduce", limit) as header:
            out = self._connect(peers[self.succ], seq, header, deadline, check, limit)
            fault = self.fault(seq, "ring-out")
            rnd = _Round(out, b"", [flat_bytes(a) for a in sends], head, fault)
            self._post(rnd)
            try:
                inn = self._header(seq, header, deadline, check, rnd, limit)
                done, total = 0, relayed + lands[-1].nbytes
                for j, into in enumerate(lands):
                    raw = flat_bytes(into)
                    for off in range(0, len(raw), PIECE):
                        k = min(PIECE, len(raw) - off)
                        _reach(fault, "receive", done, total)
                        if j < n - 1:  # a running sum: add this member's chunk into it
                            buf = self._piece(k)
                            self._recv(inn, flat_bytes(buf), seq, deadline, check, rnd, limit)
                            _reach(fault, "reduce", done, total)
                            self._add(seq, op, into, off, buf, into, n if j == n - 2 else 0)
                        else:  # a whole sum, in place
                            self._recv(inn, raw[off : off + k], seq, deadline, check, rnd, limit)
                        done += k
                        rnd.advance(head + min(done, relayed))
                _reach(fault, "report", total, total)
                self._acknowledge(inn, seq)
                self._sent(rnd, seq, deadline, check, limit)
            except BaseException:
                self._abandon(rnd)
                raise

    def reduce(
        self,
        seq: int,
        flat: Any,
        op: ReduceOp,
        peers: list[Peer],
        dst: int,
        limit: float,
        check: Callable[[], None],
    ) -> None:
        """Round ``seq``: reduce every member's ``flat`` into ``dst``'s, in place, along the chain
        ``dst+1 -> dst+2 -> ... -> dst`` (:func:`~.ring.direct_reduce`'s): the first member sends
        its array, each next one receives the partial reduction, adds its array in (in a buffer
        the wire keeps: its array stays as it was) and sends it on, piece by piece; ``dst`` adds
        the last into its array. The others return once the member after has what they send whole."""
        deadline = time.monotonic() + limit
        me, first = self.rank, (dst + 1) % self.world
        fault = self.fault(seq, "chain-out")
        rnd: _Round | None = None
        with self._taken(seq, flat, op, "reduce", limit) as header:
            if me != dst:
                out = self._connect(peers[self.succ], seq, header, deadline, check, limit)
                if me == first:
                    views, ready = [flat_bytes(flat)], flat.nbytes
                else:
                    if self._partial.nbytes < flat.nbytes:
                        self._partial = np.empty(flat.nbytes, np.uint8)
                    views, ready = [flat_bytes(self._partial[: flat.nbytes])], 0
                rnd = _Round(out, b"", views, ready, fault)
                self._post(rnd)
            try:
                if me != first:
                    inn = self._header(seq, header, deadline, check, rnd, limit)
                    for off in range(0, flat.nbytes, PIECE):
                        k = min(PIECE, flat.nbytes - off)
                        _reach(fault, "receive", off, flat.nbytes)
                        if rnd is None:  # the root: into its array
                            buf = self._piece(k)
                            self._recv(inn, flat_bytes(buf), seq, deadline, check, rnd, limit)
                            _reach(fault, "reduce", off, flat.nbytes)
                            self._add(seq, op, flat, off, buf, flat, self.world)
                        else:  # the partial reduction, passed on
                            buf = self._partial[off : off + k]
                            self._recv(inn, flat_bytes(buf), seq, deadline, check, rnd, limit)
                            _reach(fault, "reduce", off, flat.nbytes)
                            self._add(seq, op, flat, off, buf, None, 0)
                            rnd.advance(off + k)
                    _reach(fault, "report", flat.nbytes, flat.nbytes)
                    self._acknowledge(inn, seq)
                if rnd is not None:
                    self._sent(rnd, seq, deadline, check, limit)
            except BaseException:
                self._abandon(rnd)
                raise

    def refuse(self, seq: int) -> None:
        """This member refused round ``seq`` before it began: tell the member after it (which
        fails the round with ``CollectiveArgumentError`` if it runs it here) and close both
        connections (the member before may have sent this round: it is not read)."""
        out = self.out
        if out is not None and not stale(out):
            header = WIRE.pack(seq, REFUSED, b"", b"", 0)
            # At most a few slices: the member after reads what is before it unless it is gone.
            with contextlib.suppress(OSError, HopliteTimeoutError):
                _send_within(
                    out,
                    header,
                    lambda: None,
                    time.monotonic() + 10 * WATCH_SLICE,
                    lambda: self._late(seq, "", 0),
                )
        self.close()

    def close(self) -> None:
        """Close both connections (the sender, if blocked, wakes); a next round makes them again."""
        for sock in (self.out, self.inn):
            if sock is not None:
                shut(sock)
        self.out = self.inn = None

    def stop(self) -> None:
        """Close for good: the connections, the sender's thread and what was handed over unread."""
        self.close()
        self._jobs.put(None)
        self.node.drop_handed([self.in_key])

    # ------------------------------------------------------------ plumbing
    def fault(self, seq: int, kind: str) -> str:
        """The object whose armed faults fire in this member's round ``seq``
        (:mod:`hoplite_gpu.faults`): :mod:`.ring`'s object of the same round (``kind``)."""
        return self._oid(seq, kind, self.rank).hex() if INJECTOR.armed else ""

    @contextlib.contextmanager
    def _taken(self, seq: int, flat: Any, op: ReduceOp, what: str, limit: float) -> Iterator[bytes]:
        """The wire, held for round ``seq`` (``what``, for errors); gives the round's header."""
        if not self._lock.acquire(timeout=min(max(0.0, limit), threading.TIMEOUT_MAX)):
            raise self._late(seq, "this member's previous round did not end", limit)
        try:
            self._what = what
            yield WIRE.pack(seq, DATA, np.dtype(flat.dtype).name.encode(), op.value.encode(), flat.size)
        finally:
            self._lock.release()

    def _piece(self, k: int) -> Any:
        """A receive buffer of ``k`` bytes, kept from round to round."""
        if self._scratch.nbytes < k:
            self._scratch = np.empty(PIECE, np.uint8)
        return self._scratch[:k]

    def _add(self, seq: int, op: ReduceOp, flat: Any, off: int, buf: Any, into: Any, inputs: int) -> None:
        """Add the piece ``buf`` landed (bytes ``off`` on of ``into``, a typed array) and the same
        elements of ``flat``, into ``into`` (None: into ``buf``); ``inputs`` > 0 finishes AVG."""
        item = flat.dtype.itemsize
        mine = flat[off // item : (off + buf.nbytes) // item]
        theirs = buf.view(flat.dtype)
        try:
            if into is None:
                reduce_chunk(op, theirs, [mine], theirs, inputs)
            else:
                target = into[off // item : (off + buf.nbytes) // item]
                reduce_chunk(op, target, [theirs], target, inputs)
        except Exception as exc:
            raise HopliteError(f"{self._what} #{seq}: the reduction failed: {exc}") from exc

    def _sent(self, rnd: _Round, seq: int, deadline: float, check: Callable[[], None], limit: float) -> None:
        """Wait for the sender to have sent the round, and the member after to have it whole."""
        while not rnd.done.wait(WATCH_SLICE):
            check()
            if time.monotonic() >= deadline:
                raise self._late(seq, f"rank {self.succ} did not read this member's part", limit)
        if rnd.error is not None:
            raise self._lost(seq, self.succ, rnd.error)
        got = bytearray(ACK.size)
        self._recv(rnd.sock, memoryview(got), seq, deadline, check, None, limit, who=self.succ)
        if ACK.unpack(got)[0] != seq:
            raise HopliteError(f"{self._what} #{seq}: rank {self.succ} acknowledged #{ACK.unpack(got)[0]}")

    def _acknowledge(self, inn: socket.socket, seq: int) -> None:
        """Tell the member before that round ``seq`` landed here whole: it returns then (a member
        that fails a round closes instead, so that its predecessor fails that round too)."""
        with contextlib.suppress(OSError):  # (it failed meanwhile: this member has its bytes)
            inn.sendall(ACK.pack(seq))

    def _abandon(self, rnd: _Round | None) -> None:
        """A round failed here: stop its sender and close both connections."""
        if rnd is not None:
            rnd.abort = True
        self.close()
        if rnd is not None:
            rnd.done.wait(WATCH_SLICE * 10)  # (the sender wakes at once: its socket is shut)

    def _post(self, rnd: _Round) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._sending, name="hoplite-wire", daemon=True)
            self._thread.start()
        self._jobs.put(rnd)

    def _sending(self) -> None:
        while True:
            rnd = self._jobs.get()
            if rnd is None:
                return
            rnd.send()

    def _connect(
        self, peer: Peer, seq: int, header: bytes, deadline: float, check: Callable[[], None], limit: float
    ) -> socket.socket:
        """``out`` with the round's ``header`` sent on it, made again where the member after
        closed it (it failed a round). The header goes first, from this thread: a member that
        fails the round after it is read to have failed it (its stream ends in the round), not
        to have left an earlier one."""
        for _ in range(2):
            if self.out is not None and stale(self.out):
                shut(self.out)
                self.out = None
            if self.out is None:
                try:
                    sock = self.node.hand_over(peer.host, peer.port, self.out_key)
                except (PeerLostError, TransportError) as exc:
                    raise self._lost(seq, self.succ, exc) from None
                blocking_with_timeouts(sock, WATCH_SLICE)
                self.out = sock
            try:
                _send_within(
                    self.out,
                    header,
                    check,
                    deadline,
                    lambda: self._late(seq, f"rank {self.succ} did not read the round before", limit),
                )
                return self.out
            except (BrokenPipeError, ConnectionResetError):  # closed by the member after since: again
                shut(self.out)
                self.out = None
        raise self._lost(seq, self.succ, ConnectionResetError("it closed the connection made for the round"))

    def _inbound(
        self, seq: int, deadline: float, check: Callable[[], None], rnd: _Round | None, limit: float
    ) -> socket.socket:
        """``inn``, waiting for the member before to make it where it has not."""
        while self.inn is None:
            check()
            if rnd is not None and rnd.error is not None:
                raise self._lost(seq, self.succ, rnd.error)
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._late(seq, f"rank {self.pred} did not connect", limit)
            sock = self.node.take_handed(self.in_key, min(left, WATCH_SLICE))
            if sock is not None:
                blocking_with_timeouts(sock, WATCH_SLICE)
                self.inn = sock
        return self.inn

    def _header(
        self,
        seq: int,
        header: bytes,
        deadline: float,
        check: Callable[[], None],
        rnd: _Round | None,
        limit: float,
    ) -> socket.socket:
        """``inn``, once its round ``seq`` header is read and matches this member's: a
        connection closed before a round's first byte (the member before failed an earlier
        round), or that starts with an earlier round, is closed and a newer one waited on."""
        got = bytearray(WIRE.size)
        while True:
            inn = self._inbound(seq, deadline, check, rnd, limit)
            try:
                self._recv(inn, memoryview(got), seq, deadline, check, rnd, limit, first=True)
            except _Empty:
                shut(inn)
                self.inn = None
                continue
            their_seq, flag = WIRE.unpack(got)[:2]
            if their_seq < seq:
                # A round this member did not run here (it refused it, or failed before): the
                # member before fails it too, and makes the connection again at its next round.
                shut(inn)
                self.inn = None
                continue
            if their_seq != seq:
                raise HopliteError(
                    f"{self._what} #{seq}: rank {self.pred} sent round #{their_seq} on the ring "
                    f"(rank {self.rank} of {self.world}): members called their collectives in other "
                    "orders, or with arrays of which only some take the ring"
                )
            if flag == REFUSED:
                raise CollectiveArgumentError(
                    f"{self._what} #{seq}: rank {self.pred} refused its call (its arguments)"
                )
            theirs = bytes(got[WIRE.size - HEADER.size :])
            mine = header[WIRE.size - HEADER.size :]
            if theirs != mine:
                raise CollectiveArgumentError(
                    f"{self._what} #{seq}: the member before this one has {_described(theirs)}, "
                    f"this one {_described(mine)}: every member's array must match"
                )
            return inn

    def _recv(
        self,
        sock: socket.socket,
        view: memoryview,
        seq: int,
        deadline: float,
        check: Callable[[], None],
        rnd: _Round | None,
        limit: float,
        first: bool = False,
        who: int | None = None,
    ) -> None:
        """Fill ``view`` from ``sock`` (the caller's thread blocked in the kernel, a slice at a
        time), checking between slices the group, the deadline and the sender."""
        got, size = 0, len(view)
        while got < size:
            error: OSError | None = None
            try:
                k = sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
            except BlockingIOError:  # a slice of SO_RCVTIMEO
                check()
                if rnd is not None and rnd.error is not None:
                    raise self._lost(seq, self.succ, rnd.error) from None
                if time.monotonic() >= deadline:
                    late = (
                        f"rank {self.pred} did not send its part"
                        if who is None
                        else f"rank {who} did not read"
                    )
                    raise self._late(seq, late, limit) from None
                continue
            except OSError as exc:
                k, error = 0, exc
            if k == 0:
                if first and got == 0:
                    raise _Empty()
                ended = error or ConnectionResetError("the connection ended")
                raise self._lost(seq, self.pred if who is None else who, ended)
            got += k

    def _lost(self, seq: int, rank: int, exc: BaseException) -> ObjectLostError:
        return ObjectLostError(
            f"{self._what} #{seq}: rank {rank}'s connection on the ring ended during the round "
            f"(rank {self.rank} of {self.world}): {type(exc).__name__}: {exc}",
            object_id=self._oid(seq, "ring-out", rank).hex(),
        )

    def _late(self, seq: int, why: str, limit: float) -> HopliteTimeoutError:
        return HopliteTimeoutError(
            f"{self._what} #{seq}: {why} within {limit} s", operation=self._what, timeout=limit
        )


def _reach(fault: str, event: str, pos: int, size: int) -> None:
    """Where armed faults (:mod:`hoplite_gpu.faults`) on ``fault``, the round's object, fire:
    ``receive`` before each piece lands, ``reduce`` before it is added in, ``report`` before the
    round is acknowledged (``serve``: as the sender sends)."""
    if fault and INJECTOR.armed:
        INJECTOR.check(event, fault, pos, size)


def _send_within(
    sock: socket.socket,
    data: bytes,
    check: Callable[[], None],
    deadline: float,
    late: Callable[[], Exception],
) -> None:
    """Send ``data`` (a header) from the caller's thread, ``check`` and ``deadline`` (past it:
    ``late()``) checked between slices of ``SO_SNDTIMEO``."""
    view = memoryview(data)
    while len(view):
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:  # the member after has not read the round before yet
            check()
            if time.monotonic() >= deadline:
                raise late() from None


class _Empty(Exception):
    """A connection that ended before a round's first byte."""


#: What a round's path on the I/O thread returns where the round goes on the wire
#: (:func:`on_wire` runs it then, on the caller's thread).
ON_WIRE = object()


def goes_wire(g: Group, flat: Any, sharing: bool = False) -> bool:
    """Whether an allreduce (a reduce: ``sharing``) of ``flat`` goes on the wire: ``g``'s members
    know each other (:func:`~.ring.ring_peers`), take the direct ring (the reduce's chain:
    :func:`~.ring.goes_direct`; not where their shared memory does, :func:`~.host.goes_host`,
    unless their mesh broke) and all run the TCP data plane, and ``flat`` is large enough for
    the direct ring."""
    peers = g._peers
    if sharing and goes_host(peers) and not (g._mesh is not None and g._mesh.broken):
        return False  # the members' shared memory takes it (collective.host), or has refused it
    return (
        goes_direct(peers, sharing)
        and all(p.plane == "tcp" for p in peers)
        and flat.size >= g.world_size
        and flat.nbytes >= g.node.config.direct_min_bytes
    )


def on_wire(g: Group, seq: int, flat: Any, op: ReduceOp, root: int | None = None) -> bool:
    """Round ``seq``, an allreduce of ``flat`` (a flat view of the caller's array; with ``root``
    a reduce into ``root``'s), on the wire where it goes there (:func:`goes_wire`), on the
    caller's thread; whether it did. Device memory goes through a host copy (the TCP plane sends
    host bytes anyway)."""
    if not goes_wire(g, flat, root is not None):
        return False
    g._raise_if_broken()
    wire = g._wire
    if wire is None:
        wire = g._wire = Wire(g)
        weakref.finalize(g, wire.stop)  # (a group dropped without destroy: its thread ends)
    host = flat if isinstance(flat, np.ndarray) else memory.to_host(flat).reshape(-1)
    what = "allreduce" if root is None else "reduce"

    def check() -> None:
        g._raise_if_broken()
        if g.node.closed:
            raise HopliteError(f"{what} #{seq}: the node closed")

    def run() -> None:
        if root is None:
            wire.allreduce(seq, host, op, g._peers, wait_limit(g), check)
        else:
            wire.reduce(seq, host, op, g._peers, root, wait_limit(g), check)

    try:
        g._call(run)
    except ObjectLostError as exc:
        if g._watching is None:
            raise
        g._run(_raise(exc))  # the watch's MemberLostError, once it reports the member
        raise
    if host is not flat and root in (None, g.rank):
        memory.copy_into(flat, host)
    if g._owned:
        g._run(g._delete_before(seq))
    return True


async def _raise(exc: BaseException) -> None:
    raise exc
