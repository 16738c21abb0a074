"""A reduce vertex's runs of host chunks split among threads (hoplite_gpu.node.host_steps): the
same bytes as one chunk at a time, into private memory and through a new segment's file, with
weights; a thread's error is raised only after every thread stopped writing; runs are cut where
the sources end and on step boundaries."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import numpy as np
import pytest

from hoplite_gpu.memory import shm
from hoplite_gpu.memory.buffers import Buffer, BufferPool, through_file
from hoplite_gpu.node.host_steps import HostSteps, default_threads, ready_run
from hoplite_gpu.node.vertex import reduce_stream
from hoplite_gpu.reduce_ops import ReduceOp
from tests.test_vertex import _obj, local_object, reduce_task

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


def test_a_run_on_three_threads_writes_what_one_thread_writes_through_a_new_segment() -> None:
    rng = np.random.default_rng(5)
    arrays = [rng.integers(-9, 9, (5 * MiB + 24) // 8).astype(np.int64) for _ in range(4)]
    pool = BufferPool(1 << 20, shared_min_bytes=4096)
    flat = pool.allocate(arrays[0].nbytes, populate=False)
    assert through_file(flat)  # a fresh segment: written through its file, under the run's lock
    own, *children = (_obj(a, a.nbytes) for a in arrays)
    out = local_object(flat, np.dtype(np.int64), arrays[0].shape, 0)

    async def run() -> None:
        await reduce_stream(reduce_task(arrays[0], ReduceOp.SUM, 3, 4), own, children, out, MiB, threads=3)

    asyncio.run(run())
    assert out.progress == out.size
    assert np.array_equal(flat.view(np.int64), arrays[0] + arrays[1] + arrays[2] + arrays[3])
    seg = shm.segment_of(flat)
    assert seg is not None and not seg.populated  # every byte went through the file
    pool.release(flat)
    pool.clear()


@pytest.mark.parametrize("threads", [2, 4])
def test_a_weighted_run_equals_the_weighted_sum(threads: int) -> None:
    rng = np.random.default_rng(threads)
    arrays = [rng.standard_normal(3 * MiB // 4 + 5).astype(np.float32) for _ in range(3)]
    weights = [0.5, 1.0, -2.0]
    steps = HostSteps(
        ReduceOp.SUM,
        np.dtype(np.float32),
        _obj(arrays[0], arrays[0].nbytes),
        tuple(_obj(a, a.nbytes) for a in arrays[1:]),
        np.empty(arrays[0].nbytes, np.uint8),
        0,
        weights,
        False,
    )
    steps.run(0, arrays[0].nbytes, 256 << 10, threads)
    want = 0.5 * arrays[0] + arrays[1] - 2.0 * arrays[2]
    assert np.allclose(steps.result.view(np.float32), want, rtol=1e-6)


class _Failing:
    """A child's buffer whose chunks at or past ``bad`` cannot be read; records the slices read."""

    def __init__(self, arr: np.ndarray[Any, Any], bad: int) -> None:
        self.inner = Buffer.wrap(arr.view(np.uint8))
        self.bad = bad
        self.read: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def host_chunk(self, start: int, end: int) -> np.ndarray[Any, Any]:
        if start >= self.bad:
            raise OSError("the chunk is gone")
        with self.lock:
            self.read.append((start, end))
        return self.inner.host_chunk(start, end)


def test_an_error_on_one_thread_is_raised_once_every_thread_stopped() -> None:
    arr = np.arange(8 * MiB // 8, dtype=np.int64)
    child = _obj(arr.copy(), arr.nbytes)
    failing = _Failing(arr.copy(), bad=6 * MiB)  # the last of four threads' slices fails
    child.buffer = failing  # type: ignore[assignment]
    result = np.zeros(arr.nbytes, np.uint8)
    steps = HostSteps(
        ReduceOp.SUM, np.dtype(np.int64), _obj(arr, arr.nbytes), (child,), result, 0, None, False
    )
    with pytest.raises(OSError, match="gone"):
        steps.run(0, arr.nbytes, MiB, 4)
    # The threads that did not fail wrote their slices whole before the error came out.
    assert np.array_equal(result[: 6 * MiB].view(np.int64), 2 * arr[: 6 * MiB // 8])
    assert sorted(failing.read) == [(i * MiB, (i + 1) * MiB) for i in range(6)]


def test_a_run_ends_on_a_step_where_the_sources_end_and_needs_two_steps() -> None:
    arr = np.zeros(10 * MiB, np.uint8)
    a, b = _obj(arr, 10 * MiB), _obj(arr, 0)
    b.advance(5 * MiB + 100)
    assert ready_run((a, b), 0, MiB, 10 * MiB, 2) == 5 * MiB  # on a step boundary
    assert ready_run((a, b), 4 * MiB, MiB, 10 * MiB, 2) == 4 * MiB  # one step: none
    assert ready_run((a, b), 0, MiB, 10 * MiB, 1) == 0  # one thread: none
    b.advance(10 * MiB)
    assert ready_run((a, b), 0, MiB, 10 * MiB, 2) == 8 * MiB  # at most RUN_CHUNKS per thread
    assert ready_run((a, b), 7 * MiB + 1, MiB, 10 * MiB, 2) == 10 * MiB  # to the end, unaligned
    assert 1 <= default_threads() <= 4


def test_a_forked_child_makes_its_own_threads() -> None:
    arr = np.arange(4 * MiB // 8, dtype=np.int64)

    def summed() -> bool:
        result = np.zeros(arr.nbytes, np.uint8)
        steps = HostSteps(
            ReduceOp.SUM,
            np.dtype(np.int64),
            _obj(arr, arr.nbytes),
            (_obj(arr, arr.nbytes),),
            result,
            0,
            None,
            False,
        )
        steps.run(0, arr.nbytes, MiB, 2)
        return bool(np.array_equal(result.view(np.int64), 2 * arr))

    assert summed()  # the pool's threads exist in this process now
    pid = os.fork()
    if pid == 0:  # the child: the parent's threads are not here; a run must not wait for them
        code = 1
        try:
            code = 0 if summed() else 1
        finally:
            os._exit(code)
    waited: list[tuple[int, int]] = []
    waiter = threading.Thread(target=lambda: waited.append(os.waitpid(pid, 0)), daemon=True)
    waiter.start()
    waiter.join(30)
    if not waited:
        os.kill(pid, 9)
        waiter.join(10)
        pytest.fail("the forked child's run hung")
    status = waited[0][1]
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
