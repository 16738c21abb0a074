"""The array-type dispatch and buffer kinds of :mod:`hoplite_gpu.memory.buffers` (no GPU needed)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hoplite_gpu import dtypes
from hoplite_gpu.errors import InvalidArgumentError
from hoplite_gpu.memory import arrays, buffers, kernels, shm
from hoplite_gpu.memory.arrays import ArrayKind
from hoplite_gpu.memory.buffers import Buffer, BufferKind, BufferPool

pytestmark = pytest.mark.timeout(60)


class _Exported:
    """A foreign host array: only ``__array_interface__``, like many C extensions' arrays."""

    def __init__(self, base: np.ndarray[Any, Any]) -> None:
        self._base = base
        self.__array_interface__ = base.__array_interface__


class _OnDevice:
    __cuda_array_interface__: dict[str, Any] = {}


class _DLPackOnly:
    """An array that exports DLPack alone, on the DLPack device type ``device_type``."""

    def __init__(self, device_type: Any, base: np.ndarray[Any, Any] | None = None) -> None:
        self._type = device_type
        self._base = base

    def __dlpack__(self, **kwargs: Any) -> Any:
        assert self._base is not None
        return self._base.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        if isinstance(self._type, Exception):
            raise self._type
        return (self._type, 0)


def test_arrays_are_classified_once() -> None:
    arr = np.arange(6, dtype=np.float32)
    assert arrays.kind_of(arr) is ArrayKind.NUMPY
    assert arrays.kind_of(_Exported(arr)) is ArrayKind.HOST
    assert arrays.kind_of(_OnDevice()) is ArrayKind.CUDA and arrays.on_device(_OnDevice())
    assert arrays.kind_of([1, 2]) is ArrayKind.OTHER and not arrays.on_device(arr)


@pytest.mark.parametrize(("device_type", "kind"), [(2, "cuda"), (13, "cuda"), (1, "host"), (3, "host")])
def test_dlpack_arrays_are_classified_by_their_device(device_type: int, kind: str) -> None:
    """DLPack alone on a CUDA device (kDLCUDA 2, kDLCUDAManaged 13) is device memory; on the CPU
    (1) or in CUDA host memory (3) it is host memory, which NumPy views or refuses."""
    arr = _DLPackOnly(device_type, np.arange(6, dtype=np.int32))
    assert arrays.kind_of(arr) is ArrayKind(kind)
    assert arrays.on_device(arr) is (kind == "cuda")
    if device_type == 1:
        assert np.array_equal(arrays.to_host(arr), np.arange(6))


def test_a_broken_dlpack_exporter_is_not_taken_for_device_memory() -> None:
    broken = _DLPackOnly(RuntimeError("no device"))
    assert arrays.kind_of(broken) is ArrayKind.HOST and not arrays.on_device(broken)


def test_to_host_views_host_arrays_and_refuses_the_rest() -> None:
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    assert arrays.to_host(arr) is arr
    view = arrays.to_host(_Exported(arr))
    assert np.shares_memory(view, arr) and view.dtype == arr.dtype and view.shape == (2, 3)
    with pytest.raises(InvalidArgumentError, match="got list"):
        arrays.to_host([1, 2, 3])


def test_flat_view_only_of_contiguous_arrays() -> None:
    arr = np.zeros((4, 4))
    flat = arrays.flat_view(arr)
    assert flat is not None and flat.shape == (16,) and np.shares_memory(flat, arr)
    assert arrays.flat_view(arr[:, ::2]) is None
    assert arrays.flat_view(_Exported(arr)) is None


@pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")
def test_a_private_pool_makes_private_buffers_and_reuses_either_kind() -> None:
    pool = BufferPool(1 << 20, shared_min_bytes=4096)
    segment = pool.allocate(8192)
    assert buffers.buffer_kind(segment) is BufferKind.SEGMENT
    pool.private = True  # its node is alone on its host
    fresh = pool.allocate(8192)
    assert buffers.buffer_kind(fresh) is BufferKind.PRIVATE and not pool.shares(8192)
    big = pool.allocate(2 << 20)  # anonymous pages of its own (buffers.private_pages)
    assert buffers.buffer_kind(big) is BufferKind.PRIVATE and big.flags.writeable
    big[-1] = 7
    assert big[-1] == 7 and shm.segment_of(big) is None
    seg_id = id(segment)
    pool.release(segment)
    del segment
    again = pool.allocate(8192)  # the free segment, reused as it is
    assert id(again) == seg_id and buffers.buffer_kind(again) is BufferKind.SEGMENT
    pool.release(fresh)
    del fresh
    pool.private = False  # another node joined the host: a free private buffer is not taken
    assert buffers.buffer_kind(pool.allocate(8192)) is BufferKind.SEGMENT
    pool.release(again)
    del again
    pool.clear()


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


def test_a_buffer_owns_its_bytes_and_says_where_they_live() -> None:
    arr = np.arange(64, dtype=np.uint8)
    buf = Buffer.wrap(arr, pooled=True)
    assert buf.kind is BufferKind.PRIVATE and buf.pooled and not buf.on_device and buf.device is None
    assert buf.nbytes == 64 and buf.host is arr and buf.to_host() is arr
    part = buf.view(8, 24)
    assert np.shares_memory(part, arr) and part.nbytes == 16 and part[0] == 8
    assert buf.digest() == buffers.digest_of(arr) != Buffer.wrap(arr[::-1].copy()).digest()
    typed = buf.typed(np.dtype(np.uint16), (4, 8))
    assert typed.shape == (4, 8) and not typed.flags.writeable and np.shares_memory(typed, arr)


