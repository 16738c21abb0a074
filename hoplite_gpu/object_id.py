"""Object identifiers."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from .errors import InvalidArgumentError

OBJECT_ID_SIZE = 20


class ObjectID:
    """A 20-byte identifier of an immutable object in the store.

    ObjectIDs are hashable, ordered, picklable and compare by value, so they can be passed through
    Ray task arguments or any other channel and used again in another process.
    """

    __slots__ = ("_bytes",)

    def __init__(self, raw: bytes) -> None:
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(
                f"ObjectID needs {OBJECT_ID_SIZE} bytes, got {type(raw).__name__}", argument="raw"
            )
        raw = bytes(raw)
        if len(raw) != OBJECT_ID_SIZE:
            raise InvalidArgumentError(
                f"ObjectID needs exactly {OBJECT_ID_SIZE} bytes, got {len(raw)}; "
                "use ObjectID.from_name() for arbitrary names",
                argument="raw",
            )
        self._bytes = raw

    @classmethod
    def random(cls) -> ObjectID:
        """Return a new random ObjectID (160 bits from ``os.urandom``)."""
        return cls(os.urandom(OBJECT_ID_SIZE))

    @classmethod
    def from_bytes(cls, raw: bytes) -> ObjectID:
        """Return the ObjectID whose binary form is ``raw`` (exactly 20 bytes)."""
        return cls(raw)

    @classmethod
    def from_hex(cls, text: str) -> ObjectID:
        """Return the ObjectID whose hex form (``str(oid)``) is ``text``."""
        try:
            return cls(bytes.fromhex(text))
        except ValueError as exc:
            raise InvalidArgumentError(f"not a hex ObjectID: {text!r}", argument="text") from exc

    @classmethod
    def from_name(cls, name: str) -> ObjectID:
        """Return a deterministic ObjectID for a name: the same name gives the same id everywhere."""
        if not isinstance(name, str):
            raise InvalidArgumentError("ObjectID.from_name needs a str", argument="name")
        return cls(hashlib.blake2b(name.encode(), digest_size=OBJECT_ID_SIZE).digest())

    def binary(self) -> bytes:
        """The 20 raw bytes."""
        return self._bytes

    def hex(self) -> str:
        """The 40-character hex form."""
        return self._bytes.hex()

    def __bytes__(self) -> bytes:
        return self._bytes

    def __hash__(self) -> int:
        return hash(self._bytes)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ObjectID) and other._bytes == self._bytes

    def __lt__(self, other: ObjectID) -> bool:
        return self._bytes < other._bytes

    def __repr__(self) -> str:
        return f"ObjectID({self.hex()})"

    def __str__(self) -> str:
        return self.hex()

    def __reduce__(self) -> tuple[Any, ...]:
        return (ObjectID, (self._bytes,))
