"""CPU per byte in the benchmarks (``bench/common.py``), and the bounded run of ``bench/p2p.py``'s
patterns as users write a get: fresh objects kept by the reader, and ``get(out=...)``."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench import p2p
from bench.common import cpu_per_gib, cpu_seconds, cpu_since, process_cpu, socket_copy

pytestmark = pytest.mark.timeout(180)

#: A child that burns about 0.3 s of CPU, says so, then waits on its stdin.
_BURN = """
import sys, time
t = time.process_time()
while time.process_time() - t < 0.3:
    pass
print(1, flush=True)
sys.stdin.read()
"""


def test_cpu_of_other_processes_counts_what_they_used_in_between() -> None:
    child = subprocess.Popen([sys.executable, "-c", _BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"1"
        now = process_cpu([child.pid])
        assert 0.25 <= cpu_since({}, now) <= 2.0  # not in the first reading: counted in full
        assert cpu_since(now, process_cpu([child.pid])) < 0.1  # idle on its stdin since
    finally:
        child.communicate(b"", timeout=30)
    assert process_cpu([child.pid]) == {}  # reaped: left out
    start = cpu_seconds()
    t = time.process_time()
    while time.process_time() - t < 0.05:
        pass
    assert cpu_seconds() - start >= 0.05
    assert cpu_per_gib(0.5, 512 << 20) == pytest.approx(1.0)


def test_the_socket_baseline_reports_both_processes_cpu() -> None:
    copies = socket_copy(4 << 20, repeat=3)
    assert len(copies) == 3
    assert all(seconds > 0 and cpu > 0 for seconds, cpu in copies)


@pytest.mark.parametrize("pattern", ["kept", "out"])
def test_p2p_gets_fresh_objects_as_users_write_them(pattern: str) -> None:
    # Every round's data is checked by the benchmark itself (it raises on a wrong array).
    rows = p2p.run([1 << 20, 4 << 20], repeat=2, path="ucx", pattern=pattern)
    assert [(r["pattern"], r["size"]) for r in rows] == [(pattern, 1 << 20), (pattern, 4 << 20)]
    for r in rows:
        assert len(r["hoplite_seconds_rounds"]) == 2  # no warm-up: the first round is timed
        assert r["hoplite_cpu_s_per_gib"] > 0 and r["socket_cpu_s_per_gib"] > 0
        assert r["cpu_ratio_vs_socket"] == pytest.approx(
            r["hoplite_cpu_s_per_gib"] / r["socket_cpu_s_per_gib"]
        )
