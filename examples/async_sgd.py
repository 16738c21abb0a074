"""Asynchronous SGD with a parameter server on Ray actors, the first ``k`` gradients of every update
summed by hoplite_gpu's reduce (the workload of section 5.3 of the Hoplite paper, Zhuang et al.,
SIGCOMM 2021).

A parameter server (PS) and ``N`` workers are Ray actors, each with its own hoplite node
(:func:`hoplite_gpu.ray.node`). Every worker always has one task outstanding: ``get`` the parameters
it was given (workers that fetch them at the same time form a pipelined broadcast chain), compute a
gradient on its own batch and ``put`` it under the ObjectID the PS chose. Each update the PS asks for
the sum of the first ``k`` gradients to be put, ``reduce(outstanding_ids, num_objects=k)``: they are
summed in a tree among the workers holding them while the PS streams the result, and
``reduced_objects`` says which ``k`` were used. The PS takes an SGD step, puts the new parameters and
relaunches those ``k`` workers; the other ``N - k`` go on, and their gradients count, stale, in a
later update. Parameters, gradients and sums are deleted once nothing needs them.

The model is a linear regression ``y = W^T x`` on synthetic data from a teacher (inputs in a random
``rank``-dimensional subspace, targets with noise), whose expected loss has a closed form. A gradient
carries its batch's loss as one more float32, so a sum of ``k`` gradients carries their losses' sum::

    python examples/async_sgd.py                       # 4 workers, k = 2, 4 MB gradients
    python examples/async_sgd.py --workers 8 -k 4 --grad-bytes 100000000

``bench/asgd.py`` measures this workload against plain Ray and with a worker SIGKILLed mid-run (its
parameter server, :mod:`bench.workloads.asgd_actors`, also relaunches a worker that died and asks
for another reduction when one can no longer find ``k`` gradients).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
import uuid
from typing import Any

import numpy as np
import ray

import hoplite_gpu.ray as hgray
from hoplite_gpu import ObjectID

#: Seconds a get or a reduction may wait (an update takes about a second: this bounds a bug).
TIMEOUT = 120.0


@dataclasses.dataclass(frozen=True)
class Problem:
    """The synthetic regression problem and the model's shape (see the module docstring).

    Attributes:
        d_in: Input features.
        d_out: Outputs (``d_in * d_out`` parameters).
        rank: Dimension of the subspace the inputs lie in.
        batch: Samples in each worker's batch.
        noise: Standard deviation of the targets' noise (the loss floor is ``noise**2 / 2``).
        seed: Seed of the teacher and of every batch.
    """

    d_in: int
    d_out: int
    rank: int = 8
    batch: int = 8
    noise: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.d_in, self.d_out, self.rank, self.batch) < 1 or self.rank > self.d_in:
            raise ValueError(f"invalid problem shape: {self}")

    @classmethod
    def for_bytes(cls, grad_bytes: int, **kwargs: Any) -> Problem:
        """A square-ish problem whose float32 gradient takes about ``grad_bytes`` bytes."""
        n = max(4, int(grad_bytes) // 4)
        d_in = max(2, math.isqrt(n))
        return cls(d_in=d_in, d_out=max(1, n // d_in), **kwargs)

    @property
    def params(self) -> int:
        """Number of parameters."""
        return self.d_in * self.d_out

    @property
    def grad_bytes(self) -> int:
        """Bytes of one gradient object (the parameters' gradient and the batch loss)."""
        return 4 * (self.params + 1)


class Model:
    """The teacher of a :class:`Problem`, its batches, gradients and exact loss."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        rng = np.random.default_rng([problem.seed, 0])
        q, _ = np.linalg.qr(rng.standard_normal((problem.d_in, problem.rank)))
        self.q = np.ascontiguousarray(q, dtype=np.float32)  # orthonormal basis of the inputs
        self.b = rng.standard_normal((problem.d_out, problem.rank), dtype=np.float32)

    def batch(self, worker: int, task: int) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and targets of worker ``worker``'s ``task``-th batch (the same in every mode)."""
        pr = self.problem
        rng = np.random.default_rng([pr.seed, 1, worker, task])
        z = rng.standard_normal((pr.batch, pr.rank), dtype=np.float32)
        x = z @ self.q.T
        y = z @ self.b.T + np.float32(pr.noise) * rng.standard_normal((pr.batch, pr.d_out), dtype=np.float32)
        return x, y

    def gradient(self, params: np.ndarray, worker: int, task: int) -> np.ndarray:
        """The gradient of the batch's loss at ``params`` (flat), with the loss appended."""
        pr = self.problem
        w = params.reshape(pr.d_in, pr.d_out)
        x, y = self.batch(worker, task)
        residual = x @ w
        residual -= y
        out = np.empty(pr.params + 1, np.float32)
        np.matmul(x.T, residual * np.float32(1.0 / pr.batch), out=out[: pr.params].reshape(pr.d_in, pr.d_out))
        out[pr.params] = 0.5 * float(np.square(residual).sum()) / (pr.batch * pr.d_out)
        return out

    def loss(self, params: np.ndarray) -> float:
        """Expected loss at ``params`` over the data distribution (closed form)."""
        pr = self.problem
        fit = self.q.T @ params.reshape(pr.d_in, pr.d_out)  # rank x d_out
        fit -= self.b.T
        return 0.5 * (float(np.square(fit, dtype=np.float64).sum()) / pr.d_out + pr.noise**2)


# ---------------------------------------------------------------------------------------- the actors
class Worker:
    """A worker (a Ray actor): the gradient of its next batch at the parameters it is given."""

    def __init__(self, index: int, problem: Problem) -> None:
        self.index, self.model, self.tasks = index, Model(problem), 0
        self.node = hgray.node()  # this process's hoplite node
        self.last: ObjectID | None = None  # the gradient put last

    def compute(self, params_id: ObjectID, grad_id: ObjectID) -> None:
        """``get`` the parameters, ``put`` the gradient of the next batch as ``grad_id``."""
        if self.last is not None:  # the PS relaunched this worker: its last gradient was summed
            self.node.delete(self.last)
        params = self.node.get(params_id, timeout=TIMEOUT)  # a read-only view of the local copy
        grad = self.model.gradient(params, self.index, self.tasks)
        self.node.put(grad, grad_id, copy=False)  # never modified again: no copy
        self.last, self.tasks = grad_id, self.tasks + 1


class ParameterServer:
    """The parameter server (a Ray actor): :meth:`train` runs the whole loop."""

    def __init__(self, problem: Problem) -> None:
        self.problem, self.model = problem, Model(problem)
        self.node = hgray.node()
        self.tag = uuid.uuid4().hex[:8]  # names this run's objects
        self.tasks: dict[ObjectID, tuple[int, ObjectID]] = {}  # gradient -> worker, its parameters
        self.users: dict[ObjectID, int] = {}  # parameters -> outstanding tasks that need them
        self.launched = 0

    def _publish(self, params: np.ndarray, version: int) -> ObjectID:
        params_id = ObjectID.from_name(f"asgd/{self.tag}/params/{version}")
        self.node.put(params, params_id, copy=False)  # an update makes a new array: no copy
        self.users[params_id] = 0
        return params_id

    def _launch(self, worker: Any, index: int, params_id: ObjectID) -> None:
        grad_id = ObjectID.from_name(f"asgd/{self.tag}/grad/{self.launched}")
        self.launched += 1
        worker.compute.remote(params_id, grad_id)
        self.tasks[grad_id] = (index, params_id)
        self.users[params_id] += 1

    def train(self, workers: list[Any], k: int, steps: int, lr: float) -> list[tuple[float, float]]:
        """``steps`` updates, each from the first ``k`` gradients to be put; returns each update's
        mean batch loss and the exact loss after it."""
        n, node = self.problem.params, self.node
        params = np.zeros(n, np.float32)
        params_id = self._publish(params, 0)
        for i, worker in enumerate(workers):
            self._launch(worker, i, params_id)
        curve = []
        for step in range(1, steps + 1):
            sum_id = node.reduce(list(self.tasks), num_objects=k, timeout=TIMEOUT)
            total = node.get(sum_id, timeout=TIMEOUT)  # streamed here while the tree sums
            params = params - np.float32(lr / k) * total[:n]  # a new array: the old one may be read
            curve.append((float(total[n]) / k, self.model.loss(params)))
            used = node.reduced_objects(sum_id, timeout=TIMEOUT)
            del total
            node.delete(sum_id)
            params_id = self._publish(params, step)
            for grad_id in used:  # relaunch the workers whose gradients were summed
                index, their_params = self.tasks.pop(grad_id)
                self.users[their_params] -= 1
                self._launch(workers[index], index, params_id)
            for old in [p for p, count in self.users.items() if count == 0 and p != params_id]:
                del self.users[old]
                node.delete(old)
        return curve


# ---------------------------------------------------------------------------------------- the driver
def run(workers: int, k: int, problem: Problem, steps: int, lr: float) -> list[tuple[float, float]]:
    """Train with a PS and ``workers`` workers (Ray initialised, hoplite's directory started);
    returns the PS's curve (see :meth:`ParameterServer.train`)."""
    ps = ray.remote(ParameterServer).options(num_cpus=0).remote(problem)
    handles = [ray.remote(Worker).options(num_cpus=0).remote(i, problem) for i in range(workers)]
    try:
        return ray.get(ps.train.remote(handles, k, steps, lr))
    finally:
        for actor in [ps, *handles]:
            ray.kill(actor)


def main() -> None:
    """Command line: train and print the loss every few updates."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("-k", type=int, default=2, help="gradients summed per update")
    ap.add_argument("--grad-bytes", type=int, default=4_000_000, help="about the size of a gradient")
    ap.add_argument("--steps", type=int, default=30, help="updates")
    ap.add_argument("--lr", type=float, default=0.1)
    args = ap.parse_args()
    problem = Problem.for_bytes(args.grad_bytes)

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # inherited by the actors: many share few cores
    ray.init(include_dashboard=False, logging_level="WARNING")
    try:
        hgray.start_directory()  # hoplite's directory, as a Ray actor
        start = time.monotonic()
        curve = run(args.workers, args.k, problem, args.steps, args.lr)
        seconds = time.monotonic() - start
    finally:
        ray.shutdown()
    print(f"{problem.params} parameters, {args.workers} workers, first {args.k} gradients per update")
    print(f"loss at zero: {Model(problem).loss(np.zeros(problem.params, np.float32)):.4f}")
    for step, (batch_loss, loss) in enumerate(curve, 1):
        if step % max(1, args.steps // 10) == 0 or step == args.steps:
            print(f"update {step:4d}: batch loss {batch_loss:.4f}, loss {loss:.4f}")
    print(f"{args.steps} updates in {seconds:.1f} s (the first ones include starting the actors)")


if __name__ == "__main__":
    main()
