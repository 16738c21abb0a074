"""The tensors a publisher is given and a subscriber fills: NumPy arrays and torch tensors (CPU or
CUDA). Their bytes go through host memory: a CUDA tensor is copied to the host to publish it and
from the host to fill it (device buckets are not built yet)."""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import numpy as np

from ..dtypes import dtype_from_wire, dtype_to_wire
from ..errors import InvalidArgumentError
from ..memory import digest_of
from .manifest import TensorEntry


def bucket_digest(bucket: np.ndarray[Any, Any]) -> str:
    """The xxh3-128 digest of a contiguous bucket's bytes, as the store takes it, in hex."""
    return digest_of(bucket).hex()


def _torch() -> Any:
    return sys.modules.get("torch")


def _is_torch(value: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


def host_bytes(name: str, value: Any) -> tuple[np.ndarray[Any, Any], str, str, tuple[int, ...]]:
    """``value``'s bytes as a flat uint8 host array, with its kind, dtype text and shape.

    Raises:
        InvalidArgumentError: not a NumPy array, a CuPy array or a dense torch tensor.
    """
    if _is_torch(value):
        if value.layout != _torch().strided or value.is_quantized:
            raise InvalidArgumentError(f"tensor {name!r} is not a dense tensor", argument="tensors")
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        flat = t.contiguous().reshape(-1)
        return flat.view(_torch().uint8).numpy(), "torch", _torch_name(t.dtype), tuple(t.shape)
    if type(value).__module__.split(".")[0] == "cupy":
        value = value.get()
    if not isinstance(value, np.ndarray):
        raise InvalidArgumentError(
            f"tensor {name!r} is a {type(value).__name__}, not a NumPy array or a torch tensor",
            argument="tensors",
        )
    arr = value if value.flags.c_contiguous else value.copy(order="C")  # ascontiguousarray makes 0-d 1-d
    return arr.reshape(-1).view(np.uint8), "numpy", dtype_to_wire(arr.dtype), tuple(arr.shape)


def _torch_dtype(text: str) -> Any:
    torch = _torch()
    if torch is None:
        import torch  # a manifest of torch tensors: the subscriber gets torch tensors
    dtype = getattr(torch, text, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"not a torch dtype: {text[:80]!r}", argument="dtype")
    return dtype


def _itemsize(entry: TensorEntry) -> int:
    if entry.kind == "torch":
        return int(_torch_dtype(entry.dtype).itemsize)
    return dtype_from_wire(entry.dtype).itemsize


def check_entry(entry: TensorEntry) -> None:
    """Raise :class:`InvalidArgumentError` unless ``entry``'s bytes hold its shape of its dtype."""
    if entry.nbytes != math.prod(entry.shape) * _itemsize(entry):
        raise InvalidArgumentError(
            f"tensor {entry.name!r}: {entry.nbytes} bytes do not hold {entry.shape} of {entry.dtype}",
            argument="manifest",
        )


def _torch_name(dtype: Any) -> str:
    """A torch dtype's name: ``torch.bfloat16`` is ``bfloat16``."""
    return str(dtype).split(".")[-1]


def _numpy_name(dtype: np.dtype[Any]) -> str:
    """A NumPy dtype's name as torch's would read (``float32``), its byte order where not native."""
    return str(dtype.name if dtype.isnative else dtype.str)


def dtype_name(value: Any) -> str:
    """A dtype's name that NumPy (with ml_dtypes) and torch share: ``float32``, ``bfloat16``."""
    return _torch_name(value.dtype) if _is_torch(value) else _numpy_name(value.dtype)


def entry_dtype_name(entry: TensorEntry) -> str:
    """:func:`dtype_name` of the tensor ``entry`` describes."""
    return entry.dtype if entry.kind == "torch" else _numpy_name(dtype_from_wire(entry.dtype))


def check_into(entry: TensorEntry, dst: Any) -> None:
    """Raise :class:`InvalidArgumentError` unless ``dst`` can take ``entry``'s tensor."""
    if not (_is_torch(dst) or isinstance(dst, np.ndarray)):
        raise InvalidArgumentError(
            f"into[{entry.name!r}] is a {type(dst).__name__}, not a NumPy array or a torch tensor",
            argument="into",
        )
    shape, name = tuple(dst.shape), dtype_name(dst)
    if shape != entry.shape or name != entry_dtype_name(entry):
        raise InvalidArgumentError(
            f"into[{entry.name!r}] is {name}{list(shape)}, the published tensor is "
            f"{entry_dtype_name(entry)}{list(entry.shape)}",
            argument="into",
        )
    if isinstance(dst, np.ndarray) and not dst.flags.writeable:
        raise InvalidArgumentError(f"into[{entry.name!r}] is read-only", argument="into")


def _as_torch(src: np.ndarray[Any, Any]) -> Any:
    with warnings.catch_warnings():  # a read-only store view: only read from
        warnings.simplefilter("ignore", UserWarning)
        return _torch().from_numpy(src)


def fill(entry: TensorEntry, dst: Any, src: np.ndarray[Any, Any]) -> None:
    """Copy ``src`` (``entry``'s bytes) into ``dst``, which :func:`check_into` accepted."""
    if isinstance(dst, np.ndarray):
        if dst.flags.c_contiguous:
            dst.reshape(-1).view(np.uint8)[:] = src
        else:
            dst[...] = src.view(dst.dtype).reshape(entry.shape)
        return
    if entry.nbytes == 0:
        return
    typed = _as_torch(src).view(dst.dtype).reshape(entry.shape)
    with _torch().no_grad():
        dst.copy_(typed)


def new_tensor(entry: TensorEntry, src: np.ndarray[Any, Any]) -> Any:
    """``entry``'s tensor from its bytes ``src``: a read-only NumPy view of them for a NumPy one, a
    new torch tensor (a copy: the store's memory may be mapped read-only) for a torch one."""
    if entry.kind == "numpy":
        return src.view(dtype_from_wire(entry.dtype)).reshape(entry.shape)
    torch, dtype = _torch(), _torch_dtype(entry.dtype)
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    return torch.from_numpy(np.array(src)).view(dtype).reshape(entry.shape)
