"""Which device backend an array belongs to, and which one this process creates memory with.

:func:`backend_for` answers for any array (None: host memory); :func:`default_backend` is the
process's (``HOPLITE_DEVICE_BACKEND``: ``cupy``, the default, or ``sim``). :func:`device_result`
makes a reader's device copy.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from ..errors import HopliteError
from .backend import DeviceBackend
from .cuda import CupyBackend
from .sim import SimBackend, SimDeviceArray

#: Environment variable naming the default backend of a process (``cupy``, the default, or ``sim``).
BACKEND_ENV = "HOPLITE_DEVICE_BACKEND"

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
