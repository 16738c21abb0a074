"""Device memory behind one small seam: the only module that moves bytes in or out of GPU memory.

A device object's bytes are a flat ``uint8`` array of a :class:`DeviceBackend`. The rest of the
package never calls CuPy or torch to copy or reduce device bytes: it asks the backend of the array
(:func:`backend_for`) or, for memory it creates for a reader, :func:`default_backend`.

Two backends:

- :class:`CupyBackend`: CUDA memory through CuPy (CuPy arrays, CUDA torch tensors and any object
  exporting ``__cuda_array_interface__``, or DLPack on a CUDA device, go in; CuPy arrays come
  out). Copies are
  ``cudaMemcpy`` calls; reductions run the kernels of ``kernels/reduce.cu`` (:mod:`hoplite_gpu.gpu`).
- :class:`SimBackend`: host memory standing in for device memory (:class:`SimDeviceArray`, made
  with :func:`sim_array`). It takes every path a real device object takes (no host view in the
  store, staged sends, device results, device reductions) with NumPy doing the copies, so the
  device-object logic is tested on machines without a GPU. Processes use it as their default when
  ``HOPLITE_DEVICE_BACKEND=sim``.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from . import shm
from .errors import DeviceIpcError, HopliteError, InvalidArgumentError, PinnedMemoryError
from .reduce_ops import ReduceOp
from .reduce_ops import finish as host_finish
from .reduce_ops import reduce_into as host_reduce_into

log = logging.getLogger("hoplite_gpu")

#: Environment variable naming the default backend of a process (``cupy``, the default, or ``sim``).
BACKEND_ENV = "HOPLITE_DEVICE_BACKEND"
#: Largest device-to-host copy made into pinned memory (:meth:`CupyBackend.host_copy`).
PINNED_STAGING_BYTES = 64 << 20
#: ``cudaHostRegisterPortable``: memory registered with it is page-locked for every CUDA context.
CUDA_HOST_REGISTER_PORTABLE = 1


def _bfloat16() -> np.dtype[Any]:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


@functools.cache
def cupy_bfloat16() -> np.dtype[Any] | None:
    """``ml_dtypes.bfloat16`` where CuPy computes with it (CuPy 14 and later: cupy/cupy#9494), else
    None: older CuPy has no bfloat16, so bfloat16 data lives in uint16 CuPy arrays. Asked only
    where a GPU is in use (it runs one small kernel, once per process)."""
    try:
        import cupy

        dtype = _bfloat16()
        probe = cupy.zeros(2, dtype)
        probe += probe  # an elementwise kernel: older CuPy has no type for it
        cupy.cuda.Stream.null.synchronize()
    except Exception:  # no bfloat16 in this CuPy (TypeError, NotImplementedError, ...), or no GPU
        return None
    return dtype


class DeviceEvent:
    """A point in a device's queue of work (a CUDA stream), taken by :meth:`DeviceBackend.record`:
    :meth:`done` once everything queued on that stream before it has finished. This one is done
    from the start (work that ran as it was called)."""

    def done(self) -> bool:
        """Whether the work queued before this event has finished (does not wait)."""
        return True

    def wait(self) -> None:
        """Block until :meth:`done`. It lets go of the GIL, so it may run on a worker thread while
        the caller's event loop goes on."""
        return None


#: An event with nothing left to wait for.
DONE = DeviceEvent()


class DeviceBackend:
    """What the package needs of device memory. Arrays passed in are the backend's own flat
    ``uint8`` arrays unless a method says otherwise; copies are complete when a method returns."""

    name = "none"

    def available(self) -> bool:
        """Whether this process can create device memory with this backend."""
        raise NotImplementedError

    def in_use(self) -> bool:
        """Whether this process already works with this backend's device memory (and it is
        available): asked on every lookup, so it loads nothing new (no CUDA start-up for a
        process that never touches a GPU)."""
        return self.available()

    def owns(self, array: Any) -> bool:
        """Whether ``array`` (any caller's array) lives in this backend's device memory."""
        raise NotImplementedError

    def current_device(self) -> int:
        """The caller's current device ordinal."""
        raise NotImplementedError

    def device_of(self, array: Any) -> int:
        """The device ordinal ``array`` lives on."""
        raise NotImplementedError

    def describe(self, array: Any) -> tuple[np.dtype[Any], tuple[int, ...]]:
        """A caller's device array's dtype (as NumPy knows it) and shape."""
        raise NotImplementedError

    def device_uuid(self, device: int) -> str:
        """The UUID of device ordinal ``device`` as NVML writes it (``GPU-8-4-4-4-12`` hex digits),
        or "" when unknown (:mod:`hoplite_gpu.topology` matches it with NVML's inventory)."""
        return ""

    def flat_bytes(self, array: Any) -> Any:
        """The bytes of a caller's device array as a flat ``uint8`` array of this backend: a view
        when it is C-contiguous, else a contiguous copy."""
        raise NotImplementedError

    def empty(self, nbytes: int, device: int) -> Any:
        """New device memory of ``nbytes`` on ``device``."""
        raise NotImplementedError

    def empty_shared(self, nbytes: int, device: int) -> Any:
        """New device memory of ``nbytes`` on ``device`` that other processes on this host can open
        (:meth:`export`): its own allocation, never a sub-allocation of a memory pool. The store
        keeps objects in it, so same-host readers copy them device to device."""
        return self.empty(nbytes, device)

    def export(self, flat: Any) -> tuple[bytes, int] | None:
        """The inter-process handle of the allocation holding ``flat`` and ``flat``'s byte offset
        in it, or None when it cannot be shared (memory of :meth:`empty_shared` can)."""
        return None

    def references(self, flat: Any) -> tuple[int, ...]:
        """Reference counts that rise while anything else uses the memory of ``flat`` (an array of
        :meth:`empty_shared`): views of it, arrays sharing its memory. Compared only with the
        counts of an allocation nothing else uses (:class:`hoplite_gpu.ipc.DevicePool`). Here:
        ``flat``'s own (NumPy views refer to the array that owns their memory)."""
        return (sys.getrefcount(flat),)

    def open_export(self, handle: bytes, offset: int, nbytes: int, device: int) -> tuple[Any, Any]:
        """Open another process's :meth:`export`: a flat ``uint8`` array of the ``nbytes`` at
        ``offset`` of the allocation ``handle`` names, usable from ``device``, and a callable that
        closes it (call it once the array is no longer used).

        Raises:
            DeviceIpcError: the handle cannot be opened here (its process is gone, no peer access,
                another machine's handle).
        """
        raise DeviceIpcError(f"the {self.name} backend cannot open device memory of other processes")

    def copy(self, dst: Any, src: Any) -> None:
        """Device to device (the same or another device), ``dst.nbytes == src.nbytes``."""
        raise NotImplementedError

    def settle(self, device: int) -> None:
        """Wait for the work this thread queued on its current stream of ``device`` when the
        store's own copies are not ordered after it: before a ``put`` reads a caller's array, and
        before a ``get`` writes a caller's ``out``. Here: nothing to wait for."""
        return None

    def copy_async(self, dst: Any, src: Any) -> None:
        """:meth:`copy` queued on this thread's current stream of ``dst``'s device, without
        waiting for it to finish: it has finished once an event taken after it (:meth:`record`) is
        done. Both arrays must stay allocated until then. Here: :meth:`copy`."""
        self.copy(dst, src)

    def to_host(self, dst: np.ndarray[Any, Any], src: Any) -> None:
        """Device ``src`` into host ``dst`` (a C-contiguous NumPy array of the same size)."""
        raise NotImplementedError

    def from_host(self, dst: Any, src: np.ndarray[Any, Any]) -> None:
        """Host ``src`` into device ``dst``."""
        raise NotImplementedError

    def staging(self, nbytes: int) -> np.ndarray[Any, Any]:
        """A new flat ``uint8`` host buffer for staging ``nbytes`` on their way into or out of
        device memory (the data plane's chunks)."""
        return np.empty(nbytes, np.uint8)

    def host_copy(self, src: Any) -> np.ndarray[Any, Any]:
        """A new flat ``uint8`` host copy of device ``src``'s bytes (in :meth:`staging` memory)."""
        out = self.staging(int(src.nbytes))
        self.to_host(out, src)
        return out

    def typed(self, flat: Any, dtype: np.dtype[Any], shape: tuple[int, ...]) -> Any:
        """``flat`` viewed as ``dtype`` and ``shape`` (bfloat16 as uint16 where CuPy lacks it:
        :func:`cupy_bfloat16`)."""
        raise NotImplementedError

    def reduce_into(self, op: ReduceOp, acc: Any, other: Any, dtype: np.dtype[Any]) -> None:
        """``acc = acc (op) other`` on flat byte arrays holding ``dtype`` elements."""
        raise NotImplementedError

    def finish(self, op: ReduceOp, acc: Any, count: int, dtype: np.dtype[Any]) -> None:
        """The final step of ``op`` over ``count`` inputs (AVG divides)."""
        raise NotImplementedError

    def scale(self, acc: Any, weight: float, dtype: np.dtype[Any]) -> None:
        """``acc = weight * acc`` (float dtypes)."""
        raise NotImplementedError

    def axpy(self, acc: Any, other: Any, weight: float, dtype: np.dtype[Any]) -> None:
        """``acc = acc + weight * other`` (float dtypes)."""
        raise NotImplementedError

    def synchronize(self, device: int) -> None:
        """Wait until the work this thread queued on ``device`` is done (reduced chunks are
        published only after it)."""
        raise NotImplementedError

    def record(self, device: int) -> DeviceEvent:
        """An event after the work this thread has queued on ``device`` so far (on its current
        stream): a reduce vertex publishes a step's bytes once the step's event is done, and
        queues its next step meanwhile. Here: waits for that work (:meth:`synchronize`)."""
        self.synchronize(device)
        return DONE

    def register_host(self, array: np.ndarray[Any, Any]) -> Callable[[], None]:
        """Page-lock the host memory of flat ``array`` where it is, so copies between it and a
        device run at the link's full rate (``put(..., pinned=True)`` of a copy in a shared-memory
        segment, whose pages are its own), and return what undoes it (call it before the memory
        is freed or reused). Raises :class:`PinnedMemoryError` where it cannot be locked."""
        raise NotImplementedError

    def page_locked(self, nbytes: int) -> tuple[np.ndarray[Any, Any], Callable[[], None]]:
        """New page-locked host memory, flat ``uint8`` (``put(..., pinned=True)`` of a copy in
        private memory: registering that in place could share a page with other memory), and
        what to call once it is no longer used. Raises :class:`PinnedMemoryError`."""
        raise NotImplementedError


def _nothing() -> None:
    return None


# ---------------------------------------------------------------- CUDA through CuPy
def _torch_cuda_started() -> bool:
    """Whether torch is loaded and has initialised CUDA in this process (without loading it)."""
    torch = sys.modules.get("torch")
    try:
        return torch is not None and bool(torch.cuda.is_initialized())
    except Exception:  # a partly imported or unusual torch
        return False


#: DLPack device types of CUDA device memory (``kDLCUDA``, ``kDLCUDAManaged``).
DLPACK_CUDA_DEVICES = (2, 13)


def dlpack_on_cuda(array: Any) -> bool:
    """Whether ``array`` exports DLPack (``__dlpack__``) with its memory on a CUDA device, as
    its ``__dlpack_device__()`` says (asked without importing anything)."""
    probe = getattr(array, "__dlpack_device__", None)
    if probe is None or not hasattr(array, "__dlpack__"):
        return False
    try:
        return int(probe()[0]) in DLPACK_CUDA_DEVICES
    except Exception:  # a broken or unusual exporter: not taken for device memory
        return False


def cupy_view(array: Any) -> Any:
    """A CuPy array sharing memory with a caller's CUDA array: a CuPy array itself, a torch tensor
    through DLPack, any object exporting ``__cuda_array_interface__``, or one exporting only
    DLPack on a CUDA device (:func:`dlpack_on_cuda`). A bfloat16 tensor comes out as bfloat16
    where CuPy has it (:func:`cupy_bfloat16`), else as its bits (uint16)."""
    import cupy

    if type(array).__module__.split(".")[0] == "torch":
        import torch

        tensor = array.detach()
        if tensor.dtype != torch.bfloat16:
            return cupy.from_dlpack(tensor)
        return cupy.from_dlpack(tensor.view(torch.int16)).view(cupy_bfloat16() or np.uint16)
    if isinstance(array, cupy.ndarray):
        return array
    if hasattr(array, "__cuda_array_interface__"):
        return cupy.asarray(array)
    return cupy.from_dlpack(array)


class CupyBackend(DeviceBackend):
    """CUDA device memory through CuPy (imported on first use)."""

    name = "cupy"

    def __init__(self) -> None:
        # Handles this process has open, by (device, handle): [mapped address, users]. CUDA maps
        # one handle once per context, so concurrent readers of one object share the mapping.
        self._opened: dict[tuple[int, bytes], list[int]] = {}
        self._opened_lock = threading.Lock()
        self._in_use: bool | None = None
        self._available = False

    def available(self) -> bool:
        from . import gpu

        # Asked at every read of device memory; a device once seen stays (a process's CUDA
        # devices do not go away), so only a missing one is asked about again.
        if not self._available:
            self._available = gpu.available()
        return self._available

    def in_use(self) -> bool:
        if self._in_use is None and ("cupy" in sys.modules or _torch_cuda_started()):
            self._in_use = self.available()  # asked once CuPy (or torch's CUDA) is loaded: then kept
        return bool(self._in_use)

    def owns(self, array: Any) -> bool:
        module = type(array).__module__.split(".")[0]
        if module == "cupy":
            return True
        if module == "torch":
            return bool(getattr(array, "is_cuda", False))
        return hasattr(array, "__cuda_array_interface__") or dlpack_on_cuda(array)

    def current_device(self) -> int:
        import cupy

        return int(cupy.cuda.runtime.getDevice())

    def device_of(self, array: Any) -> int:
        return int(cupy_view(array).device.id)

    def device_uuid(self, device: int) -> str:
        import cupy

        try:
            raw = bytes(cupy.cuda.runtime.getDeviceProperties(device)["uuid"])
        except Exception:  # an old CuPy without the field, or no usable device
            return ""
        if len(raw) != 16:
            return ""
        h = raw.hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def describe(self, array: Any) -> tuple[np.dtype[Any], tuple[int, ...]]:
        if type(array).__module__.split(".")[0] == "torch":
            import torch

            if array.dtype == torch.bfloat16:
                return _bfloat16(), tuple(array.shape)
            return np.dtype(torch.empty((), dtype=array.dtype).numpy().dtype), tuple(array.shape)
        arr = cupy_view(array)
        return np.dtype(arr.dtype), tuple(arr.shape)

    def flat_bytes(self, array: Any) -> Any:
        import cupy

        arr = cupy_view(array)
        with cupy.cuda.Device(arr.device.id):
            if not arr.flags.c_contiguous:
                arr = cupy.ascontiguousarray(arr)
            return arr.reshape(-1).view(cupy.uint8)

    def empty(self, nbytes: int, device: int) -> Any:
        import cupy

        with cupy.cuda.Device(device):
            return cupy.empty(nbytes, cupy.uint8)

    def empty_shared(self, nbytes: int, device: int) -> Any:
        import cupy

        with cupy.cuda.Device(device):
            mem = cupy.cuda.memory.Memory(max(nbytes, 1))  # cudaMalloc, outside CuPy's pool
            return cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))

    def export(self, flat: Any) -> tuple[bytes, int] | None:
        import cupy

        mem = flat.data.mem
        if not isinstance(mem, cupy.cuda.memory.Memory) or not mem.ptr:
            return None  # pooled (a sub-allocation) or not CuPy's: only whole allocations are shared
        try:
            with cupy.cuda.Device(mem.device_id):
                handle = cupy.cuda.runtime.ipcGetMemHandle(mem.ptr)
        except cupy.cuda.runtime.CUDARuntimeError:
            return None
        return bytes(handle), int(flat.data.ptr - mem.ptr)

    def references(self, flat: Any) -> tuple[int, ...]:
        # A CuPy view holds the memory pointer (``view``) or a new pointer to the same Memory
        # (slicing), never the array it came from: all three counts.
        data = flat.data
        return (sys.getrefcount(flat), sys.getrefcount(data), sys.getrefcount(data.mem))

    def open_export(self, handle: bytes, offset: int, nbytes: int, device: int) -> tuple[Any, Any]:
        import cupy

        runtime = cupy.cuda.runtime
        key = (device, handle)
        with self._opened_lock, cupy.cuda.Device(device):
            entry = self._opened.get(key)
            if entry is None:
                try:
                    base = runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
                except runtime.CUDARuntimeError as exc:
                    raise DeviceIpcError(f"cannot open the CUDA IPC handle: {exc}") from None
                entry = self._opened[key] = [base, 0]
            entry[1] += 1
            mem = cupy.cuda.UnownedMemory(entry[0] + offset, max(nbytes, 1), None, device)
            array = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))

        def close() -> None:
            with self._opened_lock, cupy.cuda.Device(device):
                cupy.cuda.Stream.null.synchronize()  # copies out of it are done
                entry[1] -= 1
                if entry[1] == 0:
                    del self._opened[key]
                    runtime.ipcCloseMemHandle(entry[0])

        return array, close

    @staticmethod
    def _memcpy(dst_ptr: int, src_ptr: int, nbytes: int) -> None:
        import cupy

        if nbytes:  # cudaMemcpyDefault: unified addressing works out the direction and devices
            cupy.cuda.runtime.memcpy(dst_ptr, src_ptr, nbytes, cupy.cuda.runtime.memcpyDefault)
            # A device-to-device cudaMemcpy may return before it is done: complete it, so the
            # caller may reuse or free either side (and a closed IPC mapping is not read later).
            cupy.cuda.Stream.null.synchronize()

    def copy(self, dst: Any, src: Any) -> None:
        _same_size(dst, src)
        self._memcpy(dst.data.ptr, src.data.ptr, dst.nbytes)

    def settle(self, device: int) -> None:
        import cupy

        with cupy.cuda.Device(device):
            stream = cupy.cuda.get_current_stream()
        # The store copies on the legacy default stream (ptr 0), which waits for the work of
        # blocking streams before it runs; a non-blocking stream, or the per-thread default
        # stream, the caller computed an array on is not waited for that way.
        if stream.ptr:
            stream.synchronize()

    def copy_async(self, dst: Any, src: Any) -> None:
        import cupy

        _same_size(dst, src)
        if dst.nbytes:  # cudaMemcpyDefault: unified addressing works out the devices
            runtime = cupy.cuda.runtime
            with _on(dst):
                stream = cupy.cuda.get_current_stream().ptr
                runtime.memcpyAsync(dst.data.ptr, src.data.ptr, dst.nbytes, runtime.memcpyDefault, stream)

    def to_host(self, dst: np.ndarray[Any, Any], src: Any) -> None:
        _same_size(dst, src)
        _host_contiguous(dst)
        self._memcpy(dst.ctypes.data, src.data.ptr, dst.nbytes)

    def staging(self, nbytes: int) -> np.ndarray[Any, Any]:
        """Pinned memory from CuPy's pinned pool for chunk-sized buffers (copies between host and
        device run at the link's full rate only from and into page-locked memory, and the pool
        hands the same buffers out again once a chunk is done with); ordinary memory beyond
        :data:`PINNED_STAGING_BYTES` (page-locking gigabytes costs more than it saves)."""
        import cupy

        if not 0 < nbytes <= PINNED_STAGING_BYTES:
            return super().staging(nbytes)
        return np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)

    def from_host(self, dst: Any, src: np.ndarray[Any, Any]) -> None:
        _same_size(dst, src)
        _host_contiguous(src)
        self._memcpy(dst.data.ptr, src.ctypes.data, dst.nbytes)

    def typed(self, flat: Any, dtype: np.dtype[Any], shape: tuple[int, ...]) -> Any:
        if dtype.name == "bfloat16":
            return flat.view(cupy_bfloat16() or np.uint16).reshape(shape)
        return flat.view(dtype).reshape(shape)

    @staticmethod
    def _storage(flat: Any, dtype: np.dtype[Any]) -> Any:
        """``flat`` as the kernels' operand for ``dtype`` elements (bfloat16 as its uint16 bits: the
        kernels are named by the dtype, whatever CuPy makes of the array's own)."""
        return flat.view(np.uint16 if dtype.name == "bfloat16" else dtype)

    def reduce_into(self, op: ReduceOp, acc: Any, other: Any, dtype: np.dtype[Any]) -> None:
        from . import gpu

        with _on(acc):
            gpu.reduce_into(op, self._storage(acc, dtype), self._storage(other, dtype), dtype.name)

    def finish(self, op: ReduceOp, acc: Any, count: int, dtype: np.dtype[Any]) -> None:
        from . import gpu

        with _on(acc):
            gpu.finish(op, self._storage(acc, dtype), count, dtype.name)

    def scale(self, acc: Any, weight: float, dtype: np.dtype[Any]) -> None:
        from . import gpu

        with _on(acc):
            gpu.scale(self._storage(acc, dtype), weight, dtype.name)

    def axpy(self, acc: Any, other: Any, weight: float, dtype: np.dtype[Any]) -> None:
        from . import gpu

        with _on(acc):
            gpu.axpy(self._storage(acc, dtype), self._storage(other, dtype), weight, dtype.name)

    def synchronize(self, device: int) -> None:
        import cupy

        with cupy.cuda.Device(device):
            cupy.cuda.get_current_stream().synchronize()

    def record(self, device: int) -> DeviceEvent:
        import cupy

        with cupy.cuda.Device(device):
            # Blocking: a thread waiting for it sleeps instead of spinning on the CPU.
            event = cupy.cuda.Event(block=True, disable_timing=True)
            event.record()  # on the device's current stream, where this thread queued its work
        return _CupyEvent(event)

    def register_host(self, array: np.ndarray[Any, Any]) -> Callable[[], None]:
        import cupy

        runtime = cupy.cuda.runtime
        ptr, nbytes = int(array.ctypes.data), int(array.nbytes)
        if not nbytes:
            return _nothing
        try:  # portable: page-locked for every device's context, not only the current one's
            runtime.hostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE)
        except runtime.CUDARuntimeError as exc:
            raise PinnedMemoryError(f"cannot page-lock {nbytes} bytes of host memory: {exc}") from None

        def unregister() -> None:
            try:
                runtime.hostUnregister(ptr)
            except runtime.CUDARuntimeError as exc:  # nothing more to do than say so
                log.warning("unregistering page-locked host memory failed: %s", exc)

        return unregister

    def page_locked(self, nbytes: int) -> tuple[np.ndarray[Any, Any], Callable[[], None]]:
        import cupy

        try:  # CuPy's pinned pool, which gets the memory back once the array is gone
            mem = cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
        except (cupy.cuda.runtime.CUDARuntimeError, MemoryError) as exc:
            raise PinnedMemoryError(f"cannot allocate {nbytes} bytes of page-locked memory: {exc}") from None
        return np.frombuffer(mem, np.uint8, nbytes), _nothing


