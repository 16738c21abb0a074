"""Members that all share one host: a group's allreduce, or reduce, through shared memory,
signalled member to member over Unix sockets, with no message to the directory and no byte on
the data plane (bench/pages/collectives.md#one-host-allreduce-through-shared-memory).

Each member keeps one shared-memory segment the size of the array (made at its first round,
again only when an array outgrows it) and a Unix socket to every other member (the *mesh*, made
at the group's first allreduce or reduce: :func:`meet`). A round of member ``r`` of ``N``, the array
cut into one shard per member:

1. wait until every member is done reading this member's segment in the round before (``DONE``);
2. copy the array into its segment, but for its own shard ``r``, and tell the others (``IN``,
   with the array's dtype, size, operator and the reduce's root, and the segment's name);
3. once every ``IN`` came: reduce shard ``r`` of every member's segment into shard ``r`` of its
   own array, in place, copy that into shard ``r`` of its segment, and tell the others (``SUM``);
4. once every ``SUM`` came: copy shard ``j`` of member ``j``'s segment into its array, for every
   ``j``, and tell the others (``DONE``).

A reduce is the same round but that only its root copies the shards out (and waits for ``SUM``):
the others reduce their shard into their segment, leaving their array as it was, tell the root
(``SUM``) and every member (``DONE``), and return.

Each shard is reduced once, by one member, in the same order, so every member ends with the same
bits. A member writes its segment only after every other member told it is done reading it, and
reads another's only after that one told it wrote what is read: a member never reads bytes being
written. A member whose ``IN`` differs (dtype, size, operator) fails the round on every member
alike (:class:`CollectiveArgumentError`: each sees every ``IN``; so does one that names another
root, or runs the other collective, and a dtype the library's reductions lack, as on its other
paths), and the mesh stays usable (a read-only result array never reaches it: the collective
stands a copy in for it, see :func:`~hoplite_gpu.collective.allreduce`). So does a member whose
call was refused before it began (an unknown operator, a root out of range: :meth:`Mesh.refuse`),
telling the others in its ``IN``; they fail the round at once.

A member that cannot make its segment (no room in ``/dev/shm``) or whose array is not one this
path takes (device memory) says so in its ``IN``: every member then runs that round on the
directory's schedule (:mod:`.operations`). A member whose round fails (a timeout, a member lost)
leaves the mesh, telling the others (``BREAK``, naming the round): they fail that round too, or,
where they are past it and have read nothing of their next one (steps 1 and 2), run the next
and every later one on the directory's schedule, as it does. A member's socket closing with no
``BREAK`` means its process ended: the round fails with :class:`ObjectLostError` (in a watched
group, :class:`MemberLostError` once the watch reports it). A member's mappings of the others'
segments stay valid whatever happens to them, so nothing here can fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import select
import socket
import struct
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .. import memory
from ..errors import (
    CollectiveArgumentError,
    HopliteError,
    HopliteTimeoutError,
    InvalidArgumentError,
    ObjectLostError,
    PeerLostError,
)
from ..faults import INJECTOR
from ..reduce_ops import ReduceOp, check_dtype, reduce_chunk

if TYPE_CHECKING:
    from .group import Group

#: One signal: sequence number, phase, operator, flags, the reduce's root (``ALL``: an
#: allreduce), the array's bytes, its dtype, the sender's segment name. ``BREAK``: the round at
#: which the sender left, and in ``nbytes`` the rank it found dead, or ``NO_RANK``.
MESSAGE = struct.Struct("<QBBBxIQ16s64s")
IN, SUM, DONE, BREAK = 1, 2, 3, 4
#: Operators by their number in ``IN``.
OPS = list(ReduceOp)
#: Flags of ``IN``: the array is one this path takes (host memory, a segment made for it); the
#: sender refused its call (its arguments: see :meth:`Mesh.refuse`).
TAKES, REFUSED = 1, 2
NO_RANK = 2**64 - 1
ALL = 2**32 - 1
#: A connecting member's first bytes: its group's digest, its rank, the collective's number.
HELLO = struct.Struct("<8sIQ")
#: How often a wait looks at a watched group's state (a member reported lost, an abort).
WATCH_SLICE = 0.1


class Signal(NamedTuple):
    """One decoded :data:`MESSAGE`."""

    seq: int
    phase: int
    op: int
    flags: int
    root: int
    nbytes: int
    dtype: str
    name: str


class Left(Exception):
    """Member ``rank`` sent ``BREAK``: it left the mesh at round ``seq`` (``dead``: the rank it
    found dead there, or None)."""

    def __init__(self, rank: int, seq: int, dead: int | None) -> None:
        super().__init__(rank, seq, dead)
        self.rank, self.seq, self.dead = rank, seq, dead

    @classmethod
    def of(cls, rank: int, signal: Signal) -> Left:
        """Member ``rank``'s ``BREAK`` ``signal``."""
        return cls(rank, signal.seq, None if signal.nbytes == NO_RANK else signal.nbytes)


