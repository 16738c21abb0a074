"""The bounded run of ``bench/latency.py`` (issue 42's baseline): every small operation on one
host with both systems, each result checked by the members, the directory's events counted."""

from __future__ import annotations

import pytest

from bench import latency

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]


def test_small_operations_run_checked_beside_gloo() -> None:
    rows = [r for s in latency.SYSTEMS for r in latency.run(s, 3, 1024, 5, 1, list(latency.OPS))]
    assert [(r["system"], r["op"]) for r in rows] == [(s, op) for s in latency.SYSTEMS for op in latency.OPS]
    assert all(0 < r["median_us"] <= r["p99_us"] for r in rows)
    ours = [r for r in rows if r["system"] == "hoplite_gpu"]
    # Every operation of ours asks the directory something; a barrier at least once per member.
    assert all(latency.op_events(rows, r) > 0 for r in ours)
    assert latency.op_events(rows, ours[-1]) >= 3
    assert "| put+get |" in latency.table(rows)
