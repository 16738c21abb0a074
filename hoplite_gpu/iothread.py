"""The process-wide event-loop thread that runs all of hoplite_gpu's network work.

Every node and embedded directory of a process shares it; the synchronous API submits coroutines to
it and waits (:meth:`IOThread.run`), the ``*_async`` twins await them from another loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading
from collections.abc import Awaitable, Coroutine, Iterable
from typing import Any, TypeVar

from .errors import HopliteError, HopliteTimeoutError, InvalidArgumentError

T = TypeVar("T")

#: The event loops ``HOPLITE_EVENT_LOOP`` may name (see :func:`new_event_loop`).
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop of the kind ``HOPLITE_EVENT_LOOP`` names: ``uvloop``, ``asyncio`` (the
    standard library's), or ``auto`` (the default: uvloop where it is installed). uvloop's
    turns and system calls cost less: an embedded directory's put, get and delete of 1 KiB took
    0.82x the CPU, a put and get between two processes about 0.9x the time (bench/pages/small-operations.md,
    "Small operations"). An environment variable, not a ``Config`` field: the loop is the
    process's, shared by every node and directory in it, and made before any of their configs."""
    kind = os.environ.get("HOPLITE_EVENT_LOOP", "auto").strip().lower() or "auto"
    if kind not in EVENT_LOOPS:
        raise InvalidArgumentError(
            f"HOPLITE_EVENT_LOOP must be one of {', '.join(EVENT_LOOPS)}, not {kind!r}",
            argument="HOPLITE_EVENT_LOOP",
        )
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError as exc:
            if kind == "uvloop":
                raise InvalidArgumentError(
                    "HOPLITE_EVENT_LOOP=uvloop, but uvloop is not installed", argument="HOPLITE_EVENT_LOOP"
                ) from exc
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


async def bounded(aw: Awaitable[T], timeout: float | None) -> T:
    """``await aw``, raising :class:`asyncio.TimeoutError` after ``timeout`` s (None: no limit).

    Unlike ``asyncio.wait_for`` before Python 3.12, a cancellation that comes just as ``aw``
    finishes is never lost: ``wait_for`` then returns ``aw``'s result or raises its error, and the
    cancelled caller goes on (a watched group's collective whose pull failed as its member died
    went on to look the object up again and waited for its whole timeout; tests/test_soak.py)."""
    if timeout is None:
        return await aw
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await aw
    return await asyncio.wait_for(aw, timeout)  # 3.10: no asyncio.timeout


async def all_or_cancel(steps: Iterable[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Run ``steps`` concurrently, started in order (each sends its request before the next
    starts); if one fails, cancel the others and raise its error."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class IOThread:
    """The process-wide event loop thread that runs all network work."""

    _instance: IOThread | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name="hoplite-io", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @classmethod
    def get(cls) -> IOThread:
        """The shared instance, started on first use."""
        with cls._lock:
            if cls._instance is None or not cls._instance._thread.is_alive():
                cls._instance = IOThread()
            return cls._instance

    def in_thread(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it (from any other thread)."""
        if self.in_thread():
            coro.close()
            raise HopliteError(
                "a blocking hoplite_gpu call was made on its own I/O thread; use the *_async methods"
            )
        fut = self.submit(coro)
        try:
            # The future's own wait: concurrent.futures.wait builds a waiter, an event and a lock
            # per call, a tenth of a small operation's time on its caller's thread.
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            if fut.done():  # it finished with a timeout of its own: that is its result
                raise
            fut.cancel()
            raise HopliteTimeoutError(
                f"operation did not finish within {timeout} s", operation="call", timeout=timeout
            ) from None
        except BaseException:  # e.g. KeyboardInterrupt: stop the operation too
            fut.cancel()
            raise

    async def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and await it from another event loop."""
        if self.in_thread():
            return await coro
        return await asyncio.wrap_future(self.submit(coro))


def forget(fut: asyncio.Future[Any]) -> None:
    """Drop a future no longer awaited (a ucxx send or receive, the streams of a vertex that
    failed): cancel it and mark its error retrieved, now or when it ends (a ucxx request cancelled
    on a closed endpoint may still end with an error of its own), so asyncio does not log it as
    unretrieved."""
    fut.cancel()
    fut.add_done_callback(retrieved)


def retrieved(fut: asyncio.Future[Any]) -> None:
    """Mark a finished future's error (if any) retrieved."""
    if not fut.cancelled():
        fut.exception()
