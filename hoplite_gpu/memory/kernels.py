"""GPU reductions: the CUDA kernels of ``kernels/reduce.cu``, compiled lazily by CuPy per device.

CuPy is optional (the ``cuda`` extra). Nothing here imports it until a GPU buffer is reduced, and
:func:`available` says whether that can happen on this machine.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import HopliteError, InvalidArgumentError
from ..reduce_ops import ReduceOp, check_dtype

#: CUDA storage type per dtype name.
CUDA_TYPES: dict[str, str] = {
    "float16": "__half",
    "bfloat16": "hoplite_bf16",
    "float32": "float",
    "float64": "double",
    "int32": "int",
    "int64": "long long",
    "uint8": "unsigned char",
}

_OP_STRUCTS: dict[ReduceOp, str] = {
    ReduceOp.SUM: "OpSum",
    ReduceOp.AVG: "OpSum",
    ReduceOp.PROD: "OpProd",
    ReduceOp.MIN: "OpMin",
    ReduceOp.MAX: "OpMax",
}

#: The dtypes of weighted reductions (``hoplite_scale`` and ``hoplite_axpy``).
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")

THREADS_PER_BLOCK = 256
MAX_BLOCKS = 4096  # the kernels loop with a grid stride beyond this


def kernels_dir() -> Path:
    """Where the CUDA sources are: ``HOPLITE_KERNELS_DIR``, else ``kernels/`` of the checkout."""
    override = os.environ.get("HOPLITE_KERNELS_DIR")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "kernels"


def kernel_names() -> list[str]:
    """Every templated kernel instantiation the module compiles (its ``name_expressions``)."""
    names = []
    for ctype in CUDA_TYPES.values():
        names += [f"hoplite_reduce<{ctype}, {s}>" for s in sorted(set(_OP_STRUCTS.values()))]
        names.append(f"hoplite_average<{ctype}>")
    for dtype in FLOAT_DTYPES:
        names += [f"hoplite_scale<{CUDA_TYPES[dtype]}>", f"hoplite_axpy<{CUDA_TYPES[dtype]}>"]
    return names


def available() -> bool:
    """Whether CuPy is installed and sees at least one CUDA device."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # CUDA driver missing or unusable
        return False


_compile_lock = threading.Lock()


@functools.cache
def _module(device_id: int) -> Any:
    """The compiled RawModule for one device (compiled on first use, then cached)."""
    import cupy

    source = (kernels_dir() / "reduce.cu").read_text()
    with _compile_lock, cupy.cuda.Device(device_id):
        module = cupy.RawModule(code=source, options=("--std=c++14",), name_expressions=kernel_names())
        module.compile()
    return module


def _ctype(arr: Any, dtype: str | None) -> str:
    """CUDA storage type for ``arr`` (or for the dtype named ``dtype``, which overrides the
    array's own: CuPy before 14 has no bfloat16, so bfloat16 data travels as uint16 arrays)."""
    name = dtype or np.dtype(arr.dtype).name
    if name not in CUDA_TYPES:
        check_dtype(np.dtype(name))  # raises with the list of supported dtypes
    if dtype is not None and np.dtype(arr.dtype).itemsize != (
        2 if name == "bfloat16" else np.dtype(name).itemsize
    ):
        raise InvalidArgumentError(f"array of {arr.dtype} cannot hold {name} data", argument="dtype")
    return CUDA_TYPES[name]


def _launch(kernel: Any, n: int, args: tuple[Any, ...]) -> None:
    blocks = max(1, min(MAX_BLOCKS, (n + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK))
    kernel((blocks,), (THREADS_PER_BLOCK,), args)


def reduce_into(op: ReduceOp, acc: Any, other: Any, dtype: str | None = None) -> None:
    """``acc = acc (op) other`` elementwise on the GPU, in place (CuPy arrays, same dtype, size
    and device, C-contiguous); runs on the current stream. ``dtype`` names the element type when
    the arrays' own dtype is only storage (``"bfloat16"`` in uint16 arrays)."""
    if acc.dtype != other.dtype or acc.size != other.size:
        raise InvalidArgumentError(
            f"GPU reduce of {acc.dtype}[{acc.size}] with {other.dtype}[{other.size}]", argument="other"
        )
    if not (acc.flags.c_contiguous and other.flags.c_contiguous):
        raise InvalidArgumentError("GPU reductions need C-contiguous arrays", argument="acc")
    if acc.size == 0:
        return
    name = f"hoplite_reduce<{_ctype(acc, dtype)}, {_OP_STRUCTS[op]}>"
    _launch(_kernel(acc.device.id, name), acc.size, (acc, other, np.uint64(acc.size)))


def finish(op: ReduceOp, acc: Any, count: int, dtype: str | None = None) -> None:
    """Final step after ``count`` inputs were reduced into ``acc`` (AVG divides; others no-op)."""
    if op is not ReduceOp.AVG or count <= 1 or acc.size == 0:
        return
    kernel = _kernel(acc.device.id, f"hoplite_average<{_ctype(acc, dtype)}>")
    _launch(kernel, acc.size, (acc, np.uint64(acc.size), np.float64(count)))


def _float_ctype(acc: Any, dtype: str | None) -> str:
    ctype = _ctype(acc, dtype)
    if (dtype or np.dtype(acc.dtype).name) not in FLOAT_DTYPES:
        raise InvalidArgumentError(
            f"weighted reductions need floats, got {dtype or acc.dtype}", argument="dtype"
        )
    return ctype


def scale(acc: Any, weight: float, dtype: str | None = None) -> None:
    """``acc = weight * acc`` elementwise on the GPU, in place (float dtypes; see :func:`reduce_into`)."""
    if not acc.flags.c_contiguous:
        raise InvalidArgumentError("GPU reductions need C-contiguous arrays", argument="acc")
    name = f"hoplite_scale<{_float_ctype(acc, dtype)}>"
    if acc.size:
        _launch(_kernel(acc.device.id, name), acc.size, (acc, np.uint64(acc.size), np.float64(weight)))


def axpy(acc: Any, other: Any, weight: float, dtype: str | None = None) -> None:
    """``acc = acc + weight * other`` elementwise on the GPU, in place (float dtypes): one step of a
    weighted SUM (see :func:`reduce_into`)."""
    if acc.dtype != other.dtype or acc.size != other.size:
        raise InvalidArgumentError(
            f"GPU axpy of {acc.dtype}[{acc.size}] with {other.dtype}[{other.size}]", argument="other"
        )
    if not (acc.flags.c_contiguous and other.flags.c_contiguous):
        raise InvalidArgumentError("GPU reductions need C-contiguous arrays", argument="acc")
    name = f"hoplite_axpy<{_float_ctype(acc, dtype)}>"
    if acc.size:
        _launch(_kernel(acc.device.id, name), acc.size, (acc, other, np.uint64(acc.size), np.float64(weight)))


def _kernel(device_id: int, name: str) -> Any:
    try:
        return _module(device_id).get_function(name)
    except Exception as exc:  # CuPy raises CompileException, CUDADriverError, ...
        raise HopliteError(f"cannot load GPU kernel {name} on device {device_id}: {exc}") from exc
