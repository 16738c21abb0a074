"""hoplite_gpu for PyTorch: the torch.distributed backend ``"hoplite"``, and gradient averaging in
the style of Horovod.

Importing this package registers the backend, so ``torch.distributed`` code, DDP, FSDP and Ray
Train switch to hoplite_gpu by name::

    import hoplite_gpu.torch  # registers "hoplite"
    dist.init_process_group("hoplite", init_method="env://", rank=rank, world_size=world_size)
    model = torch.nn.parallel.DistributedDataParallel(model)

The store torch's rendezvous makes is the hoplite rendezvous too: rank 0 starts a directory (or
uses ``HOPLITE_DIRECTORY``) and publishes it there (:mod:`.rendezvous`). Every group watches its
members: one that dies makes the others' pending and later work fail at once with
:class:`~hoplite_gpu.torch.errors.RankLostError`, a ``torch.distributed.DistBackendError`` naming
it (:mod:`.backend`). docs/torch.md has the details.

The Horovod-style helpers (:mod:`.optimizer`) take a :class:`hoplite_gpu.collective.Group` or a
``ray.util.collective`` group instead. torch is an optional dependency
(``pip install hoplite_gpu[torch]``).
"""

from __future__ import annotations

from .backend import BACKEND, ProcessGroupHoplite, register
from .errors import BackendTimeoutError, HopliteBackendError, RankLostError
from .optimizer import (
    DEFAULT_BUCKET_BYTES,
    DistributedOptimizer,
    allreduce_gradients,
    allreduce_tensors,
    broadcast_parameters,
    resolve_group,
)
from .work import HopliteWork

__all__ = [
    "BACKEND",
    "DEFAULT_BUCKET_BYTES",
    "BackendTimeoutError",
    "DistributedOptimizer",
    "HopliteBackendError",
    "HopliteWork",
    "ProcessGroupHoplite",
    "RankLostError",
    "allreduce_gradients",
    "allreduce_tensors",
    "broadcast_parameters",
    "register",
    "resolve_group",
]

register()
