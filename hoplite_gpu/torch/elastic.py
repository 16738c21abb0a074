"""Elastic data-parallel training: a step that survives a dead rank, without a new process group.

:class:`Elastic` registers a DDP communication hook (or reduces tensors itself,
:meth:`Elastic.allreduce`). Each step's gradient buckets are allreduced among the members still
alive, as an ordinary hoplite allreduce on a watched group of those members (an *epoch*); the
step then ends with an *agreement* (:meth:`hoplite_gpu.node.Node.agree`): a barrier of that
group that the directory answers once every member has come or is lost, telling every member the
same two things: who is left, and whether every one of them read every bucket's result.

- Yes: every survivor holds the same sums (each shard of a result is one object that every
  member reads), averaged over the epoch's members: the step is applied everywhere.
- No (a member died while results were still being read, so some survivor lacks one): every
  survivor restores its gradients from the copy it kept and reduces them again among the
  members left (a new epoch), then agrees again. No survivor applies the first round.

So a step is applied by every live rank, with the same gradients, or by none (the step raises on
every rank: rounds exhausted, or a timeout); the decision is the directory's, taken once. A rank
that the others gave up on (it stalled past its lease) learns it at its next agreement and raises
:class:`~.errors.ElasticRemovedError`. (DDP's ``backward`` raises it as a ``RuntimeError`` naming
its class, with its text: torch's reducer re-raises a hook's failure as its own error; the typed
error is :attr:`Elastic.error`.) The loop reads what happened in :attr:`Elastic.last_step` and the
membership in :attr:`Elastic.members` (shard the data by :attr:`Elastic.index` among
:attr:`Elastic.world_size`).

DDP keeps using its process group for what the hook does not cover, so: construct it with
``broadcast_buffers=False`` (or a module without buffers) and ``find_unused_parameters=False``;
and DDP synchronises its bucket layout once, at its second forward pass, on the process group: a
rank lost before that fails the survivors with :class:`~.errors.RankLostError`, as without
elastic mode. The process group's own collectives fail after a rank is lost (as always); the
elastic ones go on. docs/torch.md, "Elastic training", has an example.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import collective
from ..errors import HopliteError, InvalidArgumentError
from ..object_id import ObjectID
from ..reduce_ops import ReduceOp
from . import tensors as tt
from .errors import ElasticRemovedError, HopliteBackendError
from .work import failing_in_cpp

#: Rounds a step may take (each after a failed one, among the members left) before it raises.
MAX_ROUNDS = 4


@dataclass(frozen=True)
class StepReport:
    """What happened to one elastic step, the same on every live rank.

    Attributes:
        step: The step's number (0 for the first step of this :class:`Elastic`).
        contributors: Ranks (of the process group) whose gradients the applied average holds.
        members: Ranks alive after the step: the next step's contributors.
        lost: Ranks lost during the step, with why (as far as this rank heard).
        rounds: Times the step's gradients were reduced (1 unless a member died mid-step).
    """

    step: int
    contributors: tuple[int, ...]
    members: tuple[int, ...]
    lost: dict[int, str] = field(default_factory=dict)
    rounds: int = 1


@dataclass(eq=False)
class _Part:
    """One tensor reduced in a step: its original (to reduce again), and the future DDP waits on."""

    tensor: torch.Tensor
    original: torch.Tensor
    settled: torch.futures.Future[torch.Tensor]  # set here; DDP waits on failing_in_cpp(settled)
    ready: Callable[[], None]
    ok: bool = False


class Elastic:
    """Elastic mode for a DDP model on the ``"hoplite"`` backend (see the module's docstring).

    Args:
        module: A ``DistributedDataParallel`` model on a hoplite process group: the hook is
            registered on it. None: only :meth:`allreduce`.
        group: The process group (default: the module's, or the default group).
        timeout: Seconds a step waits for the other members (None: the process group's).
        max_rounds: Rounds a step may take before it raises.

    Raises:
        InvalidArgumentError: not a hoplite group, or a DDP model that would use its process
            group at every step (buffers broadcast, unused parameters found).
    """

    def __init__(
        self,
        module: Any = None,
        *,
        group: Any = None,
        timeout: float | None = None,
        max_rounds: int = MAX_ROUNDS,
    ) -> None:
        from .backend import ProcessGroupHoplite

        pg = group if group is not None else getattr(module, "process_group", None)
        pg = pg if pg is not None else dist.group.WORLD
        if not isinstance(pg, ProcessGroupHoplite):
            raise InvalidArgumentError(
                f"elastic mode needs a process group of the hoplite backend, got {type(pg).__name__}",
                argument="group",
            )
        if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
            raise InvalidArgumentError("max_rounds must be an int >= 1", argument="max_rounds")
        if module is not None:
            _check_ddp(module)
        base = pg.group
        self.rank: int = base.rank
        self._node = base.node
        self._name = f"{base.name}/elastic"
        self._timeout = timeout if timeout is not None else base.timeout
        self._max_rounds = max_rounds
        self._members: tuple[int, ...] = tuple(range(base.world_size))
        self._epoch = -1
        self._agreements = 0  # agreements reached in this epoch
        self._group = self._open_epoch(self._members)
        self._parts: list[_Part] = []
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hoplite-elastic")
        self._lock = threading.Lock()
        self._on_change: list[Callable[[StepReport], None]] = []
        self.steps = 0
        self.last_step: StepReport | None = None
        self.error: BaseException | None = None
        if module is not None:
            module.register_comm_hook(self, comm_hook)

    # ------------------------------------------------------------ what the loop reads
    @property
    def members(self) -> tuple[int, ...]:
        """The ranks alive, as agreed at the last step (ascending)."""
        return self._members

    @property
    def world_size(self) -> int:
        """How many ranks are alive (the next step's contributors)."""
        return len(self._members)

    @property
    def index(self) -> int:
        """This rank's position among :attr:`members` (for sharding the data)."""
        return self._members.index(self.rank)

    def add_change_callback(self, callback: Callable[[StepReport], None]) -> None:
        """Call ``callback(report)`` after each step that lost members (on the elastic worker
        thread, before the step's results are handed back)."""
        self._on_change.append(callback)

    # ------------------------------------------------------------ reducing
    def reduce_later(self, tensor: torch.Tensor, last: bool) -> torch.futures.Future[torch.Tensor]:
        """Start averaging ``tensor`` (in place) among the live ranks as part of the current step;
        ``last``: it is the step's last tensor, and the step is agreed on after it. The future
        completes with ``tensor`` once the step is agreed on (every tensor of the step at once)
        or fails with the step's error. DDP's hook (:func:`comm_hook`) calls it per bucket."""
        t = tt.check(tensor, "tensor")
        if not (t.dtype.is_floating_point or t.dtype.is_complex):
            raise tt.argument_error(f"elastic averaging needs a floating-point tensor, got {t.dtype}")
        ready = tt.cuda_ready([t]) if t.is_cuda else _nothing
        part = _Part(t, t.detach().clone(), torch.futures.Future(), ready)
        future = failing_in_cpp(part.settled)
        with self._lock:
            self._parts.append(part)
            self._worker.submit(self._reduce, part)
            if last:
                parts, self._parts = self._parts, []
                self._worker.submit(self._commit, parts)
        return future

    def allreduce(self, tensor: torch.Tensor) -> StepReport:
        """Average ``tensor`` in place among the live ranks, as a step of its own; returns the
        step's report. Raises what the step raised."""
        self.reduce_later(tensor, last=True).wait()
        assert self.last_step is not None
        return self.last_step

    def close(self) -> None:
        """Stop the worker (after the steps in flight) and leave the current epoch's group
        (its objects are deleted once every member has closed, or after the timeout)."""
        self._worker.shutdown(wait=True)
        try:
            self._group.destroy(wait=False)
        except HopliteError:
            pass

    # ------------------------------------------------------------ on the worker thread
    def _reduce(self, part: _Part) -> None:
        """Sum ``part`` among the current epoch's members (``ok`` if this member read it all)."""
        part.ok = False
        try:
            part.ready()
            plan = tt.reduction(part.tensor, dist.ReduceOp.SUM)
            collective.allreduce(plan.array, self._group, ReduceOp.SUM)
            plan.done()
            part.ok = True
        except HopliteError:
            pass  # (the agreement tells every member; the step is reduced again or fails)

    def _commit(self, parts: list[_Part]) -> None:
        try:
            self._agree(parts)
        except BaseException as exc:
            self.error = exc
            for part in parts:
                part.settled.set_exception(exc)  # type: ignore[arg-type]
            return
        for part in parts:
            part.settled.set_result(part.tensor)

    def _agree(self, parts: list[_Part]) -> StepReport:
        """Agree on the step; reduce it again among the members left until every one read every
        result (at most ``max_rounds`` rounds)."""
        lost: dict[int, str] = {}
        for rounds in range(1, self._max_rounds + 1):
            group, members = self._group, self._members
            vote = int(all(part.ok for part in parts))
            agreement = self._node.agree(
                group.watch_id,
                self._agreement_id(),
                group.rank,
                group.world_size,
                vote=vote,
                timeout=self._timeout,
            )
            self._agreements += 1
            left = tuple(members[i] for i in agreement.members)
            heard = group.lost
            for i, rank in enumerate(members):
                if rank not in left:
                    lost[rank] = heard.get(i, f"rank {rank} did not come to step {self.steps}'s agreement")
            if self.rank not in left:
                raise ElasticRemovedError(
                    f"rank {self.rank} was given up on by the other ranks of elastic group "
                    f"{self._name!r} (it was lost: {lost.get(self.rank, 'no reason heard')})",
                    lost_ranks=[self.rank],
                    reasons={self.rank: lost.get(self.rank, "")},
                    group=self._name,
                    rank=self.rank,
                )
            if agreement.vote == 1:
                for part in parts:
                    part.tensor.div_(len(members))
                report = StepReport(self.steps, members, left, dict(lost), rounds)
                self.steps += 1
                self.last_step = report
                if left != members:
                    self._next_epoch(left)
                    for callback in list(self._on_change):
                        callback(report)
                return report
            self._next_epoch(left)
            for part in parts:
                part.tensor.copy_(part.original)
                self._reduce(part)
        raise HopliteBackendError(
            f"elastic step {self.steps} of {self._name!r} was not read by every member after "
            f"{self._max_rounds} rounds",
            group=self._name,
            rank=self.rank,
        )

    # ------------------------------------------------------------ epochs
    def _agreement_id(self) -> ObjectID:
        return ObjectID.from_name(f"hoplite-elastic/{self._name}/{self._epoch}/{self._agreements}")

    def _open_epoch(self, members: tuple[int, ...]) -> collective.Group:
        """The watched group of ``members`` for the next epoch (every member makes the same)."""
        self._epoch += 1
        self._agreements = 0
        return collective.Group(
            self._node,
            members.index(self.rank),
            len(members),
            f"{self._name}/{self._epoch}",
            timeout=self._timeout,
            watch=True,
        )

    def _next_epoch(self, members: tuple[int, ...]) -> None:
        old = self._group
        self._members = members
        self._group = self._open_epoch(members)
        self._leave(old)

    def _leave(self, group: collective.Group) -> None:
        """Leave an epoch's group: no member reads its objects any more (all are past its last
        agreement), so they are deleted now, without a barrier the lost members would miss."""
        try:
            if group.error is None and not group.destroyed:
                group.abort("the elastic group moved to a new epoch")
            group.destroy()
        except HopliteError:
            pass  # (the directory is gone: nothing left to delete there)


def comm_hook(state: Elastic, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook of elastic mode (``state`` is the :class:`Elastic`); registered
    by ``Elastic(module)``."""
    return state.reduce_later(bucket.buffer(), bucket.is_last())


# DDP checks a hook's annotations as objects, not as the strings postponed annotations make them.
comm_hook.__annotations__.update(bucket=dist.GradBucket, state=Elastic)
comm_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def _check_ddp(module: Any) -> None:
    """Refuse a DDP model that would use its process group at every step."""
    if not isinstance(module, torch.nn.parallel.DistributedDataParallel):
        raise InvalidArgumentError(
            f"module must be a DistributedDataParallel model, got {type(module).__name__}",
            argument="module",
        )
    if module.broadcast_buffers and any(True for _ in module.module.buffers()):
        raise InvalidArgumentError(
            "elastic mode needs DistributedDataParallel(..., broadcast_buffers=False): DDP "
            "broadcasts buffers on its process group before every forward pass",
            argument="module",
        )
    if module.find_unused_parameters:
        raise InvalidArgumentError(
            "elastic mode needs find_unused_parameters=False: DDP reduces the map of used "
            "parameters on its process group at every step",
            argument="module",
        )


def _nothing() -> None:
    return None
