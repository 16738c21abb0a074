"""Group collectives for processes that all take part, named and ordered like ``ray.util.collective``.

Each member creates a :class:`Group` with its own node, its rank and the group's size and name,
then every member calls the same collectives in the same order::

    group = hg.collective.Group(node, rank, world_size, "trainers")
    hg.collective.allreduce(grads, group)            # in place, SUM by default
    hg.collective.broadcast(weights, 0, group)

The collectives are built on ``put``/``get``/``reduce``: the objects of the ``n``-th collective of a
group have ObjectIDs derived from (group name, ``n``, rank), so members find each other's objects
without talking to each other, and a ``get`` of a reduction streams its result while it is being
reduced (allreduce is a reduce pipelined into a broadcast).

Clean-up: a member deletes the objects it created for earlier collectives as soon as a collective
to which every member contributed (allreduce, allgather, reducescatter, barrier) completes on it,
because every member then has finished all earlier ones. :meth:`Group.destroy` deletes the rest
after a final barrier (a barrier is no object: one message per member to the directory). Group
names must therefore be unique for the lifetime of a directory (a second group of the same name
would find the first one's results).
"""

from __future__ import annotations

from .group import DESCRIBED_KEPT, DESTROY_WAIT, Group, barrier
from .operations import (
    SHARD_MIN_BYTES,
    allgather,
    allreduce,
    alltoall,
    broadcast,
    gather,
    reduce,
    reducescatter,
    scatter,
)
from .p2p import recv, recv_any, send

__all__ = [
    "DESCRIBED_KEPT",
    "DESTROY_WAIT",
    "SHARD_MIN_BYTES",
    "Group",
    "allgather",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "gather",
    "recv",
    "recv_any",
    "reduce",
    "reducescatter",
    "scatter",
    "send",
]
