"""The actors of the synchronous-RL benchmark (``bench/rl.py``): the rollout workers and the learner
of ``examples/rl.py``'s workload, with the same workload moved three ways, the figures the benchmark
reports, and the handling of a worker killed mid-run. :func:`bench.workloads.rl.run` drives them.

* ``ray``: the plain object store. The learner's ``publish_ray`` returns the weights (Ray stores
  the return value in the learner's object store, as ``ray.put`` would), the driver passes that
  ref to every worker's ``rollout_ray``, each returns its gradient through the object store, and
  the learner ``ray.get``s the gradients in the order they become ready and sums them.
* ``gloo``: Ray Direct Transport over Gloo. The learner and the workers form a
  ``ray.experimental.collective`` group (``backend="torch_gloo"``); ``publish_gloo`` and
  ``rollout_gloo`` are ``@ray.method(tensor_transport="gloo")``, so Ray keeps the returned tensors
  in the actors and sends them point to point (the learner sends the weights to each worker in
  turn, each worker sends its gradient to the learner) when the driver passes the refs on.
* ``hoplite``: the weights go through hoplite_gpu's Ray Direct Transport: ``publish_hoplite`` is
  ``@ray.method(tensor_transport="HOPLITE")`` (registered when this module is imported, see
  :data:`HOPLITE`), a one-sided transport: the workers pull the tensor from hoplite's store, all of
  them in one pipelined broadcast tree (``weights_via="put"``: an explicit
  ``hgray.node().put`` of the weights, whose ObjectID goes to the workers; ``"sync"``: versions
  of :mod:`hoplite_gpu.weights`, received into each worker's own array). The gradients go
  through hoplite's reduce: each worker ``put``s its gradient under an ObjectID the driver named
  in advance, and the learner requests ``reduce(ids, SUM)`` over them before they exist, so the
  tree sums the first gradients while later workers are still receiving the weights; it then
  ``get``s the sum.

The workload (weights, rollouts, exact sums) is ``examples/rl.py``'s: the learner recomputes each
worker's advantage and checks every iteration's sum bit-exactly before the update. An optional
``compute_s`` per rollout emulates an accelerator's compute time (a fixed delay per task; no
synchronisation waits on it).

Faults: a worker killed mid-run (SIGKILL of its process) is restarted by Ray (``max_restarts=-1``).
The iteration that loses it finishes with the others' gradients: in ``ray`` mode the learner's
``ray.get`` of its gradient raises ``RayActorError`` and it is left out; in ``hoplite`` mode the
learner watches the workers' rollout calls while it waits for the sum, and when one fails it deletes
the reduction and requests one over the survivors' gradients (still held by their workers).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
import uuid
from typing import Any

import numpy as np
import ray

import hoplite_gpu.ray as hgray
from examples.rl import ENV_DIM, initial_weights, rollout_advantage

#: The HOPLITE transport, registered at import: ``@ray.method(tensor_transport="HOPLITE")`` below
#: checks the name when the classes are defined, in the driver and in every Ray worker process that
#: imports this module, including an actor's process that Ray restarted after a crash (Ray 2.60
#: registers a custom transport on an actor once, when the actor is created, and not again on its
#: restarted process; see ``RDTManager.actor_id_to_transports_registered``).
HOPLITE = hgray.register_tensor_transport()
MODES = ("ray", "gloo", "hoplite")
#: Seconds between two checks of the rollout calls while the learner waits for a hoplite sum.
POLL_SECONDS = 0.05
#: Reductions the learner requests for one iteration (the first, and again after failures).
MAX_ATTEMPTS = 5
#: Seconds a worker waits for the weights (they are published: this only bounds a bug).
FETCH_TIMEOUT = 600.0
#: Seconds the actors of a run may take to start (an actor that cannot be placed waits forever).
START_TIMEOUT = 300.0
#: Seconds the driver waits for the small figures of a finished iteration's rollouts.
INFO_TIMEOUT = 30.0


def _setenv(env: dict[str, str] | None) -> None:
    for key, value in (env or {}).items():
        os.environ[key] = value


def _threads() -> None:
    """One compute thread per actor: many actors share few cores."""
    import torch

    torch.set_num_threads(1)


def _as_numpy(weights: Any) -> np.ndarray:
    """A NumPy view of received weights (a NumPy array or a CPU torch tensor)."""
    if isinstance(weights, np.ndarray):
        return weights
    return weights.detach().numpy()  # type: ignore[no-any-return]


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the run did not finish in time")
    return left


def _ready_results(refs: list[Any], wait: float, deadline: float) -> tuple[dict[Any, Any], dict[Any, str]]:
    """The results of the calls among ``refs`` that finish within ``wait`` seconds, in their order,
    and the error name of each of those whose actor died instead."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait)
    done: dict[Any, Any] = {}
    died: dict[Any, str] = {}
    for ref in ready:
        try:
            done[ref] = ray.get(ref, timeout=_left(deadline))
        except ray.exceptions.RayActorError as exc:
            died[ref] = type(exc).__name__
    return done, died


