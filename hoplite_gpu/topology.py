"""How the GPUs of the cluster's nodes are connected: the types a node reports and pure rankings.

An :class:`Inventory` describes a node: its host, NVIDIA driver, and every GPU NVML sees (memory,
PCI bus, NUMA node, compute capability, PCIe link, NVLinks and what is at their other end); a value
that a GPU or driver does not report is ``None`` (or empty). :func:`hoplite_gpu.memory.placement.inventory`
reads it; this module only describes and compares, so the directory loads it alone.

:func:`link_between` and :func:`rank_sources` are pure: given the inventories of two nodes they
say how a buffer on one GPU reaches another, and order candidate sources by it, best first.
Inventories travel between processes as plain dicts (:meth:`Inventory.to_dict`); the receiving
side validates them with :meth:`Inventory.from_dict`, which rejects malformed input with
:class:`~hoplite_gpu.errors.InvalidArgumentError`.
"""

from __future__ import annotations

import enum
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidArgumentError

#: Bounds :meth:`Inventory.from_dict` enforces on data from other processes.
MAX_GPUS = 64
MAX_LINKS = 64
MAX_STR = 256
_MAX_INT = 2**63 - 1

#: Largest encoded inventory a node sends in its hello (which the directory reads before it has
#: authenticated the node, so it bounds it: ``protocol.MAX_HELLO_BYTES``).
MAX_PLACE_BYTES = 48 * 1024


class LinkKind(enum.IntEnum):
    """How bytes on one GPU reach another, in order of preference (smaller is better)."""

    SAME_GPU = 0
    NVLINK = 1
    SAME_NUMA = 2  #: same host, over PCIe, both GPUs on the same NUMA node
    SAME_HOST = 3  #: same host, across NUMA nodes or with a NUMA node unknown
    NETWORK = 4


@dataclass(frozen=True, slots=True)
class NvLink:
    """One NVLink of a GPU.

    Attributes:
        index: the link's number on its GPU.
        active: whether the link is up.
        remote_bus_id: PCI bus id of the device at the other end (``None`` if not reported).
        remote_kind: what that device is: ``"gpu"``, ``"switch"`` (an NVSwitch), ``"ibmnpu"``,
            or ``None`` if not reported.
        remote_uuid: the UUID of that device when it is a GPU of this node, else ``None``.
    """

    index: int
    active: bool
    remote_bus_id: str | None = None
    remote_kind: str | None = None
    remote_uuid: str | None = None


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One GPU as NVML sees it. Fields other than ``index``, ``uuid`` and ``name`` are ``None``
    when the GPU or driver does not report them; ``pci_bus_id`` is in sysfs form
    (``0000:3b:00.0``), as are NVLink remote bus ids."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int | None = None
    memory_free_bytes: int | None = None
    pci_bus_id: str | None = None
    numa_node: int | None = None
    compute_capability: tuple[int, int] | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    nvlinks: tuple[NvLink, ...] = ()


