"""System calls of a same-host device get, counted with strace (the bounded run of
``bench/syscalls.py``): where system calls are intercepted (gVisor, on the GPU machine), each costs
microseconds, so the index path's count is kept from growing back."""

from __future__ import annotations

import pytest

from bench import syscalls
from hoplite_gpu.memory import shm

_NO_STRACE = syscalls.strace_usable()

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm"),
    pytest.mark.skipif(bool(_NO_STRACE), reason=_NO_STRACE),
]


def test_an_indexed_device_get_reads_the_ticket_and_checks_its_holder_once() -> None:
    row = syscalls.run("sim-index", 4096, count=5, timeout=60)
    get = row["get"]
    assert get["calls"] == 5
    calls = get["caller_typical"]
    # open, fstat, flock, pread, kill (is the holder alive), close: the ticket is read under its
    # lock, not mapped, and the holder's liveness is asked once however many checks need it.
    assert "pread64" in calls or "pread" in calls, calls
    # No hop to the I/O thread (its wake-up is a sendto), so no directory round trip either.
    assert not {"mmap", "munmap", "getpid", "geteuid", "sendto"} & set(calls), calls
    assert calls.get("kill") == 1, calls
    assert get["caller_median"] <= 7, calls
    # The owner's put and delete go through the directory: the caller wakes the I/O thread.
    assert row["put"]["calls"] == row["delete"]["calls"] == 5
