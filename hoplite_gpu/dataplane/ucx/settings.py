"""The UCX settings of this host: the measured defaults, the transports and thresholds chosen from
what UCX lists here (:mod:`.choice`, from :mod:`.probe`'s listing), whether device chunks go to
UCX as they are, and applying them to the environment before ``ucxx`` loads.

Pure of the node side: it loads neither ``ucxx`` nor the memory or the node, so ``hoplite-gpu info``
and the choice of data plane run where UCX is missing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .choice import UcxChoice, choose_ucx
from .probe import host_listing, rdma_devices

#: UCX settings applied before UCX is first imported, unless already set in the environment: those
#: of a host where UCX lists only TCP. On a host where it lists RDMA or CUDA transports, :mod:`.choice`
#: changes ``UCX_TLS`` and ``UCX_RNDV_THRESH`` on top of them. One line each below
#: (docs/configuration.md is generated from them); why: bench/pages/defaults.md#ucx-defaults.
#:
#: - ``UCX_TLS``: TCP only (plus RDMA transports where UCX lists them, CUDA ones with
#:   ``HOPLITE_UCX_CUDA=1``): UCX's shared-memory transports wedged nodes after SIGKILLs; same-host
#:   copies take hoplite_gpu's own segments instead (``tcp,sm`` is faster without ``shared_memory``).
#: - ``UCX_MM_ERROR_HANDLING``: lets UCX use shared memory on endpoints with peer-failure handling
#:   (ucxx's), should ``UCX_TLS`` list ``sm``.
#: - ``UCX_RNDV_THRESH``: the eager protocol for every size: over TCP, rendezvous moved far less
#:   (``auto``, UCX's own, where RDMA transports are chosen: rendezvous moves large messages
#:   zero-copy there).
#: - ``UCX_TCP_TX_SEG_SIZE``: 1 MiB TCP send segments instead of 8 KiB: fewer system calls and
#:   progress rounds per byte.
#: - ``UCX_TCP_RX_SEG_SIZE``: 1 MiB TCP receive segments instead of 64 KiB, for the same reason.
#: - ``UCX_WARN_UNUSED_ENV_VARS``: no warning about the variables of this list that the transports in
#:   use ignore.
#: - ``UCXPY_PROGRESS_MODE``: ucxx progresses on its own thread; the other modes re-poll the event
#:   loop while a receive is posted, which a node always has, and spin a core per idle node.
#: - ``UCXPY_ENABLE_PYTHON_FUTURE``: requests complete through Python futures, which lets the
#:   ``thread`` mode idle.
UCX_DEFAULTS: dict[str, str] = {
    "UCX_TLS": "tcp",
    "UCX_MM_ERROR_HANDLING": "y",
    "UCX_RNDV_THRESH": "inf",
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCXPY_PROGRESS_MODE": "thread",
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
}


#: Environment variable: ``1`` hands device chunks to UCX as they are (its ``cuda_copy`` transport,
#: added to ``UCX_TLS``) instead of staging them through pinned host buffers; read when UCX is first
#: loaded. Off: staging was faster on an H100 (bench/pages/gpu.md#gpu-benchgpupy, the ``wire`` part).
UCX_CUDA_ENV = "HOPLITE_UCX_CUDA"


def ucx_cuda() -> bool:
    """Whether device chunks go to UCX as they are (:data:`UCX_CUDA_ENV` is ``1``)."""
    return os.environ.get(UCX_CUDA_ENV, "") == "1"


def ucx_choice(environ: Mapping[str, str] | None = None) -> UcxChoice:
    """The UCX settings :func:`apply_ucx_defaults` would apply for this host and ``environ``
    (default ``os.environ``), and why, without applying them. Never raises: any failure to probe
    UCX gives the TCP-only choice, with the reason."""
    env = os.environ if environ is None else environ
    try:
        listing = host_listing(env)
        return choose_ucx(
            listing.text,
            env,
            UCX_DEFAULTS,
            problem=listing.problem,
            rdma_devices=rdma_devices(),
            source=listing.source,
        )
    except Exception as exc:  # a node must start whatever the probe or the parser does
        return choose_ucx(None, env, UCX_DEFAULTS, problem=f"choosing failed: {type(exc).__name__}: {exc}")


def default_ucx_tls() -> str:
    """The UCX transports used where ``UCX_TLS`` is not set: this host's choice
    (:func:`ucx_choice`), ``UCX_DEFAULTS``'s ``tcp`` on a TCP-only host, plus ``cuda_copy`` with
    :data:`UCX_CUDA_ENV`."""
    return ucx_choice({k: v for k, v in os.environ.items() if k != "UCX_TLS"}).effective()["UCX_TLS"]


_applied: UcxChoice | None = None


def apply_ucx_defaults() -> UcxChoice:
    """Set this host's UCX settings (:func:`ucx_choice`) in the environment unless the user set
    them already, and return the choice. With :data:`UCX_CUDA_ENV`, ``UCX_TLS`` lists
    ``cuda_copy`` even where it was set (a process started by a node inherits the node's
    ``UCX_TLS=tcp``): ucxx refuses device buffers without it."""
    global _applied
    choice = ucx_choice()
    os.environ.update(dict(choice.settings))
    _applied = choice
    return choice


def applied_ucx_choice() -> UcxChoice | None:
    """The choice :func:`apply_ucx_defaults` last applied in this process (None before)."""
    return _applied


__all__ = [
    "UCX_CUDA_ENV",
    "UCX_DEFAULTS",
    "applied_ucx_choice",
    "apply_ucx_defaults",
    "default_ucx_tls",
    "ucx_choice",
    "ucx_cuda",
]