class Gone(Exception):
    """A member's socket closed with no ``BREAK``: its process ended."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.rank = rank


def goes_host(peers: list[Any]) -> bool:
    """Whether a group's allreduces and reduces run through shared memory (:class:`Mesh`), the same
    answer on every member: every member's schedule is ``auto``, and all share one host's
    memory and listen for the others (:func:`listen`)."""
    keys = {p.host_key for p in peers}
    return (
        len(peers) > 1
        and all(p.schedule == "auto" and p.meet for p in peers)
        and len(keys) == 1
        and "" not in keys
    )


def listen(g: Group) -> str:
    """Open ``g``'s listening socket for its mesh (once), a file under ``/dev/shm`` named like a
    segment (only this user may connect, and :func:`~hoplite_gpu.memory.shm_files.sweep_orphans`
    removes it if this process is killed); its path."""
    if g._listener is not None:
        return str(g._listener.getsockname())
    path = memory.socket_path()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(max(g.world_size, 8))
    except OSError:
        sock.close()
        memory.unlink_quietly(path)
        raise
    sock.setblocking(False)
    g._listener = sock
    weakref.finalize(sock, memory.unlink_quietly, path)
    return path


def close_listener(g: Group) -> None:
    """Close ``g``'s listening socket and remove its file."""
    sock, g._listener = g._listener, None
    if sock is not None:
        path = sock.getsockname()
        sock.close()
        memory.unlink_quietly(path)


def _digest(g: Group) -> bytes:
    return hashlib.blake2b(g.name.encode(), digest_size=8).digest()


def wait_limit(g: Group) -> float:
    """Seconds a wait of ``g``'s may last: its timeout, else the node's default (0: forever)."""
    limit = g.timeout if g.timeout is not None else g.node.config.default_get_timeout
    return limit if limit else math.inf


