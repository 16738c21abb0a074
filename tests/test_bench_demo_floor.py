"""The bounded run of ``bench/demo_floor.py``: the demo's reduce beside the floor of its memory
work (and the floor of private puts), every result checked, the workers' pools off only for the
run's own nodes."""

from __future__ import annotations

import os

import pytest

from bench import demo_floor

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]


def test_the_demos_reduce_and_its_floors_run_checked() -> None:
    before = os.environ.get(demo_floor.POOL_VAR)
    try:
        [row] = demo_floor.run(3, [1 << 20], trials=2, threads=2, private=demo_floor.reads_others())
    finally:
        assert os.environ.get(demo_floor.POOL_VAR) == before  # put back as it was
    assert row["verified"] and row["ideal_seconds"] > 0
    assert len(row["ours_seconds"]) == len(row["floor_seconds"]) == 2
    assert all(t > 0 for t in row["ours_seconds"] + row["floor_seconds"] + row["private_seconds"])
    assert len(row["private_seconds"]) == (2 if demo_floor.reads_others() else 0)
    assert "| 1 MiB |" in demo_floor._table([row])
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"demo-floor-{os.getpid()}-")]
