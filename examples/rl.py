"""Synchronous reinforcement learning on Ray actors with hoplite_gpu: every iteration a learner
broadcasts its weights to ``N`` rollout workers and sums the gradients they send back (the RL
workload of section 5.4 of the Hoplite paper, Zhuang et al., SIGCOMM 2021).

* The weights go through hoplite's Ray Direct Transport: ``Learner.publish`` is
  ``@ray.method(tensor_transport="HOPLITE")`` (:func:`hoplite_gpu.ray.register_tensor_transport`),
  so the returned tensor stays in the learner's hoplite node and the workers that receive the ref
  pull it, all of them in one pipelined broadcast tree.
* The gradients go through hoplite's reduce: each worker ``put``s its gradient under an ObjectID
  the driver named in advance, and the learner requests ``reduce(ids, SUM)`` before they exist, so
  the tree sums the first gradients while later workers are still receiving the weights; the
  learner then ``get``s the sum.

The workload is synthetic and exact. The weights are float32 small integers (``w0[j] = j % 251 -
125``). A worker's rollout is a small deterministic environment seeded by (seed, worker,
iteration): it picks a 64 x 64 block of the weights it received, iterates a state vector through it
eight times (``s <- (W s) mod 97`` in float64, exact on integers) and turns the final state into an
integer advantage ``c`` in [-8, 8]. Its gradient is ``g = w + c`` (as large as the weights). The
learner recomputes each worker's ``c``, so it checks every sum bit-exactly, ``sum_i g_i == N w +
sum_i c_i``, before the update ``w <- w + sum_i (g_i - w)`` (SGD with learning rate 1 on ``sum_i
|w - g_i|^2 / 2``): the weights stay integers far below 2**24, so every sum is exact in float32 in
any order. Needs ``ray`` and ``torch`` (``pip install hoplite_gpu[ray] torch``)::

    python examples/rl.py
    python examples/rl.py --workers 8 --weights-mib 32 --iterations 20

``bench/rl.py`` measures this workload against plain Ray and Ray Direct Transport over Gloo, and
with a worker SIGKILLed mid-run (its learner, in :mod:`bench.workloads.rl_actors`, then sums the
survivors' gradients).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import ray

import hoplite_gpu.ray as hgray
from hoplite_gpu import ObjectID, ReduceOp

#: The HOPLITE transport, registered at import: ``@ray.method(tensor_transport=HOPLITE)`` below
#: checks the name when the class is defined.
HOPLITE = hgray.register_tensor_transport()
#: Side of the square block of weights a rollout's environment iterates through.
ENV_DIM = 64
#: Steps of a rollout's environment.
ENV_STEPS = 8
#: Advantages are integers in ``[-ADVANTAGE, ADVANTAGE]``.
ADVANTAGE = 8
#: Seconds a get or a call may wait (an iteration takes about a second: this bounds a bug).
TIMEOUT = 120.0


# ---------------------------------------------------------------------------------------- the workload
def initial_weights(n: int) -> np.ndarray:
    """The weights before the first iteration: ``n`` float32 ``j % 251 - 125``."""
    return (np.arange(n, dtype=np.int64) % 251 - 125).astype(np.float32)


def rollout_advantage(weights: np.ndarray, worker: int, iteration: int, seed: int) -> int:
    """The integer advantage in ``[-ADVANTAGE, ADVANTAGE]`` of ``worker``'s rollout in
    ``iteration`` on ``weights`` (see the module docstring; the learner calls it too)."""
    rng = np.random.default_rng([seed, worker, iteration])
    span = ENV_DIM * ENV_DIM
    start = int(rng.integers(0, weights.size - span + 1))
    block = np.asarray(weights[start : start + span], dtype=np.float64).reshape(ENV_DIM, ENV_DIM)
    state = rng.integers(0, 97, ENV_DIM).astype(np.float64)
    for _ in range(ENV_STEPS):
        state = np.mod(block @ state, 97.0)
    return int(state.sum()) % (2 * ADVANTAGE + 1) - ADVANTAGE


# ---------------------------------------------------------------------------------------- the actors
class RolloutWorker:
    """A rollout worker (a Ray actor): runs its rollout on the weights it receives and puts a
    gradient as large as them."""

    def __init__(self, index: int, seed: int) -> None:
        import torch

        torch.set_num_threads(1)  # many actors share few cores
        self.index, self.seed = index, seed
        self.node = hgray.node()  # this process's hoplite node
        self.last: ObjectID | None = None  # the gradient put last

    def rollout(self, weights: Any, iteration: int, grad_id: ObjectID) -> int:
        """``weights`` arrived as a tensor through the HOPLITE transport; puts the gradient as
        ``grad_id`` and returns the rollout's advantage."""
        if self.last is not None:  # the last iteration's sum is done: its input can go
            self.node.delete(self.last)
        w = weights.numpy()
        advantage = rollout_advantage(w, self.index, iteration, self.seed)
        self.node.put(np.add(w, np.float32(advantage)), grad_id, copy=False)  # never modified again
        self.last = grad_id
        return advantage


