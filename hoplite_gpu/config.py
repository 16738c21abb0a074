"""Configuration of a node and of the directory.

Every field can be overridden by an environment variable ``HOPLITE_<FIELD_NAME_UPPER>``; explicit
keyword arguments win over the environment.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any

from .errors import InvalidArgumentError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: UCX settings applied (unless already set in the environment) before UCX is first imported.
#: Measured on the 2-core development machines over loopback TCP (see bench/p2p.py and README):
#: the rendezvous protocol over TCP moved 0.5-1 GB/s, the eager protocol (RNDV_THRESH=inf) about
#: 5 GB/s; "blocking" progress costs ~3% of a core when idle, "polling" a whole core.
UCX_DEFAULTS: dict[str, str] = {
    "UCX_TLS": "tcp",
    "UCX_RNDV_THRESH": "inf",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCXPY_PROGRESS_MODE": "blocking",
}


@dataclass(frozen=True, slots=True)
class Config:
    """Tunables for a node (and the embedded directory).

    Attributes:
        chunk_bytes: Size of one data-plane chunk. 4 MiB measured best with 4 in flight.
        chunks_in_flight: How many chunks a receiver has posted ahead of the data.
        inline_threshold_bytes: Objects up to this size live inline in the directory.
        max_object_bytes: Largest object ``put`` accepts.
        store_capacity_bytes: Total bytes a node's local store may hold.
        max_control_message_bytes: Control messages larger than this are rejected (connection closed).
        connect_timeout: Seconds to connect and authenticate to the directory or a peer.
        request_timeout: Seconds to wait for a directory reply to a non-blocking request.
        stall_timeout: Seconds a transfer may make no progress before it is treated as failed.
        default_get_timeout: Timeout of ``get`` when the caller passes ``timeout=None``;
            ``0`` means wait forever.
        send_rate_limit: Bytes per second a node serves at most (0 = unlimited); for traffic shaping
            and for tests that need a slow sender.
        listen_host: Interface the data-plane listener and the embedded directory bind to.
        advertise_host: Address peers use to reach this node (defaults to ``listen_host``).
        verify_digest: Check a received object's digest against the one recorded at ``put``.
        close_grace: Seconds ``Node.close`` lets transfers it is serving finish.
    """

    chunk_bytes: int = 4 * MiB
    chunks_in_flight: int = 4
    inline_threshold_bytes: int = 64 * KiB
    max_object_bytes: int = 16 * GiB
    store_capacity_bytes: int = 64 * GiB
    max_control_message_bytes: int = 0  # 0: derived from inline_threshold_bytes
    connect_timeout: float = 10.0
    request_timeout: float = 30.0
    stall_timeout: float = 30.0
    default_get_timeout: float = 0.0
    send_rate_limit: float = 0.0
    listen_host: str = "127.0.0.1"
    advertise_host: str = ""
    verify_digest: bool = False
    close_grace: float = 10.0

    def __post_init__(self) -> None:
        positive = ("chunk_bytes", "chunks_in_flight", "max_object_bytes", "store_capacity_bytes")
        for name in positive:
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"Config.{name} must be > 0", argument=name)
        for name in ("connect_timeout", "request_timeout", "stall_timeout"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"Config.{name} must be > 0 seconds", argument=name)
        if self.inline_threshold_bytes < 0 or self.send_rate_limit < 0:
            raise InvalidArgumentError("Config sizes and rates must be >= 0", argument="config")

    @property
    def control_message_limit(self) -> int:
        """Largest control message accepted, in bytes."""
        if self.max_control_message_bytes:
            return self.max_control_message_bytes
        return self.inline_threshold_bytes + 1 * MiB

    @property
    def data_host(self) -> str:
        """Address advertised to peers for the data plane."""
        return self.advertise_host or self.listen_host

    @classmethod
    def from_env(cls, **overrides: Any) -> Config:
        """Build a Config from ``HOPLITE_*`` environment variables, then ``overrides``."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = os.environ.get("HOPLITE_" + f.name.upper())
            if raw is None:
                continue
            kind: Any = type(f.default)
            try:
                if kind is bool:
                    values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
                else:
                    values[f.name] = kind(raw)
            except ValueError as exc:
                raise InvalidArgumentError(
                    f"environment variable HOPLITE_{f.name.upper()}={raw!r} is not a {kind.__name__}",
                    argument=f.name,
                ) from exc
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise InvalidArgumentError(f"unknown Config fields: {sorted(unknown)}", argument="config")
        return cls(**values)

    def replace(self, **changes: Any) -> Config:
        """Return a copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def apply_ucx_defaults() -> None:
    """Set the measured UCX defaults in the environment unless the user set them already."""
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)
