"""A weighted reduction refuses a weight its inputs' dtype cannot hold (issue 39, finding 8):
``weights=[1e308] * 4`` on float32 gave NaN in every element, silently. The directory checks the
weights against the inputs' dtype once it knows it: at the request if an input is there, else
when the first input is placed (the reduction then fails, and so does a get of its result)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import hoplite_gpu as hg
from tests.procs import make_array

pytestmark = pytest.mark.timeout(120)

SHAPES = [(4, 4), (256, 256)]  # inline in the directory; reduced by vertices on the node


def _inputs(owner: Any, dtype: Any, shape: tuple[int, ...], n: int = 4) -> list[Any]:
    return [owner.put(make_array(dtype, shape, 60 + i)) for i in range(n)]


def _drop(owner: Any, ids: list[Any]) -> None:
    for oid in ids:
        owner.delete(oid)


@pytest.mark.parametrize("shape", SHAPES, ids=["inline", "node"])
@pytest.mark.parametrize(
    ("dtype", "weight"), [("float32", 1e308), ("float16", 7e4), (ml_dtypes.bfloat16, 1e39)]
)
def test_a_weight_the_inputs_dtype_cannot_hold_is_refused_at_the_request(
    owner: Any, dtype: Any, weight: float, shape: tuple[int, ...]
) -> None:
    ids = _inputs(owner, dtype, shape)
    try:
        name = np.dtype(dtype).name
        with pytest.raises(hg.InvalidArgumentError, match=f"weight .* cannot be represented .* {name}"):
            owner.reduce(ids, weights=[weight] * len(ids), timeout=30)
    finally:
        _drop(owner, ids)


@pytest.mark.parametrize("shape", SHAPES, ids=["inline", "node"])
def test_a_weight_refused_once_the_inputs_arrive_fails_the_reduction(
    owner: Any, shape: tuple[int, ...]
) -> None:
    ids = [hg.ObjectID.random() for _ in range(4)]
    rid = owner.reduce(ids, weights=[1e308] * 4, timeout=30)  # nothing known of the inputs yet
    for i, oid in enumerate(ids):
        owner.put(make_array("float32", shape, 60 + i), oid)
    try:
        with pytest.raises(hg.InvalidArgumentError, match=r"cannot be represented .* float32"):
            owner.get(rid, timeout=30)
    finally:
        _drop(owner, ids)
        owner.delete(rid)


@pytest.mark.parametrize("shape", SHAPES, ids=["inline", "node"])
def test_the_largest_weights_a_dtype_holds_are_accepted(owner: Any, shape: tuple[int, ...]) -> None:
    ids = [owner.put(np.full(shape, v, np.float16)) for v in (0.5, 0.25)]
    try:
        rid = owner.reduce(ids, weights=[6e4, -6e4], timeout=30)  # float16 holds up to 65504
        got = owner.get(rid, timeout=30)
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, np.full(shape, np.float16(6e4) / 4, np.float16))
        owner.delete(rid)
    finally:
        _drop(owner, ids)
