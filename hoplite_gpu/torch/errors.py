"""The errors the torch.distributed backend raises: each is a ``torch.distributed.DistBackendError``
(so torch's and torchft's handling of a broken process group applies) and the library's own typed
error, with its fields (so ``except hoplite_gpu.MemberLostError`` works too, and the error pickles
across processes, as Ray Train needs).

Bad arguments are refused with :class:`hoplite_gpu.CollectiveArgumentError` (a ``ValueError`` and
a ``RuntimeError``), not with these.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..errors import HopliteError, HopliteTimeoutError, MemberLostError


class HopliteBackendError(dist.DistBackendError, HopliteError):  # type: ignore[misc]
    """A collective of the hoplite backend failed. Fields: ``kind`` (the library's error class),
    ``group`` (the torch group's name), ``rank`` (this member's rank in it), and the library
    error's own fields."""

    def __init__(self, message: str, **fields: Any) -> None:
        HopliteError.__init__(self, message, **fields)


class RankLostError(HopliteBackendError, MemberLostError):
    """A member of the process group is gone or gave up (its process died, or a collective
    failed on it): every pending and later collective of the group fails with it. Fields:
    ``lost_ranks`` (ranks in the group, ascending), ``reasons`` (rank -> why), and those of
    :class:`HopliteBackendError`. Create a new process group with the ranks left."""


class ElasticRemovedError(RankLostError):
    """This rank is no longer a member of its elastic group (:mod:`.elastic`): the others gave up
    on it (it stalled past its lease, or its node was cut off) and went on without it.
    ``lost_ranks`` is this rank."""


class BackendTimeoutError(HopliteBackendError, HopliteTimeoutError):
    """A collective did not finish within the process group's timeout (or a ``Work.wait``'s);
    ``waiting_for_ranks`` names the members it waited for, where known."""


def as_torch_error(exc: BaseException, group: str, rank: int) -> BaseException:
    """``exc`` as the backend raises it: a library error becomes one of the classes above (the
    original chained as its cause); argument errors and other exceptions are returned as they
    are."""
    from ..errors import InvalidArgumentError

    if isinstance(exc, HopliteBackendError | InvalidArgumentError) or not isinstance(exc, HopliteError):
        return exc
    fields = {**exc.fields, "kind": type(exc).__name__, "group": group, "rank": rank}
    cls: type[HopliteBackendError] = HopliteBackendError
    if isinstance(exc, MemberLostError):
        cls = RankLostError
    elif isinstance(exc, HopliteTimeoutError):
        cls = BackendTimeoutError
    err = cls(exc.message, **fields)
    err.__cause__ = exc
    return err
