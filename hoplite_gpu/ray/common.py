"""What the modules of :mod:`hoplite_gpu.ray` share, none of it needing Ray: the names and timeouts
of the directory actor and the collective backend, and :func:`as_buffer` (a tensor as an array a
node reads and writes). Every other module of the package imports this one; it imports none of them.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import memory
from ..errors import InvalidArgumentError

#: Name of the directory actor (and of the default directory everywhere in this package).
DEFAULT_NAME = "hoplite"
#: Name of the ``ray.util.collective`` backend.
BACKEND = "HOPLITE"
#: Seconds a collective of a :class:`~hoplite_gpu.ray.collective_group.HopliteGroup` waits for the
#: other members when the call's options set no timeout.
DEFAULT_TIMEOUT = 300.0
#: Seconds to wait for the directory actor to start and answer.
ACTOR_TIMEOUT = 120.0


def as_buffer(tensor: Any, write: bool = True) -> tuple[Any, Callable[[], None] | None]:
    """A C-contiguous NumPy or CuPy array sharing memory with ``tensor`` where it can, and a
    function that copies it back into ``tensor`` (None when they share memory).

    Accepts NumPy and CuPy arrays and torch tensors (CPU: a NumPy view, bfloat16 through
    ``ml_dtypes``; CUDA: a CuPy view, bfloat16 as CuPy 14's ``ml_dtypes.bfloat16``).

    ``write=False`` (an input the collective only reads) takes read-only arrays as they are. With
    ``write=True`` a read-only NumPy array is refused, but one that Ray deserialized without a copy
    (an actor method's argument, a view of Ray's object store or of the task's inlined arguments):
    Ray flags those read-only although their memory is writable, and its gloo backend writes
    its in-place results into them (through ``torch.from_numpy``), which Ray's API and tests
    expect. The result is then written through, with a :class:`RayReadOnlyWriteWarning` once
    per process: other readers of the same Ray object in this process see it too.

    Raises:
        InvalidArgumentError: not an array; a read-only NumPy array to write into that Ray did
            not deserialize (or whose memory is not mapped writable, or is not contiguous); a
            bfloat16 CUDA tensor with a CuPy that has no bfloat16 (before 14).
    """
    kind = memory.kind_of(tensor)
    if kind is memory.ArrayKind.TORCH:
        return _torch_buffer(tensor)
    module = kind.value
    if kind not in (memory.ArrayKind.NUMPY, memory.ArrayKind.CUPY):
        raise InvalidArgumentError(
            f"expected a NumPy or CuPy array or a torch tensor, got {type(tensor).__name__}",
            argument="tensor",
        )
    if tensor.flags["C_CONTIGUOUS"] and (module == "cupy" or not write or tensor.flags["WRITEABLE"]):
        return tensor, None
    if module == "numpy" and write and not tensor.flags["WRITEABLE"]:
        return _write_through(tensor), None
    xp = np if module == "numpy" else __import__("cupy")
    copy = xp.ascontiguousarray(tensor)

    def back() -> None:
        tensor[...] = copy

    return copy, back


class RayReadOnlyWriteWarning(UserWarning):
    """A collective wrote its in-place result into a NumPy array that Ray flagged read-only (see
    :func:`as_buffer`)."""


_warned = False


def _write_through(array: np.ndarray) -> np.ndarray:
    """A writable view of ``array``, a read-only C-contiguous NumPy array that Ray deserialized
    without a copy and whose memory is mapped writable; else :class:`InvalidArgumentError`."""
    global _warned
    refused = "the array is read-only"
    if not _from_ray(array):
        raise InvalidArgumentError(f"{refused} (pass a writable array for the result)", argument="tensor")
    if not array.flags["C_CONTIGUOUS"]:
        raise InvalidArgumentError(f"{refused} and not contiguous", argument="tensor")
    if not array.nbytes:
        return np.empty(array.shape, array.dtype)  # nothing to write
    if not _mapped_writable(array.ctypes.data, array.nbytes):
        raise InvalidArgumentError(f"{refused}: its memory is not mapped writable", argument="tensor")
    raw = (ctypes.c_uint8 * array.nbytes).from_address(array.ctypes.data)
    view = np.ctypeslib.as_array(raw).view(array.dtype).reshape(array.shape)
    if not _warned:
        _warned = True
        warnings.warn(
            "hoplite_gpu.ray: writing a collective's result into a NumPy array that Ray made "
            "read-only (a zero-copy argument from Ray's object store), as Ray's gloo backend does; "
            "pass a copy (np.array(x)) to keep Ray's object unchanged",
            RayReadOnlyWriteWarning,
            stacklevel=4,
        )
    return view


def _from_ray(array: np.ndarray) -> bool:
    """Whether ``array`` views a buffer of Ray's (``ray._raylet``), following ``base`` links."""
    base: Any = array
    for _ in range(32):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
        if base is None:
            return False
        if type(base).__module__ == "ray._raylet":
            return True
    return False


def _mapped_writable(address: int, size: int) -> bool:
    """Whether ``size`` bytes at ``address`` lie in writable mappings of this process (Linux)."""
    end = address + size
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, perms = line.split(None, 2)[:2]
                lo, hi = (int(v, 16) for v in span.split("-"))
                if lo <= address < hi:
                    if "w" not in perms:
                        return False
                    if end <= hi:
                        return True
                    address = hi  # the rest is in the next mapping(s)
    except OSError:
        return False
    return False


def _torch_buffer(tensor: Any) -> tuple[Any, Callable[[], None] | None]:
    import torch

    t = tensor.detach()
    contiguous = t if t.is_contiguous() else t.contiguous()
    if contiguous.is_cuda:
        from ..memory import cuda

        if contiguous.dtype == torch.bfloat16 and cuda.cupy_bfloat16() is None:
            raise InvalidArgumentError(
                "collectives on bfloat16 CUDA tensors need CuPy 14 or later (with ml_dtypes), "
                "whose kernels take bfloat16; this CuPy would reduce the bits as integers",
                argument="tensor",
            )
        array = cuda.cupy_view(contiguous)
    else:
        array = memory.torch_numpy(contiguous)
    if contiguous is t:
        return array, None

    def back() -> None:
        t.copy_(contiguous)

    return array, back
