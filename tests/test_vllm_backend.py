"""The vLLM weight-transfer backend "hoplite" through vLLM's own factories and plugin loader
(vLLM 0.33.0, installed by ``make test`` without its dependencies: only its weight-transfer API
runs here). Engines are real processes with real hoplite nodes, each building its engine the way
a vLLM worker does (``WeightTransferEngineFactory.create_engine`` after the plugins loaded); the
trainer drives them through a ``FleetClient`` of one pipe client per engine."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.distributed.weight_transfer")

import torch

import hoplite_gpu as hg
from hoplite_gpu.errors import HopliteError, InvalidArgumentError
from hoplite_gpu.weights.manifest import object_id

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

CALL_TIMEOUT = 120.0


class TinyModel(torch.nn.Module):
    """A model with vLLM's loading interface: ``load_weights`` of (name, tensor) pairs."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(512, 64)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
        self.head = torch.nn.Linear(64, 512, bias=False).to(torch.bfloat16)

    def load_weights(self, weights: Any) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)
                loaded.add(name)
        return loaded


def _state(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's bytes, hashed."""
    import xxhash

    return {
        name: xxhash.xxh3_64_hexdigest(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        for name, p in model.named_parameters()
    }


def _engine(conn: Any) -> None:
    """A vLLM worker's part: the plugins, then the engine from vLLM's factory, driven by commands."""
    import vllm.plugins
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    vllm.plugins.load_general_plugins()  # the entry point registers "hoplite", as in every vLLM process
    model = TinyModel(seed=99)
    config = SimpleNamespace(parallel_config=None, model_config=None)
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="hoplite"), config, torch.device("cpu"), model
    )
    weight_version = "default"  # what vLLM's engine core keeps (get_weight_version)
    conn.send(("ok", type(engine).__name__))
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "init_weight_transfer_engine":
                engine.init_transfer_engine(engine.parse_init_info(arg))
            elif cmd == "start_weight_update":
                engine.start_weight_update()
            elif cmd == "update_weights":
                engine.update_weights(arg)
            elif cmd == "finish_weight_update":
                engine.finish_weight_update()
                weight_version = arg if arg is not None else weight_version
            elif cmd == "state":
                conn.send(("ok", (_state(model), weight_version, engine.version)))
                continue
            elif cmd == "arm":
                from hoplite_gpu import faults

                faults.arm(arg)
            elif cmd == "stop":
                engine.shutdown()
                conn.send(("ok", None))
                return
            conn.send(("ok", None))
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class EngineClient:
    """vLLM's ``VLLMWeightSyncClient`` for one engine process (as its HTTP client is for a server)."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine, args=(child,), daemon=True)
        self.proc.start()

    def _call(self, cmd: str, arg: Any = None) -> Any:
        self.conn.send((cmd, arg))
        if not self.conn.poll(CALL_TIMEOUT):
            raise TimeoutError(f"engine {self.proc.pid} did not answer {cmd}")
        status, value = self.conn.recv()  # EOFError if the engine died
        if status == "error":
            raise RuntimeError(value)
        return value

    def ready(self) -> str:
        if not self.conn.poll(CALL_TIMEOUT):
            raise TimeoutError(f"engine {self.proc.pid} did not start")
        return str(self.conn.recv()[1])

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def state(self) -> tuple[dict[str, str], str, int | None]:
        state, version, number = self._call("state")
        return state, version, number

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def _engines(n: int) -> list[EngineClient]:
    engines = [EngineClient() for _ in range(n)]
    assert [e.ready() for e in engines] == ["HopliteWeightTransferEngine"] * n
    return engines


@pytest.fixture(scope="module")
def owner() -> Iterator[Any]:
    node = hg.init(lease_timeout=8.0)
    yield node
    node.close()


def _trainer(owner: Any, fleet: Any, model: torch.nn.Module, name: str) -> Any:
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from hoplite_gpu.weights.vllm import HopliteTrainerInitInfo

    info = HopliteTrainerInitInfo(
        rank=0,
        directory=owner.directory_address,
        token=owner.token,
        name=name,
        bucket_bytes=64 << 10,  # several buckets
        layerwise_reload=False,  # TinyModel has no vLLM layers to reload
        timeout=120.0,
    )
    return WeightTransferTrainerFactory.trainer_init(info, client=fleet, source=ModuleSource(model))


def test_the_plugin_registers_the_backend_in_a_fresh_vllm_process() -> None:
    code = (
        "import vllm.plugins\n"
        "from vllm.config import WeightTransferConfig\n"
        "from vllm.distributed.weight_transfer import WeightTransferEngineFactory as E, "
        "WeightTransferTrainerFactory as T\n"
        "vllm.plugins.load_general_plugins()\n"
        "WeightTransferConfig(backend='hoplite')\n"
        "print('hoplite' in E._registry, 'hoplite' in T._registry)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split()[-2:] == ["True", "True"]


def test_bad_infos_are_refused_as_vllm_expects() -> None:
    from hoplite_gpu.weights.vllm import HopliteWeightTransferInitInfo, HopliteWeightTransferUpdateInfo

    with pytest.raises(ValueError, match="host:port"):
        HopliteWeightTransferInitInfo(directory="nowhere")
    with pytest.raises(ValueError, match="bad version"):
        HopliteWeightTransferUpdateInfo(version=-1)
    with pytest.raises(TypeError):  # vLLM's parse_update_info turns this into its ValueError
        HopliteWeightTransferUpdateInfo(packed=True)  # type: ignore[call-arg]


@pytest.mark.parametrize("cap", [None, 1], ids=["all-at-once", "one-at-a-time"])
def test_engines_get_each_version_and_a_late_joiner_the_newest(owner: Any, cap: int | None) -> None:
    from hoplite_gpu.weights.vllm import FleetClient

    engines = _engines(3)
    late: list[EngineClient] = []
    trainer = None
    try:
        model = TinyModel(seed=1)
        fleet = FleetClient(engines, max_updating=cap)
        trainer = _trainer(owner, fleet, model, f"fleet-{cap}")
        trainer.send_weights()
        for e in engines:
            assert e.state() == (_state(model), "1", 1)
        late = _engines(1)
        fleet.add(late[0])  # it gets version 1 from whichever engines hold it
        assert late[0].state() == (_state(model), "1", 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        trainer.send_weights("step-2")
        for e in [*engines, *late]:
            assert e.state() == (_state(model), "step-2", 2)
        assert fleet.failed == []
    finally:
        if trainer is not None:
            trainer.shutdown()
        for e in [*engines, *late]:
            e.kill()


def test_an_engine_killed_mid_update_leaves_the_fleet_and_the_others_finish(owner: Any) -> None:
    from hoplite_gpu.weights.vllm import FleetClient

    engines = _engines(3)
    trainer = None
    try:
        model = TinyModel(seed=2)
        fleet = FleetClient(engines)
        trainer = _trainer(owner, fleet, model, "killed")
        engines[1]._call("arm", f"receive:{object_id('killed', 'bucket', 1, 0, 0).hex()}:0.5:KILL")
        trainer.send_weights()
        engines[1].proc.join(30)
        assert not engines[1].proc.is_alive()
        assert [e for e, _ in fleet.failed] == [engines[1]]
        for e in (engines[0], engines[2]):
            assert e.state() == (_state(model), "1", 1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(2)
        trainer.send_weights()  # the next round goes to the engines left
        for e in (engines[0], engines[2]):
            assert e.state() == (_state(model), "2", 2)
        for e in (engines[0], engines[2]):
            e.kill()
        with pytest.raises(HopliteError, match="every engine"):
            trainer.send_weights()
    finally:
        if trainer is not None:
            trainer.shutdown()
        for e in engines:
            e.kill()


class _Paced:
    """A fake engine client: records its calls; its update waits at ``barrier`` for the engines
    updating beside it, so that a fleet that lets fewer than the barrier's parties update at once
    breaks it (an error), and one that lets more is seen in ``counter``."""

    def __init__(self, counter: dict[str, int], lock: threading.Lock, barrier: threading.Barrier) -> None:
        self.calls: list[str] = []
        self._counter, self._lock, self._barrier = counter, lock, barrier

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, info: Any) -> None:
        self.calls.append(f"update {info['version']}")
        with self._lock:
            self._counter["now"] += 1
            self._counter["most"] = max(self._counter["most"], self._counter["now"])
        try:
            self._barrier.wait(timeout=30)
        finally:
            with self._lock:
                self._counter["now"] -= 1

    def finish_weight_update(self, version: str | None) -> None:
        self.calls.append(f"finish {version}")


def test_a_capped_fleet_updates_at_most_that_many_engines_at_once() -> None:
    from hoplite_gpu.weights.vllm import FleetClient

    counter, lock = {"now": 0, "most": 0}, threading.Lock()
    barrier = threading.Barrier(2)
    engines = [_Paced(counter, lock, barrier) for _ in range(6)]
    fleet = FleetClient(engines, max_updating=2)
    fleet.start_weight_update()
    fleet.update_weights({"version": 3})
    assert all(e.calls == [] for e in engines)  # recorded: each engine's turn comes at finish
    fleet.finish_weight_update("3")
    assert counter["most"] == 2 and fleet.failed == []
    assert all(e.calls == ["start", "update 3", "finish 3"] for e in engines)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="max_updating"):
            FleetClient(engines, max_updating=bad)  # type: ignore[arg-type]
