"""How a reduction combines its inputs: which inputs can be reduced together, their weights
(given, or decoded from a code's encoding rows), what each vertex is sent, and the
directory-side reduce of inline inputs. Pure functions over a :class:`~.records.Reduction`;
NumPy only."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .. import protocol as p
from ..coding.decoding import DecodeTracker, solve_decoding
from ..dtypes import dtype_from_wire
from ..errors import InvalidArgumentError
from ..reduce_ops import as_op, check_dtype, reduce_chunk, weighted_sum_chunk
from .records import Location, LocationState, ObjectEntry, Reduction
from .reduce import Placement, ReducePlan


def input_problem(
    plan: ReducePlan, entry: ObjectEntry, first: ObjectEntry, weighted: bool = False
) -> tuple[str, str] | None:
    """Why ``entry`` cannot be reduced together with ``first`` (or with what ``plan`` placed),
    in a weighted reduction if ``weighted``: (error kind, message), or None."""
    try:
        dtype = dtype_from_wire(entry.dtype)
        check_dtype(dtype)
    except (InvalidArgumentError, TypeError) as exc:
        return "InvalidArgumentError", f"input {entry.object_id.hex()}: {exc}"
    if weighted and dtype.kind != "f" and dtype.name != "bfloat16":
        return "InvalidArgumentError", (
            f"input {entry.object_id.hex()} is {dtype.name}: a weighted reduction needs floats"
        )
    ref = (
        (plan.size, plan.dtype, plan.shape)
        if plan.size >= 0
        else (first.size, first.dtype, tuple(first.shape))
    )
    if (entry.size, entry.dtype, tuple(entry.shape)) != ref:
        return "ReduceMismatchError", (
            f"input {entry.object_id.hex()} has dtype {entry.dtype} and shape {list(entry.shape)}, but "
            f"reduction {plan.reduction_id.hex()}'s inputs have dtype {ref[1]} and shape {list(ref[2])}; "
            "nothing was reduced"
        )
    return None


def weights_problem(weights: Iterable[float], wire_dtype: str) -> tuple[str, str] | None:
    """Why ``weights`` cannot scale inputs of ``wire_dtype``: a weight that overflows it (vertices
    multiply in the inputs' dtype, so ``1e308`` on float32 would turn every element into inf or
    NaN): (error kind, message), or None."""
    try:
        dtype = dtype_from_wire(wire_dtype)
    except (InvalidArgumentError, TypeError):
        return None  # input_problem reports the dtype itself
    values = np.fromiter(weights, np.float64)
    with np.errstate(over="ignore"):
        bad = ~np.isfinite(values.astype(dtype))
    if not bad.any():
        return None
    big = float(values[int(np.argmax(bad))])
    return "InvalidArgumentError", f"weight {big!r} cannot be represented in the inputs' dtype {dtype.name}"


def stream_weight(red: Reduction, pl: Placement) -> float:
    """The weight a parent applies to what ``pl`` streams: an input's own weight for a leaf,
    1 for a vertex's output (weighted already)."""
    return 1.0 if pl.runs_task else red.weights.get(pl.object_id, 1.0)


def vertex_weights(red: Reduction, pl: Placement) -> list[float]:
    """:attr:`~hoplite_gpu.protocol.ReduceTask.weights` of vertex ``pl`` ([] unweighted)."""
    if not red.weights:
        return []
    weights = [red.weights.get(pl.object_id, 1.0)]
    for child in pl.children:
        placed = red.plan.by_vertex.get(child)
        weights.append(stream_weight(red, placed) if placed is not None else 1.0)
    return weights


def decoding_weights(red: Reduction) -> tuple[dict[bytes, float], float]:
    """The weights of a decoded reduction's placed inputs whose sum of their encoding rows is all
    ones (least-norm, as :meth:`GradientCode.decoding_weights
    <hoplite_gpu.coding.GradientCode.decoding_weights>` computes them), and the residual: they
    decode unless it is over :data:`~hoplite_gpu.coding.DECODE_TOLERANCE`."""
    chosen = [pl.object_id for pl in red.plan.placed]
    weights, residual = solve_decoding(np.array([red.coding[oid] for oid in chosen], dtype=np.float64))
    return {oid: float(w) for oid, w in zip(chosen, weights, strict=True)}, residual


def new_tracker(red: Reduction) -> DecodeTracker:
    """A fresh :class:`~hoplite_gpu.coding.DecodeTracker` for a reduction that decodes as its
    inputs arrive."""
    return DecodeTracker(len(next(iter(red.coding.values()))))


def weights_message(red: Reduction, pl: Placement) -> p.ReduceWeights:
    """The :class:`~hoplite_gpu.protocol.ReduceWeights` for vertex ``pl`` once weights are chosen."""
    plan = red.plan
    return p.ReduceWeights(
        reduction_id=plan.reduction_id, vertex=pl.vertex, epoch=plan.epoch, weights=vertex_weights(red, pl)
    )


def vertex_output(red: Reduction, pl: Placement) -> ObjectEntry:
    """The object vertex ``pl`` produces, a partial copy on its node from the start (the root's
    belongs to the requester, who deletes it)."""
    plan = red.plan
    return ObjectEntry(
        object_id=pl.output_id,
        size=plan.size,
        dtype=plan.dtype,
        shape=list(plan.shape),
        digest=b"",
        owner=red.requester if pl.parent is None else pl.node_id,
        inline=None,
        memory=red.memory or "",
        locations={pl.node_id: Location(pl.node_id, LocationState.PARTIAL, 0, producing=True)},
        reduction=plan.reduction_id,
    )


def vertex_task(red: Reduction, pl: Placement) -> p.ReduceTask:
    """The task of vertex ``pl``, for its node."""
    plan = red.plan
    return p.ReduceTask(
        reduction_id=plan.reduction_id,
        vertex=pl.vertex,
        input_id=pl.object_id,
        output_id=pl.output_id,
        children=plan.child_sources(pl.vertex),
        op=red.op,
        count=plan.num_objects if pl.parent is None else 0,
        size=plan.size,
        dtype=plan.dtype,
        shape=list(plan.shape),
        epoch=plan.epoch,
        weights=vertex_weights(red, pl),
        await_weights=bool(red.coding) and not red.weights,
        memory=red.memory or "",
    )


def child_message(red: Reduction, pl: Placement, parent: Placement) -> p.ReduceChild:
    """What tells vertex ``parent``'s node where its child ``pl``'s output is."""
    plan = red.plan
    return p.ReduceChild(
        reduction_id=plan.reduction_id,
        vertex=parent.vertex,
        index=parent.children.index(pl.vertex),
        object_id=pl.output_id,
        epoch=plan.epoch,
        weight=stream_weight(red, pl),
    )


def reduce_inline(red: Reduction) -> bytes:
    """The result of a reduction whose inputs are all inline (``red.inline``, in arrival order)."""
    plan = red.plan
    dtype = dtype_from_wire(plan.dtype)
    arrays = [np.frombuffer(b, dtype) for b in red.inline]
    out = np.empty_like(arrays[0])
    if red.weights:
        scales = [red.weights.get(oid, 1.0) for oid in red.inline_ids]
        weighted_sum_chunk(arrays[0], arrays[1:], out, scales)
    else:
        reduce_chunk(as_op(red.op), arrays[0], arrays[1:], out, plan.num_objects)
    return out.tobytes()
