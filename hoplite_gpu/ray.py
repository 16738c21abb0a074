"""Ray integration: the directory in a named Ray actor, one node per Ray worker process, and a
``ray.util.collective`` backend named ``"hoplite"``.

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
accepted. Ray is an optional dependency (``pip install hoplite_gpu[ray]``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np

from . import collective, memory
from .config import Config
from .errors import DirectoryUnavailableError, HopliteError, InvalidArgumentError
from .node import Node
from .reduce_ops import ReduceOp, as_op

__all__ = [
    "BACKEND",
    "DEFAULT_NAME",
    "DEFAULT_TIMEOUT",
    "HopliteGroup",  # noqa: F822  (module __getattr__: built on first use)
    "as_buffer",
    "directory_info",
    "node",
    "register_collective_backend",
    "register_tensor_transport",
    "start_directory",
    "stop_directory",
]

#: Name of the directory actor (and of the default directory everywhere in this module).
DEFAULT_NAME = "hoplite"
#: Name of the ``ray.util.collective`` backend.
BACKEND = "HOPLITE"
#: Seconds a collective of a :class:`HopliteGroup` waits for the other members when the call's
#: options set no timeout.
DEFAULT_TIMEOUT = 300.0
#: Seconds to wait for the directory actor to start and answer.
ACTOR_TIMEOUT = 120.0


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - ray is installed with the test extra
        raise ImportError("hoplite_gpu.ray needs Ray: pip install 'hoplite_gpu[ray]'") from exc
    return ray


def _node_ip() -> str:
    ray = _ray()
    return str(ray.util.get_node_ip_address())


class _DirectoryActor:
    """The directory service, hosted by a Ray actor process (on its I/O thread, so actor calls and
    directory traffic do not wait for each other). Also hands out group generations."""

    def __init__(self, host: str | None, config: Config | None, token: str | None = None) -> None:
        from . import start_directory as start

        # The token comes from the driver, so that a restarted actor keeps it: nodes rejoin it
        # and keep talking to each other with the one they have.
        self._service = start(token=token, host=host or _node_ip(), config=config)
        self._groups: dict[str, tuple[int, int, set[int]]] = {}  # name -> generation, size, ranks

    def info(self) -> tuple[str, str]:
        return self._service.address, self._service.token

    def join_group(self, name: str, rank: int, world_size: int) -> int:
        """The generation of group ``name`` that member ``rank`` joins: the current one, unless
        this rank already joined it or the size differs (the group was destroyed and created
        again), in which case a new one starts. Member objects' names include it, so that a group
        created again under the same name does not find the previous one's objects."""
        current = self._groups.get(name)
        if current is None or rank in current[2] or current[1] != world_size:
            current = (0 if current is None else current[0] + 1, world_size, set())
            self._groups[name] = current
        current[2].add(rank)
        return current[0]

    def stop(self) -> None:
        from .iothread import IOThread

        IOThread.get().run(self._service.stop(), timeout=10.0)


_actor_lock = threading.Lock()
_actor_cls: Any = None


def _actor_class() -> Any:
    global _actor_cls
    with _actor_lock:
        if _actor_cls is None:
            _actor_cls = _ray().remote(num_cpus=0)(_DirectoryActor)
        return _actor_cls


def _actor(name: str, namespace: str | None) -> Any:
    ray = _ray()
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise DirectoryUnavailableError(
            f"no hoplite directory actor named {name!r}: call hoplite_gpu.ray.start_directory() "
            "in the driver first",
            peer=name,
            cause="missing",
        ) from None


def start_directory(
    name: str = DEFAULT_NAME,
    *,
    namespace: str | None = None,
    detached: bool = False,
    host: str | None = None,
    config: Config | None = None,
    actor_options: dict[str, Any] | None = None,
    max_restarts: int = -1,
) -> str:
    """Start the directory inside a named Ray actor and return its ``host:port``; if an actor of
    that name exists, return its address (the other arguments are then ignored).

    Args:
        name: The actor's name (nodes find the directory by it).
        namespace: Ray namespace of the actor (None: the job's).
        detached: Let the actor outlive the job that started it (stop it with
            :func:`stop_directory`); otherwise it ends with the driver.
        host: Address the directory binds to (None: the Ray node's IP address).
        config: Directory tunables (None: ``Config.from_env()`` in the actor).
        actor_options: More options of the actor (Ray's ``.options()``), for instance
            ``{"resources": {"head": 1}}`` to place it.
        max_restarts: How often Ray restarts the actor when it dies (-1: always, 0: never). A
            restarted directory listens at a new address with the same token; every node finds it
            through the actor, reconnects within ``Config.reconnect_timeout`` and restores its
            copies and reductions, as with a standalone directory restarted (transfers in
            progress go on meanwhile). Group generations (see ``ray.util.collective`` groups) start
            afresh: create groups again after a restart.
    """
    from .auth import new_token

    ray = _ray()
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < -1:
        raise InvalidArgumentError(
            f"max_restarts must be an int >= -1, got {max_restarts!r}", argument="max_restarts"
        )
    options: dict[str, Any] = {
        "max_restarts": max_restarts,
        "max_task_retries": -1 if max_restarts != 0 else 0,  # calls made while it restarts wait
        **(actor_options or {}),
        "name": name,
        "get_if_exists": True,
    }
    if namespace is not None:
        options["namespace"] = namespace
    if detached:
        options["lifetime"] = "detached"
    actor = _actor_class().options(**options).remote(host, config, new_token())
    address, _token = ray.get(actor.info.remote(), timeout=ACTOR_TIMEOUT)
    # A non-detached actor lives while its creator's handle does: keep the first one.
    _started.setdefault((name, namespace), actor)
    return str(address)


