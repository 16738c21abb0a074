"""This node's GPUs as NVML reports them (:func:`inventory`) and where its device objects live
(:func:`node_place`), as it tells the directory when it joins. The types and the pure ranking are in
:mod:`hoplite_gpu.topology`, which the directory loads without this module.

:func:`inventory` never raises because a driver or a library is missing: the inventory then lists no
GPU and its ``error`` says why. GPU indices are NVML's, which ignore ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import msgpack

from ..errors import InvalidArgumentError
from ..topology import MAX_GPUS, MAX_LINKS, MAX_PLACE_BYTES, MAX_STR, GpuInfo, GpuPlace, Inventory, NvLink
from . import device, shm

#: Where Linux lists PCI devices (``<bus id>/numa_node``); a test may point it elsewhere.
SYSFS_PCI = "/sys/bus/pci/devices"

_T = TypeVar("_T")
_REMOTE_KINDS = {0: "gpu", 1: "ibmnpu", 2: "switch"}  # NVML_NVLINK_DEVICE_TYPE_*


def node_place() -> GpuPlace:
    """This process's :class:`GpuPlace`: empty unless it already works with CUDA device memory
    (:meth:`~hoplite_gpu.memory.backend.DeviceBackend.in_use`: no CUDA or NVML start-up for a process that
    never touches a GPU) and NVML lists its current device."""
    backend = device.default_backend()
    if not backend.in_use():
        return GpuPlace()
    uuid = backend.device_uuid(backend.current_device())
    inv = inventory().for_routing() if uuid else None
    if inv is None or inv.gpu(uuid) is None:
        return GpuPlace()
    place = GpuPlace(uuid, inv.to_dict())
    try:
        Inventory.from_dict(place.inventory)  # as the directory checks it: a refused hello would
    except InvalidArgumentError:  # keep the node out (NVML reporting a UUID twice, say)
        return GpuPlace()
    if len(msgpack.packb(place.inventory)) > MAX_PLACE_BYTES:
        return GpuPlace()  # more GPUs and links than a hello carries: no ranking, as without
    return place


def inventory() -> Inventory:
    """Describe this node's GPUs through NVML. Never raises for a missing library or driver: the
    inventory then has no GPU and ``error`` says why."""
    host, key = socket.gethostname(), shm.host_key()
    try:
        import pynvml
    except ImportError as exc:
        return Inventory(host, key, error=_why("pynvml (nvidia-ml-py) is not installed", exc))
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, OSError, ...
        return Inventory(host, key, error=_why("cannot initialise NVML (no NVIDIA driver here?)", exc))
    try:
        return _read(pynvml, host, key)
    except Exception as exc:  # e.g. nvmlDeviceGetCount failing: report rather than raise
        return Inventory(host, key, error=_why("NVML query failed", exc))
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _read(nv: Any, host: str, key: str) -> Inventory:
    def opt(fn: Callable[..., _T], *args: Any) -> _T | None:
        try:
            return fn(*args)
        except (nv.NVMLError, AttributeError, NotImplementedError):
            return None

    cuda, count = opt(nv.nvmlSystemGetCudaDriverVersion), int(nv.nvmlDeviceGetCount())
    gpus: list[GpuInfo] = []
    problems = [] if count else ["NVML lists no GPU"]
    for i in range(min(count, MAX_GPUS)):
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            uuid, name = _text(nv.nvmlDeviceGetUUID(h)), _text(nv.nvmlDeviceGetName(h))
        except nv.NVMLError as exc:
            problems.append(_why(f"GPU {i} skipped", exc))
            continue
        mem, pci = opt(nv.nvmlDeviceGetMemoryInfo, h), opt(nv.nvmlDeviceGetPciInfo, h)
        bus = bus_id(_text(pci.busId)) if pci is not None else None
        numa = opt(nv.nvmlDeviceGetNumaNodeId, h)
        if numa is None and bus:
            numa = _sysfs_numa(bus)
        cc = opt(nv.nvmlDeviceGetCudaComputeCapability, h)
        links = []
        for link in range(min(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)), MAX_LINKS)):
            state = opt(nv.nvmlDeviceGetNvLinkState, h, link)
            if state is None:
                continue
            remote = opt(nv.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
            kind = opt(nv.nvmlDeviceGetNvLinkRemoteDeviceType, h, link)
            links.append(
                NvLink(
                    index=link,
                    active=bool(state),
                    remote_bus_id=bus_id(_text(remote.busId)) if remote is not None else None,
                    remote_kind=_REMOTE_KINDS.get(kind) if kind is not None else None,
                )
            )
        gpus.append(
            GpuInfo(
                index=i,
                uuid=uuid,
                name=name,
                memory_total_bytes=int(mem.total) if mem is not None else None,
                memory_free_bytes=int(mem.free) if mem is not None else None,
                pci_bus_id=bus,
                numa_node=numa if numa is not None and numa >= 0 else None,
                compute_capability=(int(cc[0]), int(cc[1])) if cc is not None else None,
                pcie_gen=opt(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
                pcie_gen_max=opt(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
                pcie_width=opt(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
                pcie_width_max=opt(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
                nvlinks=tuple(links),
            )
        )
    by_bus = {g.pci_bus_id: g.uuid for g in gpus if g.pci_bus_id}
    gpus = [_resolve_peers(g, by_bus) for g in gpus]
    return Inventory(
        host,
        key,
        driver_version=_text(opt(nv.nvmlSystemGetDriverVersion) or ""),
        cuda_driver_version=f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else "",
        gpus=tuple(gpus),
        error="; ".join(problems)[:MAX_STR],
    )


def _resolve_peers(g: GpuInfo, by_bus: Mapping[str, str]) -> GpuInfo:
    links = tuple(replace(n, remote_uuid=by_bus.get(n.remote_bus_id or "")) for n in g.nvlinks)
    return replace(g, nvlinks=links)


def _text(v: Any) -> str:
    return (v.decode(errors="replace") if isinstance(v, bytes) else str(v))[:MAX_STR]


def _why(what: str, exc: BaseException) -> str:
    return f"{what}: {exc or type(exc).__name__}"[:MAX_STR]


def bus_id(nvml_bus_id: str) -> str:
    """A PCI bus id in sysfs form: NVML's ``00000000:3B:00.0`` becomes ``0000:3b:00.0``."""
    domain, sep, rest = nvml_bus_id.strip().partition(":")
    try:
        return f"{int(domain, 16):04x}:{rest.lower()}" if sep else nvml_bus_id.lower()
    except ValueError:
        return nvml_bus_id.lower()


def _sysfs_numa(bus: str) -> int | None:
    try:
        with open(f"{SYSFS_PCI}/{bus}/numa_node") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None
