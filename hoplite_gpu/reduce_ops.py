"""Reduction operators on host buffers: NumPy ufuncs writing in place, chunk by chunk.

A reduction accumulates into a buffer that starts as a copy of one input: for each further input,
``reduce_into(op, acc, other)`` applies the operator elementwise into ``acc`` (``out=``, no
temporaries); :func:`reduce_chunk` does one tree vertex's chunk in one pass per input. ``AVG``
accumulates like ``SUM`` and :func:`finish` divides by the number of inputs actually reduced
(for integer dtypes the quotient is truncated toward zero, as NCCL does).
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from .errors import InvalidArgumentError


class ReduceOp(enum.Enum):
    """Elementwise reduction operators."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"  # SUM scaled by 1 / (number of inputs actually reduced)


_UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}

#: dtypes a reduction accepts (``bfloat16`` through ``ml_dtypes`` on the host).
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8")


def as_op(op: ReduceOp | str) -> ReduceOp:
    """``op`` as a :class:`ReduceOp` (accepts the enum, its value or its name)."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        for member in ReduceOp:
            if op.lower() in (member.value, member.name.lower()):
                return member
    raise InvalidArgumentError(
        f"unknown reduce op {op!r}; use one of {[m.name for m in ReduceOp]}", argument="op"
    )


def check_dtype(dtype: np.dtype[Any]) -> None:
    """Raise :class:`InvalidArgumentError` unless reductions support ``dtype``."""
    if np.dtype(dtype).name not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(
            f"reductions support {', '.join(SUPPORTED_DTYPES)}; got {np.dtype(dtype).name}",
            argument="dtype",
        )


def reduce_into(op: ReduceOp, acc: np.ndarray[Any, Any], other: np.ndarray[Any, Any]) -> None:
    """``acc = acc (op) other`` elementwise, in place; both have the same dtype and size."""
    _UFUNCS[op](acc, other, out=acc)


def reduce_chunk(
    op: ReduceOp,
    own: np.ndarray[Any, Any],
    children: list[np.ndarray[Any, Any]],
    out: np.ndarray[Any, Any],
    count: int = 0,
) -> None:
    """One chunk of a tree vertex: ``out = own (op) children[0] (op) ...``, then, at the root
    (``count`` > 0), the final step over ``count`` inputs. One pass per child, no temporaries."""
    if children:
        _UFUNCS[op](own, children[0], out=out)
        for child in children[1:]:
            _UFUNCS[op](out, child, out=out)
    else:
        np.copyto(out, own)
    if count:
        finish(op, out, count)


def weighted_sum_chunk(
    own: np.ndarray[Any, Any],
    children: list[np.ndarray[Any, Any]],
    out: np.ndarray[Any, Any],
    weights: list[float],
) -> None:
    """One chunk of a weighted SUM vertex: ``out = weights[0] * own + weights[1] * children[0] +
    ...`` (float dtypes; a weight of 1 costs no multiplication, and one temporary chunk is used
    for the products)."""
    typed = [out.dtype.type(w) for w in weights]
    if typed[0] == 1:
        np.copyto(out, own)
    else:
        np.multiply(own, typed[0], out=out)
    scratch: np.ndarray[Any, Any] | None = None
    for child, w in zip(children, typed[1:], strict=True):
        if w == 1:
            np.add(out, child, out=out)
            continue
        if scratch is None:
            scratch = np.empty_like(out)
        np.multiply(child, w, out=scratch)
        np.add(out, scratch, out=out)


def finish(op: ReduceOp, acc: np.ndarray[Any, Any], count: int) -> None:
    """Final step after ``count`` inputs were reduced into ``acc`` (AVG divides; others no-op)."""
    if op is not ReduceOp.AVG or count <= 1:
        return
    if np.issubdtype(acc.dtype, np.integer):
        np.divide(acc, count, out=acc, casting="unsafe")
    else:
        np.divide(acc, acc.dtype.type(count), out=acc)
