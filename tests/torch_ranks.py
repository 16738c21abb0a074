"""Scenarios of the torch.distributed backend's tests, one process per rank:

    python -m tests.torch_ranks SCENARIO RANK WORLD PORT OUT [ARG]

Each process joins ``init_process_group("hoplite", init_method="tcp://127.0.0.1:PORT")``, runs the
scenario and writes what it found to ``OUT.RANK.json`` (``{"result": ...}`` or ``{"error": ...}``);
:func:`run_ranks` starts the processes and collects those files. Comparisons with Gloo run in the
same processes, on a Gloo group of the same ranks (``new_group(backend="gloo")``) and the same
inputs.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.elastic_ranks import ELASTIC

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------- the test side
def run_ranks(
    scenario: str,
    world: int,
    tmp: Path,
    timeout: float = 120.0,
    arg: str = "",
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
) -> dict[int, dict[str, Any]]:
    """Run ``scenario`` in ``world`` processes; each rank's file (``{}`` for a rank that wrote
    none: it died). Processes still running at ``timeout`` are killed, and that is an error."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / f"{scenario}-{arg}" if arg else tmp / scenario
    procs = []
    try:
        for rank in range(world):
            path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
            penv = {**os.environ, "PYTHONPATH": path, **(env or {}), **(rank_env or {}).get(rank, {})}
            cmd = [
                sys.executable,
                "-m",
                "tests.torch_ranks",
                scenario,
                str(rank),
                str(world),
                str(port),
                str(out),
                arg,
            ]
            log = open(f"{out}.{rank}.log", "w")
            procs.append(
                (subprocess.Popen(cmd, env=penv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log)
            )
        deadline = time.monotonic() + timeout
        for proc, _ in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logs = "\n".join(Path(f"{out}.{r}.log").read_text()[-3000:] for r in range(world))
                raise AssertionError(f"{scenario}: ranks still running after {timeout} s\n{logs}") from None
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.close()
    results: dict[int, dict[str, Any]] = {}
    for rank in range(world):
        path = Path(f"{out}.{rank}.json")
        results[rank] = json.loads(path.read_text()) if path.exists() else {}
        results[rank]["log"] = Path(f"{out}.{rank}.log").read_text()[-4000:]
    return results


# ---------------------------------------------------------------------------- the rank side
def main() -> None:
    scenario, rank, world, port, out, arg = sys.argv[1:7]
    rank_i, world_i = int(rank), int(world)
    import torch.distributed as dist

    import hoplite_gpu.torch  # noqa: F401  (registers the backend)

    seconds = float(os.environ.get("TEST_PG_TIMEOUT", "60"))
    # A process outside the others' group (an elastic joiner) makes a group of its own.
    alone = os.environ.get("TEST_PG_ALONE") == "1"
    dist.init_process_group(
        "hoplite",
        init_method=f"tcp://127.0.0.1:{_free_port() if alone else port}",
        rank=0 if alone else rank_i,
        world_size=1 if alone else int(os.environ.get("TEST_PG_WORLD", world)),
        timeout=datetime.timedelta(seconds=seconds),
    )
    path = Path(f"{out}.{rank}.json")
    try:
        result = SCENARIOS[scenario](rank_i, world_i, arg)
        path.write_text(json.dumps({"result": result}))
    except BaseException as exc:
        path.write_text(json.dumps(_error(exc)))
        raise
    finally:
        if os.environ.get("TEST_DESTROY", "1") == "1" and dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _error(exc: BaseException) -> dict[str, Any]:
    import torch.distributed as dist

    return {
        "error": type(exc).__name__,
        "message": str(exc)[:2000],
        "dist_backend_error": isinstance(exc, dist.DistBackendError),
        "fields": {k: v for k, v in getattr(exc, "fields", {}).items() if isinstance(v, int | str | list)},
        "traceback": traceback.format_exc()[-3000:],
        "at": time.monotonic(),  # when it came (the system's monotonic clock, as the fault log's)
    }


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return bool(
            torch.allclose(
                a.double() if not a.is_complex() else a,
                b.double() if not b.is_complex() else b,
                rtol=1e-3,
                atol=1e-3,
                equal_nan=True,
            )
        )
    return bool(torch.equal(a, b))


def _inputs(dtype: Any, rank: int, n: int = 12, shape: tuple[int, ...] | None = None) -> Any:
    """Small integer-valued inputs, distinct per rank (exact in every dtype)."""
    import torch

    base = (torch.arange(n) * 7 + rank * 3) % 5 + 1
    if dtype == torch.bool:
        t = (base + rank) % 2 == 0
    elif dtype.is_complex:
        t = torch.complex(base.float(), (base * 2 - rank).float()).to(dtype)
    else:
        t = base.to(dtype)
    return t.reshape(shape) if shape else t


def collectives(rank: int, world: int, arg: str) -> dict[str, Any]:
    """Every collective on the hoplite world group and on a Gloo group of the same ranks, the same
    inputs: the names of those whose results differ (expected: none), and how many ran."""
    import torch
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    R = dist.ReduceOp
    bad: list[str] = []
    skipped: list[str] = []
    ran = 0

    def compare(name: str, run: Callable[[Any], Any]) -> None:
        nonlocal ran
        ran += 1
        try:
            ours = run(None)
        except Exception as exc:  # a failure is a difference too
            bad.append(f"{name}: {type(exc).__name__}: {exc}")
            return
        try:
            theirs = run(gloo)
        except RuntimeError as exc:  # what this torch's Gloo lacks (all_to_all before 2.12...)
            if "does not support" in str(exc) or "Invalid scalar type" in str(exc):
                skipped.append(name)
                return
            raise
        if not _same(ours, theirs):
            bad.append(f"{name}: {ours} != {theirs}")

    floats = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    ints = [torch.int32, torch.int64, torch.uint8, torch.int8]
    for dtype in [*floats, *ints, torch.bool, torch.complex64]:
        d = str(dtype).removeprefix("torch.")
        ops = [R.SUM] if dtype.is_complex else [R.SUM, R.PRODUCT, R.MIN, R.MAX]
        ops += [R.AVG] if dtype in floats or dtype.is_complex else []
        ops += [R.BAND, R.BOR, R.BXOR] if dtype in ints or dtype == torch.bool else []
        for op in ops:

            def allreduce(g: Any, op: Any = op, dtype: Any = dtype) -> Any:
                t = _inputs(dtype, rank)
                dist.all_reduce(t, op=op, group=g)
                return t

            def reduce(g: Any, op: Any = op, dtype: Any = dtype) -> Any:
                t = _inputs(dtype, rank)
                dist.reduce(t, dst=world - 1, op=op, group=g)
                return t if rank == world - 1 else _inputs(dtype, rank)

            def reduce_scatter(g: Any, op: Any = op, dtype: Any = dtype) -> Any:
                out = torch.zeros(4, dtype=dtype)
                dist.reduce_scatter(
                    out, [_inputs(dtype, rank + 10 * j, 4) for j in range(world)], op=op, group=g
                )
                return out

            def reduce_scatter_tensor(g: Any, op: Any = op, dtype: Any = dtype) -> Any:
                out = torch.zeros(3, dtype=dtype)
                dist.reduce_scatter_tensor(out, _inputs(dtype, rank, 3 * world), op=op, group=g)
                return out

            compare(f"all_reduce {d} {op}", allreduce)
            compare(f"reduce {d} {op}", reduce)
            if not (dtype == torch.bool and op in (R.PRODUCT, R.MIN)):  # (gloo's bool scatter differs)
                compare(f"reduce_scatter {d} {op}", reduce_scatter)
                compare(f"reduce_scatter_tensor {d} {op}", reduce_scatter_tensor)

        def broadcast(g: Any, dtype: Any = dtype) -> Any:
            t = _inputs(dtype, rank, shape=(3, 4))
            dist.broadcast(t, src=world - 1, group=g)
            return t

        def all_gather(g: Any, dtype: Any = dtype) -> Any:
            outs = [torch.zeros(2, 3, dtype=dtype) for _ in range(world)]
            dist.all_gather(outs, _inputs(dtype, rank, 6, (2, 3)), group=g)
            return outs

        def all_gather_into_tensor(g: Any, dtype: Any = dtype) -> Any:
            out = torch.zeros(world * 2, 3, dtype=dtype)
            dist.all_gather_into_tensor(out, _inputs(dtype, rank, 6, (2, 3)), group=g)
            return out

        def gather(g: Any, dtype: Any = dtype) -> Any:
            outs = [torch.zeros(5, dtype=dtype) for _ in range(world)] if rank == 0 else None
            dist.gather(_inputs(dtype, rank, 5), outs, dst=0, group=g)
            return outs if outs is not None else []

        def scatter(g: Any, dtype: Any = dtype) -> Any:
            out = torch.zeros(5, dtype=dtype)
            pieces = [_inputs(dtype, 10 * j, 5) for j in range(world)] if rank == 0 else None
            dist.scatter(out, pieces, src=0, group=g)
            return out

        def all_to_all(g: Any, dtype: Any = dtype) -> Any:
            outs = [torch.zeros(4, dtype=dtype) for _ in range(world)]
            dist.all_to_all(outs, [_inputs(dtype, rank * 10 + j, 4) for j in range(world)], group=g)
            return outs

        def all_to_all_single(g: Any, dtype: Any = dtype) -> Any:
            out = torch.zeros(world * 2, 3, dtype=dtype)
            dist.all_to_all_single(out, _inputs(dtype, rank, world * 6, (world * 2, 3)), group=g)
            return out

        def all_to_all_uneven(g: Any, dtype: Any = dtype) -> Any:
            # rank r sends j + 1 rows to rank j, and so receives r + 1 rows from each
            sends, gets = [j + 1 for j in range(world)], [rank + 1] * world
            out = torch.zeros(sum(gets), 2, dtype=dtype)
            dist.all_to_all_single(
                out, _inputs(dtype, rank, 2 * sum(sends), (sum(sends), 2)), gets, sends, group=g
            )
            return out

        for fn in (
            broadcast,
            all_gather,
            all_gather_into_tensor,
            gather,
            scatter,
            all_to_all,
            all_to_all_single,
            all_to_all_uneven,
        ):
            if not (fn is gather and dtype.is_complex):  # (gloo's gather takes no complex)
                compare(f"{fn.__name__} {d}", fn)

    def coalesced(g: Any) -> Any:
        ts = [
            _inputs(torch.float32, rank, 5),
            _inputs(torch.float32, rank + 1, 3),
            _inputs(torch.float32, rank, 2),
        ]
        dist.all_reduce_coalesced(ts, group=g)
        return ts

    def coalesced_into_tensors(g: Any) -> Any:
        gathered = [torch.zeros(world * 3) for _ in range(2)]
        scattered = [torch.zeros(2) for _ in range(2)]
        with dist._coalescing_manager(group=g or dist.group.WORLD, async_ops=True) as cm:
            for i, out in enumerate(gathered):
                dist.all_gather_into_tensor(out, _inputs(torch.float32, rank + i, 3), group=g)
        cm.wait()
        with dist._coalescing_manager(group=g or dist.group.WORLD, async_ops=True) as cm:
            for i, out in enumerate(scattered):
                dist.reduce_scatter_tensor(out, _inputs(torch.float32, rank + i, 2 * world), group=g)
        cm.wait()
        return [*gathered, *scattered]

    def asynchronous(g: Any) -> Any:
        ts = [_inputs(torch.float32, rank + i, 1000) for i in range(4)]
        works = [dist.all_reduce(t, group=g, async_op=True) for t in ts]
        values = [w.get_future().wait()[0] for w in works]
        assert all(w.wait() and w.is_completed() and w.is_success() for w in works)
        return [*ts, *values]

    def objects(g: Any) -> Any:
        got: list[Any] = [None] * world
        dist.all_gather_object(got, {"rank": rank, "text": "x" * rank}, group=g)
        listed = [{"from": rank}] if rank == 0 else [None]
        dist.broadcast_object_list(listed, src=0, group=g)
        return [torch.tensor([o["rank"] for o in got]), torch.tensor([listed[0]["from"]])]

    def point_to_point(g: Any) -> Any:
        if world == 1:
            return torch.zeros(1)
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        a, b = torch.zeros(6), torch.zeros(6)
        reqs = [
            dist.irecv(a, src=prv, group=g, tag=1),
            dist.irecv(b, src=prv, group=g, tag=2),
            dist.isend(_inputs(torch.float32, rank + 2, 6), dst=nxt, group=g, tag=2),
            dist.isend(_inputs(torch.float32, rank + 1, 6), dst=nxt, group=g, tag=1),
        ]
        for req in reqs:
            req.wait()
        c = torch.zeros(3, dtype=torch.int64)
        if rank == 0:
            dist.send(_inputs(torch.int64, 9, 3), dst=world - 1, group=g)
        elif rank == world - 1:
            dist.recv(c, src=0, group=g)
        ops = [
            dist.P2POp(dist.isend, _inputs(torch.float32, rank, 4), nxt, g),
            dist.P2POp(dist.irecv, d := torch.zeros(4), prv, g),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        # From any source: rank 0 takes one message from every other rank, in whatever order.
        got = {}
        if rank == 0:
            for _ in range(world - 1):
                buf = torch.zeros(2)
                got[dist.recv(buf, group=g, tag=3)] = buf
        else:
            dist.send(_inputs(torch.float32, rank + 5, 2), dst=0, group=g, tag=3)
        anywhere = [got[src] for src in sorted(got)] + [torch.tensor(sorted(got))]
        return [a, b, c, d, *anywhere]

    for fn in (coalesced, coalesced_into_tensors, asynchronous, objects, point_to_point):
        compare(fn.__name__, fn)
    dist.barrier()
    dist.barrier(group=gloo)
    if world >= 3:  # a subgroup of this backend: ranks 0 and 2
        sub = dist.new_group([0, 2], backend="hoplite")
        subgloo = dist.new_group([0, 2], backend="gloo")
        if rank in (0, 2):

            def sub_allreduce(g: Any) -> Any:
                t = _inputs(torch.float32, rank, 7)
                dist.all_reduce(t, group=g)
                dist.broadcast(t, src=2, group=g)
                return t

            compare("subgroup", lambda g: sub_allreduce(subgloo if g is gloo else sub))
    return {"bad": bad, "ran": ran, "skipped": skipped}


def ddp(rank: int, world: int, arg: str) -> dict[str, Any]:
    """Train the same model on the same data with DDP over hoplite and over a Gloo group, in each
    mode (plain, gradient views, unused parameters, a comm hook, no_sync): the largest difference
    of their parameters, per mode."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    gloo = dist.new_group(backend="gloo")

    class Net(torch.nn.Module):
        def __init__(self, unused: bool) -> None:
            super().__init__()
            self.conv = torch.nn.Conv1d(2, 4, 3)
            self.fc = torch.nn.Linear(48, 3)
            if unused:  # parameters that get no gradient
                self.unused = torch.nn.Linear(3, 3)

        def forward(self, x: Any) -> Any:
            return self.fc(torch.relu(self.conv(x)).flatten(1))

    def train(group: Any, mode: str) -> list[Any]:
        torch.manual_seed(0)
        net = Net(mode == "unused")
        if rank != 0:  # DDP starts every rank from rank 0's parameters
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(rank)
        kwargs: dict[str, Any] = {"process_group": group, "bucket_cap_mb": 0.001}
        if mode == "views":
            kwargs["gradient_as_bucket_view"] = True
        if mode == "unused":
            kwargs["find_unused_parameters"] = True
        model = DDP(net, **kwargs)
        if mode == "hook":
            model.register_comm_hook(group, default_hooks.allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.125)
        gen = torch.Generator().manual_seed(100 + rank)
        for step in range(4):
            x = torch.randint(-3, 4, (5, 2, 14), generator=gen).float()
            y = torch.randint(-3, 4, (5, 3), generator=gen).float()
            if mode == "no_sync" and step % 2 == 0:
                with model.no_sync():
                    torch.nn.functional.mse_loss(model(x), y).backward()
                continue
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.module.parameters()]

    diffs = {}
    for mode in ("plain", "views", "unused", "hook", "no_sync"):
        ours, theirs = train(None, mode), train(gloo, mode)
        diffs[mode] = max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))
    return diffs


def fsdp(rank: int, world: int, arg: str) -> dict[str, Any]:
    """FSDP2 (``fully_shard``) on the hoplite world against a mesh of a Gloo group: the largest
    difference of the full parameters after a few steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    gloo = dist.new_group(backend="gloo")

    def train(mesh: Any) -> list[Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.125)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            x = torch.randint(-3, 4, (6, 16), generator=gen).float()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    ours = train(DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    theirs = train(DeviceMesh.from_group(gloo, "cpu"))
    return {"diff": max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))}


def killed(rank: int, world: int, arg: str) -> dict[str, Any]:
    """Every rank allreduces 16 MiB again and again; the rank named in ``arg`` is SIGKILLed by
    its own fault injection half way through serving a shard. The others: what failed, how long
    after their step began, and whether a later collective fails at once."""
    import torch
    import torch.distributed as dist

    victim = int(arg)
    t = torch.ones(4 << 20)
    for step in range(50):
        begun = time.monotonic()
        try:
            dist.all_reduce(t)
        except Exception as exc:
            took = time.monotonic() - begun
            later = time.monotonic()
            try:
                dist.all_reduce(torch.ones(4))
                again = None
            except Exception as exc2:
                again = {"error": type(exc2).__name__, "seconds": time.monotonic() - later}
            from hoplite_gpu.torch.rendezvous import PROCESS

            joined = {"directory": PROCESS.node.directory_address, "host_rank": PROCESS.host_rank}
            return {**_error(exc), "step": step, "seconds": took, "later": again, "victim": victim, **joined}
    raise AssertionError("nothing failed")


def soak(rank: int, world: int, arg: str) -> str:
    """One collective of the fault soak (``tests/soak.py``, operation ``torch``); ``arg`` is
    ``OP:SEED``: the digest of this rank's output (an error is written by :func:`main`)."""
    import torch
    import torch.distributed as dist

    from tests.procs import digest, make_array

    op, seed_text = arg.split(":")
    seed, n = int(seed_text), SOAK_ELEMENTS
    x = torch.from_numpy(make_array("float32", (n,), seed + rank))
    if op == "all_reduce":
        dist.all_reduce(x)
        out = x
    elif op == "broadcast":
        dist.broadcast(x, src=0)
        out = x
    elif op == "all_gather":
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        out = torch.cat(parts)
    else:  # reduce_scatter: rank r's piece j is seed + r * 100 + j
        pieces = [torch.from_numpy(make_array("float32", (n,), seed + rank * 100 + j)) for j in range(world)]
        out = torch.empty(n)
        dist.reduce_scatter(out, pieces)
    return digest(out.numpy())


#: Elements of each rank's tensor in :func:`soak` (4 MiB of float32: sharded, many chunks).
SOAK_ELEMENTS = 1 << 20


def timeout(rank: int, world: int, arg: str) -> dict[str, Any]:
    """Rank 1 never joins the allreduce: ``Work.wait(0.5 s)`` raises and the work goes on; the
    group's timeout (TEST_PG_TIMEOUT) then fails the allreduce on rank 0, and rank 1 hears of it."""
    import torch
    import torch.distributed as dist

    if rank == 1:
        begun = time.monotonic()
        try:
            dist.barrier()  # answered by rank 0's abort, never by rank 0 itself
        except Exception as exc:
            return {**_error(exc), "seconds": time.monotonic() - begun}
        raise AssertionError("the barrier passed")
    work = dist.all_reduce(torch.ones(3), async_op=True)
    begun = time.monotonic()
    try:
        work.wait(datetime.timedelta(seconds=0.5))
        early = None
    except Exception as exc:
        early = {**_error(exc), "seconds": time.monotonic() - begun, "completed": work.is_completed()}
    try:
        work.wait()
    except Exception as exc:
        return {"early": early, **_error(exc), "seconds": time.monotonic() - begun}
    raise AssertionError("the allreduce passed")


def bad_input(rank: int, world: int, arg: str) -> dict[str, Any]:
    """Refusals on the calling rank (a non-contiguous tensor, an unsupported op or dtype, a root
    outside the world, a send to itself), then tensors of other sizes on different ranks; the
    group breaks on every rank with a typed error."""
    import torch
    import torch.distributed as dist

    found: dict[str, Any] = {}

    def attempt(name: str, call: Callable[[], Any]) -> None:
        begun = time.monotonic()
        try:
            call()
            found[name] = None
        except Exception as exc:
            found[name] = {**_error(exc), "seconds": time.monotonic() - begun}

    if arg == "refused":  # then, on a new group of the same ranks, tensors of other sizes
        if rank == 1:
            attempt("noncontiguous", lambda: dist.all_reduce(torch.ones(4, 4).t()))
        else:
            attempt("noncontiguous", lambda: dist.all_reduce(torch.ones(4, 4)))
        attempt("later", lambda: dist.all_reduce(torch.ones(4)))
        again = dist.new_group(backend="hoplite")
        attempt("sizes", lambda: dist.all_reduce(torch.ones(1000 + 10 * rank), group=again))
        attempt("sizes_later", lambda: dist.broadcast(torch.ones(4), 0, group=again))
        return found
    # "local": each refused everywhere (every rank makes the same mistake), one group each time
    from hoplite_gpu.torch.backend import create

    class Options:
        store = None
        group_rank, group_size, timeout, group_id, global_ranks_in_group = 0, 1, None, "x", []

    attempt("no_store", lambda: create(Options()))
    attempt("float8", lambda: dist.all_reduce(torch.ones(4, dtype=torch.float8_e4m3fn)))
    for name, call in [
        ("premul_sum", lambda: dist.all_reduce(torch.ones(4), op=dist._make_nccl_premul_sum(2.0))),
        ("band_float", lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND)),
        ("root_outside", lambda: dist.broadcast(torch.ones(4), src=world + 3)),
        ("send_to_self", lambda: dist.send(torch.ones(4), dst=rank)),
    ]:
        attempt(name, call)
    return found


