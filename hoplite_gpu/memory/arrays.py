"""The one place that looks at what kind of array a caller passed.

Every array a caller hands the library (``put``, ``get(out=...)``, collectives, the Ray backend)
is classified once where it enters, as a :class:`CallerArray`: NumPy, CuPy, torch tensors, and
other objects that export ``__cuda_array_interface__`` or DLPack on a CUDA device (device memory,
with the :class:`~hoplite_gpu.memory.backend.DeviceBackend` that holds it), or
``__array_interface__`` / DLPack on the CPU (host memory). What travels down from there is the
classified array, or the object's :class:`~hoplite_gpu.memory.buffers.Buffer`. Nothing else in the
package inspects array types.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from . import device
from .backend import DeviceBackend
from .cuda import dlpack_on_cuda
from .sim import SimDeviceArray


class ArrayKind(enum.Enum):
    """What a caller's array is."""

    NUMPY = "numpy"
    CUPY = "cupy"
    TORCH = "torch"
    CUDA = "cuda"  # another CUDA array: ``__cuda_array_interface__``, or DLPack on a CUDA device
    HOST = "host"  # another object NumPy can view (``__array_interface__``, buffer, DLPack)
    SIM = "sim"  # simulated device memory (:class:`hoplite_gpu.memory.sim.SimDeviceArray`, for tests)
    OTHER = "other"


#: The kinds whose memory may be on a device (a torch tensor may be either).
_MAYBE_DEVICE = frozenset({ArrayKind.CUPY, ArrayKind.TORCH, ArrayKind.CUDA, ArrayKind.SIM})
#: The kinds ``get`` writes into as ``out``.
OUT_KINDS = frozenset({ArrayKind.NUMPY, ArrayKind.CUPY, ArrayKind.SIM})


def kind_of(array: Any) -> ArrayKind:
    """Classify ``array`` (no import of CuPy or torch happens here)."""
    if isinstance(array, np.ndarray):
        return ArrayKind.SIM if isinstance(array, SimDeviceArray) else ArrayKind.NUMPY
    module = type(array).__module__.split(".")[0]
    if module == "cupy":
        return ArrayKind.CUPY
    if module == "torch":
        return ArrayKind.TORCH
    if hasattr(array, "__cuda_array_interface__") or dlpack_on_cuda(array):
        return ArrayKind.CUDA
    if hasattr(array, "__array_interface__") or hasattr(array, "__dlpack__"):
        return ArrayKind.HOST
    return ArrayKind.OTHER


@dataclass(frozen=True, slots=True)
class CallerArray:
    """A caller's array, classified once (:meth:`of`): ``value`` itself, its :class:`ArrayKind`,
    and the device backend whose memory it is in (None: host memory)."""

    value: Any
    kind: ArrayKind
    backend: DeviceBackend | None

    @classmethod
    def of(cls, array: Any) -> CallerArray:
        """Classify ``array``."""
        kind = kind_of(array)
        return cls(array, kind, device.backend_for(array) if kind in _MAYBE_DEVICE else None)

    @property
    def on_device(self) -> bool:
        """Whether the array lives in GPU memory (of any backend)."""
        return self.backend is not None

    def describe(self) -> tuple[np.dtype[Any], tuple[int, ...]]:
        """The array's dtype (as NumPy knows it) and shape."""
        if self.backend is not None:
            return self.backend.describe(self.value)
        host = self.host()
        return host.dtype, tuple(host.shape)

    def host(self) -> np.ndarray[Any, Any]:
        """A NumPy view of the array where one exists, else a host copy (GPU arrays are copied)."""
        array, kind, backend = self.value, self.kind, self.backend
        if kind is ArrayKind.NUMPY:
            return array  # type: ignore[no-any-return]
        if backend is not None:
            dtype, shape = backend.describe(array)
            return backend.host_copy(backend.flat_bytes(array)).view(dtype).reshape(shape)
        if kind is ArrayKind.TORCH:
            return torch_numpy(array)
        if kind is ArrayKind.HOST:
            try:
                return (
                    np.from_dlpack(array) if not hasattr(array, "__array_interface__") else np.asarray(array)
                )
            except (TypeError, ValueError, RuntimeError, BufferError) as exc:
                raise InvalidArgumentError(
                    f"cannot view {type(array).__name__} as an array: {exc}", argument="array"
                ) from None
        raise InvalidArgumentError(
            f"put needs a NumPy or CuPy array (or a torch tensor, or an object exporting the array "
            f"interface), got {type(array).__name__}",
            argument="array",
        )

    def flat_view(self) -> Any:
        """A one-dimensional view of a C-contiguous NumPy, CuPy or simulated device array (None for
        anything else)."""
        if self.kind not in OUT_KINDS or not self.value.flags["C_CONTIGUOUS"]:
            return None
        return self.value.reshape(-1)

    def copy_from(self, src: Any) -> None:
        """Copy ``src`` (host, or a device array of any backend) into this array (NumPy, or a device
        array: CuPy or simulated), same dtype and shape."""
        out, backend = self.value, self.backend
        source = device.backend_for(src)
        if backend is not None:
            backend.settle(backend.device_of(out))  # what the caller queued that uses out comes first
        if backend is not None and source is backend and out.flags.c_contiguous:
            backend.copy(backend.flat_bytes(out), backend.flat_bytes(src))
            return
        host = src if source is None else CallerArray.of(src).host()
        if backend is None:
            np.copyto(out, host)
        elif out.flags.c_contiguous:
            backend.from_host(backend.flat_bytes(out), np.ascontiguousarray(host).reshape(-1).view(np.uint8))
        elif isinstance(out, np.ndarray):  # a non-contiguous simulated device array
            np.copyto(out.view(np.ndarray), host)
        else:
            out.set(host)  # a non-contiguous CuPy array


def on_device(array: Any) -> bool:
    """Whether ``array`` lives in GPU memory (of any :mod:`~hoplite_gpu.memory.device` backend)."""
    return device.backend_for(array) is not None


def to_host(array: Any) -> np.ndarray[Any, Any]:
    """:meth:`CallerArray.host` of ``array``."""
    return CallerArray.of(array).host()


def flat_view(array: Any) -> Any:
    """:meth:`CallerArray.flat_view` of ``array``."""
    return CallerArray.of(array).flat_view()


def copy_into(out: Any, src: Any) -> None:
    """:meth:`CallerArray.copy_from`: ``src`` into ``out``."""
    CallerArray.of(out).copy_from(src)


def torch_numpy(tensor: Any) -> np.ndarray[Any, Any]:
    """A NumPy view of a host torch tensor (a copy of a device one): bfloat16, which NumPy
    lacks, as ml_dtypes' bfloat16 over the same bytes; a dtype NumPy cannot hold (float8, say)
    raises :class:`InvalidArgumentError`."""
    import torch

    t = tensor.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)  # type: ignore[no-any-return]
    try:
        return t.numpy()  # type: ignore[no-any-return]
    except (TypeError, RuntimeError) as exc:
        raise InvalidArgumentError(
            f"cannot store a torch tensor of {t.dtype}: {exc}", argument="array"
        ) from None
