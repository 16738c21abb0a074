"""hoplite_gpu as a Ray Direct Transport ("HOPLITE") on a local Ray instance, in Ray's own RDT usage
patterns: actor to actor, one to many, ``ray.get`` on the driver, ``ray.put`` in an actor, freeing,
and bounded, named failures (the source actor killed; a transfer Ray aborts)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray")

import hoplite_gpu as hg  # noqa: E402
import hoplite_gpu.ray as hgray  # noqa: E402
from hoplite_gpu.memory import kernels  # noqa: E402
from hoplite_gpu.ray import tensor_transport as rdt  # noqa: E402
from tests.procs import wait_for_events  # noqa: E402

# At import, in the driver and in every actor process that imports this module: the decorators
# below check the name, and Ray hands the registration only to actors created after it.
hgray.register_tensor_transport(timeout=20)

#: Same-host readers map the holder's shared memory; without it every byte goes over UCX, as
#: between hosts.
NO_SHM = hg.Config.from_env().replace(shared_memory=False)


def _tensors(seed: int, n: int) -> dict[str, Any]:
    """Several dtypes and shapes, exactly comparable."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randint(-1000, 1000, (n,), generator=g).float(),
        "i": torch.arange(12, dtype=torch.int64).reshape(3, 4) * seed,
        "h": torch.full((9,), float(seed), dtype=torch.bfloat16),
        "t": torch.arange(20, dtype=torch.float64).reshape(4, 5).t(),  # not contiguous
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


class Producer:
    def __init__(self, shared_memory: bool = True, send_rate_limit: float = 0.0) -> None:
        if not shared_memory:
            hgray.node(config=NO_SHM.replace(send_rate_limit=send_rate_limit))

    @ray.method(tensor_transport="HOPLITE")
    def make(self, seed: int, n: int) -> dict[str, Any]:
        return _tensors(seed, n)

    @ray.method(tensor_transport="HOPLITE")
    def make_one(self, n: int) -> Any:
        return torch.arange(n, dtype=torch.float32)

    def put(self, seed: int, n: int) -> Any:
        """``ray.put`` of tensors with the transport, in an actor: the ref is returned inside a list."""
        import ray

        return [ray.put(_tensors(seed, n), _tensor_transport="HOPLITE")]

    def holds(self, hex_ids: list[str]) -> list[bool]:
        node = hgray.node()
        return [node.contains(hg.ObjectID.from_hex(h)) for h in hex_ids]

    def wait_freed(self, seed: int, n: int, timeout: float) -> list[str]:
        """Make an object, hand back its ids, and wait until Ray freed it (see the test)."""
        import ray

        value = _tensors(seed, n)
        ref = ray.put(value, _tensor_transport="HOPLITE")
        ids = [rdt.object_id_for(ref.hex(), i).hex() for i in range(len(value))]
        del ref
        ray.experimental.wait_tensor_freed(value["w"], timeout=timeout)
        return ids

    def pid(self) -> int:
        return os.getpid()


class Consumer:
    def __init__(self, shared_memory: bool = True) -> None:
        if not shared_memory:
            hgray.node(config=NO_SHM)

    def take(self, value: dict[str, Any], seed: int, n: int) -> bool:
        return _same(value, _tensors(seed, n))

    def take_from_list(self, refs: list[Any], seed: int, n: int) -> bool:
        import ray

        return _same(ray.get(refs[0], timeout=TRANSFER_WAIT), _tensors(seed, n))

    def take_one(self, value: Any) -> float:
        return float(value.sum())


@pytest.fixture(scope="module")
def rdt_ray(ray_session: Any) -> Any:
    """The session's Ray with the transport registered (at import, before this module's actors exist)."""
    assert hgray.register_tensor_transport(timeout=20) == "HOPLITE"  # again: a no-op
    return ray_session


#: How long a test waits for a transfer: past Ray's RDT fetch timeout (60 s) and ours (20 s), so
#: that a transfer that failed shows as their error, not as this wait running out first.
TRANSFER_WAIT = 90


def _started(ray: Any, *actors: Any) -> None:
    """Wait (bounded) until the actors run: starting one (a process importing torch) on a busy
    machine is not part of what a transfer's wait measures."""
    ray.get([a.__ray_ready__.remote() for a in actors], timeout=120)


