"""The coded-SGD benchmark's runs (``bench/coded_sgd.py``, issue 20): synchronous SGD of
``examples/coded_sgd.py``'s problem with stragglers, in four modes side by side on real processes,
with the figures the benchmark reports. The tests (``tests/test_coded_sgd.py``) run it in small form.

A parameter server (this process, with an embedded directory) trains a linear model on ``n``
data partitions with ``n`` worker processes. Each iteration it puts the weights under a fresh
ObjectID and tells every worker which ids to put its results under; the workers ``get`` the
weights, compute partition gradients and ``put`` them; the parameter server aggregates with one
hoplite reduce and takes a step. The modes differ in what workers compute and what the reduce
waits for:

* ``all``: worker ``i`` computes partition ``i``; the reduce waits for all ``n`` (exact).
* ``firstk``: the same, reduced with ``num_objects = n - s``, scaled by ``n / (n - s)``: fast,
  but the stragglers' partitions are missing (inexact).
* ``gc``: a gradient code (:meth:`GradientCode.cyclic <hoplite_gpu.coding.GradientCode.cyclic>`):
  each worker computes ``s + 1`` partitions and sends one coded message; the reduce decodes the
  first messages that can be (exact).
* ``partial``: :class:`~hoplite_gpu.coding.PartialCode` on the same assignment: a piece per
  finished partition; the reduce decodes as soon as every partition arrived (exact).

Stragglers: each iteration a seeded draw picks ``s`` workers that are ``slowdown`` times slower
(``kind="slow"``) or deliver nothing (``kind="failed"``); every worker's time per partition also
varies by a seeded factor (log-normal, sigma 0.1). A worker's compute is the real gradient plus
a wait that brings it to ``partition_seconds`` times its factor (the emulated cost of a larger
model); the wait ends early when the next iteration starts, as a real worker would abandon
stale work.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import numpy as np

from examples.coded_sgd import Problem

MODES = ("all", "firstk", "gc", "partial")
#: The environment of the worker processes (inherited when they are spawned).
BLAS_THREADS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
KINDS = ("slow", "failed")


class Evaluator:
    """The parameter server's view of the whole dataset: loss, true full gradient, optimum."""

    def __init__(self, problem: Problem) -> None:
        self.parts = [problem.partition(j) for j in range(problem.n)]  # float32, as the workers'
        self.x = np.concatenate([x for x, _ in self.parts]).astype(np.float64)
        self.y = np.concatenate([y for _, y in self.parts]).astype(np.float64)
        self.count = self.x.shape[0]
        best, *_ = np.linalg.lstsq(self.x, self.y, rcond=None)
        self.best_loss = self.loss(best)
        # Step size 1/L, L the largest eigenvalue of the loss's Hessian x^T x / count.
        self.step = float(1.0 / np.linalg.eigvalsh(self.x.T @ self.x / self.count)[-1])

    def loss(self, w: np.ndarray[Any, Any]) -> float:
        """Half the mean squared error over every sample."""
        r = self.x @ w - self.y
        return float(0.5 * np.sum(r * r) / self.count)

    def gradient(self, problem: Problem, w: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The full gradient the workers' shares add up to: each partition's share computed as a
        worker computes it (float32), summed in float64. An exact aggregation differs from it by
        the rounding of the last sum only."""
        out: np.ndarray[Any, Any] = sum(  # type: ignore[assignment]
            problem.gradient(j, w, part).astype(np.float64) for j, part in enumerate(self.parts)
        )
        return out


def modelled_seconds(mode: str, times: list[float | None], s: int) -> float:
    """The iteration time the emulated compute alone allows (no communication, no overhead):
    when the first results that suffice are all computed. ``times``: each worker's seconds per
    partition (None: failed)."""
    from hoplite_gpu.coding import DecodeTracker, PartialCode

    n = len(times)
    alive = sorted(t for t in times if t is not None)
    if mode == "all":
        return float("inf") if len(alive) < n else alive[-1]
    if mode == "firstk":
        return alive[n - s - 1] if len(alive) >= n - s else float("inf")
    code = _code(n, s)
    if mode == "gc":
        done = sorted((t * len(code.partitions(i)), i) for i, t in enumerate(times) if t is not None)
        rows = [(finish, code.matrix[i]) for finish, i in done]
    else:
        partial = PartialCode(code)
        rows = sorted(
            (
                ((k + 1) * t, partial.piece_row(i, k))
                for i, t in enumerate(times)
                if t is not None
                for k in range(len(code.partitions(i)))
            ),
            key=lambda item: item[0],
        )
    tracker = DecodeTracker(n)
    for key, (finish, row) in enumerate(rows):
        if tracker.add(key, row):
            return float(finish)
    return float("inf")


# ---------------------------------------------------------------- workers
@functools.cache
def _code(n: int, s: int) -> Any:
    from hoplite_gpu.coding import GradientCode

    return GradientCode.cyclic(n, s)  # seeded: the same code in every process


def _worker(address: str, token: str, index: int, problem: Problem, conn: Any) -> None:
    """A worker process: for each iteration message, compute and put what its mode asks."""
    import hoplite_gpu as hg
    from hoplite_gpu.coding import PartialCode

    node = hg.connect(address, token=token, shared_memory=False)
    data: dict[int, Any] = {}
    mine: list[Any] = []  # what this worker put in the previous iteration (deleted next time)
    conn.send("ready")
    pending = None
    try:
        while True:
            msg = pending if pending is not None else conn.recv()
            pending = None
            if msg is None:
                break
            for oid in mine:
                node.delete(oid)
            mine = []
            mode, weights_hex, ids, per_partition, s = msg
            code = _code(problem.n, s) if mode in ("gc", "partial") else None
            partial = PartialCode(code) if mode == "partial" else None
            order = code.partitions(index) if code is not None else [index]
            if per_partition is None:  # a failed worker this iteration: nothing to send
                pending = conn.recv()
                if pending is None:
                    return
                continue
            try:
                w = node.get(hg.ObjectID.from_hex(weights_hex), timeout=60)
            except hg.ObjectDeletedError:
                # The driver finished this iteration without this straggler (first k, or decoded
                # from the others) and deleted its weights: wait for the next one.
                pending = conn.recv()
                if pending is None:
                    return
                continue
            grads: dict[int, Any] = {}
            aborted = False
            for k, j in enumerate(order):
                start = time.monotonic()
                if j not in data:
                    data[j] = problem.partition(j)
                grads[j] = problem.gradient(j, w, data[j])
                # Emulated cost: the rest of this partition's time, cut short by the next iteration.
                if conn.poll(max(0.0, per_partition - (time.monotonic() - start))):
                    pending, aborted = conn.recv(), True
                    if pending is None:
                        return
                    break
                if partial is not None:
                    oid = hg.ObjectID.from_hex(ids[k])
                    node.put(partial.encode_piece(index, k, grads[j]), oid)
                    mine.append(oid)
            if aborted:
                continue
            if mode in ("all", "firstk"):
                oid = hg.ObjectID.from_hex(ids[0])
                node.put(grads[index], oid)
                mine.append(oid)
            elif mode == "gc":
                assert code is not None
                oid = hg.ObjectID.from_hex(ids[0])
                node.put(code.encode(index, grads), oid)
                mine.append(oid)
    finally:
        node.close()


# ---------------------------------------------------------------- the parameter server
def _partition_times(
    rng: np.random.Generator, n: int, count: int, kind: str, slowdown: float, base: float
) -> tuple[list[float | None], list[int]]:
    """Each worker's seconds per partition this iteration (None: failed) and the ``count``
    stragglers drawn."""
    stragglers = sorted(int(i) for i in rng.choice(n, count, replace=False)) if count else []
    jitter = rng.lognormal(0.0, 0.1, n)
    times: list[float | None] = [float(base * jitter[i]) for i in range(n)]
    for i in stragglers:
        times[i] = None if kind == "failed" else float(base * slowdown * jitter[i])
    return times, stragglers


def run(
    mode: str,
    workers: int = 8,
    stragglers: int = 2,
    kind: str = "slow",
    slowdown: float = 5.0,
    partition_seconds: float = 0.2,
    iterations: int = 30,
    problem: Problem | None = None,
    target: float = 1e-3,
    seed: int = 1,
    timeout: float = 60.0,
    slow_workers: int | None = None,
) -> dict[str, Any]:
    """Train for ``iterations`` synchronous steps in ``mode`` and return the record: per-iteration
    seconds (and what the emulated compute alone allows, :func:`modelled_seconds`), loss after
    each, relative error of each aggregated gradient against the true full gradient, and the
    time to reach the target loss (``best * (1 + target)``, ``best`` the least-squares optimum).

    ``stragglers`` is the ``s`` the codes tolerate (and first-k leaves out); ``slow_workers``
    how many workers straggle each iteration (default ``s``; more than ``s`` is past what the
    codes were built for). The straggler draws depend on ``seed`` only, so every mode sees the
    same stragglers."""
    import hoplite_gpu as hg
    from hoplite_gpu.baselines import start_workers, stop_workers
    from hoplite_gpu.coding import PartialCode

    if mode not in MODES or kind not in KINDS:
        raise ValueError(f"mode is one of {MODES} and kind one of {KINDS}")
    if mode == "all" and kind == "failed":
        raise ValueError("wait-for-all cannot finish an iteration with failed workers")
    problem = problem or Problem(n=workers)
    n, s = problem.n, stragglers
    evaluator = Evaluator(problem)
    code = _code(n, s)
    partial = PartialCode(code)
    rng = np.random.default_rng(seed)
    # One BLAS thread per worker: n workers share this machine's cores, and a worker's compute
    # must fit in its emulated time per partition.
    saved = {k: os.environ.get(k) for k in BLAS_THREADS}
    os.environ.update(BLAS_THREADS)
    node = hg.init(shared_memory=False)
    pipes: list[Any] = []
    procs: list[Any] = []
    record: dict[str, Any] = {
        "mode": mode,
        "kind": kind,
        "n": n,
        "s": s,
        "slow_workers": s if slow_workers is None else slow_workers,
        "slowdown": slowdown,
        "partition_seconds": partition_seconds,
    }
    try:
        pipes, procs = start_workers(
            _worker, [(node.directory_address, node.token, i, problem) for i in range(n)]
        )
        w = np.zeros((problem.features, problem.outputs), np.float32)
        initial = evaluator.loss(w)
        goal = evaluator.best_loss * (1.0 + target)
        times: list[float] = []
        losses: list[float] = []
        errors: list[float] = []
        used: list[int] = []
        picked: list[list[int]] = []
        modelled: list[float] = []
        for _ in range(iterations):
            count = s if slow_workers is None else slow_workers
            per_partition, slow = _partition_times(rng, n, count, kind, slowdown, partition_seconds)
            start = time.monotonic()
            wid = node.put(w)
            if mode == "partial":
                ids = {pc: hg.ObjectID.random() for pc in partial.pieces()}
                for i, pipe in enumerate(pipes):
                    order = [ids[(i, k)].hex() for k in range(len(partial.partitions(i)))]
                    pipe.send((mode, wid.hex(), order, per_partition[i], s))
                decoded = partial.reduce_detailed(node, ids, timeout=timeout)
                rid, count = decoded.object_id, len(decoded.pieces)
            else:
                wids = {i: hg.ObjectID.random() for i in range(n)}
                for i, pipe in enumerate(pipes):
                    pipe.send((mode, wid.hex(), [wids[i].hex()], per_partition[i], s))
                if mode == "gc":
                    done = code.reduce_detailed(node, wids, timeout=timeout)
                    rid, count = done.object_id, len(done.workers)
                else:
                    k = n if mode == "all" else n - s
                    rid = node.reduce(list(wids.values()), num_objects=k, timeout=timeout)
                    count = k
            grad = node.get(rid, timeout=timeout)
            if mode == "firstk":
                grad = grad * np.float32(n / (n - s))  # an unbiased estimate of the full sum
            times.append(time.monotonic() - start)
            modelled.append(modelled_seconds(mode, per_partition, s))
            # Outside the timed part: the true gradient, the step and the loss.
            truth = evaluator.gradient(problem, w)
            errors.append(float(np.linalg.norm(grad - truth) / np.linalg.norm(truth)))
            used.append(count)
            w = (w - np.float32(evaluator.step) * grad).astype(np.float32)
            losses.append(evaluator.loss(w))
            node.delete(wid)
            node.delete(rid)
            picked.append(slow)
        elapsed = np.cumsum(times)
        reached = [float(t) for t, loss in zip(elapsed, losses, strict=True) if loss <= goal]
        record.update(
            iteration_seconds=times,
            modelled_seconds=modelled,
            losses=losses,
            gradient_errors=errors,
            inputs_used=used,
            stragglers=picked,
            initial_loss=initial,
            best_loss=evaluator.best_loss,
            target_loss=goal,
            time_to_target=reached[0] if reached else None,
            iterations_to_target=(int(np.argmax(np.array(losses) <= goal)) + 1) if reached else None,
        )
        return record
    finally:
        stop_workers(pipes, procs)
        node.close()  # stops the embedded directory too
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