@dataclass(frozen=True, slots=True)
class Inventory:
    """The GPUs of one node.

    Attributes:
        host: the host name.
        host_key: :func:`hoplite_gpu.memory.shm.host_key` of the node; nodes with the same non-empty key
            are on the same host.
        driver_version: NVIDIA driver version ("" when unknown).
        cuda_driver_version: CUDA version the driver supports, e.g. ``"12.4"`` ("" when unknown).
        gpus: the GPUs, by NVML index.
        error: "" when NVML answered; otherwise why GPUs are missing (no library, no driver, a
            GPU that could not be read).
    """

    host: str
    host_key: str
    driver_version: str = ""
    cuda_driver_version: str = ""
    gpus: tuple[GpuInfo, ...] = ()
    error: str = ""

    def gpu(self, uuid: str) -> GpuInfo | None:
        """The GPU with this UUID, or ``None``."""
        return next((g for g in self.gpus if uuid and g.uuid == uuid), None)

    def for_routing(self) -> Inventory:
        """Only what :func:`link_between` reads: each GPU's UUID, index and NUMA node, and one
        active NVLink per GPU it reaches (plus one to an NVSwitch): a few hundred bytes per GPU,
        where the full inventory of a GPU with 18 NVLinks to switches takes kilobytes."""
        gpus = []
        for g in self.gpus:
            links: dict[tuple[str, str | None], NvLink] = {}
            for n in g.nvlinks:
                if n.active and (n.remote_uuid or n.remote_kind == "switch"):
                    key = ("switch", None) if n.remote_kind == "switch" else ("gpu", n.remote_uuid)
                    links.setdefault(
                        key, NvLink(len(links), True, remote_kind=n.remote_kind, remote_uuid=n.remote_uuid)
                    )
            gpus.append(GpuInfo(g.index, g.uuid, "", numa_node=g.numa_node, nvlinks=tuple(links.values())))
        return Inventory(self.host, self.host_key, gpus=tuple(gpus))

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (str, int, bool, None, list, dict): JSON and msgpack encode it."""
        gpus = []
        for g in self.gpus:
            d: dict[str, Any] = {k: getattr(g, k) for k in _GPU_FIELDS}
            d["compute_capability"] = list(g.compute_capability) if g.compute_capability else None
            d["nvlinks"] = [{k: getattr(n, k) for k in _LINK_FIELDS} for n in g.nvlinks]
            gpus.append(d)
        return {k: getattr(self, k) for k in _INV_FIELDS} | {"gpus": gpus}

    @classmethod
    def from_dict(cls, data: Any) -> Inventory:
        """Rebuild an inventory from :meth:`to_dict`'s output, checking every field (unknown
        keys are ignored, so a newer peer may send more).

        Raises:
            InvalidArgumentError: a field is missing, of the wrong type, negative, too long or
                too many.
        """
        d = _mapping(data, "inventory")
        gpus_raw = _seq(d.get("gpus"), "gpus", MAX_GPUS)
        gpus = tuple(_gpu_from(_mapping(g, f"gpus[{i}]"), f"gpus[{i}]") for i, g in enumerate(gpus_raw))
        if len({g.uuid for g in gpus}) != len(gpus):
            raise InvalidArgumentError("inventory lists a GPU UUID twice")
        fields = {k: _str(d.get(k), k) for k in _INV_FIELDS}
        return cls(gpus=gpus, **fields)


_INV_FIELDS = ("host", "host_key", "driver_version", "cuda_driver_version", "error")
_GPU_INTS = (
    *("memory_total_bytes", "memory_free_bytes", "numa_node"),
    *("pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max"),
)
_GPU_FIELDS = ("index", "uuid", "name", "pci_bus_id", *_GPU_INTS)
_LINK_FIELDS = ("index", "active", "remote_bus_id", "remote_kind", "remote_uuid")


def _bad(what: str, value: Any, expected: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"inventory field {what} is {reprlib.repr(value)}, expected {expected}")


def _mapping(v: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise _bad(what, v, "a dict")
    return v


def _seq(v: Any, what: str, cap: int) -> Sequence[Any]:
    if not isinstance(v, list | tuple) or len(v) > cap:
        raise _bad(what, v, f"a list of at most {cap} items")
    return v


def _str(v: Any, what: str, optional: bool = False) -> Any:
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > MAX_STR:
        raise _bad(what, v, f"a string of at most {MAX_STR} characters")
    return v


def _int(v: Any, what: str, optional: bool = False, hi: int = _MAX_INT) -> Any:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        raise _bad(what, v, f"an integer in [0, {hi}]")
    return v


def _gpu_from(d: Mapping[str, Any], at: str) -> GpuInfo:
    cc = d.get("compute_capability")
    if cc is not None:
        if not isinstance(cc, list | tuple) or len(cc) != 2:
            raise _bad(f"{at}.compute_capability", cc, "[major, minor]")
        cc = tuple(_int(x, f"{at}.compute_capability", hi=1000) for x in cc)
    links = []
    for i, raw in enumerate(_seq(d.get("nvlinks"), f"{at}.nvlinks", MAX_LINKS)):
        n, w = _mapping(raw, f"{at}.nvlinks[{i}]"), f"{at}.nvlinks[{i}]"
        if not isinstance(n.get("active"), bool):
            raise _bad(f"{w}.active", n.get("active"), "a bool")
        links.append(
            NvLink(
                index=_int(n.get("index"), f"{w}.index", hi=MAX_LINKS - 1),
                active=n["active"],
                **{k: _str(n.get(k), f"{w}.{k}", optional=True) for k in _LINK_FIELDS[2:]},
            )
        )
    return GpuInfo(
        index=_int(d.get("index"), f"{at}.index", hi=MAX_GPUS - 1),
        uuid=_str(d.get("uuid"), f"{at}.uuid"),
        name=_str(d.get("name"), f"{at}.name"),
        pci_bus_id=_str(d.get("pci_bus_id"), f"{at}.pci_bus_id", optional=True),
        compute_capability=cc,
        nvlinks=tuple(links),
        **{k: _int(d.get(k), f"{at}.{k}", optional=True) for k in _GPU_INTS},
    )


def link_between(inv_a: Inventory, uuid_a: str, inv_b: Inventory, uuid_b: str) -> LinkKind:
    """How a buffer on GPU ``uuid_a`` of node ``inv_a`` reaches GPU ``uuid_b`` of ``inv_b``.

    Nodes are on the same host when their ``host_key`` is equal and not empty. A UUID that is
    empty or unknown to its inventory (a host-memory buffer) gives ``SAME_HOST`` on one host.
    Two GPUs are on NVLink when an active link of one ends at the other, or when both have an
    active link to an NVSwitch.
    """
    if not inv_a.host_key or inv_a.host_key != inv_b.host_key:
        return LinkKind.NETWORK
    a, b = inv_a.gpu(uuid_a), inv_b.gpu(uuid_b)
    if a is None or b is None:
        return LinkKind.SAME_HOST
    if a.uuid == b.uuid:
        return LinkKind.SAME_GPU
    direct = any(n.active and n.remote_uuid == b.uuid for n in a.nvlinks) or any(
        n.active and n.remote_uuid == a.uuid for n in b.nvlinks
    )
    switched = all(any(n.active and n.remote_kind == "switch" for n in g.nvlinks) for g in (a, b))
    if direct or switched:
        return LinkKind.NVLINK
    if a.numa_node is not None and a.numa_node == b.numa_node:
        return LinkKind.SAME_NUMA
    return LinkKind.SAME_HOST


def rank_sources(reader: tuple[Inventory, str], candidates: Sequence[tuple[Inventory, str]]) -> list[int]:
    """Indices of ``candidates`` (each a node's inventory and a GPU UUID) ordered by
    :func:`link_between` to ``reader``, best first; equally good ones keep their order."""
    kinds = [link_between(inv, uuid, reader[0], reader[1]) for inv, uuid in candidates]
    return sorted(range(len(candidates)), key=kinds.__getitem__)


@dataclass(frozen=True, slots=True)
class GpuPlace:
    """Where a node's device objects live, as it tells the directory when it joins.

    Attributes:
        uuid: the UUID of the GPU that was the node's current CUDA device when it started ("" when
            it used no GPU then). A node that moves between GPUs is placed by this one.
        inventory: its host's :meth:`Inventory.to_dict` ({} with ``uuid`` "").
    """

    uuid: str = ""
    inventory: dict[str, Any] = field(default_factory=dict)