async def meet(g: Group, seq: int, peers: list[Any], what: str = "allreduce") -> Mesh:
    """Connect ``g``'s members on this host to each other (at collective ``seq``, ``what``
    for errors): member ``i``
    connects to every member below it and accepts every one above, each within the group's
    timeout. Raises ``HopliteTimeoutError`` naming the members that did not come, leaving
    ``g._mesh`` a mesh this member has left."""
    loop = asyncio.get_running_loop()
    n, me = g.world_size, g.rank
    limit = wait_limit(g)
    deadline = loop.time() + limit
    socks: dict[int, socket.socket] = {}

    def late(why: str) -> HopliteTimeoutError:
        missing = sorted(set(range(n)) - set(socks) - {me})
        return HopliteTimeoutError(
            f"{what} #{seq}: {why} within {limit} s (group {g.name!r}, rank {me} of {n})",
            operation=what,
            timeout=limit,
            waiting_for_ranks=missing,
        )

    try:
        for j in range(me):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            socks[j] = sock
            try:
                await asyncio.wait_for(loop.sock_connect(sock, peers[j].meet), _left(loop, deadline))
                await loop.sock_sendall(sock, HELLO.pack(_digest(g), me, seq))
            except TimeoutError:
                raise late(f"rank {j} did not take this member's connection") from None
            except OSError as exc:  # its listener is gone: its group or its process ended
                raise PeerLostError(
                    f"{what} #{seq}: rank {j} cannot be reached on this host: {exc}"
                ) from None
        listener = g._listener
        assert listener is not None
        while len(socks) < n - 1:
            try:
                sock, _ = await asyncio.wait_for(loop.sock_accept(listener), _left(loop, deadline))
            except TimeoutError:
                raise late("ranks did not connect") from None
            sock.setblocking(False)
            try:
                hello = await asyncio.wait_for(_recv_exactly(loop, sock, HELLO.size), _left(loop, deadline))
            except (TimeoutError, OSError):
                sock.close()  # closed, or silent, before its hello: not a member's
                if loop.time() >= deadline:
                    raise late("ranks did not connect") from None
                continue
            digest, rank, their_seq = HELLO.unpack(hello)
            if digest != _digest(g) or not me < rank < n or rank in socks or their_seq != seq:
                sock.close()
                continue  # not a member of this round: never read from
            socks[rank] = sock
    except BaseException:
        # The members it reached learn it left at this round; it runs the later ones on the
        # directory's schedule, as they will.
        for sock in socks.values():
            sock.setblocking(True)
        g._mesh = Mesh(g, socks)
        g._mesh._leave(seq)
        raise
    for sock in socks.values():
        sock.setblocking(True)
    return Mesh(g, socks)


async def meets(g: Group, seq: int, peers: list[Any], what: str) -> bool:
    """Make ``g``'s mesh (:func:`meet`) if it has none and every member shares this host
    (:func:`goes_host`); whether it did."""
    if g._mesh is not None or not goes_host(peers):
        return False
    g._mesh = await meet(g, seq, peers, what)
    return True


def _left(loop: asyncio.AbstractEventLoop, deadline: float) -> float | None:
    left = deadline - loop.time()
    return None if math.isinf(left) else max(left, 0.0)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = await loop.sock_recv(sock, size - len(data))
        if not more:
            raise ConnectionResetError("closed during the hello")
        data += more
    return data


