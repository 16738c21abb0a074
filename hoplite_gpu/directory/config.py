"""The directory's settings: one frozen :class:`DirectoryConfig` for the state machine and its
service, with the defaults of :class:`~hoplite_gpu.config.Config` (written there once)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config

_DEFAULT = Config()  # the defaults every field below takes

#: Finished or failed reductions the directory remembers (for ``reduced_objects`` and lookups).
REDUCTIONS_KEPT = 10_000
#: How many events the directory keeps for :class:`~hoplite_gpu.protocol.EventLogRequest`.
EVENT_LOG_CAPACITY = 100_000
#: Default bound of the event log's size in bytes (estimated: see
#: :func:`~hoplite_gpu.directory.eventlog.event_bytes`); the oldest events go first once either
#: bound is reached.
EVENT_LOG_BYTES: int = _DEFAULT.directory_event_log_bytes
#: Inputs a reduction places per event when they are already present (see
#: :class:`~hoplite_gpu.directory.events.Resume`): about 5-10 ms of the directory's time on the
#: development machines.
PLACE_SLICE: int = _DEFAULT.directory_place_slice
#: A suspect node's heartbeat clears the suspicion only if it arrives this long after it (one sent
#: just before the node stopped may still be in flight).
SUSPECT_GRACE = 0.25
#: Rebuilds of one reduction's tree after failures before it is failed instead.
MAX_REPAIRS = 64


@dataclass(frozen=True, slots=True)
class DirectoryConfig:
    """Settings of one directory (see the ``Config`` field named in each line for more).

    Args:
        inline_threshold_bytes: Objects up to this size are stored inline
            (``Config.inline_threshold_bytes``).
        lease_timeout: Seconds of silence after which a node is declared dead
            (``Config.lease_timeout``).
        validate: Check every invariant after each event (``Config.validate_directory``; it costs
            a pass over the whole state per event). A :class:`~.state.DirectoryState` raises
            :class:`~.invariants.InvariantError` on a broken one (for tests); a
            :class:`~.service.DirectoryService` logs and records it and goes on serving.
        violation_log: A service appends each broken invariant to this file as well
            (``Config.directory_violation_log``; empty: none).
        max_pending_lookups: Per-node quota of waiting lookups
            (``Config.directory_max_pending_lookups``).
        max_reductions: Per-node quota of unfinished reductions
            (``Config.directory_max_reductions``).
        max_reduce_inputs: Per-node quota of the inputs (weights and encoding numbers included) of
            the reductions held here, finished ones included (``Config.directory_max_reduce_inputs``).
        max_inline_bytes: Per-node quota of bytes of the objects a node put (or restored) that are
            stored inline here (``Config.directory_max_inline_bytes``).
        event_log_bytes: Bound of the event log's estimated size; with :data:`EVENT_LOG_CAPACITY`
            events, the oldest go first (``Config.directory_event_log_bytes``).
        place_slice: Present inputs a reduction places per event (``Config.directory_place_slice``).
        max_message_bytes: Larger control frames are refused and the connection closed
            (``Config.control_message_limit``).
        max_unread_bytes: A node whose unread replies exceed this is dropped
            (``Config.directory_unread_bytes``).
        max_handshakes: Connections beyond this many still authenticating are closed at once
            (``Config.directory_max_handshakes``).
        max_handshakes_per_address: The same, counted per peer address
            (``Config.directory_max_handshakes_per_address``).
    """

    inline_threshold_bytes: int = _DEFAULT.inline_threshold_bytes
    lease_timeout: float = _DEFAULT.lease_timeout
    validate: bool = _DEFAULT.validate_directory
    violation_log: str = _DEFAULT.directory_violation_log
    max_pending_lookups: int = _DEFAULT.directory_max_pending_lookups
    max_reductions: int = _DEFAULT.directory_max_reductions
    max_reduce_inputs: int = _DEFAULT.directory_max_reduce_inputs
    max_inline_bytes: int = _DEFAULT.directory_max_inline_bytes
    event_log_bytes: int = EVENT_LOG_BYTES
    place_slice: int = PLACE_SLICE
    # The service's own (the state machine does not read them).
    max_message_bytes: int = _DEFAULT.control_message_limit
    max_unread_bytes: int = _DEFAULT.directory_unread_bytes
    max_handshakes: int = _DEFAULT.directory_max_handshakes
    max_handshakes_per_address: int = _DEFAULT.directory_max_handshakes_per_address

    @classmethod
    def from_config(cls, config: Config) -> DirectoryConfig:
        """The directory settings of ``config`` (its TLS context is the service's own argument)."""
        return cls(
            inline_threshold_bytes=config.inline_threshold_bytes,
            lease_timeout=config.lease_timeout,
            validate=config.validate_directory,
            violation_log=config.directory_violation_log,
            max_pending_lookups=config.directory_max_pending_lookups,
            max_reductions=config.directory_max_reductions,
            max_reduce_inputs=config.directory_max_reduce_inputs,
            max_inline_bytes=config.directory_max_inline_bytes,
            event_log_bytes=config.directory_event_log_bytes,
            place_slice=config.directory_place_slice,
            max_message_bytes=config.control_message_limit,
            max_unread_bytes=config.directory_unread_bytes,
            max_handshakes=config.directory_max_handshakes,
            max_handshakes_per_address=config.directory_max_handshakes_per_address,
        )
