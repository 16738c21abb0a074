"""Device objects end to end, through the device seam (:mod:`hoplite_gpu.memory.device`).

A CUDA array put stays in device memory; readers get device arrays; reductions of device inputs
run on the device backend; device bytes are staged through host memory on the data plane. Every
test runs with two backends: ``sim`` (host memory that every layer treats as device memory: a
device buffer has no host view, so any layer that still read device bytes as host memory fails
these tests) on every machine, and ``cupy`` (real GPU memory, the CUDA kernels) where CuPy sees a
GPU (``make gpu-check``); without one the ``cupy`` cases skip.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu import protocol as p
from hoplite_gpu.dataplane.ucx.settings import UCX_CUDA_ENV
from hoplite_gpu.errors import InvalidArgumentError, PinnedMemoryError, ProtocolError
from hoplite_gpu.memory import cuda, device, kernels, sim, to_host
from hoplite_gpu.memory.buffers import BufferKind, buffer_kind
from tests.procs import (
    DEVICE_TYPE,
    Worker,
    array_type,
    device_array,
    digest,
    make_array,
    start_device_workers,
    start_workers,
)

pytestmark = pytest.mark.timeout(120)

SHAPE = (3, 1 << 16)  # 768 KiB of float32: several data-plane chunks


@pytest.fixture(scope="module")
def dev_owner(backend: str) -> Iterator[Any]:
    node = hg.init()
    yield node
    node.close()


@pytest.fixture(scope="module")
def dev_workers(backend: str, dev_owner: Any) -> Iterator[list[Worker]]:
    ws = start_device_workers(dev_owner.directory_address, dev_owner.token, 3, backend)
    yield ws
    for w in ws:
        w.stop()


def _local(node: Any, oid: hg.ObjectID) -> Any:
    obj = node._store.get(oid)
    assert obj is not None
    return obj


def _same_memory(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return bool(np.shares_memory(a, b))
    return bool(a.data.ptr == b.data.ptr)


def test_a_device_put_stays_on_the_device(backend: str, dev_owner: Any) -> None:
    want = make_array("float32", SHAPE, 1)
    arr = device_array(backend, want)
    oid = dev_owner.put(arr)
    obj = _local(dev_owner, oid)
    assert obj.buffer.kind is BufferKind.DEVICE and obj.memory == "device"
    assert not _same_memory(obj.buffer.array, arr)  # copied device to device
    got = dev_owner.get(oid)
    assert array_type(got) == DEVICE_TYPE[backend] and got.shape == SHAPE
    assert np.array_equal(to_host(got), want)
    got[...] = -1  # the reader's own device copy: the stored object is unchanged
    assert np.array_equal(to_host(dev_owner.get(oid)), want)
    host_out = np.zeros(SHAPE, np.float32)
    assert dev_owner.get(oid, out=host_out) is host_out and np.array_equal(host_out, want)
    dev_out = device_array(backend, np.zeros(SHAPE, np.float32))
    assert dev_owner.get(oid, out=dev_out) is dev_out and np.array_equal(to_host(dev_out), want)
    # a host object into device memory
    host_oid = dev_owner.put(want + 1)
    assert dev_owner.get(host_oid, out=dev_out) is dev_out and np.array_equal(to_host(dev_out), want + 1)


class _CudaInterfaceOnly:
    """A foreign CUDA array exporting ``__cuda_array_interface__`` alone (Numba, JAX, PyCUDA...)."""

    def __init__(self, base: Any) -> None:
        self._base = base
        self.__cuda_array_interface__ = base.__cuda_array_interface__


class _DLPackOnly:
    """A foreign CUDA array exporting DLPack alone (as several frameworks' tensors do)."""

    def __init__(self, base: Any) -> None:
        self._base = base

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._base.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._base.__dlpack_device__()


@pytest.mark.parametrize("wrap", [_CudaInterfaceOnly, _DLPackOnly], ids=["cuda-array-interface", "dlpack"])
def test_foreign_cuda_arrays_are_device_objects(backend: str, dev_owner: Any, wrap: Any) -> None:
    """Anything exporting ``__cuda_array_interface__`` or DLPack on a CUDA device goes in as a
    device object and comes back as a CuPy array; ``copy=False`` keeps its memory."""
    if backend != "cupy":
        pytest.skip("foreign CUDA arrays: the cupy backend only")
    import cupy

    want = make_array("float32", SHAPE, 9)
    base = cupy.asarray(want)
    oid = dev_owner.put(wrap(base))
    obj = _local(dev_owner, oid)
    assert obj.buffer.kind is BufferKind.DEVICE and obj.dtype == "<f4" and obj.shape == SHAPE
    got = dev_owner.get(oid)
    assert isinstance(got, cupy.ndarray) and np.array_equal(cupy.asnumpy(got), want)
    kept = dev_owner.put(wrap(base), copy=False)
    assert _local(dev_owner, kept).buffer.array.data.ptr == base.data.ptr


def test_put_and_get_out_wait_for_the_callers_non_blocking_stream(backend: str, dev_owner: Any) -> None:
    """An array still being written on the caller's current stream, a non-blocking one (which the
    store's copies on the legacy default stream would not wait for), is put with every write
    done; a ``get(out=...)`` writes ``out`` after what the caller queued on it."""
    if backend != "cupy":
        pytest.skip("CUDA streams: the cupy backend only")
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        arr = cupy.zeros(1 << 24, cupy.float32)  # 64 MiB, then 100 kernels queued on the stream
        for _ in range(100):
            arr += 1
        oid = dev_owner.put(arr)
        out = cupy.zeros_like(arr)
        for _ in range(100):  # still running when get writes out: get's copy must come after
            out -= 1
        assert dev_owner.get(oid, out=out) is out
        stream.synchronize()
    got = dev_owner.get(oid)
    assert float(got.min()) == float(got.max()) == 100.0
    assert float(out.min()) == float(out.max()) == 100.0
    dev_owner.delete(oid)


def _page_locked(backend: str, arr: np.ndarray[Any, Any]) -> bool:
    """Whether host ``arr`` is registered as page-locked with ``backend``."""
    if backend == "sim":
        backend = device.default_backend()
        assert isinstance(backend, sim.SimBackend)
        return (arr.ctypes.data, arr.nbytes) in backend.registered
    import cupy

    attrs = cupy.cuda.runtime.pointerGetAttributes(arr.ctypes.data)
    return int(attrs.type) == 1  # cudaMemoryTypeHost: registered; pageable memory is 0


@pytest.mark.parametrize("size", [4096, 1 << 20], ids=["private", "segment"])
def test_pinned_host_objects_are_page_locked_until_deleted(backend: str, size: int) -> None:
    """``put(pinned=True)`` keeps the store's copy in page-locked memory: a small one in new
    page-locked memory, a large one in its shared-memory segment, locked in place, which a
    same-host reader still maps. A ``get(out=device_array)`` fills from it; the delete undoes
    the locking."""
    node = hg.init(shared_memory=True, inline_threshold_bytes=64 << 10)
    reader = start_workers(node.directory_address, node.token, 1, shared_memory=True)[0]
    try:
        want = make_array("float32", (size // 4,), 11)
        oid = node.put(want, pinned=True, copy=False)  # copied all the same
        buf = _local(node, oid).buffer
        assert buf.page_locked and not np.shares_memory(buf.array, want)
        assert _page_locked(backend, buf.array)
        segment = buffer_kind(buf.array) is BufferKind.SEGMENT
        assert segment is (size > 64 << 10)
        assert buf.pooled is segment  # a segment is locked in place; private memory is new
        out = device_array(backend, np.zeros_like(want))
        assert node.get(oid, out=out) is out and np.array_equal(to_host(out), want)
        assert reader.call("get", oid.hex(), 30) == digest(want)
        if segment:  # the reader mapped the page-locked segment, as any other
            assert reader.call("buffer_kind", oid.hex()) == BufferKind.MAPPED.value
        node.delete(oid)
        assert buf.unpin is None
        if segment or backend == "sim":  # registered in place: no longer
            assert not buf.page_locked
        else:  # CuPy's pinned pool's memory, which it takes back once this buffer is gone
            assert buf.kind is BufferKind.PINNED
        if backend == "sim":  # (CUDA is not asked about memory that may be unmapped by now)
            assert not _page_locked(backend, buf.array)
        again = node.put(want, pinned=True)  # (a segment: the same pooled one, locked again)
        assert _page_locked(backend, _local(node, again).buffer.array)
    finally:
        reader.stop()
        node.close()


def test_a_pinned_put_that_cannot_be_page_locked_stores_nothing(
    backend: str, dev_owner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend != "sim":
        pytest.skip("a refusal is simulated")

    def refuse(self: Any, array: Any) -> Any:
        raise PinnedMemoryError("no room for more page-locked memory")

    before = dev_owner.stats()["objects"]
    monkeypatch.setattr(sim.SimBackend, "register_host", refuse)
    with pytest.raises(PinnedMemoryError, match="no room"):
        dev_owner.put(make_array("int32", (1000,), 3), pinned=True)
    assert dev_owner.stats()["objects"] == before
    with pytest.raises(InvalidArgumentError, match="pinned must be a bool"):
        dev_owner.put(make_array("int32", (10,), 3), pinned="yes")


@pytest.mark.skipif(kernels.available(), reason="checks the refusal where CuPy sees no GPU")
def test_pinned_needs_a_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(device.BACKEND_ENV, "cupy")
    device.default_backend.cache_clear()
    node = hg.init()
    try:
        with pytest.raises(InvalidArgumentError, match="needs CuPy and a CUDA device") as info:
            node.put(np.arange(10), pinned=True)
        assert info.value.argument == "pinned"  # type: ignore[attr-defined]
        assert node.stats()["objects"] == 0
    finally:
        node.close()
        monkeypatch.undo()
        device.default_backend.cache_clear()


def test_copy_false_keeps_the_callers_device_memory(backend: str, dev_owner: Any) -> None:
    arr = device_array(backend, make_array("int64", (1000,), 2))
    oid = dev_owner.put(arr, copy=False)
    assert _same_memory(_local(dev_owner, oid).buffer.array, arr)
    strided = device_array(backend, make_array("int64", (1000,), 3))[::2]  # not contiguous: copied
    oid2 = dev_owner.put(strided, copy=False)
    assert np.array_equal(to_host(dev_owner.get(oid2)), to_host(strided))


def test_host_objects_stay_host_objects(backend: str, dev_owner: Any) -> None:
    arr = make_array("float32", SHAPE, 4)
    got = dev_owner.get(dev_owner.put(arr))
    assert type(got) is np.ndarray and not got.flags.writeable
    assert np.array_equal(got, arr)


@pytest.mark.skipif(kernels.available(), reason="this process has a usable GPU")
def test_a_reader_without_a_device_gets_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the CuPy backend and no GPU, a device object is read back as a host copy."""
    monkeypatch.delenv(device.BACKEND_ENV, raising=False)
    device.default_backend.cache_clear()
    try:
        with hg.init() as node:
            arr = sim.sim_array(make_array("float16", (5, 7), 5))
            got = node.get(node.put(arr))
            assert type(got) is np.ndarray and not got.flags.writeable
            assert np.array_equal(got, arr)
    finally:
        device.default_backend.cache_clear()


@pytest.mark.multiprocess
def test_broadcast_from_device_memory(backend: str, dev_owner: Any, dev_workers: list[Worker]) -> None:
    """Readers in other processes get device arrays; the source's bytes cross the data plane
    staged through host memory (a device buffer has no host view to send from, and none to
    receive into): each reader's copy lands in its own device memory chunk by chunk."""
    oid = dev_workers[0].call("put_device", backend, "float32", SHAPE, 11, "")
    want = digest(make_array("float32", SHAPE, 11))
    for w in dev_workers[1:]:
        w.send("get_typed", oid, 60)
    got = dev_owner.get(hg.ObjectID.from_hex(oid), timeout=60)
    assert array_type(got) == DEVICE_TYPE[backend] and digest(to_host(got)) == want
    for w in dev_workers[1:]:
        assert w.result() == (DEVICE_TYPE[backend], want)
        assert w.call("buffer_kind", oid) == "device"
    assert _local(dev_owner, hg.ObjectID.from_hex(oid)).buffer.kind is BufferKind.DEVICE
    host = dev_workers[1].call("put", "float32", SHAPE, 12, "")
    assert dev_workers[2].call("get_typed", host, 60) == (
        "numpy.ndarray",
        digest(make_array("float32", SHAPE, 12)),
    )


@pytest.mark.multiprocess
def test_a_reader_killed_while_receiving_a_device_object(backend: str, dev_owner: Any) -> None:
    """Readers receive a device object over the data plane into device memory chunk by chunk; one
    is SIGKILLed half way through (fault injection): the other reader, which may be streaming
    from it, finishes bit-exact."""
    shape = (4, 1 << 20)  # 16 MiB of float32: several chunks
    ws = start_device_workers(dev_owner.directory_address, dev_owner.token, 3, backend)
    try:
        oid = hg.ObjectID.random().hex()
        ws[1].call("arm", f"receive:{oid}:0.5:KILL")
        ws[1].send("get_typed", oid, 60)  # both wait before the put; the victim asked first
        ws[2].send("get_typed", oid, 60)
        ws[0].call("put_device", backend, "float32", shape, 41, oid)
        assert ws[2].result() == (DEVICE_TYPE[backend], digest(make_array("float32", shape, 41)))
        ws[1].proc.join(30)
        assert ws[1].proc.exitcode == -signal.SIGKILL
    finally:
        for w in ws:
            w.stop()


def _expected(op: str, seeds: list[int], dtype: str) -> np.ndarray[Any, Any]:
    arrays = [make_array(dtype, SHAPE, s) for s in seeds]
    if op == "sum":
        return np.sum(arrays, axis=0, dtype=dtype)
    if op == "max":
        return np.max(arrays, axis=0)
    raise AssertionError(op)


@pytest.mark.multiprocess
@pytest.mark.parametrize("ucx_cuda", [False, True], ids=["staged", "ucx-cuda"])
def test_device_chunks_are_staged_unless_ucx_moves_device_memory(
    backend: str, dev_owner: Any, monkeypatch: pytest.MonkeyPatch, ucx_cuda: bool
) -> None:
    """By default a device object's chunks cross the data plane through host staging buffers on
    both sides; with ``HOPLITE_UCX_CUDA=1`` UCX is handed the device memory itself (its
    ``cuda_copy`` transport; the simulated backend's memory is host memory, which UCX moves as it
    is). Either way the reader's device copy is exact."""
    monkeypatch.setenv(UCX_CUDA_ENV, "1" if ucx_cuda else "0")
    ws = start_device_workers(dev_owner.directory_address, dev_owner.token, 2, backend)  # they inherit it
    try:
        oid = ws[0].call("put_device", backend, "float32", SHAPE, 31, "")
        want = make_array("float32", SHAPE, 31)
        assert ws[1].call("get_typed", oid, 60) == (DEVICE_TYPE[backend], digest(want))
        staged = (ws[0].call("stats")["staged_bytes_sent"], ws[1].call("stats")["staged_bytes_received"])
        assert staged == ((0, 0) if ucx_cuda else (want.nbytes, want.nbytes))
    finally:
        for w in ws:
            w.stop()


@pytest.mark.multiprocess
@pytest.mark.parametrize(("op", "dtype"), [("sum", "float32"), ("sum", "int32"), ("max", "float64")])
def test_reduce_of_device_inputs_runs_on_the_device(
    backend: str, dev_owner: Any, dev_workers: list[Worker], op: str, dtype: str
) -> None:
    """Every vertex's input is a device object, so every vertex reduces with the device backend
    (the host path cannot read a device buffer); the result is a device object."""
    seeds = [21, 22, 23, 24]
    ids = [
        w.call("put_device", backend, dtype, SHAPE, s, "") for w, s in zip(dev_workers, seeds, strict=False)
    ]
    ids.append(dev_owner.put(device_array(backend, make_array(dtype, SHAPE, seeds[-1]))).hex())
    rid = dev_owner.reduce([hg.ObjectID.from_hex(h) for h in ids], op, degree=2, timeout=60)
    got = dev_owner.get(rid, timeout=60)
    assert array_type(got) == DEVICE_TYPE[backend]
    assert np.array_equal(to_host(got), _expected(op, seeds, dtype))
    assert dev_workers[0].call("get_typed", rid.hex(), 60) == (
        DEVICE_TYPE[backend],
        digest(_expected(op, seeds, dtype)),
    )


@pytest.mark.multiprocess
def test_weighted_reduce_of_device_inputs(backend: str, dev_owner: Any, dev_workers: list[Worker]) -> None:
    seeds = [31, 32, 33]
    ids = [
        w.call("put_device", backend, "float64", SHAPE, s, "")
        for w, s in zip(dev_workers, seeds, strict=True)
    ]
    weights = [0.5, -2.0, 0.25]
    rid = dev_owner.reduce([hg.ObjectID.from_hex(h) for h in ids], "sum", weights=weights, timeout=60)
    got = dev_owner.get(rid, timeout=60)
    want = sum(w * make_array("float64", SHAPE, s) for w, s in zip(weights, seeds, strict=True))
    assert array_type(got) == DEVICE_TYPE[backend]
    np.testing.assert_allclose(to_host(got), want, rtol=1e-12)


@pytest.mark.multiprocess
@pytest.mark.parametrize("shape", [(5, 7), (3, 1 << 17)])  # one object; sharded (1.5 MiB)
def test_allreduce_of_device_arrays(backend: str, dev_workers: list[Worker], shape: tuple[int, ...]) -> None:
    """The group API in place on device arrays: every member ends with the sum in its own device
    array (the sharded path puts device slices and reads shards into device slices)."""
    name = f"dev-{backend}-{shape[-1]}"
    for rank, w in enumerate(dev_workers):
        w.send("group", name, rank, len(dev_workers))
    assert [w.result() for w in dev_workers] == [0, 1, 2]
    for w in dev_workers:
        w.send("allreduce", name, f"{backend}:float32", shape, 40, "sum")
    want = sum(make_array("float32", shape, 40 + r) for r in range(len(dev_workers)))
    for w in dev_workers:
        kind, got = w.result()
        assert kind == DEVICE_TYPE[backend]
        np.testing.assert_array_equal(got, want)


@pytest.mark.multiprocess
def test_a_sharded_allreduce_on_one_host_stages_nothing(backend: str, monkeypatch: Any) -> None:
    """With shared memory, members on one host lend their device shards through CUDA IPC (a
    borrowed device array is copied into memory they open) and read the results the same way:
    no byte is staged through host memory and the loopback."""
    monkeypatch.setenv("HOPLITE_DEVICE_BACKEND", backend)
    node = hg.init(shared_memory=True)
    ws = start_device_workers(node.directory_address, node.token, 2, backend, shared_memory=True)
    try:
        for rank, w in enumerate(ws):
            w.send("group", "one-host", rank, len(ws))
        assert [w.result() for w in ws] == [0, 1]
        shape = (3, 1 << 17)  # 1.5 MiB: sharded
        for w in ws:
            w.send("allreduce", "one-host", f"{backend}:float32", shape, 50, "sum")
        want = sum(make_array("float32", shape, 50 + r) for r in range(len(ws)))
        for w in ws:
            kind, got = w.result()
            assert kind == DEVICE_TYPE[backend]
            np.testing.assert_array_equal(got, want)
        for w in ws:
            stats = w.call("stats")
            assert stats["staged_bytes_sent"] == stats["staged_bytes_received"] == 0, stats
            assert stats["device_ipc_opened"] + stats["device_ipc_reused"] >= 2, stats
    finally:
        for w in ws:
            w.stop()
        node.close()


def test_the_memory_kind_is_checked_on_the_wire() -> None:
    ok = p.PutRequest(
        request_id=1, object_id=b"x" * 20, size=4, dtype="<f4", shape=[1], digest=b"", memory="device"
    )
    ok.check()
    bad = p.PutRequest(
        request_id=1, object_id=b"x" * 20, size=4, dtype="<f4", shape=[1], digest=b"", memory="gpu0"
    )
    with pytest.raises(ProtocolError):
        bad.check()


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason="no GPU")
def test_chunks_staged_for_the_data_plane_are_pinned() -> None:
    import cupy

    from hoplite_gpu.memory.buffers import buffer_kind

    src = (cupy.arange(1 << 20, dtype=cupy.uint32) % 251).view(cupy.uint8)
    chunk = cuda.CupyBackend().host_copy(src)
    assert buffer_kind(chunk) is BufferKind.PINNED
    assert np.array_equal(chunk, cupy.asnumpy(src))
    big = cuda.CupyBackend().host_copy(cupy.zeros(cuda.PINNED_STAGING_BYTES + 1, cupy.uint8))
    assert buffer_kind(big) is BufferKind.PRIVATE and not big.any()


def test_bfloat16_cuda_tensors_reduce_as_bfloat16(backend: str, dev_owner: Any) -> None:
    """Torch bfloat16 CUDA tensors are put as bfloat16 objects, reduced by the bfloat16 kernels, and
    read back as bfloat16 CuPy arrays where CuPy has the type (14 and later), else as their bits."""
    if backend != "cupy":
        pytest.skip("CUDA torch tensors: the cupy backend only")
    torch = pytest.importorskip("torch")
    import cupy
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    # Small integers: bfloat16 holds them and their sums exactly, in any order of reduction.
    host = [((np.arange(4096) * seed) % 64 - 32).astype(bf16) for seed in (3, 5, 7)]
    tensors = [torch.from_numpy(h.view(np.int16)).view(torch.bfloat16).cuda() for h in host]
    oids = [dev_owner.put(t) for t in tensors]
    assert _local(dev_owner, oids[0]).dtype == "bfloat16"
    result = dev_owner.get(dev_owner.reduce(oids, op="sum"), timeout=60)  # the bfloat16 kernels
    want = sum(h.astype(np.float32) for h in host).astype(bf16)
    native = cuda.cupy_bfloat16()
    assert result.dtype == (native if native is not None else np.uint16)
    assert np.array_equal(cupy.asnumpy(result.view(cupy.uint16)), want.view(np.uint16))
    back = dev_owner.get(oids[1])
    assert np.array_equal(cupy.asnumpy(back.view(cupy.uint16)), host[1].view(np.uint16))
