"""The ensemble-serving benchmark (bench/serving.py) on a local Ray instance: both modes serve the
same queries, and their summed outputs equal NumPy's reference bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from bench import serving

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]  # bounds for a busy machine (issue 39)

MODELS = 4


@pytest.mark.parametrize(
    ("batch", "classes"),
    [
        (2, 1000),  # 1.5 MiB queries, 8000-byte outputs: reduced inline in the directory
        (4, 5000),  # 3 MiB queries, 80000-byte outputs: above the inline threshold, a reduce tree
    ],
)
def test_both_modes_match_numpy(ray_session: Any, batch: int, classes: int) -> None:
    import hoplite_gpu.ray as hgray

    workload = serving.Workload(models=MODELS, batch=batch, image=256, pool=16, classes=classes, seed=batch)
    models = serving.start_models(workload)
    before = hgray.node().stats()["objects"]  # the session's driver node: other tests use it too
    try:
        releases = serving.Releases(MODELS)
        for k in range(3):
            query = serving.make_query(workload, k)
            expected = serving.reference(workload, query)
            # Every model contributes: each image's probabilities sum to about 1 per model.
            np.testing.assert_allclose(expected.sum(axis=1), MODELS, atol=1e-2)
            by_hoplite = serving.query_hoplite(models, query, releases, timeout=120)
            by_ray = serving.query_ray(models, query, timeout=120)
            assert by_hoplite.dtype == by_ray.dtype == np.float32
            np.testing.assert_array_equal(by_hoplite, expected)
            np.testing.assert_array_equal(by_ray, expected)
        # Every model deletes the outputs it put, the front end its queries and sums: none left here.
        serving.finish_hoplite(models, releases)
        assert hgray.node().stats()["objects"] == before
    finally:
        for m in models:
            ray_session.kill(m)


def test_run_mode_reports_and_checks(ray_session: Any) -> None:
    workload = serving.Workload(models=2, batch=2, image=64, pool=8, classes=100, seed=7)
    models = serving.start_models(workload, inflight=2)
    try:
        results = serving.serve_both(workload, models, count=4, warmup=1, inflight=2, timeout=120)
        for mode in ("hoplite", "ray"):
            assert results[mode]["queries"] == 4
            assert len(results[mode]["latency"]) == 4
            assert results[mode]["qps"] == pytest.approx(4 / results[mode]["seconds"])
        row = serving.summarize(workload, results, setting="local")
        assert row["ratio"] == pytest.approx(row["hoplite"]["qps"] / row["ray"]["qps"])
        table = serving.format_table({"local": row})
        assert "| local | 2 | 96 KiB |" in table
    finally:
        for m in models:
            ray_session.kill(m)
