"""UCX, for the data plane over RDMA and CUDA transports; nothing else in the package talks to
``ucxx``. This package's own import loads nothing: its modules are imported by name, and
:class:`UcxDataPlane` loads its module on first use.

- :mod:`.choice`: the transports and thresholds chosen from what UCX lists on this host (pure).
- :mod:`.probe`: reading that listing (``ucx_info -d``, once per boot).
- :mod:`.settings`: the measured defaults and this host's choice, applied before ``ucxx`` loads.
- :mod:`.interfaces`: the network interface that holds an address (UCX is limited to it).
- :mod:`.loading`: importing and starting ``ucxx`` with those settings and limited features.
- :mod:`.waits`: awaiting UCX operations, their failures and stalls as typed errors.
- :mod:`.plane`: :class:`~.plane.UcxDataPlane`, the data plane over UCX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .plane import UcxDataPlane


def __getattr__(name: str) -> Any:
    """Load :class:`~.plane.UcxDataPlane`'s module on its first use (it loads ``ucxx``'s callers)."""
    if name != "UcxDataPlane":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = importlib.import_module(".plane", __name__).UcxDataPlane
    globals()[name] = value
    return value


__all__ = ["UcxDataPlane"]