def _remote(ray: Any, cls: type) -> Any:
    # enable_tensor_transport: an actor with no method that returns tensors through a transport
    # must still ask for the threads that receive them (else a receive queued behind the task that
    # waits for it never runs: ray-project/ray#66264).
    return ray.remote(num_cpus=0, enable_tensor_transport=True)(cls)


def test_actor_to_actor_and_one_to_many(rdt_ray: Any) -> None:
    ray = rdt_ray
    # The producer serves at 40 MB/s (8 MiB: 0.2 s), so the four reads overlap whatever the speed of
    # the data plane: a holder serves one reader at a time, and the others then read from readers.
    producer = _remote(ray, Producer).remote(shared_memory=False, send_rate_limit=40e6)
    consumers = [_remote(ray, Consumer).remote(shared_memory=False) for _ in range(4)]
    n = 1 << 21  # 8 MiB of float32 beside the small ones
    ref = producer.make.remote(3, n)
    assert ray.get([c.take.remote(ref, 3, n) for c in consumers], timeout=120) == [True] * 4
    # The four readers formed a tree: some pulled from another reader, not all from the producer.
    node = hgray.node()
    big = rdt.object_id_for(ref.hex(), 0).hex()
    events = wait_for_events(
        node,
        lambda evs: len([e for e in evs if e["kind"] == "transfer_done" and e.get("object_id") == big]) >= 4,
    )
    senders = {e["sender"] for e in events if e["kind"] == "transfer_start" and e.get("object_id") == big}
    assert len(senders) >= 2, senders
    # the driver gets it too (one-sided: no task on the producer)
    assert _same(ray.get(ref, timeout=60), _tensors(3, n))


def test_many_objects_and_same_host_shared_memory(rdt_ray: Any) -> None:
    ray = rdt_ray
    producer = _remote(ray, Producer).remote()
    consumer = _remote(ray, Consumer).remote()
    _started(ray, producer, consumer)
    refs = [producer.make_one.remote(1000 + i) for i in range(10)]
    sums = ray.get([consumer.take_one.remote(r) for r in refs], timeout=TRANSFER_WAIT)
    assert sums == [float(sum(range(1000 + i))) for i in range(10)]


def test_ray_put_in_an_actor_and_get_elsewhere(rdt_ray: Any) -> None:
    ray = rdt_ray
    producer = _remote(ray, Producer).remote()
    consumer = _remote(ray, Consumer).remote()
    _started(ray, producer, consumer)
    box = ray.get(producer.put.remote(5, 1000), timeout=60)
    assert ray.get(consumer.take_from_list.remote(box, 5, 1000), timeout=TRANSFER_WAIT) is True
    assert _same(ray.get(box[0], timeout=60), _tensors(5, 1000))


def test_freeing_deletes_the_hoplite_objects(rdt_ray: Any) -> None:
    ray = rdt_ray
    producer = _remote(ray, Producer).remote()
    consumer = _remote(ray, Consumer).remote()
    _started(ray, producer, consumer)
    ref = producer.make.remote(7, 5000)
    assert ray.get(consumer.take.remote(ref, 7, 5000), timeout=TRANSFER_WAIT)
    ids = [rdt.object_id_for(ref.hex(), i).hex() for i in range(4)]
    assert ray.get(producer.holds.remote(ids), timeout=60) == [True] * 4
    # An object the actor put itself: once Ray freed it, its hoplite objects are gone.
    freed = ray.get(producer.wait_freed.remote(8, 5000, 60.0), timeout=90)
    assert ray.get(producer.holds.remote(freed), timeout=60) == [False] * 4
    with pytest.raises(hg.HopliteError):  # deleted everywhere: the directory no longer has it
        hgray.node().get(hg.ObjectID.from_hex(freed[0]), timeout=1)


