"""The torch.distributed backend ``"hoplite"``: :class:`ProcessGroupHoplite`, a process group whose
collectives run on :mod:`hoplite_gpu.collective` (public names only), registered with
``torch.distributed.Backend.register_backend`` by :mod:`.plugin`.

Each torch process group is a watched :class:`hoplite_gpu.collective.Group` of the same members,
under a name its rank 0 makes up (:mod:`.rendezvous`). Its collectives run in one lane (one
thread, in the order they were called, which every member shares); the messages between a pair of
ranks with one tag in a lane of their own. A synchronous call (``async_op=False``) runs on the
caller's thread when its lane is idle.

Whatever breaks a collective breaks the group, on every member: a member lost (its process died,
its lease ran out), a timeout, tensors that do not match the other members', an argument refused
here. The member that sees it gives up on the group (:meth:`~hoplite_gpu.collective.Group.abort`),
so the others' pending and later work fails at once with
:class:`~hoplite_gpu.torch.errors.RankLostError` (a ``DistBackendError``) naming it and why,
rather than at their timeout. Create a new process group with the ranks left to go on.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import collective
from ..errors import DirectoryUnavailableError, HopliteError, InvalidArgumentError, MemberLostError
from . import rendezvous as rdv
from . import tensors as tt
from .errors import RankLostError, as_torch_error
from .names import BACKEND
from .work import HopliteWork, Lane, joined

#: Seconds a group waits for its members when torch passes no timeout (torch's own default).
DEFAULT_TIMEOUT = 1800.0


def create(options: Any, backend_options: Any = None) -> ProcessGroupHoplite:
    """The creator torch calls for each new group of this backend (``extended_api``: ``options``
    is a ``_DistributedBackendOptions``)."""
    store = options.store
    if store is None:
        raise InvalidArgumentError(
            "the hoplite backend needs torch's store to find its directory: call "
            "init_process_group with an init_method (env:// or tcp://...) or a store",
            argument="store",
        )
    rank, size = int(options.group_rank), int(options.group_size)
    ranks = [int(r) for r in (options.global_ranks_in_group or range(size))]
    timeout = _seconds(options.timeout) or DEFAULT_TIMEOUT
    met = rdv.rendezvous(store, rank, ranks[rank], timeout)
    pg = ProcessGroupHoplite(met, rank, size, timeout, ranks, str(options.group_id or "0"))
    try:
        rdv.all_joined(store, size, timeout)
    except BaseException:
        pg.leave()
        raise
    return pg


def _seconds(timeout: Any) -> float | None:
    """Seconds of a timedelta (None when unset: negative, as torch's options leave it)."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
        return seconds if seconds > 0 else None
    return None


class ProcessGroupHoplite(dist.ProcessGroup):  # type: ignore[misc]
    """A torch.distributed process group on hoplite_gpu (see the module's docstring). Made by
    ``init_process_group("hoplite")`` and ``new_group(backend="hoplite")``, not directly.

    Args:
        met: The rendezvous of this member (:func:`.rendezvous.rendezvous`).
        rank: This member's rank in the group.
        size: The group's size.
        timeout: Seconds each collective waits for the other members.
        global_ranks: The global rank of each member.
        torch_name: torch's name of the group (for errors).
    """

    def __init__(
        self,
        met: rdv.Rendezvous,
        rank: int,
        size: int,
        timeout: float,
        global_ranks: list[int],
        torch_name: str,
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._rank, self._size = rank, size
        self._timeout = timeout
        self._global_ranks = global_ranks
        self._torch_name = torch_name
        self._host = met.host_rank  # global rank hosting the directory (-1: none of ours)
        self.group = collective.Group(met.node, rank, size, met.name, timeout=timeout, watch=True)
        self._lanes: dict[Any, Lane] = {"coll": Lane(f"{torch_name}")}
        self._lanes_lock = threading.Lock()
        self._count = 0  # collectives started (for errors)
        self._closed = False
        self._group_name = self._group_desc = torch_name
        rdv.register(self)

    # ------------------------------------------------------------ names torch asks for
    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"<ProcessGroupHoplite {self._torch_name!r} rank {self._rank}/{self._size}>"

    # torch keeps a group's name and description in its backend, which a Python group has none
    # of: they are kept here (``pg.group_name``, which DeviceMesh and FSDP read).
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    # ------------------------------------------------------------ running a call
    def _lane(self, key: Any) -> Lane:
        with self._lanes_lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = Lane(f"{self._torch_name}-{key[0]}{key[1]}-t{key[2]}")
            return lane

    def _run(
        self,
        what: str,
        outputs: list[torch.Tensor],
        call: Callable[[], Any],
        opts: Any = None,
        lane: Any = "coll",
        inputs: Sequence[torch.Tensor] = (),
    ) -> HopliteWork:
        """Run ``call`` (the collective, with the library) in ``lane``; the work completes with
        ``outputs`` or with its error (which breaks the group, see the module's docstring)."""
        if lane == "coll":
            self._count += 1
            what = f"{what} #{self._count}"
        work = HopliteWork(outputs, f"{what} of process group {self._torch_name!r}")
        ready = tt.cuda_ready([*inputs, *outputs]) if torch.cuda.is_available() else None

        def run() -> None:
            try:
                if self._closed:
                    raise InvalidArgumentError(f"process group {self._torch_name!r} was destroyed")
                if ready is not None:
                    ready()
                result = call()
                if isinstance(result, int) and not isinstance(result, bool):
                    work.source = result
            except BaseException as exc:
                work.finish(self._failed(exc, what))
                return
            work.finish()

        target = self._lanes["coll"] if lane == "coll" else self._lane(lane)
        if getattr(opts, "asyncOp", True) or not target.run_here(run):
            target.submit(run)
        return work

    def _refused(self, what: str, exc: BaseException) -> HopliteWork:
        """A call refused before it ran: its work fails with ``exc``, and the group breaks."""
        work = HopliteWork([], f"{what} of process group {self._torch_name!r}")
        work.finish(self._failed(exc, what))
        return work

    def _failed(self, exc: BaseException, what: str) -> BaseException:
        """The error a failed call raises; the group is broken for every member."""
        g = self.group
        if isinstance(exc, DirectoryUnavailableError) or isinstance(g.error, DirectoryUnavailableError):
            exc = self._directory_lost(exc)
        if not isinstance(exc, MemberLostError) and g.error is None and not g.node.closed:
            try:
                g.abort(f"{what} failed on rank {self._rank}: {type(exc).__name__}: {exc}"[:900])
            except HopliteError:
                pass  # (the directory is gone too: the others find out from their own)
        return as_torch_error(exc, self._torch_name, self._rank)

    def _directory_lost(self, exc: BaseException) -> BaseException:
        """A lost directory that lived in a member's process: that member is gone."""
        host = self._host
        if host < 0:
            return exc
        where = self._global_ranks.index(host) if host in self._global_ranks else -1
        text = f"the process hosting the hoplite directory (global rank {host}) is gone: {exc}"
        lost = [where] if where >= 0 else []
        return RankLostError(text, lost_ranks=lost, reasons={r: text for r in lost}, group=self._torch_name)

    # ------------------------------------------------------------ reductions
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> HopliteWork:
        """``dist.all_reduce``: every member's tensor reduced, in place everywhere."""
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        try:
            t = tt.single(tensors, "all_reduce")
            if tt.is_bitwise(op):
                fn = tt.check_bitwise(t, op)
                return self._run("all_reduce", [t], lambda: self._bitwise_allreduce(t, fn), opts, inputs=[t])
            plan = tt.reduction(t, op)
        except InvalidArgumentError as exc:
            return self._refused("all_reduce", exc)

        def call() -> None:
            collective.allreduce(plan.array, self.group, plan.op)
            plan.done()

        return self._run("all_reduce", [t], call, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> HopliteWork:
        """``dist.all_reduce_coalesced``: several tensors, packed per dtype and device into one
        allreduce each."""
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        try:
            ts = [tt.check(t, "all_reduce_coalesced") for t in tensors]
            kinds: dict[tuple[Any, Any], list[torch.Tensor]] = {}
            for t in ts:
                kinds.setdefault((t.dtype, t.device), []).append(t)
            packs = [(group, torch.cat([t.reshape(-1) for t in group])) for group in kinds.values()]
            plans = [(group, flat, tt.reduction(flat, op)) for group, flat in packs]
        except InvalidArgumentError as exc:
            return self._refused("all_reduce_coalesced", exc)

        def call() -> None:
            for group, flat, plan in plans:
                collective.allreduce(plan.array, self.group, plan.op)
                plan.done()
                start = 0
                for t in group:
                    t.detach().copy_(flat[start : start + t.numel()].view_as(t))
                    start += t.numel()

        return self._run("all_reduce_coalesced", ts, call, opts)

    def _bitwise_allreduce(
        self, t: torch.Tensor, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> None:
        """A bitwise allreduce: every member's tensor gathered, reduced here."""
        gathered = torch.empty((self._size, *t.shape), dtype=t.dtype, device=t.device)
        collective.allgather([tt.as_bytes(x) for x in gathered], tt.as_bytes(t), self.group)
        t.detach().copy_(functools.reduce(fn, gathered.unbind(0)))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> HopliteWork:
        """``dist.reduce``: every member's tensor reduced into the root's (the others' are left
        as they are)."""
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        root = int(getattr(opts, "rootRank", 0))
        try:
            t = tt.single(tensors, "reduce")
            self._check_rank(root, "dst")
            if tt.is_bitwise(op):
                fn = tt.check_bitwise(t, op)
                mine = t if root == self._rank else t.clone()
                return self._run("reduce", [t], lambda: self._bitwise_allreduce(mine, fn), opts, inputs=[t])
            plan = tt.reduction(t, op)
        except InvalidArgumentError as exc:
            return self._refused("reduce", exc)

        def call() -> None:
            collective.reduce(plan.array, root, self.group, plan.op)
            if root == self._rank:
                plan.done()

        return self._run("reduce", [t], call, opts)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> HopliteWork:
        """``dist.reduce_scatter``: member ``r`` gets the reduction of every member's
        ``inputs[r]``."""
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        try:
            out = tt.single(outputs, "reduce_scatter")
            pieces = tt.per_member(
                tt.one_list(inputs, "reduce_scatter"), self._size, "reduce_scatter input_list"
            )
            return self._reduce_scatter("reduce_scatter", out, pieces, op, opts)
        except InvalidArgumentError as exc:
            return self._refused("reduce_scatter", exc)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> HopliteWork:
        """``dist.reduce_scatter_tensor``: member ``r`` gets the reduction of every member's
        ``r``-th chunk of ``input`` (``size`` equal chunks along the flattened tensor)."""
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        try:
            out, src = tt.check(output, "output"), tt.check(input, "input")
            tt.check_whole("reduce_scatter_tensor", ("input", src), ("output", out), self._size)
            pieces = list(src.reshape(self._size, -1).unbind(0))
            return self._reduce_scatter("reduce_scatter_tensor", out, pieces, op, opts)
        except InvalidArgumentError as exc:
            return self._refused("reduce_scatter_tensor", exc)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> HopliteWork:
        """Several ``reduce_scatter_tensor`` at once (one work for all)."""
        return self._pairwise(
            "reduce_scatter_tensor_coalesced", self._reduce_scatter_base, outputs, inputs, opts
        )

    def _reduce_scatter(
        self, what: str, out: torch.Tensor, pieces: list[torch.Tensor], op: Any, opts: Any
    ) -> HopliteWork:
        if any(p.numel() != out.numel() or p.dtype != out.dtype for p in pieces):
            raise tt.argument_error(
                f"{what}: every input must have the output's dtype and number of elements"
            )
        if tt.is_bitwise(op):
            fn = tt.check_bitwise(out, op)

            def bitwise() -> None:
                got = [torch.empty_like(out) for _ in range(self._size)]
                mine = [p.contiguous() for p in pieces]
                collective.alltoall([tt.as_bytes(g) for g in got], [tt.as_bytes(p) for p in mine], self.group)
                out.detach().copy_(functools.reduce(fn, got))

            return self._run(what, [out], bitwise, opts, inputs=pieces)
        plan = tt.reduction(out, op)
        arrays = [tt.reduction(p.reshape(out.shape), op).array for p in pieces]

        def call() -> None:
            collective.reducescatter(plan.array, arrays, self.group, plan.op)
            plan.done()

        return self._run(what, [out], call, opts, inputs=pieces)

    # ------------------------------------------------------------ data movement (any dtype)
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> HopliteWork:
        """``dist.broadcast``: the root's tensor copied into every member's."""
        root = int(getattr(opts, "rootRank", 0))
        try:
            t = tt.single(tensors, "broadcast")
            self._check_rank(root, "src")
            buf = tt.as_bytes(t)
        except InvalidArgumentError as exc:
            return self._refused("broadcast", exc)
        return self._run("broadcast", [t], lambda: collective.broadcast(buf, root, self.group), opts)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> HopliteWork:
        """``dist.all_gather``: ``outputs[0][r]`` gets member ``r``'s tensor, on every member."""
        try:
            t = tt.single(inputs, "all_gather")
            outs = tt.per_member(tt.one_list(outputs, "all_gather"), self._size, "all_gather tensor_list")
            src, dst = tt.as_bytes(t), [tt.as_bytes(o) for o in outs]
        except InvalidArgumentError as exc:
            return self._refused("all_gather", exc)
        return self._run("all_gather", outs, lambda: collective.allgather(dst, src, self.group), opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> HopliteWork:
        """``dist.all_gather_into_tensor``: member ``r``'s tensor lands in the ``r``-th of
        ``size`` equal chunks of ``output``."""
        try:
            out, t = tt.check(output, "output"), tt.check(input, "input")
            tt.check_whole("all_gather_into_tensor", ("output", out), ("input", t), self._size)
            rows = tt.as_bytes(out).reshape(self._size, -1)
            dst, src = [rows[r] for r in range(self._size)], tt.as_bytes(t)
        except InvalidArgumentError as exc:
            return self._refused("all_gather_into_tensor", exc)
        return self._run(
            "all_gather_into_tensor", [out], lambda: collective.allgather(dst, src, self.group), opts
        )

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> HopliteWork:
        """Several ``all_gather_into_tensor`` at once (one work for all)."""
        return self._pairwise("all_gather_into_tensor_coalesced", self._allgather_base, outputs, inputs, opts)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> HopliteWork:
        """``dist.all_gather_coalesced``: ``outputs[r][j]`` gets rank ``r``'s ``inputs[j]``, one
        ``all_gather`` per input tensor."""
        if len(outputs) != self._size or any(len(row) != len(inputs) for row in outputs):
            what = f"{self._size} lists (one per rank) of {len(inputs)} tensors (one per input)"
            refused = tt.argument_error(f"all_gather_coalesced: output_tensor_lists must hold {what}")
            return self._refused("all_gather_coalesced", refused)
        works = [
            self.allgather([[outputs[r][j] for r in range(self._size)]], [t], opts)
            for j, t in enumerate(inputs)
        ]
        what = f"all_gather_coalesced of process group {self._torch_name!r}"
        return joined(works, [t for row in outputs for t in row], what)

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> HopliteWork:
        """``dist.gather``: on the root, ``outputs[0][r]`` gets member ``r``'s tensor."""
        root = int(getattr(opts, "rootRank", 0))
        try:
            t = tt.single(inputs, "gather")
            self._check_rank(root, "dst")
            outs: list[torch.Tensor] = []
            if root == self._rank:
                outs = tt.per_member(tt.one_list(outputs, "gather"), self._size, "gather gather_list")
            dst = [tt.as_bytes(o) for o in outs] if outs else None
            src = tt.as_bytes(t)
        except InvalidArgumentError as exc:
            return self._refused("gather", exc)
        return self._run("gather", outs, lambda: collective.gather(dst, src, root, self.group), opts)

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> HopliteWork:
        """``dist.scatter``: member ``r`` gets the root's ``inputs[0][r]``."""
        root = int(getattr(opts, "rootRank", 0))
        try:
            out = tt.single(outputs, "scatter")
            self._check_rank(root, "src")
            src = None
            if root == self._rank:
                src = [
                    tt.as_bytes(t)
                    for t in tt.per_member(tt.one_list(inputs, "scatter"), self._size, "scatter scatter_list")
                ]
            dst = tt.as_bytes(out)
        except InvalidArgumentError as exc:
            return self._refused("scatter", exc)
        return self._run("scatter", [out], lambda: collective.scatter(dst, src, root, self.group), opts)

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> HopliteWork:
        """``dist.all_to_all``: member ``r``'s ``inputs[j]`` lands in member ``j``'s
        ``outputs[r]``."""
        try:
            outs = tt.per_member(outputs, self._size, "all_to_all output_tensor_list")
            ins = tt.per_member(inputs, self._size, "all_to_all input_tensor_list")
            dst, src = [tt.as_bytes(o) for o in outs], [tt.as_bytes(t) for t in ins]
        except InvalidArgumentError as exc:
            return self._refused("all_to_all", exc)
        return self._run("all_to_all", outs, lambda: collective.alltoall(dst, src, self.group), opts)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> HopliteWork:
        """``dist.all_to_all_single``: ``input`` split along its first dimension (by
        ``input_split_sizes``, else equally), piece ``j`` to member ``j``; ``output`` likewise
        receives member ``r``'s piece in its ``r``-th part."""
        try:
            out, t = tt.check(output, "output"), tt.check(input, "input")
            dst = tt.split_rows(out, output_split_sizes, self._size, "output")
            src = tt.split_rows(t, input_split_sizes, self._size, "input")
        except InvalidArgumentError as exc:
            return self._refused("all_to_all_single", exc)
        return self._run("all_to_all_single", [out], lambda: collective.alltoall(dst, src, self.group), opts)

    # torch 2.13's names for the same calls (the older ones above are those of its C++ side).
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]
    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]
    all_to_all_single = alltoall_base  # type: ignore[assignment]

    # ------------------------------------------------------------ point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> HopliteWork:
        """``dist.send`` / ``isend``: returns once ``dst`` received it (the work); messages
        between a pair with one tag arrive in order."""
        try:
            t = tt.single(tensors, "send")
            self._check_peer(dst, "dst")
            buf = tt.as_bytes(t)
        except InvalidArgumentError as exc:
            return self._refused("send", exc)
        call = functools.partial(collective.send, buf, dst, self.group, tag=tag)
        return self._run(f"send to {dst}", [t], call, lane=("send", dst, tag), inputs=[t])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> HopliteWork:
        """``dist.recv`` / ``irecv`` from ``src``."""
        try:
            t = tt.single(tensors, "recv")
            self._check_peer(src, "src")
            buf = tt.as_bytes(t)
        except InvalidArgumentError as exc:
            return self._refused("recv", exc)

        def call() -> int:
            collective.recv(buf, src, self.group, tag=tag)
            return src

        return self._run(f"recv from {src}", [t], call, lane=("recv", src, tag))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> HopliteWork:
        """``dist.recv`` / ``irecv`` without a source: the next message any rank sends with
        ``tag`` (the work's ``_source_rank()`` says whose). Do not wait for a named source with the
        same tag meanwhile (:func:`hoplite_gpu.collective.recv_any`)."""
        try:
            t = tt.single(tensors, "recv")
            buf = tt.as_bytes(t)
        except InvalidArgumentError as exc:
            return self._refused("recv", exc)
        call = functools.partial(collective.recv_any, buf, self.group, tag=tag)
        return self._run("recv from any source", [t], call, lane=("recv", "any", tag))

    # ------------------------------------------------------------ barriers
    def barrier(self, opts: Any = None) -> HopliteWork:
        """``dist.barrier``: completes once every member has called it."""
        return self._run("barrier", [], lambda: collective.barrier(self.group), opts)

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """``dist.monitored_barrier``: a barrier whose timeout error names the ranks missing."""
        self.barrier().wait(timeout or timedelta(0))

    # ------------------------------------------------------------ ending
    def give_up(self, reason: str) -> None:
        """Break the group on every member, for ``reason`` (see :meth:`Group.abort
        <hoplite_gpu.collective.Group.abort>`)."""
        if self.group.error is None and not self.group.node.closed:
            self.group.abort(reason)

    def leave(self) -> list[Any]:
        """Destroy the group on this member without waiting; the futures of its clean-up
        (done once the other members are past every collective with it; see :mod:`.rendezvous`)."""
        rdv.unregister(self)
        self._closed = True
        if self.group.destroyed or self.group.node.closed:
            return []
        done = self.group.destroy(wait=False)
        return [done] if done is not None else []

    def shutdown(self) -> None:
        """``dist.destroy_process_group``: local and quiet (the clean-up waits for the others in
        the background, and the process's exit waits for it: :mod:`.rendezvous`)."""
        rdv.left(self.leave())

    def abort(self) -> None:
        """``torch.distributed``'s abort: give up on the group (the others' work fails), then
        leave it."""
        self.give_up("aborted (ProcessGroup.abort)")
        self.leave()

    # ------------------------------------------------------------ arguments
    def _check_rank(self, rank: Any, argument: str) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self._size:
            raise tt.argument_error(f"{argument} rank {rank} is not in 0..{self._size - 1}", argument)

    def _check_peer(self, rank: Any, argument: str) -> None:
        self._check_rank(rank, argument)
        if rank == self._rank:
            raise tt.argument_error(f"{argument} rank {rank} is this process's own rank", argument)

    def _pairwise(
        self,
        what: str,
        one: Callable[[torch.Tensor, torch.Tensor, Any], HopliteWork],
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: Any,
    ) -> HopliteWork:
        """``one(output, input, opts)`` for each pair, as one work."""
        if len(outputs) != len(inputs):
            refused = tt.argument_error(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs")
            return self._refused(what, refused)
        works = [one(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return joined(works, list(outputs), f"{what} of process group {self._torch_name!r}")
