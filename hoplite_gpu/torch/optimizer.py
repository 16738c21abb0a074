"""Gradient averaging for torch training loops, in the style of Horovod, on hoplite_gpu collectives.

::

    import hoplite_gpu.torch as hgt

    optimizer = hgt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), group)
    hgt.broadcast_parameters(model, root_rank=0, group=group)   # same start everywhere
    for x, y in batches:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()                 # averages the gradients over the group, then steps

``group`` is a :class:`hoplite_gpu.collective.Group`, or the name of a ``ray.util.collective``
group created with ``backend="hoplite"`` in this process. Small gradients are fused: packed into
buckets of up to ``bucket_bytes`` (per device and dtype), each bucket allreduced as one array, so
a model of many small layers costs a few collectives, not one per tensor. Every member must call
these functions with the same tensors in the same order (the same model), and the same tensors
must have gradients everywhere. torch is an optional dependency (``pip install hoplite_gpu[torch]``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .. import collective
from ..errors import InvalidArgumentError
from ..reduce_ops import ReduceOp, as_op

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DistributedOptimizer",
    "allreduce_gradients",
    "allreduce_tensors",
    "broadcast_parameters",
    "resolve_group",
]

#: Default size of a fusion bucket (PyTorch DDP's default bucket is 25 MiB too).
DEFAULT_BUCKET_BYTES = 25 << 20


def resolve_group(group: Any) -> collective.Group:
    """The :class:`~hoplite_gpu.collective.Group` behind ``group`` (a Group, or the name of a
    ``ray.util.collective`` group of the hoplite backend initialised in this process)."""
    if isinstance(group, collective.Group):
        return group
    if isinstance(group, str):
        from ray.util.collective import collective as ray_collective

        handle = ray_collective.get_group_handle(group)
        inner = getattr(handle, "group", None)
        if isinstance(inner, collective.Group):
            return inner
        raise InvalidArgumentError(
            f"ray collective group {group!r} does not use the hoplite backend", argument="group"
        )
    raise InvalidArgumentError(
        f"group must be a hoplite_gpu.collective.Group or a ray collective group name, got "
        f"{type(group).__name__}",
        argument="group",
    )


def _tensors(model_or_tensors: Any) -> list[Any]:
    import torch

    if isinstance(model_or_tensors, torch.nn.Module):
        return list(model_or_tensors.parameters())
    if isinstance(model_or_tensors, torch.Tensor):
        return [model_or_tensors]
    if isinstance(model_or_tensors, Iterable):
        items = list(model_or_tensors)
        if all(isinstance(t, torch.Tensor) for t in items):
            return items
    raise InvalidArgumentError(
        "expected a torch.nn.Module, a tensor or an iterable of tensors", argument="model_or_tensors"
    )


def _buckets(tensors: list[Any], bucket_bytes: int) -> list[list[Any]]:
    """``tensors`` grouped by (device, dtype), in order, cut into runs of at most ``bucket_bytes``
    (a larger tensor is a bucket of its own)."""
    kinds: dict[tuple[str, Any], list[list[Any]]] = {}
    used: dict[tuple[str, Any], int] = {}  # bytes in each kind's last run
    for t in tensors:
        kind = (str(t.device), t.dtype)
        runs = kinds.setdefault(kind, [[]])
        size = t.numel() * t.element_size()
        if runs[-1] and used[kind] + size > bucket_bytes:
            runs.append([])
            used[kind] = 0
        runs[-1].append(t)
        used[kind] = used.get(kind, 0) + size
    return [run for runs in kinds.values() for run in runs]


def _fused(tensors: list[Any], bucket_bytes: int, run: Callable[[Any], Any]) -> None:
    """Call ``run`` on an array sharing memory with each bucket of ``tensors`` (a tensor alone in
    its bucket is used as it is; others are packed into one flat tensor and unpacked after)."""
    import torch

    from ..ray.common import as_buffer

    for bucket in _buckets(tensors, bucket_bytes):
        if len(bucket) == 1:
            buf, back = as_buffer(bucket[0].detach())
            run(buf)
            if back is not None:
                back()
            continue
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        buf, _ = as_buffer(flat)
        run(buf)
        start = 0
        with torch.no_grad():
            for t in bucket:
                n = t.numel()
                t.copy_(flat[start : start + n].view_as(t))
                start += n


def allreduce_tensors(
    tensors: Any,
    group: Any,
    op: ReduceOp | str = ReduceOp.AVG,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Allreduce ``tensors`` (a tensor or an iterable of tensors) in place over ``group``,
    fused into buckets of up to ``bucket_bytes``."""
    g = resolve_group(group)
    reduce_op = as_op(op)
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise InvalidArgumentError("bucket_bytes must be a positive int", argument="bucket_bytes")
    _fused(_tensors(tensors), bucket_bytes, lambda buf: collective.allreduce(buf, g, reduce_op))


def allreduce_gradients(
    model_or_tensors: Any,
    group: Any,
    op: ReduceOp | str = ReduceOp.AVG,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Average (or reduce with ``op``) the ``.grad`` of a model's parameters, or of the given
    tensors, over ``group``, in place. Tensors without a gradient are skipped: they must be the
    same on every member."""
    grads = [t.grad for t in _tensors(model_or_tensors) if t.grad is not None]
    if grads:
        allreduce_tensors(grads, group, op, bucket_bytes)


def broadcast_parameters(model_or_tensors: Any, root_rank: int, group: Any) -> None:
    """Copy ``root_rank``'s parameters (or tensors) into everyone's, in place (fused into buckets
    of :data:`DEFAULT_BUCKET_BYTES`)."""
    g = resolve_group(group)
    _fused(
        _tensors(model_or_tensors),
        DEFAULT_BUCKET_BYTES,
        lambda buf: collective.broadcast(buf, root_rank, g),
    )


class DistributedOptimizer:
    """Wraps a torch optimizer: :meth:`step` first averages the gradients of the optimizer's
    parameters over ``group`` (:func:`allreduce_gradients`), then steps. Everything else
    (``zero_grad``, ``param_groups``, ``state_dict``...) is the wrapped optimizer's.

    Args:
        optimizer: A ``torch.optim.Optimizer``.
        group: A :class:`~hoplite_gpu.collective.Group` or a hoplite ray collective group's name.
        op: How to combine gradients (default ``AVG``).
        bucket_bytes: Fusion bucket size.
    """

    def __init__(
        self,
        optimizer: Any,
        group: Any,
        op: ReduceOp | str = ReduceOp.AVG,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        import torch

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}",
                argument="optimizer",
            )
        self.optimizer = optimizer
        self.group = resolve_group(group)
        self.op = as_op(op)
        self.bucket_bytes = bucket_bytes

    def _params(self) -> list[Any]:
        return [p for pg in self.optimizer.param_groups for p in pg["params"]]

    def synchronize(self) -> None:
        """Average the gradients now (``step`` does it; call it to clip averaged gradients)."""
        allreduce_gradients(self._params(), self.group, self.op, self.bucket_bytes)

    def step(self, closure: Any = None) -> Any:
        """Average the gradients over the group, then step the wrapped optimizer."""
        self.synchronize()
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"<hoplite_gpu.torch.DistributedOptimizer of {self.optimizer!r} over {self.group!r}>"
