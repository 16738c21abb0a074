"""Weight sync for RL on Ray actors with :mod:`hoplite_gpu.weights`: a learner publishes a new
version of its model after every step, and each rollout actor pulls the newest version into its
own model whenever it is ready. Rollout actors come and go: one is killed in the middle of the
run and a new one joins, and gets the newest version from whichever processes hold it.

Every rollout checks what it received: its model's parameters are summed (in float64, in a fixed
order) and compared with the learner's sum of the same version. Needs ``ray`` and ``torch``
(``pip install hoplite_gpu[ray] torch``)::

    python examples/weight_sync.py
    python examples/weight_sync.py --rollouts 4 --width 1024 --steps 8
"""

from __future__ import annotations

import argparse
from typing import Any

import ray
import torch

import hoplite_gpu.ray as hgray
from hoplite_gpu.weights import WeightPublisher, WeightSubscriber

#: Seconds a sync may wait (a step takes well under a second: this bounds a bug).
TIMEOUT = 120.0


def make_model(width: int, seed: int) -> torch.nn.Module:
    """The policy: a small MLP, its initial weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 16))


def checksum(model: torch.nn.Module) -> float:
    """The parameters' sum, in float64 and a fixed order: equal for equal bytes."""
    return float(sum(p.detach().double().sum().item() for p in model.parameters()))


class Learner:
    """Trains (here: a stand-in step) and publishes every new version."""

    def __init__(self, width: int) -> None:
        self.model = make_model(width, seed=0)
        self.publisher = WeightPublisher(hgray.node(), "policy")
        self.version = 0

    def step(self) -> tuple[int, float]:
        """One training step, then the new weights published as the next version."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(0.9).add_(torch.randn_like(p), alpha=0.01)
        self.version += 1
        self.publisher.publish(self.model.state_dict(), self.version)
        return self.version, checksum(self.model)


class Rollout:
    """Generates experience with the newest weights it has (here: only receives them)."""

    def __init__(self, width: int) -> None:
        self.model = make_model(width, seed=1)  # other weights until the first sync
        self.subscriber = WeightSubscriber(hgray.node(), "policy")

    def sync(self, newer_than: int | None = None) -> tuple[int, float]:
        """Wait for a version newer than ``newer_than`` (None: any), receive the newest into the
        model's own tensors, and say which version it is and its checksum."""
        self.subscriber.latest(timeout=TIMEOUT, newer_than=newer_than)
        version, _ = self.subscriber.receive(into=self.model.state_dict(), timeout=TIMEOUT)
        return version, checksum(self.model)


def run(rollouts: int, width: int, steps: int) -> list[dict[str, Any]]:
    """``steps`` steps with ``rollouts`` rollout actors (Ray initialised, hoplite's directory
    started); after the second step one rollout is killed and a new one joins. Returns what each
    step's rollouts reported; raises if any received other weights than the learner published."""
    learner = ray.remote(Learner).options(num_cpus=0).remote(width)
    rollout = ray.remote(Rollout).options(num_cpus=0)
    actors = [rollout.remote(width) for _ in range(rollouts)]
    done = []
    try:
        for step in range(steps):
            version, expected = ray.get(learner.step.remote(), timeout=TIMEOUT)
            got = ray.get([a.sync.remote(newer_than=version - 1) for a in actors], timeout=TIMEOUT)
            if any(g != (version, expected) for g in got):
                raise AssertionError(f"step {step}: the rollouts got {got}, the learner published {expected}")
            done.append({"step": step, "version": version, "rollouts": len(actors)})
            if step == 1:  # a rollout goes away and another joins, mid-run
                ray.kill(actors.pop(0))
                joiner = rollout.remote(width)
                late = ray.get(joiner.sync.remote(), timeout=TIMEOUT)  # the newest: this version
                if late != (version, expected):
                    raise AssertionError(f"the late joiner got {late}, the learner published {expected}")
                actors.append(joiner)
    finally:
        for actor in [learner, *actors]:
            ray.kill(actor)
    return done


def main() -> None:
    """Command line: run the steps and print what each rollout received."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    ray.init(include_dashboard=False, logging_level="WARNING")
    try:
        hgray.start_directory()  # hoplite's directory, as a Ray actor
        for row in run(args.rollouts, args.width, args.steps):
            print(f"step {row['step']}: version {row['version']} bit-exact on {row['rollouts']} rollouts")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
