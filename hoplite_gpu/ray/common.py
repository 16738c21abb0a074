"""What the modules of :mod:`hoplite_gpu.ray` share, none of it needing Ray: the names and timeouts
of the directory actor and the collective backend, and :func:`as_buffer` (a tensor as an array a
node reads and writes). Every other module of the package imports this one; it imports none of them.
"""

from __future__ import annotations

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


def as_buffer(tensor: Any) -> tuple[Any, Callable[[], None] | None]:
    """A C-contiguous NumPy or CuPy array sharing memory with ``tensor`` where it can, and a
    function that copies it back into ``tensor`` (None when they share memory).

    Accepts NumPy and CuPy arrays and torch tensors (CPU: a NumPy view, bfloat16 through
    ``ml_dtypes``; CUDA: a CuPy view, bfloat16 as CuPy 14's ``ml_dtypes.bfloat16``).

    Raises:
        InvalidArgumentError: not an array, a read-only NumPy array, or a bfloat16 CUDA tensor
            with a CuPy that has no bfloat16 (before 14).
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
    if tensor.flags["C_CONTIGUOUS"] and (module == "cupy" or tensor.flags["WRITEABLE"]):
        return tensor, None
    if module == "numpy" and not tensor.flags["WRITEABLE"]:
        raise InvalidArgumentError("the array is read-only", argument="tensor")
    xp = np if module == "numpy" else __import__("cupy")
    copy = xp.ascontiguousarray(tensor)

    def back() -> None:
        tensor[...] = copy

    return copy, back


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
    elif contiguous.dtype == torch.bfloat16:
        import ml_dtypes

        array = contiguous.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        array = contiguous.numpy()
    if contiguous is t:
        return array, None

    def back() -> None:
        t.copy_(contiguous)

    return array, back
