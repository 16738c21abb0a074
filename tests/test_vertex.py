"""The node's per-vertex chunk reducer: results equal one whole-array reduction, however the inputs
arrive (chunk sizes, progress steps and orders drawn by Hypothesis), and failures propagate.
Outputs in (simulated) device memory: steps take in what every input holds, and a step's bytes
are published only once the device says its queued work is done."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hoplite_gpu import protocol as p
from hoplite_gpu.dtypes import dtype_to_wire
from hoplite_gpu.errors import ObjectDeletedError, PeerLostError
from hoplite_gpu.memory.buffers import Buffer
from hoplite_gpu.memory.sim import SimBackend, sim_array
from hoplite_gpu.memory.store import LocalObject
from hoplite_gpu.node.vertex import reduce_stream
from hoplite_gpu.object_id import ObjectID
from hoplite_gpu.reduce_ops import SUPPORTED_DTYPES, ReduceOp, reduce_chunk

pytestmark = pytest.mark.timeout(120)


def _dtype(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def local_object(flat: Any, dtype: np.dtype[Any], shape: tuple[int, ...], progress: int) -> LocalObject:
    """A local object whose bytes are the flat ``uint8`` array ``flat`` (host or any device)."""
    buf = Buffer.wrap(flat)
    return LocalObject(ObjectID.random(), buf.nbytes, dtype_to_wire(dtype), shape, b"", buf, progress)


def _obj(arr: np.ndarray[Any, Any], progress: int, device: int | None = None) -> LocalObject:
    """A local object holding ``arr`` (in simulated device memory of ``device`` unless None)."""
    flat = arr.reshape(-1).view(np.uint8)
    return local_object(flat if device is None else sim_array(flat, device), arr.dtype, arr.shape, progress)


def reduce_task(arr: np.ndarray[Any, Any], op: ReduceOp, children: int, count: int) -> p.ReduceTask:
    """A vertex's task over arrays like ``arr``, with ``children`` children (``count``: at the root)."""
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


