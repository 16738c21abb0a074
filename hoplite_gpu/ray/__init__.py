"""Ray integration: the directory in a named Ray actor, one node per Ray worker process, a
``ray.util.collective`` backend named ``"hoplite"`` and a Ray Direct Transport named ``"HOPLITE"``.

In the driver::

    import ray, hoplite_gpu.ray as hgray
    ray.init()
    hgray.start_directory()              # a named actor, "hoplite"; again: the same one

In any task or actor::

    node = hgray.node()                  # this process's node, connected on first use
    oid = node.put(array)                # ObjectIDs pass through task arguments and results

Collective groups: call :func:`register_collective_backend` in every process that creates a group
(or let Ray call it in every worker: ``ray.init(runtime_env={"worker_process_setup_hook":
"hoplite_gpu.ray.register_collective_backend"})``), then code written for Ray's gloo backend changes
one string::

    col.init_collective_group(world_size, rank, backend="hoplite", group_name="trainers")
    col.allreduce(tensor, group_name="trainers")

The backend works on NumPy arrays, CuPy arrays and torch tensors (CPU and CUDA), in place where
Ray's API is: the result is written into the caller's tensor. ``ray.util.collective``'s
``ReduceOp`` (SUM, PRODUCT, MIN, MAX) and :class:`hoplite_gpu.ReduceOp` (which adds AVG) are both
accepted. Ray is an optional dependency (``pip install hoplite_gpu[ray]``), imported on first use:
importing this package does not import Ray.

The package, one concept per module (each imports only :mod:`.common` and the modules above it):

- :mod:`.common`: names, timeouts and :func:`as_buffer`, shared by the others;
- :mod:`.directory`: the directory actor, :func:`start_directory` and :func:`node`;
- :mod:`.collective_group`: :class:`~.collective_group.HopliteGroup`, the backend's group class;
- :mod:`.tensor_transport`: the Ray Direct Transport (:func:`register_tensor_transport`).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from .common import (
    ACTOR_TIMEOUT,
    BACKEND,
    DEFAULT_NAME,
    DEFAULT_TIMEOUT,
    RayReadOnlyWriteWarning,
    as_buffer,
)
from .directory import directory_info, node, start_directory, stop_directory

__all__ = [
    "ACTOR_TIMEOUT",
    "BACKEND",
    "DEFAULT_NAME",
    "DEFAULT_TIMEOUT",
    "HopliteGroup",  # module __getattr__: its module imports Ray
    "RayReadOnlyWriteWarning",
    "as_buffer",
    "directory_info",
    "node",
    "register_collective_backend",
    "register_tensor_transport",
    "start_directory",
    "stop_directory",
]

_register_lock = threading.Lock()


def __getattr__(name: str) -> Any:
    if name == "HopliteGroup":  # imported on first use: its base class comes from Ray
        from .collective_group import HopliteGroup

        return HopliteGroup
    raise AttributeError(name)


def register_collective_backend() -> None:
    """Register the ``"hoplite"`` backend with ``ray.util.collective`` in this process (again: no-op).

    Every process that creates a group needs it (the driver and each actor), like any backend
    registered through Ray's registry (Ray >= 2.56). The torch.distributed backend ``"hoplite"``
    (Ray Train's ``TorchConfig(backend="hoplite")``) is registered too, here where torch is
    imported already, else as torch is imported (:mod:`hoplite_gpu.torch.plugin`). It also
    starts importing the node's modules (and UCX, where the node will run the UCX data plane) in
    the background, so that the process's first collective does not wait for them.
    """
    from ray.util.collective.backend_registry import _global_registry
    from ray.util.collective.backend_registry import register_collective_backend as register

    from .collective_group import HopliteGroup

    if not _global_registry.is_registered(BACKEND):
        register(BACKEND, HopliteGroup)
    if "torch" in sys.modules:  # (else torch registers it as it is imported: hoplite_gpu.torch.plugin)
        from ..torch.plugin import autoload

        autoload()
    _start_preload()


_preload_lock = threading.Lock()
_preloaded: threading.Thread | None = None


def _start_preload() -> None:
    """Import the node's modules, and UCX where ``Config.data_plane`` chooses the UCX plane (about
    0.5 s, most of it UCX's libraries), on a background thread, once per process. As Ray's setup
    hook this runs when a worker starts, so an actor's first ``node()`` no longer waits for them
    (with UCX it takes a twentieth of the time: bench/pages/small-operations.md, "A new actor's
    first node"). It starts nothing: no UCX context, no connection, no thread of UCX's."""
    global _preloaded
    with _preload_lock:
        if _preloaded is None:
            _preloaded = threading.Thread(target=_preload, name="hoplite-preload", daemon=True)
            _preloaded.start()


def _preload() -> None:
    try:
        from .. import node as _node  # noqa: F401
        from ..config import Config
        from ..dataplane.selection import data_plane_kind

        if data_plane_kind(Config.from_env()) == "ucx":
            from ..dataplane.ucx.loading import load_ucxx

            load_ucxx()
    except Exception:  # only a head start: the first node() reports whatever fails here
        pass


def register_tensor_transport(timeout: float | None = None) -> str:
    """Register hoplite_gpu as the Ray Direct Transport ``"HOPLITE"`` for CPU and CUDA torch
    tensors (again: no-op) and return its name; see :mod:`hoplite_gpu.ray.tensor_transport`.

    Call it in the driver before creating the actors that use it (Ray registers it on every actor
    created afterwards), after :func:`start_directory`; then ``@ray.method(tensor_transport="HOPLITE")``
    sends a method's tensors through hoplite: receivers pull them, many receivers of one tensor in a
    pipelined broadcast tree.

    Args:
        timeout: Seconds a receiver waits for an object's tensors before raising an error that
            names the object and its holder (None: Ray's RDT fetch timeout,
            ``RAY_rdt_fetch_fail_timeout_milliseconds``, 60 s by default).
    """
    from ray.experimental import register_tensor_transport as register
    from ray.experimental.rdt import util

    from . import tensor_transport as rdt

    if timeout is None:
        from ray._private import ray_constants

        timeout = float(ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS)
    rdt.set_timeout(timeout)
    with _register_lock:
        if rdt.TRANSPORT not in util.transport_manager_info:
            import torch

            register(rdt.TRANSPORT, rdt.DEVICES, rdt.HopliteTensorTransport, torch.Tensor)
    return rdt.TRANSPORT
