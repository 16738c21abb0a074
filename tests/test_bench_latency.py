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


def test_put_get_is_cut_into_its_steps() -> None:
    [row] = latency.run("hoplite_gpu", 2, 1024, 20, 2, ["put+get"], breakdown=True)
    steps = row["steps_us"]
    assert steps["rounds"] + steps["late_gets"] == 20 and steps["rounds"] > 0
    # Each step is a span between two stamps in order, and together they are one round.
    assert all(steps[name] >= 0 for name in latency.STEPS)
    assert sum(steps[name] for name in latency.STEPS) <= 2 * row["p99_us"]
