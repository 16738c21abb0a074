"""Elastic data-parallel training: a step that survives a dead rank, and ranks that join a running
group, without a new process group.

:class:`Elastic` registers a DDP communication hook (or reduces tensors itself,
:meth:`Elastic.allreduce`). Each step's gradient buckets are allreduced among the members still
alive, as an ordinary hoplite allreduce on a watched group of those members (an *epoch*); the
step then ends with an *agreement* (:meth:`hoplite_gpu.node.Node.agree`): a barrier of that
group that the directory answers once every member has come or is lost, telling every member the
same things: who is left, whether every one of them read every bucket's result, and how many
joiners every one of them has seen.

- All read: every survivor holds the same sums (each shard of a result is one object that every
  member reads), averaged over the epoch's members: the step is applied everywhere.
- Not all (a member died while results were still being read, so some survivor lacks one):
  every survivor puts its gradients back (from its parameters' gradients, which DDP leaves as
  they were until the results come back; from a copy with ``gradient_as_bucket_view``) and
  reduces them again among the members left (a new epoch), then agrees again. No survivor
  applies the first round.

So a step is applied by every live rank, with the same gradients, or by none (the step raises on
every rank: rounds exhausted, or a timeout); the decision is the directory's, taken once. A rank
that the others gave up on (it stalled past its lease) learns it at its next agreement and raises
:class:`~.errors.ElasticRemovedError`. (DDP's ``backward`` raises it as a ``RuntimeError`` naming
its class, with its text: torch's reducer re-raises a hook's failure as its own error; the typed
error is :attr:`Elastic.error`.)

A new process joins with ``Elastic(model, optimizer=..., name=..., join=True)`` (:mod:`.joins`):
it takes a ticket, the members admit it at the end of a step (all of them at the same step), and
before their next forward pass they publish the parameters and the optimizer's state, each
member a piece, which the joiner pulls from all of them at once; it takes part from that step on.
The members do not wait for a joiner before it is admitted; after, the step it joins waits for
its first gradients (its state transfer and one forward and backward pass). A joiner that dies
before it joined is given up on after ``join_timeout``.

DDP keeps using its process group for what the hook does not cover, so: construct it with
``forward_sync_buffers=False`` (``broadcast_buffers=False`` before torch 2.13; or a module
without buffers) and ``find_unused_parameters=False``;
and DDP synchronises its bucket layout once, at its second forward pass, on the process group: a
rank lost before that fails the survivors with :class:`~.errors.RankLostError`, as without
elastic mode. The process group's own collectives fail after a rank is lost (as always); the
elastic ones go on. docs/torch.md, "Elastic training", has an example.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import collective
from ..errors import HopliteError, InvalidArgumentError
from ..object_id import ObjectID
from ..reduce_ops import ReduceOp
from . import joins
from . import tensors as tt
from .errors import ElasticRemovedError, HopliteBackendError
from .work import Lane, failing_in_cpp

#: Rounds a step may take (each after a failed one, among the members left) before it raises.
MAX_ROUNDS = 4
#: Seconds an admitted joiner has to take its place before the members give up on it.
JOIN_TIMEOUT = 60.0


@dataclass(frozen=True)
class StepReport:
    """What happened to one elastic step, the same on every live rank.

    Attributes:
        step: The step's number (0 for the group's first step).
        contributors: Ranks whose gradients the applied average holds.
        members: Ranks taking part in the next step (joiners admitted at this step included).
        lost: Ranks lost during the step, with why (as far as this rank heard).
        joined: Ranks admitted at this step (they take part from the next one).
        rounds: Times the step's gradients were reduced (1 unless a member died mid-step).
    """

    step: int
    contributors: tuple[int, ...]
    members: tuple[int, ...]
    lost: dict[int, str] = field(default_factory=dict)
    joined: tuple[int, ...] = ()
    rounds: int = 1


_Epoch = tuple[collective.Group, tuple[int, ...]]  # an epoch's group and its members


@dataclass(eq=False)
class _Part:
    """One tensor reduced in a step: how to put its original back (to reduce it again), its
    bucket's parameters (by index; None outside DDP), and the future torch waits on."""

    tensor: torch.Tensor
    restore: Callable[[], None]
    key: tuple[int, ...] | None
    settled: torch.futures.Future[torch.Tensor]  # set here; torch waits on failing_in_cpp(settled)
    ready: Callable[[], None]
    ok: bool = False


