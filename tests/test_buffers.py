"""The array-type dispatch and buffer kinds of :mod:`hoplite_gpu.buffers` (no GPU needed)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hoplite_gpu import buffers, shm
from hoplite_gpu.buffers import ArrayKind, BufferKind, BufferPool
from hoplite_gpu.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(60)


class _Exported:
    """A foreign host array: only ``__array_interface__``, like many C extensions' arrays."""

    def __init__(self, base: np.ndarray[Any, Any]) -> None:
        self._base = base
        self.__array_interface__ = base.__array_interface__


class _OnDevice:
    __cuda_array_interface__: dict[str, Any] = {}


def test_arrays_are_classified_once() -> None:
    arr = np.arange(6, dtype=np.float32)
    assert buffers.kind_of(arr) is ArrayKind.NUMPY
    assert buffers.kind_of(_Exported(arr)) is ArrayKind.HOST
    assert buffers.kind_of(_OnDevice()) is ArrayKind.CUDA and buffers.on_device(_OnDevice())
    assert buffers.kind_of([1, 2]) is ArrayKind.OTHER and not buffers.on_device(arr)


def test_to_host_views_host_arrays_and_refuses_the_rest() -> None:
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    assert buffers.to_host(arr) is arr
    view = buffers.to_host(_Exported(arr))
    assert np.shares_memory(view, arr) and view.dtype == arr.dtype and view.shape == (2, 3)
    with pytest.raises(InvalidArgumentError, match="got list"):
        buffers.to_host([1, 2, 3])


def test_flat_view_only_of_contiguous_arrays() -> None:
    arr = np.zeros((4, 4))
    flat = buffers.flat_view(arr)
    assert flat is not None and flat.shape == (16,) and np.shares_memory(flat, arr)
    assert buffers.flat_view(arr[:, ::2]) is None
    assert buffers.flat_view(_Exported(arr)) is None


@pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")
def test_buffer_kinds() -> None:
    pool = BufferPool(1 << 20, shared_min_bytes=4096)
    private, shared = pool.allocate(100), pool.allocate(8192)
    assert buffers.buffer_kind(private) is BufferKind.PRIVATE
    assert buffers.buffer_kind(shared) is BufferKind.SEGMENT
    seg = shm.segment_of(shared)
    assert seg is not None
    seg.publish(b"o" * 20)
    mapped = shm.map_view(seg.name, b"o" * 20, 8192)
    assert mapped is not None and buffers.buffer_kind(mapped) is BufferKind.MAPPED
    del mapped
    pool.release(shared)
    pool.clear()