class _CupyEvent(DeviceEvent):
    """A CUDA event (``cupy.cuda.Event``) recorded on a stream."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.done)  # cudaEventQuery

    def wait(self) -> None:
        self._event.synchronize()  # cudaEventSynchronize, without the GIL


def _on(array: Any) -> Any:
    import cupy

    return cupy.cuda.Device(array.device.id)


def _same_size(dst: Any, src: Any) -> None:
    if int(dst.nbytes) != int(src.nbytes):
        raise InvalidArgumentError(f"copy of {src.nbytes} bytes into {dst.nbytes}", argument="dst")


def _host_contiguous(arr: np.ndarray[Any, Any]) -> None:
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError("host side of a device copy must be C-contiguous", argument="host")


# ---------------------------------------------------------------- host memory posing as a device
class SimDeviceArray(np.ndarray):  # type: ignore[type-arg]
    """Host memory that the package treats as device memory of :class:`SimBackend` (device
    ordinal ``device_id``). Views and slices stay simulated device arrays."""

    device_id: int = 0

    def __array_finalize__(self, obj: Any) -> None:
        self.device_id = getattr(obj, "device_id", 0)


def sim_array(array: Any, device: int = 0) -> SimDeviceArray:
    """A copy of ``array`` in simulated device memory on ``device`` (for tests without a GPU)."""
    out = np.array(array, copy=True, order="C").view(SimDeviceArray)
    out.device_id = device
    return out


def _plain(array: Any) -> np.ndarray[Any, Any]:
    return array.view(np.ndarray)  # type: ignore[no-any-return]


class SimBackend(DeviceBackend):
    """Simulated device memory: :class:`SimDeviceArray` (host memory), NumPy for the work.
    ``registered``: the host ranges (address, bytes) page-locked now (:meth:`register_host`
    only records them)."""

    name = "sim"

    def __init__(self) -> None:
        self.registered: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        #: Events :meth:`record` has handed out.
        self.events_recorded = 0
        #: While a :class:`threading.Event` that is not set, the events :meth:`record` hands out
        #: stay pending until it is (tests: work queued on a device that has not finished yet).
        self.hold_events: threading.Event | None = None

    def available(self) -> bool:
        return True

    def owns(self, array: Any) -> bool:
        return isinstance(array, SimDeviceArray)

    def current_device(self) -> int:
        return int(os.environ.get("HOPLITE_SIM_DEVICE", "0"))

    def device_of(self, array: Any) -> int:
        return int(array.device_id)

    def describe(self, array: Any) -> tuple[np.dtype[Any], tuple[int, ...]]:
        return np.dtype(array.dtype), tuple(array.shape)

    def flat_bytes(self, array: Any) -> Any:
        arr = array if array.flags.c_contiguous else array.copy(order="C")
        return arr.reshape(-1).view(np.uint8)

    def empty(self, nbytes: int, device: int) -> Any:
        out = np.empty(nbytes, np.uint8).view(SimDeviceArray)
        out.device_id = device
        return out

    def empty_shared(self, nbytes: int, device: int) -> Any:
        payload = shm.create(nbytes)  # a file under /dev/shm stands in for a CUDA allocation
        if payload is None:
            return self.empty(nbytes, device)
        out = payload.view(SimDeviceArray)
        out.device_id = device
        return out

    def export(self, flat: Any) -> tuple[bytes, int] | None:
        base: Any = flat
        while isinstance(base, np.ndarray):
            base = base.base
        if not isinstance(base, shm.Segment):
            return None
        start = np.frombuffer(base, np.uint8).ctypes.data + shm.HEADER_BYTES
        return base.name.encode(), int(flat.ctypes.data - start)

    def open_export(self, handle: bytes, offset: int, nbytes: int, device: int) -> tuple[Any, Any]:
        try:
            name = handle.decode()
        except UnicodeDecodeError:
            name = ""
        payload = shm.map_payload(name, offset, nbytes)
        if payload is None:
            raise DeviceIpcError(f"simulated device memory {name!r} cannot be opened")
        array = payload.view(SimDeviceArray)
        array.device_id = device
        return array, lambda: None  # unmapped once the array is dropped

    def copy(self, dst: Any, src: Any) -> None:
        _same_size(dst, src)
        np.copyto(_plain(dst), _plain(src))

    def to_host(self, dst: np.ndarray[Any, Any], src: Any) -> None:
        _same_size(dst, src)
        np.copyto(dst, _plain(src))

    def from_host(self, dst: Any, src: np.ndarray[Any, Any]) -> None:
        _same_size(dst, src)
        np.copyto(_plain(dst), src)

    def typed(self, flat: Any, dtype: np.dtype[Any], shape: tuple[int, ...]) -> Any:
        return flat.view(dtype).reshape(shape)

    def reduce_into(self, op: ReduceOp, acc: Any, other: Any, dtype: np.dtype[Any]) -> None:
        host_reduce_into(op, _plain(acc).view(dtype), _plain(other).view(dtype))

    def finish(self, op: ReduceOp, acc: Any, count: int, dtype: np.dtype[Any]) -> None:
        host_finish(op, _plain(acc).view(dtype), count)

    def scale(self, acc: Any, weight: float, dtype: np.dtype[Any]) -> None:
        typed = _plain(acc).view(dtype)
        np.multiply(typed, typed.dtype.type(weight), out=typed)

    def axpy(self, acc: Any, other: Any, weight: float, dtype: np.dtype[Any]) -> None:
        typed = _plain(acc).view(dtype)
        np.add(typed, _plain(other).view(dtype) * typed.dtype.type(weight), out=typed)

    def synchronize(self, device: int) -> None:
        return None

    def record(self, device: int) -> DeviceEvent:
        """Done at once (NumPy did the work as it was called), or held by :attr:`hold_events`."""
        with self._lock:
            self.events_recorded += 1
        gate = self.hold_events
        return DONE if gate is None else _HeldEvent(gate)

    def register_host(self, array: np.ndarray[Any, Any]) -> Callable[[], None]:
        """Records the range as registered (:attr:`registered`), refusing overlaps as CUDA does."""
        ptr, nbytes = int(array.ctypes.data), int(array.nbytes)
        with self._lock:
            if any(ptr < p + n and p < ptr + nbytes for p, n in self.registered):
                raise PinnedMemoryError(f"{nbytes} bytes at {ptr:#x} are page-locked already")
            self.registered.add((ptr, nbytes))

        def unregister() -> None:
            with self._lock:
                self.registered.discard((ptr, nbytes))

        return unregister

    def page_locked(self, nbytes: int) -> tuple[np.ndarray[Any, Any], Callable[[], None]]:
        """Ordinary memory, recorded in :attr:`registered` until the returned call."""
        out = np.empty(nbytes, np.uint8)
        return out, self.register_host(out)


class _HeldEvent(DeviceEvent):
    """An event of :class:`SimBackend` that is done once ``gate`` is set."""

    #: Seconds :meth:`wait` waits for the gate before it gives up.
    LIMIT = 120.0

    def __init__(self, gate: threading.Event) -> None:
        self._gate = gate

    def done(self) -> bool:
        return self._gate.is_set()

    def wait(self) -> None:
        if not self._gate.wait(self.LIMIT):
            raise HopliteError(f"a held simulated device event was not let go within {self.LIMIT:.0f} s")


# ---------------------------------------------------------------- choosing one
_BACKENDS: dict[str, DeviceBackend] = {"cupy": CupyBackend(), "sim": SimBackend()}


def backend_for(array: Any) -> DeviceBackend | None:
    """The backend whose device memory ``array`` is in (None: host memory)."""
    if isinstance(array, np.ndarray):
        return _BACKENDS["sim"] if isinstance(array, SimDeviceArray) else None
    cupy_backend = _BACKENDS["cupy"]
    return cupy_backend if cupy_backend.owns(array) else None


@functools.cache
def default_backend() -> DeviceBackend:
    """The backend this process creates device memory with (``HOPLITE_DEVICE_BACKEND``)."""
    name = os.environ.get(BACKEND_ENV, "cupy") or "cupy"
    if name not in _BACKENDS:
        raise HopliteError(f"{BACKEND_ENV}={name!r}: use one of {sorted(_BACKENDS)}")
    return _BACKENDS[name]


def device_result(flat: Any, dtype: np.dtype[Any], shape: tuple[int, ...]) -> Any:
    """A reader's copy of a device object: new memory on the caller's current device of the
    default backend, filled from ``flat`` (host bytes, or device bytes of any backend), typed.
    None when this process has no usable device (the caller then keeps host memory)."""
    backend = default_backend()
    if not backend.available():
        return None
    out = backend.empty(int(flat.nbytes), backend.current_device())
    source = backend_for(flat)
    if source is None:
        backend.from_host(out, np.ascontiguousarray(flat))
    elif source is backend:
        backend.copy(out, flat)
    else:  # memory of another backend: through host
        backend.from_host(out, source.host_copy(flat))
    return backend.typed(out, dtype, shape)
