"""What code written for Ray's gloo backend expects of ``backend="hoplite"`` beyond the results
themselves (``ray.util.collective``'s contract): in-place results in the NumPy arrays Ray hands an
actor (flagged read-only), and ``destroy_collective_group`` on one member alone, the name then
usable again."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.multiprocess]

pytest.importorskip("torch")
pytest.importorskip("ray")

import hoplite_gpu as hg  # noqa: E402
import hoplite_gpu.ray as hgray  # noqa: E402

#: float32 elements of an array Ray inlines in the task (10) and of one it keeps in its object store.
SMALL, LARGE = 10, 1 << 18


class Holder:
    """An actor keeping the array it was given, as Ray's tests' workers do."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.buffer: Any = None

    def init(self, group: str) -> bool:
        import ray.util.collective as col

        col.init_collective_group(self.world, self.rank, backend="hoplite", group_name=group)
        return True

    def set_buffer(self, data: Any) -> tuple[bool, str]:
        self.buffer = data  # Ray's zero-copy view: read-only
        return bool(data.flags["WRITEABLE"]), type(data.base.base).__module__

    def collectives(self, group: str) -> dict[str, Any]:
        """In-place allreduce, broadcast and reduce into the array Ray gave, and an allgather whose
        input is that array; the warnings they raised."""
        import ray.util.collective as col

        out: dict[str, Any] = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            col.allreduce(self.buffer, group)
            out["allreduce"] = self.buffer.copy()
            col.broadcast(self.buffer, 1, group)
            out["broadcast"] = self.buffer.copy()
            gathered = [np.zeros_like(self.buffer) for _ in range(self.world)]
            col.allgather(gathered, self.buffer, group)
            out["allgather"] = np.stack(gathered)
        out["warnings"] = [type(w.message).__name__ for w in caught]
        out["still_read_only"] = not self.buffer.flags["WRITEABLE"]
        return out

    def destroy(self, group: str) -> bool:
        import ray.util.collective as col

        col.destroy_collective_group(group)
        return True

    def initialized(self, group: str) -> bool:
        import ray.util.collective as col

        return bool(col.is_group_initialized(group))

    def allreduce(self, group: str) -> Any:
        import ray.util.collective as col

        a = np.full(4, self.rank + 1, np.float64)
        col.allreduce(a, group)
        return a

    def mismatched_allgather(self, group: str) -> tuple[str, bool, bool]:
        """An allgather whose outputs (20 elements) do not match the members' inputs (10)."""
        import ray.util.collective as col

        try:
            outs = [np.zeros(20, np.float32) for _ in range(self.world)]
            col.allgather(outs, np.ones(10, np.float32), group)
        except RuntimeError as exc:  # what Ray's backends raise; ours is a hoplite error too
            return type(exc).__name__, isinstance(exc, hg.InvalidArgumentError), "group" in str(exc)
        return "nothing", False, False

    def preloaded(self) -> tuple[bool, bool, bool]:
        """Whether the node's code was imported without a node (polled with a deadline), whether
        ucxx was, and whether this process has a node or a UCX context of hoplite_gpu's."""
        import sys
        import time

        from hoplite_gpu.dataplane.ucx import loading as ucx
        from hoplite_gpu.ray import directory

        deadline = time.monotonic() + 60
        while "hoplite_gpu.node" not in sys.modules and time.monotonic() < deadline:
            time.sleep(0.05)
        loaded = "hoplite_gpu.node" in sys.modules
        return loaded, "ucxx" in sys.modules, bool(directory._nodes) or ucx._ucxx is not None


def _holders(ray: Any, world: int = 2) -> list[Any]:
    actor = ray.remote(num_cpus=0)(Holder)
    return [actor.remote(r, world) for r in range(world)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["inlined", "object-store"])
