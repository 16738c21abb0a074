"""The control plane's framing and codec.

A frame is a 4-byte big-endian length followed by a msgpack array
``[PROTOCOL_VERSION, message_type, {field: value}]``. :func:`decode` validates the version, the
type name, the field names and each field's type, bounds the texts of messages from nodes
(:data:`~.fields.FIELD_LIMITS`), then runs the message's own ``check()``; it raises
:class:`~hoplite_gpu.errors.ProtocolError` on anything else.
"""

from __future__ import annotations

import asyncio
import struct
import typing
from dataclasses import fields
from typing import Any

import msgpack

from ..errors import ProtocolError
from . import replies  # noqa: F401  (defining its classes registers them in _REGISTRY)
from .fields import FIELD_LIMITS, MAX_TEXT_CHARS
from .messages import _REGISTRY, FROM_NODES, Message

PROTOCOL_VERSION = 20  # 2: PULL_REQUEST carries the chunk size; 3: shared-memory copies; 4: reduce;
# 5: heartbeats, failed senders, lost and reset objects; 6: rejoining a restarted directory;
# 7: a reduction's requested tree degree, direct lookups; 8: one tag per chunk (chunk_tag);
# 9: weighted reductions; 10: decoded as inputs arrive (num_objects 0 with coding); 11: Goodbye;
# 12: barriers; 13: caller channels (Hello.channel); 14: objects a barrier releases;
# 15: a sender that no longer holds the object (TransferDone.sender_lacks);
# 16: inputs placed in the listed order (ReduceRequest.ordered), lookups via a holder (via);
# 17: agreements (BarrierRequest.group_id and vote, BarrierReply.members and vote);
# 18: how many nodes share a node's host (HostPeers); 19: several objects in one delete
# (DeleteRequest.also, DeleteReply.deleted_also and kept_also); 20: a watched group's parent
# (WatchRequest.parent and parent_ranks)
FRAME_HEADER = struct.Struct(">I")


def local_socket_name(directory_id: str) -> str:
    """The abstract Unix socket a directory without TLS also listens on, for the processes of its
    host: an abstract name belongs to its network namespace, so a process in another one (another
    host, or an emulated one) cannot reach it, and it goes with the directory's last descriptor."""
    return f"\0hoplite-gpu/{directory_id}"


Check = typing.Callable[[Any], bool]


def _is_union(hint: Any) -> bool:
    """Whether ``hint`` is ``A | B`` (or ``Optional[A]``)."""
    origin = typing.get_origin(hint)
    return origin is typing.Union or str(origin) == "<class 'types.UnionType'>"


def _checker(hint: Any) -> Check:
    """A function telling whether a decoded value has the type ``hint`` (a field's annotation),
    built once per field: decoding runs on the directory's one event loop for every message."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return lambda value: True
    if _is_union(hint):
        options = tuple(_checker(h) for h in typing.get_args(hint))
        return lambda value: any(check(value) for check in options)
    if hint is type(None):
        return lambda value: value is None
    if origin is list:
        (inner,) = typing.get_args(hint)
        item = _checker(inner)
        return lambda value: isinstance(value, list) and all(item(v) for v in value)
    if origin is dict:
        return lambda value: isinstance(value, dict)
    if hint is float:
        return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool)
    return lambda value: isinstance(value, hint)


#: The exact types msgpack decodes a value of each simple annotation to (bool is not an int here,
#: an int is a float): a field of one of these is checked by its type alone.
_EXACT: dict[Any, frozenset[type]] = {
    int: frozenset({int}),
    float: frozenset({int, float}),
    bool: frozenset({bool}),
    str: frozenset({str}),
    bytes: frozenset({bytes}),
    type(None): frozenset({type(None)}),
}


def _exact_types(hint: Any) -> frozenset[type] | None:
    """The exact types a value of ``hint`` may have, where the type alone decides (a simple
    annotation or a union of them); None where :func:`_checker` must look inside (lists)."""
    if hint in _EXACT:
        return _EXACT[hint]
    if _is_union(hint):
        args = typing.get_args(hint)
        parts = [part for part in map(_exact_types, args) if part is not None]
        if len(parts) == len(args):
            return frozenset().union(*parts)
    return None


#: A field's check: the exact types its value may have (None: call the check function), the
#: check function, and its text limit (None where the field is not bounded: messages not from nodes).
_Field = tuple[frozenset[type] | None, Check, int | None]
#: Per message class: its field names in order, and each field's check.
_Layout = tuple[tuple[str, ...], dict[str, _Field]]
_LAYOUTS: dict[type, _Layout] = {}


def _layout(cls: type) -> _Layout:
    layout = _LAYOUTS.get(cls)
    if layout is None:
        hints = _hints(cls)
        names = tuple(hints)
        bounded = cls in FROM_NODES
        checks = {
            name: (
                _exact_types(hints[name]),
                _checker(hints[name]),
                FIELD_LIMITS.get(name, MAX_TEXT_CHARS) if bounded else None,
            )
            for name in names
        }
        layout = _LAYOUTS[cls] = (names, checks)
    return layout


def _hints(cls: type) -> dict[str, Any]:
    """A message class's field annotations, by field name."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def encode(msg: Message) -> bytes:
    """Serialize a message into one frame (length prefix included)."""
    names = _layout(type(msg))[0]
    body = {name: getattr(msg, name) for name in names}
    payload = msgpack.packb([PROTOCOL_VERSION, msg.TYPE, body], use_bin_type=True)
    return FRAME_HEADER.pack(len(payload)) + payload


def decode(payload: bytes) -> Message:
    """Parse and validate one frame body (without the length prefix)."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable control message: {exc}") from exc
    if not (isinstance(obj, list) and len(obj) == 3):
        raise ProtocolError("control message is not [version, type, body]")
    version, kind, body = obj
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} not supported (this build speaks {PROTOCOL_VERSION}); "
            "run the same hoplite_gpu version everywhere",
            version=version,
        )
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None or not isinstance(body, dict):
        raise ProtocolError(f"unknown control message type {kind!r}")
    checks = _layout(cls)[1]
    for name, value in body.items():
        field = checks.get(name)
        if field is None:
            raise ProtocolError(f"{kind}: unexpected field {name!r}")
        exact, matches, limit = field
        kind_of = type(value)
        if not (kind_of in exact if exact is not None else matches(value)):
            raise ProtocolError(f"{kind}: field {name!r} has type {kind_of.__name__}")
        if limit is not None and (kind_of is str or kind_of is bytes) and len(value) > limit:
            raise ProtocolError(f"{kind}: field {name!r} is {len(value)} long, over its limit")
    try:
        msg = cls(**body)
    except TypeError as exc:
        raise ProtocolError(f"{kind}: {exc}") from exc
    msg.check()
    return msg


def frame_length(header: bytes, limit: int) -> int:
    """Length announced by a frame header; raises :class:`ProtocolError` above ``limit``."""
    (length,) = FRAME_HEADER.unpack(header)
    if length > limit:
        raise ProtocolError(f"control message of {length} bytes exceeds the limit of {limit}")
    return int(length)


async def read_frame(reader: asyncio.StreamReader, limit: int) -> Message:
    """Read and decode one control frame (raises ProtocolError / IncompleteReadError)."""
    header = await reader.readexactly(FRAME_HEADER.size)
    return decode(await reader.readexactly(frame_length(header, limit)))
