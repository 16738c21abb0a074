"""Synchronous SGD that does not wait for stragglers and still uses the exact gradient, with
hoplite_gpu's gradient codes (:mod:`hoplite_gpu.coding`; Tandon et al., ICML 2017).

A parameter server (this process, with hoplite's directory embedded) trains a linear model on
``n`` data partitions with ``n`` worker processes. Each worker holds ``s + 1`` partitions (a cyclic
assignment: every partition is held by ``s + 1`` workers). Each iteration the parameter server
``put``s the weights and tells every worker which ObjectIDs to put its results under; the workers
``get`` the weights and compute their partitions' gradients; the parameter server asks hoplite for
the decoded sum, one reduce, and takes a step. Two ways to send results:

* ``gc`` (gradient coding): each worker ``put``s one coded message, a combination of its
  partitions' gradients (:meth:`GradientCode.encode <hoplite_gpu.coding.GradientCode.encode>`);
  the reduce decodes the full gradient from the first ``n - s`` messages that suffice.
* ``partial`` (:class:`~hoplite_gpu.coding.PartialCode`): each worker ``put``s a piece as soon as
  each partition is done; the reduce finishes once every partition arrived from someone, so the
  finished work of slow workers counts too.

Each iteration ``s`` random workers are ``--slowdown`` times slower (a wait per partition emulates
a larger model's compute; a worker drops stale work when the next iteration starts). Both modes
reach the exact full gradient without waiting for them::

    python examples/coded_sgd.py
    python examples/coded_sgd.py --mode partial --workers 8 --stragglers 2 --iterations 30

``bench/coded_sgd.py`` measures both against waiting for every worker and against first-k (which
leaves the stragglers' partitions out), with stragglers that fail, and past what the code tolerates.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

import hoplite_gpu as hg
from hoplite_gpu.coding import GradientCode, PartialCode

#: Seconds a get or a reduction may wait (an iteration takes a second at most: this bounds a bug).
TIMEOUT = 60.0


@dataclass(frozen=True)
class Problem:
    """A synthetic least-squares problem: ``n`` partitions of ``samples`` rows each,
    ``features`` inputs and ``outputs`` targets (the gradient has ``features * outputs`` floats)."""

    n: int = 8
    samples: int = 64
    features: int = 64
    outputs: int = 1024
    seed: int = 0

    def partition(self, j: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Partition ``j``'s inputs and targets (float32), the same in every process."""
        truth = np.random.default_rng(self.seed).standard_normal((self.features, self.outputs))
        rng = np.random.default_rng([self.seed, j + 1])
        x = rng.standard_normal((self.samples, self.features))
        y = x @ truth + 0.5 * rng.standard_normal((self.samples, self.outputs))
        return x.astype(np.float32), y.astype(np.float32)

    def gradient(self, j: int, w: np.ndarray[Any, Any], data: Any = None) -> np.ndarray[Any, Any]:
        """Partition ``j``'s share of the full gradient at ``w`` (the full gradient is the sum of
        the ``n`` shares): ``x^T (x w - y) / (n * samples)``."""
        x, y = self.partition(j) if data is None else data
        out: np.ndarray[Any, Any] = (x.T @ (x @ w - y)) / np.float32(self.n * self.samples)
        return out.astype(np.float32)


def worker(address: str, token: str, index: int, problem: Problem, s: int, conn: Any) -> None:
    """A worker process: for each ``(mode, weights id, result ids, seconds per partition)`` on
    ``conn``, compute its partitions' gradients and put what ``mode`` asks; None ends it."""
    node = hg.connect(address, token=token)
    code = GradientCode.cyclic(problem.n, s)  # seeded: the same code in every process
    partial = PartialCode(code)
    mine = code.partitions(index)
    data = {j: problem.partition(j) for j in mine}
    done: list[hg.ObjectID] = []  # what it put last iteration
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        mode, weights_id, ids, seconds = msg
        for oid in done:  # the last iteration is over: its results can go
            node.delete(oid)
        done = []
        w = node.get(weights_id, timeout=TIMEOUT)
        grads = {}
        for k, j in enumerate(mine):
            grads[j] = problem.gradient(j, w, data[j])
            if conn.poll(seconds):  # emulated compute, cut short: the next iteration started
                break
            if mode == "partial":  # a piece per partition, as soon as it is done
                node.put(partial.encode_piece(index, k, grads[j]), ids[k])
                done.append(ids[k])
        else:
            if mode == "gc":  # one message once every partition is done
                node.put(code.encode(index, grads), ids[0])
                done.append(ids[0])
    node.close()


