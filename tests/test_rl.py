"""Synchronous RL on Ray (``examples/rl.py``): in each mode (plain Ray, Ray Direct Transport over
Gloo, hoplite_gpu) every iteration's sum of the gradients is checked bit-exactly by the learner,
and a rollout worker SIGKILLed mid-run is left out of that iteration only: its restarted process
receives the current weights and contributes again."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

from bench.workloads.rl import failure_summary, run
from examples.rl import initial_weights, rollout_advantage

pytestmark = [pytest.mark.multiprocess]

#: Weights (and gradients) of 1 MiB: over the inline limit, so hoplite moves them on its data plane.
WEIGHTS = 1 << 20


def _check_exact(rec: dict[str, Any], iterations: int, workers: int) -> None:
    """Every iteration summed every launched worker's gradient (the learner checked each sum
    against its own recomputation, or the run would have raised), and the final weights are the
    initial ones plus every applied advantage."""
    its = rec["iterations"]
    assert len(its) == rec["iteration_count"] >= iterations
    assert rec["state"] == {"drift": sum(sum(r["advantages"].values()) for r in its), "exact": True}
    lost = rec["kill"]["iteration"] if rec["kill"] else None
    for i, r in enumerate(its):
        # Only the iteration whose worker was killed leaves one out.
        assert r["used"] == r["launched"] or (i == lost and set(r["used"]) < set(r["launched"])), r
        assert sorted(int(w) for w in r["advantages"]) == r["used"]
        # The workers reported the advantages the learner recomputed (ray and hoplite modes).
        for info in r.get("infos", []):
            assert r["advantages"][str(info["worker"])] == info["advantage"], (r, info)
    if rec["kill"] is None:
        assert all(r["used"] == list(range(workers)) for r in its)


def test_rollout_is_deterministic_and_bounded() -> None:
    w = initial_weights(1 << 14)
    assert w.dtype.name == "float32" and w.min() == -125 and w.max() == 125
    values = {rollout_advantage(w, worker, it, 0) for worker in range(4) for it in range(8)}
    assert values <= set(range(-8, 9)) and len(values) > 1
    assert rollout_advantage(w, 1, 2, 0) == rollout_advantage(w.copy(), 1, 2, 0)


@pytest.mark.timeout(600)  # bounds for a busy machine (issue 39)
@pytest.mark.parametrize("mode", ["ray", "gloo", "hoplite"])
def test_every_sum_is_exact(ray_session: Any, mode: str) -> None:
    rec = run(mode, 2, WEIGHTS, 3, warmup=1, timeout=400)
    _check_exact(rec, 3, 2)
    if mode == "hoplite":
        assert rec["weights_via"] == "transport"
        assert all(r["attempts"] == 1 for r in rec["iterations"])


@pytest.mark.timeout(600)  # bounds for a busy machine (issue 39)
def test_hoplite_weights_through_put(ray_session: Any) -> None:
    """Without the HOPLITE transport: the learner puts the weights and passes their ObjectID."""
    rec = run("hoplite", 2, WEIGHTS, 3, warmup=1, weights_via="put", timeout=400)
    assert rec["weights_via"] == "put"
    _check_exact(rec, 3, 2)


@pytest.mark.timeout(600)  # bounds for a busy machine (issue 39)
def test_hoplite_weights_through_weight_sync(ray_session: Any) -> None:
    """Through hoplite_gpu.weights: a publisher in the learner, a subscriber in each worker."""
    rec = run("hoplite", 2, WEIGHTS, 3, warmup=1, weights_via="sync", timeout=400)
    assert rec["weights_via"] == "sync"
    _check_exact(rec, 3, 2)


@pytest.mark.timeout(600)  # bounds for a busy machine (issue 39)
@pytest.mark.parametrize("mode", ["hoplite", "ray"])
def test_killed_worker_is_left_out_then_rejoins(ray_session: Any, mode: str) -> None:
    victim = 1
    # 0.1 s of emulated compute per rollout: the restart (a few seconds) spans tens of iterations.
    rec = run(
        mode,
        2,
        WEIGHTS,
        6,
        warmup=1,
        compute_s=0.1,
        kill_worker=victim,
        kill_at=2,
        until_rejoined=True,
        timeout=400,
    )
    _check_exact(rec, 6, 2)
    summary = failure_summary(rec)
    its = rec["iterations"]
    # Every iteration before the kill used both workers; the one that lost the victim finished
    # with the other's gradient (hoplite: a second reduction over the survivor).
    assert all(r["used"] == [0, 1] for r in its[:2])
    assert summary["lost_worker"] and its[2]["used"] == [0], its[2]
    assert str(victim) in its[2]["failed"]
    if mode == "hoplite":
        assert summary["attempts"] == 2, its[2]
    # The restarted process (another pid) took part again, with the current weights (its gradient
    # is part of an exact sum).
    back = summary["rejoined_iteration"]
    assert back is not None and back > 2
    assert summary["restarted_pid"] not in (None, rec["kill"]["pid"])
    assert its[back]["used"] == [0, 1]
    assert all(r["used"] == [0] for r in its[3:back])
    assert all(r["used"] == [0, 1] for r in its[back:])
