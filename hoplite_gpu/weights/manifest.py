"""What one rank's part of a weight version holds: each tensor's name, dtype, shape and place in
a bucket, and each bucket's size and digest. Pure: it travels as JSON in a small object and is
checked when read, since it comes from another process."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import WeightSyncError
from ..object_id import ObjectID

FORMAT = 1
#: Offsets of tensors in a bucket are multiples of this, so every dtype's view of them is aligned.
ALIGN = 64
#: The largest manifest a subscriber reads (about 80 bytes a tensor: a million tensors).
MAX_MANIFEST_BYTES = 128 * 1024 * 1024
_ID_PREFIX = "hoplite_gpu.weights"


def object_id(name: str, *parts: object) -> ObjectID:
    """The ObjectID of one piece of the weights ``name``: ``("head",)``, ``("after", v)``,
    ``("manifest", v, rank)``, ``("bucket", v, rank, i)`` or ``("digests", v, rank)``. Derived,
    so every process finds it."""
    return ObjectID.from_name("/".join([_ID_PREFIX, name, *map(str, parts)]))


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: ``kind`` is how it was published ("numpy" or "torch"), ``dtype`` its dtype in
    that kind's words (NumPy's wire text, or torch's name such as ``"bfloat16"``)."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketEntry:
    """One bucket: its size. (Its digest comes in the version's digests object, put after the
    buckets: :func:`decode_digests`.)"""

    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """One rank's part of version ``version`` of the weights ``name``, published by ``holder``
    (its node id and data address), one of ``world_size`` publishing ranks."""

    name: str
    version: int
    rank: int
    world_size: int
    holder: str
    tensors: tuple[TensorEntry, ...]
    buckets: tuple[BucketEntry, ...]

    def encode(self) -> bytes:
        """The JSON bytes :meth:`decode` reads."""
        body = {
            "format": FORMAT,
            "name": self.name,
            "version": self.version,
            "rank": self.rank,
            "world_size": self.world_size,
            "holder": self.holder,
            "buckets": [b.nbytes for b in self.buckets],
            "tensors": [
                [t.name, t.kind, t.dtype, list(t.shape), t.bucket, t.offset, t.nbytes] for t in self.tensors
            ],
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes, name: str, version: int, rank: int) -> Manifest:
        """Read the manifest of ``rank`` in version ``version`` of ``name``.

        Raises:
            WeightSyncError: not a manifest this module wrote for that version and rank, or one
                whose tensors lie outside their buckets.
        """

        def bad(why: str) -> WeightSyncError:
            return WeightSyncError(
                f"the manifest of rank {rank} in version {version} of weights {name!r} is malformed: {why}",
                name=name,
                version=version,
                rank=rank,
                bucket=-1,
                holder="",
                cause="malformed manifest",
            )

        try:
            body = json.loads(bytes(raw))
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad(f"not JSON ({exc})") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise bad(f"not format {FORMAT}")
        if (body.get("name"), body.get("version"), body.get("rank")) != (name, version, rank):
            raise bad("it names another weight version or rank")
        world, holder = body.get("world_size"), body.get("holder")
        if (
            not isinstance(world, int)
            or not _int(world)
            or not 0 <= rank < world
            or not isinstance(holder, str)
        ):
            raise bad("bad world_size or holder")
        try:
            buckets = tuple(_bucket(b) for b in body["buckets"])
            tensors = tuple(_tensor(t, buckets) for t in body["tensors"])
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(str(exc)) from None
        if len({t.name for t in tensors}) != len(tensors):
            raise bad("a tensor name appears twice")
        return cls(name, version, rank, world, holder, tensors, buckets)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bucket(raw: Any) -> BucketEntry:
    if not _int(raw):
        raise ValueError(f"bad bucket {raw!r:.80}")
    return BucketEntry(raw)


def decode_digests(raw: bytes, manifest: Manifest) -> list[str]:
    """The xxh3-128 digests (hex) of ``manifest``'s buckets, from its digests object.

    Raises:
        WeightSyncError: not one hex digest per bucket.
    """
    try:
        digests = json.loads(bytes(raw))
    except (ValueError, UnicodeDecodeError):
        digests = None
    if not isinstance(digests, list) or len(digests) != len(manifest.buckets):
        digests = None
    elif not all(isinstance(d, str) and len(d) == 32 for d in digests):
        digests = None
    if digests is None:
        raise WeightSyncError(
            f"the digests of rank {manifest.rank} in version {manifest.version} of weights "
            f"{manifest.name!r} are malformed",
            name=manifest.name,
            version=manifest.version,
            rank=manifest.rank,
            bucket=-1,
            holder=manifest.holder,
            cause="malformed manifest",
        )
    return digests


def _tensor(raw: Any, buckets: Sequence[BucketEntry]) -> TensorEntry:
    name, kind, dtype, shape, bucket, offset, nbytes = raw
    if not isinstance(name, str) or kind not in ("numpy", "torch") or not isinstance(dtype, str):
        raise ValueError(f"bad tensor {raw!r:.80}")
    if not isinstance(shape, list) or not all(_int(d) for d in shape):
        raise ValueError(f"bad shape of {name!r:.80}")
    if not (_int(bucket) and _int(offset) and _int(nbytes)) or bucket >= len(buckets):
        raise ValueError(f"bad place of {name!r:.80}")
    if offset + nbytes > buckets[bucket].nbytes:
        raise ValueError(f"{name!r:.80} lies outside its bucket")
    return TensorEntry(name, kind, dtype, tuple(shape), bucket, offset, nbytes)


def plan(sizes: Sequence[int], bucket_bytes: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Pack tensors of ``sizes`` bytes, in order, into buckets of about ``bucket_bytes``: each
    tensor's (bucket, offset) and each bucket's size. A tensor is never split; one larger than
    ``bucket_bytes`` gets a bucket of its own, and a bucket is closed before it would overflow."""
    places: list[tuple[int, int]] = []
    totals: list[int] = []
    for size in sizes:
        used = totals[-1] if totals else 0
        start = -(-used // ALIGN) * ALIGN
        if not totals or (used and start + size > bucket_bytes):
            totals.append(0)
            start = 0
        places.append((len(totals) - 1, start))
        totals[-1] = start + size
    return places, totals
