"""The bounded run of ``bench/directory_ops.py``: clients pipelining small puts, lookups and
deletes to a standalone directory, every reply checked, the directory's CPU time measured."""

from __future__ import annotations

import pytest

from bench import directory_ops

pytestmark = [pytest.mark.timeout(120), pytest.mark.multiprocess]


def test_clients_pipeline_small_operations_to_a_standalone_directory() -> None:
    row = directory_ops.run(clients=2, window=4, size=1024, seconds=1.0)
    # Whole operations only: a client stops between its batches.
    assert row["requests"] > 0 and row["requests"] % directory_ops.REQUESTS_PER_OP == 0
    assert 0 < row["directory_cpu_s"] and row["per_cpu_second"] > 0
    assert 0 < row["median_us"] <= row["p99_us"]
