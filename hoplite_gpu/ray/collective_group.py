"""The ``ray.util.collective`` backend ``"hoplite"``: :class:`HopliteGroup`, a group whose collectives
run on :mod:`hoplite_gpu.collective`.

Like Ray's own backends, the group is a module-level subclass of Ray's ``BaseGroup``, so this module
imports Ray; :func:`hoplite_gpu.ray.register_collective_backend` imports it and registers the class.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
from ray.util.collective.collective_group.base_collective_group import BaseGroup

from .. import collective
from ..errors import InvalidArgumentError
from ..reduce_ops import ReduceOp, as_op
from .common import BACKEND, DEFAULT_TIMEOUT, as_buffer
from .directory import group_generation, node

T = TypeVar("T")


def _op(op: Any) -> ReduceOp:
    """Ray's ``ReduceOp`` (by its name) or anything :func:`hoplite_gpu.reduce_ops.as_op` takes."""
    name = getattr(op, "name", None)
    if type(op).__module__.startswith("ray.") and isinstance(name, str):
        return {"SUM": ReduceOp.SUM, "PRODUCT": ReduceOp.PROD, "MIN": ReduceOp.MIN, "MAX": ReduceOp.MAX}[name]
    return as_op(op)


def _seconds(options: Any) -> float | None:
    """The timeout of a call's options (``timeout_ms``) in seconds; None when it sets none (or
    0: the group's own then applies)."""
    value = getattr(options, "timeout_ms", None)
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float):
        seconds = value / 1000.0
    else:
        return None
    return seconds if seconds > 0 else None


def _single(tensors: Any, argument: str) -> Any:
    if isinstance(tensors, list | tuple):
        if len(tensors) != 1:
            raise InvalidArgumentError(
                f"{argument}: the hoplite backend takes one tensor per process, got {len(tensors)}",
                argument=argument,
            )
        return tensors[0]
    return tensors


def _output(tensor: Any) -> tuple[Any, Callable[[], None] | None]:
    """:func:`~.common.as_buffer` of a tensor a collective writes into; a read-only NumPy array
    that it refuses goes to the collective as it is, which takes its place in the group's order
    (the other members get their results) and then refuses it (``CollectiveArgumentError``)."""
    try:
        return as_buffer(tensor)
    except InvalidArgumentError:
        if isinstance(tensor, np.ndarray) and not tensor.flags.writeable:
            return tensor, None
        raise


class HopliteGroup(BaseGroup):  # type: ignore[misc]
    """A ``ray.util.collective`` group whose collectives run on hoplite_gpu (see
    :mod:`hoplite_gpu.collective`); created by ``init_collective_group(...,
    backend="hoplite")``. Its :attr:`group` is the underlying
    :class:`hoplite_gpu.collective.Group`."""

    def __init__(self, world_size: int, rank: int, group_name: str) -> None:
        super().__init__(world_size, rank, group_name)
        generation = group_generation(group_name, rank, world_size)
        self.group = collective.Group(
            node(), rank, world_size, f"ray/{group_name}/{generation}", timeout=DEFAULT_TIMEOUT
        )

    @classmethod
    def backend(cls) -> str:
        return BACKEND

    @classmethod
    def check_backend_availability(cls) -> bool:
        return True

    def destroy_group(self) -> None:
        """Destroy the group on this member alone, at once, as Ray's contract says: its objects
        are deleted in the background once the other members destroy theirs, or after the
        group's timeout (:meth:`hoplite_gpu.collective.Group.destroy` with ``wait=False``)."""
        self.group.destroy(wait=False)

    def _call(self, options: Any, fn: Callable[[], Any]) -> Any:
        seconds = _seconds(options)
        if seconds is None:
            return fn()
        saved = self.group.timeout
        self.group.timeout = seconds
        try:
            return fn()
        finally:
            self.group.timeout = saved

    def _checked(self, check: Callable[[], T]) -> T:
        """``check()``, a call's arguments made ready for the collective; if it refuses them,
        the collective still takes its place in the group's order (:meth:`Group.refuse
        <hoplite_gpu.collective.Group.refuse>`), so the group stays in step."""
        try:
            return check()
        except InvalidArgumentError as exc:
            self.group.refuse(exc)

    def _inplace(self, tensors: Any, argument: str, options: Any, fn: Callable[[Any], Any]) -> None:
        buf, back = self._checked(lambda: _output(_single(tensors, argument)))
        self._call(options, lambda: fn(buf))
        if back is not None:
            back()

    def allreduce(self, tensor: Any, allreduce_options: Any = None) -> None:
        """Reduce every member's tensor into it, in place (``allreduce_options.reduceOp``)."""
        op = self._checked(lambda: _op(getattr(allreduce_options, "reduceOp", ReduceOp.SUM)))
        self._inplace(tensor, "tensor", allreduce_options, lambda b: collective.allreduce(b, self.group, op))

    def barrier(self, barrier_options: Any = None) -> None:
        """Return once every member has called ``barrier``."""
        self._call(barrier_options, lambda: collective.barrier(self.group))

    def reduce(self, tensor: Any, reduce_options: Any = None) -> None:
        """Reduce every member's tensor into ``reduce_options.root_rank``'s, in place."""
        op = self._checked(lambda: _op(getattr(reduce_options, "reduceOp", ReduceOp.SUM)))
        root = int(getattr(reduce_options, "root_rank", 0))
        self._inplace(tensor, "tensor", reduce_options, lambda b: collective.reduce(b, root, self.group, op))

    def broadcast(self, tensor: Any, broadcast_options: Any = None) -> None:
        """Copy ``broadcast_options.root_rank``'s tensor into every member's, in place."""
        root = int(getattr(broadcast_options, "root_rank", 0))
        self._inplace(
            tensor, "tensor", broadcast_options, lambda b: collective.broadcast(b, root, self.group)
        )

    def allgather(self, tensor_list: Any, tensor: Any, allgather_options: Any = None) -> None:
        """Fill ``tensor_list[r]`` with member ``r``'s ``tensor`` on every member."""
        bufs, (src, _) = self._checked(
            lambda: (
                [_output(t) for t in _single(tensor_list, "tensor_list")],
                as_buffer(_single(tensor, "tensor"), write=False),
            )
        )
        self._call(allgather_options, lambda: collective.allgather([b for b, _ in bufs], src, self.group))
        for _, back in bufs:
            if back is not None:
                back()

    def reducescatter(self, tensor: Any, tensor_list: Any, reducescatter_options: Any = None) -> None:
        """Member ``r`` gets the reduction over members of their ``tensor_list[r]``, in ``tensor``."""
        op, inputs = self._checked(
            lambda: (
                _op(getattr(reducescatter_options, "reduceOp", ReduceOp.SUM)),
                [as_buffer(t, write=False)[0] for t in _single(tensor_list, "tensor_list")],
            )
        )
        self._inplace(
            tensor,
            "tensor",
            reducescatter_options,
            lambda b: collective.reducescatter(b, inputs, self.group, op),
        )

    def send(self, tensor: Any, send_options: Any) -> None:
        """Send ``tensor`` to ``send_options.dst_rank``; returns once it has received it."""
        dst = int(send_options.dst_rank)
        buf, _ = as_buffer(_single(tensor, "tensor"), write=False)
        self._call(send_options, lambda: collective.send(buf, dst, self.group))

    def recv(self, tensor: Any, recv_options: Any) -> None:
        """Receive the next tensor ``recv_options.src_rank`` sends, into ``tensor``."""
        src = int(recv_options.src_rank)
        self._inplace(tensor, "tensor", recv_options, lambda b: collective.recv(b, src, self.group))