def cuda(rank: int, world: int, arg: str) -> dict[str, Any]:
    """CUDA tensors (every rank on device 0): collectives against values computed here, DDP on
    CUDA against DDP over Gloo on CPU, and the bytes the library staged through host memory."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hoplite_gpu.torch.rendezvous import PROCESS

    dev = torch.device("cuda", 0)
    bad: list[str] = []

    staged: dict[str, int] = {}

    def moved() -> int:
        stats = PROCESS.node.stats()
        return int(stats["staged_bytes_sent"] + stats["staged_bytes_received"])

    def check(name: str, got: Any, want: Any) -> None:
        if not torch.equal(got.cpu(), want.cpu()):
            bad.append(f"{name}: {got.flatten()[:4].tolist()} != {want.flatten()[:4].tolist()}")
        staged[name] = moved() - sum(staged.values())

    everyone = [_inputs(torch.float32, r, 1 << 18) for r in range(world)]  # 1 MiB each
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        mine = everyone[rank].to(dtype).to(dev)
        total = sum(e.to(dtype) for e in everyone)
        t = mine.clone()
        dist.all_reduce(t)
        check(f"all_reduce {dtype}", t, total)
        t = mine.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        check(f"all_reduce max {dtype}", t, torch.stack([e.to(dtype) for e in everyone]).amax(0))
        b = mine.clone()
        dist.broadcast(b, src=world - 1)
        check(f"broadcast {dtype}", b, everyone[-1].to(dtype))
        g = torch.empty(world * mine.numel(), dtype=dtype, device=dev)
        dist.all_gather_into_tensor(g, mine)
        check(f"all_gather_into_tensor {dtype}", g, torch.cat([e.to(dtype) for e in everyone]))
        rs = torch.empty(mine.numel() // world, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(rs, mine)
        check(f"reduce_scatter_tensor {dtype}", rs, total.reshape(world, -1)[rank])
        a2a = torch.empty_like(mine)
        dist.all_to_all_single(a2a, mine)
        want = torch.cat([e.to(dtype).reshape(world, -1)[rank] for e in everyone])
        check(f"all_to_all_single {dtype}", a2a, want)
    if world > 1:
        got = torch.empty(1000, device=dev)
        works = [
            dist.isend(everyone[rank][:1000].to(dev), (rank + 1) % world),
            dist.irecv(got, (rank - 1) % world),
        ]
        for w in works:
            w.wait()
        check("send/recv", got, everyone[(rank - 1) % world][:1000])

    gloo = dist.new_group(backend="gloo")

    def train(device: Any, group: Any) -> list[Any]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(
            device
        )
        model = DDP(net, process_group=group, device_ids=[0] if device.type == "cuda" else None)
        opt = torch.optim.SGD(model.parameters(), lr=0.125)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            x = torch.randint(-3, 4, (16, 64), generator=gen).float().to(device)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().cpu() for p in net.parameters()]

    before = moved()
    ours, theirs = train(dev, None), train(torch.device("cpu"), gloo)
    staged["ddp"] = moved() - before
    diff = max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))
    return {"bad": bad, "ddp_diff": diff, "staged": {k: v for k, v in staged.items() if v}}


def training(rank: int, world: int, arg: str) -> dict[str, Any]:
    """:func:`ddp`, then :func:`fsdp`, in the same processes."""
    return {"ddp": ddp(rank, world, arg), "fsdp": fsdp(rank, world, arg)}


SCENARIOS: dict[str, Callable[[int, int, str], Any]] = {
    "collectives": collectives,
    "ddp": ddp,
    "fsdp": fsdp,
    "training": training,
    "killed": killed,
    "soak": soak,
    "timeout": timeout,
    "bad_input": bad_input,
    "cuda": cuda,
}
SCENARIOS.update(ELASTIC)

if __name__ == "__main__":
    main()
