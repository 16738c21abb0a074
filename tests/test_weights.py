"""Weight sync (:mod:`hoplite_gpu.weights`): versions of named tensors from a publisher to
subscribers, in one process and across real processes with real SIGKILLs."""

from __future__ import annotations

import glob
import threading
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

try:
    import torch
except ImportError:  # the worker image collects this file without torch
    torch = None

import hoplite_gpu as hg
from hoplite_gpu.errors import InvalidArgumentError, VersionRetiredError, WeightSyncError
from hoplite_gpu.weights import WeightPublisher, WeightSubscriber
from hoplite_gpu.weights.manifest import (
    ALIGN,
    BucketEntry,
    Manifest,
    TensorEntry,
    decode_digests,
    object_id,
    plan,
)
from tests.procs import digest, start_workers, weights_state

pytestmark = pytest.mark.timeout(180)

#: A transformer-like state dict of mixed sizes: about 21 MiB in 26 tensors.
LAYOUT = (
    [("embed", "float32", (2048, 1024))]
    + [
        (f"layer{i}.{part}", dtype, shape)
        for i in range(4)
        for part, dtype, shape in (
            ("attn", "float32", (512, 1024)),
            ("mlp", "float16", (1024, 1024)),
            ("norm", "float32", (1024,)),
            ("bias", "float32", (7,)),
            ("step", "int64", ()),
            ("mask", "bool", (3, 5)),
        )
    ]
    + [("head", "float32", (1000, 256))]
)
SMALL_CHUNKS = {"adaptive_chunks": False, "chunk_bytes": 256 << 10}


# ---------------------------------------------------------------- the manifest (pure)
def test_tensors_are_packed_in_order_aligned_and_a_large_one_gets_its_own_bucket() -> None:
    places, sizes = plan([10, 100, 1000, 5, 0, 3], bucket_bytes=256)
    assert places == [(0, 0), (0, 64), (1, 0), (2, 0), (2, 64), (2, 64)]
    assert sizes == [164, 1000, 67]
    assert all(offset % ALIGN == 0 for _, offset in places)
    assert plan([], 256) == ([], [])


def _manifest() -> Manifest:
    return Manifest(
        "w",
        3,
        0,
        2,
        "node at host:1",
        (
            TensorEntry("a", "numpy", "<f4", (2, 3), 0, 0, 24),
            TensorEntry("b", "torch", "bfloat16", (), 0, 64, 2),
        ),
        (BucketEntry(66),),
    )


def test_a_manifest_round_trips() -> None:
    m = _manifest()
    assert Manifest.decode(m.encode(), "w", 3, 0) == m


@pytest.mark.parametrize(
    "raw, expected",
    [
        (b"not json", ("w", 3, 0)),
        (None, ("w", 4, 0)),  # another version
        (None, ("w", 3, 1)),  # another rank
        (b'{"format": 1, "name": "w", "version": 3, "rank": 0, "world_size": 0, "holder": ""}', ("w", 3, 0)),
        (_manifest().encode().replace(b"[66]", b"[60]"), ("w", 3, 0)),  # b lies outside its bucket
        (_manifest().encode().replace(b'"b"', b'"a"'), ("w", 3, 0)),  # a name twice
        (_manifest().encode().replace(b'"torch"', b'"pickle"'), ("w", 3, 0)),
        (_manifest().encode().replace(b"[2,3]", b"[2,-3]"), ("w", 3, 0)),
    ],
)
def test_a_malformed_manifest_is_refused(raw: bytes | None, expected: tuple[str, int, int]) -> None:
    with pytest.raises(WeightSyncError, match="malformed"):
        Manifest.decode(raw or _manifest().encode(), *expected)


# ---------------------------------------------------------------- one process, two nodes
@pytest.fixture(scope="module")
def nodes() -> Iterator[tuple[Any, Any]]:
    trainer = hg.init()
    engine = hg.connect(trainer.directory_address, token=trainer.token)
    yield trainer, engine
    engine.close()
    trainer.close()