_started: dict[tuple[str, str | None], Any] = {}  # handles of the directory actors started here


def directory_info(
    name: str = DEFAULT_NAME, namespace: str | None = None, timeout: float = ACTOR_TIMEOUT
) -> tuple[str, str]:
    """``(address, token)`` of the directory actor ``name`` (waiting for it while Ray restarts it,
    up to ``timeout`` s).

    Raises:
        DirectoryUnavailableError: no such actor (``start_directory`` was not called), or it did
            not answer within ``timeout`` (it died for good, or is still restarting).
    """
    ray = _ray()
    try:
        address, token = ray.get(_actor(name, namespace).info.remote(), timeout=timeout)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
        raise DirectoryUnavailableError(
            f"the hoplite directory actor {name!r} did not answer within {timeout:.1f} s: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
            peer=name,
            cause="unreachable",
        ) from None
    return str(address), str(token)


def stop_directory(name: str = DEFAULT_NAME, namespace: str | None = None) -> None:
    """Stop the directory actor ``name`` (and close this process's node connected to it)."""
    ray = _ray()
    with _nodes_lock:
        own = _nodes.pop((name, namespace), None)
    if own is not None:
        own.close()
    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return
    with contextlib.suppress(Exception):
        ray.get(actor.stop.remote(), timeout=ACTOR_TIMEOUT)
    ray.kill(actor)
    _started.pop((name, namespace), None)


def _resolver(name: str, namespace: str | None) -> Callable[[float], str]:
    """Where the directory actor ``name`` is now (for a node reconnecting after it restarted)."""

    def resolve(seconds: float) -> str:
        if not _ray().is_initialized():  # shut down: do not let Ray start a new local instance
            raise DirectoryUnavailableError(
                f"Ray was shut down: the hoplite directory actor {name!r} is gone",
                peer=name,
                cause="shutdown",
            )
        return directory_info(name, namespace, timeout=seconds)[0]

    return resolve


_nodes_lock = threading.Lock()
_nodes: dict[tuple[str, str | None], Node] = {}


def node(name: str = DEFAULT_NAME, namespace: str | None = None, config: Config | None = None) -> Node:
    """This process's node of the directory actor ``name``, connected on first use (one per
    process and directory, reused by every later call; a closed one is replaced).

    Its data plane is advertised at the Ray node's IP address unless ``config`` (or
    ``HOPLITE_ADVERTISE_HOST``) says otherwise.

    Raises:
        DirectoryUnavailableError: no directory actor of that name.
    """
    key = (name, namespace)
    with _nodes_lock:
        existing = _nodes.get(key)
        if existing is not None and not existing.closed:
            return existing
        address, token = directory_info(name, namespace)
        if config is None:
            config = Config.from_env()
            if not config.advertise_host:
                config = config.replace(advertise_host=_node_ip())
        made = Node(address, token, config, resolve_directory=_resolver(name, namespace))
        _nodes[key] = made
        return made


# ----------------------------------------------------------------------------- tensors


