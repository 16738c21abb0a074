"""GPU benchmark: CuPy objects kept on the device, each figure a ratio measured in the same run.

Six parts, each in its own function; a part that fails is recorded in the JSON with its error and
the others still run:

* ``p2p``: a device-to-device ``get`` between two processes on one GPU (the sender puts a CuPy
  array, the receiver ``get``s it as a CuPy array) against ``cudaMemcpy`` device-to-device of the
  same size on that GPU, at 64 MiB and 1 GiB. A fresh ObjectID for every get; the first get of
  each size has no warm-up (as users call it), then the median of ``--repeat`` gets, and of as
  many ``get(out=...)`` into a CuPy array the receiver allocated once. Target: 0.7x the copy.
  Each row also says how many CUDA IPC mappings the receiver opened and how many gets read
  through one it kept open: the sender deletes each object after its get and its next put gets
  that allocation again (``device_pool.DevicePool``), so a mapping the receiver kept serves it; and how
  many gets found the object through its index link, with no lookup (``same_host_index``). One
  more row has a second receiver ask the directory for every object (``same_host_index=False``).
* ``kernel``: ``hoplite_gpu.memory.kernels.reduce_into(SUM)`` at 256 MiB for float32 and bfloat16 (uint16
  storage), as bandwidth (3 x bytes: two reads and one write, over the median of CUDA-event times
  after a warm-up) against the device's copy bandwidth (2 x bytes over the median time of a
  device-to-device copy). Target: 0.8x.
* ``collectives``: broadcast, reduce and allreduce of 256 MiB float32 CuPy arrays among
  ``--workers`` processes sharing the GPU (``hoplite_gpu.collective``), timed as
  ``bench/collectives.py`` times them, against the same collective of NumPy arrays through the
  library. Every round's result is checked against CuPy/NumPy: bit-exact for broadcast, and sums
  of small integers for reduce and allreduce, which are exact. No target: the ratio is the host
  path's time over the device path's; pass means every result was right.
* ``failure``: a member SIGKILLed mid-broadcast of 256 MiB to ``--workers - 1`` members, twice:
  by the library's fault injection half way through receiving (or a quarter of the way through
  relaying, if that comes first), and by this process right after the root's ``put`` returned.
  Pass: the member died before it had its copy and every survivor's copy is bit-exact; the time
  runs from the ``put`` to the last survivor's copy.
* ``wire``: the same get between two processes that do not share memory, so the object crosses
  the data plane in chunks as between hosts: the device object staged through pinned host buffers
  on both sides (the default), and handed to UCX as device memory (``HOPLITE_UCX_CUDA=1``: its
  ``cuda_copy`` transport), each against a host object's get over the same data plane in the same
  pair of processes. No target: it shows what moving device memory costs on the wire, and which of
  the two ways to default to (each row's path is read from the receiver's ``staged_bytes``).
* ``weights``: weight sync (:mod:`hoplite_gpu.weights`) of a ``--size`` state dict in 64 tensors
  (float32 and bfloat16, large and small) of CUDA torch tensors, from a publisher in this
  process to ``--workers - 1`` subscriber processes, each receiving into CUDA tensors of its own,
  against the same with CPU tensors. The time runs from ``publish`` to the last subscriber's
  tensors holding the version; every received tensor is checked bit-exact. The first version
  (no warm-up), then the median of ``--repeat``. No target: it shows what the host staging of
  CUDA tensors costs (device buckets are not built).

Exits 2 with one line where there is no CUDA GPU, 1 if a part failed to run, else 0 (a ratio
below its target is a result, not an error). Run it on a GPU host (``make gpu-check`` on the
device machine runs it after the GPU tests):

    python bench/gpu.py --json bench/results/gpu-h100.json --md bench/results/gpu-h100.md
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.collectives import round_times
from bench.common import format_size, markdown_table, parse_size, start_workers, stop_workers, write_json
from hoplite_gpu.memory import placement

PARTS = ("p2p", "kernel", "collectives", "failure", "wire", "weights")
OPS = ("broadcast", "reduce", "allreduce")
P2P_TARGET = 0.7
KERNEL_TARGET = 0.8


def _sync() -> None:
    import cupy as cp

    cp.cuda.runtime.deviceSynchronize()


def _pattern(xp: Any, nbytes: int) -> Any:
    """float32 values 0..1008: every sum of a few of them, plus small integers, is exact."""
    return xp.arange(nbytes // 4, dtype=xp.float32) % 1009


# ---------------------------------------------------------------- worker processes
def _member(
    address: str,
    token: str,
    rank: int,
    world: int,
    fault: str,
    staged: bool,
    ucx_cuda: bool,
    index: bool,
    conn: Any,
) -> None:
    """A worker process: one node; runs the commands the driver sends until it sends None.
    ``fault``: armed in it (:mod:`hoplite_gpu.faults`). ``staged``: without shared memory, so
    objects reach it over the data plane in chunks, as from another host (a fault fires at a byte
    offset of a transfer; on one host a reader copies the whole object through CUDA IPC at once).
    ``ucx_cuda``: its data plane hands device chunks to UCX as they are (``HOPLITE_UCX_CUDA``).
    ``index``: it finds same-host device objects through their index links (``same_host_index``;
    without, every get asks the directory)."""
    from hoplite_gpu.dataplane.ucx.settings import UCX_CUDA_ENV

    os.environ[UCX_CUDA_ENV] = "1" if ucx_cuda else "0"  # read when UCX loads, at the node's start
    import cupy as cp

    import hoplite_gpu as hg

    _pattern(cp, 4).sum()  # a CUDA context before anything is timed, as a training process has one
    overrides: dict[str, Any] = {"fault_injection": fault} if fault else {}
    if staged:
        overrides["shared_memory"] = False
    overrides["same_host_index"] = index
    node = hg.connect(address, token=token, **overrides)
    state: dict[str, Any] = {"rank": rank, "world": world}
    conn.send("ready")
    try:
        while (msg := conn.recv()) is not None:
            try:
                conn.send(_command(node, state, *msg))
            except Exception as exc:
                conn.send(("error", f"member {rank}: {type(exc).__name__}: {exc}"))
    finally:
        node.close()


def _command(node: Any, state: dict[str, Any], what: str, *args: Any) -> Any:
    if what == "weights":  # part weights: a subscriber (needs torch, not CuPy)
        return _receive_weights(node, state, *args)
    import cupy as cp

    import hoplite_gpu as hg
    from hoplite_gpu import collective as coll

    if what == "get":  # part p2p: one get of a fresh object, timed
        hex_id, nbytes, use_out, timeout = args
        if state.get("nbytes") != nbytes:
            state.update(nbytes=nbytes, want=_pattern(cp, nbytes), out=cp.empty(nbytes // 4, cp.float32))
        _sync()
        t0 = time.perf_counter()
        # The device API: get of a device object returns a CuPy array on this process's current
        # device, and get(out=cupy_array) fills one (today's code returns a NumPy array).
        arr = node.get(hg.ObjectID.from_hex(hex_id), timeout=timeout, out=state["out"] if use_out else None)
        _sync()
        seconds = time.perf_counter() - t0
        if not isinstance(arr, cp.ndarray):
            raise TypeError(f"get returned a {type(arr).__module__}.{type(arr).__name__}, not a CuPy array")
        return seconds, bool(cp.array_equal(arr.reshape(-1), state["want"]))
    if what == "stats":
        return node.stats()
    if what == "put_new":  # part wire: the sender puts a fresh object, device or host
        nbytes, on_device = args
        return node.put(_pattern(cp if on_device else np, nbytes)).hex()
    if what == "delete":
        node.delete(hg.ObjectID.from_hex(args[0]))
        return None
    if what == "get_any":  # part wire: the receiver's get, timed, of a device or host object
        hex_id, nbytes, timeout = args
        _sync()
        t0 = time.perf_counter()
        arr = node.get(hg.ObjectID.from_hex(hex_id), timeout=timeout)
        _sync()
        seconds = time.perf_counter() - t0
        on_device = isinstance(arr, cp.ndarray)
        # Against the pattern as the sender made it (float32 arange past 2**24 differs between
        # NumPy and CuPy: a 1 GiB CuPy object is not NumPy's pattern).
        ok = bool(
            cp.array_equal(arr, _pattern(cp, nbytes))
            if on_device
            else np.array_equal(arr, _pattern(np, nbytes))
        )
        return seconds, ok, on_device, node.stats()["staged_bytes_received"]
    if what == "collective":  # part collectives: rounds of one collective, spans of each
        name, kind, op, nbytes, rounds, timeout = args
        if "group" not in state:
            state["group"] = coll.Group(node, state["rank"], state["world"], name, timeout=timeout)
        return _collective_rounds(state["group"], cp if kind == "device" else np, op, nbytes, rounds)
    if what == "put":  # part failure: the root
        hex_id, nbytes = args
        arr = _pattern(cp, nbytes)
        _sync()
        start = time.monotonic()
        node.put(arr, hg.ObjectID.from_hex(hex_id))  # device API: the object stays on this GPU
        return start
    if what == "fetch":  # part failure: a receiver (maybe the victim)
        hex_id, nbytes, timeout = args
        arr = node.get(hg.ObjectID.from_hex(hex_id), timeout=timeout)
        _sync()
        end = time.monotonic()
        on_device = isinstance(arr, cp.ndarray)
        return end, bool(cp.array_equal(cp.asarray(arr).reshape(-1), _pattern(cp, nbytes))), on_device
    raise ValueError(f"unknown command {what!r}")


def _weights_state(version: int, nbytes: int, on_device: bool) -> dict[str, Any]:
    """About ``nbytes`` in 64 torch tensors, as a transformer's: 32 float32 ones three times the
    size of 32 bfloat16 ones; their values depend on ``version`` (the same bits wherever made)."""
    import torch

    unit = max(nbytes // 64, 8)
    out = {}
    for i in range(32):
        for dtype, size in ((torch.float32, 3 * unit // 8), (torch.bfloat16, unit // 4)):
            values = (torch.arange(size, dtype=torch.float32) + i + version) % 1009
            out[f"layers.{i}.{dtype}".replace("torch.", "")] = values.to(dtype)
    return {k: v.cuda() for k, v in out.items()} if on_device else out


def _receive_weights(
    node: Any, state: dict[str, Any], name: str, version: int, nbytes: int, on_device: bool, timeout: float
) -> tuple[float, bool]:
    """Receive ``version`` of ``name`` into this subscriber's tensors; when they held it, and
    whether every one is bit-exact. Version 0 only makes the subscriber and its tensors (an
    engine has its model's before any sync; so is torch imported and CUDA started untimed)."""
    import torch

    from hoplite_gpu.weights import WeightSubscriber

    if state.get("weights") != name:
        want = _weights_state(0, nbytes, on_device)
        state.update(
            weights=name,
            sub=WeightSubscriber(node, name),
            into={k: torch.empty_like(v) for k, v in want.items()},
        )
    if version == 0:
        return time.monotonic(), True
    got, into = state["sub"].receive(version=version, into=state["into"], timeout=timeout)
    if on_device:
        torch.cuda.synchronize()
    end = time.monotonic()
    want = _weights_state(version, nbytes, on_device)
    return end, got == version and all(torch.equal(into[k], want[k]) for k in want)


def _collective_rounds(group: Any, xp: Any, op: str, nbytes: int, rounds: int) -> list[tuple[float, float]]:
    """``rounds`` rounds of ``op`` with root 0, each after a barrier, each result checked."""
    from hoplite_gpu import collective as coll

    rank, world = group.rank, group.world_size
    base = _pattern(xp, nbytes)
    mine = base if op == "broadcast" else base + rank
    want = base if op == "broadcast" else base * world + world * (world - 1) // 2
    arr = xp.empty_like(base)
    spans = []
    for i in range(rounds):
        if op == "broadcast" and rank != 0:
            arr.fill(-1)
        else:
            arr[...] = mine
        if xp is not np:
            _sync()
        coll.barrier(group)
        start = time.monotonic()
        if op == "allreduce":
            coll.allreduce(arr, group)
        else:
            getattr(coll, op)(arr, 0, group)
        if xp is not np:
            _sync()
        spans.append((start, time.monotonic()))
        if (op != "reduce" or rank == 0) and not bool(xp.array_equal(arr, want)):
            raise AssertionError(f"{op} round {i}: member {rank}'s result differs from {xp.__name__}'s")
    return spans


def _answer(pipe: Any, timeout: float) -> Any:
    if not pipe.poll(timeout):
        raise TimeoutError(f"a worker did not answer within {timeout:.0f} s")
    reply = pipe.recv()
    if isinstance(reply, tuple) and reply and reply[0] == "error":
        raise RuntimeError(reply[1])
    return reply


# ---------------------------------------------------------------- measurements
def _event_seconds(fn: Callable[[], None], repeat: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` on the current stream, timed with CUDA events after ``warmup`` calls."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return statistics.median(times)


def copy_seconds(nbytes: int, repeat: int) -> float:
    """Median seconds of a device-to-device ``cudaMemcpyAsync`` of ``nbytes`` on this GPU."""
    import cupy as cp

    src, dst = cp.ones(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)
    kind = cp.cuda.runtime.memcpyDeviceToDevice
    stream = cp.cuda.get_current_stream().ptr
    return _event_seconds(
        lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, kind, stream), repeat
    )


def _row(
    part: str,
    name: str,
    size: int,
    gbps: float | None,
    baseline: str,
    baseline_gbps: float | None,
    target: float | None,
    correct: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    ratio = gbps / baseline_gbps if gbps and baseline_gbps else None
    met = target is None or (ratio is not None and ratio >= target)
    return {
        "part": part,
        "measurement": name,
        "size": size,
        "gbps": gbps,
        "baseline": baseline,
        "baseline_gbps": baseline_gbps,
        "ratio": ratio,
        "target": target,
        "pass": bool(correct and met),
        **extra,
    }


def _answers(pipes: list[Any], timeout: float) -> list[Any]:
    """Every worker's answer, in order; raises as soon as one reports an error (the others may be
    waiting for it inside a collective)."""
    from multiprocessing.connection import wait

    replies: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(replies) < len(pipes):
        waiting = [pipe for i, pipe in enumerate(pipes) if i not in replies]
        ready = wait(waiting, max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(
                f"{len(waiting)} of {len(pipes)} workers did not answer within {timeout:.0f} s"
            )
        for pipe in ready:
            replies[pipes.index(pipe)] = _answer(pipe, 0)
    return [replies[i] for i in range(len(pipes))]


def _p2p_get(node: Any, pipe: Any, src: Any, use_out: bool, timeout: float) -> float:
    """Put ``src`` under a fresh ObjectID, have the receiver get it; the get's seconds."""
    oid = node.put(src)  # device API: the put keeps a CuPy array on its device
    try:
        pipe.send(("get", oid.hex(), src.nbytes, use_out, timeout))
        seconds, ok = _answer(pipe, timeout)
    finally:
        node.delete(oid)
    if not ok:
        raise AssertionError(
            f"get of {format_size(src.nbytes)}: the receiver's copy differs from the sender's"
        )
    return float(seconds)


def _paths(events: list[dict[str, Any]]) -> str:
    """How the gets among ``events`` (the directory's event log) were served: ``ipc`` (opened the
    holder's device memory on this host), ``shm`` (mapped a host segment), ``pull`` (the data plane,
    staged through host memory), with counts where they differ."""
    kinds = {"lookup_ipc": "ipc", "lookup_shm": "shm", "transfer_start": "pull"}
    counts = collections.Counter(kinds[e["kind"]] for e in events if e["kind"] in kinds)
    return ", ".join(f"{path} x{n}" for path, n in sorted(counts.items())) or "none"


def part_p2p(node: Any, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """A device-to-device get between two processes against cudaMemcpy of the same size."""
    import cupy as cp

    # Receiver 1 finds the sender's objects through their index links (the default); receiver 2
    # asks the directory for each (same_host_index off), for the row that shows what that costs.
    receivers = [(node.directory_address, node.token, r, 3, "", False, False, r == 1) for r in (1, 2)]
    pipes, procs = start_workers(_member, receivers, daemon=False)
    try:
        for size in args.p2p_sizes:
            src = _pattern(cp, size)
            copy_gbps = size / copy_seconds(size, max(args.repeat, 20)) / 1e9
            for name, use_out, times, pipe in (
                ("get, first (no warm-up)", False, 1, pipes[0]),
                (f"get, median of {args.repeat}", False, args.repeat, pipes[0]),
                (f"get(out=cupy), median of {args.repeat}", True, args.repeat, pipes[0]),
                (f"get asking the directory, median of {args.repeat}", False, args.repeat, pipes[1]),
            ):
                since = node.event_log()[-1]["seq"] + 1
                pipe.send(("stats",))
                before = _answer(pipe, args.timeout)
                seconds = statistics.median(
                    _p2p_get(node, pipe, src, use_out, args.timeout) for _ in range(times)
                )
                pipe.send(("stats",))
                after = _answer(pipe, args.timeout)
                opened, kept, indexed = (
                    after[f"device_ipc_{k}"] - before[f"device_ipc_{k}"]
                    for k in ("opened", "reused", "indexed")
                )
                rows.append(
                    _row(
                        "p2p",
                        name,
                        size,
                        size / seconds / 1e9,
                        "cudaMemcpy d2d",
                        copy_gbps,
                        P2P_TARGET,
                        seconds=seconds,
                        path=(
                            f"{_paths(node.event_log(since))}; index links {indexed}; "
                            f"mappings opened {opened}, kept {kept}"
                        ),
                        mappings_opened=opened,
                        mappings_kept=kept,
                        indexed=indexed,
                    )
                )
            del src
            cp.get_default_memory_pool().free_all_blocks()
    finally:
        stop_workers(pipes, procs)


def _wire_get(pipes: list[Any], size: int, on_device: bool, timeout: float) -> tuple[float, int]:
    """Member 0 puts a fresh object of ``size``, member 1 gets it: the get's seconds, and the
    device bytes member 1 has received through host staging buffers so far."""
    pipes[0].send(("put_new", size, on_device))
    hex_id = _answer(pipes[0], timeout)
    try:
        pipes[1].send(("get_any", hex_id, size, timeout))
        seconds, ok, device_copy, staged = _answer(pipes[1], timeout)
    finally:
        pipes[0].send(("delete", hex_id))
        _answer(pipes[0], timeout)
    if not ok or device_copy != on_device:
        raise AssertionError(f"get of {format_size(size)}: wrong bytes or memory (device: {device_copy})")
    return float(seconds), int(staged)


def part_wire(node: Any, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """A device object over the data plane between two processes (as between hosts): staged through
    pinned host buffers, and as device memory handed to UCX, each against a host object's get."""
    for ucx_cuda in (False, True):
        specs = [(node.directory_address, node.token, r, 2, "", True, ucx_cuda, True) for r in (1, 2)]
        pipes, procs = start_workers(_member, specs, daemon=False)
        try:
            for size in args.p2p_sizes:
                host = [_wire_get(pipes, size, False, args.timeout) for _ in range(args.repeat)]
                device = [_wire_get(pipes, size, True, args.timeout) for _ in range(args.repeat)]
                seconds = statistics.median(t for t, _ in device)
                staged = device[-1][1] - host[-1][1]  # during the device gets
                rows.append(
                    _row(
                        "wire",
                        f"device get over the data plane, {'UCX cuda_copy' if ucx_cuda else 'staged'},"
                        f" median of {args.repeat}",
                        size,
                        size / seconds / 1e9,
                        "host get, same pair",
                        size / statistics.median(t for t, _ in host) / 1e9,
                        None,
                        seconds=seconds,
                        path="staged" if staged else "device memory to UCX",
                    )
                )
        finally:
            stop_workers(pipes, procs)


def part_kernel(node: Any, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The reduce kernel's bandwidth (3 x bytes) against the device's copy bandwidth (2 x bytes)."""
    import functools

    import cupy as cp

    from hoplite_gpu.memory import kernels
    from hoplite_gpu.reduce_ops import ReduceOp

    size, repeat = args.kernel_size, max(args.repeat, 20)
    copy_gbps = 2 * size / copy_seconds(size, repeat) / 1e9
    # bfloat16 travels as uint16 storage: 0x3F80 is 1.0 and 0x4000 is 2.0.
    for dtype, storage, one, two in (
        ("float32", cp.float32, 1.0, 2.0),
        ("bfloat16", cp.uint16, 0x3F80, 0x4000),
    ):
        n = size // cp.dtype(storage).itemsize
        acc, other = cp.full(n, one, storage), cp.full(n, one, storage)
        step = functools.partial(kernels.reduce_into, ReduceOp.SUM, acc, other, dtype)
        step()  # compiles the kernels on first use
        correct = bool((acc == two).all())
        seconds = _event_seconds(step, repeat)
        rows.append(
            _row(
                "kernel",
                f"reduce_into SUM {dtype}",
                size,
                3 * size / seconds / 1e9,
                "d2d copy (2 x bytes)",
                copy_gbps,
                KERNEL_TARGET,
                correct,
                seconds=seconds,
            )
        )
        del acc, other, step


def part_collectives(node: Any, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Broadcast, reduce, allreduce of CuPy arrays against the same with NumPy arrays."""
    world, size, rounds = args.workers, args.size, args.warmup + args.repeat
    members = [(node.directory_address, node.token, r, world, "", False, False, True) for r in range(world)]
    pipes, procs = start_workers(_member, members, daemon=False)
    name = f"bench-gpu-{os.getpid()}-{time.time_ns()}"
    try:
        for op in OPS:
            seconds, paths = {}, {}
            for kind in ("device", "host"):
                since = node.event_log()[-1]["seq"] + 1
                for pipe in pipes:
                    pipe.send(("collective", name, kind, op, size, rounds, args.timeout))
                spans = _answers(pipes, args.timeout * rounds)
                seconds[kind] = statistics.median(round_times(spans, args.warmup, args.repeat))
                paths[kind] = _paths(node.event_log(since))
            rows.append(
                _row(
                    "collectives",
                    f"{op}, {world} processes, median of {args.repeat}",
                    size,
                    size / seconds["device"] / 1e9,
                    "same with NumPy arrays",
                    size / seconds["host"] / 1e9,
                    None,
                    seconds=seconds["device"],
                    host_seconds=seconds["host"],
                    path=paths["device"],
                    host_path=paths["host"],
                )
            )
    finally:
        stop_workers(pipes, procs, timeout=10)


def _replied(pipe: Any) -> bool:
    """Whether a (possibly dead) worker sent an answer that is still unread."""
    try:
        return bool(pipe.poll(0)) and pipe.recv() is not None
    except (EOFError, OSError):  # it died without answering
        return False


def _kill_broadcast(node: Any, args: argparse.Namespace, injected: bool) -> dict[str, Any]:
    """Member 0 puts an array that members 1.. are already getting; member 1 is SIGKILLed. With
    ``injected``, member 1 kills itself half way through receiving the object, or a quarter of the
    way through relaying it, whichever comes first (:mod:`hoplite_gpu.faults`; member 1 then
    receives over the data plane, staged, as from another host); else this process kills it as
    soon as member 0's put returns (every member on the same-host path, CUDA IPC)."""
    import hoplite_gpu as hg

    world, size = args.workers, args.size
    hex_id = hg.ObjectID.random().hex()
    fault = f"receive:{hex_id}:0.5:KILL,serve:{hex_id}:0.25:KILL" if injected else ""
    address, token = node.directory_address, node.token
    members = [
        (address, token, r, world, fault if r == 1 else "", injected, False, True) for r in range(world)
    ]
    pipes, procs = start_workers(_member, members, daemon=False)
    try:
        for r in range(1, world):  # gets before the put, member 1's first: later readers may stream from it
            pipes[r].send(("fetch", hex_id, size, args.timeout))
            time.sleep(0.2)
        pipes[0].send(("put", hex_id, size))
        start = _answer(pipes[0], args.timeout)
        if not injected:
            os.kill(procs[1].pid, signal.SIGKILL)
        survivors = _answers(pipes[2:], args.timeout)
        procs[1].join(10)
        killed = procs[1].exitcode == -signal.SIGKILL and not _replied(pipes[1])
    finally:
        stop_workers(pipes, procs, timeout=10)
    seconds = max(end for end, _, _ in survivors) - start
    exact = all(ok for _, ok, _ in survivors)
    how = "killed itself half way (fault injection)" if injected else "SIGKILLed after the put"
    return _row(
        "failure",
        f"broadcast to {world - 1}, member 1 {how}",
        size,
        size / seconds / 1e9,
        "",
        None,
        None,
        killed and exact,
        seconds=seconds,
        victim_killed_before_its_copy=killed,
        survivors_exact=exact,
        survivors_on_device=all(dev for *_, dev in survivors),
        note="" if killed else "member 1 had its whole copy first: not a mid-transfer kill",
    )


def part_failure(node: Any, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """A receiver SIGKILLed mid-broadcast: the survivors must finish with the root's bytes."""
    for injected in (True, False):
        try:
            rows.append(_kill_broadcast(node, args, injected))
        except Exception as exc:
            name = "fault injection" if injected else "SIGKILL after the put"
            rows.append(_row("failure", name, args.size, None, "", None, None, False, error=repr(exc)))


def part_weights(node: Any, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Weight sync of CUDA torch tensors against the same of CPU tensors (see the module's doc)."""
    import torch

    from hoplite_gpu.weights import WeightPublisher

    world, size = args.workers - 1, args.size
    specs = [(node.directory_address, node.token, r, world, "", False, False, True) for r in range(world)]
    pipes, procs = start_workers(_member, specs, daemon=False)
    times: dict[str, list[float]] = {}
    try:
        for kind in ("device", "host"):
            name = f"bench-weights-{kind}-{os.getpid()}-{time.time_ns()}"
            with WeightPublisher(node, name, timeout=args.timeout) as pub:
                times[kind] = []
                for pipe in pipes:
                    pipe.send(("weights", name, 0, size, kind == "device", args.timeout))
                _answers(pipes, args.timeout)
                for version in range(1, args.repeat + 2):
                    tensors = _weights_state(version, size, kind == "device")
                    if kind == "device":
                        torch.cuda.synchronize()
                    for pipe in pipes:
                        pipe.send(("weights", name, version, size, kind == "device", args.timeout))
                    start = time.monotonic()
                    pub.publish(tensors, version=version)
                    answers = _answers(pipes, args.timeout)
                    if not all(ok for _, ok in answers):
                        raise AssertionError(f"version {version} of {kind} tensors arrived wrong")
                    times[kind].append(max(end for end, _ in answers) - start)
    finally:
        stop_workers(pipes, procs)
    nbytes = sum(t.nbytes for t in _weights_state(0, size, False).values())
    for which, pick in (("first version (no warm-up)", lambda ts: ts[0]), (f"median of {args.repeat}", None)):
        seconds = {k: pick(ts) if pick else statistics.median(ts[1:]) for k, ts in times.items()}
        rows.append(
            _row(
                "weights",
                f"publish + receive into CUDA tensors, {world} subscribers, {which}",
                nbytes,
                nbytes / seconds["device"] / 1e9,
                "same with CPU tensors",
                nbytes / seconds["host"] / 1e9,
                None,
                seconds=seconds["device"],
                host_seconds=seconds["host"],
            )
        )


PART_FUNCTIONS = {
    "p2p": part_p2p,
    "wire": part_wire,
    "kernel": part_kernel,
    "collectives": part_collectives,
    "failure": part_failure,
    "weights": part_weights,
}


# ---------------------------------------------------------------- report
def environment() -> dict[str, Any]:
    """The GPU (CuPy's and NVML's view), driver and versions."""
    import cupy as cp

    import hoplite_gpu as hg

    props = cp.cuda.runtime.getDeviceProperties(0)
    env: dict[str, Any] = {
        "device": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
        "devices": cp.cuda.runtime.getDeviceCount(),
        "compute_capability": f"{props['major']}.{props['minor']}",
        "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
        "cuda_driver_api": cp.cuda.runtime.driverGetVersion(),
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "cupy": cp.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "hoplite_gpu": hg.__version__,
    }
    try:
        import ucxx

        env["ucxx"] = ucxx.__version__
    except Exception as exc:
        env["ucxx"] = f"not importable: {exc}"
    inventory = placement.inventory()  # NVML's view, as `hoplite-gpu info` prints it
    env["driver"] = inventory.driver_version or f"NVML unavailable: {inventory.error}"
    if inventory.gpus:
        env["nvml_device"] = inventory.gpus[0].name
    return env


def run_parts(args: argparse.Namespace, record: dict[str, Any]) -> None:
    """Run each part in turn into ``record`` (its ``parts`` and ``rows``), saving it after each: a
    part's error is recorded beside the rows it measured, and a run stopped by a time limit keeps
    the parts it finished."""
    import cupy as cp

    import hoplite_gpu as hg

    node = hg.init()
    try:
        for part in args.parts:
            print(f"== {part}", file=sys.stderr, flush=True)
            start, error = time.monotonic(), None
            measured: list[dict[str, Any]] = []
            try:
                PART_FUNCTIONS[part](node, args, measured)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            record["parts"][part] = {"seconds": round(time.monotonic() - start, 1), "error": error}
            record["rows"] += measured
            cp.get_default_memory_pool().free_all_blocks()
            save(record, args)
    finally:
        node.close()


def save(record: dict[str, Any], args: argparse.Namespace) -> str:
    """Update the record's summary, write ``--json`` and ``--md``; returns the Markdown."""
    record["summary"] = {
        "passed": sum(r["pass"] for r in record["rows"]),
        "failed": sum(not r["pass"] for r in record["rows"]),
        "parts_with_errors": [p for p, info in record["parts"].items() if info["error"]],
        "parts_not_run": [p for p in args.parts if p not in record["parts"]],
    }
    table = format_markdown(record)
    write_json(args.json, record)
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(table)
    return table


def _cell(value: Any, digits: int = 2) -> str:
    if value is None:
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def format_markdown(record: dict[str, Any]) -> str:
    env = record["environment"]
    lines = [
        f"# GPU benchmark: {env['device']}",
        "",
        f"{record['date']}; driver {env.get('driver')}, CUDA runtime {env['cuda_runtime']},"
        f" CuPy {env['cupy']}, ucxx {env.get('ucxx')}, hoplite_gpu {env['hoplite_gpu']},"
        f" Python {env['python']}."
        f" `python bench/gpu.py {' '.join(record['argv'])}`",
        "",
    ]
    columns = [("part", "l"), ("measurement", "l"), ("size", "r"), ("GB/s", "r"), ("baseline", "l")]
    columns += [("baseline GB/s", "r"), ("ratio", "r"), ("target", "r"), ("pass", "c")]
    cells = [
        [
            r["part"],
            r["measurement"]
            + (f" ({r['note']})" if r.get("note") else "")
            + (f" [{r['path']}]" if r.get("path") else ""),
            format_size(r["size"]),
            _cell(r["gbps"], 1),
            r["baseline"],
            _cell(r["baseline_gbps"], 1),
            _cell(r["ratio"]),
            _cell(r["target"]),
            "yes" if r["pass"] else "**no**",
        ]
        for r in record["rows"]
    ]
    lines.append(markdown_table(columns, cells))
    errors = [f"- {part}: {info['error']}" for part, info in record["parts"].items() if info["error"]]
    if errors:
        lines += ["", "Parts that did not run to the end:", *errors]
    if record["summary"]["parts_not_run"]:
        lines += ["", "Parts not run (stopped first): " + ", ".join(record["summary"]["parts_not_run"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS))
    ap.add_argument("--p2p-sizes", default="64MiB,1GiB", help="sizes of the p2p part")
    ap.add_argument("--kernel-size", default="256MiB")
    ap.add_argument("--size", default="256MiB", help="array size of the collectives and failure parts")
    ap.add_argument("--workers", type=int, default=4, help="processes of the collectives and failure parts")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds of each collective")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any one operation may take")
    ap.add_argument("--json", help="write the record to this file")
    ap.add_argument("--md", help="write the Markdown table to this file")
    args = ap.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not args.parts or set(args.parts) - set(PARTS):
        ap.error("--parts takes " + ", ".join(PARTS))
    if args.workers < 3:
        ap.error("--workers must be >= 3 (the failure part kills one and needs a survivor)")
    args.p2p_sizes = [parse_size(s) for s in args.p2p_sizes.split(",")]
    args.kernel_size, args.size = parse_size(args.kernel_size), parse_size(args.size)

    from hoplite_gpu.memory import kernels

    if not kernels.available():
        print("bench/gpu.py: no CUDA GPU here (CuPy is not installed or sees no device)", file=sys.stderr)
        return 2
    # A time limit's SIGTERM unwinds (the workers are stopped) instead of killing this process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    record: dict[str, Any] = {
        "benchmark": "bench/gpu.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else argv,
        "environment": environment(),
        "parts": {},
        "rows": [],
    }
    run_parts(args, record)
    print(save(record, args))
    return 1 if record["summary"]["parts_with_errors"] else 0


__all__ = ["copy_seconds", "environment", "format_markdown", "main", "run_parts", "save"]

if __name__ == "__main__":
    raise SystemExit(main())