class Learner:
    """The learner (a Ray actor): publishes the weights and applies the sum of the gradients,
    checking it bit-exactly first."""

    def __init__(self, n: int, seed: int) -> None:
        self.seed = seed
        self.weights = initial_weights(n)  # never modified in place: an update makes a new array
        self.node = hgray.node()

    @ray.method(tensor_transport=HOPLITE)
    def publish(self, iteration: int) -> Any:
        """The weights as a tensor, kept in this process's hoplite node (not copied) until the
        workers' calls pull it."""
        import torch

        return torch.from_numpy(self.weights)

    def apply(self, iteration: int, grad_ids: list[ObjectID]) -> int:
        """Sum the gradients ``grad_ids`` (worker ``i`` puts ``grad_ids[i]``), check the sum and
        step; returns the sum of the advantages."""
        sum_id = self.node.reduce(grad_ids, ReduceOp.SUM, timeout=TIMEOUT)  # before the puts
        total = self.node.get(sum_id, timeout=TIMEOUT)  # streamed here while the tree sums
        step = sum(rollout_advantage(self.weights, i, iteration, self.seed) for i in range(len(grad_ids)))
        expected = self.weights * np.float32(len(grad_ids)) + np.float32(step)
        if not np.array_equal(total, expected):
            raise AssertionError(f"iteration {iteration}: the sum of the gradients is wrong")
        self.weights = total - np.float32(len(grad_ids) - 1) * self.weights  # w + sum_i (g_i - w)
        del total  # a view of the local store
        self.node.delete(sum_id)
        return step


# ---------------------------------------------------------------------------------------- the driver
def run(workers: int, n: int, iterations: int, seed: int = 0) -> list[tuple[float, int]]:
    """``iterations`` iterations of a learner with ``n`` float32 weights and ``workers`` rollout
    workers (Ray initialised, hoplite's directory started); returns each iteration's seconds and
    sum of advantages (every sum of the gradients was exact, or the learner raised)."""
    learner = ray.remote(Learner).options(num_cpus=0).remote(n, seed)
    # enable_tensor_transport: the workers receive through a transport (and return none).
    worker = ray.remote(num_cpus=0, enable_tensor_transport=True)(RolloutWorker)
    handles = [worker.remote(i, seed) for i in range(workers)]
    done = []
    try:
        for it in range(iterations):
            start = time.monotonic()
            weights = learner.publish.remote(it)  # a ref: the tensor stays in the learner
            grad_ids = [ObjectID.random() for _ in handles]
            rollouts = [h.rollout.remote(weights, it, g) for h, g in zip(handles, grad_ids, strict=True)]
            step = ray.get(learner.apply.remote(it, grad_ids), timeout=TIMEOUT)
            ray.get(rollouts, timeout=TIMEOUT)
            done.append((time.monotonic() - start, step))
    finally:
        for actor in [learner, *handles]:
            ray.kill(actor)
    return done


def main() -> None:
    """Command line: run the iterations and print their times."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--weights-mib", type=float, default=8.0, help="size of the weights, MiB")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n = max(ENV_DIM * ENV_DIM, int(args.weights_mib * (1 << 20)) // 4)

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # inherited by the actors
    ray.init(include_dashboard=False, logging_level="WARNING")
    try:
        hgray.start_directory()  # hoplite's directory, as a Ray actor
        done = run(args.workers, n, args.iterations, args.seed)
    finally:
        ray.shutdown()
    for it, (seconds, step) in enumerate(done):
        print(f"iteration {it}: {seconds:.3f} s, the sum exact, weights moved by {step}")
    print("(the first iteration includes starting the actors)")


if __name__ == "__main__":
    main()
