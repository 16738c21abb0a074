"""The data plane: how an object's bytes cross from one node to another.

Two implementations with one interface, chosen per node by ``Config.data_plane``
(:func:`make_data_plane`): :class:`TcpDataPlane` (:mod:`.tcp`), authenticated sockets where the
kernel moves each chunk into place, on hosts where UCX would use TCP anyway; and
:class:`DataPlane` (:mod:`.transport`) over UCX, for RDMA and CUDA transports. :mod:`.ucx` starts
``ucxx`` with the measured defaults and turns every UCX failure into a typed error; nothing else in
the package talks to ``ucxx``.
"""

from __future__ import annotations

from ..config import Config, data_plane_kind
from ..memory import LocalStore
from .shared import ServeCallback
from .tcp import TcpDataPlane
from .transport import DataPlane

#: Either data plane.
AnyDataPlane = DataPlane | TcpDataPlane


def make_data_plane(
    store: LocalStore, token: str, config: Config, on_served: ServeCallback | None = None
) -> AnyDataPlane:
    """The data plane ``config`` chooses for this host (:func:`~hoplite_gpu.config.data_plane_kind`)."""
    if data_plane_kind(config) == "ucx":
        return DataPlane(store, token, config, on_served)
    return TcpDataPlane(store, token, config, on_served)


__all__ = ["AnyDataPlane", "DataPlane", "TcpDataPlane", "make_data_plane"]
