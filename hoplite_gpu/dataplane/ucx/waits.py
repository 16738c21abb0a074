"""Awaiting UCX operations: every failure or stall of one becomes a typed error
(:class:`~hoplite_gpu.errors.PeerLostError` unless it is typed already)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from ...errors import HopliteError, PeerLostError


def as_transport_error(exc: BaseException, peer: str, what: str) -> HopliteError:
    """``exc`` of a UCX operation (``what``) with ``peer`` as a typed error: itself if typed, else
    :class:`~hoplite_gpu.errors.PeerLostError`."""
    if isinstance(exc, HopliteError):
        return exc
    return PeerLostError(
        f"{what} with {peer} failed: {type(exc).__name__}: {exc}",
        peer=peer,
        cause=f"{type(exc).__name__}: {exc}",
    )


async def timed(aw: Awaitable[Any], timeout: float, peer: str, what: str) -> Any:
    """Await a UCX operation ``aw`` for at most ``timeout`` s; its failure or stall as a typed error."""
    try:
        return await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:
        raise PeerLostError(
            f"{what} with {peer} made no progress for {timeout} s", peer=peer, cause="stalled"
        ) from None
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise as_transport_error(exc, peer, what) from exc


async def landed(
    fut: asyncio.Future[Any], stops: list[asyncio.Future[None]], timeout: float, peer: str, what: str
) -> None:
    """Wait for a posted receive; give up if a ``stops`` future fails first (the object being
    filled failed: it was lost, reset or deleted; or the directory aborted the transfer) or nothing
    arrived for ``timeout`` s."""
    done, _ = await asyncio.wait({fut, *stops}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if fut in done:
        fut.result()
        return
    for stop in stops:
        if stop in done:
            stop.result()  # raises its error
    raise PeerLostError(f"{what} with {peer} made no progress for {timeout} s", peer=peer, cause="stalled")


def failure_of(fut: asyncio.Future[Any]) -> asyncio.Future[None]:
    """A future that fails with ``fut``'s error if ``fut`` fails, and never succeeds otherwise
    (for :func:`landed`'s ``stops``); hand it to :func:`~hoplite_gpu.iothread.forget` afterwards."""
    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def check(done: asyncio.Future[Any]) -> None:
        if failed.done() or done.cancelled():
            return
        exc = done.exception()
        if exc is not None:
            failed.set_exception(exc)

    fut.add_done_callback(check)
    return failed


__all__ = ["as_transport_error", "failure_of", "landed", "timed"]