def test_a_buffer_is_a_flat_byte_array_and_device_memory_has_no_host_view() -> None:
    with pytest.raises(InvalidArgumentError, match="flat uint8"):
        Buffer.wrap(np.zeros((2, 2), np.uint8))
    with pytest.raises(InvalidArgumentError, match="flat uint8"):
        Buffer.wrap(np.zeros(4, np.float32))
    with pytest.raises(InvalidArgumentError, match="not a store buffer"):
        Buffer.wrap([1, 2, 3])
    assert buffers.buffer_kind(_OnDevice()) is BufferKind.DEVICE
    device = Buffer(_OnDevice(), BufferKind.DEVICE, device=0)
    assert device.on_device
    with pytest.raises(InvalidArgumentError, match="device buffer has no host view"):
        _ = device.host


@pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")
def test_segment_and_mapped_buffers() -> None:
    pool = BufferPool(1 << 20, shared_min_bytes=4096)
    shared = pool.allocate(8192)
    shared[:] = 7
    buf = Buffer.wrap(shared, pooled=True)
    assert buf.kind is BufferKind.SEGMENT and buf.host is shared
    seg = shm.segment_of(shared)
    assert seg is not None
    seg.publish(b"p" * 20)
    mapped = shm.map_view(seg.name, b"p" * 20, 8192)
    assert mapped is not None
    view = Buffer.wrap(mapped)
    assert view.kind is BufferKind.MAPPED and view.digest() == buf.digest()
    del mapped, view
    pool.release(shared)
    pool.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason="needs CuPy and a CUDA device")
def test_device_and_pinned_buffers() -> None:
    import cupy

    host = np.arange(1 << 20, dtype=np.uint8)
    dev = cupy.asarray(host)
    buf = Buffer.wrap(dev)
    assert buf.kind is BufferKind.DEVICE and buf.on_device and buf.device == dev.device.id
    part = buf.view(16, 48)
    assert isinstance(part, cupy.ndarray) and int(part[0]) == 16
    assert buf.digest() == buffers.digest_of(host) and np.array_equal(buf.to_host(), host)
    assert isinstance(buf.typed(np.dtype(np.float32), (1 << 18,)), cupy.ndarray)
    pinned = Buffer.pinned(4096)
    assert pinned.kind is BufferKind.PINNED and buffers.buffer_kind(pinned.array) is BufferKind.PINNED
    pinned.host[:] = 3
    assert pinned.digest() == buffers.digest_of(np.full(4096, 3, np.uint8))


def test_structured_dtypes_round_trip_with_their_padding() -> None:
    padded = np.dtype({"names": ["a", "b"], "formats": ["<i4", "<f8"], "offsets": [4, 16], "itemsize": 32})
    nested = np.dtype([("x", "<i2"), ("y", [("p", "<f4"), ("q", "u1", (3,))])])
    for dtype in (padded, nested, np.dtype("<f4"), np.dtype([("a", "<i8")])):
        back = dtypes.dtype_from_wire(dtypes.dtype_to_wire(dtype))
        assert back == dtype and back.itemsize == dtype.itemsize


class _Cycle:
    """An object in a reference cycle holding a view of a buffer (as a traceback's frames do)."""

    def __init__(self, view: Any) -> None:
        self.me = self
        self.view = view


def test_a_buffer_held_only_by_a_reference_cycle_is_collected_and_reused() -> None:
    import gc

    size = buffers.COLLECT_MIN_BYTES
    pool = BufferPool(1 << 30)
    gc.disable()  # the collector runs only when the pool asks
    try:
        buf = pool.allocate(size)
        _Cycle(buf[10:])
        pool.release(buf)
        first = buf.__array_interface__["data"][0]
        del buf
        again = pool.allocate(size)
        assert again.__array_interface__["data"][0] == first
        assert pool.reused == 1 and pool.collections == 1
        # A buffer something alive still uses (a reader's view) is never handed out.
        kept = again[5:]
        pool.release(again)
        del again
        other = pool.allocate(size)
        assert not np.shares_memory(other, kept) and pool.reused == 1 and pool.collections == 2
        # Below COLLECT_MIN_BYTES the collector is not run.
        small = pool.allocate(size // 2)
        _Cycle(small[1:])
        pool.release(small)
        del small
        pool.allocate(size // 2)
        assert pool.collections == 2 and pool.reused == 1
    finally:
        gc.enable()


def test_a_joined_buffer_is_its_pieces_back_to_back_and_moves_within_one() -> None:
    pieces = [np.arange(n, dtype=np.uint8) for n in (5, 1, 10)]
    buf = Buffer.joined(pieces)
    assert buf.nbytes == 16 and buf.ends == (5, 6, 16) and buf.kind is BufferKind.PRIVATE
    assert [buf.piece_end(p) for p in (0, 4, 5, 6, 15)] == [5, 5, 6, 16, 16]
    view = buf.view(7, 9)
    view[:] = 99  # the pieces' own memory
    assert pieces[2][1:3].tolist() == [99, 99] and buf.host_chunk(5, 6).tolist() == [0]
    with pytest.raises(InvalidArgumentError, match="span"):
        buf.view(4, 6)
    assert buf.array.size == 0  # no whole view: whoever reads a whole buffer fails at once
    plain = Buffer.wrap(np.zeros(8, np.uint8))
    assert plain.piece_end(3) == 8
    for bad in ([], [np.zeros(0, np.uint8)], [np.zeros(4, np.float32)], [np.zeros((2, 2), np.uint8)]):
        with pytest.raises(InvalidArgumentError):
            Buffer.joined(bad)