class Mesh:
    """This member's sockets to the other members of its group on this host, its segment and
    its mappings of theirs: the rounds of :meth:`reduce` (see the module's text). Every
    method runs on the caller's thread, one round at a time."""

    def __init__(self, g: Group, socks: dict[int, socket.socket]) -> None:
        self.rank, self.world = g.rank, g.world_size
        self.socks = socks
        self.broken = False  # this member left the mesh: no more rounds
        self._inbox = {r: bytearray() for r in socks}
        self._segment: np.ndarray[Any, Any] | None = None  # flat uint8, in shared memory
        self._mapped: dict[int, tuple[str, np.ndarray[Any, Any]]] = {}  # rank -> (name, view)
        self._pending: int | None = None  # the round whose DONE is not read yet
        self._round = "allreduce", math.inf  # the round's collective and wait limit, for errors

    def reduce(
        self,
        seq: int,
        flat: Any,
        op: ReduceOp,
        takes: bool,
        limit: float,
        check: Callable[[], None],
        root: int | None = None,
        fault: str = "",
    ) -> bool:
        """Round ``seq`` on ``flat`` (the caller's array, a flat view) with ``op``: an allreduce
        (``root`` None), or a reduce into ``root``'s array (the others' stay as they were, and
        return once they reduced their shard). True once it is done here; False when the group
        runs this round on the directory's schedule instead, every member alike (a member did
        not take it: ``takes`` False on one, or one left the mesh). ``limit``: seconds each wait
        may last; ``check`` raises a watched group's error (called at least every
        :data:`WATCH_SLICE` seconds of a wait). ``fault``: the object (hex) whose armed faults
        (:mod:`hoplite_gpu.faults`) fire in the round: ``serve`` in the copy in, ``reduce``
        around the reduction, ``receive`` in the copy out, ``report`` before the last signal."""
        deadline = time.monotonic() + limit
        n, me = self.world, self.rank
        what = "allreduce" if root is None else "reduce"
        self._round = what, limit
        cuts = [flat.size * j // n for j in range(n + 1)]
        item = flat.dtype.itemsize

        def reach(event: str, pos: int) -> None:
            if fault and INJECTOR.armed:
                INJECTOR.check(event, fault, pos, flat.nbytes)

        try:
            self._done_reading(deadline, check)
            segment = self._segment_for(flat.nbytes) if takes else None
            mine = self._typed(segment, flat) if segment is not None else None
            if segment is not None:
                reach("serve", 0)
                memory.write_at(segment, 0, flat[: cuts[me]])
                reach("serve", cuts[me] * item)
                memory.write_at(segment, cuts[me + 1] * item, flat[cuts[me + 1] :])
                reach("serve", flat.nbytes)
            name = memory.segment_name(segment) if segment is not None else ""
            code, to = OPS.index(op), ALL if root is None else root
            flags = TAKES if mine is not None else 0
            self._send(seq, IN, code, flags, to, flat.nbytes, flat.dtype.str, name)
            signals = self._gather(seq, IN, deadline, check)
        except Left as exc:
            if exc.dead is None and exc.seq < seq:  # it left after a round this member finished
                self._leave(exc.seq)
                return False
            raise self._failed(what, seq, exc) from None
        except Gone as exc:
            raise self._failed(what, seq, exc) from None
        except BaseException:
            self._leave(seq)
            raise
        refused = sorted(j for j, s in signals.items() if s.flags & REFUSED)
        if refused:  # (before anything else: that member has left the round)
            raise CollectiveArgumentError(
                f"{what} #{seq}: rank {refused[0]} refused its call (its arguments)"
            )
        if mine is None or not all(s.flags & TAKES for s in signals.values()):
            return False  # every member saw the same flags: none goes on here
        _check_alike(what, seq, me, flat, code, to, signals)
        gathers = root is None or root == me  # the others' results land here
        try:
            views = {j: self._view(j, s, flat) for j, s in signals.items()}
            shard = slice(cuts[me], cuts[me + 1])
            own = flat[shard]
            reach("reduce", 0)
            children = [views[j][shard] for j in sorted(views)]
            reduce_chunk(op, own, children, own if gathers else mine[shard], count=n)
            if root is None and segment is not None:
                memory.write_at(segment, cuts[me] * item, own)
            reach("reduce", flat.nbytes)
            if gathers:
                if root is None:
                    self._send(seq, SUM)
                self._gather(seq, SUM, deadline, check)
                landed = (cuts[me + 1] - cuts[me]) * item
                for j, view in views.items():
                    np.copyto(flat[cuts[j] : cuts[j + 1]], view[cuts[j] : cuts[j + 1]])
                    landed += (cuts[j + 1] - cuts[j]) * item
                    reach("receive", landed)
            else:
                self._send(seq, SUM, only=root)
            reach("report", flat.nbytes)
            self._send(seq, DONE)
            self._pending = seq
        except (Left, Gone) as exc:
            raise self._failed(what, seq, exc) from None
        except BaseException:
            self._leave(seq)
            raise
        return True

    def refuse(self, seq: int, limit: float, check: Callable[[], None]) -> None:
        """Round ``seq``, an allreduce or reduce this member refused before it began (its
        arguments): tell the others (``IN`` with :data:`REFUSED`), so that they fail it alike
        and at once, and read their ``IN`` so that the next round starts in step. A failure
        here leaves the mesh, as in :meth:`reduce`."""
        deadline = time.monotonic() + limit
        try:
            self._done_reading(deadline, check)
            self._send(seq, IN, flags=REFUSED)
            self._gather(seq, IN, deadline, check)
        except (Left, Gone) as exc:
            raise self._failed(self._round[0], seq, exc) from None
        except BaseException:
            self._leave(seq)
            raise

    def _failed(self, what: str, seq: int, exc: Left | Gone) -> HopliteError:
        """Leave the mesh after ``exc`` in round ``seq`` (of ``what``); the error it raises."""
        dead = exc.rank if isinstance(exc, Gone) else exc.dead
        self._leave(seq, dead)
        if dead is not None:
            return ObjectLostError(
                f"{what} #{seq}: rank {dead}'s process ended during the round ({self._who()})",
                object_id="",
                lost_ranks=[dead],
            )
        return HopliteError(f"{what} #{seq}: rank {exc.rank} failed the round ({self._who()})")

    def close(self) -> None:
        """Leave the mesh (``BREAK`` to every member) and let the segments go."""
        self._leave(NO_RANK)
        self._segment = None
        self._mapped.clear()

    # ------------------------------------------------------------ plumbing
    def _who(self) -> str:
        return f"rank {self.rank} of {self.world}"

    def _segment_for(self, nbytes: int) -> np.ndarray[Any, Any] | None:
        """This member's segment, at least ``nbytes`` (None: no room in ``/dev/shm``). A new one
        is filled through its file the first time (:func:`~hoplite_gpu.memory.write_at`: cheaper
        than mapping its new pages first), and its pages are mapped when it is used again."""
        if self._segment is None or self._segment.size < nbytes:
            self._segment = None  # (its file goes with it; the others' mappings stay valid)
            self._segment = memory.new_segment(max(nbytes, 1), populate=False)
        else:
            memory.map_pages(self._segment)
        return self._segment

    def _done_reading(self, deadline: float, check: Callable[[], None]) -> None:
        """Wait until every other member is done reading this member's segment in the round
        before (its ``DONE``), if that round's ``DONE`` is not read yet."""
        if self._pending is not None:
            self._gather(self._pending, DONE, deadline, check)
            self._pending = None

    @staticmethod
    def _typed(buf: np.ndarray[Any, Any], flat: Any) -> np.ndarray[Any, Any]:
        return buf[: flat.nbytes].view(flat.dtype)

    def _view(self, rank: int, signal: Signal, flat: Any) -> np.ndarray[Any, Any]:
        """Member ``rank``'s segment, mapped read-only (kept between rounds), as ``flat``'s
        dtype. A segment that cannot be mapped fails the round (on the others too: they wait
        for this member's ``SUM``)."""
        kept = self._mapped.get(rank)
        if kept is None or kept[0] != signal.name or kept[1].size < flat.nbytes:
            self._mapped.pop(rank, None)
            view = memory.map_whole(signal.name, flat.nbytes)
            if view is None:
                raise HopliteError(f"rank {self.rank} cannot map rank {rank}'s segment {signal.name!r}")
            kept = self._mapped[rank] = (signal.name, view)
        return self._typed(kept[1], flat)

    def _send(
        self,
        seq: int,
        phase: int,
        op: int = 0,
        flags: int = 0,
        root: int = ALL,
        nbytes: int = 0,
        dtype: str = "",
        name: str = "",
        only: int | None = None,
    ) -> None:
        """Signal ``phase`` of round ``seq`` to every other member (``only``: to that one)."""
        message = MESSAGE.pack(seq, phase, op, flags, root, nbytes, dtype.encode(), name.encode())
        for rank, sock in self.socks.items():
            if only is not None and rank != only:
                continue
            try:
                sock.sendall(message)
            except OSError:
                self._closed(rank)

    def _gather(self, seq: int, phase: int, deadline: float, check: Callable[[], None]) -> dict[int, Signal]:
        """Every other member's signal ``phase`` of round ``seq``, by rank."""
        got: dict[int, Signal] = {}
        poller = select.poll()
        by_fd = {sock.fileno(): rank for rank, sock in self.socks.items()}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        while len(got) < len(self.socks):
            check()
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(self.socks) - set(got))
                what, limit = self._round
                raise HopliteTimeoutError(
                    f"{what} #{seq}: ranks {missing} did not come within {limit} s",
                    operation=what,
                    timeout=limit,
                    waiting_for_ranks=missing,
                )
            for fd, _ in poller.poll(min(left, WATCH_SLICE) * 1000):
                rank = by_fd[fd]
                signal = self._read(rank)
                if signal is None:
                    continue
                if signal.phase == BREAK:
                    raise Left.of(rank, signal)
                if (signal.seq, signal.phase) != (seq, phase):
                    raise HopliteError(
                        f"{self._round[0]} #{seq}: rank {rank} sent phase {signal.phase} of #{signal.seq}, "
                        f"not phase {phase} ({self._who()})"
                    )
                got[rank] = signal
                poller.unregister(fd)
        return got

    def _closed(self, rank: int) -> None:
        """``rank``'s socket is closed: raise :class:`Left` if it said ``BREAK`` before it
        closed it (unread yet), else :class:`Gone`."""
        while True:
            try:
                more = self.socks[rank].recv(MESSAGE.size, socket.MSG_DONTWAIT)
            except OSError:
                more = b""
            if not more:
                raise Gone(rank)
            inbox = self._inbox[rank]
            inbox += more
            while len(inbox) >= MESSAGE.size:
                signal = self._decode(inbox)
                if signal.phase == BREAK:
                    raise Left.of(rank, signal)

    def _read(self, rank: int) -> Signal | None:
        """The next whole signal from ``rank``, or None while it is not all there."""
        inbox = self._inbox[rank]
        if len(inbox) < MESSAGE.size:
            try:
                more = self.socks[rank].recv(MESSAGE.size - len(inbox))
            except OSError:
                more = b""
            if not more:
                raise Gone(rank)
            inbox += more
            if len(inbox) < MESSAGE.size:
                return None
        return self._decode(inbox)

    @staticmethod
    def _decode(inbox: bytearray) -> Signal:
        """The signal at the head of ``inbox``, taken off it."""
        seq, phase, op, flags, root, nbytes, dtype, name = MESSAGE.unpack(inbox[: MESSAGE.size])
        del inbox[: MESSAGE.size]
        text = dtype.rstrip(b"\0").decode(), name.rstrip(b"\0").decode()
        return Signal(seq, phase, op, flags, root, nbytes, *text)

    def _leave(self, seq: int, dead: int | None = None) -> None:
        """Send ``BREAK`` (round ``seq``, naming ``dead``) to every member, close every socket,
        and take no more rounds (once)."""
        if self.broken:
            return
        self.broken = True
        message = MESSAGE.pack(seq, BREAK, 0, 0, ALL, NO_RANK if dead is None else dead, b"", b"")
        for sock in self.socks.values():
            with contextlib.suppress(OSError):
                sock.sendall(message)
            sock.close()


def _check_alike(
    what: str, seq: int, rank: int, flat: Any, code: int, root: int, signals: dict[int, Signal]
) -> None:
    """Raise ``CollectiveArgumentError`` where a member's array, operator or collective
    differs from this member's, or reductions do not support the dtype (each member sees every
    ``IN``: all raise alike)."""

    def told(op: int, to: int) -> str:
        name = OPS[op].value if op < len(OPS) else str(op)
        return f"an allreduce with {name}" if to == ALL else f"a reduce to rank {to} with {name}"

    for j, s in sorted(signals.items()):
        if (s.dtype, s.nbytes, s.op, s.root) != (flat.dtype.str, flat.nbytes, code, root):
            raise CollectiveArgumentError(
                f"{what} #{seq}: rank {j} runs {told(s.op, s.root)} of {s.nbytes} bytes of {s.dtype}, "
                f"rank {rank} {told(code, root)} of {flat.nbytes} bytes of {flat.dtype.str}: every "
                "member's array must match"
            )
    try:
        check_dtype(flat.dtype)  # as on the directory's paths, whichever path a group takes
    except InvalidArgumentError as exc:
        raise CollectiveArgumentError(f"{what} #{seq}: {exc}") from None
