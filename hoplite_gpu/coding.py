"""Gradient coding: the exact sum of ``n`` partition gradients from any ``n - s`` of ``n`` workers.

First-k reduce (``num_objects=k``) leaves the stragglers' gradients out. Gradient coding (Tandon,
Lei, Dimakis and Karampatziakis, "Gradient Coding: Avoiding Stragglers in Distributed Learning",
ICML 2017) gives each worker ``s + 1`` of the ``n`` data partitions and has it send one linear
combination of their gradients; the messages of any ``n - s`` workers then combine, with weights
that depend on which workers they are, into the sum of all ``n`` partition gradients.

A code is its ``n x n`` encoding matrix ``B``: worker ``i`` sends ``sum_j B[i, j] * g_j`` over its
partitions ``j`` (the non-zero entries of row ``i``). A set ``F`` of workers decodes when some
weights ``a`` give ``a @ B[F] == 1`` (the all-ones row), and then ``sum_i a_i * message_i`` is the
full gradient.

    code = GradientCode.cyclic(8, 2)
    message = code.encode(worker, {j: grad_of(j) for j in code.partitions(worker)})
    ...
    weights = code.decoding_weights(first_six_workers)   # any 6 distinct workers of the 8
    full = code.decode({w: messages[w] for w in first_six_workers})

Two constructions of the paper:

* :meth:`GradientCode.fractional_repetition` (``s + 1`` divides ``n``): the workers form groups of
  ``s + 1``; every worker of a group computes the group's ``s + 1`` partitions and sends their
  plain sum. Any ``n - s`` workers include one of every group: the weights are 0 or 1, exact in
  any float type.
* :meth:`GradientCode.cyclic` (any ``s < n``): worker ``i`` computes partitions ``i, i+1, ..., i+s``
  (mod ``n``); the rows of ``B`` span the null space of a random ``s x n`` matrix ``H`` with
  ``H @ 1 = 0`` (the paper's Algorithm 2), so any ``n - s`` of them, linearly independent with
  probability 1, span a space that holds the all-ones row. ``seed`` fixes ``H``; of the seeds it
  tries, the code keeps the ``H`` whose worst arrival set needs the smallest weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, NotDecodableError
from .object_id import ObjectID
from .reduce_ops import weighted_sum_chunk

#: Largest ``n`` for which :meth:`GradientCode.cyclic` checks the conditioning of every arrival
#: set of ``n - s`` workers when it chooses ``H`` (C(16, 8) = 12,870 solves at most).
EXHAUSTIVE_CHECK_MAX_N = 16
#: A decoding whose weights reproduce the all-ones row worse than this (relative) is refused.
DECODE_TOLERANCE = 1e-9


class GradientCode:
    """An encoding of ``n`` partition gradients for ``n`` workers that tolerates ``s`` stragglers.

    Build one with :meth:`fractional_repetition` or :meth:`cyclic` (or pass a matrix of your own).

    Args:
        matrix: The ``n x n`` encoding matrix ``B`` (row ``i``: worker ``i``'s coefficients).
        stragglers: ``s``: every set of ``n - s`` distinct workers must decode.
        name: A short description for messages and ``repr``.
        order: Each worker's partitions in the order it computes them (default: ascending); the
            same sets as the non-zero entries of its row.

    Raises:
        InvalidArgumentError: the matrix is not square, not finite, or some set of ``n - s``
            workers cannot decode (checked for every such set up to ``n = 16``).
    """

    def __init__(
        self, matrix: Any, stragglers: int, name: str = "custom", order: Sequence[Sequence[int]] | None = None
    ) -> None:
        b = np.array(matrix, dtype=np.float64)
        if b.ndim != 2 or b.shape[0] != b.shape[1] or b.shape[0] < 1:
            raise InvalidArgumentError(f"an encoding matrix is n x n; got shape {b.shape}", argument="matrix")
        if not np.all(np.isfinite(b)):
            raise InvalidArgumentError("the encoding matrix has a NaN or an infinity", argument="matrix")
        n = b.shape[0]
        _check_counts(n, stragglers)
        self.matrix = b
        self.n = n
        self.stragglers = stragglers
        self.name = name
        self._group_size = 0  # fractional repetition: workers i // g share their partitions
        self._supports = [tuple(int(j) for j in np.flatnonzero(row)) for row in b]
        if order is not None:
            if len(order) != n or any(
                sorted(int(j) for j in o) != list(sup) for o, sup in zip(order, self._supports, strict=False)
            ):
                raise InvalidArgumentError(
                    "order must list each worker's partitions (its row's non-zero entries)", argument="order"
                )
            self._supports = [tuple(int(j) for j in o) for o in order]
        if n <= EXHAUSTIVE_CHECK_MAX_N:
            worst, _ = _worst_case(b, n - stragglers)
            if worst > DECODE_TOLERANCE:
                raise InvalidArgumentError(
                    f"{name}: some set of {n - stragglers} workers cannot decode (residual {worst:.2e})",
                    argument="matrix",
                )

    # ------------------------------------------------------------ constructions
    @classmethod
    def fractional_repetition(cls, n: int, s: int) -> GradientCode:
        """The fractional repetition code: groups of ``s + 1`` workers, each worker of a group
        computing the group's ``s + 1`` partitions and sending their sum.

        Raises:
            InvalidArgumentError: ``s + 1`` does not divide ``n`` (use :meth:`cyclic`), or
                ``n``, ``s`` out of range.
        """
        _check_counts(n, s)
        if n % (s + 1):
            raise InvalidArgumentError(
                f"fractional repetition needs s + 1 = {s + 1} to divide n = {n}; use GradientCode.cyclic",
                argument="s",
            )
        b = np.zeros((n, n))
        for worker in range(n):
            group = worker // (s + 1)
            b[worker, group * (s + 1) : (group + 1) * (s + 1)] = 1.0
        code = cls(b, s, name=f"fractional repetition (n={n}, s={s})")
        code._group_size = s + 1
        return code

    @classmethod
    def cyclic(cls, n: int, s: int, seed: int = 0, tries: int = 8) -> GradientCode:
        """The cyclic repetition code: worker ``i`` computes partitions ``i .. i+s`` (mod ``n``).

        Args:
            n: Workers (and partitions).
            s: Stragglers tolerated (``0 <= s < n``).
            seed: Seed of the random matrix ``H`` the rows are built from.
            tries: How many seeds (``seed``, ``seed + 1``, ...) to build from, keeping the code
                whose decoding weights are smallest for its worst arrival set (they amplify the
                messages' rounding; every set is checked up to ``n = 16``, a sample of 200 above).
        """
        _check_counts(n, s)
        if s == 0:
            return cls(np.eye(n), 0, name=f"cyclic (n={n}, s=0)")
        best: tuple[float, np.ndarray[Any, Any]] | None = None
        for k in range(max(1, tries)):
            b = _cyclic_matrix(n, s, np.random.default_rng(seed + k))
            if b is None:
                continue
            residual, amplification = _worst_case(
                b, n - s, sample=None if n <= EXHAUSTIVE_CHECK_MAX_N else 200
            )
            if residual <= DECODE_TOLERANCE and (best is None or amplification < best[0]):
                best = (amplification, b)
        if best is None:  # pragma: no cover - a singular draw every time has probability 0
            raise InvalidArgumentError(f"no cyclic code for n={n}, s={s} from {tries} seeds", argument="seed")
        order = [[(i + k) % n for k in range(s + 1)] for i in range(n)]
        return cls(best[1], s, name=f"cyclic (n={n}, s={s})", order=order)

    # ------------------------------------------------------------ encoding
    def partitions(self, worker: int) -> list[int]:
        """The data partitions ``worker`` computes gradients of, in the order it computes them
        (``s + 1`` for both codes; ``i, i+1, ..., i+s`` mod ``n`` for the cyclic one)."""
        return list(self._supports[self._check_worker(worker)])

    def encode(self, worker: int, grads: Mapping[int, Any]) -> np.ndarray[Any, Any]:
        """``worker``'s coded message: ``sum_j B[worker, j] * grads[j]`` over its partitions.

        Args:
            worker: The worker's index.
            grads: The gradient (a NumPy array) of each of :meth:`partitions`, all of one float
                dtype and shape.

        Raises:
            InvalidArgumentError: a partition missing or extra, or arrays that differ in dtype or
                shape or are not floating point.
        """
        wanted = self._supports[self._check_worker(worker)]
        if sorted(grads) != sorted(wanted):
            raise InvalidArgumentError(
                f"worker {worker} computes partitions {list(wanted)}; got gradients of {sorted(grads)}",
                argument="grads",
            )
        arrays = [np.asarray(grads[j]) for j in wanted]
        _check_same_float(arrays, "grads")
        out = np.empty_like(arrays[0])
        weighted_sum_chunk(arrays[0], arrays[1:], out, [float(self.matrix[worker, j]) for j in wanted])
        return out

    # ------------------------------------------------------------ decoding
    def is_decodable(self, workers: Sequence[int]) -> bool:
        """Whether the messages of these workers determine the full gradient."""
        try:
            self.decoding_weights(workers)
        except NotDecodableError:
            return False
        return True

    def decoding_weights(self, workers: Sequence[int]) -> list[float]:
        """Weights, one per worker in ``workers``' order, whose weighted sum of those workers'
        messages is the sum of all ``n`` partition gradients.

        Any ``n - s`` distinct workers decode; more are fine, and some smaller sets decode too (a
        fractional repetition code needs one worker of each group: the first of each group in
        ``workers`` gets weight 1, the others 0; a cyclic code's weights are the least-norm
        solution).

        Raises:
            NotDecodableError: the set does not decode (too few workers, say); wait for more.
            InvalidArgumentError: a worker index out of range or given twice.
        """
        chosen = [self._check_worker(w) for w in workers]
        if len(set(chosen)) != len(chosen):
            raise InvalidArgumentError(f"workers {list(workers)} name one worker twice", argument="workers")
        if not chosen:
            raise NotDecodableError(
                "no workers: nothing to decode", workers=[], needed=self.n - self.stragglers
            )
        if self._group_size:
            # One worker of each group, weight 1 (exact in any float type); the rest 0.
            first: dict[int, int] = {}
            for w in chosen:
                first.setdefault(w // self._group_size, w)
            weights = np.array([1.0 if first[w // self._group_size] == w else 0.0 for w in chosen])
            residual = 0.0 if len(first) == self.n // self._group_size else 1.0
        else:
            weights, residual = solve_decoding(self.matrix[chosen])
        if residual > DECODE_TOLERANCE:
            raise NotDecodableError(
                f"{self.name}: the messages of workers {sorted(chosen)} do not determine the full "
                f"gradient; any {self.n - self.stragglers} distinct workers do",
                workers=sorted(chosen),
                needed=self.n - self.stragglers,
            )
        return [float(w) for w in weights]

    def decode(self, messages: Mapping[int, Any]) -> np.ndarray[Any, Any]:
        """The full gradient from the coded messages of some workers (worker -> message), on this
        process: :meth:`decoding_weights` of the workers in the mapping's order, and a weighted
        sum in the messages' dtype."""
        workers = list(messages)
        weights = self.decoding_weights(workers)
        arrays = [np.asarray(messages[w]) for w in workers]
        _check_same_float(arrays, "messages")
        # Messages of weight 0 (a fractional repetition group's other members) are left out.
        used = [(w, a) for w, a in zip(weights, arrays, strict=True) if w]
        out = np.empty_like(arrays[0])
        weighted_sum_chunk(used[0][1], [a for _, a in used[1:]], out, [w for w, _ in used])
        return out

    # ------------------------------------------------------------ over hoplite
    def reduce(
        self,
        node: Any,
        ids_by_worker: Mapping[int, ObjectID],
        timeout: float | None = None,
        result_id: ObjectID | None = None,
    ) -> ObjectID:
        """Decode inside hoplite's reduce tree: the first ``n - s`` workers' messages to arrive,
        weighted by their decoding weights, summed into ``result_id`` (a fresh id by default).

        Returns at once, like :meth:`Node.reduce <hoplite_gpu.node.Node.reduce>`: ``node.get`` of
        the id is the exact sum of all ``n`` partition gradients once enough messages arrived.
        The directory chooses the weights when the ``(n - s)``-th message is chosen (any
        ``n - s`` workers decode); until then the tree's vertices already stream the messages
        that arrived. A worker that dies or never sends is left out like a late one.

        Args:
            node: The node that asks (usually the parameter server's).
            ids_by_worker: Each worker's coded message (worker index -> ObjectID); messages may
                be put after this call.
            timeout: Seconds to wait for ``n - s`` of them (None: the node's default).
            result_id: Id of the result.

        Raises:
            NotDecodableError: fewer than ``n - s`` workers given.
            InvalidArgumentError: a worker index out of range, or ids that are not ObjectIDs.
        """
        workers = sorted(ids_by_worker)
        for worker in workers:
            self._check_worker(worker)
            if not isinstance(ids_by_worker[worker], ObjectID):
                raise InvalidArgumentError(
                    f"worker {worker}'s id is a {type(ids_by_worker[worker]).__name__}, not an ObjectID",
                    argument="ids_by_worker",
                )
        needed = self.n - self.stragglers
        if len(workers) < needed:
            raise NotDecodableError(
                f"{self.name}: {len(workers)} workers given, any {needed} distinct ones are needed",
                workers=workers,
                needed=needed,
            )
        return node.reduce(  # type: ignore[no-any-return]
            [ids_by_worker[w] for w in workers],
            num_objects=needed,
            reduction_id=result_id,
            timeout=timeout,
            coding=self.matrix[workers],
        )

    def reduce_detailed(
        self,
        node: Any,
        ids_by_worker: Mapping[int, ObjectID],
        timeout: float | None = None,
        result_id: ObjectID | None = None,
    ) -> Decoded:
        """:meth:`reduce`, then wait until its inputs are chosen and say which workers' messages
        it uses and with what weights (those the directory computed)."""
        rid = self.reduce(node, ids_by_worker, timeout, result_id)
        worker_of = {oid: w for w, oid in ids_by_worker.items()}
        workers = [worker_of[oid] for oid in node.reduced_objects(rid, timeout=timeout)]
        weights, _ = solve_decoding(self.matrix[workers])
        return Decoded(rid, workers, [float(w) for w in weights])

    def __repr__(self) -> str:
        return f"<GradientCode {self.name}>"

    def _check_worker(self, worker: int) -> int:
        if isinstance(worker, bool) or not isinstance(worker, (int, np.integer)) or not 0 <= worker < self.n:
            raise InvalidArgumentError(f"worker {worker!r} is not in 0..{self.n - 1}", argument="worker")
        return int(worker)


@dataclass(frozen=True)
class Decoded:
    """What :meth:`GradientCode.reduce_detailed` did.

    Attributes:
        object_id: Where the full gradient is.
        workers: The workers whose messages were used, in arrival order.
        weights: Their decoding weights, in the same order.
    """

    object_id: ObjectID
    workers: list[int]
    weights: list[float]


# ---------------------------------------------------------------- helpers
def _check_counts(n: int, s: int) -> None:
    for name, value in (("n", n), ("s", s)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise InvalidArgumentError(f"{name} must be an integer; got {value!r}", argument=name)
    if n < 1 or not 0 <= s < n:
        raise InvalidArgumentError(f"a code needs n >= 1 and 0 <= s < n; got n={n}, s={s}", argument="s")


def _check_same_float(arrays: list[np.ndarray[Any, Any]], argument: str) -> None:
    first = arrays[0]
    if not np.issubdtype(first.dtype, np.floating):
        raise InvalidArgumentError(
            f"gradient coding needs float arrays; got {first.dtype}", argument=argument
        )
    for a in arrays[1:]:
        if a.dtype != first.dtype or a.shape != first.shape:
            raise InvalidArgumentError(
                f"arrays differ: {first.dtype}{list(first.shape)} and {a.dtype}{list(a.shape)}",
                argument=argument,
            )


def solve_decoding(rows: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], float]:
    """Least-norm ``a`` with ``a @ rows ~= 1``, and how far ``a @ rows`` is from the all-ones row
    (the largest absolute difference)."""
    ones = np.ones(rows.shape[1])
    weights, *_ = np.linalg.lstsq(rows.T, ones, rcond=None)
    return weights, float(np.max(np.abs(weights @ rows - ones)))


def _worst_case(b: np.ndarray[Any, Any], size: int, sample: int | None = None) -> tuple[float, float]:
    """Over the sets of ``size`` workers (all, or ``sample`` random ones): the worst decoding
    residual, and the largest sum of absolute weights (how much a decoding can amplify the float
    rounding of the messages)."""
    n = b.shape[0]
    if sample is None:
        sets: Any = itertools.combinations(range(n), size)
    else:
        rng = np.random.default_rng(12345)
        sets = (sorted(rng.choice(n, size, replace=False)) for _ in range(sample))
    residual = amplification = 0.0
    for chosen in sets:
        weights, off = solve_decoding(b[list(chosen)])
        residual = max(residual, off)
        amplification = max(amplification, float(np.abs(weights).sum()))
    return residual, amplification


def _cyclic_matrix(n: int, s: int, rng: np.random.Generator) -> np.ndarray[Any, Any] | None:
    """Tandon et al.'s Algorithm 2: rows with cyclic supports of ``s + 1`` in the null space of a
    random ``H`` (``s x n``, ``H @ 1 = 0``). None when a draw is singular."""
    h = rng.standard_normal((s, n))
    h[:, -1] = -h[:, :-1].sum(axis=1)  # H @ 1 = 0: the all-ones row is in its null space
    b = np.zeros((n, n))
    for i in range(n):
        support = [(i + k) % n for k in range(s + 1)]
        b[i, support[0]] = 1.0
        rest = h[:, support[1:]]
        if abs(np.linalg.det(rest)) < 1e-12:
            return None
        b[i, support[1:]] = np.linalg.solve(rest, -h[:, support[0]])
    return b
