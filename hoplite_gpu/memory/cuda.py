"""CUDA device memory through CuPy (imported on first use): the :class:`CupyBackend`.

CuPy arrays, CUDA torch tensors and any object exporting ``__cuda_array_interface__``, or DLPack on
a CUDA device, go in; CuPy arrays come out. Copies are ``cudaMemcpy`` calls; reductions run the
kernels of ``kernels/reduce.cu`` (:mod:`hoplite_gpu.memory.kernels`).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import DeviceIpcError, InvalidArgumentError, PinnedMemoryError
from ..reduce_ops import ReduceOp
from . import kernels
from .backend import DeviceBackend, DeviceEvent, same_size

log = logging.getLogger("hoplite_gpu")

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


def _nothing() -> None:
    return None


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
        # Asked at every read of device memory; a device once seen stays (a process's CUDA
        # devices do not go away), so only a missing one is asked about again.
        if not self._available:
            self._available = kernels.available()
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
        same_size(dst, src)
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

        same_size(dst, src)
        if dst.nbytes:  # cudaMemcpyDefault: unified addressing works out the devices
            runtime = cupy.cuda.runtime
            with _on(dst):
                stream = cupy.cuda.get_current_stream().ptr
                runtime.memcpyAsync(dst.data.ptr, src.data.ptr, dst.nbytes, runtime.memcpyDefault, stream)

    def to_host(self, dst: np.ndarray[Any, Any], src: Any) -> None:
        same_size(dst, src)
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
        same_size(dst, src)
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
        with _on(acc):
            kernels.reduce_into(op, self._storage(acc, dtype), self._storage(other, dtype), dtype.name)

    def finish(self, op: ReduceOp, acc: Any, count: int, dtype: np.dtype[Any]) -> None:
        with _on(acc):
            kernels.finish(op, self._storage(acc, dtype), count, dtype.name)

    def scale(self, acc: Any, weight: float, dtype: np.dtype[Any]) -> None:
        with _on(acc):
            kernels.scale(self._storage(acc, dtype), weight, dtype.name)

    def axpy(self, acc: Any, other: Any, weight: float, dtype: np.dtype[Any]) -> None:
        with _on(acc):
            kernels.axpy(self._storage(acc, dtype), self._storage(other, dtype), weight, dtype.name)

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


def _host_contiguous(arr: np.ndarray[Any, Any]) -> None:
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError("host side of a device copy must be C-contiguous", argument="host")