async def _arrive(children: list[LocalObject], reducing: asyncio.Future[None], steps: random.Random) -> None:
    """The children's bytes arrive in random steps, in any order; then the reduction ends."""
    while any(c.progress < c.size for c in children):
        c = steps.choice([c for c in children if c.progress < c.size])
        c.advance(c.progress + steps.randint(1, max(1, c.size // 3)))
        await asyncio.sleep(0)
    await asyncio.wait_for(reducing, 30)


@settings(max_examples=80, deadline=None)
@given(
    n_children=st.integers(0, 4),
    length=st.integers(0, 2500),
    dtype=st.sampled_from(SUPPORTED_DTYPES),
    op=st.sampled_from(list(ReduceOp)),
    chunk=st.sampled_from([1, 3, 64, 1000, 1 << 20]),
    root=st.booleans(),
    seed=st.integers(0, 2**31),
    threads=st.sampled_from([1, 2, 3]),
)
def test_streamed_reduction_equals_whole_array_reduction(
    n_children: int, length: int, dtype: str, op: ReduceOp, chunk: int, root: bool, seed: int, threads: int
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
            reduce_stream(
                reduce_task(arrays[0], op, n_children, count), own, children, out, chunk, threads=threads
            )
        )
        await _arrive(children, reducing, steps)
        assert out.progress == out.size
        return out.buffer.host.view(dt)

    got = asyncio.run(run())
    assert np.array_equal(got.view(np.uint8), want.reshape(-1).view(np.uint8))


def test_a_failed_child_fails_the_vertex_and_its_output_stays_partial() -> None:
    arr = np.ones(1 << 16, np.float32)

    async def run() -> LocalObject:
        own, child, out = _obj(arr, arr.nbytes), _obj(arr.copy(), 0), _obj(np.empty_like(arr), 0)
        reducing = asyncio.ensure_future(
            reduce_stream(reduce_task(arr, ReduceOp.SUM, 1, 0), own, [child], out, 4096)
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


SIM = Buffer.wrap(sim_array(np.zeros(1, np.uint8))).backend


@pytest.fixture
def held() -> Iterator[threading.Event]:
    """Events of the simulated backend stay pending until the returned gate is set."""
    assert isinstance(SIM, SimBackend)
    gate = threading.Event()
    SIM.hold_events = gate
    try:
        yield gate
    finally:
        SIM.hold_events = None
        gate.set()  # a step still waited for ends


async def _until(condition: Callable[[], bool]) -> None:
    """Let the event loop run until ``condition`` holds (bounded: the reducer needs a few turns)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def _events() -> int:
    assert isinstance(SIM, SimBackend)
    return SIM.events_recorded


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["host", "device", "other device"]), min_size=0, max_size=3),
    length=st.integers(0, 2500),
    dtype=st.sampled_from(SUPPORTED_DTYPES),
    op=st.sampled_from(list(ReduceOp)),
    chunk=st.sampled_from([1, 3, 64, 1000]),
    most=st.sampled_from([0, 5, 256, 4096, 1 << 20]),
    root=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_device_output_reduced_in_steps_equals_whole_array_reduction(
    kinds: list[str], length: int, dtype: str, op: ReduceOp, chunk: int, most: int, root: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    dt = _dtype(dtype)
    arrays = [rng.integers(1, 4, length).astype(dt) for _ in range(len(kinds) + 1)]
    count = len(kinds) + 1 if root else 0
    want = np.empty_like(arrays[0])
    reduce_chunk(op, arrays[0], arrays[1:], want, count)
    steps = random.Random(seed)
    devices = {"host": None, "device": 0, "other device": 1}

    async def run() -> np.ndarray[Any, Any]:
        own = _obj(arrays[0], arrays[0].nbytes, 0)
        children = [_obj(a, 0, devices[k]) for a, k in zip(arrays[1:], kinds, strict=True)]
        out = _obj(np.empty_like(arrays[0]), 0, 0)
        task = reduce_task(arrays[0], op, len(kinds), count)
        reducing = asyncio.ensure_future(reduce_stream(task, own, children, out, chunk, None, most))
        await _arrive(children, reducing, steps)
        assert out.progress == out.size
        return out.buffer.view(0, out.size).view(np.ndarray)

    got = asyncio.run(run())
    assert np.array_equal(got, want.reshape(-1).view(np.uint8))


def test_a_device_step_takes_in_what_every_input_holds_and_is_published_once_done(
    held: threading.Event,
) -> None:
    arr = np.arange(1 << 14, dtype=np.float32)  # 64 KiB

    async def run() -> None:
        own, child, out = _obj(arr, arr.nbytes, 0), _obj(arr.copy(), 0, 0), _obj(np.empty_like(arr), 0, 0)
        before = _events()
        reducing = asyncio.ensure_future(
            reduce_stream(reduce_task(arr, ReduceOp.SUM, 1, 0), own, [child], out, 1024, None, 16384)
        )
        child.advance(40000)
        # Three steps queued, each as long as the inputs allow up to 16 KiB: 16 KiB, 16 KiB and
        # the 7232 bytes beyond; then the vertex waits for them before waiting for the child.
        await _until(lambda: _events() == before + 3)
        assert out.progress == 0  # queued, not done: nothing published
        held.set()
        await _until(lambda: out.progress == 40000)
        assert not reducing.done()
        child.advance(child.size)  # the other 25536 bytes: steps of 16 KiB and 9152
        await asyncio.wait_for(reducing, 30)
        assert _events() == before + 5
        assert np.array_equal(out.buffer.view(0, out.size).view(np.ndarray).view(np.float32), 2 * arr)

    asyncio.run(run())


def test_a_device_step_queued_before_a_child_failed_is_published_then_the_error_raised(
    held: threading.Event,
) -> None:
    arr = np.ones(1 << 14, np.float32)

    async def run() -> LocalObject:
        own, child, out = _obj(arr, arr.nbytes, 0), _obj(arr.copy(), 0, 0), _obj(np.empty_like(arr), 0, 0)
        before = _events()
        reducing = asyncio.ensure_future(
            reduce_stream(reduce_task(arr, ReduceOp.SUM, 1, 0), own, [child], out, 4096, None, 1 << 20)
        )
        child.advance(8192)
        await _until(lambda: _events() == before + 1)  # one step of 8 KiB, queued
        child.fail(PeerLostError("lost", peer="x", cause="test"))
        held.set()
        with pytest.raises(PeerLostError):
            await asyncio.wait_for(reducing, 10)
        return out

    out = asyncio.run(run())
    assert out.progress == 8192
    assert np.all(out.buffer.view(0, 8192).view(np.ndarray).view(np.float32) == 2)


class _LetGoOnWait(threading.Event):
    """A gate that counts the waits on it and lets go of every held event at the first."""

    waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        self.set()
        return True


def test_a_dropped_device_output_waits_for_its_queued_steps_before_raising() -> None:
    """The vertex's caller frees the memory once it returns: nothing it queued may still run."""
    arr = np.ones(1 << 14, np.float32)
    gate = _LetGoOnWait()
    assert isinstance(SIM, SimBackend)
    SIM.hold_events = gate

    async def run() -> tuple[LocalObject, int]:
        own, child, out = (
            _obj(arr, arr.nbytes, 0),
            _obj(arr.copy(), arr.nbytes, 0),
            _obj(np.empty_like(arr), 0, 0),
        )
        before = _events()
        reducing = asyncio.ensure_future(
            reduce_stream(reduce_task(arr, ReduceOp.SUM, 1, 0), own, [child], out, 1024, None, 4096)
        )
        await _until(lambda: _events() == before + 2)  # two steps of 4 KiB queued, not done
        out.fail(ObjectDeletedError("dropped", object_id=out.object_id.hex()))
        with pytest.raises(ObjectDeletedError):
            await asyncio.wait_for(reducing, 10)
        return out, _events() - before

    try:
        out, queued = asyncio.run(run())
    finally:
        SIM.hold_events = None
    assert queued == 2 and gate.waits == 2  # each queued step was waited for before it raised
    assert out.progress == 0
