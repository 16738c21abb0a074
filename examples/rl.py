"""Synchronous reinforcement learning on Ray actors: a learner broadcasts its weights to ``N``
rollout workers every iteration and sums the gradients they send back (the RL workload of section
5.4 of the Hoplite paper, Zhuang et al., SIGCOMM 2021), with the same workload moved three ways:

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
  them in one pipelined broadcast tree (``hoplite_transport=False``: an explicit
  ``hgray.node().put`` of the weights, whose ObjectID goes to the workers). The gradients go
  through hoplite's reduce: each worker ``put``s its gradient under an ObjectID the driver named
  in advance, and the learner requests ``reduce(ids, SUM)`` over them before they exist, so the
  tree sums the first gradients while later workers are still receiving the weights; it then
  ``get``s the sum.

The workload is synthetic and exact. The weights are ``S`` bytes of float32 small integers
(``w0[j] = j % 251 - 125``). A worker's rollout is a small deterministic environment seeded by
(seed, worker, iteration): it picks a 64 x 64 block of the weights it received, iterates a state
vector through it eight times (``s <- (W s) mod 97`` in float64, exact on integers) and turns the
final state into an integer advantage ``c`` in [-8, 8]. Its gradient is ``g = w + c`` (as large
as the weights; it depends on every weight received). The learner knows ``w`` and recomputes each
worker's ``c``, so it checks every iteration's sum bit-exactly, ``sum_i g_i == k * w + sum_i c_i``
over the ``k`` gradients it summed, before the update ``w <- w + sum_i (g_i - w)`` (SGD with
learning rate 1 on ``sum_i |w - g_i|^2 / 2``), which is ``w + sum_i c_i``: the weights stay
integers far below 2**24 (they drift by at most ``8 k`` per iteration), so every sum is exact in
float32 in any order. An optional
``compute_s`` per rollout emulates an accelerator's compute time (a fixed delay per task; no
synchronisation waits on it).

Faults: a worker killed mid-run (SIGKILL of its process, ``kill_worker``/``kill_at``) is restarted
by Ray (``max_restarts=-1``). The iteration that loses it finishes with the others' gradients: in
``ray`` mode the learner's ``ray.get`` of its gradient raises ``RayActorError`` and it is left
out; in ``hoplite`` mode the learner watches the workers' rollout calls while it waits for the
sum, and when one fails it deletes the reduction and requests one over the survivors' gradients
(still held by their workers). The driver then leaves the worker out until a call on the restarted
process answers, and gives it the current weights in the next iteration. ``gloo`` mode has no kill
variant: a restarted process is not a member of the collective group (Ray 2.60 does not re-create
it), so nothing could be sent to it again.

Every wait has a timeout. The driver runs the loop (it owns the refs, which Ray Direct Transport
needs)::

    python examples/rl.py --mode all --workers 4 --weights-mib 32 --iterations 10
    python examples/rl.py --mode hoplite --workers 4 --weights-mib 8 --iterations 20 --kill-at 5

Needs ``ray`` and ``torch`` (``pip install hoplite_gpu[ray] torch``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import signal
import statistics
import sys
import time
import uuid
from typing import Any

import numpy as np
import ray

import hoplite_gpu.ray as hgray

#: The HOPLITE transport, registered at import: ``@ray.method(tensor_transport="HOPLITE")`` below
#: checks the name when the classes are defined, in the driver and in every Ray worker process that
#: imports this module, including an actor's process that Ray restarted after a crash (Ray 2.60
#: registers a custom transport on an actor once, when the actor is created, and not again on its
#: restarted process; see ``RDTManager.actor_id_to_transports_registered``).
HOPLITE = hgray.register_tensor_transport()
MODES = ("ray", "gloo", "hoplite")
#: Side of the square block of weights a rollout's environment iterates through.
ENV_DIM = 64
#: Steps of a rollout's environment.
ENV_STEPS = 8
#: Advantages are integers in ``[-ADVANTAGE, ADVANTAGE]``.
ADVANTAGE = 8
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


# ---------------------------------------------------------------------------------------- the workload
def initial_weights(n: int) -> np.ndarray:
    """The weights before the first iteration: ``n`` float32 ``j % 251 - 125``."""
    return (np.arange(n, dtype=np.int64) % 251 - 125).astype(np.float32)


def rollout_advantage(weights: np.ndarray, worker: int, iteration: int, seed: int) -> int:
    """The integer advantage in ``[-ADVANTAGE, ADVANTAGE]`` of ``worker``'s rollout in
    ``iteration`` on ``weights`` (see the module docstring; the learner calls it too)."""
    rng = np.random.default_rng([seed, worker, iteration])
    span = ENV_DIM * ENV_DIM
    start = int(rng.integers(0, weights.size - span + 1))
    block = np.asarray(weights[start : start + span], dtype=np.float64).reshape(ENV_DIM, ENV_DIM)
    state = rng.integers(0, 97, ENV_DIM).astype(np.float64)
    for _ in range(ENV_STEPS):
        state = np.mod(block @ state, 97.0)
    return int(state.sum()) % (2 * ADVANTAGE + 1) - ADVANTAGE


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
    """A rollout worker (made a Ray actor by :func:`run`): receives the weights, runs its rollout
    and returns a gradient as large as the weights, in the mode's way.

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
        """``hoplite`` mode: the weights are a tensor (the HOPLITE transport) or an ObjectID to
        ``get``; puts the gradient as ``grad_id`` and returns the rollout's figures. The previous
        gradient's reduction is over when the next rollout comes, so it is deleted first."""
        node = hgray.node()
        start = time.time()
        if self._last_grad is not None:
            node.delete(self._last_grad)
            self._last_grad = None
        if not hasattr(weights, "dtype"):  # an ObjectID
            weights = node.get(weights, timeout=FETCH_TIMEOUT)
        fetched = time.time()
        grad, advantage = self._gradient(weights, iteration)
        del weights  # a view of the local copy: the learner deletes it when nobody needs it
        node.put(grad, grad_id, copy=False)  # never modified again
        self._last_grad = grad_id
        return self._info(iteration, advantage, start, fetched, time.time())


