"""Loading ``ucxx`` as the data plane uses it: this host's UCX settings applied first, its features
limited to what the plane needs, and UCX limited to the node's interface."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ...errors import HopliteError
from .choice import UcxChoice
from .interfaces import interface_of
from .settings import apply_ucx_defaults

log = logging.getLogger("hoplite_gpu.transport")

_ucxx: Any = None
_net_devices = ""
_load_lock = threading.Lock()
_loaded: tuple[Any, UcxChoice] | None = None


def load_ucxx() -> tuple[Any, UcxChoice]:
    """Apply this host's UCX settings and import ``ucxx`` with its features limited
    (:data:`FEATURES`), once per process; return the module and the choice applied. Starts
    nothing (no UCX context, no thread), so it may run ahead of the first node, on any thread."""
    global _loaded
    with _load_lock:
        if _loaded is None:
            choice = apply_ucx_defaults()
            import ucxx

            _limit_features()
            _loaded = (ucxx, choice)
        return _loaded


def ucxx_module(listen_host: str = "") -> Any:
    """Import ``ucxx`` once, after applying the measured UCX defaults.

    With ``listen_host`` (the address a node was told to listen on: ``Config.listen_host``), UCX
    is limited to the network interface that holds it (UCX's ``NET_DEVICES``, given to
    ``ucxx.init`` rather than through the environment, so processes started later do not inherit
    it), and to the RDMA devices the UCX choice uses (``UcxChoice.net_devices``), unless
    ``UCX_NET_DEVICES`` is set. ucxx's listener takes no bind address and listens on
    every interface; UCX then refuses a connection arriving on an interface it was not given,
    before the peer can send anything (it logs "got connection request ... on a device ... which
    was not present during UCP initialization"). UCX reads its settings once per process: a
    later node of the same process that asks for another interface gets a warning.
    """
    global _ucxx, _net_devices
    if _ucxx is None:
        ucxx, choice = load_ucxx()
        device = interface_of(listen_host) if listen_host else ""
        if device and "UCX_NET_DEVICES" not in os.environ:
            devices = ",".join([device, *choice.net_devices])  # RDMA ports are net devices too
            try:
                ucxx.init(options={"NET_DEVICES": devices}, env_takes_precedence=True)
                _net_devices = device
            except RuntimeError:  # UCX was started in this process before us: leave it as it is
                log.warning("UCX was initialised before hoplite_gpu: not limiting it to %s", device)
        _ucxx = ucxx
    elif listen_host:
        device = interface_of(listen_host)
        if device and device != _net_devices and "UCX_NET_DEVICES" not in os.environ:
            log.warning(
                "UCX in this process was started for %s; this node, told to listen on %s (%s), "
                "answers %s: run one node per process to limit each to its own interface",
                _net_devices or "every interface",
                listen_host,
                device,
                "on every interface" if not _net_devices else f"only on {_net_devices}",
            )
    return _ucxx


#: The UCX features ucxx's context asks for (names of ``ucxx._lib.libucxx.Feature``): tagged
#: messages (the data plane), WAKEUP (ucxx's progress thread sleeps on the worker) and STREAM
#: (ucxx's exchange of peer information on each new endpoint). ucxx's default adds, unused here:
#: RMA, with which UCX over TCP served any peer's get and put at any address of this process,
#: before and without authentication (UCP's software get reads the address the message names, no
#: key checked); and AM, with which ucxx keeps every active message a peer sends until the
#: application receives it (+100 MiB for good per flood of 100 x 1 MiB). Without them UCX has no
#: handler for such messages: it logs and drops them. tests/test_dataplane_intruder.py tries both.
FEATURES = ("TAG", "WAKEUP", "STREAM")

#: UCX settings of the same context (an explicit ``UCX_*`` variable wins): TCP_PUT_ENABLE=n, or
#: UCX's TCP transport tells peers it takes one-sided writes and an unmodified UCX peer writes any
#: address of this process even with RMA off (the transport serves them below UCP's features).
#: A peer that speaks UCX's TCP transport itself still can: see SECURITY.md.
CONTEXT_OPTIONS = {"TCP_PUT_ENABLE": "n"}


class _FeatureLimitedApi:
    """``ucxx._lib.libucxx`` as ucxx's application context sees it, except that the UCX context
    it creates asks for :data:`FEATURES` only (its ``__init__`` takes no feature flags)."""

    def __init__(self, api: Any) -> None:
        self._api = api

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)

    def UCXContext(self, config_dict: Any = None, feature_flags: Any = None) -> Any:
        flags = tuple(getattr(self._api.Feature, name) for name in FEATURES)
        config = dict(config_dict or {})
        for name, value in CONTEXT_OPTIONS.items():
            if f"UCX_{name}" not in os.environ:  # a user's own setting wins
                config.setdefault(name, value)
        return self._api.UCXContext(config, feature_flags=flags)


def _limit_features() -> None:
    """Have every ucxx context this process creates from now on ask UCX for :data:`FEATURES`
    (other code of the process using ucxx afterwards gets the same context, ucxx keeps one)."""
    from ucxx._lib_async import application_context

    if not isinstance(application_context.ucx_api, _FeatureLimitedApi):
        application_context.ucx_api = _FeatureLimitedApi(application_context.ucx_api)


def check_features(ucxx: Any) -> None:
    """Start ucxx's context in this process (if not yet) and check that it asks UCX for no
    feature beyond :data:`FEATURES`.

    Raises:
        HopliteError: UCX was started in this process before hoplite_gpu (by other code using
            ucxx) with more features, RMA among them (ucxx's default): any peer reaching the
            listener could read and write this process's memory, so the data plane does not
            listen.
    """
    from ucxx._lib.libucxx import Feature

    asked = int(ucxx.core._get_ctx().context.feature_flags)
    extra = [f.name for f in Feature if f.value & asked and f.name not in FEATURES]
    if extra:
        raise HopliteError(
            f"UCX in this process was started with {'/'.join(extra)} (by code using ucxx before "
            "hoplite_gpu), which a peer reaches before authenticating (with RMA it reads and "
            "writes this process's memory): the data plane does not listen on it; start "
            "hoplite_gpu's node before other ucxx users, or in a process of its own"
        )


def net_devices() -> str:
    """The interface UCX was limited to in this process ("" when it was not)."""
    return _net_devices


__all__ = ["CONTEXT_OPTIONS", "FEATURES", "check_features", "load_ucxx", "net_devices", "ucxx_module"]
