"""Scenarios of elastic training (:mod:`hoplite_gpu.torch.elastic`), one process per rank, run by
:func:`tests.torch_ranks.run_ranks` (registered in its ``SCENARIOS``).

``arg`` is a JSON object: ``steps``; ``kill``: ``{rank: [step, seconds]}`` (that rank SIGKILLs
itself that many seconds after that step began), ``stop``: the same with SIGSTOP; ``data``: the
global rank whose data each rank trains on (default its own: a reference run on fewer ranks is
fed the survivors' data); ``elastic``: false for the plain backend.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import threading
import time
from typing import Any

import numpy as np


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    # About 4 MiB of float32 gradients in several buckets: an allreduce long enough to die in.
    nn = torch.nn
    return nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 768), nn.Tanh(), nn.Linear(768, 8))


def _batch(step: int, source: int) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(1000 * step + source)
    x = torch.randn(32, 256, generator=gen)
    return x, torch.sin(x[:, :8] * 2.0)


def _eval_loss(net: Any) -> float:
    import torch

    gen = torch.Generator().manual_seed(99)
    x = torch.randn(256, 256, generator=gen)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(net(x), torch.sin(x[:, :8] * 2.0)))


def _digest(net: Any) -> str:
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _signal_later(plan: dict[str, Any], key: str, rank: int, step: int, sig: int) -> None:
    """Send ``sig`` to this process when ``plan[key]`` says so for (``rank``, ``step``); a
    third number: seconds after which another process sends SIGCONT (the stall's length)."""
    when = plan.get(key, {}).get(str(rank))
    if when is None or int(when[0]) != step:
        return
    if len(when) > 2:
        resume = float(when[1]) + float(when[2])
        subprocess.Popen(["sh", "-c", f"sleep {resume}; kill -CONT {os.getpid()}"])
    threading.Timer(float(when[1]), os.kill, (os.getpid(), sig)).start()


def elastic(rank: int, world: int, arg: str) -> dict[str, Any]:
    """Train with DDP in elastic mode (or plain) while the plan kills or stops ranks: each
    survivor's final parameters' digest, evaluation loss and step reports. With ``joiner`` (a
    process index, started with ``TEST_PG_ALONE=1``), that process joins once the others have
    finished step ``join_after`` (rank 0 says so with an object)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hoplite_gpu.object_id import ObjectID
    from hoplite_gpu.torch import Elastic
    from hoplite_gpu.torch.rendezvous import PROCESS

    plan = json.loads(arg)
    source = int(plan.get("data", list(range(world)))[rank])
    model = DDP(_model(), broadcast_buffers=False, bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    name = plan.get("name", "elastic-test")
    marker = ObjectID.from_name(f"test/{name}/joiner-may-come")
    trainer = None
    patience = float(plan.get("join_timeout", 60))
    if rank == plan.get("joiner"):
        PROCESS.node.get(marker, timeout=60)
        if "kill_join" in plan:  # dies that many seconds into its join
            threading.Timer(float(plan["kill_join"]), os.kill, (os.getpid(), signal.SIGKILL)).start()
        trainer = Elastic(model, optimizer=opt, name=name, join=True, join_timeout=patience)
    elif plan.get("elastic", True):
        trainer = Elastic(model, optimizer=opt, name=name, join_timeout=patience)
    reports: list[dict[str, Any]] = []
    begun = time.monotonic()
    for step in range(trainer.steps if trainer is not None else 0, int(plan["steps"])):
        _signal_later(plan, "kill", rank, step, signal.SIGKILL)
        _signal_later(plan, "stop", rank, step, signal.SIGSTOP)
        if plan.get("kill_serving", {}).get(str(rank)) == step:  # dies mid-allreduce, serving
            from hoplite_gpu import faults

            faults.arm("serve:*:0.5:KILL")
        if rank == 0 and step == plan.get("join_after", -1) + 1:
            PROCESS.node.put(np.zeros(1, np.uint8), marker)
        x, y = _batch(step, source)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if trainer is not None and trainer.last_step is not None:
            r = trainer.last_step
            reports.append(
                {
                    "step": r.step,
                    "contributors": list(r.contributors),
                    "members": list(r.members),
                    "lost": sorted(r.lost),
                    "joined": list(r.joined),
                    "rounds": r.rounds,
                }
            )
    return {
        "digest": _digest(model.module),
        "loss": _eval_loss(model.module),
        "reports": reports,
        "seconds": time.monotonic() - begun,
        "rank": trainer.rank if trainer is not None else rank,
    }


def refusals(rank: int, world: int, arg: str) -> dict[str, str]:
    """Elastic mode refuses what it cannot serve, each with InvalidArgumentError: the name of
    each case's error and the argument it names."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hoplite_gpu.errors import InvalidArgumentError
    from hoplite_gpu.torch import Elastic

    class WithBuffer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)
            self.register_buffer("seen", torch.zeros(1))

        def forward(self, x: Any) -> Any:
            return self.fc(x)

    gloo = dist.new_group(backend="gloo")
    cases = {
        "buffers broadcast": lambda: Elastic(DDP(WithBuffer())),
        "unused parameters": lambda: Elastic(DDP(torch.nn.Linear(2, 2), find_unused_parameters=True)),
        "not DDP": lambda: Elastic(torch.nn.Linear(2, 2)),
        "gloo group": lambda: Elastic(group=gloo),
        "joiner without a name": lambda: Elastic(DDP(torch.nn.Linear(2, 2)), join=True),
        "max_rounds 0": lambda: Elastic(max_rounds=0),
        "join_timeout 0": lambda: Elastic(join_timeout=0),
    }
    found = {}
    for what, make in cases.items():
        try:
            make()
            found[what] = "accepted"
        except InvalidArgumentError as exc:
            found[what] = str(exc.fields.get("argument"))
    fine = Elastic(DDP(WithBuffer(), forward_sync_buffers=False))  # buffers kept apart: accepted
    found["forward_sync_buffers=False"] = fine.name
    fine.close()
    return found


def alone(steps: int, sources: list[int]) -> float:
    """The evaluation loss after one process trains on the batches of ``sources`` together:
    what ranks fed those sources reach with gradients averaged among them (their batches have
    one size, so the mean of their losses' gradients is the gradient of the joined batch's)."""
    import torch

    net = _model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        batches = [_batch(step, source) for source in sources]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _eval_loss(net)


ELASTIC = {"elastic": elastic, "elastic_refusals": refusals}
