"""The ways an object's bytes arrive (:mod:`hoplite_gpu.node.sources`), each on its own."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu import protocol as p
from hoplite_gpu.config import Config
from hoplite_gpu.errors import ObjectReset
from hoplite_gpu.memory import LocalStore
from hoplite_gpu.node import sources
from hoplite_gpu.object_id import ObjectID

pytestmark = pytest.mark.timeout(30)


def context(store: LocalStore, computes: bool = False) -> sources.Context:
    def unused(*_: object) -> None:
        raise AssertionError("a local source neither reports nor makes copies here")

    return sources.Context(
        store=store,
        data=None,  # type: ignore[arg-type]
        config=Config(),
        report=unused,
        completed=unused,
        abandon=unused,
        computes=lambda oid: computes,
        new_copy=unused,  # type: ignore[arg-type]
    )


def test_a_copy_the_directory_places_here_that_is_gone_makes_the_get_ask_again() -> None:
    # The soak on a restarted directory: the root of a reduction was told its own vertex computes
    # the result; the vertex's output was voided as the node rejoined, and the get raised
    # ObjectNotFoundError although the new directory placed the vertex here again an instant later.
    oid = ObjectID.random()
    reply = p.LookupReply(1, "local", oid.binary(), size=8, dtype="<f4", shape=[2])
    source = sources.LocalSource(context(LocalStore(1 << 20)))
    attempt = sources.Attempt(oid, 5.0, None)
    with pytest.raises(sources.Vanished) as raised:
        asyncio.run(source.fill(reply, attempt, 0))
    assert isinstance(raised.value, ObjectReset)  # Fetcher.get starts again (a bounded number of times)


def test_a_get_told_again_and_again_that_a_gone_copy_is_here_raises_not_found() -> None:
    # The bound on asking again: a directory that keeps counting a copy this node no longer holds
    # (dropped here behind its back) gets a typed error at once, not a get that spins or waits.
    node = hg.init()
    try:
        oid = ObjectID.random()
        node.put(np.arange(1 << 16, dtype=np.float32), oid)
        node._store.remove(oid)  # the directory still counts this node's copy
        with pytest.raises(hg.ObjectNotFoundError, match="vanished from this node"):
            node.get(oid, timeout=10)
    finally:
        node.close()
