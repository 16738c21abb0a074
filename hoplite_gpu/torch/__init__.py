"""hoplite_gpu for PyTorch: the torch.distributed backend ``"hoplite"``, and gradient averaging in
the style of Horovod.

torch registers the backend as it is imported, wherever hoplite_gpu is installed (:mod:`.plugin`),
and so does importing this package; ``torch.distributed`` code, DDP, FSDP and Ray Train switch to
hoplite_gpu by name::

    dist.init_process_group("hoplite", init_method="env://", rank=rank, world_size=world_size)
    model = torch.nn.parallel.DistributedDataParallel(model)

The store torch's rendezvous makes is the hoplite rendezvous too: rank 0 starts a directory (or
uses ``HOPLITE_DIRECTORY``) and publishes it there (:mod:`.rendezvous`). Every group watches its
members: one that dies makes the others' pending and later work fail at once with
:class:`~hoplite_gpu.torch.errors.RankLostError`, a ``torch.distributed.DistBackendError`` naming
it (:mod:`.backend`). docs/torch.md has the details.

Elastic mode (:mod:`.elastic`): a DDP step that survives a dead rank, the survivors going on
without a new process group.

The Horovod-style helpers (:mod:`.optimizer`) take a :class:`hoplite_gpu.collective.Group` or a
``ray.util.collective`` group instead. torch is an optional dependency
(``pip install hoplite_gpu[torch]``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .names import BACKEND
from .plugin import register

if TYPE_CHECKING:
    from .backend import ProcessGroupHoplite
    from .elastic import Elastic, StepReport, comm_hook
    from .errors import BackendTimeoutError, ElasticRemovedError, HopliteBackendError, RankLostError
    from .optimizer import (
        DEFAULT_BUCKET_BYTES,
        DistributedOptimizer,
        allreduce_gradients,
        allreduce_tensors,
        broadcast_parameters,
        resolve_group,
    )
    from .work import HopliteWork

#: Where each public name lives (imported on first use: the backend's modules load with its
#: first group, not with ``import torch``, which registers it through :mod:`.plugin`).
_LAZY = {
    "ProcessGroupHoplite": "backend",
    "Elastic": "elastic",
    "StepReport": "elastic",
    "comm_hook": "elastic",
    "BackendTimeoutError": "errors",
    "ElasticRemovedError": "errors",
    "HopliteBackendError": "errors",
    "RankLostError": "errors",
    "DEFAULT_BUCKET_BYTES": "optimizer",
    "DistributedOptimizer": "optimizer",
    "allreduce_gradients": "optimizer",
    "allreduce_tensors": "optimizer",
    "broadcast_parameters": "optimizer",
    "resolve_group": "optimizer",
    "HopliteWork": "work",
}

__all__ = [
    "BACKEND",
    "DEFAULT_BUCKET_BYTES",
    "BackendTimeoutError",
    "DistributedOptimizer",
    "Elastic",
    "ElasticRemovedError",
    "HopliteBackendError",
    "HopliteWork",
    "ProcessGroupHoplite",
    "RankLostError",
    "StepReport",
    "allreduce_gradients",
    "allreduce_tensors",
    "broadcast_parameters",
    "comm_hook",
    "register",
    "resolve_group",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


register()
