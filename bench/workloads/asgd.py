"""The asynchronous-SGD benchmark's runs (``bench/asgd.py``): :func:`run` trains with a parameter
server and workers (:mod:`bench.workloads.asgd_actors`) in one mode, optionally SIGKILLs a worker
mid-run, and returns the record the benchmark reports; :func:`failure_summary` sums up a run with a
kill. The tests (``tests/test_ray_asgd.py``) run it in small form.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from typing import Any

import numpy as np

from bench.workloads.asgd_actors import MODES, ParameterServer, Worker
from examples.async_sgd import Model, Problem

#: Seconds the actors of a run may take to start (an actor that cannot be placed waits forever).
START_TIMEOUT = 300.0


def run(
    mode: str,
    workers: int = 8,
    k: int = 4,
    grad_bytes: int = 100_000_000,
    steps: int = 20,
    *,
    batch: int = 8,
    lr: float = 0.1,
    seed: int = 0,
    warmup: int = 2,
    kill_worker: int | None = None,
    kill_at_step: int | None = None,
    env: dict[str, str] | None = None,
    ps_options: dict[str, Any] | None = None,
    worker_options: list[dict[str, Any]] | None = None,
    directory_options: dict[str, Any] | None = None,
    timeout: float = 1800.0,
) -> dict[str, Any]:
    """Train with a PS and ``workers`` workers in ``mode`` (Ray must be initialised; in hoplite mode
    the directory actor is started here unless it exists) and return the run's record.

    Args:
        mode: ``"hoplite"`` or ``"ray"``.
        workers: Number of workers.
        k: Gradients summed per update.
        grad_bytes: About the size of a gradient (sets the model's shape, see :meth:`Problem.for_bytes`).
        steps: Updates.
        batch: Samples per worker batch.
        lr: Learning rate (of the mean of the ``k`` gradients).
        seed: Seed of the data and the teacher.
        warmup: Updates left out of the throughput (the first ones include starting up).
        kill_worker: Worker to SIGKILL once ``kill_at_step`` updates are done (None: no kill).
        kill_at_step: See ``kill_worker``.
        env: Environment variables set in the actors before anything else.
        ps_options: More Ray ``.options()`` of the PS (e.g. placement resources).
        worker_options: More Ray ``.options()`` of each worker.
        directory_options: ``actor_options`` of :func:`hoplite_gpu.ray.start_directory`.
        timeout: Seconds the whole run may take.

    Returns:
        A dict: the settings; ``samples_per_s`` (``k * batch`` samples per update, over the updates
        after ``warmup``); per update: ``step_seconds``, ``reduce_seconds`` (until the sum of its
        gradients was at the PS), ``step_end`` (``time.time()``), ``losses`` (mean batch loss of its
        gradients), ``used``/``used_tasks`` (their workers and task numbers), ``staleness`` (updates
        between a used gradient's parameters and the update); ``initial_loss``/``final_loss``
        (exact); ``relaunches`` after failures; ``reissued`` (hoplite: reductions deleted and
        requested again, with why) and ``cancelled_gets`` (see
        :data:`bench.workloads.asgd_actors.DELETED_GET_GRACE`);
        ``tasks`` (every finished task's figures, with its pid); ``kill`` (worker, pid, step, time)
        when one was killed; ``ps_store`` and ``worker_stores`` (hoplite: the local stores' figures
        at the end, see :meth:`hoplite_gpu.Node.stats`).
    """
    import ray

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if (kill_worker is None) != (kill_at_step is None):
        raise ValueError("kill_worker and kill_at_step go together")
    if kill_worker is not None and not 0 <= kill_worker < workers:
        raise ValueError(f"kill_worker must be in 0..{workers - 1}")
    if not 0 <= warmup < steps:
        raise ValueError("warmup must be in 0..steps-1")
    problem = Problem.for_bytes(grad_bytes, batch=batch, seed=seed)
    if mode == "hoplite":
        import hoplite_gpu.ray as hgray

        hgray.start_directory(actor_options=directory_options)
    deadline = time.monotonic() + timeout
    ps_cls = ray.remote(ParameterServer).options(num_cpus=0, max_concurrency=2, **(ps_options or {}))
    worker_cls = ray.remote(Worker)
    ps: Any = ps_cls.remote(problem, mode, env)  # actor handles
    handles: list[Any] = [
        worker_cls.options(
            num_cpus=0,
            max_restarts=-1,
            max_task_retries=0,
            max_concurrency=4,  # compute, watch, and pid/stats calls meanwhile
            **((worker_options or [{}] * workers)[i]),
        ).remote(i, problem, mode, env)
        for i in range(workers)
    ]
    try:
        starting = min(START_TIMEOUT, _left(deadline))
        pids = ray.get([h.pid.remote() for h in handles], timeout=starting)
        ray.get(ps.pid.remote(), timeout=starting)
        initial = Model(problem).loss(np.zeros(problem.params, np.float32))
        training = ps.train.remote(handles, k, steps, lr, _left(deadline))
        kill = None
        if kill_worker is not None and kill_at_step is not None:
            kill = _kill_when(ps, training, kill_at_step, pids[kill_worker], kill_worker, deadline)
        record = ray.get(training, timeout=_left(deadline))
        if mode == "hoplite":  # what the workers' stores hold at the end
            record["worker_stores"] = ray.get([h.stats.remote() for h in handles], timeout=_left(deadline))
    finally:
        for h in [ps, *handles]:
            ray.kill(h)
    record.update(
        mode=mode,
        workers=workers,
        k=k,
        batch=batch,
        lr=lr,
        seed=seed,
        steps=steps,
        warmup=warmup,
        params=problem.params,
        grad_bytes=problem.grad_bytes,
        initial_loss=initial,
        kill=kill,
    )
    ends = record["step_end"]
    timed = ends[-1] - ends[warmup - 1] if warmup else ends[-1] - record["started"]
    record["seconds"] = timed
    record["samples_per_s"] = (steps - warmup) * k * batch / timed
    return record


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the run did not finish in time")
    return left


def _kill_when(ps: Any, training: Any, step: int, pid: int, worker: int, deadline: float) -> dict[str, Any]:
    """SIGKILL ``pid`` once the PS has done ``step`` updates (polled)."""
    import ray

    while (done := ray.get(ps.progress.remote(), timeout=_left(deadline))) < step:
        finished, _ = ray.wait([training], timeout=0.02)
        if finished:
            raise RuntimeError(f"the run ended before update {step} (at {done})")
    os.kill(pid, signal.SIGKILL)
    return {"worker": worker, "pid": pid, "step": done, "time": time.time()}


def failure_summary(record: dict[str, Any], window: int = 5) -> dict[str, Any]:
    """Figures of a run with a killed worker: the median update time before the kill, the
    ``window`` updates from the first one to end after it, how long until the PS relaunched the
    worker after seeing it fail, and until a gradient computed by the restarted process (a pid other
    than the killed one) was used."""
    kill = record["kill"]
    if kill is None:
        raise ValueError("the run killed no worker")
    ends, secs = record["step_end"], record["step_seconds"]
    at = next((i for i, t in enumerate(ends) if t > kill["time"]), len(ends))
    before = secs[record["warmup"] : at] or secs[:at]
    relaunch = [
        r for r in record["relaunches"] if r["worker"] == kill["worker"] and r["time"] >= kill["time"]
    ]
    pid_of = {(t["worker"], t["task"]): t["pid"] for t in record["tasks"]}

    def restarted(step: int) -> bool:
        return any(
            w == kill["worker"] and pid_of.get((w, n)) not in (None, kill["pid"])
            for w, n in record["used_tasks"][step]
        )

    back = next((i for i in range(at, len(ends)) if restarted(i)), None)
    after = secs[at : at + window]
    return {
        "kill_step": at,
        "median_step_s_before": statistics.median(before) if before else None,
        "steps_after_s": after,
        "max_step_s_after": max(after) if after else None,
        "relaunched_after_s": relaunch[0]["time"] - kill["time"] if relaunch else None,
        "rejoined_step": back,
        "rejoined_after_s": ends[back] - kill["time"] if back is not None else None,
    }


def parse_bytes(text: str) -> int:
    """A size in bytes: ``"100MB"`` (decimal units: KB, MB, GB) or ``"64MiB"`` (binary, as
    :func:`hoplite_gpu.baselines.parse_size`)."""
    from hoplite_gpu.baselines import parse_size

    decimal = {"kb": 10**3, "mb": 10**6, "gb": 10**9}
    unit = text.strip()[-2:].lower()
    if unit in decimal and text.strip()[:-2].strip().isdigit():
        return int(text.strip()[:-2]) * decimal[unit]
    return parse_size(text)
