"""Data-parallel training in Ray actors with the ``hoplite`` backend of ``ray.util.collective`` and
:class:`hoplite_gpu.torch.DistributedOptimizer`, checked against one process training on the same
global batches.

Each of ``W`` actors holds the same model (the same seed, and rank 0's parameters broadcast to be
sure), takes its ``1/W`` share of every global batch, and steps a ``DistributedOptimizer``, which
averages the gradients over the group before each SGD step. Averaging the gradients of equal shares
gives the gradient of the whole batch's mean loss, so every step matches a single process training
on the whole batch, up to floating-point rounding::

    python examples/ray_training.py --workers 4 --steps 60

prints both loss curves and their largest difference. Code that used Ray's gloo backend changes only
``backend="gloo"`` into ``backend="hoplite"`` (after :func:`hoplite_gpu.ray.register_collective_backend`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

FEATURES, HIDDEN, CLASSES = 32, 64, 4


def make_data(seed: int, samples: int) -> tuple[Any, Any]:
    """A synthetic classification problem: labels from a fixed random teacher network."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    y = (x @ teacher + 0.1 * torch.randn(samples, CLASSES, generator=g)).argmax(dim=1)
    return x, y


def make_model(seed: int) -> Any:
    """A two-layer MLP, initialised from ``seed``."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)
    )


def batches(seed: int, steps: int, global_batch: int) -> list[tuple[Any, Any]]:
    """The global batches of a run: ``steps`` draws (with replacement) from the data set."""
    import torch

    x, y = make_data(seed, 4096)
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (global_batch,), generator=g)
        out.append((x[idx], y[idx]))
    return out


def train_single(seed: int = 0, steps: int = 60, global_batch: int = 256, lr: float = 0.1) -> list[float]:
    """One process on whole global batches; returns the loss of every step."""
    import torch

    torch.set_num_threads(1)
    model = make_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches(seed, steps, global_batch):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


class Trainer:
    """One data-parallel member (a Ray actor; see :func:`train_distributed`)."""

    def __init__(self, rank: int, world: int, group_name: str, seed: int, lr: float) -> None:
        import ray.util.collective as col
        import torch

        import hoplite_gpu.ray as hgray
        import hoplite_gpu.torch as hgt

        torch.set_num_threads(1)
        hgray.register_collective_backend()
        col.init_collective_group(world, rank, backend="hoplite", group_name=group_name)
        self.rank, self.world, self.group_name, self.seed = rank, world, group_name, seed
        self.model = make_model(seed)
        hgt.broadcast_parameters(self.model, 0, group_name)
        self.optimizer = hgt.DistributedOptimizer(torch.optim.SGD(self.model.parameters(), lr=lr), group_name)

    def train(self, steps: int, global_batch: int) -> list[float]:
        """Train ``steps`` steps on this member's share; returns the whole batch's mean loss per step."""
        import ray.util.collective as col
        import torch

        share = global_batch // self.world
        losses = []
        for x, y in batches(self.seed, steps, global_batch):
            mine = slice(self.rank * share, (self.rank + 1) * share)
            self.optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.model(x[mine]), y[mine])
            loss.backward()
            self.optimizer.step()
            total = loss.detach().reshape(1).clone()
            col.allreduce(total, self.group_name)  # SUM of the shares' means
            losses.append(float(total) / self.world)
        return losses

    def close(self) -> None:
        """Leave the group."""
        import ray.util.collective as col

        col.destroy_collective_group(self.group_name)


def train_distributed(
    workers: int = 4,
    seed: int = 0,
    steps: int = 60,
    global_batch: int = 256,
    lr: float = 0.1,
    group_name: str = "ray-training",
    timeout: float = 300.0,
) -> list[float]:
    """``workers`` actors training together (the caller has ``ray.init``-ed and started the
    directory with :func:`hoplite_gpu.ray.start_directory`); returns rank 0's loss per step."""
    import ray

    if global_batch % workers:
        raise ValueError("global_batch must be a multiple of workers")
    actor = ray.remote(num_cpus=0)(Trainer)
    trainers = [actor.remote(r, workers, group_name, seed, lr) for r in range(workers)]
    try:
        curves = ray.get([t.train.remote(steps, global_batch) for t in trainers], timeout=timeout)
        ray.get([t.close.remote() for t in trainers], timeout=timeout)
    finally:
        for t in trainers:
            ray.kill(t)
    return list(curves[0])


def main(argv: list[str] | None = None) -> int:
    """Command line: train both ways and compare the loss curves."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import ray

    import hoplite_gpu.ray as hgray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(include_dashboard=False, logging_level="WARNING")
    try:
        hgray.start_directory()
        distributed = train_distributed(args.workers, args.seed, args.steps, args.global_batch)
    finally:
        ray.shutdown()
    single = train_single(args.seed, args.steps, args.global_batch)
    for step in range(0, args.steps, max(1, args.steps // 10)):
        print(f"step {step:4d}  single {single[step]:.5f}  {args.workers} actors {distributed[step]:.5f}")
    gap = float(np.max(np.abs(np.array(single) - np.array(distributed))))
    print(
        f"final loss: single {single[-1]:.5f}, {args.workers} actors {distributed[-1]:.5f}; max gap {gap:.2e}"
    )
    return 0 if gap < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
