"""The rollout engine's side: :class:`WeightSubscriber` finds the newest version of named weights
and receives it whole, each bucket pulled through hoplite's trees (from the publisher or from any
subscriber that holds or is still receiving it)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine, Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import (
    HopliteError,
    HopliteTimeoutError,
    InvalidArgumentError,
    ObjectDeletedError,
    VersionRetiredError,
    WeightSyncError,
)
from ..iothread import all_or_cancel
from ..node import Node
from ..object_id import ObjectID
from .arrays import bucket_digest, check_entry, check_into, fill, new_tensor
from .manifest import MAX_MANIFEST_BYTES, Manifest, TensorEntry, decode_digests, object_id
from .publisher import _check_name, delete_all

#: Longest pause between two reads of a head that its publisher is moving (deleted, then put).
HEAD_RETRY_MAX = 0.05


def _left(deadline: float, what: str, timeout: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise HopliteTimeoutError(f"{what}: not done within {timeout} s", operation=what, timeout=timeout)
    return left


class WeightSubscriber:
    """Receives versions of named weights that :class:`~hoplite_gpu.weights.WeightPublisher`\\ s
    publish.

    Args:
        node: This process's node.
        name: The weights' name.
        keep_previous: Keep this node's copies of a version after a newer one was received
            (they serve later receivers until the publisher retires the version). By default a
            node drops them once it received the next version, so it holds one version.
        verify: Check every bucket against its digest (xxh3-128, put after the buckets; about 10 GB/s
            of one core). Without it, bytes are as exact as the transport (TCP's checksums).
    """

    def __init__(self, node: Node, name: str, *, keep_previous: bool = False, verify: bool = True) -> None:
        if not isinstance(node, Node):
            raise InvalidArgumentError("WeightSubscriber needs a hoplite_gpu Node", argument="node")
        self.node, self.name = node, _check_name(name)
        self.keep_previous, self.verify = keep_previous, verify
        self.received: int | None = None  # the version received last
        self._held: list[ObjectID] = []  # this node's copies of that version (dropped for the next)
        self._own = False  # this node published that version: deleting it would delete it everywhere

    def __repr__(self) -> str:
        return f"<WeightSubscriber {self.name!r} received={self.received}>"

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        if self.node.closed:
            coro.close()
            raise InvalidArgumentError("the subscriber's node is closed", argument="node")
        return self.node.io.run(coro)

    # ------------------------------------------------------------ versions
    def latest(self, timeout: float = 30.0, newer_than: int | None = None) -> int:
        """The newest published version; waits for the first one, and with ``newer_than`` for
        one greater than it (without polling: the publisher links each version to the next).

        Raises:
            HopliteTimeoutError: none (or none newer) within ``timeout`` seconds.
        """
        deadline = time.monotonic() + _positive(timeout)
        return int(self._run(self._latest(deadline, timeout, newer_than))[0])

    async def _latest(self, deadline: float, timeout: float, newer_than: int | None) -> tuple[int, int]:
        version, world = await self._head(deadline, timeout)
        while newer_than is not None and version <= newer_than:
            what = f"a version of weights {self.name!r} newer than {newer_than}"
            after = object_id(self.name, "after", version)
            try:
                raw = await self.node.get_async(after, timeout=_left(deadline, what, timeout))
            except ObjectDeletedError:  # retired meanwhile: the head is newer
                version, world = await self._head(deadline, timeout)
                continue
            version = int(np.frombuffer(bytes(raw), np.int64)[0])
        return version, world

    async def _head(self, deadline: float, timeout: float) -> tuple[int, int]:
        what, pause = f"the newest version of weights {self.name!r}", 0.001
        while True:
            try:
                raw = await self.node.get_async(
                    object_id(self.name, "head"), timeout=_left(deadline, what, timeout)
                )
            except ObjectDeletedError:  # the publisher deletes the head, then puts the new one
                await asyncio.sleep(min(pause, HEAD_RETRY_MAX))
                pause *= 2
                continue
            try:
                head = json.loads(bytes(raw))
                return int(head["version"]), int(head["world_size"])
            except (ValueError, KeyError, TypeError) as exc:
                raise WeightSyncError(
                    f"the head of weights {self.name!r} is malformed ({exc})",
                    name=self.name,
                    version=-1,
                    rank=0,
                    bucket=-1,
                    holder="",
                    cause="malformed head",
                ) from None

    # ------------------------------------------------------------ receive
    def receive(
        self,
        version: int | None = None,
        into: Mapping[str, Any] | None = None,
        names: Iterable[str] | None = None,
        timeout: float = 60.0,
    ) -> tuple[int, dict[str, Any]]:
        """Receive a version whole: every bucket at once, each checked, then the tensors.

        Args:
            version: Which version (waits for it if not yet published); None: the newest (if it
                is retired while being received, the newest then is received instead).
            into: Tensors (NumPy arrays, CPU or CUDA torch tensors) to fill in place, by name,
                with the published shapes and dtypes. They are written only once every bucket
                arrived and checked: on an error, none was touched.
            names: Receive only these tensors (default: all of the version).
            timeout: Seconds for the whole call.

        Returns:
            ``(version, tensors)``: by name, ``into``'s tensor where given, else a new one
            (NumPy: a read-only view of this node's copy; torch: a new CPU tensor).

        Raises:
            HopliteTimeoutError: not received within ``timeout`` (the message names the bucket).
            VersionRetiredError: ``version`` was retired by its publisher.
            WeightSyncError: a bucket was lost with its holders, arrived with other bytes than
                its manifest names, or a manifest is malformed.
            InvalidArgumentError: ``into`` or ``names`` name a tensor the version lacks, or an
                ``into`` tensor's shape or dtype differs.
        """
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
            raise InvalidArgumentError(
                f"version must be an int >= 0 or None, got {version!r}", argument="version"
            )
        if into is not None and not isinstance(into, Mapping):
            raise InvalidArgumentError("into must be a mapping of names to tensors", argument="into")
        if isinstance(names, str):
            raise InvalidArgumentError("names must be a collection of names, not one str", argument="names")
        wanted = None if names is None else set(names)
        deadline = time.monotonic() + _positive(timeout)
        got, tensors = self._run(self._receive(version, into or {}, wanted, deadline, timeout))
        return got, tensors

    async def _receive(
        self,
        version: int | None,
        into: Mapping[str, Any],
        wanted: set[str] | None,
        deadline: float,
        timeout: float,
    ) -> tuple[int, dict[str, Any]]:
        while True:
            v = version if version is not None else (await self._head(deadline, timeout))[0]
            try:
                return v, await self._receive_version(v, into, wanted, deadline, timeout)
            except VersionRetiredError:
                if version is not None:
                    raise

    async def _manifest(self, version: int, rank: int, deadline: float, timeout: float) -> Manifest:
        what = f"the manifest of rank {rank} in version {version} of weights {self.name!r}"
        try:
            raw = await self.node.get_async(
                object_id(self.name, "manifest", version, rank), timeout=_left(deadline, what, timeout)
            )
        except ObjectDeletedError:
            raise self._retired(version, rank, -1, "") from None
        if raw.nbytes > MAX_MANIFEST_BYTES:
            raise WeightSyncError(
                f"{what} has {raw.nbytes} bytes, more than {MAX_MANIFEST_BYTES}",
                name=self.name,
                version=version,
                rank=rank,
                bucket=-1,
                holder="",
                cause="malformed manifest",
            )
        return Manifest.decode(bytes(raw), self.name, version, rank)

    def _retired(self, version: int, rank: int, bucket: int, holder: str) -> VersionRetiredError:
        return VersionRetiredError(
            f"version {version} of weights {self.name!r} was retired (or withdrawn) by its publisher; "
            "receive a newer one",
            name=self.name,
            version=version,
            rank=rank,
            bucket=bucket,
            holder=holder,
            cause="retired",
        )

    async def _receive_version(
        self, version: int, into: Mapping[str, Any], wanted: set[str] | None, deadline: float, timeout: float
    ) -> dict[str, Any]:
        first = await self._manifest(version, 0, deadline, timeout)
        rest = await all_or_cancel(
            self._manifest(version, r, deadline, timeout) for r in range(1, first.world_size)
        )
        manifests = [first, *rest]
        chosen = [(m, t) for m in manifests for t in m.tensors if wanted is None or t.name in wanted]
        self._check(version, manifests, chosen, into, wanted)
        places = sorted({(m.rank, t.bucket) for m, t in chosen})
        ranks = sorted({r for r, _ in places})
        digests = {
            r: asyncio.ensure_future(self._digests(manifests[r], deadline, timeout))
            for r in ranks
            if self.verify
        }
        try:
            pulls = (self._bucket(manifests[r], i, digests.get(r), deadline, timeout) for r, i in places)
            buckets = dict(zip(places, await all_or_cancel(pulls), strict=True))
        finally:
            for task in digests.values():
                task.cancel()
            await asyncio.gather(*digests.values(), return_exceptions=True)
        tensors: dict[str, Any] = {}
        for m, t in chosen:
            src = buckets[m.rank, t.bucket][t.offset : t.offset + t.nbytes]
            if t.name in into:
                fill(t, into[t.name], src)
                tensors[t.name] = into[t.name]
            else:
                tensors[t.name] = new_tensor(t, src)
        held = [object_id(self.name, "bucket", version, r, i) for r, i in places]
        held += [object_id(self.name, "manifest", version, m.rank) for m in manifests]
        held += [object_id(self.name, "digests", version, r) for r in digests]
        await self._drop_previous(version, held, {m.holder.split(" ")[0] for m in manifests})
        return tensors

    def _check(
        self,
        version: int,
        manifests: list[Manifest],
        chosen: list[tuple[Manifest, TensorEntry]],
        into: Mapping[str, Any],
        wanted: set[str] | None,
    ) -> None:
        """Refuse before pulling: a malformed entry, a name the version lacks, a wrong ``into``."""
        found = {t.name for _, t in chosen}
        for what, asked in (("names", wanted or set()), ("into", set(into))):
            missing = sorted(asked - found)
            if missing:
                raise InvalidArgumentError(
                    f"{what} names tensors that version {version} of weights {self.name!r} lacks: "
                    f"{missing[:5]}",
                    argument=what,
                )
        if len(found) != len(chosen):
            raise WeightSyncError(
                f"two ranks of version {version} of weights {self.name!r} publish a tensor of the same name",
                name=self.name,
                version=version,
                rank=-1,
                bucket=-1,
                holder="",
                cause="malformed manifest",
            )
        for m, t in chosen:
            try:
                check_entry(t)
            except InvalidArgumentError as exc:
                raise WeightSyncError(
                    f"the manifest of rank {m.rank} in version {version} of weights {self.name!r}: {exc}",
                    name=self.name,
                    version=version,
                    rank=m.rank,
                    bucket=t.bucket,
                    holder=m.holder,
                    cause="malformed manifest",
                ) from None
            if t.name in into:
                check_into(t, into[t.name])

    async def _get(self, m: Manifest, index: int, deadline: float, timeout: float) -> Any:
        """Get bucket ``index`` of ``m`` (-1: its digests), its errors named after it."""
        what = f"{_part(index)} of rank {m.rank} in version {m.version} of weights {self.name!r}"
        what += f" (held by {m.holder})"
        if index >= 0:
            oid = object_id(self.name, "bucket", m.version, m.rank, index)
        else:
            oid = object_id(self.name, "digests", m.version, m.rank)
        try:
            return await self.node.get_async(oid, timeout=_left(deadline, what, timeout))
        except ObjectDeletedError:
            raise self._retired(m.version, m.rank, index, m.holder) from None
        except HopliteTimeoutError as exc:
            raise HopliteTimeoutError(
                f"{what} did not arrive within {timeout} s",
                operation="receive weights",
                timeout=timeout,
                object_id=oid.hex(),
            ) from exc
        except HopliteError as exc:
            raise self._failed(m, index, f"{type(exc).__name__}: {exc}") from exc

    async def _digests(self, m: Manifest, deadline: float, timeout: float) -> list[str]:
        return decode_digests(bytes(await self._get(m, -1, deadline, timeout)), m)

    async def _bucket(
        self,
        m: Manifest,
        index: int,
        digests: asyncio.Future[list[str]] | None,
        deadline: float,
        timeout: float,
    ) -> np.ndarray[Any, Any]:
        """Bucket ``index`` of ``m``, checked against its size and (with ``digests``) its digest."""
        raw = await self._get(m, index, deadline, timeout)
        entry = m.buckets[index]
        if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.nbytes != entry.nbytes:
            raise self._failed(m, index, f"not {entry.nbytes} bytes as its manifest says")
        if digests is not None and bucket_digest(raw) != (await digests)[index]:
            raise self._failed(m, index, "its bytes do not match their digest")
        return raw

    def _failed(self, m: Manifest, index: int, cause: str) -> WeightSyncError:
        return WeightSyncError(
            f"{_part(index)} of rank {m.rank} in version {m.version} of weights {self.name!r} "
            f"(held by {m.holder}) could not be received: {cause}",
            name=self.name,
            version=m.version,
            rank=m.rank,
            bucket=index,
            holder=m.holder,
            cause=cause,
        )

    async def _drop_previous(self, version: int, held: list[ObjectID], holders: set[str]) -> None:
        """Remember what this node holds of ``version``; drop its copies of the version received
        before (never on a node that published it: there a delete removes it everywhere)."""
        previous, self._held, self.received = self._held, held, version
        own, self._own = self._own, self.node.node_id in holders
        if self.keep_previous or own:
            return
        await delete_all(self.node, set(previous) - set(held), self.name)

    def close(self) -> None:
        """Drop this node's copies of the version received last (unless it published it)."""
        held, self._held = self._held, []
        if held and not self._own and not self.node.closed:
            self._run(delete_all(self.node, held, self.name))


def _part(index: int) -> str:
    """What piece of a rank's part of a version ``index`` names: a bucket, or (-1) its digests."""
    return f"bucket {index}" if index >= 0 else "the digests"


def _positive(timeout: Any) -> float:
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise InvalidArgumentError(f"timeout must be a number > 0, got {timeout!r}", argument="timeout")
    return float(timeout)
