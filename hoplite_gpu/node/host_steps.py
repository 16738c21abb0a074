"""A reduce vertex's steps over host memory: one chunk at a time on the node's event loop, or,
where every source already holds several chunks past the vertex, a run of them split among a few
threads (NumPy's arithmetic and ``pwrite`` release the GIL).

The run is what the root of a one-host star meets: it reduces every input after the last put has
landed, alone on the host's cores by then, and a second core halves that tail
(bench/pages/collectives.md#the-stars-tail-on-two-cores). The event loop's own thread
reduces one slice of the run and waits for the others before it goes on, so nothing the loop does
(a deletion that frees the output, a cancellation) can happen while a thread writes.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import HopliteTimeoutError
from ..memory import LocalObject, write_at
from ..reduce_ops import ReduceOp, reduce_chunk, weighted_sum_chunk

#: Chunks each thread reduces in one run: a run keeps the event loop for about as long as this
#: many chunks take on one core (about 0.5 ms per MiB of a 4-input sum here).
RUN_CHUNKS = 4

#: The most threads a run uses when ``Config.reduce_threads`` is 0 (the host's cores up to this).
DEFAULT_MAX_THREADS = 4

#: Seconds a run waits for its threads: far beyond a run's work (milliseconds); past it the
#: memory is not answering, and the vertex fails rather than wait on.
RUN_WAIT_SECONDS = 120.0

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    """In a forked child: the parent's threads are not there, so its pool is not used."""
    global _pool, _pool_size, _pool_lock
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def default_threads() -> int:
    """The threads a run uses by default: the cores this process may run on, at most
    :data:`DEFAULT_MAX_THREADS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(DEFAULT_MAX_THREADS, cores))


def _threads_pool(helpers: int) -> ThreadPoolExecutor:
    """The process's pool of helper threads, with room for ``helpers`` of them."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < helpers:
            old, _pool, _pool_size = _pool, ThreadPoolExecutor(helpers, "hoplite-reduce"), helpers
            if old is not None:
                old.shutdown(wait=False)  # its threads end once their work is done
        return _pool


@dataclass(frozen=True, slots=True)
class HostSteps:
    """What every step of one vertex's host reduction shares.

    Attributes:
        op: The operator (ignored with ``weights``).
        dtype: The elements' dtype.
        own: The vertex's input.
        children: Its children's outputs, in order.
        result: The output's flat host bytes.
        count: Inputs reduced in all, at the root (the final step of AVG), else 0.
        weights: One per source for a weighted sum, else None.
        through_file: Whether the output is written through its segment's file from scratch
            memory (see :func:`~hoplite_gpu.memory.through_file`).
    """

    op: ReduceOp
    dtype: np.dtype[Any]
    own: LocalObject
    children: tuple[LocalObject, ...]
    result: np.ndarray[Any, Any]
    count: int
    weights: list[float] | None
    through_file: bool
    # Writes through one file take its inode's lock, and a thread waiting for it spins in the
    # kernel: this lock makes it sleep instead, while the other threads go on reducing.
    writing: threading.Lock = field(default_factory=threading.Lock)

    def step(self, pos: int, end: int, scratch: np.ndarray[Any, Any] | None) -> None:
        """Reduce bytes ``[pos, end)`` of every source into the output (through ``scratch`` when
        the output is written through its file)."""
        mine = self.own.buffer.host[pos:end].view(self.dtype)
        parts = [c.buffer.host_chunk(pos, end).view(self.dtype) for c in self.children]
        flat = self.result[pos:end] if scratch is None else scratch[: end - pos]
        if self.weights:
            weighted_sum_chunk(mine, parts, flat.view(self.dtype), self.weights)
        else:
            reduce_chunk(self.op, mine, parts, flat.view(self.dtype), self.count)
        if scratch is not None:
            with self.writing:
                write_at(self.result, pos, flat)

    def steps(self, pos: int, end: int, step: int) -> None:
        """Reduce ``[pos, end)`` one ``step`` at a time (on a thread of its own: its own scratch)."""
        scratch = np.empty(min(step, end - pos), np.uint8) if self.through_file else None
        for at in range(pos, end, step):
            self.step(at, min(at + step, end), scratch)

    def run(self, pos: int, end: int, step: int, threads: int) -> None:
        """Reduce ``[pos, end)`` (whole steps but at the end) split among ``threads`` threads,
        this one included; returns once every slice is written, raising the first error.

        Raises:
            HopliteTimeoutError: a thread's slice did not end within :data:`RUN_WAIT_SECONDS`.
        """
        chunks = -(-(end - pos) // step)
        per = -(-chunks // threads)
        cuts = [min(end, pos + i * per * step) for i in range(threads + 1)]
        slices = [(a, b) for a, b in itertools.pairwise(cuts) if a < b]
        pool = _threads_pool(len(slices) - 1) if len(slices) > 1 else None
        futures: list[Future[None]] = []
        try:
            if pool is not None:
                futures = [pool.submit(self.steps, a, b, step) for a, b in slices[1:]]
            self.steps(*slices[0], step)
        finally:
            # Even on an error here: no thread may write after this returns.
            _, late = wait_all(futures, RUN_WAIT_SECONDS)
        if late:
            raise HopliteTimeoutError(
                f"a reduce step's thread did not end within {RUN_WAIT_SECONDS:.0f} s",
                operation="reduce step",
                timeout=RUN_WAIT_SECONDS,
            )
        for future in futures:
            future.result()


def ready_run(sources: tuple[LocalObject, ...], pos: int, step: int, size: int, threads: int) -> int:
    """Where a run from ``pos`` that ``threads`` threads reduce at once ends: at most
    :data:`RUN_CHUNKS` steps per thread, within what every source holds, on a step boundary but
    at ``size``; ``pos`` where fewer than two steps are ready (one step goes on the event loop)."""
    if threads < 2:
        return pos
    ready = min(min(src.progress for src in sources), size, pos + threads * RUN_CHUNKS * step)
    if ready < size:
        ready -= (ready - pos) % step
    return ready if ready - pos >= 2 * step else pos