def test_results_land_in_the_arrays_ray_hands_an_actor(ray_session: Any, size: int) -> None:
    ray = ray_session
    holders = _holders(ray)
    group = f"read-only-{size}"
    try:
        assert ray.get([h.init.remote(group) for h in holders], timeout=60) == [True, True]
        given = [np.arange(size, dtype=np.float32) * (r + 1) for r in range(2)]
        flags = ray.get([h.set_buffer.remote(a) for h, a in zip(holders, given, strict=True)], timeout=60)
        assert flags == [(False, "ray._raylet")] * 2  # what gloo writes through and we did refuse
        results = ray.get([h.collectives.remote(group) for h in holders], timeout=120)
    finally:
        for h in holders:
            ray.kill(h)
    total = given[0] + given[1]
    for out in results:
        np.testing.assert_array_equal(out["allreduce"], total)
        np.testing.assert_array_equal(out["broadcast"], total)  # rank 1's, after the allreduce
        np.testing.assert_array_equal(out["allgather"], np.stack([total, total]))
        assert out["warnings"] == ["RayReadOnlyWriteWarning"]  # once per process
        assert out["still_read_only"]


@pytest.mark.timeout(240)
def test_destroy_on_one_member_is_local_and_the_name_is_usable_again(ray_session: Any) -> None:
    ray = ray_session
    holders = _holders(ray)
    group = "destroyed-locally"
    try:
        assert ray.get([h.init.remote(group) for h in holders], timeout=60) == [True, True]
        first = ray.get([h.allreduce.remote(group) for h in holders], timeout=60)
        assert [a.tolist() for a in first] == [[3.0] * 4] * 2
        # Member 0 alone: its destroy used to wait for member 1 (hoplite_gpu.ray.DEFAULT_TIMEOUT,
        # 300 s); Ray's contract is local.
        assert ray.get(holders[0].destroy.remote(group), timeout=60)
        assert ray.get([h.initialized.remote(group) for h in holders], timeout=60) == [False, True]
        assert ray.get(holders[1].destroy.remote(group), timeout=60)
        assert ray.get([h.init.remote(group) for h in holders], timeout=60) == [True, True]
        again = ray.get([h.allreduce.remote(group) for h in holders], timeout=60)
        assert [a.tolist() for a in again] == [[3.0] * 4] * 2
    finally:
        for h in holders:
            ray.kill(h)


@pytest.mark.timeout(180)
def test_arrays_unlike_the_other_members_raise_a_runtime_error(ray_session: Any) -> None:
    ray = ray_session
    holders = _holders(ray)
    try:
        assert ray.get([h.init.remote("mismatched") for h in holders], timeout=60) == [True, True]
        results = ray.get([h.mismatched_allgather.remote("mismatched") for h in holders], timeout=120)
    finally:
        for h in holders:
            ray.kill(h)
    assert results == [("CollectiveArgumentError", True, True)] * 2


@pytest.mark.timeout(120)
def test_a_worker_loads_the_node_before_its_first_collective(ray_session: Any) -> None:
    """Ray's setup hook (``register_collective_backend``) imports the node's code in the
    background, and UCX only where the data plane is UCX's (half a second), starting nothing."""
    from hoplite_gpu.config import Config
    from hoplite_gpu.dataplane.selection import data_plane_kind

    ucx = data_plane_kind(Config.from_env()) == "ucx"
    (holder,) = _holders(ray_session, world=1)
    try:
        assert ray_session.get(holder.preloaded.remote(), timeout=90) == (True, ucx, False)
    finally:
        ray_session.kill(holder)


@pytest.mark.timeout(60)
def test_read_only_arrays_not_from_ray_are_refused_as_outputs_only() -> None:
    frozen = np.frombuffer(np.arange(6, dtype=np.float32).tobytes(), dtype=np.float32)
    assert not frozen.flags["WRITEABLE"]
    with pytest.raises(hg.InvalidArgumentError, match="read-only"):
        hgray.as_buffer(frozen)
    buf, back = hgray.as_buffer(frozen, write=False)  # an input: read as it is
    assert buf is frozen and back is None
    strided = np.arange(12.0).reshape(3, 4)[:, ::2]
    strided.flags["WRITEABLE"] = False
    with pytest.raises(hg.InvalidArgumentError, match="read-only"):
        hgray.as_buffer(strided)
