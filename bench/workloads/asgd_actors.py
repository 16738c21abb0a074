"""The actors of the asynchronous-SGD benchmark (``bench/asgd.py``): the workers and the parameter
server of ``examples/async_sgd.py``'s workload, in two interchangeable modes, with the figures the
benchmark reports and the handling of a worker killed mid-run. :func:`bench.workloads.asgd.run`
starts them.

A parameter server (PS) and ``N`` workers are Ray actors. Every worker always has one task
outstanding: fetch the parameters it was given, compute a gradient on its own synthetic batch, and
hand the gradient back. Each update the PS takes the first ``k`` gradients to be ready, sums them,
takes an SGD step, and relaunches only the ``k`` workers whose gradients it used, with the new
parameters; the other ``N - k`` stay outstanding and are used, stale, in a later update (asynchronous
SGD). Both modes run the model of ``examples/async_sgd.py`` on the same data:

* ``hoplite``: the PS ``put``s the parameters into hoplite_gpu (workers that fetch them at the same
  time form a pipelined broadcast chain), gives each task an ObjectID for its gradient, and calls
  ``reduce(outstanding_gradient_ids, num_objects=k)``: the first ``k`` gradients to be ``put`` are
  summed in a tree among the workers holding them while the PS streams the result;
  ``reduced_objects`` says which ``k`` were used. Old parameters, used gradients and reduction
  results are deleted as soon as nothing needs them, so memory stays bounded.
* ``ray``: ``ray.wait(gradient_refs, num_returns=k)``, ``ray.get`` of the ``k`` gradients, a sum at
  the PS, ``ray.put`` of the new parameters, which each relaunched task receives as its argument.

A gradient is a flat array of ``d_in * d_out + 1`` float32: the last element is the batch's loss, so
the sum of ``k`` gradients carries the sum of their losses.

A worker killed mid-run (SIGKILL of its process) is restarted by Ray (``max_restarts=-1``); the PS
notices the failure (``RayActorError`` on the worker's task, or, in hoplite mode, on a call that
each worker keeps open for that purpose: a finished gradient lives in the worker's process and dies
with it) and relaunches the worker with a fresh gradient id, while the first-k reduce goes on with
the other workers' gradients. If the reduction in progress could no longer find ``k`` live
candidates, or its result was lost with the node computing it before the PS had all of it, the PS
deletes it and requests another one over the outstanding tasks, the relaunched one included.

In hoplite mode the PS relaunches the workers whose gradients it used before it has computed and
``put`` the new parameters (a ``get`` waits for the ``put``), so that the calls reach the workers
meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import threading
import time
import uuid
from typing import Any

import numpy as np

from examples.async_sgd import Model, Problem

MODES = ("hoplite", "ray")
#: Seconds between two checks of the workers' health while the PS waits for a reduction.
POLL_SECONDS = 0.05
#: Relaunches of one worker after failures before the PS gives up on the run.
MAX_FAILURES_PER_WORKER = 20
#: Reductions requested for one update (the first, and again after failures) before giving up.
MAX_ATTEMPTS = 20
#: Seconds the PS waits for its get of a reduction it deleted to fail before cancelling it. It fails
#: at once unless the get's partial copy was reset (a tree rebuilt after a node died) while it asked
#: the directory for a source: it then starts again with a lookup that, the id being deleted, waits
#: for ever (hoplite_gpu 0.1.0: ``Node._fetch`` raises the stored reset instead of the deletion).
DELETED_GET_GRACE = 5.0
#: Seconds a worker waits for the parameters of its task (they exist: this only bounds a bug).
FETCH_TIMEOUT = 600.0


def _setenv(env: dict[str, str] | None) -> None:
    for key, value in (env or {}).items():
        os.environ[key] = value


# ---------------------------------------------------------------------------------------- the actors
class Worker:
    """A worker (a Ray actor, see :func:`bench.workloads.asgd.run`): computes gradients of its batches.

    Args:
        index: Its number (selects its batches).
        problem: The model and data.
        mode: ``"hoplite"`` or ``"ray"``.
        env: Environment variables to set first (e.g. ``HOPLITE_SHARED_MEMORY=0``).
    """

    def __init__(self, index: int, problem: Problem, mode: str, env: dict[str, str] | None = None) -> None:
        _setenv(env)
        self.index = index
        self.model = Model(problem)
        self.node: Any = None
        if mode == "hoplite":
            import hoplite_gpu.ray as hgray

            self.node = hgray.node()
        self._last_grad: Any = None
        self._lock = threading.Lock()
        self._released = threading.Event()

    def pid(self) -> int:
        """This actor's process id."""
        return os.getpid()

    def watch(self) -> None:
        """Returns only after :meth:`release`: the PS keeps one call open to learn of this
        process's death (the call then fails with ``RayActorError``)."""
        self._released.wait()

    def release(self) -> None:
        """Let :meth:`watch` return."""
        self._released.set()

    def stats(self) -> dict[str, Any]:
        """The local store's figures (hoplite mode) and the process id."""
        out: dict[str, Any] = {"pid": os.getpid()}
        if self.node is not None:
            out.update(self.node.stats())
        return out

    def compute_hoplite(self, params_id: Any, grad_id: Any, task: int) -> dict[str, Any]:
        """Fetch the parameters ``params_id``, compute the gradient of batch ``task`` and put it as
        ``grad_id``. The previous gradient's reduction is finished when the PS relaunches this
        worker, so it is deleted first."""
        with self._lock:
            start = time.time()
            if self._last_grad is not None:
                self.node.delete(self._last_grad)
                self._last_grad = None
            params = self.node.get(params_id, timeout=FETCH_TIMEOUT)
            fetched = time.time()
            grad = self.model.gradient(params, self.index, task)
            del params  # a view of the local copy: the PS deletes it when nobody needs it
            computed = time.time()
            self.node.put(grad, grad_id, copy=False)
            self._last_grad = grad_id
            end = time.time()
        return _task_info(self.index, task, start, fetched, computed, end)

    def compute_ray(self, params: np.ndarray, task: int) -> tuple[np.ndarray, dict[str, Any]]:
        """The gradient of batch ``task`` at ``params`` (resolved by Ray), and the task's figures."""
        start = time.time()
        grad = self.model.gradient(params, self.index, task)
        computed = time.time()
        return grad, _task_info(self.index, task, start, start, computed, computed)


