"""Which data plane a node runs (``Config.data_plane``, ``auto`` decided by what UCX lists on this
host), and building it."""

from __future__ import annotations

from ..config import Config
from ..memory import LocalStore
from .base import DataPlane
from .shared import ServeCallback
from .tcp import TcpDataPlane
from .ucx.choice import UcxChoice
from .ucx.plane import UcxDataPlane
from .ucx.settings import UCX_CUDA_ENV, ucx_choice, ucx_cuda


def data_plane_choice(config: Config, choice: UcxChoice | None = None) -> tuple[str, str]:
    """The data plane a node with ``config`` runs, ``tcp`` or ``ucx`` (see ``Config.data_plane``),
    and why; ``choice``: this host's :func:`~.ucx.settings.ucx_choice`, where the caller has it already."""
    if config.data_plane != "auto":
        return config.data_plane, f"Config.data_plane={config.data_plane} (HOPLITE_DATA_PLANE)"
    if ucx_cuda():
        return "ucx", f"auto: {UCX_CUDA_ENV}=1 hands device chunks to UCX"
    case = (choice or ucx_choice()).case
    if "rdma" in case:
        return "ucx", f"auto: UCX lists RDMA transports here ({case})"
    return "tcp", (
        f"auto: UCX lists no RDMA transport here ({case}), so it would use TCP: the TCP plane moves "
        "the same bytes with the kernel's sockets (bench/pages/collectives.md#the-tcp-data-plane)"
    )


def data_plane_kind(config: Config) -> str:
    """The data plane a node with ``config`` runs: ``tcp`` or ``ucx`` (:func:`data_plane_choice`)."""
    return data_plane_choice(config)[0]


def make_data_plane(
    store: LocalStore, token: str, config: Config, on_served: ServeCallback | None = None
) -> DataPlane:
    """The data plane ``config`` chooses for this host (:func:`data_plane_kind`), not started."""
    if data_plane_kind(config) == "ucx":
        return UcxDataPlane(store, token, config, on_served)
    return TcpDataPlane(store, token, config, on_served)


#: ``DataPlane`` (:mod:`.base`) is offered here too: the type of what :func:`make_data_plane` builds.
__all__ = ["DataPlane", "data_plane_choice", "data_plane_kind", "make_data_plane"]