def as_buffer(tensor: Any) -> tuple[Any, Callable[[], None] | None]:
    """A C-contiguous NumPy or CuPy array sharing memory with ``tensor`` where it can, and a
    function that copies it back into ``tensor`` (None when they share memory).

    Accepts NumPy and CuPy arrays and torch tensors (CPU: a NumPy view, bfloat16 through
    ``ml_dtypes``; CUDA: a CuPy view, bfloat16 as CuPy 14's ``ml_dtypes.bfloat16``).

    Raises:
        InvalidArgumentError: not an array, a read-only NumPy array, or a bfloat16 CUDA tensor
            with a CuPy that has no bfloat16 (before 14).
    """
    kind = memory.kind_of(tensor)
    if kind is memory.ArrayKind.TORCH:
        return _torch_buffer(tensor)
    module = kind.value
    if kind not in (memory.ArrayKind.NUMPY, memory.ArrayKind.CUPY):
        raise InvalidArgumentError(
            f"expected a NumPy or CuPy array or a torch tensor, got {type(tensor).__name__}",
            argument="tensor",
        )
    if tensor.flags["C_CONTIGUOUS"] and (module == "cupy" or tensor.flags["WRITEABLE"]):
        return tensor, None
    if module == "numpy" and not tensor.flags["WRITEABLE"]:
        raise InvalidArgumentError("the array is read-only", argument="tensor")
    xp = np if module == "numpy" else __import__("cupy")
    copy = xp.ascontiguousarray(tensor)

    def back() -> None:
        tensor[...] = copy

    return copy, back


def _torch_buffer(tensor: Any) -> tuple[Any, Callable[[], None] | None]:
    import torch

    t = tensor.detach()
    contiguous = t if t.is_contiguous() else t.contiguous()
    if contiguous.is_cuda:
        from .memory import cuda

        if contiguous.dtype == torch.bfloat16 and cuda.cupy_bfloat16() is None:
            raise InvalidArgumentError(
                "collectives on bfloat16 CUDA tensors need CuPy 14 or later (with ml_dtypes), "
                "whose kernels take bfloat16; this CuPy would reduce the bits as integers",
                argument="tensor",
            )
        array = cuda.cupy_view(contiguous)
    elif contiguous.dtype == torch.bfloat16:
        import ml_dtypes

        array = contiguous.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        array = contiguous.numpy()
    if contiguous is t:
        return array, None

    def back() -> None:
        t.copy_(contiguous)

    return array, back


def _op(op: Any) -> ReduceOp:
    name = getattr(op, "name", None)
    if type(op).__module__.startswith("ray.") and isinstance(name, str):
        return {"SUM": ReduceOp.SUM, "PRODUCT": ReduceOp.PROD, "MIN": ReduceOp.MIN, "MAX": ReduceOp.MAX}[name]
    return as_op(op)


def _seconds(options: Any) -> float | None:
    value = getattr(options, "timeout_ms", None)
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float):
        seconds = value / 1000.0
    else:
        return None
    return seconds if seconds >= 0 else None


def _single(tensors: Any, argument: str) -> Any:
    if isinstance(tensors, list | tuple):
        if len(tensors) != 1:
            raise InvalidArgumentError(
                f"{argument}: the hoplite backend takes one tensor per process, got {len(tensors)}",
                argument=argument,
            )
        return tensors[0]
    return tensors


# ----------------------------------------------------------------------------- the backend


def _base_group() -> type:
    from ray.util.collective.collective_group.base_collective_group import BaseGroup

    return BaseGroup  # type: ignore[no-any-return]