# ---------------------------------------------------------------------------------------- the actors
class RolloutWorker:
    """A rollout worker (made a Ray actor by :func:`bench.workloads.rl.run`): receives the weights,
    runs its rollout and returns a gradient as large as the weights, in the mode's way.

    Args:
        index: Its number (seeds its rollouts).
        seed: Seed of every rollout.
        compute_s: Seconds of emulated compute per rollout.
        env: Environment variables to set first (e.g. ``HOPLITE_SHARED_MEMORY=0``).
    """

    def __init__(self, index: int, seed: int, compute_s: float = 0.0, env: dict[str, str] | None = None):
        _setenv(env)
        _threads()
        self.index = index
        self.seed = seed
        self.compute_s = compute_s
        self._last_grad: Any = None  # hoplite: the ObjectID of the gradient put last
        self._subscriber: Any = None  # hoplite through hoplite_gpu.weights, and its array
        self._synced: np.ndarray | None = None

    def pid(self) -> int:
        """This actor's process id (also how the driver learns that a restarted one is up)."""
        return os.getpid()

    def _gradient(self, weights: Any, iteration: int) -> tuple[np.ndarray, int]:
        w = _as_numpy(weights)
        advantage = rollout_advantage(w, self.index, iteration, self.seed)
        grad = np.add(w, np.float32(advantage))
        if self.compute_s > 0:
            time.sleep(self.compute_s)  # emulated accelerator time of the rollout, not a wait
        return grad, advantage

    def _info(
        self, iteration: int, advantage: int, start: float, fetched: float, end: float
    ) -> dict[str, Any]:
        return {
            "worker": self.index,
            "iteration": iteration,
            "pid": os.getpid(),
            "advantage": advantage,
            "fetch_s": fetched - start,
            "end": end,
        }

    @ray.method(num_returns=2)
    def rollout_ray(self, weights: np.ndarray, iteration: int) -> tuple[np.ndarray, dict[str, Any]]:
        """``ray`` mode: the weights were resolved by Ray; returns the gradient (into the object
        store) and the rollout's figures."""
        start = time.time()
        grad, advantage = self._gradient(weights, iteration)
        return grad, self._info(iteration, advantage, start, start, time.time())

    @ray.method(tensor_transport="gloo")
    def rollout_gloo(self, weights: Any, iteration: int) -> Any:
        """``gloo`` mode: the weights arrived as a tensor over Gloo; the gradient tensor stays here
        until the learner's call receives it."""
        import torch

        grad, _ = self._gradient(weights, iteration)
        return torch.from_numpy(grad)

    def rollout_hoplite(self, weights: Any, iteration: int, grad_id: Any) -> dict[str, Any]:
        """``hoplite`` mode: the weights are a tensor (the HOPLITE transport), an ObjectID to
        ``get``, or a (name, version) of :mod:`hoplite_gpu.weights` to receive; puts the gradient
        as ``grad_id`` and returns the rollout's figures. The previous gradient's reduction is
        over when the next rollout comes, so it is deleted first."""
        node = hgray.node()
        start = time.time()
        if self._last_grad is not None:
            node.delete(self._last_grad)
            self._last_grad = None
        if isinstance(weights, tuple):  # (name, version) of hoplite_gpu.weights
            weights = self._receive(node, *weights)
        elif not hasattr(weights, "dtype"):  # an ObjectID
            weights = node.get(weights, timeout=FETCH_TIMEOUT)
        fetched = time.time()
        grad, advantage = self._gradient(weights, iteration)
        del weights  # a view of the local copy: the learner deletes it when nobody needs it
        node.put(grad, grad_id, copy=False)  # never modified again
        self._last_grad = grad_id
        return self._info(iteration, advantage, start, fetched, time.time())

    def _receive(self, node: Any, name: str, version: int) -> np.ndarray:
        """Version ``version`` of the weights published as ``name``, received into this worker's
        own array (allocated at the first version, as a model's parameters are)."""
        from hoplite_gpu.weights import WeightSubscriber

        if self._subscriber is None:
            self._subscriber = WeightSubscriber(node, name)
        into = {"weights": self._synced} if self._synced is not None else None
        _, tensors = self._subscriber.receive(version=version, into=into, timeout=FETCH_TIMEOUT)
        if self._synced is None:  # a read-only view of the received copy: this worker's own from now
            self._synced = np.array(tensors["weights"])
            return self._synced
        return tensors["weights"]


