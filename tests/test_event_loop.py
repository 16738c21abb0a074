"""The I/O thread's event loop: uvloop by default where it is installed, the standard library's
on request (``HOPLITE_EVENT_LOOP``), and a typed error for anything else."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import hoplite_gpu as hg
from hoplite_gpu.iothread import new_event_loop

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("kind", "module"), [("", "uvloop"), ("auto", "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")]
)
def test_the_loop_is_the_one_named(monkeypatch: pytest.MonkeyPatch, kind: str, module: str) -> None:
    pytest.importorskip("uvloop")
    monkeypatch.setenv("HOPLITE_EVENT_LOOP", kind)
    loop = new_event_loop()
    try:
        assert type(loop).__module__.split(".")[0] == module
    finally:
        loop.close()


def test_an_unknown_loop_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOPLITE_EVENT_LOOP", "trio")
    with pytest.raises(hg.InvalidArgumentError, match="HOPLITE_EVENT_LOOP"):
        new_event_loop()


_ROUND_TRIP = """
import numpy as np, hoplite_gpu as hg
from hoplite_gpu import collective as coll
from hoplite_gpu.iothread import IOThread
node = hg.init()
x = np.arange(1000, dtype=np.float32)
oid = hg.ObjectID.random()
node.put(x, oid)
assert np.array_equal(node.get(oid, timeout=30), x)
coll.barrier(coll.Group(node, 0, 1, "one", timeout=30))
node.close()
print(type(IOThread.get().loop).__module__)
"""


def test_the_standard_loop_still_serves_a_node_and_its_directory() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _ROUND_TRIP],
        env={**os.environ, "HOPLITE_EVENT_LOOP": "asyncio"},
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    )
    assert out.stdout.split()[-1].startswith("asyncio")


@pytest.mark.parametrize("outcome", ["result", "error"])
def test_a_cancellation_as_the_awaited_finishes_is_not_lost(outcome: str) -> None:
    # Found by tests/test_soak.py: a watched group cancelled a collective just as its pull from
    # the dead member failed; asyncio.wait_for (before Python 3.12) then raised the pull's error
    # instead, and the collective looked the object up again and waited out its timeout.
    import asyncio

    from hoplite_gpu.iothread import bounded

    async def main() -> None:
        inner = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(bounded(inner, 30.0))
        await asyncio.sleep(0)  # it waits on inner
        if outcome == "result":
            inner.set_result(1)
        else:
            inner.set_exception(ValueError("the pull failed"))
        waiting.cancel()  # in the same turn of the loop
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())
