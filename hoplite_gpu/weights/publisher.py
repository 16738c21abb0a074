"""The trainer's side: :class:`WeightPublisher` packs named tensors into buckets and puts them,
with a manifest, under ids derived from (name, version, rank, bucket); rank 0 then points the
name's head at the new version and links the previous version to it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import HopliteError, HopliteTimeoutError, InvalidArgumentError
from ..memory import BufferPool
from ..node import Node
from ..object_id import ObjectID
from .arrays import bucket_digest, host_bytes
from .manifest import BucketEntry, Manifest, TensorEntry, object_id, plan

log = logging.getLogger(__name__)

#: Default bucket size: large enough that a bucket's pull is mostly bytes (a get costs about a
#: millisecond of round trips), small enough that a 512 MiB state dict has buckets to pull at once.
BUCKET_BYTES = 64 * 1024 * 1024


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > 256:
        raise InvalidArgumentError("weights need a name of 1 to 256 characters", argument="name")
    return name


def head_bytes(version: int, world_size: int) -> np.ndarray[Any, Any]:
    """The head object of a weights name: its newest version, as JSON bytes."""
    return np.frombuffer(json.dumps({"version": version, "world_size": world_size}).encode(), np.uint8)


async def delete_all(node: Node, oids: Iterable[ObjectID], name: str) -> None:
    """Delete ``oids`` at once (on a node that did not put one: its copy), logging failures."""
    oids = list(oids)
    done = await asyncio.gather(*(node.delete_async(o) for o in oids), return_exceptions=True)
    for oid, result in zip(oids, done, strict=True):
        if isinstance(result, BaseException):
            log.warning("could not delete %s of weights %r: %s", oid, name, result)


class WeightPublisher:
    """Publishes versions of named tensors from this process (a trainer, or one rank of several).

    Args:
        node: This process's node.
        name: The weights' name (the same in every publisher and subscriber of them).
        rank: This publisher's rank among ``world_size`` ranks that each publish a part of every
            version (tensor names must differ between ranks).
        world_size: How many ranks publish parts of each version.
        keep: How many newest versions stay available; older ones are deleted everywhere when a
            new one is published (a receive of a deleted version fails with
            :class:`~hoplite_gpu.errors.VersionRetiredError`; one of the newest retries).
        bucket_bytes: Size of the buckets tensors are packed into (a larger tensor gets its own).
        timeout: Seconds each put and delete may take.
    """

    def __init__(
        self,
        node: Node,
        name: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        keep: int = 2,
        bucket_bytes: int = BUCKET_BYTES,
        timeout: float = 60.0,
    ) -> None:
        if not isinstance(node, Node):
            raise InvalidArgumentError("WeightPublisher needs a hoplite_gpu Node", argument="node")
        for what, value, low in (
            ("world_size", world_size, 1),
            ("keep", keep, 1),
            ("bucket_bytes", bucket_bytes, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise InvalidArgumentError(f"{what} must be an int >= {low}, got {value!r}", argument=what)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
            raise InvalidArgumentError(f"rank must be in 0..{world_size - 1}, got {rank!r}", argument="rank")
        self.node, self.name = node, _check_name(name)
        self.rank, self.world_size, self.keep = rank, world_size, keep
        self.bucket_bytes, self.timeout = bucket_bytes, timeout
        # Published and kept, oldest first: each version, its ids and its buckets.
        self.versions: deque[tuple[int, list[ObjectID], list[np.ndarray[Any, Any]]]] = deque()
        # Retired versions' buckets, handed out again once nothing reads them: fresh memory costs
        # a page fault per page (0.5 s for 256 MiB on a 2-core VM, bench/pages/weight-sync.md).
        self._pool = BufferPool(max_bytes=0)
        self.closed = False

    def __repr__(self) -> str:
        latest = self.versions[-1][0] if self.versions else None
        return f"<WeightPublisher {self.name!r} rank {self.rank}/{self.world_size} latest={latest}>"

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def latest(self) -> int | None:
        """The newest version this publisher published (None before the first)."""
        return self.versions[-1][0] if self.versions else None

    def publish(self, tensors: Mapping[str, Any], version: int) -> Manifest:
        """Publish ``tensors`` (name -> NumPy array or torch tensor) as version ``version``.

        The tensors are copied (packed into buckets) before this returns, so the caller may
        update them at once. The manifest goes first and each bucket as soon as it is packed, so
        subscribers waiting for this version (``receive(version=...)``) pull while the rest is
        packed; the buckets' digests go last. The head moves (``latest()``, ``receive()`` of the
        newest) once all of this rank's part is there. Versions must increase; they may skip
        numbers.

        Returns:
            This rank's manifest of the version.

        Raises:
            InvalidArgumentError: not a mapping of str to arrays, no greater version than the
                last, or a closed publisher.
            ObjectExistsError: the version was published before with other content (by a
                publisher of an earlier run: publish a greater version).
            HopliteTimeoutError: not published within the publisher's ``timeout``; what was put
                of the version is withdrawn (a receive waiting for it fails).
        """
        if self.closed:
            raise InvalidArgumentError(f"publisher of {self.name!r} is closed", argument="self")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise InvalidArgumentError(f"version must be an int >= 0, got {version!r}", argument="version")
        if self.latest is not None and version <= self.latest:
            raise InvalidArgumentError(
                f"version {version} of {self.name!r} is not greater than {self.latest}, published last",
                argument="version",
            )
        if not isinstance(tensors, Mapping) or not all(isinstance(k, str) for k in tensors):
            raise InvalidArgumentError("tensors must be a mapping of str names to arrays", argument="tensors")
        views = [(key, *host_bytes(key, value)) for key, value in tensors.items()]
        places, sizes = plan([v[1].nbytes for v in views], self.bucket_bytes)
        entries = [
            TensorEntry(key, kind, dtype, shape, bucket, offset, raw.nbytes)
            for (key, raw, kind, dtype, shape), (bucket, offset) in zip(views, places, strict=True)
        ]
        manifest = Manifest(
            self.name,
            version,
            self.rank,
            self.world_size,
            f"{self.node.node_id} at {self.node.data_address}",
            tuple(entries),
            tuple(BucketEntry(size) for size in sizes),
        )
        oids = [object_id(self.name, "manifest", version, self.rank)]
        oids += [object_id(self.name, "bucket", version, self.rank, i) for i in range(len(sizes))]
        oids.append(object_id(self.name, "digests", version, self.rank))
        deadline = time.monotonic() + self.timeout
        puts = [self._put(np.frombuffer(manifest.encode(), np.uint8), oids[0])]
        buckets, digests = [], []
        contents: list[list[tuple[np.ndarray[Any, Any], TensorEntry]]] = [[] for _ in sizes]
        for (_, raw, *_), entry in zip(views, entries, strict=True):
            contents[entry.bucket].append((raw, entry))
        try:
            for i, size in enumerate(sizes):  # pack one, put it, pack the next meanwhile
                bucket = self._pool.allocate(size)
                for raw, entry in contents[i]:
                    bucket[entry.offset : entry.offset + entry.nbytes] = raw
                buckets.append(bucket)
                digests.append(bucket_digest(bucket))
                puts.append(self._put(bucket, oids[1 + i], digest=False))
            puts.append(self._put(np.frombuffer(json.dumps(digests).encode(), np.uint8), oids[-1]))
            for put in puts:
                put.result(max(0.0, deadline - time.monotonic()))
        except BaseException as exc:
            for put in puts:
                put.cancel()
            self._run(self._delete(oids))
            if isinstance(exc, concurrent.futures.TimeoutError):
                raise HopliteTimeoutError(
                    f"version {version} of weights {self.name!r} was not published within {self.timeout} s",
                    operation="publish",
                    timeout=self.timeout,
                ) from None
            raise
        self._run(self._announce(version, oids, buckets))
        return manifest

    def _put(self, array: np.ndarray[Any, Any], oid: ObjectID, digest: bool = True) -> Any:
        """Start putting ``array`` (kept as it is) on the I/O thread; a future of the put."""
        return self.node.io.submit(self.node.put_async(array, oid, copy=False, digest=digest))

    def _run(self, coro: Any) -> Any:
        return self.node.io.run(asyncio.wait_for(coro, self.timeout))

    async def _announce(self, version: int, oids: list[ObjectID], buckets: list[Any]) -> None:
        """The version is all there: move the head to it (rank 0), and retire the oldest."""
        node = self.node
        previous = self.latest
        self.versions.append((version, oids, buckets))
        if self.rank == 0:
            if previous is not None:
                link = np.array([version], np.int64).view(np.uint8)
                await node.put_async(link, object_id(self.name, "after", previous), copy=False)
            head = object_id(self.name, "head")
            await node.delete_async(head)  # a reader between the two retries (see WeightSubscriber)
            await node.put_async(head_bytes(version, self.world_size), head, copy=False)
        while len(self.versions) > self.keep:
            old, old_oids, old_buckets = self.versions.popleft()
            self._pool.max_bytes = 2 * sum(b.nbytes for b in buckets)  # about two versions
            for bucket in old_buckets:
                self._pool.release(bucket)
            if self.rank == 0:
                old_oids = [*old_oids, object_id(self.name, "after", old)]
            await self._delete(old_oids)

    async def _delete(self, oids: list[ObjectID]) -> None:
        await delete_all(self.node, oids, self.name)

    def close(self) -> None:
        """Delete every kept version (and, on rank 0, the head). Idempotent."""
        if self.closed:
            return
        self.closed = True
        oids = [oid for _, kept, _ in self.versions for oid in kept]
        if self.rank == 0:
            oids += [object_id(self.name, "after", v) for v, _, _ in self.versions]
            oids.append(object_id(self.name, "head"))
        self.versions.clear()
        self._pool.clear()
        if not self.node.closed:
            try:
                self._run(self._delete(oids))
            except HopliteError as exc:
                log.warning("could not delete the versions of weights %r: %s", self.name, exc)
