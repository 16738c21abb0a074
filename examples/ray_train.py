"""Ray Train with the torch.distributed backend ``"hoplite"``: a ``TorchTrainer`` whose workers train
a DDP model, checked against one process training on the same global batches.

The only change from a Gloo or NCCL run is ``TorchConfig(backend="hoplite")``: Ray Train calls
``init_process_group("hoplite", init_method="tcp://...")`` in each worker, torch registers the
backend as it is imported there (hoplite_gpu installed is enough), and the store of that call is
where rank 0 publishes the directory it starts. The model, data and single-process reference are
those of ``examples/ray_training.py``::

    python examples/ray_train.py --workers 2 --steps 30

prints both loss curves and their largest difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.ray_training import batches, make_model, train_single


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: DDP over the process group Ray Train made (backend "hoplite"),
    this worker's share of every global batch; reports the whole batch's mean loss per step."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "hoplite", dist.get_backend()
    model = ray.train.torch.prepare_model(make_model(config["seed"]))  # DDP over the group
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    share = config["global_batch"] // world
    losses = []
    for x, y in batches(config["seed"], config["steps"], config["global_batch"]):
        mine = slice(rank * share, (rank + 1) * share)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[mine]), y[mine])
        loss.backward()  # DDP averages the gradients over the workers
        optimizer.step()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)  # the shares' means, summed
        losses.append(float(total) / world)
    # Ray Train keeps what a checkpoint holds: rank 0's losses go in one, for the driver.
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = None
        if rank == 0:
            with open(os.path.join(folder, "losses.json"), "w") as f:
                json.dump(losses, f)
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report({"steps": len(losses)}, checkpoint=checkpoint)


def train(
    workers: int = 2, seed: int = 0, steps: int = 30, global_batch: int = 256, lr: float = 0.1
) -> list[float]:
    """Train with ``workers`` Ray Train workers (the caller has ``ray.init``-ed); rank 0's loss
    per step."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if global_batch % workers:
        raise ValueError("global_batch must be a multiple of workers")
    config = {"seed": seed, "steps": steps, "global_batch": global_batch, "lr": lr}
    with tempfile.TemporaryDirectory() as storage:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
            torch_config=TorchConfig(backend="hoplite"),
            run_config=RunConfig(storage_path=storage, name="hoplite-ray-train"),
        )
        result = trainer.fit()
        assert result.checkpoint is not None, result
        with result.checkpoint.as_directory() as folder, open(os.path.join(folder, "losses.json")) as f:
            return [float(v) for v in json.load(f)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest loss difference allowed")
    args = parser.parse_args()

    import ray

    ray.init(num_cpus=args.workers + 2, include_dashboard=False, logging_level="WARNING")
    try:
        ours = train(args.workers, steps=args.steps, global_batch=args.global_batch)
    finally:
        ray.shutdown()
    single = train_single(steps=args.steps, global_batch=args.global_batch)
    for step, (a, b) in enumerate(zip(ours, single, strict=True)):
        print(f"step {step:3d}  ray train {a:.6f}  one process {b:.6f}")
    worst = max(abs(a - b) for a, b in zip(ours, single, strict=True))
    print(f"largest difference: {worst:.2e}")
    if worst > args.tolerance:
        sys.exit(f"the loss curves differ by {worst:.2e} > {args.tolerance}")


if __name__ == "__main__":
    main()