def test_a_dead_source_is_a_bounded_named_error(rdt_ray: Any) -> None:
    ray = rdt_ray
    producer = _remote(ray, Producer).remote(shared_memory=False)
    consumer = _remote(ray, Consumer).remote(shared_memory=False)
    n = 1 << 20  # 4 MiB: held by the producer alone (a small one would be inline in the directory)
    ref = producer.make.remote(9, n)
    ray.wait([ref], timeout=60)
    assert ray.get(producer.holds.remote([rdt.object_id_for(ref.hex(), 0).hex()]), timeout=60) == [True]
    os.kill(ray.get(producer.pid.remote(), timeout=60), signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(ray.exceptions.RayError) as info:
        ray.get(consumer.take.remote(ref, 9, n), timeout=90)
    assert time.monotonic() - started < 60  # the transport's timeout (20 s) bounds it
    text = str(info.value)
    # ours: it names the Ray object and the node that held it
    assert ref.hex() in text and ("did not arrive" in text or "lost" in text), text


def test_abort_cancels_a_receive_in_progress(rdt_ray: Any) -> None:
    """Ray's abort (what it calls when a transfer fails or times out) stops a receive that waits."""
    import threading

    node = hgray.node()
    transport = rdt.HopliteTensorTransport()
    missing = hg.ObjectID.random()  # never put: the receive waits for it
    meta = rdt.HopliteTransportMetadata(
        tensor_meta=[((4,), torch.float32)], tensor_device="cpu", object_ids=[missing.hex()], holder="x:1"
    )
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            transport.recv_multiple_tensors("obj1", meta, rdt.HopliteCommunicatorMetadata(timeout=60))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    wait_for_events(
        node, lambda evs: any(e["kind"] == "lookup" and e["object_id"] == missing.hex() for e in evs)
    )
    transport.abort_transport("obj1", rdt.HopliteCommunicatorMetadata())
    thread.join(10)
    assert not thread.is_alive()
    assert (
        isinstance(errors[0], hg.TransportError) and "aborted" in str(errors[0]) and "x:1" in str(errors[0])
    )
    # An abort that comes before the receive starts stops it at once.
    transport.abort_transport("obj2", rdt.HopliteCommunicatorMetadata())
    with pytest.raises(hg.TransportError, match="aborted"):
        transport.recv_multiple_tensors("obj2", meta, rdt.HopliteCommunicatorMetadata(timeout=60))
    # and a receive that times out names the object and the holder
    with pytest.raises(hg.HopliteTimeoutError, match="x:1"):
        transport.recv_multiple_tensors("obj3", meta, rdt.HopliteCommunicatorMetadata(timeout=0.5))


def test_receive_into_target_buffers_and_bad_metadata(rdt_ray: Any) -> None:
    node = hgray.node()
    transport = rdt.HopliteTensorTransport()
    src = [torch.arange(6, dtype=torch.float32), torch.ones(3, dtype=torch.int32)]
    meta = transport.extract_tensor_transport_metadata("obj-target", src)
    assert meta.holder == node.data_address and len(meta.object_ids) == 2
    target = [torch.zeros(6), torch.zeros(3, dtype=torch.int32)]
    got = transport.recv_multiple_tensors("obj-target", meta, rdt.HopliteCommunicatorMetadata(), target)
    assert got[0] is target[0] and torch.equal(target[0], src[0]) and torch.equal(target[1], src[1])
    with pytest.raises(hg.InvalidArgumentError, match="target buffers"):
        transport.recv_multiple_tensors("obj-target", meta, rdt.HopliteCommunicatorMetadata(), target[:1])
    with pytest.raises(hg.InvalidArgumentError, match="torch tensors"):
        transport.extract_tensor_transport_metadata("obj-bad", [np.zeros(3)])
    transport.garbage_collect("obj-target", meta, src)
    assert not node.contains(hg.ObjectID.from_hex(meta.object_ids[0]))
    with pytest.raises(hg.InvalidArgumentError):
        rdt.set_timeout(0)


class CudaProducer:
    @ray.method(tensor_transport="HOPLITE")
    def make(self, n: int) -> Any:
        return torch.arange(n, dtype=torch.float64, device="cuda") * 3  # sums exact

    def device(self) -> str:
        return str(torch.cuda.current_device())


class CudaConsumer:
    def take(self, value: Any) -> tuple[str, float]:
        return value.device.type, float(value.sum().item())


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available() or not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_arrive_on_the_receivers_device(rdt_ray: Any) -> None:
    producer = ray.remote(num_gpus=0.5, num_cpus=0, enable_tensor_transport=True)(CudaProducer).remote()
    consumer = ray.remote(num_gpus=0.5, num_cpus=0, enable_tensor_transport=True)(CudaConsumer).remote()
    n = 1 << 20
    ref = producer.make.remote(n)
    assert ray.get(consumer.take.remote(ref), timeout=120) == ("cuda", 3.0 * n * (n - 1) / 2)