class Learner:
    """The learner (made a Ray actor by :func:`run`): publishes the weights and applies the sum of
    the gradients, checking it bit-exactly first.

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


# ---------------------------------------------------------------------------------------- the driver
class _Loop:
    """The driver's side of one run: launches every iteration and records it."""

    def __init__(
        self,
        mode: str,
        learner: Any,
        workers: list[Any],
        pids: list[int],
        transport: bool,
        deadline: float,
    ) -> None:
        self.mode, self.learner, self.workers, self.pids = mode, learner, workers, pids
        self.transport, self.deadline = transport, deadline
        self.alive = set(range(len(workers)))
        self.pings: dict[int, Any] = {}  # worker left out -> its pending pid() call
        self.tag = uuid.uuid4().hex[:12]
        self.iterations: list[dict[str, Any]] = []
        self.rejoins: list[dict[str, Any]] = []

    def launch(self, iteration: int) -> tuple[Any, list[Any]]:
        """Publish the weights, start the live workers' rollouts and the learner's sum; returns the
        learner's call and the rollouts' figure refs (``ray`` mode; else none)."""
        active = sorted(self.alive)
        step_timeout = _left(self.deadline)
        if self.mode == "ray":
            weights = self.learner.publish_ray.remote(iteration)
            calls = [self.workers[w].rollout_ray.remote(weights, iteration) for w in active]
            grads = [g for g, _ in calls]
            return self.learner.apply_ray.remote(iteration, active, grads, step_timeout), [
                i for _, i in calls
            ]
        if self.mode == "gloo":
            weights = self.learner.publish_gloo.remote(iteration)
            grads = [self.workers[w].rollout_gloo.remote(weights, iteration) for w in active]
            return self.learner.apply_gloo.remote(iteration, active, *grads), []
        from hoplite_gpu import ObjectID

        publish = self.learner.publish_hoplite if self.transport else self.learner.publish_hoplite_put
        weights = publish.remote(iteration)
        ids = [ObjectID.from_name(f"rl/{self.tag}/grad/{iteration}/{w}") for w in active]
        pairs = zip(active, ids, strict=True)
        calls = [self.workers[w].rollout_hoplite.remote(weights, iteration, g) for w, g in pairs]
        return self.learner.apply_hoplite.remote(iteration, active, ids, calls, step_timeout), []

    def kill(self, worker: int, iteration: int) -> dict[str, Any]:
        """SIGKILL ``worker``'s process (its rollout of ``iteration`` was just launched)."""
        pid = self.pids[worker]
        os.kill(pid, signal.SIGKILL)
        return {"worker": worker, "pid": pid, "iteration": iteration, "time": time.time()}

    def finish(self, iteration: int, started: float, call: Any, info_refs: list[Any]) -> None:
        """Wait for the learner's sum of ``iteration``, record it, and take the workers it had to
        leave out off the list until they answer again."""
        record = ray.get(call, timeout=_left(self.deadline))
        record["seconds"] = time.monotonic() - started
        record["end"] = time.time()
        record["launched"] = sorted(self.alive)
        if info_refs:  # ray mode: the rollouts' figures came through the driver
            done, _ = _ready_results(info_refs, min(INFO_TIMEOUT, _left(self.deadline)), self.deadline)
            record["infos"] = list(done.values())
        self.iterations.append(record)
        for w in sorted(self.alive - set(record["used"])):
            self.alive.discard(w)
            self.pings[w] = self.workers[w].pid.remote()

    def readmit(self, iteration: int) -> None:
        """Workers left out whose restarted process answered take part from ``iteration`` on."""
        for w, ping in list(self.pings.items()):
            ready, _ = ray.wait([ping], timeout=0)
            if not ready:
                continue
            try:
                pid = ray.get(ping, timeout=_left(self.deadline))
            except ray.exceptions.RayActorError:  # sent before Ray knew the process had died
                self.pings[w] = self.workers[w].pid.remote()
                continue
            del self.pings[w]
            self.pids[w] = pid
            self.alive.add(w)
            self.rejoins.append({"worker": w, "pid": pid, "iteration": iteration, "time": time.time()})