class Elastic:
    """Elastic mode for a DDP model on the ``"hoplite"`` backend (see the module's docstring).

    Args:
        module: A ``DistributedDataParallel`` model on a hoplite process group: the hook is
            registered on it. None: only :meth:`allreduce` (and no joiners).
        optimizer: The model's optimizer, whose state a joiner receives (None: parameters only).
        group: The process group (default: the module's, or the default group). A joiner's is a
            group of its own (``init_process_group`` of one rank): only its node is used.
        name: The elastic group's name, the same on every member and joiner (default: derived
            from the process group's; a joiner must name it).
        join: Join the running group ``name`` as a new rank (blocks until admitted and loaded).
        timeout: Seconds a step waits for the other members (None: the process group's).
        max_rounds: Rounds a step may take before it raises.
        join_timeout: Seconds an admitted joiner has to take its place.

    Attributes:
        steps: Steps agreed so far (a joiner's first step's number once it returns).
        last_step: The last step's :class:`StepReport` (None before the first).
        error: What the last failed step raised (its type, which DDP's ``backward`` loses).
        join_seconds: A joiner's: seconds from its ticket to its admission (``admitted``) and to
            load the state after (``state``: waiting for the members to publish it,
            ``published``; pulling its pieces, ``pulled``; loading them, ``loaded``).

    Raises:
        InvalidArgumentError: not a hoplite group, or a DDP model that would use its process
            group at every step (buffers broadcast, unused parameters found), or a joiner
            without a model or a name.
        HopliteTimeoutError: (a joiner) not admitted, or its state not received, in ``timeout``.
    """

    def __init__(
        self,
        module: Any = None,
        *,
        optimizer: Any = None,
        group: Any = None,
        name: str | None = None,
        join: bool = False,
        timeout: float | None = None,
        max_rounds: int = MAX_ROUNDS,
        join_timeout: float = JOIN_TIMEOUT,
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
        if name is not None and (not isinstance(name, str) or not name):
            raise InvalidArgumentError("name must be a non-empty str", argument="name")
        patient = isinstance(join_timeout, int | float) and not isinstance(join_timeout, bool)
        if not (patient and join_timeout > 0 and math.isfinite(join_timeout)):
            text = "join_timeout must be a finite number of seconds > 0"
            raise InvalidArgumentError(text, argument="join_timeout")
        if join and (module is None or name is None):
            raise InvalidArgumentError("a joiner needs its DDP model and the group's name", argument="join")
        if module is not None:
            _check_ddp(module)
        base = pg.group
        self._node = base.node
        self._name = name or f"{base.name}/elastic"
        self._timeout = timeout if timeout is not None else base.timeout
        self._max_rounds = max_rounds
        self._join_timeout = float(join_timeout)
        self._module = module.module if module is not None else None
        self._optimizer = optimizer
        params = list(self._module.parameters()) if self._module is not None else []
        self._index = {id(p): i for i, p in enumerate(params)}  # a bucket's parameters, by index
        self._numels = [p.numel() for p in params]
        self._views = bool(getattr(module, "gradient_as_bucket_view", False))
        self._parts: list[_Part] = []
        # One daemon thread, in order: an exit is never held up by a step waiting for others.
        self._worker = Lane("elastic")
        self._lock = threading.Lock()
        self._on_change: list[Callable[[StepReport], None]] = []
        self._keys: list[tuple[int, ...] | None] = []  # the last step's bucket layout
        self._layout: list[tuple[int, ...]] | None = None  # a joiner's: the members' layout
        self._publish: tuple[int, tuple[int, ...]] | None = None  # (step, publishers) pending
        self._published: list[ObjectID] = []  # state this member put for joiners
        self._timers: list[threading.Timer] = []  # giving up on admitted joiners
        self.steps = 0
        self.last_step: StepReport | None = None
        self.error: BaseException | None = None
        self.join_seconds: dict[str, float] = {}  # a joiner's: "admitted" (since its ticket), "state"
        self._epoch = -1
        self._agreements = 0  # agreements reached in this epoch
        self._failed = -1  # the last epoch in which a reduction failed here (see _reduce)
        if join:
            self._join()
        else:
            self.rank: int = base.rank
            self._base = base.world_size  # joiner k takes rank base + k
            self._admitted = 0  # tickets admitted so far
            self._members: tuple[int, ...] = tuple(range(base.world_size))
            self._group = self._open_epoch(self._members)
        self._door = joins.Door(self._node, self._name, self._admitted)
        if module is not None:
            module.register_comm_hook(self, comm_hook)
            module.register_forward_pre_hook(self._before_forward)

    # ------------------------------------------------------------ what the loop reads
    @property
    def members(self) -> tuple[int, ...]:
        """The ranks taking part in the next step (ascending, joiners last)."""
        return self._members

    @property
    def world_size(self) -> int:
        """How many ranks take part in the next step."""
        return len(self._members)

    @property
    def index(self) -> int:
        """This rank's position among :attr:`members` (for sharding the data)."""
        return self._members.index(self.rank)

    @property
    def name(self) -> str:
        """The elastic group's name (a joiner passes it)."""
        return self._name

    def add_change_callback(self, callback: Callable[[StepReport], None]) -> None:
        """Call ``callback(report)`` after each step that lost or admitted members (on the
        elastic worker thread, before the step's results are handed back)."""
        self._on_change.append(callback)

    # ------------------------------------------------------------ reducing
    def reduce_later(
        self,
        tensor: torch.Tensor,
        last: bool,
        key: tuple[int, ...] | None = None,
        sources: list[torch.Tensor] | None = None,
    ) -> torch.futures.Future[torch.Tensor]:
        """Start averaging ``tensor`` (in place) among the live ranks as part of the current step;
        ``last``: it is the step's last tensor, and the step is agreed on after it; ``key``: the
        parameters (by index) of the DDP bucket it is; ``sources``: tensors whose concatenation
        is ``tensor``'s original and that stay unchanged until the future completes (a DDP
        bucket's gradients), else it is copied, to reduce it again if a member dies. The future
        completes with ``tensor`` once the step is agreed on (every tensor of the step at once)
        or fails with the step's error. DDP's hook (:func:`comm_hook`) calls it per bucket."""
        t = tt.check(tensor, "tensor")
        if not (t.dtype.is_floating_point or t.dtype.is_complex):
            raise tt.argument_error(f"elastic averaging needs a floating-point tensor, got {t.dtype}")
        ready = tt.cuda_ready([t]) if t.is_cuda else _nothing
        part = _Part(t, _restorer(t, sources), key, torch.futures.Future(), ready)
        future = failing_in_cpp(part.settled)
        with self._lock:
            self._parts.append(part)
            if self._layout is None:
                self._worker.submit(functools.partial(self._reduce, part))  # overlaps the backward
            if last:
                parts, self._parts = self._parts, []
                self._worker.submit(functools.partial(self._commit, parts))
        return future

    def allreduce(self, tensor: torch.Tensor) -> StepReport:
        """Average ``tensor`` in place among the live ranks, as a step of its own; returns the
        step's report. Raises what the step raised."""
        self.reduce_later(tensor, last=True).wait()
        assert self.last_step is not None
        return self.last_step

    def close(self) -> None:
        """Let the steps in flight end (at most the timeout), then leave the current epoch's
        group (its objects are deleted once every member has closed, or after the timeout)."""
        self._door.close()
        idle = threading.Event()
        self._worker.submit(idle.set)
        idle.wait(self._timeout)
        for timer in self._timers:
            timer.cancel()
        joins.delete_all(self._node, self._published)
        try:
            self._group.destroy(wait=False)
        except HopliteError:
            pass

    # ------------------------------------------------------------ on the worker thread
    def _reduce(self, part: _Part) -> None:
        """Average ``part`` among the current epoch's members (``ok`` if this member read it all);
        not tried once one failed in this epoch (the agreement moves on: one timeout, not one each)."""
        part.ok = False
        if self._failed == self._epoch:
            return
        try:
            part.ready()
            plan = tt.reduction(part.tensor, dist.ReduceOp.AVG)  # (the tree's roots divide)
            collective.allreduce(plan.array, self._group, ReduceOp.AVG)
            plan.done()
            part.ok = True
        except HopliteError:
            self._failed = self._epoch  # (the agreement tells every member; reduced again or fails)

    def _commit(self, parts: list[_Part]) -> None:
        reduced = parts
        try:
            if self._layout is not None:  # a joiner's first steps: its buckets may differ
                reduced = self._as_layout(parts)
                for part in reduced:
                    self._reduce(part)
            self._agree(reduced, [p.key for p in parts])
            if reduced is not parts:
                self._scatter(reduced, parts)
        except BaseException as exc:
            self.error = exc
            for part in parts:
                part.settled.set_exception(exc)  # type: ignore[arg-type]
            return
        for part in parts:
            part.settled.set_result(part.tensor)

    def _agree(self, parts: list[_Part], keys: list[tuple[int, ...] | None]) -> StepReport:
        """Agree on the step; reduce it again among the members left until every one read every
        result (at most ``max_rounds`` rounds); admit the joiners every member has seen."""
        lost: dict[int, str] = {}
        for rounds in range(1, self._max_rounds + 1):
            group, members = self._group, self._members
            seen = self._door.seen
            vote = 1 + seen if all(part.ok for part in parts) else 0
            agreement = self._node.agree(
                group.watch_id, self._agreement_id(), group.rank, group.world_size, vote, self._timeout
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
            if agreement.vote >= 1:
                return self._applied(parts, keys, members, left, lost, agreement.vote - 1, rounds)
            self._next_epoch(left)
            for part in parts:
                part.restore()
                self._reduce(part)
        raise HopliteBackendError(
            f"elastic step {self.steps} of {self._name!r} was not read by every member after "
            f"{self._max_rounds} rounds",
            group=self._name,
            rank=self.rank,
        )

    def _applied(
        self,
        parts: list[_Part],
        keys: list[tuple[int, ...] | None],
        members: tuple[int, ...],
        left: tuple[int, ...],
        lost: dict[int, str],
        admitted: int,
        rounds: int,
    ) -> StepReport:
        """Every member read every result (averaged over ``members``): admit the joiners, report."""
        joined = tuple(self._base + k for k in range(self._admitted, admitted))
        report = StepReport(self.steps, members, left + joined, dict(lost), joined, rounds)
        self.steps += 1
        self.last_step = report
        self._keys = keys
        if self._layout is not None and keys == self._layout:
            self._layout = None  # this joiner's buckets are the members' now
        for timer in self._timers:  # every member (joiners too) came to this agreement
            timer.cancel()
        self._timers = []
        joins.delete_all(self._node, self._published)  # (read by the joiners that came)
        self._published = []
        if left + joined != members:
            self._next_epoch(left + joined)
        if joined:
            self._admit(joined, left, admitted)
        if left != members or joined:
            for callback in list(self._on_change):
                callback(report)
        return report

    def _admit(self, joined: tuple[int, ...], left: tuple[int, ...], admitted: int) -> None:
        """Joiners were admitted: the first member left tells each of them where to go; every
        member publishes the state before its next forward pass; a joiner that does not take its
        place within ``join_timeout`` is given up on."""
        if self.rank == left[0]:
            for rank in joined:
                k = rank - self._base
                record = {
                    "nonce": self._door.nonce(k),
                    "rank": rank,
                    "base": self._base,
                    "members": list(self._members),
                    "epoch": self._epoch,
                    "step": self.steps,
                    "admitted": admitted,
                    "layout": [list(key) for key in self._keys if key is not None],
                }
                self._published.append(
                    self._node.put(joins.as_bytes(record), joins.admission_id(self._name, k))
                )
        self._publish = (self.steps, left)
        self._admitted = admitted
        group = self._group
        for rank in joined:
            where = self._members.index(rank)

            def give_up(where: int = where, rank: int = rank) -> None:
                reason = f"joiner rank {rank} did not take its place within {self._join_timeout} s"
                try:  # (refused if it did: it watches the group from its own node)
                    self._node.abort_group(group.watch_id, where, group.world_size, reason)
                except HopliteError:
                    pass

            self._timers.append(joins.later(self._join_timeout, give_up))

    # ------------------------------------------------------------ joiners
    def _before_forward(self, *_: Any) -> None:
        """DDP's forward pre-hook: publish the state for admitted joiners (the optimizer stepped)."""
        pending, self._publish = self._publish, None
        if pending is None or self._module is None:
            return
        step, publishers = pending
        if self.rank in publishers:
            put = joins.publish_state(
                self._node,
                self._name,
                step,
                publishers.index(self.rank),
                len(publishers),
                self._module,
                self._optimizer,
            )
            self._published.extend(put)

    def _join(self) -> None:
        """Take a ticket, wait to be admitted, take the place given, and load the state."""
        assert self._module is not None
        node, name = self._node, self._name
        begun = time.monotonic()
        first = 0
        while True:
            k, nonce = joins.claim_ticket(node, name, first)
            record = joins.from_bytes(node.get(joins.admission_id(name, k), self._timeout))
            if record["nonce"] == nonce:
                break
            first = k + 1  # (ticket k was a joiner's that died before it was admitted)
        self.rank = int(record["rank"])
        self._base = int(record["base"])
        self._admitted = int(record["admitted"])
        self._members = tuple(int(r) for r in record["members"])
        self._epoch = int(record["epoch"]) - 1
        self._group = self._open_epoch(self._members)  # watched from now on: a death is seen
        self.steps = int(record["step"])
        self._layout = [tuple(int(i) for i in key) for key in record["layout"]] or None
        admitted = time.monotonic()
        parts = joins.fetch_state(node, name, self.steps, self._timeout, self._module, self._optimizer)
        self.join_seconds = {"admitted": admitted - begun, "state": time.monotonic() - admitted, **parts}
        joins.delete_all(node, [joins.ticket_id(name, k)])

    def _as_layout(self, parts: list[_Part]) -> list[_Part]:
        """The step's gradients as the members' buckets (:attr:`_layout`), to reduce with them."""
        assert self._layout is not None
        if [p.key for p in parts] == self._layout:
            return parts
        if any(part.key is None for part in parts):
            raise InvalidArgumentError("a joiner's first step must come from its DDP model")
        where = self._by_parameter(parts)
        out = []
        for key in self._layout:
            sources = [where[i] for i in key]  # (this rank's buckets stay as they are until _scatter)
            flat = torch.cat(sources)
            out.append(_Part(flat, _restorer(flat, sources), key, torch.futures.Future(), _nothing))
        return out

    def _scatter(self, reduced: list[_Part], parts: list[_Part]) -> None:
        """Copy the results of the members' buckets (``reduced``) back into this rank's own."""
        results = self._by_parameter(reduced)
        for i, view in self._by_parameter(parts).items():
            view.copy_(results[i])

    def _by_parameter(self, parts: list[_Part]) -> dict[int, torch.Tensor]:
        """Each parameter's gradient within the tensors of ``parts`` (views), by index."""
        where: dict[int, torch.Tensor] = {}
        for part in parts:
            start = 0
            for i in part.key or ():
                n = self._numels[i]
                where[i] = part.tensor.view(-1)[start : start + n]
                start += n
        return where

    # ------------------------------------------------------------ epochs
    def _agreement_id(self) -> ObjectID:
        return ObjectID.from_name(f"hoplite-elastic/{self._name}/{self._epoch}/{self._agreements}")

    def _open_epoch(self, members: tuple[int, ...], before: _Epoch | None = None) -> collective.Group:
        """The watched group of ``members`` for the next epoch (every member makes the same);
        ``before``: (the group, its members) of the epoch before, its ``parent``: a member that
        dies before it watches the new one is lost in it, not waited for until the timeout."""
        self._epoch += 1
        self._agreements = 0
        parent, old = before if before is not None else (None, ())
        ranks = None if parent is None else [old.index(r) if r in old else -1 for r in members]
        name, rank = f"{self._name}/{self._epoch}", members.index(self.rank)
        return collective.Group(
            self._node, rank, len(members), name, self._timeout, True, parent=parent, parent_ranks=ranks
        )

    def _next_epoch(self, members: tuple[int, ...]) -> None:
        old, before = self._group, self._members
        self._members = members
        self._group = self._open_epoch(members, (old, before))
        _leave(old)


def _leave(group: collective.Group) -> None:
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
    by ``Elastic(module)``. Without ``gradient_as_bucket_view`` the parameters' gradients keep
    the bucket's original until the step's results are copied into them: no copy is made."""
    params = bucket.parameters()
    key = tuple(state._index[id(p)] for p in params) if state._index else None
    grads = [p.grad for p in params]
    views = state._views or any(g is None for g in grads)
    sources = None if views else [g.detach().reshape(-1) for g in grads]
    return state.reduce_later(bucket.buffer(), bucket.is_last(), key, sources)


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
            "elastic mode needs DistributedDataParallel(..., forward_sync_buffers=False) "
            "(broadcast_buffers=False before torch 2.13): DDP broadcasts buffers on its process "
            "group before every forward pass",
            argument="module",
        )
    if module.find_unused_parameters:
        raise InvalidArgumentError(
            "elastic mode needs find_unused_parameters=False: DDP reduces the map of used "
            "parameters on its process group at every step",
            argument="module",
        )


def _restorer(tensor: torch.Tensor, sources: list[torch.Tensor] | None) -> Callable[[], None]:
    """What puts ``tensor``'s original back: the concatenation of ``sources``, or a copy."""
    if sources is None:
        kept = tensor.detach().clone()

        def again() -> None:
            tensor.detach().copy_(kept)

        return again

    def concatenate() -> None:
        torch.cat(sources, out=tensor.detach().view(-1))

    return concatenate


def _nothing() -> None:
    return None