def train(
    mode: str, problem: Problem, s: int, iterations: int, seconds: float, slowdown: float
) -> dict[str, Any]:
    """Train for ``iterations`` steps with ``problem.n`` worker processes in ``mode``; returns each
    iteration's seconds and gradient error (relative to the full gradient), and the loss before
    and after."""
    node = hg.init()  # the parameter server's node, with the directory embedded
    code = GradientCode.cyclic(problem.n, s)
    partial = PartialCode(code)
    parts = [problem.partition(j) for j in range(problem.n)]
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for i in range(problem.n):
        parent, child = ctx.Pipe()
        args = (node.directory_address, node.token, i, problem, s, child)
        procs.append(ctx.Process(target=worker, args=args, daemon=True))
        procs[-1].start()
        pipes.append(parent)

    def loss(w: np.ndarray) -> float:
        return sum(float(np.square(x @ w - y).sum()) for x, y in parts) / (2 * problem.n * problem.samples)

    rng = np.random.default_rng(1)
    w = np.zeros((problem.features, problem.outputs), np.float32)
    first, times, errors = loss(w), [], []
    try:
        for pipe in pipes:  # each worker connected to the directory
            if not pipe.poll(TIMEOUT) or pipe.recv() != "ready":
                raise RuntimeError("a worker did not start")
        for _ in range(iterations):
            slow = set(rng.choice(problem.n, s, replace=False).tolist())  # this iteration's stragglers
            start = time.monotonic()
            weights_id = node.put(w)
            if mode == "gc":
                ids = {i: hg.ObjectID.random() for i in range(problem.n)}
                sends = {i: [ids[i]] for i in range(problem.n)}
                result_id = code.reduce(node, ids, timeout=TIMEOUT)  # the first decodable messages
            else:
                ids = {piece: hg.ObjectID.random() for piece in partial.pieces()}
                sends = {i: [ids[(i, k)] for k in range(s + 1)] for i in range(problem.n)}
                result_id = partial.reduce(node, ids, timeout=TIMEOUT)  # a piece of every partition
            for i, pipe in enumerate(pipes):
                pipe.send((mode, weights_id, sends[i], seconds * (slowdown if i in slow else 1.0)))
            grad = node.get(result_id, timeout=TIMEOUT)  # the full gradient, decoded
            times.append(time.monotonic() - start)
            truth = sum(problem.gradient(j, w, parts[j]) for j in range(problem.n))
            errors.append(float(np.linalg.norm(grad - truth) / np.linalg.norm(truth)))
            w = w - np.float32(0.5) * grad
            del grad  # a view of the local copy
            node.delete(weights_id)
            node.delete(result_id)
    finally:
        for pipe, proc in zip(pipes, procs, strict=True):
            with contextlib.suppress(OSError):  # a worker that died has closed its end
                pipe.send(None)
            proc.join(30)
        node.close()
    return {"seconds": times, "errors": errors, "initial_loss": first, "final_loss": loss(w)}


def main() -> None:
    """Command line: train in each mode asked for."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["gc", "partial", "both"], default="both")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--stragglers", type=int, default=2, help="slow workers per iteration (s)")
    ap.add_argument("--slowdown", type=float, default=5.0)
    ap.add_argument("--partition-seconds", type=float, default=0.1, help="emulated compute")
    ap.add_argument("--iterations", type=int, default=20)
    args = ap.parse_args()
    for mode in ["gc", "partial"] if args.mode == "both" else [args.mode]:
        problem = Problem(n=args.workers)
        seconds, s = args.partition_seconds, args.stragglers
        got = train(mode, problem, s, args.iterations, seconds, args.slowdown)
        each = (s + 1) * seconds  # a worker's partitions, emulated
        print(
            f"{mode}: median iteration {statistics.median(got['seconds']):.3f} s (a worker's {s + 1} "
            f"partitions take {each:.2f} s, a straggler's {each * args.slowdown:.2f} s), loss "
            f"{got['initial_loss']:.4g} -> {got['final_loss']:.4g}, largest gradient error "
            f"{max(got['errors']):.1e}"
        )


if __name__ == "__main__":
    main()
