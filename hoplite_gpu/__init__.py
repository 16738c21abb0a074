"""hoplite_gpu: GPU-aware, fault-tolerant collective communication for task-based systems.

Quick use::

    import hoplite_gpu as hg
    node = hg.init()                       # embedded directory in this process
    oid = node.put(np.arange(10))
    other = hg.connect(node.directory_address, token=node.token)   # in another process
    arr = other.get(oid)
"""

from __future__ import annotations

import os
from typing import Any

from . import errors
from ._version import __version__
from .config import Config
from .errors import (
    AuthenticationError,
    CollectiveArgumentError,
    DeviceIpcError,
    DirectoryUnavailableError,
    HopliteError,
    HopliteTimeoutError,
    InvalidArgumentError,
    MemberLostError,
    NodeClosedError,
    NotDecodableError,
    ObjectDeletedError,
    ObjectExistsError,
    ObjectLostError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    PeerLostError,
    PinnedMemoryError,
    ProtocolError,
    QuotaExceededError,
    ReduceMismatchError,
    ReductionFailedError,
    StoreFullError,
    TransportError,
)
from .object_id import ObjectID

__all__ = [
    "AuthenticationError",
    "CollectiveArgumentError",
    "Config",
    "DeviceIpcError",
    "DirectoryUnavailableError",
    "HopliteError",
    "HopliteTimeoutError",
    "InvalidArgumentError",
    "MemberLostError",
    "Node",
    "NodeClosedError",
    "NotDecodableError",
    "ObjectDeletedError",
    "ObjectExistsError",
    "ObjectID",
    "ObjectLostError",
    "ObjectNotFoundError",
    "ObjectTooLargeError",
    "PeerLostError",
    "PinnedMemoryError",
    "ProtocolError",
    "QuotaExceededError",
    "ReduceMismatchError",
    "ReduceOp",
    "ReductionFailedError",
    "StoreFullError",
    "TransportError",
    "__version__",
    "collective",
    "connect",
    "errors",
    "init",
    "start_directory",
    "stop_directory",
]


def __getattr__(name: str) -> Any:
    # Node pulls in numpy/xxhash/ucxx machinery; import it lazily.
    if name == "Node":
        from .node import Node

        return Node
    if name == "collective":
        import importlib

        return importlib.import_module(".collective", __name__)
    if name == "ReduceOp":
        from .reduce_ops import ReduceOp

        return ReduceOp
    raise AttributeError(name)


def start_directory(
    token: str | None = None, host: str = "127.0.0.1", port: int = 0, config: Config | None = None
) -> Any:
    """Start a directory service on this process's I/O thread and return it.

    Its ``address`` and ``token`` are what nodes need. Stop it with ``stop_directory(service)``.

    Raises:
        AuthenticationError: ``token`` has fewer than :data:`~hoplite_gpu.auth.MIN_TOKEN_CHARS`
            characters (None makes one).
        InvalidArgumentError: ``port`` is not in 0..65535.
    """
    from .auth import check_token, new_token
    from .config import check_port
    from .directory.service import DirectoryService
    from .iothread import IOThread

    config = config or Config.from_env()
    token = check_token(token, "the token argument") if token else new_token()
    service = DirectoryService.from_config(token, host, check_port(port), config)
    IOThread.get().run(service.start(), timeout=config.connect_timeout)
    return service


def stop_directory(service: Any, timeout: float = 10.0) -> None:
    """Stop a directory service that :func:`start_directory` started (its nodes lose it)."""
    from .iothread import IOThread

    IOThread.get().run(service.stop(), timeout=timeout)


def init(
    directory: str | None = None, token: str | None = None, config: Config | None = None, **overrides: Any
) -> Any:
    """Create this process's node.

    Args:
        directory: ``host:port`` of an existing directory; None starts an embedded directory in this
            process (stopped when the node closes).
        token: Shared secret; None generates one for an embedded directory (``node.token``), or
            reads ``HOPLITE_TOKEN`` (or ``HOPLITE_TOKEN_FILE``) when joining an existing directory.
        config: Tunables (default: :meth:`Config.from_env`); ``overrides`` replace single fields.

    Returns:
        The :class:`~hoplite_gpu.node.Node`.
    """
    from .node import Node

    config = (
        (config or Config.from_env()).replace(**overrides) if overrides else (config or Config.from_env())
    )
    if directory is not None:
        return connect(directory, token=token, config=config)
    service = start_directory(token, host=config.directory_host, config=config)
    try:
        return Node(service.address, service.token, config, embedded=service)
    except BaseException:
        from .iothread import IOThread

        IOThread.get().run(service.stop(), timeout=10.0)
        raise


def connect(
    directory: str | None = None, token: str | None = None, config: Config | None = None, **overrides: Any
) -> Any:
    """Join an existing directory (default address ``HOPLITE_DIRECTORY``, token ``HOPLITE_TOKEN`` or
    the file ``HOPLITE_TOKEN_FILE`` names).

    Raises:
        DirectoryUnavailableError: no directory at that address.
        AuthenticationError: the directory refused the token.
    """
    from .auth import token_from_env
    from .node import Node

    directory = directory or os.environ.get("HOPLITE_DIRECTORY")
    token = token or token_from_env()
    if not directory:
        raise DirectoryUnavailableError(
            "no directory address: pass one or set HOPLITE_DIRECTORY", peer="", cause="missing"
        )
    if not token:
        raise AuthenticationError("no token: pass token= or set HOPLITE_TOKEN (or HOPLITE_TOKEN_FILE)")
    config = config or Config.from_env()
    if overrides:
        config = config.replace(**overrides)
    return Node(directory, token, config)