def _mixed(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 700, generator=g),
        "bf": torch.randn(33, generator=g).to(torch.bfloat16),
        "flag": torch.tensor(seed % 2 == 0),
        "empty": torch.zeros(0, 4),
        "np_f64": np.arange(1000, dtype=np.float64)[::2] * seed,  # not contiguous
        "np_i8": (np.arange(5000) % 100 + seed).astype(np.int8).reshape(50, 100),
        "np_bf": np.full(9, seed, ml_dtypes.bfloat16),
        "np_scalar": np.array(seed, np.float32),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_a_version_of_numpy_and_torch_tensors_arrives_bit_exact_new_or_in_place(nodes: Any) -> None:
    trainer, engine = nodes
    pub = WeightPublisher(trainer, "exact", bucket_bytes=256 << 10)
    sub = WeightSubscriber(engine, "exact")
    state = _mixed(1)
    assert len(pub.publish(state, version=1).buckets) == 2  # w has one of its own; the rest share
    state["w"].add_(1)  # the caller may change its tensors once publish returned
    version, got = sub.receive(timeout=30)
    assert version == 1 and sub.received == 1
    assert all(_same(_mixed(1)[k], got[k]) for k in state)
    into = {
        k: torch.empty_like(v) if isinstance(v, torch.Tensor) else np.empty_like(v) for k, v in state.items()
    }
    into["np_f64"] = np.empty((1000,), np.float64)[::2]  # filled through a strided view
    pub.publish(_mixed(2), version=5)
    version, filled = sub.receive(into=into, timeout=30)
    assert version == 5 and all(filled[k] is into[k] for k in into)
    assert all(_same(_mixed(2)[k], into[k]) for k in state)
    pub.close()


def _cuda() -> bool:
    return torch is not None and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs torch with a CUDA GPU")
def test_cuda_tensors_arrive_bit_exact_into_cuda_tensors(nodes: Any) -> None:
    trainer, engine = nodes
    g = torch.Generator(device="cuda").manual_seed(3)
    state = {
        "w": torch.randn(1024, 700, device="cuda", generator=g),
        "bf": torch.randn(4099, device="cuda", generator=g).to(torch.bfloat16),
        "strided": torch.arange(30000, device="cuda", dtype=torch.int32)[::3],
        "host": torch.arange(7, dtype=torch.float64),
    }
    with WeightPublisher(trainer, "cuda", bucket_bytes=1 << 20) as pub:
        pub.publish(state, version=1)
        sub = WeightSubscriber(engine, "cuda")
        into = {k: torch.empty_like(v) for k, v in state.items()}
        into["strided"] = torch.zeros(20000, device="cuda", dtype=torch.int32)[::2]  # a strided view
        version, filled = sub.receive(into=into, timeout=60)
        assert version == 1 and all(filled[k] is into[k] for k in state)
        assert into["w"].device.type == "cuda" and into["host"].device.type == "cpu"
        assert all(torch.equal(state[k], into[k]) for k in state)
        _, fresh = sub.receive(version=1, timeout=60)  # no into: CPU tensors of the same bytes
        assert all(torch.equal(state[k].cpu(), fresh[k]) for k in state)


def test_a_receive_refuses_a_wrong_into_or_unknown_names_and_touches_nothing(nodes: Any) -> None:
    trainer, engine = nodes
    with WeightPublisher(trainer, "refuse") as pub:
        pub.publish({"a": np.ones(4, np.float32), "b": np.ones(2, np.int64)}, version=0)
        sub = WeightSubscriber(engine, "refuse")
        wrong = {"a": np.zeros(5, np.float32)}
        with pytest.raises(InvalidArgumentError, match=r"into\['a'\] is float32\[5\]"):
            sub.receive(into=wrong, timeout=30)
        with pytest.raises(InvalidArgumentError, match="lacks"):
            sub.receive(names=["a", "zzz"], timeout=30)
        with pytest.raises(InvalidArgumentError, match="not one str"):
            sub.receive(names="a", timeout=30)
        assert not wrong["a"].any() and sub.received is None
        _, only = sub.receive(names=["b"], timeout=30)
        assert list(only) == ["b"] and np.array_equal(only["b"], np.ones(2, np.int64))
        with pytest.raises(InvalidArgumentError, match="not greater"):
            pub.publish({"a": np.ones(1)}, version=0)
        with pytest.raises(InvalidArgumentError, match="not a NumPy array"):
            pub.publish({"a": [1, 2]}, version=1)


def test_versions_are_retired_and_latest_waits_for_a_newer_one(nodes: Any) -> None:
    trainer, engine = nodes
    pub = WeightPublisher(trainer, "versions", keep=2)
    sub = WeightSubscriber(engine, "versions")
    for v in (1, 2, 4):
        pub.publish({"x": np.full(3, v)}, version=v)
    assert sub.latest(timeout=10) == 4
    with pytest.raises(VersionRetiredError):
        sub.receive(version=1, timeout=10)
    assert sub.receive(version=2, timeout=10)[1]["x"][0] == 2
    seen: list[int] = []
    waiter = threading.Thread(target=lambda: seen.append(sub.latest(timeout=30, newer_than=4)))
    waiter.start()
    pub.publish({"x": np.full(3, 9)}, version=9)
    waiter.join(60)
    assert seen == [9]
    assert sub.latest(timeout=10, newer_than=1) == 9  # 1 is retired: the chain starts at the head
    with pytest.raises(hg.HopliteTimeoutError):
        sub.latest(timeout=0.5, newer_than=9)
    pub.close()
    with pytest.raises(hg.HopliteTimeoutError):
        WeightSubscriber(engine, "never-published").latest(timeout=0.5)


