"""Memory: where an object's bytes live and how the processes of one host share them.

The rest of the package asks one object, :class:`Memory` (one per node: allocate, publish for
same-host readers, open what another process published, release), and holds what it hands out:
:class:`Buffer` (an object's bytes and where they live), :class:`LocalObject` in the node's
:class:`LocalStore`, and :class:`CallerArray` (a caller's array, classified once where it enters).

Its parts, each a module:

- :mod:`.arrays`: caller arrays (NumPy, CuPy, torch, array interfaces, DLPack);
- :mod:`.buffers`: :class:`Buffer`, its kinds, and the pool of host buffers;
- :mod:`.store`: the node's local store of objects with progress counters;
- :mod:`.node_memory`: :class:`Memory`, the one object per node the rest of the package asks;
- :mod:`.backend`, :mod:`.device`, :mod:`.cuda`, :mod:`.sim`: device memory behind one interface
  (CUDA through CuPy, or host memory posing as a device for tests), and :mod:`.kernels`, the CUDA
  reduction kernels;
- :mod:`.shm`: POSIX shared-memory segments that same-host readers map, and :mod:`.shm_files`:
  their names, opening one safely, their creators' liveness and the sweep of orphans;
- :mod:`.tickets`, :mod:`.ipc`, :mod:`.device_pool`: device memory shared through CUDA IPC (the
  record that names it, the process's exports and mappings, the pool of exported allocations);
- :mod:`.placement`: this node's GPUs as NVML reports them, told to the directory.
"""

from __future__ import annotations

from .arrays import OUT_KINDS, ArrayKind, CallerArray, copy_into, flat_view, kind_of, to_host, torch_numpy
from .backend import DeviceEvent
from .buffers import Buffer, BufferKind, BufferPool, digest_of, through_file, write_at
from .device import device_result
from .node_memory import (
    THREAD_COPY_BYTES,
    Memory,
    device_in_use,
    host_key,
    shared_memory_available,
    sweep_orphans,
)
from .placement import node_place
from .shm import create as new_segment
from .shm import map_pages, map_whole, segment_name
from .shm_files import socket_path, unlink_quietly
from .store import MEMORY_DEVICE, MEMORY_HOST, LocalObject, LocalStore

__all__ = [
    "MEMORY_DEVICE",
    "MEMORY_HOST",
    "OUT_KINDS",
    "THREAD_COPY_BYTES",
    "ArrayKind",
    "Buffer",
    "BufferKind",
    "BufferPool",
    "CallerArray",
    "DeviceEvent",
    "LocalObject",
    "LocalStore",
    "Memory",
    "copy_into",
    "device_in_use",
    "device_result",
    "digest_of",
    "flat_view",
    "host_key",
    "kind_of",
    "map_pages",
    "map_whole",
    "new_segment",
    "node_place",
    "segment_name",
    "shared_memory_available",
    "socket_path",
    "sweep_orphans",
    "through_file",
    "to_host",
    "torch_numpy",
    "unlink_quietly",
    "write_at",
]