def run(
    mode: str,
    workers: int = 4,
    weights_bytes: int = 32 << 20,
    iterations: int = 10,
    *,
    warmup: int = 2,
    seed: int = 0,
    compute_s: float = 0.0,
    kill_worker: int | None = None,
    kill_at: int | None = None,
    until_rejoined: bool = False,
    hoplite_transport: bool = True,
    env: dict[str, str] | None = None,
    learner_options: dict[str, Any] | None = None,
    worker_options: list[dict[str, Any]] | None = None,
    directory_options: dict[str, Any] | None = None,
    timeout: float = 1800.0,
) -> dict[str, Any]:
    """Run ``iterations`` iterations of the workload in ``mode`` (Ray initialised; in hoplite mode
    the directory actor is started here unless it exists, and the HOPLITE transport registered) and
    return the run's record.

    Args:
        mode: One of :data:`MODES`.
        workers: Number of rollout workers.
        weights_bytes: Size of the weights (and of each gradient), a multiple of 4.
        iterations: Iterations to run.
        warmup: Iterations left out of the median (the first ones include connecting).
        seed: Seed of the rollouts.
        compute_s: Emulated compute per rollout, seconds.
        kill_worker: Worker to SIGKILL right after iteration ``kill_at``'s rollouts were launched
            (None: no kill). Not in ``gloo`` mode (see the module docstring).
        kill_at: See ``kill_worker``.
        until_rejoined: After a kill, go on past ``iterations`` until the restarted worker has
            taken part in an iteration (within ``timeout``).
        hoplite_transport: hoplite mode: publish the weights through the HOPLITE transport (True)
            or with an explicit ``put`` whose ObjectID the workers receive (False).
        env: Environment variables set in the actors before anything else.
        learner_options: More Ray ``.options()`` of the learner (e.g. placement resources).
        worker_options: More Ray ``.options()`` of each worker.
        directory_options: ``actor_options`` of :func:`hoplite_gpu.ray.start_directory`.
        timeout: Seconds the whole run may take.

    Returns:
        A dict: the settings; ``iterations`` (per iteration: ``seconds`` from publishing to the
        learner's update, ``used`` workers, their ``advantages``, ``reduce_s`` until the sum was
        at the learner, ``check_s`` for the exact check, ``failed`` workers left out, ``infos``
        of the rollouts where they come back: pid, ``fetch_s``); ``median_s`` over the iterations
        after ``warmup``, ``median_full_s`` over those of them that had every worker; ``state``
        (the final weights checked exact); ``pids``; ``kill`` and ``rejoins`` (worker, new pid,
        iteration) when a worker was killed; ``weights_via`` (hoplite: ``"transport"`` or
        ``"put"``).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if (kill_worker is None) != (kill_at is None):
        raise ValueError("kill_worker and kill_at go together")
    if kill_worker is not None:
        if mode == "gloo":
            raise ValueError(
                "gloo mode has no kill variant: a restarted actor is not in the collective group"
            )
        if not 0 <= kill_worker < workers:
            raise ValueError(f"kill_worker must be in 0..{workers - 1}")
        assert kill_at is not None
        if not 0 <= kill_at < iterations:
            raise ValueError("kill_at must be in 0..iterations-1")
    if not 0 <= warmup < iterations:
        raise ValueError("warmup must be in 0..iterations-1")
    if weights_bytes % 4 or weights_bytes // 4 < ENV_DIM * ENV_DIM:
        raise ValueError(f"weights_bytes must be a multiple of 4 and at least {4 * ENV_DIM * ENV_DIM}")
    deadline = time.monotonic() + timeout
    transport = mode == "hoplite" and hoplite_transport
    if mode == "hoplite":
        hgray.start_directory(actor_options=directory_options)
        hgray.register_tensor_transport()  # done at import; again: nothing
    learner_cls = ray.remote(Learner).options(num_cpus=0, **(learner_options or {}))
    worker_cls = ray.remote(RolloutWorker)
    learner: Any = learner_cls.remote(weights_bytes // 4, seed, env)
    handles: list[Any] = [
        worker_cls.options(
            num_cpus=0, max_restarts=-1, max_task_retries=0, **((worker_options or [{}] * workers)[i])
        ).remote(i, seed, compute_s, env)
        for i in range(workers)
    ]
    group = None
    try:
        starting = min(START_TIMEOUT, _left(deadline))
        pids = ray.get([h.pid.remote() for h in handles], timeout=starting)
        ray.get(learner.pid.remote(), timeout=starting)
        if mode == "gloo":
            from ray.experimental.collective import create_collective_group

            group = create_collective_group([learner, *handles], backend="torch_gloo")
        loop = _Loop(mode, learner, handles, list(pids), transport, deadline)
        kill = None
        first = time.time()
        it = 0
        while it < iterations or (until_rejoined and kill is not None and not _rejoined(loop, kill)):
            loop.readmit(it)
            started = time.monotonic()
            call, info_refs = loop.launch(it)
            if kill_worker is not None and it == kill_at:
                kill = loop.kill(kill_worker, it)
            loop.finish(it, started, call, info_refs)
            it += 1
        state = ray.get(learner.state.remote(), timeout=_left(deadline))
    finally:
        if group is not None:
            from ray.experimental.collective import destroy_collective_group

            try:
                destroy_collective_group(group)
            except Exception as exc:  # the actors are killed next anyway
                logging.getLogger(__name__).warning("destroying the gloo group failed: %s", exc)
        for h in [learner, *handles]:
            ray.kill(h)
    secs = [r["seconds"] for r in loop.iterations]
    full = [r["seconds"] for r in loop.iterations[warmup:] if len(r["used"]) == workers]
    return {
        "mode": mode,
        "workers": workers,
        "weights_bytes": weights_bytes,
        "iterations": loop.iterations,
        "iteration_count": len(loop.iterations),
        "warmup": warmup,
        "seed": seed,
        "compute_s": compute_s,
        "median_s": statistics.median(secs[warmup:]),
        "median_full_s": statistics.median(full) if full else None,
        "started": first,
        "state": state,
        "pids": pids,
        "kill": kill,
        "rejoins": loop.rejoins,
        "weights_via": ("transport" if transport else "put") if mode == "hoplite" else mode,
    }


def _rejoined(loop: _Loop, kill: dict[str, Any]) -> bool:
    return any(kill["worker"] in r["used"] for r in loop.iterations[kill["iteration"] + 1 :])


def failure_summary(record: dict[str, Any], window: int = 5) -> dict[str, Any]:
    """Figures of a run with a killed worker: the median iteration time before the kill, the time
    of the iteration that lost the worker and of the ``window`` after it, and when the restarted
    process took part again (iteration, seconds after the kill; ``answered_after_s``: when the
    driver saw the restarted process answer, which it checks before each iteration)."""
    kill = record["kill"]
    if kill is None:
        raise ValueError("the run killed no worker")
    its = record["iterations"]
    at = kill["iteration"]
    before = [r["seconds"] for r in its[record["warmup"] : at]] or [r["seconds"] for r in its[:at]]
    back = next((i for i in range(at + 1, len(its)) if kill["worker"] in its[i]["used"]), None)
    return {
        "kill_iteration": at,
        "median_s_before": statistics.median(before) if before else None,
        "killed_iteration_s": its[at]["seconds"],
        "lost_worker": kill["worker"] not in its[at]["used"],
        "attempts": its[at].get("attempts"),
        "after_s": [r["seconds"] for r in its[at + 1 : at + 1 + window]],
        "rejoined_iteration": back,
        "rejoined_after_s": its[back]["end"] - kill["time"] if back is not None else None,
        "answered_after_s": next(
            (r["time"] - kill["time"] for r in record["rejoins"] if r["worker"] == kill["worker"]), None
        ),
        "restarted_pid": next((r["pid"] for r in record["rejoins"] if r["worker"] == kill["worker"]), None),
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: run modes on a local Ray instance and print their iteration times."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=[*MODES, "all"], default="all")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--weights-mib", type=float, default=32.0, help="size of the weights, MiB")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compute-ms", type=float, default=0.0, help="emulated compute per rollout")
    ap.add_argument("--kill-at", type=int, default=None, help="SIGKILL a worker in this iteration")
    ap.add_argument("--kill-worker", type=int, default=0)
    args = ap.parse_args(argv)

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # inherited by the actors
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OPENBLAS_NUM_THREADS": "1"}},
    )
    nbytes = int(args.weights_mib * (1 << 20)) // 4 * 4
    try:
        for mode in MODES if args.mode == "all" else (args.mode,):
            kill = args.kill_at is not None and mode != "gloo"
            rec = run(
                mode,
                args.workers,
                nbytes,
                args.iterations,
                warmup=args.warmup,
                seed=args.seed,
                compute_s=args.compute_ms / 1000,
                kill_worker=args.kill_worker if kill else None,
                kill_at=args.kill_at if kill else None,
                until_rejoined=kill,
            )
            times = " ".join(f"{r['seconds']:.3f}" for r in rec["iterations"])
            timed = rec["iteration_count"] - args.warmup
            print(
                f"{mode}: median iteration {rec['median_s']:.3f} s over {timed} "
                f"(weights via {rec['weights_via']}; every sum exact; final weights exact: "
                f"{rec['state']['exact']}); iterations: {times}"
            )
            if rec["kill"] is not None:
                print(f"  kill: {failure_summary(rec)}")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # The actors' classes must come from the importable module, not from __main__: Ray's workers
    # then import it, which registers the HOPLITE transport in each (a restarted actor's too).
    from examples import rl

    sys.exit(rl.main())