@pytest.mark.parametrize("keep_previous", [False, True])
def test_a_subscriber_drops_its_copies_of_a_version_once_it_has_the_next(
    nodes: Any, keep_previous: bool
) -> None:
    trainer, engine = nodes
    name = f"drop-{keep_previous}"
    pub = WeightPublisher(trainer, name, keep=3)
    sub = WeightSubscriber(engine, name, keep_previous=keep_previous)
    pub.publish({"x": np.ones(1 << 17)}, version=1)
    _, first = sub.receive(timeout=30)
    bucket = object_id(name, "bucket", 1, 0, 0)
    assert engine.contains(bucket)
    pub.publish({"x": np.zeros(1 << 17)}, version=2)
    sub.receive(timeout=30)
    assert engine.contains(bucket) == keep_previous
    assert trainer.contains(bucket)  # the publisher's copy stays until it retires the version
    assert (first["x"] == 1).all()  # what a receive returned stays valid
    pub.close()


def test_a_publish_that_fails_withdraws_what_it_put_and_a_waiting_receive_hears_it(nodes: Any) -> None:
    trainer, engine = nodes
    engine.put(np.zeros(8, np.uint8), object_id("clash", "bucket", 1, 0, 0))  # someone else's object
    sub = WeightSubscriber(engine, "clash")
    with WeightPublisher(trainer, "clash") as pub:
        with pytest.raises(hg.ObjectExistsError):
            pub.publish({"x": np.ones(8, np.float32)}, version=1)
        assert pub.latest is None
        with pytest.raises(VersionRetiredError):
            sub.receive(version=1, timeout=10)  # its manifest was put first, then withdrawn
        pub.publish({"x": np.ones(8, np.float32)}, version=2)
        assert sub.receive(timeout=10)[0] == 2


def test_malformed_digests_are_refused() -> None:
    m = _manifest()
    assert decode_digests(b'["' + b"0" * 32 + b'"]', m) == ["0" * 32]
    for raw in (b"[]", b'["00"]', b"{}", b"x", b'["' + b"0" * 32 + b'", "' + b"0" * 32 + b'"]'):
        with pytest.raises(WeightSyncError, match=r"digests of rank 0 in version 3 .* are malformed"):
            decode_digests(raw, m)


def _address(node: Any, name: str, version: int) -> int:
    """Where the first bucket of ``version`` lives on the node that published it."""
    return int(node.get(object_id(name, "bucket", version, 0, 0), timeout=10).__array_interface__["data"][0])


def test_a_publisher_reuses_the_buckets_of_a_retired_version_that_nothing_reads(nodes: Any) -> None:
    trainer, _ = nodes
    pub = WeightPublisher(trainer, "reuse", keep=1)
    for v in (1, 2, 3):
        pub.publish({"x": np.full(1 << 16, v, np.float32)}, version=v)
        if v == 1:
            first = _address(trainer, "reuse", 1)
    assert _address(trainer, "reuse", 3) == first  # 1 was retired when 2 came: its memory is 3's
    held = trainer.get(object_id("reuse", "bucket", 3, 0, 0), timeout=10)  # a reader keeps 3's
    pub.publish({"x": np.full(1 << 16, 4, np.float32)}, version=4)  # 2's memory; 3 is retired
    pub.publish({"x": np.full(1 << 16, 5, np.float32)}, version=5)  # not 3's: it is read
    assert _address(trainer, "reuse", 5) != first
    assert (held.view(np.float32) == 3).all()
    pub.close()


def test_a_bucket_that_does_not_match_its_manifest_is_refused(nodes: Any) -> None:
    trainer, engine = nodes
    good = np.arange(16, dtype=np.uint8)
    entry = TensorEntry("t", "numpy", "|u1", (16,), 0, 0, 16)
    manifest = Manifest("corrupt", 0, 0, 1, "forger", (entry,), (BucketEntry(16),))
    trainer.put(good, object_id("corrupt", "bucket", 0, 0, 0))
    trainer.put(np.frombuffer(manifest.encode(), np.uint8), object_id("corrupt", "manifest", 0, 0))
    trainer.put(np.frombuffer(b'["' + b"ab" * 16 + b'"]', np.uint8), object_id("corrupt", "digests", 0, 0))
    with pytest.raises(WeightSyncError, match="do not match their digest") as info:
        WeightSubscriber(engine, "corrupt").receive(version=0, timeout=30)
    assert (info.value.bucket, info.value.holder) == (0, "forger")


# ---------------------------------------------------------------- real processes, real kills
@pytest.fixture(scope="module")
def owner() -> Iterator[Any]:
    node = hg.init(lease_timeout=8.0)
    yield node
    node.close()


