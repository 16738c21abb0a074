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
from .fields import FIELD_LIMITS, MAX_TEXT_CHARS
from .messages import _REGISTRY, FROM_NODES, Message

PROTOCOL_VERSION = 11  # 2: PULL_REQUEST carries the chunk size; 3: shared-memory copies; 4: reduce;
# 5: heartbeats, failed senders, lost and reset objects; 6: rejoining a restarted directory;
# 7: a reduction's requested tree degree, direct lookups; 8: one tag per chunk (chunk_tag);
# 9: weighted reductions; 10: decoded as inputs arrive (num_objects 0 with coding); 11: Goodbye
FRAME_HEADER = struct.Struct(">I")

_HINT_CACHE: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINT_CACHE.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        hints = {f.name: hints[f.name] for f in fields(cls)}
        _HINT_CACHE[cls] = hints
    return hints


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (inner,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, inner) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def encode(msg: Message) -> bytes:
    """Serialize a message into one frame (length prefix included)."""
    body = {f.name: getattr(msg, f.name) for f in fields(msg)}  # type: ignore[arg-type]
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
    hints = _hints(cls)
    for name, value in body.items():
        hint = hints.get(name)
        if hint is None:
            raise ProtocolError(f"{kind}: unexpected field {name!r}")
        if not _matches(value, hint):
            raise ProtocolError(f"{kind}: field {name!r} has type {type(value).__name__}")
        if (
            cls in FROM_NODES
            and isinstance(value, (str, bytes))
            and len(value) > FIELD_LIMITS.get(name, MAX_TEXT_CHARS)
        ):
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
