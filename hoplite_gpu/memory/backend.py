"""What the package needs of device memory: the :class:`DeviceBackend` interface and its events.

A device object's bytes are a flat ``uint8`` array of a backend. The rest of the package never calls
CuPy or torch to copy or reduce device bytes: it asks the array's backend
(:func:`hoplite_gpu.memory.device.backend_for`). Two backends implement it: CUDA through CuPy
(:mod:`~hoplite_gpu.memory.cuda`) and host memory posing as a device for tests
(:mod:`~hoplite_gpu.memory.sim`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import DeviceIpcError, InvalidArgumentError
from ..reduce_ops import ReduceOp


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
        counts of an allocation nothing else uses (:class:`hoplite_gpu.memory.ipc.DevicePool`). Here:
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


def same_size(dst: Any, src: Any) -> None:
    """Raise unless a copy's two sides have the same size."""
    if int(dst.nbytes) != int(src.nbytes):
        raise InvalidArgumentError(f"copy of {src.nbytes} bytes into {dst.nbytes}", argument="dst")
