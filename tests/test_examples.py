"""The examples a user copies (``examples/*.py``), run in small form: each one trains, and what it
computes is right. The benchmarks measure the same workloads with more machinery
(``bench/workloads``); ``examples/ray_training.py`` is checked in ``tests/test_ray.py``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(180)
def test_coded_sgd_example_decodes_the_full_gradient() -> None:
    from examples import coded_sgd

    problem = coded_sgd.Problem(n=4, samples=32, features=16, outputs=256)
    for mode in ("gc", "partial"):
        got = coded_sgd.train(mode, problem, s=1, iterations=3, seconds=0.02, slowdown=5.0)
        assert len(got["seconds"]) == 3
        assert max(got["errors"]) <= 1e-4, (mode, got["errors"])
        assert got["final_loss"] < got["initial_loss"]


@pytest.mark.timeout(180)
def test_async_sgd_example_converges(ray_session: Any) -> None:
    from examples import async_sgd

    problem = async_sgd.Problem.for_bytes(256 * 1024)  # over the inline limit: the data plane
    curve = async_sgd.run(workers=4, k=2, problem=problem, steps=30, lr=0.1)
    initial = async_sgd.Model(problem).loss(np.zeros(problem.params, np.float32))
    assert len(curve) == 30
    assert curve[-1][1] < 0.1 * initial, (initial, curve[-1])


@pytest.mark.timeout(180)
def test_rl_example_sums_exactly(ray_session: Any) -> None:
    pytest.importorskip("torch")
    from examples import rl

    done = rl.run(workers=2, n=1 << 18, iterations=3)  # the learner raises on a wrong sum
    assert len(done) == 3
    assert all(abs(step) <= 2 * rl.ADVANTAGE for _, step in done)


@pytest.mark.timeout(180)
def test_weight_sync_example_brings_every_rollout_to_each_version(ray_session: Any) -> None:
    pytest.importorskip("torch")
    from examples import weight_sync

    done = weight_sync.run(rollouts=2, width=256, steps=3)  # raises if a rollout got other weights
    assert [row["version"] for row in done] == [1, 2, 3]


@pytest.mark.timeout(240)
def test_ray_train_example_trains_with_the_hoplite_backend(ray_session: Any) -> None:
    """Ray Train's TorchTrainer with TorchConfig(backend="hoplite"): DDP in its workers over the
    backend, the same losses as one process on the same global batches."""
    pytest.importorskip("ray.train.torch")
    from examples import ray_train

    ours = ray_train.train(workers=2, steps=4, global_batch=64)
    single = ray_train.train_single(steps=4, global_batch=64)
    assert len(ours) == 4
    assert max(abs(a - b) for a, b in zip(ours, single, strict=True)) <= 1e-4, (ours, single)
