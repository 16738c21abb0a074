"""The node's per-vertex chunk reducer: results equal one whole-array reduction, however the inputs
arrive (chunk sizes, progress steps and orders drawn by Hypothesis), and failures propagate."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hoplite_gpu import protocol as p
from hoplite_gpu.buffers import Buffer, dtype_to_wire
from hoplite_gpu.errors import PeerLostError
from hoplite_gpu.object_id import ObjectID
from hoplite_gpu.reduce_ops import SUPPORTED_DTYPES, ReduceOp, reduce_chunk
from hoplite_gpu.store import LocalObject
from hoplite_gpu.vertex import reduce_stream

pytestmark = pytest.mark.timeout(120)


def _dtype(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _obj(arr: np.ndarray[Any, Any], progress: int) -> LocalObject:
    buf = Buffer.wrap(arr.reshape(-1).view(np.uint8))
    return LocalObject(ObjectID.random(), buf.nbytes, dtype_to_wire(arr.dtype), arr.shape, b"", buf, progress)


def _task(arr: np.ndarray[Any, Any], op: ReduceOp, children: int, count: int) -> p.ReduceTask:
    return p.ReduceTask(
        reduction_id=b"r" * 20,
        vertex=0,
        input_id=b"i" * 20,
        output_id=b"o" * 20,
        children=[b"c" * 20] * children,
        op=op.value,
        count=count,
        size=arr.nbytes,
        dtype=dtype_to_wire(arr.dtype),
        shape=list(arr.shape),
    )


@settings(max_examples=80, deadline=None)
@given(
    n_children=st.integers(0, 4),
    length=st.integers(0, 2500),
    dtype=st.sampled_from(SUPPORTED_DTYPES),
    op=st.sampled_from(list(ReduceOp)),
    chunk=st.sampled_from([1, 3, 64, 1000, 1 << 20]),
    root=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_streamed_reduction_equals_whole_array_reduction(
    n_children: int, length: int, dtype: str, op: ReduceOp, chunk: int, root: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    dt = _dtype(dtype)
    arrays = [rng.integers(1, 4, length).astype(dt) for _ in range(n_children + 1)]
    count = n_children + 1 if root else 0
    want = np.empty_like(arrays[0])
    reduce_chunk(op, arrays[0], arrays[1:], want, count)
    steps = random.Random(seed)

    async def run() -> np.ndarray[Any, Any]:
        own = _obj(arrays[0], arrays[0].nbytes)
        children = [_obj(a, 0) for a in arrays[1:]]
        out = _obj(np.empty_like(arrays[0]), 0)
        reducing = asyncio.ensure_future(
            reduce_stream(_task(arrays[0], op, n_children, count), own, children, out, chunk)
        )
        while any(c.progress < c.size for c in children):  # bytes arrive in random steps, any order
            c = steps.choice([c for c in children if c.progress < c.size])
            c.advance(c.progress + steps.randint(1, max(1, c.size // 3)))
            await asyncio.sleep(0)
        await asyncio.wait_for(reducing, 30)
        assert out.progress == out.size
        return out.buffer.host.view(dt)

    got = asyncio.run(run())
    assert np.array_equal(got.view(np.uint8), want.reshape(-1).view(np.uint8))


def test_a_failed_child_fails_the_vertex_and_its_output_stays_partial() -> None:
    arr = np.ones(1 << 16, np.float32)

    async def run() -> LocalObject:
        own, child, out = _obj(arr, arr.nbytes), _obj(arr.copy(), 0), _obj(np.empty_like(arr), 0)
        reducing = asyncio.ensure_future(
            reduce_stream(_task(arr, ReduceOp.SUM, 1, 0), own, [child], out, 4096)
        )
        child.advance(8192)
        await asyncio.sleep(0)
        child.fail(PeerLostError("lost", peer="x", cause="test"))
        with pytest.raises(PeerLostError):
            await asyncio.wait_for(reducing, 10)
        return out

    out = asyncio.run(run())
    # Only chunks whose bytes had arrived were reduced and published; nothing past them.
    assert 0 < out.progress <= 8192 and out.progress % 4096 == 0
    assert np.all(out.buffer.host[: out.progress].view(np.float32) == 2)
