"""Which copy of an object serves whom: pure functions over the directory's records.

A lookup is answered, in this order of preference, from a same-host copy in shared memory (the
GPU link between holder and reader ranks device copies), then from an idle complete copy, then
from the idle partial copy holding the most bytes whose upstream chain does not lead back to the
receiver (section 4.2 of the Hoplite paper). A reduction computes an input where its owner's
copy is, else at another complete copy, else where it is being produced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from .. import protocol as p
from ..topology import LinkKind, link_between
from .records import Location, LocationState, NodeInfo, ObjectEntry

Nodes = Mapping[str, NodeInfo]


def _on_host(nodes: Nodes, entry: ObjectEntry, receiver: str) -> Iterator[tuple[Location, NodeInfo]]:
    """Every location of ``entry`` on another node of ``receiver``'s host, with that node's record
    (none where the receiver's host is unknown): what the same-host choices below pick from."""
    key = nodes[receiver].host_key
    if not key:
        return
    for loc in entry.locations.values():
        info = nodes.get(loc.node_id)
        if loc.node_id != receiver and info is not None and info.host_key == key:
            yield loc, info


def same_host_copy(
    nodes: Nodes, entry: ObjectEntry, receiver: str, device_ipc: bool = False
) -> Location | None:
    """A complete copy in a shared-memory segment on ``receiver``'s host. A device copy's
    ticket (:mod:`hoplite_gpu.memory.ipc`) counts only for a ``device_ipc`` receiver, and the holders
    whose GPU reaches the receiver's best come first (the same GPU, then NVLink, then PCIe on
    its NUMA node: :func:`hoplite_gpu.topology.link_between`, from the GPUs nodes named when
    they joined). Then the owner's copy, and one still being copied into its segment (see
    :attr:`~.records.Location.copying`) only if no other."""
    reader = nodes[receiver]
    found = [
        loc
        for loc, info in _on_host(nodes, entry, receiver)
        if loc.state is LocationState.COMPLETE
        and loc.segment
        and (device_ipc or not loc.segment.startswith(p.IPC_SEGMENT_PREFIX))
        and info.suspect_since is None
    ]

    def rank(loc: Location) -> tuple[int, bool, bool]:
        holder = nodes[loc.node_id]
        link = LinkKind.SAME_HOST
        if loc.segment.startswith(p.IPC_SEGMENT_PREFIX) and holder.gpus and reader.gpus:
            link = link_between(holder.gpus, holder.gpu, reader.gpus, reader.gpu)
        return link, loc.copying, loc.node_id != entry.owner

    return min(found, key=rank, default=None)  # the first of equals: in the order copies came


def computed_on_host(nodes: Nodes, entry: ObjectEntry, receiver: str, device_ipc: bool) -> bool:
    """Whether a reduce vertex on ``receiver``'s host (not ``receiver``) computes ``entry``, and
    ``receiver`` is to copy it on the host once it is complete instead of pulling it through
    the loopback while it is computed. So it is for:

    - a reduction's result (the root's output): on one host the pull's copy competes with the
      reduction for the same cores (``bench/asgd.py --local`` summed four 100 MB gradients in
      0.58 s streamed, 0.30 s waiting and mapping). A vertex's host-memory output is still
      streamed to its parent vertex.
    - any vertex's output in device memory, for a receiver that opens device memory on this
      host (``device_ipc``): a pull stages it through host memory and the loopback at a few
      GB/s (``bench/gpu.py`` wire part: 2-3 GB/s on an H100), where the vertex computes it at
      the device's memory bandwidth and the reader then copies it device to device."""
    device = device_ipc and entry.memory == "device"
    if entry.object_id != entry.reduction and not device:
        return False
    for loc, info in _on_host(nodes, entry, receiver):
        if loc.producing:
            return info.suspect_since is None
    return False


def received_on_host(nodes: Nodes, entry: ObjectEntry, receiver: str, device_ipc: bool) -> bool:
    """Whether another node of ``receiver``'s host is receiving ``entry`` (a partial copy that a
    transfer feeds), so that ``receiver`` maps that copy once complete instead of pulling the
    object across the host's link a second time: any number of readers on a host cost its link
    one copy. Two engines per host, 256 MiB at 100 MB/s: 3.28x S/B when each pulled its own
    (bench/pages/weight-sync.md). Not for a device object that ``receiver`` cannot open."""
    if entry.memory == "device" and not device_ipc:
        return False
    return any(
        loc.state is LocationState.PARTIAL
        and loc.upstream is not None
        and not loc.producing
        and info.suspect_since is None
        for loc, info in _on_host(nodes, entry, receiver)
    )


def choose_sender(nodes: Nodes, entry: ObjectEntry, receiver: str, direct: bool = False) -> Location | None:
    """Idle complete copy first, else the idle partial copy with most bytes; never a cycle.
    ``direct``: the owner's copy (complete, or being computed there), busy or not, while its node
    is alive and not suspect; else as without."""
    owner = entry.locations.get(entry.owner) if direct else None
    if (
        owner is not None
        and owner.node_id != receiver
        and (owner.state is LocationState.COMPLETE or owner.producing)
    ):
        info = nodes.get(owner.node_id)
        if info is not None and info.suspect_since is None:
            return owner
    best: Location | None = None
    for loc in entry.locations.values():
        info = nodes.get(loc.node_id)
        if loc.busy or loc.node_id == receiver or info is None or info.suspect_since is not None:
            continue
        if loc.state is LocationState.PARTIAL and depends_on(entry, loc, receiver):
            continue
        if best is None or _rank(loc) > _rank(best):
            best = loc
    return best


def via_sender(
    nodes: Nodes,
    objects: Mapping[bytes, ObjectEntry],
    entry: ObjectEntry,
    receiver: str,
    via: bytes,
    asking: Callable[[str], bool],
) -> Location | bool:
    """Where a lookup ``via`` an object (see ``LookupRequest.via``) pulls from: the copy of
    ``entry`` on ``via``'s owner, partial or complete, busy or not (never a cycle); True to wait
    for that node to hold one (``via`` is not put yet, or its owner holds no copy yet, and no
    copy is complete or ``asking(owner)``: it waits for a source itself); False to choose as a
    lookup without ``via`` does (its owner is gone or suspect, or is the receiver, or another
    copy is complete and it is not asking). Members of a ring enter a collective at different
    times: one that asked before its predecessor put anything waits."""
    complete = any(
        other.state is LocationState.COMPLETE and other.node_id in nodes for other in entry.locations.values()
    )
    named = objects.get(via)
    if named is None:
        return not complete
    holder = nodes.get(named.owner)
    if holder is None or holder.node_id == receiver or holder.suspect_since is not None:
        return False
    loc = entry.locations.get(holder.node_id)
    if loc is not None:
        return False if depends_on(entry, loc, receiver) else loc
    return not complete or asking(holder.node_id)


def depends_on(entry: ObjectEntry, loc: Location, receiver: str) -> bool:
    """Whether ``loc``'s upstream chain passes through ``receiver``."""
    seen: set[str] = set()
    current: Location | None = loc
    while current is not None and current.upstream is not None:
        if current.upstream == receiver:
            return True
        if current.upstream in seen:
            return True  # defensive: a cycle already exists; do not extend it
        seen.add(current.upstream)
        current = entry.locations.get(current.upstream)
    return False


def upstream_cycle(entry: ObjectEntry, loc: Location) -> bool:
    """Whether ``loc``'s upstream chain comes back to a node it passed (a broken invariant)."""
    seen = {loc.node_id}
    current: Location | None = loc
    while current is not None and current.upstream is not None:
        if current.upstream in seen:
            return True
        seen.add(current.upstream)
        current = entry.locations.get(current.upstream)
    return False


def _rank(loc: Location) -> tuple[int, int]:
    return (1 if loc.state is LocationState.COMPLETE else 0, loc.progress)


def one_host(nodes: Nodes) -> bool:
    """Whether every node shares one host's shared memory (see
    :meth:`~.reduce.ReducePlan.place`)."""
    keys = {info.host_key for info in nodes.values()}
    return len(keys) == 1 and "" not in keys


def in_segment(entry: ObjectEntry, node_id: str) -> bool:
    """Whether ``node_id``'s copy of ``entry`` lives in a shared-memory segment (a put with
    ``copy=False`` keeps the caller's memory: readers on the host then pull it, and a star's
    root would pull every input through its one connection)."""
    loc = entry.locations.get(node_id)
    return loc is not None and bool(loc.segment)


def input_holder(nodes: Nodes, entry: ObjectEntry) -> str | None:
    """The node to compute at for a reduction's input: its owner, else another complete copy,
    else the node producing it (a reduction's result); "" for an inline object; None for none
    yet."""
    if entry.inline is not None:
        return ""
    usable = [
        loc
        for loc in entry.locations.values()
        if loc.node_id in nodes and (loc.state is LocationState.COMPLETE or loc.producing)
    ]
    usable.sort(
        key=lambda loc: (loc.state is LocationState.COMPLETE, loc.node_id == entry.owner), reverse=True
    )
    return usable[0].node_id if usable else None


def computes_at(nodes: Nodes, entry: ObjectEntry, node_id: str) -> bool:
    """Whether ``input_holder(nodes, entry) == node_id``, without sorting the copies in the common
    cases (a reduce over 10,000 inputs asks this of each)."""
    loc = entry.locations.get(node_id)
    if loc is None or entry.inline is not None or node_id not in nodes:
        return False
    if entry.owner == node_id and loc.state is LocationState.COMPLETE:
        return True  # a complete copy at the owner comes first
    return input_holder(nodes, entry) == node_id
