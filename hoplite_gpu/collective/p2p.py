"""Point-to-point messages between two members of a :class:`~.group.Group`: :func:`send`,
:func:`recv` and :func:`recv_any` (see :mod:`hoplite_gpu.collective`). Only the two members take
part: the others' sequence of collectives is unaffected."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from .group import Group, _check_group, _check_peer, _check_tag
from .operations import _copy


def send(array: Any, dst_rank: int, group: Group, tag: int = 0) -> None:
    """Send ``array`` to ``dst_rank``, which receives it with :func:`recv`; returns once it has.

    Only the two members take part (the others' sequence of collectives is unaffected); messages
    between a pair with the same ``tag`` arrive in the order they were sent (messages of other
    tags are apart: a receiver takes them in any order). The array is copied when the call
    starts, so the caller may change it as soon as ``send`` returns.
    """
    g = _check_group(group)
    _check_peer(g, dst_rank, "dst_rank")
    _check_tag(tag)
    lane = (dst_rank, tag)
    n = g._sent.get(lane, 0)
    g._sent[lane] = n + 1
    oid, ack = g.p2p_id(g.rank, dst_rank, n, tag=tag), g.p2p_id(g.rank, dst_rank, n, "p2p-ack", tag)

    async def run() -> None:
        try:  # a send cancelled during its put (its watched group broke) still deletes it
            await g.node.put_async(array, oid)
            await g.node.get_async(ack, timeout=g.timeout)
        finally:
            await g.node.delete_async(oid)

    g._run(run())


def recv(array: Any, src_rank: int, group: Group, tag: int = 0) -> Any:
    """Receive the next message ``src_rank`` sends to this member with ``tag`` into ``array``
    (in place: same dtype and shape); returns it."""
    g = _check_group(group)
    _check_peer(g, src_rank, "src_rank")
    _check_tag(tag)
    n = g._received.get((src_rank, tag), 0)
    oid = g.p2p_id(src_rank, g.rank, n, tag=tag)

    async def run() -> Any:
        await g.node.get_async(oid, timeout=g.timeout, out=array)
        await _acknowledge(g, src_rank, tag, n)
        return array

    return g._run(run())


def recv_any(array: Any, group: Group, tag: int = 0) -> int:
    """Receive the next message any other member sends to this one with ``tag`` into ``array``
    (in place: same dtype and shape); returns the sender's rank. The first message to arrive is
    taken; one that arrived at the same time from another member is taken by a later receive.
    Do not wait in :func:`recv` for a named member with the same ``tag`` meanwhile: both could
    take the same message."""
    g = _check_group(group)
    _check_tag(tag)
    senders = [r for r in range(g.world_size) if r != g.rank]
    if not senders:
        raise InvalidArgumentError("a group of one member has nobody to receive from", argument="group")
    counts = {src: g._received.get((src, tag), 0) for src in senders}

    async def run() -> int:
        gets = {
            asyncio.ensure_future(
                g.node.get_async(g.p2p_id(src, g.rank, counts[src], tag=tag), timeout=g.timeout)
            ): src
            for src in senders
        }
        try:
            done, _ = await asyncio.wait(gets, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in gets:
                task.cancel()
            await asyncio.gather(*gets, return_exceptions=True)
        arrived = [t for t in done if not t.cancelled() and t.exception() is None]
        if not arrived:
            raise next(t.exception() for t in done if t.exception() is not None)  # type: ignore[misc]
        first = min(arrived, key=lambda t: gets[t])
        src = gets[first]
        _copy(array, first.result())
        await _acknowledge(g, src, tag, counts[src])
        return src

    return g._run(run())


async def _acknowledge(g: Group, src: int, tag: int, n: int) -> None:
    """Message ``n`` from ``src`` with ``tag`` was received: count it, and put its acknowledgement
    (which the sender waits for), deleting the previous one (the sender read it before it sent
    this message)."""
    lane = (src, tag)
    g._received[lane] = n + 1
    ack = g.p2p_id(src, g.rank, n, "p2p-ack", tag)
    previous = g._acks.get(lane)
    # Recorded first: a put cancelled as it lands (the watched group broke) may still put it, and
    # destroy deletes what _acks holds (tests/test_soak.py found one left in the directory).
    g._acks[lane] = ack
    try:
        await g.node.put_async(np.zeros(1, np.uint8), ack)
    except BaseException:
        if previous is not None:
            await g._delete_all([previous])  # in the background
        raise
    if previous is not None:
        await g.node.delete_async(previous)
