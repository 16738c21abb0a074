"""A reduction's request read and checked before the directory keeps anything, and the answers
to a ``reduced_objects`` query.

A :class:`~hoplite_gpu.protocol.ReduceRequest` is read into an :class:`Asked` (its plan, op,
weights and encoding rows) or refused with a :data:`Refusal`. The checks that need the
directory's records (quotas, a reduction of the same id, the inputs already present) are made
by :class:`~.reductions.Reductions` with the helpers here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .. import protocol as p
from ..errors import InvalidArgumentError
from ..reduce_ops import as_op
from . import combine
from .config import MAX_REPAIRS
from .membership import reduction_cost
from .records import ObjectEntry, Reduction
from .reduce import ReducePlan

#: Why a request is refused: (error kind, message, the ObjectID at fault or b"").
Refusal = tuple[str, str, bytes]


@dataclass(frozen=True, slots=True)
class Asked:
    """A reduction's request, read: its plan, op (``"sum"``, ...), weights and encoding rows per
    input, whether it decodes as its inputs arrive (``as_arrive``), and what it counts against its
    node's quota of inputs (``cost``)."""

    plan: ReducePlan
    op: str
    weights: dict[bytes, float]
    coding: dict[bytes, list[float]]
    as_arrive: bool
    cost: int


def read_request(msg: p.ReduceRequest) -> Asked | Refusal:
    """``msg`` read into what it asks for, or why it is refused (ids, op, count, fan-in, order,
    weights with another op than SUM)."""
    rid, inputs = msg.reduction_id, tuple(msg.object_ids)
    if len(rid) != 20 or not inputs or any(len(o) != 20 for o in inputs) or rid in inputs:
        text = "a reduction needs 20-byte ObjectIDs and an id not among its inputs"
        return "InvalidArgumentError", text, b""
    as_arrive = msg.num_objects == 0 and bool(msg.coding)
    try:
        op = as_op(msg.op).value
        if msg.ordered and (as_arrive or msg.coding):
            raise ValueError("inputs placed in the listed order cannot be chosen by their encoding")
        count = len(inputs) if as_arrive else msg.num_objects
        plan = ReducePlan(rid, inputs, count, fan_in=msg.degree, ordered=msg.ordered)
    except (InvalidArgumentError, ValueError) as exc:
        return "InvalidArgumentError", str(exc), b""
    if (msg.weights or msg.coding) and op != "sum":
        return "InvalidArgumentError", f"weights need the SUM op, not {op.upper()}", b""
    weights = dict(zip(inputs, msg.weights, strict=True)) if msg.weights else {}
    coding = dict(zip(inputs, msg.coding, strict=True)) if msg.coding else {}
    return Asked(plan, op, weights, coding, as_arrive, reduction_cost(msg))


def asks_the_same(existing: Reduction, asked: Asked, num_objects: int) -> bool:
    """Whether a request (``asked``, for ``num_objects`` of its inputs) asks for the reduction
    ``existing`` again: every rank of a group may ask for the same one."""
    old = existing.plan
    had = (existing.candidates, 0) if existing.candidates else (old.inputs, old.num_objects)
    now = (asked.plan.inputs, num_objects)
    same = (*had, existing.op, existing.coding) == (*now, asked.op, asked.coding)
    return same and (bool(asked.coding) or existing.weights == asked.weights)


def inputs_problem(asked: Asked, present: Sequence[ObjectEntry]) -> Refusal | None:
    """Why the inputs already ``present`` cannot be reduced as ``asked`` (then nothing is
    reduced), or None. The first is checked in full; each other only if it differs from it."""
    if not present:
        return None
    first, weighted = present[0], bool(asked.weights or asked.coding)
    for entry in present:
        same_kind = (entry.size, entry.dtype, entry.shape) == (first.size, first.dtype, first.shape)
        if entry is not first and same_kind:
            continue
        problem = combine.input_problem(asked.plan, entry, first, weighted)
        if problem is None and entry is first and asked.weights:
            problem = combine.weights_problem(asked.weights.values(), entry.dtype)
        if problem is not None:
            return problem[0], problem[1], entry.object_id
    return None


def refusal_reply(request_id: int, refused: Refusal) -> p.ReduceReply:
    """The reply refusing request ``request_id``."""
    kind, text, culprit = refused
    return p.ReduceReply(request_id=request_id, error=text, error_kind=kind, error_object_id=culprit)


def reduced_reply(request_id: int, red: Reduction) -> p.ReducedObjectsReply:
    """The answer to a ``reduced_objects`` query of a failed or finished reduction. A finished
    one whose result was lost since still names its inputs: a reader may hold the whole result
    (its last bytes arrived as the root died)."""
    if red.error is not None and not red.done:
        kind, message, culprit = red.error
        return p.ReducedObjectsReply(
            request_id=request_id, error=message, error_kind=kind, error_object_id=culprit
        )
    plan = red.plan
    if red.restored and red.chooses:
        return p.ReducedObjectsReply(
            request_id=request_id,
            error=(
                f"reduction {plan.reduction_id.hex()} finished before the directory restarted; "
                f"which of its {len(red.candidates or plan.inputs)} inputs it reduced is not known"
            ),
            error_kind="ObjectNotFoundError",
        )
    if red.restored:
        return p.ReducedObjectsReply(request_id=request_id, object_ids=list(plan.inputs))
    return p.ReducedObjectsReply(request_id=request_id, object_ids=plan.reduced_objects())


def unknown_reply(request_id: int, reduction_id: bytes) -> p.ReducedObjectsReply:
    """The answer to a ``reduced_objects`` query of a reduction the directory does not know."""
    return p.ReducedObjectsReply(
        request_id=request_id,
        error=f"no reduction {reduction_id.hex()} is known (never requested, or deleted)",
        error_kind="ObjectNotFoundError",
    )


def late_reply(request_id: int, red: Reduction) -> p.ReducedObjectsReply:
    """The answer to a ``reduced_objects`` query that waited past its timeout."""
    return p.ReducedObjectsReply(
        request_id=request_id,
        error=f"reduction {red.plan.reduction_id.hex()} did not choose its inputs in time",
        error_kind="HopliteTimeoutError",
    )


def rejoined_epoch(now: float, chosen: int | None) -> int:
    """The first epoch of the reductions re-sent to a directory after it restarted (``chosen``:
    the one it took for the first of them, kept). Not 0: the lost directory's tree of such a
    reduction may still be winding down on its nodes, and a tree of the same epoch has the same
    vertex keys and intermediate ids, so an old vertex's late report, clean-up or fetched
    child would pass for the new tree's (the restart soak saw a new vertex's output deleted:
    "vertex 2's output is not registered"). One per directory, above any epoch a directory
    that never restarted reaches (``MAX_REPAIRS``), from the time it is first needed (in
    milliseconds, modulo about 12 days): a lost directory that had restarted too took its own
    at another moment."""
    return chosen if chosen is not None else MAX_REPAIRS + 1 + int(now * 1000) % (1 << 30)
