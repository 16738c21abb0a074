"""Ray's ways of sending a trainer's weights to rollout engines, the peers of ``bench/weight_sync.py``:

* ``ray``: the object store. The trainer actor ``ray.put``\\ s its state dict (one object of NumPy
  arrays) once per version; every engine actor ``ray.get``\\ s it (Ray pulls it from the trainer's
  node or from another node that has it) and copies it into its own arrays.
* ``rdt``: Ray Direct Transport over Gloo (``@ray.method(tensor_transport="gloo")`` in a
  ``torch_gloo`` collective group of the trainer and every engine): the trainer's method returns
  its tensors, which stay in its process until each engine's call receives them point to point.

Each round is a new version: the trainer fills every tensor with its own value for the version,
then the driver starts every engine's call at once with the trainer's reference. The round runs
from the start of the trainer's call (``time.monotonic``, one clock for every namespace of the
machine) until the last engine has its arrays filled and checked. No warm-up round.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np
import ray

from bench.weight_sync import fill_version, holds_version, new_state

SYSTEMS = ("ray", "rdt")


class Trainer:
    """Holds the state dict (``layout``: names and float32 shapes) and publishes versions of it."""

    def __init__(self, layout: list[tuple[str, list[int]]], env: dict[str, str]) -> None:
        os.environ.update(env)
        self.state = new_state(layout)
        self.started = 0.0

    def publish_ray(self, version: int) -> list[Any]:
        """A new version put in the object store once; its reference boxed in a list, so that Ray
        passes it on to the engines without resolving it."""
        fill_version(self.state, version)
        self.started = time.monotonic()
        return [ray.put(self.state)]

    @ray.method(tensor_transport="gloo")
    def publish_rdt(self, version: int) -> list[Any]:
        """A new version as torch tensors that stay here until each engine's call receives them."""
        import torch

        fill_version(self.state, version)
        self.started = time.monotonic()
        return [torch.from_numpy(a) for a in self.state.values()]

    def start(self) -> float:
        """When the last publish started."""
        return self.started


class Engine:
    """A rollout engine: its own arrays, filled with each version it receives."""

    def __init__(self, layout: list[tuple[str, list[int]]], env: dict[str, str]) -> None:
        os.environ.update(env)
        self.state = new_state(layout)

    def ready(self) -> int:
        return os.getpid()

    def receive_ray(self, boxed: list[Any], version: int) -> tuple[float, bool]:
        got = ray.get(boxed[0], timeout=600)
        for name, arr in self.state.items():
            np.copyto(arr, got[name])
        del got
        return time.monotonic(), holds_version(self.state, version)

    def receive_rdt(self, tensors: list[Any], version: int) -> tuple[float, bool]:
        for arr, t in zip(self.state.values(), tensors, strict=True):
            np.copyto(arr, t.numpy().reshape(arr.shape))
        return time.monotonic(), holds_version(self.state, version)


def run(
    system: str,
    layout: list[tuple[str, list[int]]],
    repeat: int,
    env: dict[str, str],
    trainer_options: dict[str, Any],
    engine_options: list[dict[str, Any]],
    timeout: float = 900.0,
) -> dict[str, Any]:
    """``repeat`` versions from a trainer to ``len(engine_options)`` engines through ``system`` (Ray
    initialised); the record: every round's seconds and their median."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
    trainer: Any = ray.remote(Trainer).options(num_cpus=0, **trainer_options).remote(layout, env)
    engines: list[Any] = [
        # enable_tensor_transport: an engine receives through RDT (else the receive would queue
        # behind the very call that waits for it)
        ray.remote(enable_tensor_transport=True)(Engine).options(num_cpus=0, **opts).remote(layout, env)
        for opts in engine_options
    ]
    group = None
    try:
        ray.get([e.ready.remote() for e in engines] + [trainer.start.remote()], timeout=300)
        if system == "rdt":
            from ray.experimental.collective import create_collective_group

            group = create_collective_group([trainer, *engines], backend="torch_gloo")
        rounds = []
        for version in range(1, repeat + 1):
            published = getattr(trainer, f"publish_{system}").remote(version)
            calls = [getattr(e, f"receive_{system}").remote(published, version) for e in engines]
            ends = ray.get(calls, timeout=timeout)
            if not all(ok for _, ok in ends):
                raise AssertionError(f"{system}: an engine got wrong weights in version {version}")
            start = ray.get(trainer.start.remote(), timeout=60)
            rounds.append(max(end for end, _ in ends) - start)
            del published
    finally:
        if group is not None:
            from ray.experimental.collective import destroy_collective_group

            destroy_collective_group(group)
        for actor in [trainer, *engines]:
            ray.kill(actor)
    return {"system": system, "engines": len(engines), "rounds": rounds, "seconds": statistics.median(rounds)}
