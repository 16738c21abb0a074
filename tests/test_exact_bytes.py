"""A put stores the caller's bytes exactly, a structured dtype's padding included: read back in
another process, every byte is the caller's, and none is left over from a deleted object whose
buffer the put recycled (issue 39, finding 7)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.procs import Worker, digest, start_workers

pytestmark = pytest.mark.timeout(300)

#: A dtype with padding: bytes 1-3, 8-23 and 26-31 of each 32-byte item belong to no field (a
#: deleted object's "SECRET!!" would show whole in bytes 8-15 and 16-23).
PADDED = np.dtype(
    {"names": ["a", "b", "c"], "formats": ["u1", "<f4", "<u2"], "offsets": [0, 4, 24], "itemsize": 32}
)
#: Sizes in bytes: inline in the directory, pulled over the data plane (the issue's 96 KB and 2.4 MB).
SIZES = [1 << 10, 96 << 10, 2_400_000]
SECRET = b"SECRET!!"


@pytest.fixture(scope="module")
def reader(owner: Any) -> Iterator[Worker]:
    """Another process with its own node, which gets what ``owner`` puts."""
    (worker,) = start_workers(owner.directory_address, owner.token, 1)
    yield worker
    worker.stop()


def _items(rows: int, cols: int, pad: int) -> np.ndarray[Any, Any]:
    """``rows`` x ``cols`` items as raw bytes, shape ``(rows, cols, itemsize)``: every padding byte
    is ``pad``, the fields count up."""
    raw = np.full((rows, cols, PADDED.itemsize), pad, np.uint8)
    arr = raw.view(PADDED)[..., 0]
    n = np.arange(rows * cols).reshape(rows, cols)
    arr["a"], arr["b"], arr["c"] = n % 251, n.astype(np.float32) / 3, n % 65521
    return raw


def _case(layout: str, nbytes: int, pad: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The array to put in ``layout`` (of about ``nbytes``), and what a reader must get: the same
    items, C-contiguous, each item's bytes as they are in the caller's memory (worked out on
    ``uint8`` bytes, independently of how put copies)."""
    count = nbytes // PADDED.itemsize
    if layout == "strided":  # every other item of a larger array
        raw = _items(1, 2 * count, pad)
        return raw.view(PADDED)[0, ::2, 0], np.ascontiguousarray(raw[0, ::2]).view(PADDED)[..., 0]
    if layout == "fortran":  # a transposed C array: Fortran order, not C-contiguous
        raw = _items(count // 8, 8, pad)
        return raw.view(PADDED)[..., 0].T, np.ascontiguousarray(raw.transpose(1, 0, 2)).view(PADDED)[..., 0]
    raw = _items(1, count, pad)
    return raw.view(PADDED)[0, :, 0], raw[0].copy().view(PADDED)[..., 0]


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize(
    ("layout", "copy"), [("contiguous", True), ("contiguous", False), ("strided", True), ("fortran", True)]
)
def test_a_structured_array_reads_back_bit_exact_elsewhere(
    owner: Any, reader: Worker, layout: str, copy: bool, nbytes: int
) -> None:
    array, expected = _case(layout, nbytes, pad=0xA5)
    assert array.flags.c_contiguous == (layout == "contiguous")
    assert (
        np.frombuffer(expected.tobytes(), np.uint8).reshape(-1, PADDED.itemsize)[:, 1].tolist()
        == [0xA5] * expected.size
    )  # the padding is the caller's pattern, in what the reader must get
    oid = owner.put(array, copy=copy)
    try:
        assert reader.call("get", oid.hex(), 60.0) == digest(expected)
        assert owner.get(oid).tobytes() == expected.tobytes()
    finally:
        owner.delete(oid)


@pytest.mark.parametrize("nbytes", SIZES[1:])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_a_recycled_buffer_carries_no_deleted_bytes(
    owner: Any, reader: Worker, layout: str, nbytes: int
) -> None:
    array, expected = _case(layout, nbytes, pad=0)
    pool = owner._store.memory.pool
    pool.clear()  # the one buffer of this size it will hold is the deleted object's
    secret = owner.put(
        np.frombuffer(SECRET * (expected.nbytes // len(SECRET) + 1), np.uint8)[: expected.nbytes]
    )
    owner.delete(secret)  # its buffer goes back to the pool, the bytes still in it
    reused = pool.reused
    oid = owner.put(array)
    try:
        assert pool.reused == reused + 1, "the put did not recycle the deleted object's buffer"
        assert SECRET not in owner.get(oid).tobytes()
        assert reader.call("get", oid.hex(), 60.0) == digest(expected)
    finally:
        owner.delete(oid)
