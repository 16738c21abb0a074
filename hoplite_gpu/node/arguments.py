"""Checks of the public calls' arguments (a timeout; a reduce call's, and the request they become).
Pure: no node needed."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from .. import protocol as p
from ..errors import InvalidArgumentError
from ..object_id import ObjectID
from ..reduce_ops import ReduceOp, as_op
from .sources import Route


def resolve_timeout(timeout: float | None, default: float) -> float | None:
    """A call's ``timeout`` in seconds, checked: None uses ``default`` (0 there: none); None for
    no timeout."""
    if timeout is None:
        timeout = default or None
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0:
        raise InvalidArgumentError(
            f"timeout must be a number of seconds >= 0 or None, got {timeout!r}", argument="timeout"
        )
    return None if math.isinf(timeout) else float(timeout)


def object_id_list(object_ids: Any, empty: bool = False) -> list[ObjectID]:
    """``object_ids`` (a sequence of :class:`ObjectID`) as a list; raises
    :class:`InvalidArgumentError` for anything else, or for none unless ``empty``."""
    try:
        ids = None if isinstance(object_ids, (str, bytes, ObjectID)) else list(object_ids)
    except TypeError:
        ids = None
    if ids is None or not (ids or empty) or not all(isinstance(o, ObjectID) for o in ids):
        what = "a list" if empty else "a non-empty list"
        raise InvalidArgumentError(f"object_ids must be {what} of ObjectIDs", argument="object_ids")
    return ids


def reduce_request(
    object_ids: Any,
    op: ReduceOp | str,
    num_objects: int | None,
    reduction_id: ObjectID | None,
    timeout: float | None,
    default_timeout: float,
    degree: int | None = None,
    weights: Any = None,
    coding: Any = None,
    ordered: bool = False,
) -> p.ReduceRequest:
    """The request of a :meth:`Node.reduce <hoplite_gpu.node.Node.reduce>` call, its arguments
    checked (``timeout`` resolved with ``default_timeout``: :func:`resolve_timeout`). Raises
    :class:`InvalidArgumentError` naming the argument at fault."""
    ids = object_id_list(object_ids)
    if len(set(ids)) != len(ids):
        raise InvalidArgumentError("object_ids must be distinct", argument="object_ids")
    k = len(ids) if num_objects is None else num_objects
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= len(ids):
        raise InvalidArgumentError(
            f"num_objects must be an int in 1..{len(ids)}, got {num_objects!r}", argument="num_objects"
        )
    if reduction_id is not None and not isinstance(reduction_id, ObjectID):
        raise InvalidArgumentError("reduction_id must be an ObjectID or None", argument="reduction_id")
    if degree is not None and (not isinstance(degree, int) or isinstance(degree, bool) or degree < 1):
        raise InvalidArgumentError(f"degree must be an int >= 1 or None, got {degree!r}", argument="degree")
    rid = reduction_id or ObjectID.random()
    if rid in ids:
        raise InvalidArgumentError("reduction_id must not be one of the inputs", argument="reduction_id")
    wait = resolve_timeout(timeout, default_timeout)
    scales = _check_weights(weights, len(ids), as_op(op))
    rows = _check_coding(coding, len(ids), as_op(op))
    if scales and rows:
        raise InvalidArgumentError("give weights or coding, not both", argument="coding")
    if not isinstance(ordered, bool):
        raise InvalidArgumentError(f"ordered must be a bool, got {ordered!r}", argument="ordered")
    if ordered and (k != len(ids) or rows):
        raise InvalidArgumentError(
            "ordered reduces every input in the listed order: no num_objects or coding", argument="ordered"
        )
    if rows and num_objects is None:
        k = 0  # decoded as soon as the rows that arrived can be
    return p.ReduceRequest(
        request_id=0,
        reduction_id=rid.binary(),
        object_ids=[o.binary() for o in ids],
        op=as_op(op).value,
        num_objects=k,
        timeout=p.wire_timeout(wait),
        degree=degree or 0,
        weights=scales,
        coding=rows,
        ordered=ordered,
    )


def _check_weights(weights: Any, count: int, op: ReduceOp) -> list[float]:
    """The weights of a weighted reduction as floats ([] for None), checked."""
    if weights is None:
        return []
    if op is not ReduceOp.SUM:
        raise InvalidArgumentError(f"weights need op=SUM, not {op.name}", argument="weights")
    try:
        values = [float(w) for w in weights]
    except (TypeError, ValueError):
        raise InvalidArgumentError("weights must be a sequence of numbers", argument="weights") from None
    if any(isinstance(w, bool) for w in weights) or not all(math.isfinite(w) for w in values):
        raise InvalidArgumentError("weights must be finite numbers", argument="weights")
    if len(values) != count:
        raise InvalidArgumentError(
            f"{len(values)} weights for {count} object ids: give one per id", argument="weights"
        )
    return values


def _check_coding(coding: Any, count: int, op: ReduceOp) -> list[list[float]]:
    """The encoding rows of a decoded reduction as lists of floats ([] for None), checked."""
    if coding is None:
        return []
    if op is not ReduceOp.SUM:
        raise InvalidArgumentError(f"coding needs op=SUM, not {op.name}", argument="coding")
    try:
        rows = np.asarray(coding, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidArgumentError("coding must be rows of numbers", argument="coding") from None
    if rows.ndim != 2 or rows.shape[0] != count or not 1 <= rows.shape[1] <= p.MAX_CODING_COLUMNS:
        raise InvalidArgumentError(
            f"coding must have one row per object id ({count}) of 1..{p.MAX_CODING_COLUMNS} numbers; "
            f"got shape {rows.shape}",
            argument="coding",
        )
    if not np.all(np.isfinite(rows)):
        raise InvalidArgumentError("coding must be finite numbers", argument="coding")
    return [[float(x) for x in row] for row in rows]


def route_of(direct: bool, via: Any) -> Route:
    """The source a ``get`` asks for (``direct``, ``via``: see :meth:`Node.get
    <hoplite_gpu.node.Node.get>`), its arguments checked."""
    if via is not None and not isinstance(via, ObjectID):
        raise InvalidArgumentError(
            f"via must be an ObjectID or None, got {type(via).__name__}", argument="via"
        )
    return Route(bool(direct), b"" if via is None else via.binary())
