"""The node of a process using the torch.distributed backend, found through torch's own store.

One node per process serves every hoplite process group of it. Group rank 0 of each new group
publishes, in the c10d store torch hands the backend, the directory's address and token and a
fresh name for the group; the other members read them (``store.get`` waits, within the store's
timeout); once each has made its group it waits for the others (:func:`all_joined`). The
directory of the world group is the one ``HOPLITE_DIRECTORY`` (with ``HOPLITE_TOKEN``) names when
set; otherwise rank 0 starts one in its own process, listening on its interface that routes to
the store's host (loopback when the store is local), with a fresh token. The other processes then
cannot outlive it: their nodes do not try to reconnect (``reconnect_timeout=0``), and a lost
directory means rank 0 is gone.

At exit the process waits (up to :data:`EXIT_WAIT` seconds) until the other members of each of
its groups, destroyed or not, have finished their collectives with it (each group's
``destroy(wait=False)`` ends with a barrier), so that rank 0's directory, or a member's results
others still read, are not pulled from under them; a process ending on an uncaught exception
gives up on its groups at once instead, so the others fail with that exception's text rather than
waiting.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ipaddress
import logging
import os
import socket
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import hoplite_gpu as hg

from ..config import route_address
from ..errors import DirectoryUnavailableError, HopliteError

log = logging.getLogger("hoplite_gpu.torch")

#: Seconds a process waits at exit for its groups' other members (see the module's docstring).
EXIT_WAIT = 10.0
#: Keys of the store, under the prefix torch gives each group.
ADDRESS, TOKEN, NAME, HOST_RANK = "hoplite/directory", "hoplite/token", "hoplite/group", "hoplite/host"
JOINED, READY = "hoplite/joined", "hoplite/ready"


@dataclass(slots=True)
class Rendezvous:
    """What a member of a new group learnt: the node to use, the group's name (the same on every
    member), and the global rank of the process hosting the directory (-1: none of the job's)."""

    node: Any
    name: str
    host_rank: int


class _Process:
    """This process's node, and the groups to see off at exit."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.node: Any = None
        self.host_rank = -1  # global rank whose process hosts the node's directory; -1: none
        self.groups: list[Any] = []  # live ProcessGroupHoplite objects (for exit)
        # Clean-ups of groups destroyed (``dist.destroy_process_group``) still waiting for the
        # other members: the exit waits for them too.
        self.leaving: list[concurrent.futures.Future[None]] = []
        self.exit_hook = False


PROCESS = _Process()


def rendezvous(store: Any, group_rank: int, global_rank: int, timeout: float) -> Rendezvous:
    """Join the group whose store is ``store``: group rank 0 publishes, the others read."""
    with PROCESS.lock:
        if group_rank == 0:
            node = _leader_node(store, global_rank)
            name = f"torch/{uuid.uuid4().hex}"
            store.set(HOST_RANK, str(PROCESS.host_rank))
            store.set(TOKEN, node.token)
            store.set(NAME, name)
            store.set(ADDRESS, node.directory_address)  # last: the others wait for this key
            return Rendezvous(node, name, PROCESS.host_rank)
    address = _get(store, ADDRESS, timeout)
    token, name, host = (_get(store, key, timeout) for key in (TOKEN, NAME, HOST_RANK))
    with PROCESS.lock:
        return Rendezvous(_member_node(address, token, int(host)), name, int(host))


def all_joined(store: Any, size: int, timeout: float) -> None:
    """Return once every member of the group has called this (after making its group, so every
    member watches it): a group is made by all its members together, as Gloo's and NCCL's are,
    and no member uses the store afterwards (rank 0's process may host it)."""
    import datetime

    try:
        if int(store.add(JOINED, 1)) == size:
            store.set(READY, "1")
        store.wait([READY], datetime.timedelta(seconds=timeout))
    except Exception as exc:  # torch's store errors (a timeout, the store's host gone)
        raise DirectoryUnavailableError(
            f"not every member of the group joined within {timeout:.0f} s: {exc}", peer="", cause="rendezvous"
        ) from exc


def _get(store: Any, key: str, timeout: float) -> str:
    try:
        return bytes(store.get(key)).decode()
    except Exception as exc:  # torch raises DistStoreError (a RuntimeError) at the store's timeout
        raise DirectoryUnavailableError(
            f"group rank 0 did not publish the hoplite directory in the store ({key!r}) within "
            f"the store's timeout ({timeout:.0f} s): {exc}",
            peer="",
            cause="rendezvous",
        ) from exc


def _open(node: Any) -> bool:
    return node is not None and not node.closed


def _leader_node(store: Any, global_rank: int) -> Any:
    """The node of group rank 0: the process's own, else one joined to ``HOPLITE_DIRECTORY``,
    else one with a directory of its own."""
    if _open(PROCESS.node):
        return PROCESS.node
    if os.environ.get("HOPLITE_DIRECTORY"):
        return _keep(hg.connect(), -1)
    overrides: dict[str, Any] = {}
    host = _store_host(store)
    if not os.environ.get("HOPLITE_LISTEN_HOST") and host and not _loopback(host):
        overrides["listen_host"] = route_address(host)  # where the other hosts can reach it
    return _keep(hg.init(**overrides), global_rank)


def _member_node(address: str, token: str, host_rank: int) -> Any:
    """The node of another member: the process's own if it is joined to ``address``, else a
    new one (a directory in a rank's process does not come back: no reconnecting to it)."""
    node = PROCESS.node
    if _open(node) and node.directory_address == address:
        return node
    if _open(node) and not PROCESS.groups:
        node.close()  # joined to another job's directory, and no group of ours uses it
    elif _open(node):
        raise hg.InvalidArgumentError(
            f"this process's hoplite node is joined to the directory at {node.directory_address}, "
            f"still used by a process group; the new group's directory is at {address}",
            argument="store",
        )
    overrides: dict[str, Any] = {"reconnect_timeout": 0.0} if host_rank >= 0 else {}
    return _keep(hg.connect(address, token=token, **overrides), host_rank)


def _keep(node: Any, host_rank: int) -> Any:
    PROCESS.node, PROCESS.host_rank = node, host_rank
    if not PROCESS.exit_hook:  # registered after the node's own close: runs before it
        atexit.register(_at_exit)
        PROCESS.exit_hook = True
    return node


def _store_host(store: Any) -> str | None:
    """The host of the TCP store under ``store`` (through its prefixes), else ``MASTER_ADDR``."""
    for _ in range(16):
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    return os.environ.get("MASTER_ADDR") or None


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def register(pg: Any) -> None:
    with PROCESS.lock:
        PROCESS.groups.append(pg)


def unregister(pg: Any) -> None:
    with PROCESS.lock:
        if pg in PROCESS.groups:
            PROCESS.groups.remove(pg)


def left(waits: list[concurrent.futures.Future[None]]) -> None:
    """A group was destroyed on this member: the exit waits for ``waits``, its clean-up (others
    may still read this member's objects: a rank that destroyed its group and exited at once
    failed the others' collectives with its node gone; the soak found it)."""
    with PROCESS.lock:
        PROCESS.leaving = [f for f in PROCESS.leaving if not f.done()] + waits


def _at_exit() -> None:
    """See the module's docstring: wait for the others, or give up on an uncaught exception."""
    crashed = getattr(sys, "last_value", None)
    with PROCESS.lock:
        groups = list(PROCESS.groups)
        waits: list[concurrent.futures.Future[None]] = list(PROCESS.leaving)
    for pg in groups:
        try:
            if crashed is not None:
                pg.give_up(f"its process exited with {type(crashed).__name__}: {crashed}"[:900])
            waits += pg.leave()
        except HopliteError as exc:
            log.debug("leaving a process group at exit failed: %s", exc)
    if waits:
        concurrent.futures.wait(waits, timeout=EXIT_WAIT)
