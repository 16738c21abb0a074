"""GPU reduction kernels against NumPy, for every op and dtype, at sizes around powers of two.

The kernel tests need CuPy and a CUDA device and skip cleanly otherwise; the checks of the kernel
table run everywhere.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from hoplite_gpu.errors import InvalidArgumentError
from hoplite_gpu.memory import kernels
from hoplite_gpu.reduce_ops import SUPPORTED_DTYPES, ReduceOp
from hoplite_gpu.reduce_ops import finish as host_finish
from hoplite_gpu.reduce_ops import reduce_into as host_reduce_into
from tests.test_vertex import local_object, reduce_task

pytestmark = pytest.mark.timeout(300)

needs_gpu = pytest.mark.skipif(not kernels.available(), reason="needs CuPy and a CUDA device")

SIZES = sorted({max(0, 2**i + d) for i in (0, 5, 10, 17, 20) for d in (-1, 0, 1)})


def test_every_dtype_and_op_has_a_kernel_in_the_source() -> None:
    assert set(kernels.CUDA_TYPES) == set(SUPPORTED_DTYPES)
    source = (kernels.kernels_dir() / "reduce.cu").read_text()
    for name in ("hoplite_reduce", "hoplite_average", "hoplite_bf16", "OpSum", "OpProd", "OpMin", "OpMax"):
        assert name in source
    names = kernels.kernel_names()
    assert len(names) == len(set(names)) == len(SUPPORTED_DTYPES) * 5 + 2 * len(kernels.FLOAT_DTYPES)


def _dtype(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _arrays(dtype: np.dtype[Any], size: int, seed: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        lo = 0 if dtype.kind == "u" else -100
        return rng.integers(lo, 100, size).astype(dtype), rng.integers(lo, 100, size).astype(dtype)
    a = rng.uniform(-2, 2, size).astype(dtype)
    b = rng.uniform(-2, 2, size).astype(dtype)
    if size > 3:
        a[1], b[2] = np.nan, np.nan  # MIN/MAX must propagate NaN like NumPy
    return a, b


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype_name", SUPPORTED_DTYPES)
@pytest.mark.parametrize("op", list(ReduceOp))
def test_kernel_matches_numpy(dtype_name: str, op: ReduceOp) -> None:
    import cupy

    dtype = _dtype(dtype_name)
    for size in SIZES:
        a, b = _arrays(dtype, size, seed=size)
        want = a.copy()
        host_reduce_into(op, want, b)
        host_finish(op, want, 3)
        # bfloat16 has no CuPy dtype: its bits travel as uint16 and the kernel is named by dtype.
        bf16 = dtype_name == "bfloat16"
        acc = cupy.asarray(a.view(np.uint16) if bf16 else a)
        other = cupy.asarray(b.view(np.uint16) if bf16 else b)
        kernels.reduce_into(op, acc, other, dtype=dtype_name)
        kernels.finish(op, acc, 3, dtype=dtype_name)
        got = cupy.asnumpy(acc).view(dtype)
        if np.issubdtype(dtype, np.integer):
            assert np.array_equal(got, want), (size, op)
        else:
            g, w = got.astype(np.float64), want.astype(np.float64)
            eps = float(ml_dtypes.finfo(dtype).eps)
            assert np.array_equal(np.isnan(g), np.isnan(w)), (size, op)
            ok = ~np.isnan(w)
            assert np.all(np.abs(g[ok] - w[ok]) <= eps * np.abs(w[ok]) + 1e-30), (size, op)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype_name", SUPPORTED_DTYPES)
@pytest.mark.parametrize("offsets", [(1, 1), (0, 1), (1, 0)])
def test_arrays_off_a_16_byte_boundary_reduce_one_by_one(dtype_name: str, offsets: tuple[int, int]) -> None:
    """The kernels move 16 bytes per load where both arrays are aligned; views that start an
    element in (or only one of them) take the element-by-element path, with the same result."""
    import cupy

    dtype = _dtype(dtype_name)
    bf16 = dtype_name == "bfloat16"
    size = 1000
    a, b = _arrays(dtype, size + 1, seed=3)
    want = a[offsets[0] : offsets[0] + size].copy()
    host_reduce_into(ReduceOp.SUM, want, b[offsets[1] : offsets[1] + size])
    acc_all = cupy.asarray(a.view(np.uint16) if bf16 else a)
    other_all = cupy.asarray(b.view(np.uint16) if bf16 else b)
    acc = acc_all[offsets[0] : offsets[0] + size]
    kernels.reduce_into(ReduceOp.SUM, acc, other_all[offsets[1] : offsets[1] + size], dtype=dtype_name)
    got, want = cupy.asnumpy(acc).view(dtype).astype(np.float64), want.astype(np.float64)
    assert np.array_equal(got, want, equal_nan=True), (dtype_name, offsets)  # one rounding, as on the host


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype_name", kernels.FLOAT_DTYPES)
def test_weighted_kernels_match_numpy(dtype_name: str) -> None:
    """``scale`` then ``axpy``: the weighted SUM of two inputs, within one rounding per step."""
    import cupy

    dtype = _dtype(dtype_name)
    bf16 = dtype_name == "bfloat16"
    for size in SIZES:
        a, b = _arrays(dtype, size, seed=size + 7)
        want = a.astype(np.float64) * 0.25 + b.astype(np.float64) * -1.5
        acc = cupy.asarray(a.view(np.uint16) if bf16 else a)
        other = cupy.asarray(b.view(np.uint16) if bf16 else b)
        kernels.scale(acc, 0.25, dtype=dtype_name)
        kernels.axpy(acc, other, -1.5, dtype=dtype_name)
        got = cupy.asnumpy(acc).view(dtype).astype(np.float64)
        eps = float(ml_dtypes.finfo(dtype).eps)
        assert np.array_equal(np.isnan(got), np.isnan(want)), size
        ok = ~np.isnan(want)
        assert np.all(np.abs(got[ok] - want[ok]) <= 4 * eps * (np.abs(a[ok]) + 2 * np.abs(b[ok])) + 1e-30), (
            size
        )


def test_weighted_kernels_refuse_integers() -> None:
    with pytest.raises(InvalidArgumentError):
        kernels.scale(np.zeros(4, np.int32), 2.0)


def _vertex_objects(cupy: Any, dtype: Any, n: int, child_on_host: bool) -> tuple[Any, ...]:
    """A vertex's own input and one child (complete, exact small integers as ``dtype``), its
    output, the sum it must hold, and the vertex's task."""
    rng = np.random.default_rng(7)
    a, b = (rng.integers(1, 4, n).astype(dtype) for _ in range(2))
    own = local_object(cupy.asarray(a.view(np.uint8)), dtype, (n,), a.nbytes)
    child_bytes = b.view(np.uint8).copy() if child_on_host else cupy.asarray(b.view(np.uint8))
    child = local_object(child_bytes, dtype, (n,), b.nbytes)
    out = local_object(cupy.empty(a.nbytes, cupy.uint8), dtype, (n,), 0)
    want = (a.astype(np.float64) + b).astype(dtype).view(np.uint8)
    return own, child, out, want, reduce_task(a, ReduceOp.SUM, 1, 0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_a_device_vertex_reduces_inputs_it_holds_in_few_steps(dtype_name: str, monkeypatch: Any) -> None:
    """16 MiB already held, steps of at most 4 MiB: four steps, each queued without waiting
    (CUDA events), and the sum right."""
    import asyncio

    import cupy

    from hoplite_gpu.node.vertex import reduce_stream

    dtype = _dtype(dtype_name)
    n = (16 << 20) // dtype.itemsize
    own, child, out, want, task = _vertex_objects(cupy, dtype, n, False)
    backend = out.buffer.backend
    events: list[Any] = []
    record = backend.record
    monkeypatch.setattr(backend, "record", lambda device: events.append(record(device)) or events[-1])
    asyncio.run(reduce_stream(task, own, [child], out, 1 << 20, None, 4 << 20))
    assert out.progress == out.size and len(events) == 4
    assert all(event.done() for event in events)
    assert np.array_equal(cupy.asnumpy(out.buffer.view(0, out.size)), want)


@pytest.mark.gpu
@needs_gpu
def test_a_device_vertex_publishes_only_reduced_bytes_while_a_host_child_arrives() -> None:
    """A child received into host memory arrives in uneven pieces; at every turn the published
    prefix of the output, read on a stream that does not wait for the vertex's, is the sum."""
    import asyncio

    import cupy

    from hoplite_gpu.node.vertex import reduce_stream

    dtype = np.dtype(np.float32)
    n = (24 << 20) // 4
    own, child, out, want, task = _vertex_objects(cupy, dtype, n, True)
    child.progress = 0
    reader = cupy.cuda.Stream(non_blocking=True)

    async def run() -> None:
        reducing = asyncio.ensure_future(reduce_stream(task, own, [child], out, 1 << 20, None, 8 << 20))
        piece = (3 << 20) + 12
        while not reducing.done():
            if child.progress < child.size:
                child.advance(child.progress + piece)
            await asyncio.sleep(0)
            done = out.progress
            if done:
                got = cupy.asnumpy(out.buffer.view(0, done), stream=reader)  # waits for the copy
                assert np.array_equal(got, want[:done]), f"published {done} bytes not yet reduced"
        await reducing

    asyncio.run(run())
    assert out.progress == out.size
    assert np.array_equal(cupy.asnumpy(out.buffer.view(0, out.size)), want)
