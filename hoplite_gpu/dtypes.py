"""How a dtype travels in a message: :func:`dtype_to_wire` writes it as text, :func:`dtype_from_wire`
reads it back and refuses anything it did not write. NumPy only, so the directory and the protocol
check dtypes without loading the node side."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .errors import InvalidArgumentError

_SPECIAL_DTYPES = ("bfloat16",)


@functools.lru_cache(maxsize=256)  # once per dtype: a tenth of a small put's own work before
def dtype_to_wire(dtype: np.dtype[Any]) -> str:
    """Text form of a dtype that :func:`dtype_from_wire` turns back into it."""
    if dtype.hasobject:
        raise InvalidArgumentError(
            "object arrays cannot be stored (their bytes are pointers); convert to a numeric dtype",
            argument="array",
        )
    if dtype.name in _SPECIAL_DTYPES:
        return dtype.name
    return dtype.str if dtype.fields is None else np.lib.format.dtype_to_descr(dtype).__repr__()


def dtype_from_wire(text: str) -> np.dtype[Any]:
    """Inverse of :func:`dtype_to_wire`; raises :class:`InvalidArgumentError` for any text that
    is not a dtype it wrote (this text comes from other processes)."""
    if text in _SPECIAL_DTYPES:
        import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)
    try:
        if text.startswith("["):  # a structured dtype's descr: padding is unnamed "|V" fields
            import ast

            dtype = np.lib.format.descr_to_dtype(ast.literal_eval(text))
        else:
            dtype = np.dtype(text)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as exc:
        what = f"not a dtype: {text[:80]!r} ({type(exc).__name__})"
        raise InvalidArgumentError(what, argument="dtype") from None
    if dtype.hasobject:
        raise InvalidArgumentError(f"object dtypes cannot be stored: {text[:80]!r}", argument="dtype")
    return dtype
