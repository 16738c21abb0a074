"""The synchronous-RL benchmark's runs (``bench/rl.py``): :func:`run` drives a learner and rollout
workers (:mod:`bench.workloads.rl_actors`) through the iterations of one mode, optionally SIGKILLs a
worker mid-run, and returns the record the benchmark reports; :func:`failure_summary` sums up a run
with a kill. The tests (``tests/test_rl.py``) run it in small form.

After a kill the driver leaves the worker out until a call on the restarted process answers, and
gives it the current weights in the next iteration. ``gloo`` mode has no kill variant: a restarted
process is not a member of the collective group (Ray 2.60 does not re-create it), so nothing could
be sent to it again. Every wait has a timeout. The driver runs the loop (it owns the refs, which Ray
Direct Transport needs).
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
import time
import uuid
from typing import Any

import ray

import hoplite_gpu.ray as hgray
from bench.workloads.rl_actors import (
    INFO_TIMEOUT,
    MODES,
    START_TIMEOUT,
    Learner,
    RolloutWorker,
    _left,
    _ready_results,
)
from examples.rl import ENV_DIM


# ---------------------------------------------------------------------------------------- the driver
class _Loop:
    """The driver's side of one run: launches every iteration and records it."""

    def __init__(
        self,
        mode: str,
        learner: Any,
        workers: list[Any],
        pids: list[int],
        weights_via: str,
        deadline: float,
    ) -> None:
        self.mode, self.learner, self.workers, self.pids = mode, learner, workers, pids
        self.weights_via, self.deadline = weights_via, deadline
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

        publish = {
            "transport": self.learner.publish_hoplite,
            "put": self.learner.publish_hoplite_put,
            "sync": self.learner.publish_hoplite_sync,
        }[self.weights_via]
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
    weights_via: str = "transport",
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
        weights_via: hoplite mode: how the weights reach the workers: ``"transport"`` (a tensor
            through the HOPLITE transport), ``"put"`` (an explicit ``put`` whose ObjectID the
            workers ``get``) or ``"sync"`` (versions of :mod:`hoplite_gpu.weights`, received
            into each worker's own array).
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
        iteration) when a worker was killed; ``weights_via`` (hoplite: ``"transport"``,
        ``"put"`` or ``"sync"``; else the mode).
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
    if weights_via not in ("transport", "put", "sync"):
        raise ValueError(f"weights_via must be transport, put or sync, got {weights_via!r}")
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
        loop = _Loop(mode, learner, handles, list(pids), weights_via, deadline)
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
        "weights_via": weights_via if mode == "hoplite" else mode,
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
