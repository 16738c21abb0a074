"""The bounded run of ``bench/latency.py`` (issue 42's baseline): every small operation on one
host with both systems, each result checked by the members, the directory's events counted."""

from __future__ import annotations

import os

import pytest

from bench import latency

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]


def test_small_operations_run_checked_beside_gloo() -> None:
    rows = [r for s in latency.SYSTEMS for r in latency.run(s, 3, 1024, 5, 1, list(latency.OPS))]
    expected = [
        (s, op) for s in latency.SYSTEMS for op in latency.OPS if s != "gloo" or op not in latency.OURS_ONLY
    ]
    assert [(r["system"], r["op"]) for r in rows] == expected
    assert all(0 < r["median_us"] <= r["p99_us"] for r in rows)
    ours = [r for r in rows if r["system"] == "hoplite_gpu"]
    # Every operation of ours asks the directory something; a barrier at least once per member.
    assert all(latency.op_events(rows, r) > 0 for r in ours)
    barrier = next(r for r in ours if r["op"] == "barrier")
    assert latency.op_events(rows, barrier) >= 3
    assert "| put+get |" in latency.table(rows)


def test_put_get_is_cut_into_its_steps() -> None:
    [row] = latency.run("hoplite_gpu", 2, 1024, 20, 2, ["put+get"], breakdown=True)
    steps = row["steps_us"]
    assert steps["rounds"] + steps["late_gets"] == 20
    # Which of put and get comes first varies from run to run: rounds whose get came after the
    # put are left out (cut on made-up stamps below), and every round may be one of them.
    if steps["rounds"]:
        # Each step is a span between two stamps in order, and together they are one round.
        assert all(steps[name] >= 0 for name in latency.STEPS)
        assert sum(steps[name] for name in latency.STEPS) <= 2 * row["p99_us"]
    else:
        assert all(steps[name] is None for name in latency.STEPS)


def test_a_round_is_cut_at_its_stamps_and_a_late_get_left_out() -> None:
    # Round 0: the get asks at 1, the put leaves at 3 and arrives at 4, the reply leaves at 6 and
    # arrives at 9, the get returns at 10. Round 1: the get asks (at 23) after the put arrived (22).
    spans = [[(2.0, 8.0), (20.0, 25.0)], [(0.5, 10.0), (22.5, 26.0)]]
    putter = [(3.0, "send", "put"), (21.0, "send", "put")]
    getter = [(9.0, "recv", "lookup_reply"), (25.5, "recv", "lookup_reply")]
    directory = [(1.0, "recv", "lookup"), (4.0, "recv", "put"), (6.0, "send", "lookup_reply")]
    directory += [(22.0, "recv", "put"), (23.0, "recv", "lookup"), (24.0, "send", "lookup_reply")]
    steps = latency.put_get_steps(spans, putter, getter, sorted(directory), 0)
    assert (steps["rounds"], steps["late_gets"]) == (1, 1)
    assert [steps[name] for name in latency.STEPS] == [1e6, 1e6, 2e6, 3e6, 1e6]


def test_the_floor_runs_reduce_and_allreduce_checked_and_cleans_up() -> None:
    # Only the ops it models, in the order asked; every member checks its result each round
    # (a wrong sum raises in the worker); its shared files are gone afterwards.
    before = set(os.listdir("/dev/shm"))
    rows = latency.run(latency.FLOOR, 3, 96 << 10, 5, 1, ["put+get", "allreduce", "reduce"])
    assert [r["op"] for r in rows] == ["allreduce", "reduce"]
    assert all(0 < r["median_us"] <= r["p99_us"] for r in rows)
    assert not {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("latency-floor-")}
    ours = latency.run("hoplite_gpu", 3, 96 << 10, 3, 1, ["allreduce"])
    table = latency.table(ours + rows)
    assert "ours x floor" in table and "| allreduce |" in table
