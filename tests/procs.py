"""Helpers for multi-process tests: worker processes that run node commands sent over a pipe."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

CMD_TIMEOUT = 120.0
#: Seconds a fault test allows past the configured timeout it checks (a loaded 2-core machine).
MARGIN = 3.0


def digest(arr: np.ndarray[Any, Any]) -> str:
    """Hex xxh3-128 of an array's bytes plus its dtype and shape."""
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return f"{arr.dtype.str}{tuple(arr.shape)}:{xxhash.xxh3_128_hexdigest(flat)}"


def make_array(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray[Any, Any]:
    """Deterministic array of any dtype/shape: small integers (0-250, so sums stay exact) drawn
    from a generator seeded with ``seed`` (PCG64), so no pattern repeats along the array and arrays
    of different seeds differ throughout (a relay that sends bytes from a wrong offset fails the
    digest check)."""
    n = int(np.prod(shape))
    raw = np.random.Generator(np.random.PCG64(seed % (1 << 64))).integers(0, 251, n, dtype=np.uint8)
    if dtype == "bfloat16":
        import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy; nothing else may have)
    return raw.astype(dtype).reshape(shape)


def make_strided(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray[Any, Any]:
    """:func:`make_array`'s values in a non-contiguous array: every other element of one twice
    its size (its ``base``), the elements between left zero."""
    wide = np.zeros((*shape, 2), dtype)
    arr = wide[..., 0]
    arr[...] = make_array(dtype, shape, seed)
    return arr


def device_array(backend: str, arr: np.ndarray[Any, Any]) -> Any:
    """A device copy of ``arr``: simulated device memory (``"sim"``) or a CuPy array (``"cupy"``)."""
    if backend == "sim":
        from hoplite_gpu.memory import sim

        return sim.sim_array(arr)
    import cupy

    return cupy.asarray(arr)


#: What :func:`array_type` names a device array of each backend (see :func:`device_array`).
DEVICE_TYPE = {"sim": "hoplite_gpu.SimDeviceArray", "cupy": "cupy.ndarray"}


def array_type(arr: Any) -> str:
    """``module.Class`` of an array (``numpy.ndarray``, ``cupy.ndarray``, ...)."""
    return f"{type(arr).__module__.split('.')[0]}.{type(arr).__name__}"


def _node(hg: Any, address: str, token: str, overrides: dict[str, Any]) -> Any:
    """The worker's node: connected to ``address``, or with ``ray_directory`` (the Ray cluster's
    address, namespace and the directory actor's name) found through that actor, as a Ray
    program's processes find it (and find it again once Ray restarted it)."""
    ray_directory = overrides.pop("ray_directory", None)
    if ray_directory is None:
        return hg.connect(address, token=token, **overrides)
    import ray

    import hoplite_gpu.ray as hgray

    cluster, namespace, name = ray_directory
    ray.init(address=cluster, namespace=namespace, logging_level="WARNING", log_to_driver=False)
    return hgray.node(name, config=hg.Config.from_env().replace(**overrides))


def _serve(address: str, token: str, overrides: dict[str, Any], conn: Any) -> None:
    import faulthandler
    import signal

    import hoplite_gpu as hg

    faulthandler.enable()  # a crash in native code prints its stacks
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand, for debugging hangs

    node = _node(hg, address, token, overrides)

    def tasks_on_stderr(*_: Any) -> None:  # SIGUSR2: the I/O thread's coroutines, for hangs
        import sys

        def dump() -> None:
            for task in asyncio.all_tasks(node._io.loop):
                lines, coro = [repr(task)[:200]], task.get_coro()
                while coro is not None and hasattr(coro, "cr_frame"):  # down the awaits
                    frame = coro.cr_frame
                    if frame is not None:
                        lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
                    coro = coro.cr_await
                lines.append(f"  awaits {coro!r}"[:300])
                print("\n".join(lines), file=sys.stderr)

        node._io.loop.call_soon_threadsafe(dump)

    signal.signal(signal.SIGUSR2, tasks_on_stderr)
    conn.send(("ok", node.node_id))
    groups: dict[str, Any] = {}
    held: dict[str, Any] = {}  # arrays returned by get, kept alive ("hold")

    def run(cmd: str, args: tuple[Any, ...]) -> Any:
        if cmd in COLLECTIVES:
            return _collective(hg, node, groups, cmd, args)
        if cmd in WEIGHTS:
            return _weights(node, held, cmd, args)
        if cmd == "reduce":
            ids, op, k, rid_hex, timeout = args
            rid = node.reduce(
                [hg.ObjectID.from_hex(h) for h in ids],
                op,
                num_objects=k,
                reduction_id=hg.ObjectID.from_hex(rid_hex) if rid_hex else None,
                timeout=timeout,
            )
            return rid.hex()
        if cmd == "get_array":
            return np.array(node.get(hg.ObjectID.from_hex(args[0]), timeout=args[1]))
        if cmd == "get_into":  # into a preallocated array (the caller's out=)
            oid_hex, timeout, dtype, shape = args
            out = np.full(shape, 7, dtype)
            returned = node.get(hg.ObjectID.from_hex(oid_hex), timeout=timeout, out=out)
            return digest(out) if returned is out else "get did not return out"
        if cmd == "put_array":
            return node.put(args[0], hg.ObjectID.from_hex(args[1]) if args[1] else None).hex()
        if cmd == "objects":
            return node.stats()["objects"]
        if cmd == "stats":  # node.stats(), its data address and this process's resident memory
            with open("/proc/self/statm") as statm:
                rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            return {**node.stats(), "data_address": node.data_address, "rss_bytes": rss}
        if cmd == "get":
            oid_hex, timeout = args
            return digest(node.get(hg.ObjectID.from_hex(oid_hex), timeout=timeout))
        if cmd == "hold":  # get and keep the returned array; its digest and whether it is writable
            oid_hex, timeout = args
            held[oid_hex] = node.get(hg.ObjectID.from_hex(oid_hex), timeout=timeout)
            return digest(held[oid_hex]), bool(held[oid_hex].flags.writeable)
        if cmd == "held":  # digest of an array kept by "hold"
            return digest(held[args[0]])
        if cmd == "get_many":
            oids, timeout = args

            async def all_of() -> list[str]:
                arrs = await asyncio.gather(
                    *(node.get_async(hg.ObjectID.from_hex(h), timeout=timeout) for h in oids)
                )
                return [digest(a) for a in arrs]

            return asyncio.run(all_of())
        if cmd == "put":
            dtype, shape, seed, oid_hex = args
            oid = hg.ObjectID.from_hex(oid_hex) if oid_hex else None
            return node.put(make_array(dtype, shape, seed), oid).hex()
        if cmd == "use_device":  # work with a device, as a GPU process does before it gets objects
            from hoplite_gpu.memory import device

            device_array(args[0], np.zeros(1, np.uint8))
            return device.default_backend().in_use()
        if cmd == "put_device":  # put a device array: "sim" (simulated device memory) or "cupy"
            backend, dtype, shape, seed, oid_hex = args
            oid = hg.ObjectID.from_hex(oid_hex) if oid_hex else None
            return node.put(device_array(backend, make_array(dtype, shape, seed)), oid).hex()
        if cmd == "get_typed":  # the type of array get returned, and its digest
            from hoplite_gpu.memory import to_host

            got = node.get(hg.ObjectID.from_hex(args[0]), timeout=args[1])
            return array_type(got), digest(to_host(got).view(np.ndarray))
        if cmd == "buffer_kind":  # where this node's copy of an object lives (None: no copy)
            obj = node._store.get(hg.ObjectID.from_hex(args[0]))
            return None if obj is None else obj.buffer.kind.value
        if cmd == "ticket":  # the device memory ticket of an object this node holds ("" if none)
            obj = node._store.get(hg.ObjectID.from_hex(args[0]))
            return "" if obj is None or obj.buffer.ticket is None else obj.buffer.ticket.name
        if cmd == "ipc_open":  # open a same-host holder's device memory and keep it open
            from hoplite_gpu.memory import ipc, to_host

            segment, oid_hex, dtype, shape = args
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            opened = ipc.PROCESS.open_ticket(segment, bytes.fromhex(oid_hex), nbytes, node._memory.seal_key)
            if opened is None:
                return None
            held["ipc"] = opened
            return digest(to_host(opened.array).view(np.ndarray).view(dtype).reshape(shape))
        if cmd == "ipc_close":
            held.pop("ipc").close()
            return True
        if cmd == "ipc_sweep":  # close kept mappings of memory their holders let go; how many stay
            from hoplite_gpu.memory import ipc

            return ipc.PROCESS.sweep()
        if cmd == "arm":
            from hoplite_gpu import faults

            faults.arm(args[0])
            return True
        if cmd == "disarm":
            from hoplite_gpu import faults

            faults.clear()
            return True
        if cmd == "reduced_objects":
            return [o.hex() for o in node.reduced_objects(hg.ObjectID.from_hex(args[0]), timeout=args[1])]
        if cmd == "contains":
            return node.contains(hg.ObjectID.from_hex(args[0]))
        if cmd == "delete":
            return node.delete(hg.ObjectID.from_hex(args[0]))
        if cmd == "cpu_while_idle":
            # CPU seconds per second this process uses over an interval in which it is asked to do
            # nothing (a measurement window, not synchronisation).
            before = os.times()
            time.sleep(args[0])
            after = os.times()
            return (after.user + after.system - before.user - before.system) / args[0]
        raise ValueError(cmd)

    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            cmd, args = msg
            try:
                conn.send(("ok", run(cmd, args)))
            except BaseException as exc:  # report to the test
                conn.send(("error", (type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        node.close()


COLLECTIVES = (
    "group",
    "allreduce",
    "allgather",
    "gather",
    "reducescatter",
    "broadcast",
    "reduce_to",
    "barrier",
    "destroy",
    "destroy_later",
    "destroyed",
    "abort",
    "lost",
    "agree",
    "send",
    "recv",
    "scatter",
    "alltoall",
)


WEIGHTS = ("publish", "receive_weights", "latest_weights", "close_weights")


def weights_state(layout: list[tuple[str, str, tuple[int, ...]]], seed: int) -> dict[str, Any]:
    """Named arrays of ``layout`` (name, dtype, shape), distinct per seed."""
    return {name: make_array(dtype, shape, seed + i) for i, (name, dtype, shape) in enumerate(layout)}


def _weights(node: Any, held: dict[str, Any], cmd: str, args: tuple[Any, ...]) -> Any:
    """Weight sync (:mod:`hoplite_gpu.weights`): one publisher or subscriber per name, kept."""
    from hoplite_gpu.weights import WeightPublisher, WeightSubscriber

    name = args[0]
    if cmd == "publish":  # name, version, layout, seed, publisher kwargs: the bucket count
        version, layout, seed, kwargs = args[1:]
        if ("pub", name) not in held:
            held["pub", name] = WeightPublisher(node, name, **kwargs)
        return len(held["pub", name].publish(weights_state(layout, seed), version).buckets)
    if cmd == "close_weights":
        for key in [("pub", name), ("sub", name)]:
            if key in held:
                held.pop(key).close()
        return True
    sub = held.setdefault(("sub", name), WeightSubscriber(node, name))
    if cmd == "latest_weights":  # name, timeout, newer_than
        return sub.latest(args[1], newer_than=args[2])
    version, timeout, layout = args[1:]  # layout: fill arrays of it in place (None: new ones)
    into = {k: np.full(v.shape, 7, v.dtype) for k, v in weights_state(layout, 0).items()} if layout else None
    got, tensors = sub.receive(version, into=into, timeout=timeout)
    if into is not None and any(tensors[k] is not into[k] for k in into):
        raise AssertionError("receive did not fill the arrays given")
    return got, {k: digest(v) for k, v in tensors.items()}


_destroying: dict[str, Any] = {}  # group name -> the future of Group.destroy(wait=False)


def _collective(hg: Any, node: Any, groups: dict[str, Any], cmd: str, args: tuple[Any, ...]) -> Any:
    """Group collectives; arrays are ``make_array(dtype, shape, seed)`` with a per-rank seed."""
    if cmd == "group":
        name, rank, world, *rest = args  # the group's timeout (CMD_TIMEOUT unless given), watch
        timeout, watch = (rest + [CMD_TIMEOUT, False][len(rest) :])[:2]
        groups[name] = hg.collective.Group(node, rank, world, name, timeout=timeout, watch=watch)
        return rank
    group = groups[args[0]]
    coll = hg.collective
    if cmd == "barrier":
        return coll.barrier(group)
    if cmd == "abort":
        return group.abort(args[1])
    if cmd == "agree":  # name, agreement name, vote: the members and the vote decided
        where = hg.ObjectID.from_name(args[1])
        decided = node.agree(group.watch_id, where, group.rank, group.world_size, args[2])
        return list(decided.members), decided.vote
    if cmd == "lost":  # the members lost so far, and what broke the group
        return group.lost, type(group.error).__name__ if group.error else None
    if cmd == "send":  # name, dtype, shape, seed, dst, tag
        coll.send(make_array(args[1], args[2], args[3]), args[4], group, tag=args[5])
        return True
    if cmd == "recv":  # name, dtype, shape, src, tag: the array received
        return coll.recv(np.empty(args[2], args[1]), args[3], group, tag=args[4])
    if cmd == "destroy":
        return group.destroy()
    if cmd == "destroy_later":  # destroy without waiting; "destroyed" waits for the clean-up
        _destroying[args[0]] = group.destroy(wait=False)
        return True
    if cmd == "destroyed":
        return _destroying.pop(args[0]).result(timeout=CMD_TIMEOUT)
    dtype, shape, seed = args[1:4]
    memory, _, dtype = dtype.rpartition(":")  # "sim:float32" / "cupy:float32": a device array
    arr = make_array(dtype, shape, seed + group.rank)
    frozen = memory == "readonly"  # "readonly:float32": arrays no result can be written into
    if frozen:
        arr.flags.writeable = False
        memory = ""
    if memory == "strided":  # "strided:float32": the same values in a non-contiguous array
        arr, memory = make_strided(dtype, shape, seed + group.rank), ""
    if memory:
        from hoplite_gpu.memory import to_host

        result = coll.allreduce(device_array(memory, arr), group, args[4]) if cmd == "allreduce" else None
        return array_type(result), to_host(result).view(np.ndarray)
    if cmd == "allreduce":
        return coll.allreduce(arr, group, args[4])
    if cmd == "reduce_to":
        return coll.reduce(arr, args[4], group, args[5])
    if cmd == "broadcast":
        return coll.broadcast(arr, args[4], group)
    if cmd == "allgather":
        out = [np.empty_like(arr) for _ in range(group.world_size)]
        for a in out[:1] if frozen else []:
            a.flags.writeable = False
        return coll.allgather(out, arr, group)
    if cmd == "gather":
        out = [np.empty_like(arr) for _ in range(group.world_size)] if group.rank == args[4] else None
        return coll.gather(out, arr, args[4], group)
    pieces = [make_array(dtype, shape, seed + group.rank * 100 + dst) for dst in range(group.world_size)]
    if cmd == "scatter":  # the root's pieces for every rank
        return coll.scatter(np.empty_like(arr), pieces if group.rank == args[4] else None, args[4], group)
    outs = [np.empty_like(arr) for _ in pieces]
    for a in outs[:1] if frozen else []:
        a.flags.writeable = False
    if cmd == "alltoall":
        return coll.alltoall(outs, pieces, group)
    return coll.reducescatter(outs[0], pieces, group, args[4])


class Worker:
    """A spawned process with its own node, driven by commands."""

    def __init__(self, address: str, token: str, **overrides: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(address, token, overrides, child), daemon=True)
        self.proc.start()
        self.node_id = ""

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until the worker's node has joined."""
        self.node_id = self._recv(timeout)

    def send(self, cmd: str, *args: Any) -> None:
        """Start a command without waiting for its result."""
        self.conn.send((cmd, args))

    def result(self, timeout: float = CMD_TIMEOUT) -> Any:
        """Result of the command started last (re-raises its error as RuntimeError)."""
        return self._recv(timeout)

    def call(self, cmd: str, *args: Any, timeout: float = CMD_TIMEOUT) -> Any:
        """Run a command and return its result."""
        self.send(cmd, *args)
        return self.result(timeout)

    def _recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker {self.proc.pid} did not answer within {timeout} s")
        status, value = self.conn.recv()
        if status == "error":
            name, text, tb = value
            raise RuntimeError(f"{name}: {text}\n{tb}")
        return value

    def kill(self) -> None:
        """SIGKILL the worker (also one that is stopped) and reap it."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        """Ask the worker to exit; kill it if it does not."""
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def start_workers(address: str, token: str, n: int, **overrides: Any) -> list[Worker]:
    """Start ``n`` workers and wait until all joined."""
    workers = [Worker(address, token, **overrides) for _ in range(n)]
    for w in workers:
        w.wait_ready()
    return workers


def start_device_workers(address: str, token: str, n: int, backend: str, **overrides: Any) -> list[Worker]:
    """:func:`start_workers` whose processes already work with ``backend``'s device memory (a
    process that never touched a GPU receives device objects into host memory, without CUDA IPC,
    until it has: :meth:`hoplite_gpu.memory.backend.DeviceBackend.in_use`)."""
    workers = start_workers(address, token, n, **overrides)
    for w in workers:
        if not w.call("use_device", backend):
            raise RuntimeError(f"worker {w.proc.pid} has no usable {backend} device")
    return workers


def wait_for_events(node: Any, predicate: Any, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Poll the directory event log until ``predicate(events)`` holds (deadline, not a sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        events = node.event_log()
        if predicate(events):
            return events
        if time.monotonic() > deadline:
            raise TimeoutError(f"directory events never satisfied the condition: {events[-10:]}")
        time.sleep(0.02)


@contextlib.contextmanager
def owner_and_workers_group(
    n: int, name: str, settings: dict[str, Any], watch: bool = False, timeout: float = 60.0
) -> Iterator[tuple[Any, Any, list[Worker]]]:
    """An owner node in this process (an embedded directory) and ``n - 1`` workers, all with
    ``settings``, in one group (the owner rank 0); the workers are killed and the owner closed
    after the block. Yields (owner, its group, workers)."""
    import hoplite_gpu as hg

    owner = hg.init(**settings)
    workers = start_workers(owner.directory_address, owner.token, n - 1, **settings)
    try:
        for rank, w in enumerate(workers, start=1):
            w.send("group", name, rank, n, timeout, watch)
        assert [w.result() for w in workers] == list(range(1, n))
        yield owner, hg.collective.Group(owner, 0, n, name, timeout=timeout, watch=watch), workers
    finally:
        for w in workers:
            w.kill()
        owner.close()
