"""The directory in a named Ray actor, and :func:`node`: this Ray worker process's node of it.

The actor hosts the directory service (see :func:`start_directory`) and hands out the generations
of ``ray.util.collective`` groups (:func:`group_generation`). Nodes find it by name, also after Ray
restarted it at a new address. Ray is imported on first use, not with this module.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..errors import DirectoryUnavailableError, InvalidArgumentError
from ..node import Node
from .common import ACTOR_TIMEOUT, DEFAULT_NAME


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
        from .. import start_directory as start

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
        from ..iothread import IOThread

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
    from ..auth import new_token

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
    # A non-detached actor lives while its creator's handle does: keep the first one, unless the
    # one kept is another actor's (of an earlier Ray session in this process, or one stopped).
    if _started.get((name, namespace)) != actor:
        _started[(name, namespace)] = actor
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
        own[1].close()
    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return
    with contextlib.suppress(Exception):
        ray.get(actor.stop.remote(), timeout=ACTOR_TIMEOUT)
    ray.kill(actor)
    _started.pop((name, namespace), None)


def group_generation(group_name: str, rank: int, world_size: int, name: str = DEFAULT_NAME) -> int:
    """The generation of collective group ``group_name`` that member ``rank`` joins, from the
    directory actor ``name`` (see ``_DirectoryActor.join_group``)."""
    ray = _ray()
    return int(
        ray.get(_actor(name, None).join_group.remote(group_name, rank, world_size), timeout=ACTOR_TIMEOUT)
    )


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
_nodes: dict[tuple[str, str | None], tuple[str, Node]] = {}  # (its Ray session, the node)


def _session() -> str:
    """The Ray session this process is in (its Ray node's id: new each time Ray starts)."""
    try:
        return str(_ray().get_runtime_context().get_node_id())
    except Exception:  # (not connected: no session)
        return ""


def node(name: str = DEFAULT_NAME, namespace: str | None = None, config: Config | None = None) -> Node:
    """This process's node of the directory actor ``name``, connected on first use (one per
    process and directory, reused by every later call; a closed one, or one of an earlier Ray
    session of this process, is replaced).

    Its data plane is advertised at the Ray node's IP address unless ``config`` (or
    ``HOPLITE_ADVERTISE_HOST``) says otherwise.

    Raises:
        DirectoryUnavailableError: no directory actor of that name.
    """
    key = (name, namespace)
    session = _session()
    with _nodes_lock:
        kept = _nodes.get(key)
        if kept is not None and not kept[1].closed:
            if kept[0] == session:
                return kept[1]
            kept[1].close()  # of a directory of an earlier Ray session in this process
        address, token = directory_info(name, namespace)
        if config is None:
            config = Config.from_env()
            if not config.advertise_host:
                config = config.replace(advertise_host=_node_ip())
        made = Node(address, token, config, resolve_directory=_resolver(name, namespace))
        _nodes[key] = (session, made)
        return made