def _make_group_class() -> type:
    base = _base_group()

    class HopliteGroup(base):  # type: ignore[valid-type,misc]
        """A ``ray.util.collective`` group whose collectives run on hoplite_gpu (see
        :mod:`hoplite_gpu.collective`); created by ``init_collective_group(...,
        backend="hoplite")``. Its :attr:`group` is the underlying
        :class:`hoplite_gpu.collective.Group`."""

        def __init__(self, world_size: int, rank: int, group_name: str) -> None:
            super().__init__(world_size, rank, group_name)
            ray = _ray()
            generation = ray.get(
                _actor(DEFAULT_NAME, None).join_group.remote(group_name, rank, world_size),
                timeout=ACTOR_TIMEOUT,
            )
            self.group = collective.Group(
                node(), rank, world_size, f"ray/{group_name}/{generation}", timeout=DEFAULT_TIMEOUT
            )

        @classmethod
        def backend(cls) -> str:
            return BACKEND

        @classmethod
        def check_backend_availability(cls) -> bool:
            return True

        def destroy_group(self) -> None:
            """Wait for every member, then delete this member's objects (a member that is gone
            only makes the wait time out)."""
            try:
                self.group.destroy()
            except HopliteError:
                pass

        def _call(self, options: Any, fn: Callable[[], Any]) -> Any:
            seconds = _seconds(options)
            if seconds is None:
                return fn()
            saved = self.group.timeout
            self.group.timeout = seconds
            try:
                return fn()
            finally:
                self.group.timeout = saved

        def _inplace(self, tensors: Any, argument: str, options: Any, fn: Callable[[Any], Any]) -> None:
            buf, back = as_buffer(_single(tensors, argument))
            self._call(options, lambda: fn(buf))
            if back is not None:
                back()

        def allreduce(self, tensor: Any, allreduce_options: Any = None) -> None:
            """Reduce every member's tensor into it, in place (``allreduce_options.reduceOp``)."""
            op = _op(getattr(allreduce_options, "reduceOp", ReduceOp.SUM))
            self._inplace(
                tensor, "tensor", allreduce_options, lambda b: collective.allreduce(b, self.group, op)
            )

        def barrier(self, barrier_options: Any = None) -> None:
            """Return once every member has called ``barrier``."""
            self._call(barrier_options, lambda: collective.barrier(self.group))

        def reduce(self, tensor: Any, reduce_options: Any = None) -> None:
            """Reduce every member's tensor into ``reduce_options.root_rank``'s, in place."""
            op = _op(getattr(reduce_options, "reduceOp", ReduceOp.SUM))
            root = int(getattr(reduce_options, "root_rank", 0))
            self._inplace(
                tensor, "tensor", reduce_options, lambda b: collective.reduce(b, root, self.group, op)
            )

        def broadcast(self, tensor: Any, broadcast_options: Any = None) -> None:
            """Copy ``broadcast_options.root_rank``'s tensor into every member's, in place."""
            root = int(getattr(broadcast_options, "root_rank", 0))
            self._inplace(
                tensor, "tensor", broadcast_options, lambda b: collective.broadcast(b, root, self.group)
            )

        def allgather(self, tensor_list: Any, tensor: Any, allgather_options: Any = None) -> None:
            """Fill ``tensor_list[r]`` with member ``r``'s ``tensor`` on every member."""
            outs = _single(tensor_list, "tensor_list")
            bufs = [as_buffer(t) for t in outs]
            src, _ = as_buffer(_single(tensor, "tensor"))
            self._call(allgather_options, lambda: collective.allgather([b for b, _ in bufs], src, self.group))
            for _, back in bufs:
                if back is not None:
                    back()

        def reducescatter(self, tensor: Any, tensor_list: Any, reducescatter_options: Any = None) -> None:
            """Member ``r`` gets the reduction over members of their ``tensor_list[r]``, in ``tensor``."""
            op = _op(getattr(reducescatter_options, "reduceOp", ReduceOp.SUM))
            inputs = [as_buffer(t)[0] for t in _single(tensor_list, "tensor_list")]
            self._inplace(
                tensor,
                "tensor",
                reducescatter_options,
                lambda b: collective.reducescatter(b, inputs, self.group, op),
            )

        def send(self, tensor: Any, send_options: Any) -> None:
            """Send ``tensor`` to ``send_options.dst_rank``; returns once it has received it."""
            dst = int(send_options.dst_rank)
            buf, _ = as_buffer(_single(tensor, "tensor"))
            self._call(send_options, lambda: collective.send(buf, dst, self.group))

        def recv(self, tensor: Any, recv_options: Any) -> None:
            """Receive the next tensor ``recv_options.src_rank`` sends, into ``tensor``."""
            src = int(recv_options.src_rank)
            self._inplace(tensor, "tensor", recv_options, lambda b: collective.recv(b, src, self.group))

    HopliteGroup.__module__ = __name__
    HopliteGroup.__qualname__ = "HopliteGroup"
    return HopliteGroup


_group_cls: type | None = None


def __getattr__(name: str) -> Any:
    if name == "HopliteGroup":  # built on first use: its base class comes from Ray
        global _group_cls
        with _actor_lock:
            if _group_cls is None:
                _group_cls = _make_group_class()
        return _group_cls
    raise AttributeError(name)


def register_collective_backend() -> None:
    """Register the ``"hoplite"`` backend with ``ray.util.collective`` in this process (again: no-op).

    Every process that creates a group needs it (the driver and each actor), like any backend
    registered through Ray's registry (Ray >= 2.56).
    """
    from ray.util.collective.backend_registry import _global_registry
    from ray.util.collective.backend_registry import register_collective_backend as register

    if not _global_registry.is_registered(BACKEND):
        register(BACKEND, __getattr__("HopliteGroup"))


def register_tensor_transport(timeout: float | None = None) -> str:
    """Register hoplite_gpu as the Ray Direct Transport ``"HOPLITE"`` for CPU and CUDA torch
    tensors (again: no-op) and return its name; see :mod:`hoplite_gpu.rdt`.

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

    from . import rdt

    if timeout is None:
        from ray._private import ray_constants

        timeout = float(ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS)
    rdt.set_timeout(timeout)
    with _actor_lock:
        if rdt.TRANSPORT not in util.transport_manager_info:
            import torch

            register(rdt.TRANSPORT, rdt.DEVICES, rdt.HopliteTensorTransport, torch.Tensor)
    return rdt.TRANSPORT
