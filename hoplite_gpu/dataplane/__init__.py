"""The data plane: how an object's bytes cross from one node to another.

Two implementations of one protocol (:class:`~.base.DataPlane`), chosen per node by
``Config.data_plane`` (:func:`~.selection.make_data_plane`): :class:`~.tcp.TcpDataPlane`,
authenticated sockets where the kernel moves each chunk into place, on hosts where UCX would use TCP
anyway; and :class:`~.ucx.plane.UcxDataPlane` over UCX, for RDMA and CUDA transports
(:mod:`.ucx` holds everything of UCX's). What both share is in :mod:`.shared`.

Importing this package loads none of them: its names load their module on first use, so that UCX's
choice and probe (:mod:`.ucx.choice`, :mod:`.ucx.probe`) run without the node side.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import DataPlane
    from .selection import data_plane_choice, data_plane_kind, make_data_plane
    from .tcp import TcpDataPlane
    from .ucx.plane import UcxDataPlane

#: Each name this package offers, and the module that defines it.
_HOMES = {
    "DataPlane": ".base",
    "TcpDataPlane": ".tcp",
    "UcxDataPlane": ".ucx.plane",
    "data_plane_choice": ".selection",
    "data_plane_kind": ".selection",
    "make_data_plane": ".selection",
}


def __getattr__(name: str) -> Any:
    """Load the module of one of this package's names on its first use."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "DataPlane",
    "TcpDataPlane",
    "UcxDataPlane",
    "data_plane_choice",
    "data_plane_kind",
    "make_data_plane",
]
