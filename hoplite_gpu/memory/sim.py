"""Host memory posing as device memory (:class:`SimBackend`), so the device-object paths are tested
on machines without a GPU.

A :class:`SimDeviceArray` (made with :func:`sim_array`) takes every path a real device object takes
(no host view in the store, staged sends, device results, device reductions) with NumPy doing the
copies. Processes use it as their default when ``HOPLITE_DEVICE_BACKEND=sim``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import DeviceIpcError, HopliteError, PinnedMemoryError
from ..reduce_ops import ReduceOp
from ..reduce_ops import finish as host_finish
from ..reduce_ops import reduce_into as host_reduce_into
from . import shm
from .backend import DONE, DeviceBackend, DeviceEvent, same_size


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
        same_size(dst, src)
        np.copyto(_plain(dst), _plain(src))

    def to_host(self, dst: np.ndarray[Any, Any], src: Any) -> None:
        same_size(dst, src)
        np.copyto(dst, _plain(src))

    def from_host(self, dst: Any, src: np.ndarray[Any, Any]) -> None:
        same_size(dst, src)
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
