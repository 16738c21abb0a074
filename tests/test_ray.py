"""The Ray integration on a local Ray instance: the directory actor, ObjectIDs through tasks, every
``ray.util.collective`` call of the ``hoplite`` backend against NumPy, the torch helpers, and the
actor training example against a single process."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.multiprocess]

torch = pytest.importorskip("torch")
pytest.importorskip("ray")

import hoplite_gpu as hg  # noqa: E402
import hoplite_gpu.ray as hgray  # noqa: E402
import hoplite_gpu.torch as hgt  # noqa: E402
import hoplite_gpu.torch.optimizer as hgt_optimizer  # noqa: E402
from hoplite_gpu.memory import cuda, kernels, shm  # noqa: E402

WORLD = 3


def _value(rank: int, shape: tuple[int, ...], salt: int = 0) -> np.ndarray:
    """Member ``rank``'s input: distinct, exactly representable values."""
    n = int(np.prod(shape))
    return ((np.arange(n) * 7 + rank * 13 + salt) % 31 - 15).astype(np.float32).reshape(shape)


class Member:
    """One member of a hoplite collective group, running the scenario the test names."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def run(self, scenario: str, group: str) -> Any:
        import ray.util.collective as col

        col.init_collective_group(self.world, self.rank, backend="hoplite", group_name=group)
        try:
            return SCENARIOS[scenario](self.rank, self.world, group)
        finally:
            col.destroy_collective_group(group)

    def run_declared(self, group: str) -> Any:
        """An allreduce in a group the driver declared with ``create_collective_group``."""
        import ray.util.collective as col

        a = _value(self.rank, (6,))
        col.allreduce(a, group)
        col.destroy_collective_group(group)
        return a


def _collectives(rank: int, world: int, group: str) -> dict[str, Any]:
    import ray.util.collective as col
    from ray.util.collective.types import ReduceOp as RayOp

    out: dict[str, Any] = {}
    for name, op in [("sum", RayOp.SUM), ("prod", RayOp.PRODUCT), ("min", RayOp.MIN), ("max", RayOp.MAX)]:
        a = _value(rank, (5, 7))
        col.allreduce(a, group, op)
        out[f"allreduce_{name}"] = a
    avg = _value(rank, (10,))
    col.allreduce(avg, group, hg.ReduceOp.AVG)
    out["allreduce_avg"] = avg
    big = _value(rank, (600_000,))  # 2.4 MB: the sharded allreduce
    col.allreduce(big, group)
    out["allreduce_big"] = big
    t = torch.from_numpy(_value(rank, (4, 6)))
    col.allreduce(t, group)
    out["allreduce_torch"] = t.numpy()
    strided = torch.from_numpy(_value(rank, (6, 4))).t()  # not contiguous: written back in place
    col.allreduce(strided, group)
    out["allreduce_strided"] = strided.contiguous().numpy()
    b16 = torch.from_numpy(_value(rank, (8,))).to(torch.bfloat16)
    col.allreduce(b16, group)
    out["allreduce_bf16"] = b16.float().numpy()
    i64 = torch.arange(5, dtype=torch.int64) * (rank + 1)
    col.allreduce(i64, group, RayOp.MAX)
    out["allreduce_int64_max"] = i64.numpy()
    b = _value(rank, (9,))
    col.broadcast(b, 1, group)
    out["broadcast"] = b
    bt = torch.from_numpy(_value(rank, (3, 3)))
    col.broadcast(bt, 2 % world, group)
    out["broadcast_torch"] = bt.numpy()
    r = _value(rank, (11,))
    col.reduce(r, 0, group, RayOp.SUM)
    out["reduce"] = r
    gathered = [np.zeros(4, np.float32) for _ in range(world)]
    col.allgather(gathered, _value(rank, (4,)), group)
    out["allgather"] = np.stack(gathered)
    gathered_t = [torch.zeros(2, 2) for _ in range(world)]
    col.allgather(gathered_t, torch.from_numpy(_value(rank, (2, 2))), group)
    out["allgather_torch"] = np.stack([x.numpy() for x in gathered_t])
    rs = torch.zeros(3)
    col.reducescatter(rs, [torch.from_numpy(_value(rank, (3,), salt=j)) for j in range(world)], group)
    out["reducescatter"] = rs.numpy()
    # point to point: 0 -> 1 twice (order kept), 1 -> 0 once
    if rank == 0:
        col.send(_value(0, (5,), salt=1), 1, group)
        col.send(torch.from_numpy(_value(0, (5,), salt=2)), 1, group)
        back = np.zeros(5, np.float32)
        col.recv(back, 1, group)
        out["recv"] = back
    elif rank == 1:
        first, second = np.zeros(5, np.float32), torch.zeros(5)
        col.recv(first, 0, group)
        col.recv(second, 0, group)
        col.send(first + second.numpy(), 0, group)
        out["recv"] = np.stack([first, second.numpy()])
    col.barrier(group)
    out["shared_memory"] = hgray.node().config.shared_memory
    return out


def _recv_timeout(rank: int, world: int, group: str) -> str:
    """Member 1 waits for a message nobody sends: a typed timeout, not a hang."""
    import ray.util.collective as col
    from ray.util.collective.collective import get_group_handle

    if rank == 1:
        get_group_handle(group).group.timeout = 1.0
        try:
            col.recv(np.zeros(3, np.float32), 0, group)
        except hg.HopliteTimeoutError:
            outcome = "timeout"
        else:
            outcome = "received"
        get_group_handle(group).group.timeout = 60.0
    else:
        outcome = "idle"
    col.barrier(group)
    return outcome


def _read_only(rank: int, world: int, group: str) -> list[Any]:
    """Member 1 passes read-only arrays (not Ray's) for results: it is refused typed, the others
    get theirs, and the next collective runs in step."""
    import ray.util.collective as col

    def frozen(a: np.ndarray) -> np.ndarray:
        if rank == 1:
            a.flags.writeable = False
        return a

    out: list[Any] = []
    calls = [
        lambda: col.allreduce(frozen(_value(rank, (5,))), group),
        lambda: col.allreduce(frozen(_value(rank, (600_000,))), group),  # the sharded path
        lambda: col.allgather(
            [frozen(np.zeros(4, np.float32)) for _ in range(world)], _value(rank, (4,)), group
        ),
        lambda: col.broadcast(frozen(_value(rank, (3,))), 0, group),
    ]
    for call in calls:
        try:
            call()
            out.append("ok")
        except hg.CollectiveArgumentError as exc:
            out.append("read-only" if "read-only" in str(exc) else str(exc))
    a = _value(rank, (7,))
    col.allreduce(a, group)
    out.append(a)
    return out


def _gradients(rank: int, world: int, group: str) -> dict[str, Any]:
    """allreduce_gradients with small buckets (several fused buckets, a large tensor alone, a
    parameter without gradient) and DistributedOptimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    frozen = torch.nn.Parameter(torch.zeros(2))  # no gradient: skipped
    for i, p in enumerate(model.parameters()):
        p.grad = torch.from_numpy(_value(rank, tuple(p.shape), salt=i))
    hgt.allreduce_gradients([*model.parameters(), frozen], group, bucket_bytes=200)
    grads = [p.grad.numpy().copy() for p in model.parameters()]
    start = torch.nn.Linear(4, 2)
    torch.nn.init.constant_(start.weight, float(rank))
    hgt.broadcast_parameters(start, 2 % world, group)
    optimizer = hgt.DistributedOptimizer(torch.optim.SGD(start.parameters(), lr=1.0), group)
    optimizer.zero_grad()
    start.weight.grad = torch.full((2, 4), float(rank))
    start.bias.grad = torch.zeros(2)
    optimizer.step()
    return {"grads": grads, "weight": start.weight.detach().numpy().copy(), "frozen_grad": frozen.grad}


def _gpu_tensors(rank: int, world: int, group: str) -> dict[str, Any]:
    """CuPy arrays and CUDA torch tensors through the backend (GPU machines only)."""
    import cupy
    import ray.util.collective as col

    a = cupy.asarray(_value(rank, (1000,)))
    col.allreduce(a, group)
    t = torch.from_numpy(_value(rank, (700_000,))).cuda()  # sharded
    col.allreduce(t, group)
    b = torch.from_numpy(_value(rank, (16,))).cuda()
    col.broadcast(b, 1, group)
    bits = _bf16_value(rank).view(np.int16)
    h = torch.from_numpy(bits).view(torch.bfloat16).cuda()
    try:
        col.allreduce(h, group)
        half: Any = h.view(torch.int16).cpu().numpy()
    except hg.InvalidArgumentError as exc:  # a CuPy without bfloat16 (before 14)
        half = str(exc)
    return {
        "cupy": cupy.asnumpy(a),
        "torch": t.cpu().numpy(),
        "broadcast": b.cpu().numpy(),
        "bf16": half,
        "stats": hgray.node().stats(),
    }


def _bf16_value(rank: int) -> Any:
    """Small integers as bfloat16: their sums are exact, whatever the order of reduction."""
    import ml_dtypes

    return ((np.arange(4096) * (rank + 3)) % 64 - 32).astype(ml_dtypes.bfloat16)


def _refused_list(rank: int, world: int, group: str) -> list[Any]:
    """Member 1 hands the backend a list of two tensors (as a multi-GPU call would): it is
    refused typed, yet takes its place in the group's order, so the others' call fails (by
    their timeout) and the next collective runs in step."""
    import ray.util.collective as col
    from ray.util.collective.collective import get_group_handle

    handle = get_group_handle(group)
    out: list[Any] = []
    handle.group.timeout = 2.0
    try:
        if rank == 1:
            handle.allreduce([_value(rank, (5,)), _value(rank, (5,))])
        else:
            col.allreduce(_value(rank, (5,)), group)
        out.append("ok")
    except hg.InvalidArgumentError as exc:
        out.append("refused" if "one tensor per process" in str(exc) else str(exc))
    except hg.HopliteError as exc:
        out.append(type(exc).__name__)
    handle.group.timeout = 60.0
    a = _value(rank, (7,))
    col.allreduce(a, group)
    out.append(a)
    return out


SCENARIOS = {
    "collectives": _collectives,
    "recv_timeout": _recv_timeout,
    "read_only": _read_only,
    "refused_list": _refused_list,
    "gradients": _gradients,
    "gpu_tensors": _gpu_tensors,
}


def _run(
    ray: Any,
    scenario: str,
    group: str,
    world: int = WORLD,
    gpus: float = 0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``scenario`` on ``world`` member actors (Ray hides the GPUs of actors that ask for none),
    with ``env`` added to their environment (a runtime environment of their own: fresh worker
    processes, whose nodes read it)."""
    options: dict[str, Any] = {"num_cpus": 0, "num_gpus": gpus}
    if env:
        options["runtime_env"] = {"env_vars": env}
    actor = ray.remote(**options)(Member)
    members = [actor.remote(r, world) for r in range(world)]
    try:
        return list(ray.get([m.run.remote(scenario, group) for m in members], timeout=150))
    finally:
        for m in members:
            ray.kill(m)


# ----------------------------------------------------------------------------- tests


@pytest.mark.timeout(120)
def test_directory_actor_start_and_reuse(ray_session: Any) -> None:
    address = hgray.start_directory()
    assert hgray.start_directory() == address
    assert hgray.directory_info()[0] == address
    node = hgray.node()
    assert hgray.node() is node
    assert node.directory_address == address


@pytest.mark.timeout(120)
def test_node_without_directory_actor_is_a_typed_error(ray_session: Any) -> None:
    with pytest.raises(hg.DirectoryUnavailableError, match="start_directory"):
        hgray.node("no-such-directory")


@pytest.mark.timeout(120)
def test_object_ids_through_tasks_and_actors(ray_session: Any) -> None:
    ray = ray_session

    @ray.remote(num_cpus=0)
    def produce(n: int) -> Any:
        return [hgray.node().put(np.arange(n, dtype=np.float64))]

    @ray.remote(num_cpus=0)
    def total(ids: list[Any]) -> float:
        return float(sum(hgray.node().get(oid).sum() for oid in ids))

    class Keeper:
        def keep(self, oid: Any) -> Any:
            self.oid = oid
            return oid

        def read(self) -> float:
            return float(hgray.node().get(self.oid).sum())

    ids = ray.get(produce.remote(100))
    assert isinstance(ids[0], hg.ObjectID)
    keeper = ray.remote(num_cpus=0)(Keeper).remote()
    assert ray.get(keeper.keep.remote(ids[0]), timeout=60) == ids[0]
    assert ray.get(keeper.read.remote(), timeout=60) == 4950.0
    assert ray.get(total.remote(ids + ray.get(produce.remote(10))), timeout=60) == 4950.0 + 45.0
    assert float(hgray.node().get(ids[0]).sum()) == 4950.0  # and in the driver
    ray.kill(keeper)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shared_memory", [False, True], ids=["network", "shared-memory"])
def test_every_collective_call_matches_numpy(ray_session: Any, shared_memory: bool) -> None:
    # The suite turns shared memory off (every byte over the data plane); members on one host
    # with it on read each other's objects in /dev/shm.
    env = {"HOPLITE_SHARED_MEMORY": str(int(shared_memory))}
    results = _run(ray_session, "collectives", f"every-call-{int(shared_memory)}", env=env)
    w = WORLD
    ins = [_value(r, (5, 7)) for r in range(w)]
    for r, out in enumerate(results):
        assert out["shared_memory"] is (shared_memory and shm.available())
        np.testing.assert_array_equal(out["allreduce_sum"], np.sum(ins, axis=0))
        np.testing.assert_array_equal(out["allreduce_prod"], np.prod(ins, axis=0))
        np.testing.assert_array_equal(out["allreduce_min"], np.min(ins, axis=0))
        np.testing.assert_array_equal(out["allreduce_max"], np.max(ins, axis=0))
        np.testing.assert_allclose(
            out["allreduce_avg"], np.mean([_value(i, (10,)) for i in range(w)], axis=0)
        )
        np.testing.assert_array_equal(
            out["allreduce_big"], np.sum([_value(i, (600_000,)) for i in range(w)], 0)
        )
        np.testing.assert_array_equal(
            out["allreduce_torch"], np.sum([_value(i, (4, 6)) for i in range(w)], 0)
        )
        np.testing.assert_array_equal(
            out["allreduce_strided"], np.sum([_value(i, (6, 4)).T for i in range(w)], axis=0)
        )
        np.testing.assert_array_equal(out["allreduce_bf16"], np.sum([_value(i, (8,)) for i in range(w)], 0))
        np.testing.assert_array_equal(out["allreduce_int64_max"], np.arange(5) * w)
        np.testing.assert_array_equal(out["broadcast"], _value(1, (9,)))
        np.testing.assert_array_equal(out["broadcast_torch"], _value(2 % w, (3, 3)))
        expected_reduce = np.sum([_value(i, (11,)) for i in range(w)], 0) if r == 0 else _value(r, (11,))
        np.testing.assert_array_equal(out["reduce"], expected_reduce)
        np.testing.assert_array_equal(out["allgather"], np.stack([_value(i, (4,)) for i in range(w)]))
        np.testing.assert_array_equal(out["allgather_torch"], np.stack([_value(i, (2, 2)) for i in range(w)]))
        np.testing.assert_array_equal(
            out["reducescatter"], np.sum([_value(i, (3,), salt=r) for i in range(w)], axis=0)
        )
    sent = np.stack([_value(0, (5,), salt=1), _value(0, (5,), salt=2)])
    np.testing.assert_array_equal(results[1]["recv"], sent)
    np.testing.assert_array_equal(results[0]["recv"], sent.sum(axis=0))
    assert "recv" not in results[2]


@pytest.mark.timeout(120)
def test_group_declared_by_the_driver(ray_session: Any) -> None:
    import ray.util.collective as col

    members = [ray_session.remote(num_cpus=0)(Member).remote(r, 2) for r in range(2)]
    try:
        col.create_collective_group(members, 2, [0, 1], backend="hoplite", group_name="declared")
        results = ray_session.get([m.run_declared.remote("declared") for m in members], timeout=60)
    finally:
        for m in members:
            ray_session.kill(m)
    for out in results:
        np.testing.assert_array_equal(out, _value(0, (6,)) + _value(1, (6,)))


@pytest.mark.timeout(180)
def test_group_created_again_under_the_same_name(ray_session: Any) -> None:
    """A destroyed group's name can be used again: the new group does not see the old objects."""
    first = _run(ray_session, "gradients", "again", world=2)
    second = _run(ray_session, "gradients", "again", world=2)
    for a, b in zip(first, second, strict=True):
        for x, y in zip(a["grads"], b["grads"], strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.mark.timeout(120)
def test_recv_with_nothing_sent_times_out(ray_session: Any) -> None:
    assert _run(ray_session, "recv_timeout", "recv-timeout") == ["idle", "timeout", "idle"]


@pytest.mark.timeout(120)
def test_read_only_results_are_refused_typed_and_the_group_stays_in_step(ray_session: Any) -> None:
    results = _run(ray_session, "read_only", "read-only-results")
    want = sum(_value(r, (7,)) for r in range(WORLD))
    for rank, got in enumerate(results):
        assert got[:4] == ["read-only" if rank == 1 else "ok"] * 4, got
        np.testing.assert_allclose(got[4], want)


@pytest.mark.timeout(120)
def test_a_call_refused_on_one_member_keeps_the_group_in_step(ray_session: Any) -> None:
    results = _run(ray_session, "refused_list", "refused-list")
    want = sum(_value(r, (7,)) for r in range(WORLD))
    for rank, got in enumerate(results):
        assert got[0] == ("refused" if rank == 1 else "HopliteTimeoutError"), got
        np.testing.assert_allclose(got[1], want)


@pytest.mark.timeout(180)
def test_gradient_helpers(ray_session: Any) -> None:
    results = _run(ray_session, "gradients", "gradients")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    shapes = [tuple(p.shape) for p in model.parameters()]
    for out in results:
        for i, (got, shape) in enumerate(zip(out["grads"], shapes, strict=True)):
            expected = np.mean([_value(r, shape, salt=i) for r in range(WORLD)], axis=0)
            np.testing.assert_allclose(got, expected, rtol=1e-6)
        # every member started from rank 2's weights (2.0), stepped by the mean gradient (1.0)
        np.testing.assert_allclose(out["weight"], np.full((2, 4), 2.0 - np.mean(range(WORLD))))
        assert out["frozen_grad"] is None


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason="needs CuPy and a CUDA device")
@pytest.mark.timeout(180)
def test_gpu_tensors_through_the_backend(ray_session: Any) -> None:
    # Shared memory on (the suite turns it off): members on one host read each other's device
    # memory through CUDA IPC, never staged through host buffers.
    env = {"HOPLITE_SHARED_MEMORY": "1"}
    results = _run(ray_session, "gpu_tensors", "gpu-tensors", world=2, gpus=0.5, env=env)
    for out in results:
        stats = out["stats"]
        assert stats["staged_bytes_sent"] == stats["staged_bytes_received"] == 0, stats
        assert stats["device_ipc_opened"] + stats["device_ipc_reused"] > 0, stats
        np.testing.assert_array_equal(out["cupy"], _value(0, (1000,)) + _value(1, (1000,)))
        np.testing.assert_array_equal(out["torch"], _value(0, (700_000,)) + _value(1, (700_000,)))
        np.testing.assert_array_equal(out["broadcast"], _value(1, (16,)))
        if cuda.cupy_bfloat16() is None:
            assert "CuPy 14" in out["bf16"]
        else:
            want = (_bf16_value(0).astype(np.float32) + _bf16_value(1)).astype(_bf16_value(0).dtype)
            np.testing.assert_array_equal(out["bf16"], want.view(np.int16))


def test_buckets_fuse_by_device_and_dtype_within_the_size() -> None:
    ts = [
        torch.zeros(10),
        torch.zeros(10),
        torch.zeros(100),
        torch.zeros(5, dtype=torch.float64),
        torch.zeros(3),
    ]
    buckets = hgt_optimizer._buckets(ts, bucket_bytes=80)
    assert [[t.numel() for t in b] for b in buckets] == [[10, 10], [100], [3], [5]]


def test_torch_helpers_reject_bad_arguments() -> None:
    with pytest.raises(hg.InvalidArgumentError):
        hgt.resolve_group(42)
    with pytest.raises(hg.InvalidArgumentError):
        hgt.DistributedOptimizer(object(), "g")
    with pytest.raises(hg.InvalidArgumentError):
        hgray.as_buffer([1, 2, 3])


def test_as_buffer_shares_memory_where_it_can() -> None:
    t = torch.zeros(4)
    buf, back = hgray.as_buffer(t)
    buf[:] = 3.0
    assert back is None and float(t.sum()) == 12.0
    strided = torch.zeros(3, 2).t()
    buf, back = hgray.as_buffer(strided)
    buf[...] = 1.0
    assert back is not None
    back()
    assert float(strided.sum()) == 6.0


@pytest.mark.timeout(180)
def test_actor_training_loop_matches_a_single_process(ray_session: Any) -> None:
    from examples.ray_training import train_distributed, train_single

    distributed = train_distributed(workers=4, steps=15, global_batch=64, group_name="training-test")
    single = train_single(steps=15, global_batch=64)
    assert single[-1] < single[0]
    np.testing.assert_allclose(distributed, single, atol=1e-4)