def _expected(seed: int) -> dict[str, str]:
    return {k: digest(v) for k, v in weights_state(LAYOUT, seed).items()}


@pytest.mark.multiprocess
def test_engines_receive_a_version_bit_exact_and_a_late_joiner_gets_it_after_the_trainer_died(
    owner: Any,
) -> None:
    trainer = start_workers(owner.directory_address, owner.token, 1)[0]
    engines = start_workers(owner.directory_address, owner.token, 4)
    late: list[Any] = []
    try:
        assert trainer.call("publish", "fleet", 1, LAYOUT, 10, {"bucket_bytes": 4 << 20}) >= 5
        for i, e in enumerate(engines):
            e.send("receive_weights", "fleet", None, 60, LAYOUT if i % 2 else None)
        assert [e.result() for e in engines] == [(1, _expected(10))] * 4
        trainer.kill()
        late = start_workers(owner.directory_address, owner.token, 1)
        assert late[0].call("receive_weights", "fleet", None, 60, None) == (1, _expected(10))
    finally:
        for w in [trainer, *engines, *late]:
            w.kill()


@pytest.mark.multiprocess
def test_an_engine_killed_mid_sync_leaves_the_others_to_finish(owner: Any) -> None:
    trainer = start_workers(owner.directory_address, owner.token, 1, send_rate_limit=48 << 20)[0]
    engines = start_workers(owner.directory_address, owner.token, 4, **SMALL_CHUNKS)
    try:
        bucket = object_id("kill", "bucket", 1, 0, 1).hex()
        engines[1].call("arm", f"receive:{bucket}:0.5:KILL")
        trainer.call("publish", "kill", 1, LAYOUT, 20, {"bucket_bytes": 4 << 20})
        for e in engines:
            e.send("receive_weights", "kill", 1, 90, None)
        engines[1].proc.join(60)
        assert not engines[1].proc.is_alive()
        assert [engines[i].result() for i in (0, 2, 3)] == [(1, _expected(20))] * 3
    finally:
        for w in [trainer, *engines]:
            w.kill()


@pytest.mark.multiprocess
def test_a_sync_whose_only_holder_dies_fails_typed(owner: Any) -> None:
    trainer = start_workers(owner.directory_address, owner.token, 1, send_rate_limit=48 << 20)[0]
    engines = start_workers(owner.directory_address, owner.token, 2, **SMALL_CHUNKS)
    try:
        trainer.call("arm", f"serve:{object_id('lost', 'bucket', 1, 0, 0).hex()}:0.5:KILL")
        trainer.call("publish", "lost", 1, LAYOUT, 30, {"bucket_bytes": 4 << 20})
        for e in engines:
            e.send("receive_weights", "lost", 1, 60, None)
        for e in engines:
            with pytest.raises(
                RuntimeError,
                match=r"WeightSyncError: bucket \d+ of rank 0 in version 1 of weights .lost. \(held by ",
            ) as info:
                e.result()
            assert "ObjectLostError" in str(info.value)
    finally:
        for w in [trainer, *engines]:
            w.kill()


# ---------------------------------------------------------------- the benchmark, bounded
@pytest.mark.multiprocess
def test_the_weight_sync_benchmark_runs_bounded_beside_gloo() -> None:
    """``bench/weight_sync.py`` on an emulated cluster of 3 hosts, 8 MiB, 2 rounds: every round
    checked by the members (a wrong tensor fails the run), both systems timed; then its faults
    scenario (an engine killed mid-sync, a late joiner) on 4 hosts."""
    from bench import weight_sync
    from bench.cluster import ClusterUnavailable, check

    try:
        check()
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))
    buckets = (2 << 20, 1 << 30)
    rows = [weight_sync.run(s, 2, 1e9, 8 << 20, 2, "hgwt", buckets) for s in ("hoplite_gpu", "gloo")]
    assert [(r["system"], r["engines"], len(r["rounds"])) for r in rows] == [
        ("hoplite_gpu", 2, 2),
        ("gloo", 2, 2),
    ]
    assert all(t > 0 for r in rows for t in r["rounds"])
    assert len(weight_sync.layout(512 << 20)) == 194  # about 200 tensors, as the issue asks
    faults = weight_sync.run_faults(2, 1e9, 8 << 20, "hgwt", 2 << 20)  # checks each survivor's tensors
    assert faults["killed_round_seconds"] > 0 and faults["late_joiner_seconds"] > 0
    # Two engines on one host, sharing its memory (its own /dev/shm): checked as every round is.
    shared = weight_sync.run("hoplite_gpu", 2, 1e9, 8 << 20, 2, "hgwt", buckets, per_host=2)
    assert shared["engines_per_host"] == 2 and len(shared["rounds"]) == 2
    assert not glob.glob("/dev/shm/hgwt-shm*")  # the hosts' shared memory is removed
