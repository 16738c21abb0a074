"""The local store's buffer pool: recycled only when nothing else refers to a buffer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hoplite_gpu.memory.buffers import Buffer, BufferPool
from tests.procs import digest, make_array

pytestmark = pytest.mark.timeout(60)


def test_an_unreferenced_buffer_is_reused() -> None:
    pool = BufferPool(1 << 20)
    buf = pool.allocate(4096)
    address = buf.ctypes.data
    pool.release(buf)
    del buf
    again = pool.allocate(4096)
    assert again.ctypes.data == address
    assert pool.reused == 1 and pool.held_bytes == 0


def test_a_buffer_with_a_live_view_is_not_reused() -> None:
    pool = BufferPool(1 << 20)
    buf = pool.allocate(4096)
    view = buf.view(np.float32).reshape(32, 32)
    view.flags.writeable = False
    pool.release(buf)
    del buf
    other = pool.allocate(4096)
    assert other.ctypes.data != view.ctypes.data
    other[:] = 7  # must not reach the view
    assert pool.reused == 0
    del view
    assert pool.allocate(4096) is not None and pool.reused == 1


def test_only_exact_sizes_are_reused_and_the_pool_is_bounded() -> None:
    pool = BufferPool(10_000)
    bufs = [np.empty(4000, np.uint8) for _ in range(3)]
    for b in bufs:
        pool.release(b)
    assert pool.held_bytes == 8000  # the oldest was dropped to stay within 10 000 bytes
    pool.release(np.empty(20_000, np.uint8))  # larger than the whole pool: not kept
    assert pool.held_bytes == 8000
    del bufs, b
    assert pool.allocate(3000).nbytes == 3000 and pool.reused == 0
    pool.allocate(4000)
    assert pool.reused == 1 and pool.held_bytes == 4000


def test_disabled_pool_keeps_nothing() -> None:
    pool = BufferPool(0)
    pool.release(np.empty(100, np.uint8))
    assert pool.held_bytes == 0


def test_a_result_held_across_delete_survives_the_next_get(owner: Any) -> None:
    """The array ``get`` gave the user must stay intact after delete and new objects."""
    first = make_array("float64", (256, 256), seed=11)  # 512 KiB: not inline
    oid = owner.put(first)
    held = owner.get(oid)
    owner.delete(oid)
    for seed in range(3):
        other = make_array("float64", (256, 256), seed=100 + seed)
        oid2 = owner.put(other)
        assert digest(owner.get(oid2)) == digest(other)
        owner.delete(oid2)
    assert digest(held) == digest(first)


def test_a_removed_object_is_refused_at_once() -> None:
    """A pull of an object this node just deleted must not wait for it to reappear."""
    import asyncio

    from hoplite_gpu.memory.store import LocalObject, LocalStore
    from hoplite_gpu.object_id import ObjectID

    async def scenario() -> tuple[object, object]:
        store = LocalStore(1 << 20)
        oid = ObjectID.random()
        data = np.zeros(16, np.uint8)
        store.add(LocalObject(oid, 16, "|u1", (16,), b"", Buffer.wrap(data), progress=16))
        store.remove(oid)
        gone = await asyncio.wait_for(store.wait_for(oid, timeout=60), 5)
        store.add(LocalObject(oid, 16, "|u1", (16,), b"", Buffer.wrap(data), progress=16))
        back = await asyncio.wait_for(store.wait_for(oid, timeout=60), 5)
        return gone, back

    gone, back = asyncio.run(scenario())
    assert gone is None and back is not None


def test_chunk_size_follows_measured_throughput() -> None:
    from hoplite_gpu.config import Config, MiB
    from hoplite_gpu.dataplane import UcxDataPlane
    from hoplite_gpu.memory.store import LocalStore

    cfg = Config(chunk_bytes=4 * MiB, chunk_seconds=0.004, min_chunk_bytes=MiB // 4, max_chunk_bytes=16 * MiB)
    plane = UcxDataPlane(LocalStore(1), "token", cfg)
    assert plane.chunk_size("a:1") == 4 * MiB  # nothing measured yet
    plane.rates.record("a:1", 512 * 1024, 1.0)  # too small a transfer to count
    assert plane.chunk_size("a:1") == 4 * MiB
    plane.rates.record("a:1", 100 * MiB, 0.02)  # 5 GiB/s: capped at max
    assert plane.chunk_size("a:1") == 16 * MiB
    plane.rates.record("b:1", 100 * MiB, 1.0)  # 100 MiB/s: 409.6 KiB, rounded down to 64 KiB units
    assert plane.chunk_size("b:1") == 384 * 1024
    plane.rates.record("c:1", 10 * MiB, 10.0)  # 1 MiB/s: floored at min
    assert plane.chunk_size("c:1") == MiB // 4
    assert UcxDataPlane(LocalStore(1), "t", cfg.replace(adaptive_chunks=False)).chunk_size("a:1") == 4 * MiB


def test_a_thread_waits_for_progress_made_on_the_loop_and_hears_failures() -> None:
    import asyncio
    import threading

    import hoplite_gpu as hg
    from hoplite_gpu.errors import HopliteTimeoutError, PeerLostError
    from hoplite_gpu.memory.store import LocalObject

    def new() -> LocalObject:
        data = Buffer.wrap(np.empty(1 << 20, np.uint8))
        return LocalObject(hg.ObjectID.random(), 1 << 20, "|u1", (1 << 20,), b"", data)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        obj = new()
        waiting = loop.run_in_executor(None, obj.wait_progress_from_thread, 4096, 10.0)
        while not obj._thread_waits:  # the thread is in its wait (no sleep-based timing)
            await asyncio.sleep(0.001)
        obj.advance(1024)  # not enough: the thread looks again and goes on waiting
        obj.advance(8192)
        await asyncio.wait_for(waiting, 5)
        failed = new()
        waiting = loop.run_in_executor(None, failed.wait_progress_from_thread, 4096, 10.0)
        while not failed._thread_waits:
            await asyncio.sleep(0.001)
        failed.fail(PeerLostError("gone", peer="x"))
        with pytest.raises(PeerLostError):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(HopliteTimeoutError, match="no progress"):
            await loop.run_in_executor(None, new().wait_progress_from_thread, 1, 0.05)
        done = new()
        done.advance(1 << 20)
        done.wait_progress_from_thread(1 << 30, 0.0)  # more than the object: it is complete

    assert threading.current_thread() is threading.main_thread()
    asyncio.run(main())


def test_progress_made_on_a_thread_wakes_coroutines_and_threads_that_wait_for_it() -> None:
    import asyncio
    import threading

    import hoplite_gpu as hg
    from hoplite_gpu.memory.store import LocalObject

    size = 1 << 20
    obj = LocalObject(hg.ObjectID.random(), size, "|u1", (size,), b"", Buffer.wrap(np.empty(size, np.uint8)))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        failure = obj.failure()  # watched until the object fails: never woken by progress
        in_thread = loop.run_in_executor(None, obj.wait_progress_from_thread, 3 * 4096, 10.0)
        on_loop = asyncio.ensure_future(obj.wait_progress(2 * 4096, 10.0))
        while not obj._thread_waits or len(obj._waiters) < 2:  # both wait (no sleep-based timing)
            await asyncio.sleep(0.001)

        def advance() -> None:
            for k in range(1, 5):
                obj.advance_from_thread(k * 4096, loop)
            obj.advance_from_thread(k * 4096 - 1, loop)  # never backwards

        await loop.run_in_executor(None, advance)
        await asyncio.wait_for(asyncio.gather(in_thread, on_loop), 5)
        assert obj.progress == 4 * 4096 and not failure.done()
        # A coroutine that starts waiting while a thread advances is never left waiting: the
        # waiter is added before the progress is read again.
        racing = threading.Thread(
            target=lambda: [obj.advance_from_thread(p, loop) for p in range(5 * 4096, size + 1, 4096)]
        )
        racing.start()
        for need in range(5 * 4096, size + 1, 4096):
            await asyncio.wait_for(obj.wait_progress(need, 10.0), 5)
        racing.join(5)
        assert obj.complete
        obj.forget_failure(failure)

    asyncio.run(main())


def test_the_pulls_served_from_an_object_are_counted_and_waited_for() -> None:
    import asyncio

    import hoplite_gpu as hg
    from hoplite_gpu.memory.store import LocalObject

    async def main() -> None:
        obj = LocalObject(hg.ObjectID.random(), 8, "|u1", (8,), b"", Buffer.wrap(np.zeros(8, np.uint8)))
        assert await obj.wait_unserved(0.01)  # nothing served: at once
        ended = asyncio.Event()

        async def serve() -> None:
            with obj.being_served():
                await ended.wait()

        serving = [asyncio.ensure_future(serve()) for _ in range(2)]
        await asyncio.sleep(0)  # both entered
        assert obj.serving == 2
        assert not await obj.wait_unserved(0.01)  # still served after the timeout
        waiting = asyncio.ensure_future(obj.wait_unserved(5))
        ended.set()
        assert await waiting
        await asyncio.gather(*serving)
        assert obj.serving == 0

    asyncio.run(main())


def test_an_object_added_from_a_callers_thread_is_counted_and_never_one_awaited() -> None:
    """``add_from_caller`` (a put on a caller channel) adds only what nothing awaits and what
    fits (the caller then puts through the I/O thread, whose add wakes the waiters)."""
    import asyncio

    from hoplite_gpu.memory.store import LocalObject, LocalStore
    from hoplite_gpu.object_id import ObjectID

    def obj(oid: ObjectID, size: int = 16) -> LocalObject:
        data = np.zeros(size, np.uint8)
        return LocalObject(oid, size, "|u1", (size,), b"", Buffer.wrap(data), progress=size)

    store = LocalStore(64)
    first = ObjectID.random()
    assert store.add_from_caller(obj(first)) and store.used_bytes == 16
    assert store.get(first) is not None
    assert not store.add_from_caller(obj(first))  # here already
    assert not store.add_from_caller(obj(ObjectID.random(), 64))  # does not fit
    store.remove(first)
    assert store.used_bytes == 0

    async def scenario() -> tuple[bool, object]:
        awaited = ObjectID.random()
        waiter = asyncio.ensure_future(store.wait_for(awaited, timeout=60))
        await asyncio.sleep(0)  # one turn of the loop: the waiter runs to its await
        refused = store.add_from_caller(obj(awaited))
        store.add(obj(awaited))  # the I/O thread's add
        return refused, await asyncio.wait_for(waiter, 5)

    refused, found = asyncio.run(scenario())
    assert refused is False and found is not None


def test_only_a_plain_complete_object_leaves_the_store_from_a_callers_thread() -> None:
    """``remove_from_caller`` (a delete on a caller channel, a barrier's release) removes what
    needs nothing of the loop: complete, awaited by nothing, private host memory."""
    import asyncio

    from hoplite_gpu.memory.store import LocalObject, LocalStore
    from hoplite_gpu.object_id import ObjectID

    def obj(progress: int = 16) -> LocalObject:
        return LocalObject(
            ObjectID.random(), 16, "|u1", (16,), b"", Buffer.wrap(np.zeros(16, np.uint8)), progress
        )

    store = LocalStore(1 << 20)
    plain, partial, pinned = obj(), obj(progress=8), obj()
    pinned.buffer.unpin = lambda: None  # page-locked by a put(pinned=True): undone on the loop
    for o in (plain, partial, pinned):
        store.add(o)
    assert store.remove_from_caller(ObjectID.random())  # not here: nothing to do
    assert store.removable_from_caller(plain.object_id) and store.remove_from_caller(plain.object_id)
    assert store.get(plain.object_id) is None and store.used_bytes == 32
    for o in (partial, pinned):
        assert not store.removable_from_caller(o.object_id) and not store.remove_from_caller(o.object_id)
        assert store.get(o.object_id) is o

    async def watched() -> bool:  # a reader watching it (a pull's failure future) is the loop's
        done = obj()
        store.add(done)
        fut = done.failure()
        refused = not store.remove_from_caller(done.object_id)
        done.forget_failure(fut)
        return refused and store.remove_from_caller(done.object_id)

    assert asyncio.run(watched())
    assert store.used_bytes == 32
