"""Typed errors raised by hoplite_gpu.

Every error derives from :class:`HopliteError`. Errors carry structured fields, survive pickling (they
cross process boundaries, e.g. in Ray), and their message says what to do next.
"""

from __future__ import annotations

from typing import Any


class HopliteError(Exception):
    """Root of every error raised by hoplite_gpu.

    Subclasses keep their constructor arguments in ``self.fields`` so they pickle faithfully.
    """

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields
        for key, value in fields.items():
            setattr(self, key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.fields))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[HopliteError], message: str, fields: dict[str, Any]) -> HopliteError:
    err = cls.__new__(cls)
    HopliteError.__init__(err, message, **fields)
    return err


class HopliteTimeoutError(HopliteError, TimeoutError):
    """A blocking call did not finish within its timeout.

    Fields: ``operation`` (what was waited for), ``timeout`` (seconds), ``object_id`` (hex or None).
    """


class ObjectNotFoundError(HopliteError, KeyError):
    """The object is not known where it was expected (e.g. a peer no longer holds it)."""


class ObjectExistsError(HopliteError):
    """``put`` of an ObjectID that already exists with different content, dtype or shape.

    Use a fresh ObjectID (``ObjectID.random()``) or ``delete`` the old object first.
    """


class ObjectDeletedError(HopliteError):
    """The object was deleted by its owner while this call was waiting for it."""


class ObjectTooLargeError(HopliteError, ValueError):
    """The object is larger than the configured store limit (``Config.max_object_bytes``)."""


class StoreFullError(HopliteError, MemoryError):
    """Storing the object would exceed the node's ``Config.store_capacity_bytes``."""


class PinnedMemoryError(HopliteError, MemoryError):
    """``put(..., pinned=True)``: the store's copy could not be page-locked (``cudaHostRegister``
    refused it: no room for more page-locked memory). Put it without ``pinned``, or free some."""


class QuotaExceededError(HopliteError):
    """The directory refused a request because the node already has as many of that kind
    outstanding as it allows (pending lookups, unfinished reductions or their inputs, bytes of small
    objects kept inline); the message says which quota and its limit. Finish, cancel or delete some
    first, or raise the directory's setting (``Config.directory_max_pending_lookups``,
    ``Config.directory_max_reductions``, ``Config.directory_max_reduce_inputs``,
    ``Config.directory_max_inline_bytes``)."""


class InvalidArgumentError(HopliteError, ValueError):
    """An argument has the wrong type or value (e.g. an unsupported array type or dtype)."""


class CollectiveArgumentError(InvalidArgumentError, RuntimeError):
    """A group collective refused its arrays once it ran: they do not match what the other members
    put (shape, dtype). A :class:`RuntimeError` too, which is what ``ray.util.collective``'s
    backends raise for these, so code written for gloo catches it."""


class NotDecodableError(InvalidArgumentError):
    """The coded messages of these workers do not determine the full gradient (too few of them,
    or a set the code cannot decode); wait for more workers.

    Fields: ``workers`` (the set given), ``needed`` (how many distinct workers any decodable set
    has at least).
    """


class AuthenticationError(HopliteError):
    """A peer or the directory refused our token, or presented a wrong one.

    Check that every process uses the token printed by the process that started the directory
    (``node.token`` or the ``HOPLITE_TOKEN`` environment variable).
    """


class ProtocolError(HopliteError):
    """A malformed, oversized or unexpected message was received; the connection was closed."""


class TransportError(HopliteError, ConnectionError):
    """A data-plane (UCX) or control-plane connection failed.

    Fields: ``peer`` ("host:port"), ``cause`` (the underlying error's type and text).
    """


class PeerLostError(TransportError):
    """The peer serving or receiving a transfer went away in the middle of it."""


class DirectoryUnavailableError(TransportError):
    """The directory cannot be reached (not started, wrong address, or it went away)."""


class ReduceMismatchError(HopliteError, ValueError):
    """Inputs of a reduction differ in dtype or shape; nothing was reduced.

    Fields: ``object_id`` (hex of the offending input), ``reduction_id`` (hex).
    """


