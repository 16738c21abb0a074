"""Work objects and the threads that run the backend's collectives.

:class:`HopliteWork` is what every collective of the backend returns: a ``torch.distributed``
``Work`` whose ``wait(timeout)``, ``is_completed()``, ``exception()`` and ``get_future()`` behave
as Gloo's do (``wait`` with a timeout raises if the work is not done by then, and the work goes
on). :class:`Lane` runs calls one at a time, in the order they were submitted, on a thread of its
own: collectives of a group in one lane (members call them in the same order), the messages
between a pair of ranks with one tag in another, so a pending ``irecv`` never holds up a
collective.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import BackendTimeoutError

#: Seconds a lane's thread waits for more work before it ends (a new one starts with the next).
LANE_IDLE = 10.0


class HopliteWork(dist._Work):  # type: ignore[misc]
    """The handle of one collective of the hoplite backend (see the module's docstring).

    Args:
        outputs: The tensors the collective writes (its future's value once it completes).
        what: What it is, for errors (``"allreduce #3 of group 0"``).
    """

    def __init__(self, outputs: list[torch.Tensor], what: str) -> None:
        super().__init__()
        self._outputs = outputs
        self._what = what
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._settled: torch.futures.Future[Any] = torch.futures.Future()
        self._future = failing_in_cpp(self._settled)
        self.source = -1  # a recv from any source: the rank it came from

    def finish(self, error: BaseException | None = None) -> None:
        """Complete the work (with ``error``, or its outputs); runs the future's callbacks."""
        self._error = error
        try:  # the future first: a caller past wait() reads it
            if error is None:
                self._settled.set_result(self._outputs)
            else:
                self._settled.set_exception(error)
        finally:
            self._done.set()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until the collective completes and raise its error, if any. With a ``timeout``
        (not zero) raise :class:`BackendTimeoutError` if it is not done by then (the collective
        itself goes on, bounded by its group's timeout)."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout or 0)
        if not self._done.wait(seconds if seconds > 0 else None):
            raise BackendTimeoutError(
                f"{self._what} did not complete within {seconds} s (Work.wait)",
                operation="wait",
                timeout=seconds,
            )
        if self._error is not None:
            raise self._error
        return True

    def synchronize(self) -> None:
        """Same as :meth:`wait` (the results are in place once it returns)."""
        self.wait()

    def block_current_stream(self) -> None:
        """Same as :meth:`wait`: the library writes results before it completes."""
        self.wait()

    def is_completed(self) -> bool:
        """Whether the collective finished (succeeded or failed)."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """Whether it finished without an error (False while it runs)."""
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        """Its error once it failed, else None."""
        return self._error

    def get_future(self) -> torch.futures.Future[Any]:
        """A future completed with the output tensors (a list), or with the error."""
        return self._future

    def result(self) -> list[torch.Tensor]:
        """The output tensors (after :meth:`wait`)."""
        self.wait()
        return self._outputs

    def _source_rank(self) -> int:
        return self.source

    def source_rank(self) -> int:
        return self.source

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self._done.is_set() else "pending"
        return f"<hoplite_gpu.torch.HopliteWork {self._what} {state}>"


def failing_in_cpp(settled: torch.futures.Future[Any]) -> torch.futures.Future[Any]:
    """A future that completes as ``settled`` does, failing in C++ too when it fails.

    ``Future.set_exception`` only marks the error for Python: C++ code waiting on the future
    (DDP's reducer) reads the exception object as the value and crashes (a SIGSEGV in DDP's
    backward when a rank died). An exception raised in a ``then`` callback fails the future in
    C++; Python then sees a ``RuntimeError`` naming the error's class, with its text (the work's
    ``wait()`` and ``exception()`` keep the typed error)."""
    return settled.then(_value)


def joined(works: list[HopliteWork], outputs: list[torch.Tensor], what: str) -> HopliteWork:
    """One work completing once all of ``works`` have (with the first error)."""
    work = HopliteWork(outputs, what)
    left = [len(works)]
    lock = threading.Lock()

    def one(_: Any) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            errors = [w.exception() for w in works if w.exception() is not None]
            work.finish(errors[0] if errors else None)

    if not works:
        work.finish()
    for each in works:
        each.get_future().add_done_callback(one)
    return work


def _value(fut: torch.futures.Future[Any]) -> Any:
    return fut.value()


class Lane:
    """Runs calls one at a time in submission order on a thread of its own (started with the
    first call, ending after :data:`LANE_IDLE` seconds without one). A call may also run on the
    caller's thread when the lane is idle (:meth:`run_here`), keeping the order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._work: deque[Callable[[], None]] = deque()
        self._more = threading.Condition(self._lock)
        self._busy = False  # a call runs (on the lane's thread or a caller's)
        self._thread: threading.Thread | None = None

    def submit(self, call: Callable[[], None]) -> None:
        """Run ``call`` after the calls submitted before it."""
        with self._lock:
            self._work.append(call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"hoplite-{self.name}", daemon=True)
                self._thread.start()
            else:
                self._more.notify()

    def run_here(self, call: Callable[[], None]) -> bool:
        """Run ``call`` on this thread now if the lane is idle (True), else do nothing (False)."""
        with self._lock:
            if self._busy or self._work:
                return False
            self._busy = True
        self._call(call)
        return True

    def _call(self, call: Callable[[], None]) -> None:
        """Run ``call`` (the lane is busy meanwhile), then wake the lane's thread for what came."""
        try:
            call()
        finally:
            with self._lock:
                self._busy = False
                if self._work:
                    self._more.notify()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self._busy or not self._work:
                    if not self._more.wait(LANE_IDLE) and not self._work and not self._busy:
                        self._thread = None
                        return
                call = self._work.popleft()
                self._busy = True
            self._call(call)
