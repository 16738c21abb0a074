"""The registration of the torch.distributed backend ``"hoplite"``, kept light: it imports nothing
of the backend until a group of it is created.

torch calls :func:`autoload` while it is imported, in every process where hoplite_gpu is
installed (the ``torch.backends`` entry point of the package; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``
turns torch's loading of these off), so ``init_process_group("hoplite")`` works in any script,
``torchrun`` worker or Ray Train worker with nothing imported first. Importing
:mod:`hoplite_gpu.torch` registers it too.
"""

from __future__ import annotations

import logging
from typing import Any

from .names import BACKEND


def register() -> None:
    """Register the backend ``"hoplite"`` with torch.distributed, for CPU and CUDA tensors
    (again: no-op)."""
    import torch.distributed as dist

    if getattr(dist.Backend, BACKEND.upper(), None) == BACKEND:
        return
    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])


def create(options: Any, backend_options: Any = None) -> Any:
    """The creator torch calls for each new group of the backend (see
    :func:`hoplite_gpu.torch.backend.create`)."""
    from .backend import create as create_group

    return create_group(options, backend_options)


def autoload() -> None:
    """:func:`register`, for torch's loading of plugins: it never raises (an error there would
    fail ``import torch`` itself), and does nothing where torch has no distributed package."""
    try:
        import torch.distributed as dist

        if dist.is_available():
            register()
    except Exception:
        logging.getLogger("hoplite_gpu.torch").debug("registering the hoplite backend failed", exc_info=True)