class ReductionFailedError(HopliteError):
    """A reduction could not produce its result (an input vanished or a tree vertex failed).

    Fields: ``reduction_id`` (hex), ``cause`` (what went wrong). Request it again under a new id.
    """


class ObjectLostError(HopliteError):
    """Every complete copy of the object died while this call was receiving it, so it can never
    complete. Fields: ``object_id`` (hex). Put it again (a restarted task that puts it again under
    the same ObjectID is picked up by new gets and reductions).
    """


class MemberLostError(HopliteError):
    """A member of a watched group is gone (:class:`hoplite_gpu.collective.Group` with
    ``watch=True``): its process died or closed its node, its lease ran out, or it gave up on the
    group. Every collective of the group in flight on this member, and every later one, raises
    it; make a new group (under a new name) with the members left.

    Fields: ``group`` (its name), ``rank`` (this member), ``lost_ranks`` (ascending), ``reasons``
    (rank -> why).
    """


class DeviceIpcError(HopliteError):
    """Device memory of another process on this host could not be opened (CUDA IPC: its process is
    gone, no peer access between the devices, or a handle of another machine). Reads fall back to
    the data plane; this reaches a caller only from :mod:`hoplite_gpu.memory.device` directly."""


class NodeClosedError(HopliteError, RuntimeError):
    """The node was closed; create a new one with ``hoplite_gpu.init`` or ``hoplite_gpu.connect``."""


class WeightSyncError(HopliteError):
    """A weight version could not be received whole (:mod:`hoplite_gpu.weights`): a bucket's holder
    died with no other copy, it arrived with other bytes than its manifest names, or a manifest is
    malformed. Nothing of the version was written into the caller's tensors.

    Fields: ``name`` (the weights' name), ``version``, ``rank`` (the publishing rank), ``bucket``
    (index, -1 for a manifest), ``holder`` (the publisher's node id and data address), ``cause``.
    """


class VersionRetiredError(WeightSyncError, ObjectDeletedError):
    """The weight version asked for was retired by its publisher (it keeps its newest versions
    only, ``WeightPublisher(keep=...)``); receive a newer one (``version=None``: the newest)."""


class ObjectReset(HopliteError):
    """A partial copy of a reduction's result was voided (the tree is being rebuilt after a
    failure); a get of it starts again from byte 0. Internal: never raised to callers."""


def as_hoplite_error(exc: BaseException, object_id: Any) -> HopliteError:
    """The error waiters of an abandoned put or get of ``object_id`` (an ObjectID) see: ``exc``
    itself if typed, else a cancellation."""
    if isinstance(exc, HopliteError):
        return exc
    return ObjectDeletedError(f"get of {object_id} was cancelled", object_id=object_id.hex())


#: Errors the directory reports by name (``error_kind`` of a reply), and the class of each.
_REMOTE_KINDS: dict[str, type[HopliteError]] = {
    cls.__name__: cls
    for cls in (
        HopliteTimeoutError,
        InvalidArgumentError,
        NotDecodableError,
        ObjectDeletedError,
        ObjectExistsError,
        ObjectLostError,
        ObjectNotFoundError,
        ProtocolError,
        QuotaExceededError,
        ReduceMismatchError,
        ReductionFailedError,
    )
}


def from_kind(kind: str, message: str, **fields: Any) -> HopliteError:
    """The typed error for one the directory reported as ``kind`` (:class:`HopliteError` for a
    kind it does not name)."""
    return _REMOTE_KINDS.get(kind, HopliteError)(message, **fields)


__all__ = [
    "AuthenticationError",
    "DeviceIpcError",
    "DirectoryUnavailableError",
    "HopliteError",
    "HopliteTimeoutError",
    "InvalidArgumentError",
    "NodeClosedError",
    "NotDecodableError",
    "ObjectDeletedError",
    "ObjectExistsError",
    "ObjectLostError",
    "ObjectNotFoundError",
    "ObjectTooLargeError",
    "PeerLostError",
    "PinnedMemoryError",
    "ProtocolError",
    "QuotaExceededError",
    "ReduceMismatchError",
    "ReductionFailedError",
    "StoreFullError",
    "TransportError",
    "VersionRetiredError",
    "WeightSyncError",
]
