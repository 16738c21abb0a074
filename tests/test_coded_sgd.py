"""The coded SGD example (issue 20), bounded: every mode runs a few iterations over real worker
processes with seeded stragglers; the exact modes aggregate the full gradient, first-k does not,
and the benchmark's tables and plots come out of a record. Timing is the benchmark's business
(``bench/coded_sgd.py``), not asserted here."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench.workloads import coded_sgd

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SMALL = coded_sgd.Problem(n=4, samples=32, features=16, outputs=256)


@pytest.fixture(scope="module")
def records() -> dict[str, Any]:
    """Three iterations of each mode: n = 4, s = 1, one worker 5x slower each iteration."""
    return {
        mode: coded_sgd.run(
            mode, stragglers=1, partition_seconds=0.02, iterations=3, problem=SMALL, seed=3, timeout=60.0
        )
        for mode in coded_sgd.MODES
    }


def test_exact_modes_aggregate_the_full_gradient_and_first_k_does_not(records: dict[str, Any]) -> None:
    for mode in ("all", "gc", "partial"):
        assert max(records[mode]["gradient_errors"]) <= 1e-5, mode
    assert min(records["firstk"]["gradient_errors"]) > 1e-3  # a partition is missing every time
    # The same straggler draws in every mode, and every exact mode takes the same steps.
    assert len({str(r["stragglers"]) for r in records.values()}) == 1
    final = [records[m]["losses"][-1] for m in ("all", "gc", "partial")]
    assert max(final) - min(final) <= 1e-4 * final[0]
    assert records["all"]["losses"][-1] < records["all"]["initial_loss"]
    # Partial coding uses one piece per partition; first-k the n - s quickest workers.
    assert records["partial"]["inputs_used"] == [4, 4, 4]
    assert records["firstk"]["inputs_used"] == [3, 3, 3]


def test_the_model_of_an_iteration_follows_the_protocols() -> None:
    """Two of 8 workers 5x slower (1 s per partition against 0.2 s): wait-for-all waits 1 s,
    gradient coding for the sixth worker's three partitions (0.6 s), first-k for the sixth
    worker's one (0.2 s), partial coding for every partition's first piece: stragglers 0 and 4
    are covered by their neighbours' second pieces (0.4 s)."""
    times: list[float | None] = [1.0, 0.2, 0.2, 0.2, 1.0, 0.2, 0.2, 0.2]
    got = {mode: coded_sgd.modelled_seconds(mode, times, 2) for mode in coded_sgd.MODES}
    assert got == pytest.approx({"all": 1.0, "firstk": 0.2, "gc": 0.6, "partial": 0.4})
    failed: list[float | None] = [None, 0.2, 0.2, 0.2, None, 0.2, 0.2, 0.2]
    assert math.isinf(coded_sgd.modelled_seconds("all", failed, 2))
    assert coded_sgd.modelled_seconds("partial", failed, 2) == pytest.approx(0.4)


def test_failed_workers_do_not_stop_the_coded_modes() -> None:
    """One of four workers delivers nothing each iteration: both codes still decode exactly."""
    for mode in ("gc", "partial"):
        record = coded_sgd.run(
            mode, stragglers=1, kind="failed", partition_seconds=0.02, iterations=2, problem=SMALL, seed=4
        )
        assert max(record["gradient_errors"]) <= 1e-5
    with pytest.raises(ValueError, match="cannot finish"):
        coded_sgd.run("all", kind="failed")


def test_the_benchmark_tables_and_plots_come_out_of_the_records(
    records: dict[str, Any], tmp_path: Any
) -> None:
    from bench import coded_sgd as bench

    for r in records.values():
        r["scenario"] = "slow"
    result = {
        "date": "today",
        "command": "test",
        "workers": 4,
        "stragglers": 1,
        "slowdown": 5.0,
        "partition_seconds": 0.02,
        "iterations": 3,
        "seed": 3,
        "records": list(records.values()),
    }
    text = bench.markdown(result)
    assert "| slow | partial coding |" in text and "| slow | wait-for-all |" in text
    (path,) = bench.plot(result, str(tmp_path))
    assert path.endswith("coded_sgd_slow.png")
