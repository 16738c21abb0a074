"""Device objects end to end, through the device seam (:mod:`hoplite_gpu.device`).

A CUDA array put stays in device memory; readers get device arrays; reductions of device inputs
run on the device backend; device bytes are staged through host memory on the data plane. Here
the simulated backend (host memory that every layer treats as device memory) takes those paths on
machines without a GPU: a device buffer has no host view, so any layer that still read device
bytes as host memory would fail these tests. The same paths with CuPy are in the GPU-marked tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu import device, gpu
from hoplite_gpu import protocol as p
from hoplite_gpu.buffers import BufferKind
from hoplite_gpu.errors import ProtocolError
from tests.procs import Worker, digest, make_array, start_workers

pytestmark = pytest.mark.timeout(120)

SHAPE = (3, 1 << 16)  # 768 KiB of float32: several data-plane chunks


@pytest.fixture(scope="module")
def sim_env() -> Iterator[None]:
    """This process and the workers it spawns create device memory with the simulated backend."""
    mp = pytest.MonkeyPatch()
    mp.setenv(device.BACKEND_ENV, "sim")
    device.default_backend.cache_clear()
    yield
    mp.undo()
    device.default_backend.cache_clear()


@pytest.fixture(scope="module")
def sim_owner(sim_env: None) -> Iterator[Any]:
    node = hg.init()
    yield node
    node.close()


@pytest.fixture(scope="module")
def sim_workers(sim_owner: Any) -> Iterator[list[Worker]]:
    ws = start_workers(sim_owner.directory_address, sim_owner.token, 3)
    yield ws
    for w in ws:
        w.stop()


def _local(node: Any, oid: hg.ObjectID) -> Any:
    obj = node._store.get(oid)
    assert obj is not None
    return obj


def test_a_device_put_stays_on_the_device(sim_owner: Any) -> None:
    arr = device.sim_array(make_array("float32", SHAPE, 1), device=0)
    oid = sim_owner.put(arr)
    obj = _local(sim_owner, oid)
    assert obj.buffer.kind is BufferKind.DEVICE and obj.memory == "device"
    assert not np.shares_memory(obj.buffer.array, arr)  # copied device to device
    got = sim_owner.get(oid)
    assert isinstance(got, device.SimDeviceArray) and got.shape == SHAPE
    assert np.array_equal(got, arr)
    got[...] = -1  # the reader's own device copy: the stored object is unchanged
    assert np.array_equal(sim_owner.get(oid), arr)
    host_out = np.zeros(SHAPE, np.float32)
    assert sim_owner.get(oid, out=host_out) is host_out and np.array_equal(host_out, arr)
    dev_out = device.sim_array(np.zeros(SHAPE, np.float32))
    assert sim_owner.get(oid, out=dev_out) is dev_out and np.array_equal(dev_out, arr)


def test_copy_false_keeps_the_callers_device_memory(sim_owner: Any) -> None:
    arr = device.sim_array(make_array("int64", (1000,), 2))
    oid = sim_owner.put(arr, copy=False)
    assert np.shares_memory(_local(sim_owner, oid).buffer.array, arr)
    strided = device.sim_array(make_array("int64", (1000,), 3))[::2]  # not contiguous: copied
    oid2 = sim_owner.put(strided, copy=False)
    assert np.array_equal(sim_owner.get(oid2), strided)


def test_host_objects_stay_host_objects(sim_owner: Any) -> None:
    arr = make_array("float32", SHAPE, 4)
    got = sim_owner.get(sim_owner.put(arr))
    assert type(got) is np.ndarray and not got.flags.writeable
    assert np.array_equal(got, arr)


@pytest.mark.skipif(gpu.available(), reason="this process has a usable GPU")
def test_a_reader_without_a_device_gets_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the CuPy backend and no GPU, a device object is read back as a host copy."""
    monkeypatch.delenv(device.BACKEND_ENV, raising=False)
    device.default_backend.cache_clear()
    try:
        with hg.init() as node:
            arr = device.sim_array(make_array("float16", (5, 7), 5))
            got = node.get(node.put(arr))
            assert type(got) is np.ndarray and not got.flags.writeable
            assert np.array_equal(got, arr)
    finally:
        device.default_backend.cache_clear()


@pytest.mark.multiprocess
def test_broadcast_from_device_memory(sim_owner: Any, sim_workers: list[Worker]) -> None:
    """Readers in other processes get device arrays; the source's bytes cross the data plane
    staged through host memory (a device buffer has no host view to send from)."""
    oid = sim_workers[0].call("put_device", "float32", SHAPE, 11, "")
    want = digest(make_array("float32", SHAPE, 11))
    for w in sim_workers[1:]:
        w.send("get_typed", oid, 60)
    got = sim_owner.get(hg.ObjectID.from_hex(oid), timeout=60)
    assert isinstance(got, device.SimDeviceArray) and digest(got.view(np.ndarray)) == want
    for w in sim_workers[1:]:
        assert w.result() == ("SimDeviceArray", want)
    host = sim_workers[1].call("put", "float32", SHAPE, 12, "")
    assert sim_workers[2].call("get_typed", host, 60) == ("ndarray", digest(make_array("float32", SHAPE, 12)))


def _expected(op: str, seeds: list[int], dtype: str) -> np.ndarray[Any, Any]:
    arrays = [make_array(dtype, SHAPE, s) for s in seeds]
    if op == "sum":
        return np.sum(arrays, axis=0, dtype=dtype)
    if op == "max":
        return np.max(arrays, axis=0)
    raise AssertionError(op)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("op", "dtype"), [("sum", "float32"), ("sum", "int32"), ("max", "float64")])
def test_reduce_of_device_inputs_runs_on_the_device(
    sim_owner: Any, sim_workers: list[Worker], op: str, dtype: str
) -> None:
    """Every vertex's input is a device object, so every vertex reduces with the device backend
    (the host path cannot read a device buffer); the result is a device object."""
    seeds = [21, 22, 23, 24]
    ids = [w.call("put_device", dtype, SHAPE, s, "") for w, s in zip(sim_workers, seeds, strict=False)]
    ids.append(sim_owner.put(device.sim_array(make_array(dtype, SHAPE, seeds[-1]))).hex())
    rid = sim_owner.reduce([hg.ObjectID.from_hex(h) for h in ids], op, degree=2, timeout=60)
    got = sim_owner.get(rid, timeout=60)
    assert isinstance(got, device.SimDeviceArray)
    assert np.array_equal(got.view(np.ndarray), _expected(op, seeds, dtype))
    name, value = sim_workers[0].call("get_typed", rid.hex(), 60)
    assert (name, value) == ("SimDeviceArray", digest(_expected(op, seeds, dtype)))


@pytest.mark.multiprocess
def test_weighted_reduce_of_device_inputs(sim_owner: Any, sim_workers: list[Worker]) -> None:
    seeds = [31, 32, 33]
    ids = [w.call("put_device", "float64", SHAPE, s, "") for w, s in zip(sim_workers, seeds, strict=True)]
    weights = [0.5, -2.0, 0.25]
    rid = sim_owner.reduce([hg.ObjectID.from_hex(h) for h in ids], "sum", weights=weights, timeout=60)
    got = sim_owner.get(rid, timeout=60)
    want = sum(w * make_array("float64", SHAPE, s) for w, s in zip(weights, seeds, strict=True))
    assert isinstance(got, device.SimDeviceArray)
    np.testing.assert_allclose(got.view(np.ndarray), want, rtol=1e-12)


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