def _task_info(
    worker: int, task: int, start: float, fetched: float, computed: float, end: float
) -> dict[str, Any]:
    return {
        "worker": worker,
        "task": task,
        "pid": os.getpid(),
        "start": start,
        "fetch_s": fetched - start,
        "compute_s": computed - fetched,
        "end": end,
    }


@dataclasses.dataclass
class _Task:
    """An outstanding worker task, as the PS tracks it."""

    worker: int
    number: int  # the worker's task count: selects its batch
    version: int  # the update whose parameters it computes on
    grad: Any  # hoplite: the gradient's ObjectID; ray: the gradient's ObjectRef
    params: Any  # hoplite: the parameters' ObjectID; ray: None
    ref: Any  # the call's ObjectRef (hoplite: its info dict; ray: the info ref)
    returned: bool = False  # its call returned (hoplite: the gradient was put)
    retired: bool = False  # it needs its parameters no more


class ParameterServer:
    """The parameter server (a Ray actor, see :func:`bench.workloads.asgd.run`); :meth:`train` runs
    the whole loop.

    Args:
        problem: The model and data.
        mode: ``"hoplite"`` or ``"ray"``.
        env: Environment variables to set first.
    """

    def __init__(self, problem: Problem, mode: str, env: dict[str, str] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        _setenv(env)
        self.problem = problem
        self.mode = mode
        self.model = Model(problem)
        self.node: Any = None
        if mode == "hoplite":
            import hoplite_gpu.ray as hgray

            self.node = hgray.node()
        self._step = 0

    def pid(self) -> int:
        """This actor's process id."""
        return os.getpid()

    def progress(self) -> int:
        """Updates done so far (answered while :meth:`train` runs)."""
        return self._step

    def train(
        self, workers: list[Any], k: int, steps: int, lr: float, timeout: float = 1800.0
    ) -> dict[str, Any]:
        """Run ``steps`` updates of asynchronous SGD with ``workers`` (actor handles), each update
        summing the first ``k`` gradients; returns the run's record (see :func:`bench.workloads.asgd.run`)."""
        if not 1 <= k <= len(workers):
            raise ValueError(f"k must be in 1..{len(workers)}, got {k}")
        loop = _HopliteLoop if self.mode == "hoplite" else _RayLoop
        return loop(self, workers, k, lr, time.monotonic() + timeout).train(steps)


# ---------------------------------------------------------------------------------------- PS loops
class _Loop:
    """What both modes' PS loops share: parameters, bookkeeping of tasks and steps, the record."""

    def __init__(self, ps: ParameterServer, workers: list[Any], k: int, lr: float, deadline: float) -> None:
        self.ps, self.workers, self.k, self.lr, self.deadline = ps, workers, k, lr, deadline
        self.problem = ps.problem
        self.params = np.zeros(self.problem.params, np.float32)
        self.version = 0
        self.tasks: dict[int, _Task] = {}  # worker -> its current task
        self.counts = [0] * len(workers)  # tasks launched per worker
        self.failures = [0] * len(workers)
        self.infos: list[Any] = []  # refs of the tasks' info dicts, read at the end
        self.record: dict[str, Any] = {
            "step_end": [],
            "step_seconds": [],
            "reduce_seconds": [],
            "losses": [],
            "used": [],
            "used_tasks": [],
            "staleness": [],
            "relaunches": [],
            "reissued": [],
            "cancelled_gets": 0,
        }

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the run did not finish in time ({self.ps.progress()} updates done)")
        return left

    def next_task(self, worker: int) -> int:
        """The number of ``worker``'s next task (it selects the batch)."""
        number = self.counts[worker]
        self.counts[worker] += 1
        return number

    def failed(self, worker: int, reason: str) -> None:
        self.failures[worker] += 1
        if self.failures[worker] > MAX_FAILURES_PER_WORKER:
            raise RuntimeError(f"worker {worker} failed {self.failures[worker]} times; last: {reason}")
        self.record["relaunches"].append(
            {"worker": worker, "step": self.ps.progress(), "time": time.time(), "reason": reason}
        )

    def update(self, total: np.ndarray, used: list[_Task], in_place: bool) -> None:
        """One SGD step from the sum of ``used``'s gradients (``total``: the gradient sum and the
        loss sum), into a new array unless ``in_place``."""
        n = self.problem.params
        step = np.float32(-self.lr / len(used))
        if in_place:
            self.params += step * total[:n]
        else:
            new = np.multiply(total[:n], step)
            new += self.params
            self.params = new
        self.version += 1

    def record_step(self, total: np.ndarray, used: list[_Task], started: float, reduced: float) -> None:
        """Record an update that started at ``started`` and had its gradients' sum at ``reduced``
        (``time.monotonic()``)."""
        rec = self.record
        now = time.monotonic()
        rec["step_end"].append(time.time())
        rec["step_seconds"].append(now - started)
        rec["reduce_seconds"].append(reduced - started)
        rec["losses"].append(float(total[self.problem.params]) / len(used))
        rec["used"].append(sorted(t.worker for t in used))
        rec["used_tasks"].append(sorted([t.worker, t.number] for t in used))
        rec["staleness"].append([self.version - 1 - t.version for t in used])

    def finish(self, first: float) -> dict[str, Any]:
        import ray

        rec = self.record
        rec["final_loss"] = self.ps.model.loss(self.params)
        # Tasks still running (unused at the end) are left out.
        ready, _ = ray.wait(self.infos, num_returns=len(self.infos), timeout=1.0, fetch_local=False)
        infos: list[dict[str, Any]] = []
        for ref in ready:
            try:
                infos.append(ray.get(ref, timeout=self.remaining()))
            except ray.exceptions.RayActorError:
                pass  # a task of a killed worker
        rec["tasks"] = sorted(infos, key=lambda i: i["start"])
        rec["started"] = first
        return rec


class _Runner:
    """An event loop on a thread of its own, running hoplite_gpu's ``*_async`` calls so that one can
    be cancelled (a blocking call cannot)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="asgd-ps-io", daemon=True)
        self.thread.start()

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Run ``coro`` on the loop; cancelling the returned future cancels it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Stop the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class _HopliteLoop(_Loop):
    def __init__(self, ps: ParameterServer, workers: list[Any], k: int, lr: float, deadline: float) -> None:
        super().__init__(ps, workers, k, lr, deadline)
        self.node = ps.node
        self.tag = uuid.uuid4().hex[:12]
        self.param_users: dict[Any, int] = {}  # params ObjectID -> outstanding tasks using it
        self.leases: dict[int, Any] = {}  # worker -> its open watch() call
        self.by_grad: dict[Any, _Task] = {}  # every gradient id issued -> its task
        self.params_id: Any = None
        self.params_version = 0

    def name_params(self, version: int) -> None:
        """Name the parameters of ``version`` (tasks launched with them fetch them once put)."""
        from hoplite_gpu import ObjectID

        self.params_id = ObjectID.from_name(f"asgd/{self.tag}/params/{version}")
        self.params_version = version
        self.param_users[self.params_id] = 0

    def put_params(self) -> None:
        # Without a copy: the PS never modifies an array it put (an update makes a new one).
        self.node.put(self.params, self.params_id, copy=False)

    def launch(self, worker: int) -> None:
        from hoplite_gpu import ObjectID

        number = self.next_task(worker)
        grad = ObjectID.from_name(f"asgd/{self.tag}/grad/{worker}/{number}")
        ref = self.workers[worker].compute_hoplite.remote(self.params_id, grad, number)
        task = _Task(worker, number, self.params_version, grad, self.params_id, ref)
        self.tasks[worker] = task
        self.by_grad[grad] = task
        self.param_users[self.params_id] += 1
        self.infos.append(ref)

    def retire(self, task: _Task) -> None:
        """``task`` needs its parameters no more: delete them if no other task does either."""
        if task.retired:
            return
        task.retired = True
        self.param_users[task.params] -= 1
        if self.param_users[task.params] == 0 and task.params != self.params_id:
            del self.param_users[task.params]
            self.node.delete(task.params)

    def check_workers(self) -> None:
        """Relaunch the tasks of workers that died (seen on their task or their watch call)."""
        import ray

        refs = {t.ref: t for t in self.tasks.values() if not t.returned}
        leases = {ref: w for w, ref in self.leases.items()}
        waiting = [*refs, *leases]
        ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0, fetch_local=False)
        ready_set = set(ready)
        for ref in [r for r in refs if r in ready_set]:  # tasks first: a task that returned
            task = refs[ref]
            try:
                ray.get(ref, timeout=0)
                task.returned = True
            except ray.exceptions.RayActorError as exc:
                self.relaunch(task, f"task failed: {type(exc).__name__}")
        for ref in [r for r in leases if r in ready_set]:
            worker = leases[ref]
            try:
                ray.get(ref, timeout=0)
                raise RuntimeError(f"worker {worker}'s watch call returned")
            except ray.exceptions.RayActorError as exc:
                self.leases[worker] = self.workers[worker].watch.remote()
                task = self.tasks[worker]
                # A gradient already put died with the process; a task still running fails by itself
                # (or runs on the restarted process, if it was sent after the restart).
                if task.returned:
                    self.relaunch(task, f"process died after its task: {type(exc).__name__}")

    def relaunch(self, task: _Task, reason: str) -> None:
        self.failed(task.worker, reason)
        self.retire(task)
        self.launch(task.worker)

    def reduce_once(self, step: int, attempt: int, buf: np.ndarray, runner: _Runner) -> list[_Task] | None:
        """Request a first-k reduction of the outstanding gradients, stream its result into ``buf``
        and return the tasks whose gradients it summed; None if it cannot complete (it was deleted
        and must be requested again): a candidate's worker died and fewer than ``k`` live candidates
        are left, or the result was lost (its only copy was on the node that computed it, which
        died before all of it arrived here)."""
        from hoplite_gpu import HopliteError, ObjectID, ObjectLostError

        self.check_workers()
        candidates = [t.grad for t in self.tasks.values()]
        rid = ObjectID.from_name(f"asgd/{self.tag}/sum/{step}/{attempt}")
        self.node.reduce(candidates, num_objects=self.k, reduction_id=rid)
        fut = runner.submit(self.node.get_async(rid, None, buf))
        reason = ""
        while not reason:
            try:
                fut.result(timeout=min(POLL_SECONDS, self.remaining()))
                used = self.node.reduced_objects(rid, timeout=self.remaining())
                self.node.delete(rid)
                return [self.by_grad[g] for g in used]
            except concurrent.futures.TimeoutError:
                pass
            except ObjectLostError as exc:
                reason = f"result lost: {exc}"
                break
            self.check_workers()
            live = {t.grad for t in self.tasks.values()}
            if sum(1 for g in candidates if g in live) < self.k:
                reason = "fewer than k live candidates"
        # Deleted, the reduction also forgets which inputs it used: even one that finished just now
        # is requested again. The get then fails at once, normally; one whose partial copy was reset
        # (the tree rebuilt after a node died) just before may instead wait for ever for the deleted
        # id (see DELETED_GET_GRACE): it is cancelled.
        self.node.delete(rid)
        try:
            fut.result(timeout=DELETED_GET_GRACE)
        except HopliteError:
            pass
        except concurrent.futures.TimeoutError:
            fut.cancel()
            self.record["cancelled_gets"] += 1
        self.record["reissued"].append({"step": step, "time": time.time(), "reason": reason})
        if attempt + 1 >= MAX_ATTEMPTS:
            raise RuntimeError(f"update {step}: {attempt + 1} reductions failed; last: {reason}")
        return None

    def train(self, steps: int) -> dict[str, Any]:
        node = self.node
        buf = np.empty(self.problem.params + 1, np.float32)
        self.name_params(0)
        self.put_params()
        first = time.time()
        for w, handle in enumerate(self.workers):
            self.leases[w] = handle.watch.remote()
            self.launch(w)
        runner = _Runner()
        try:
            for step in range(steps):
                started = time.monotonic()
                attempt = 0
                while (used := self.reduce_once(step, attempt, buf, runner)) is None:
                    attempt += 1
                reduced = time.monotonic()
                old_params = self.params_id
                # Relaunch first: the workers' gets of the new parameters wait for their put, while
                # the calls reach the workers and they delete their used gradients.
                self.name_params(self.version + 1)
                for task in used:
                    self.retire(task)
                    if self.tasks.get(task.worker) is task:  # else relaunched already (it died)
                        self.launch(task.worker)
                for task in used:
                    del self.by_grad[task.grad]
                self.update(buf, used, in_place=False)  # the old array may still be sent
                self.put_params()
                self.record_step(buf, used, started, reduced)
                if self.param_users.get(old_params) == 0:
                    del self.param_users[old_params]
                    node.delete(old_params)
                self.ps._step = step + 1
        finally:
            runner.close()
        self.record["ps_store"] = node.stats()
        rec = self.finish(first)
        for handle in self.workers:
            handle.release.remote()
        return rec


class _RayLoop(_Loop):
    def launch(self, worker: int, params_ref: Any) -> None:
        number = self.next_task(worker)
        grad, info = self.workers[worker].compute_ray.options(num_returns=2).remote(params_ref, number)
        self.tasks[worker] = _Task(worker, number, self.version, grad, None, info)
        self.infos.append(info)

    def train(self, steps: int) -> dict[str, Any]:
        import ray

        buf = np.empty(self.problem.params + 1, np.float32)
        params_ref = ray.put(self.params)
        first = time.time()
        for w in range(len(self.workers)):
            self.launch(w, params_ref)
        for step in range(steps):
            started = time.monotonic()
            used: list[_Task] = []
            buf[:] = 0
            while len(used) < self.k:
                pending = {t.grad: t for t in self.tasks.values() if all(t is not u for u in used)}
                ready, _ = ray.wait(list(pending), num_returns=self.k - len(used), timeout=self.remaining())
                for ref in ready:
                    task = pending[ref]
                    try:
                        grad = ray.get(ref, timeout=self.remaining())
                    except ray.exceptions.RayActorError as exc:
                        self.failed(task.worker, f"task failed: {type(exc).__name__}")
                        self.launch(task.worker, params_ref)
                        continue
                    buf += grad
                    del grad
                    used.append(task)
            reduced = time.monotonic()
            self.update(buf, used, in_place=True)  # ray.put copies
            params_ref = ray.put(self.params)
            for task in used:
                self.launch(task.worker, params_ref)
            self.record_step(buf, used, started, reduced)
            self.ps._step = step + 1
        return self.finish(first)