class Learner:
    """The learner (made a Ray actor by :func:`bench.workloads.rl.run`): publishes the weights and
    applies the sum of the gradients, checking it bit-exactly first.

    Args:
        n: Number of float32 weights.
        seed: Seed of the rollouts (to recompute each worker's advantage).
        env: Environment variables to set first.
    """

    def __init__(self, n: int, seed: int, env: dict[str, str] | None = None) -> None:
        _setenv(env)
        _threads()
        if n < ENV_DIM * ENV_DIM:
            raise ValueError(f"the weights need at least {ENV_DIM * ENV_DIM} elements, got {n}")
        self.seed = seed
        self.weights = initial_weights(n)  # never modified in place: an update makes a new array
        self.drift = 0  # sum of every applied advantage: weights == initial + drift
        self.tag = uuid.uuid4().hex[:12]
        self._weights_id: Any = None  # hoplite without the transport: the ObjectID put last
        self._publisher: Any = None  # hoplite through hoplite_gpu.weights

    def pid(self) -> int:
        """This actor's process id."""
        return os.getpid()

    # -------------------------------------------------------------------- publishing the weights
    def publish_ray(self, iteration: int) -> np.ndarray:
        """``ray`` mode: the weights, returned into the object store."""
        return self.weights

    @ray.method(tensor_transport="gloo")
    def publish_gloo(self, iteration: int) -> Any:
        """``gloo`` mode: the weights as a tensor kept here until each worker's call receives it."""
        import torch

        return torch.from_numpy(self.weights)

    @ray.method(tensor_transport=HOPLITE)
    def publish_hoplite(self, iteration: int) -> Any:
        """``hoplite`` mode: the weights as a tensor, which stays here (in this process's hoplite
        node, not copied) until the workers' calls pull it through the HOPLITE transport."""
        import torch

        return torch.from_numpy(self.weights)  # never modified: an update makes a new array

    def publish_hoplite_put(self, iteration: int) -> Any:
        """``hoplite`` mode without the transport: ``put`` the weights into hoplite_gpu and return
        their ObjectID (the previous weights are deleted: every worker that was to read them has
        finished)."""
        from hoplite_gpu import ObjectID

        node = hgray.node()
        if self._weights_id is not None:
            node.delete(self._weights_id)
        self._weights_id = ObjectID.from_name(f"rl/{self.tag}/weights/{iteration}")
        node.put(self.weights, self._weights_id, copy=False)  # an update makes a new array
        return self._weights_id

    def publish_hoplite_sync(self, iteration: int) -> tuple[str, int]:
        """``hoplite`` mode through :mod:`hoplite_gpu.weights`: publish the weights as version
        ``iteration`` (the publisher keeps the last two) and return its name and the version."""
        from hoplite_gpu.weights import WeightPublisher

        if self._publisher is None:
            self._publisher = WeightPublisher(hgray.node(), f"rl/{self.tag}")
        self._publisher.publish({"weights": self.weights}, version=iteration)
        return self._publisher.name, iteration

    # -------------------------------------------------------------------- applying the gradients
    def _apply(self, iteration: int, used: list[int], total: np.ndarray) -> dict[str, Any]:
        """Check ``total`` against the sum of ``used``'s gradients and take the step."""
        started = time.monotonic()
        advantages = {w: rollout_advantage(self.weights, w, iteration, self.seed) for w in used}
        step = sum(advantages.values())
        expected = np.multiply(self.weights, np.float32(len(used)))
        expected += np.float32(step)
        if not np.array_equal(total, expected):
            bad = np.flatnonzero(total != expected)
            raise AssertionError(
                f"iteration {iteration}: the sum of the gradients of workers {used} is wrong at "
                f"{bad.size} of {total.size} elements (first: [{bad[0]}] = {total[bad[0]]}, "
                f"expected {expected[bad[0]]})"
            )
        del expected
        self.weights = np.add(self.weights, np.float32(step))
        self.drift += step
        return {
            "iteration": iteration,
            "used": sorted(used),
            "advantages": {str(w): a for w, a in advantages.items()},
            "check_s": time.monotonic() - started,
        }

    def apply_ray(
        self, iteration: int, workers: list[int], grads: list[Any], timeout: float
    ) -> dict[str, Any]:
        """``ray`` mode: ``ray.get`` the gradient refs (``grads[i]`` from ``workers[i]``; passed in
        a list, so Ray does not resolve them first) as they become ready and sum them; a worker
        whose call failed (``RayActorError``: it died) is left out."""
        deadline = time.monotonic() + timeout
        started = time.monotonic()
        total = np.empty_like(self.weights)
        owner = dict(zip(grads, workers, strict=True))
        pending = list(grads)
        used: list[int] = []
        failed: dict[str, str] = {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=_left(deadline))
            if not ready:
                raise TimeoutError(f"iteration {iteration}: gradients missing after {timeout:.0f} s")
            for ref in ready:
                try:
                    grad = ray.get(ref, timeout=_left(deadline))
                except ray.exceptions.RayActorError as exc:
                    failed[str(owner[ref])] = type(exc).__name__
                    continue
                if used:
                    total += grad
                else:
                    np.copyto(total, grad)
                del grad
                used.append(owner[ref])
        if not used:
            raise RuntimeError(f"iteration {iteration}: every worker failed ({failed})")
        summed = time.monotonic()
        record = self._apply(iteration, used, total)
        record.update(reduce_s=summed - started, failed=failed)
        return record

    def apply_gloo(self, iteration: int, workers: list[int], *grads: Any) -> dict[str, Any]:
        """``gloo`` mode: the gradient tensors arrived over Gloo before this call ran; sum them."""
        started = time.monotonic()
        total = np.empty_like(self.weights)
        np.copyto(total, _as_numpy(grads[0]))
        for g in grads[1:]:
            total += _as_numpy(g)
        summed = time.monotonic()
        record = self._apply(iteration, list(workers), total)
        record.update(reduce_s=summed - started, failed={})
        return record

    def apply_hoplite(
        self, iteration: int, workers: list[int], grad_ids: list[Any], calls: list[Any], timeout: float
    ) -> dict[str, Any]:
        """``hoplite`` mode: request the sum of ``grad_ids`` (``workers[i]`` puts ``grad_ids[i]``;
        ``calls[i]`` is its rollout call) and stream it here; while waiting, watch the calls, and if
        one fails (the worker died) delete the reduction and request one over the others."""
        from hoplite_gpu import HopliteError, ObjectID, ObjectLostError, ReduceOp, ReductionFailedError
        from hoplite_gpu.iothread import IOThread

        node = hgray.node()
        deadline = time.monotonic() + timeout
        started = time.monotonic()
        live = dict(zip(workers, grad_ids, strict=True))
        call_of = dict(zip(calls, workers, strict=True))
        infos: dict[int, dict[str, Any]] = {}
        failed: dict[str, str] = {}
        reasons: list[str] = []
        for attempt in range(MAX_ATTEMPTS):
            ids = [live[w] for w in sorted(live)]
            rid = ObjectID.from_name(f"rl/{self.tag}/sum/{iteration}/{attempt}")
            node.reduce(ids, ReduceOp.SUM, reduction_id=rid, timeout=_left(deadline))
            # On hoplite's I/O thread, so that the wait can be given up (a blocking get cannot).
            fut = IOThread.get().submit(node.get_async(rid, _left(deadline)))
            reason = ""
            while not reason:
                try:
                    total = fut.result(timeout=min(POLL_SECONDS, _left(deadline)))
                except concurrent.futures.TimeoutError:
                    pass
                except (ReductionFailedError, ObjectLostError) as exc:
                    reason = f"{type(exc).__name__}: {exc}"
                else:
                    summed = time.monotonic()
                    reduced = node.reduced_objects(rid, timeout=_left(deadline))
                    if set(reduced) != set(ids):
                        raise AssertionError(f"iteration {iteration}: reduced {reduced}, asked for {ids}")
                    record = self._apply(iteration, sorted(live), total)
                    del total  # a view of the local store (or of the root's shared memory)
                    node.delete(rid)
                    self._collect(call_of, infos, failed, deadline, block=True)
                    record.update(
                        reduce_s=summed - started, failed=failed, attempts=attempt + 1, reasons=reasons
                    )
                    record["infos"] = [infos[w] for w in sorted(infos)]
                    return record
                self._collect(call_of, infos, failed, deadline, block=False)
                if any(str(w) in failed for w in live):
                    reason = reason or "worker died"
            # Deleted, the reduction fails its get at once; the survivors' gradients stay put.
            reasons.append(reason)
            node.delete(rid)
            try:
                fut.result(timeout=5.0)
            except (HopliteError, concurrent.futures.TimeoutError):
                fut.cancel()
            live = {w: g for w, g in live.items() if str(w) not in failed}
            if not live:
                break
        raise RuntimeError(f"iteration {iteration}: no sum after {len(reasons)} attempts: {reasons}")

    @staticmethod
    def _collect(
        call_of: dict[Any, int],
        infos: dict[int, dict[str, Any]],
        failed: dict[str, str],
        deadline: float,
        block: bool,
    ) -> None:
        """Read the rollout calls that finished (all of the live ones when ``block``): their
        figures, or the failure of a worker that died."""
        pending = [r for r, w in call_of.items() if w not in infos and str(w) not in failed]
        if not pending:
            return
        wait = min(INFO_TIMEOUT, _left(deadline)) if block else 0
        done, died = _ready_results(pending, wait, deadline)
        infos.update((call_of[ref], info) for ref, info in done.items())
        failed.update((str(call_of[ref]), error) for ref, error in died.items())

    def state(self) -> dict[str, Any]:
        """The final weights' figures: ``drift`` (the sum of every applied advantage) and ``exact``
        (whether the weights equal the initial ones plus ``drift``, bit for bit)."""
        expected = initial_weights(self.weights.size) + np.float32(self.drift)
        return {"drift": self.drift, "exact": bool(np.array_equal(self.weights, expected))}
