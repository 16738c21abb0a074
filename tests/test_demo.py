"""A bounded run of the demo (the full one is `make demo`)."""

from __future__ import annotations

import pytest

from hoplite_gpu.demo import format_table, run_demo

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_demo_small_run_verifies_every_byte() -> None:
    rows = run_demo(workers=2, sizes="1KiB,3MiB")
    assert [(r["op"], r["size"]) for r in rows] == [
        (op, size) for size in (1024, 3 << 20) for op in ("broadcast", "reduce", "allreduce")
    ] + [("broadcast, 1 worker killed", 3 << 20)]
    assert all(r["verified"] and r["receivers"] == 2 and r["seconds"] > 0 for r in rows)
    assert all(r["socket_gbps"] > 0 for r in rows[:-1])
    assert rows[-1]["killed"] == 1 and rows[-1]["survivors"] == 1
    table = format_table(rows)
    assert "| 3 MiB | 2 |" in table and "| allreduce | 3 MiB | 2 |" in table and "NO" not in table
    assert "| broadcast, 1 worker killed | 3 MiB | 2 | 1 | 1 |" in table
