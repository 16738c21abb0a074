"""The gradient codes: :class:`GradientCode` (Tandon et al.'s fractional repetition and cyclic
codes) and :class:`PartialCode` (the partial-straggler protocol on a code's assignment), with what
their ``reduce_detailed`` report (:class:`Decoded`, :class:`PartialDecoded`).

:mod:`hoplite_gpu.coding` explains the method; the decoding math is in
:mod:`hoplite_gpu.coding.decoding`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, NotDecodableError
from ..object_id import ObjectID
from ..reduce_ops import weighted_sum_chunk
from .decoding import DECODE_TOLERANCE, DecodeTracker, _worst_case, solve_decoding

#: Largest ``n`` for which :meth:`GradientCode.cyclic` checks the conditioning of every arrival
#: set of ``n - s`` workers when it chooses ``H`` (C(16, 8) = 12,870 solves at most).
EXHAUSTIVE_CHECK_MAX_N = 16


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
        # Within a group, member t starts at the group's t-th partition: the members work on
        # different partitions first, which is what a partial-straggler decode (PartialCode) needs.
        order = [
            [(worker // (s + 1)) * (s + 1) + (worker % (s + 1) + k) % (s + 1) for k in range(s + 1)]
            for worker in range(n)
        ]
        code = cls(b, s, name=f"fractional repetition (n={n}, s={s})", order=order)
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
        return _weighted_sum(self.decoding_weights(workers), [messages[w] for w in workers])

    # ------------------------------------------------------------ over hoplite
    def reduce(
        self,
        node: Any,
        ids_by_worker: Mapping[int, ObjectID],
        timeout: float | None = None,
        result_id: ObjectID | None = None,
    ) -> ObjectID:
        """Decode inside hoplite's reduce tree: the first messages to arrive that decode (any
        ``n - s``; for a fractional repetition code one of each group is enough), weighted by
        their decoding weights, summed into ``result_id`` (a fresh id by default).

        Returns at once, like :meth:`Node.reduce <hoplite_gpu.node.Node.reduce>`: ``node.get`` of
        the id is the exact sum of all ``n`` partition gradients once enough messages arrived.
        The directory adds each message's encoding row as it arrives and, once they decode,
        reduces those with a weight that is not 0 (``coding`` without ``num_objects``). A worker
        that dies or never sends is left out like a late one.

        Args:
            node: The node that asks (usually the parameter server's).
            ids_by_worker: Each worker's coded message (worker index -> ObjectID); messages may
                be put after this call.
            timeout: Seconds to wait for ``n - s`` of them (None: the node's default).
            result_id: Id of the result.

        Raises:
            NotDecodableError: the workers given cannot decode even if all of them send.
            InvalidArgumentError: a worker index out of range, or ids that are not ObjectIDs.
        """
        workers = sorted(ids_by_worker)
        for worker in workers:
            self._check_worker(worker)
            _check_object_id(ids_by_worker[worker], f"worker {worker}'s id", "ids_by_worker")
        self.decoding_weights(workers)  # NotDecodableError now rather than after every send
        return node.reduce(  # type: ignore[no-any-return]
            [ids_by_worker[w] for w in workers],
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


class PartialCode:
    """The partial-straggler protocol on a gradient code's assignment: every finished partition
    counts, including those of slow workers.

    After Ramamoorthy, Meng and Girimaji, "Leveraging partial stragglers within gradient coding"
    (NeurIPS 2024, arXiv 2405.19509): a worker computes its partitions one after another, in the
    order :meth:`partitions` gives, and sends a piece as soon as each is done; the parameter
    server decodes as soon as the pieces that arrived suffice. A plain gradient code waits for
    whole workers, each having computed all ``s + 1`` of its partitions; here the partitions a
    slow worker finished before the others are used, and no worker's last partitions are waited
    for when others covered them.

    What is ours: a piece is the gradient of the one partition just finished (its encoding row is
    that partition's unit row). The paper encodes the pieces so that one parameter server's
    ingress stays small; hoplite's reduce tree already keeps the root's ingress at one gradient
    whatever the number of inputs, so the pieces need no coding, and decoding weights are 0 or 1:
    exact in any float type. The decodability check is the general one (the all-ones row in the
    span of the arrived pieces' rows, :class:`DecodeTracker`), which for these rows says: every
    partition computed by some worker. The processing orders are the code's (:meth:`GradientCode.
    partitions`): worker ``i`` of a cyclic code starts at partition ``i``, each member of a
    fractional repetition group at a different partition of the group, so that with no straggler
    the first piece of every worker already decodes.

        partial = PartialCode(GradientCode.cyclic(8, 2))
        for index, j in enumerate(partial.partitions(worker)):       # on each worker
            node.put(partial.encode_piece(worker, index, grad_of(j)), ids[worker, index])
        full = ps_node.get(partial.reduce(ps_node, ids))             # on the parameter server

    Args:
        code: The assignment (which partitions each worker computes, in which order).
    """

    def __init__(self, code: GradientCode) -> None:
        if not isinstance(code, GradientCode):
            raise InvalidArgumentError(
                f"a GradientCode is needed; got {type(code).__name__}", argument="code"
            )
        self.code = code
        self.n = code.n
        self.stragglers = code.stragglers
        self.name = f"partial {code.name}"

    def partitions(self, worker: int) -> list[int]:
        """``worker``'s partitions in the order it computes them; piece ``index`` is the
        ``index``-th of them."""
        return self.code.partitions(worker)

    def pieces(self) -> list[tuple[int, int]]:
        """Every ``(worker, index)`` piece of the assignment, worker by worker."""
        return [(w, i) for w in range(self.n) for i in range(len(self.code.partitions(w)))]

    def piece_row(self, worker: int, index: int) -> np.ndarray[Any, Any]:
        """The encoding row of piece ``(worker, index)`` over the ``n`` partitions."""
        row = np.zeros(self.n)
        row[self._partition(worker, index)] = 1.0
        return row

    def encode_piece(self, worker: int, index: int, grad: Any) -> np.ndarray[Any, Any]:
        """The piece ``worker`` sends when it has computed the gradient of its ``index``-th
        partition (:meth:`partitions`): that gradient itself (checked to be a float array).

        Raises:
            InvalidArgumentError: ``worker`` or ``index`` out of range, or not a float array.
        """
        self._partition(worker, index)
        array = np.asarray(grad)
        _check_same_float([array], "grad")
        return array

    def decoding_weights(self, pieces: Sequence[tuple[int, int]]) -> list[float]:
        """Weights, one per piece in ``pieces``' order (the order they arrived in), whose
        weighted sum of those pieces is the full gradient: 1 for the first piece of each
        partition, 0 for later ones.

        Raises:
            NotDecodableError: some partition has no piece among them; wait for more.
            InvalidArgumentError: a piece out of range or given twice.
        """
        tracker = self._tracker(pieces)
        if not tracker.decodable:
            missing = sorted(set(range(self.n)) - {self._partition(*pc) for pc in pieces})
            raise NotDecodableError(
                f"{self.name}: no piece of partitions {missing} among the {len(pieces)} given",
                workers=sorted({w for w, _ in pieces}),
                needed=self.n,
            )
        used, weights = tracker.solution()
        by_piece = dict(zip(used, weights, strict=True))
        return [by_piece.get((int(w), int(i)), 0.0) for w, i in pieces]

    def is_decodable(self, pieces: Sequence[tuple[int, int]]) -> bool:
        """Whether these pieces determine the full gradient (every partition among them)."""
        return self._tracker(pieces).decodable

    def decode(self, messages: Mapping[tuple[int, int], Any]) -> np.ndarray[Any, Any]:
        """The full gradient from pieces (``(worker, index)`` -> array) on this process, the
        mapping's order taken as the arrival order."""
        pieces = list(messages)
        return _weighted_sum(self.decoding_weights(pieces), [messages[pc] for pc in pieces])

    def reduce(
        self,
        node: Any,
        ids_by_piece: Mapping[tuple[int, int], ObjectID],
        timeout: float | None = None,
        result_id: ObjectID | None = None,
    ) -> ObjectID:
        """Decode inside hoplite's reduce tree as the pieces arrive; returns at once with the id
        whose ``node.get`` is the full gradient.

        The directory adds each piece's row as the piece becomes ready and, once every partition
        has one, reduces the first piece of each (``coding`` without ``num_objects`` in
        :meth:`Node.reduce <hoplite_gpu.node.Node.reduce>`); pieces after that are not read. A
        worker that dies loses only the pieces nobody used yet: the tree is rebuilt from the
        pieces still held.

        Args:
            node: The node that asks (the parameter server's).
            ids_by_piece: ``(worker, index)`` -> the id that piece is put under (pieces may be put
                after this call; list every piece that may come).
            timeout: Seconds to wait for a decodable set (None: the node's default).
            result_id: Id of the result.

        Raises:
            NotDecodableError: even all the pieces listed would not cover every partition.
            InvalidArgumentError: a piece out of range, or ids that are not ObjectIDs.
        """
        pieces = list(ids_by_piece)
        for pc in pieces:
            _check_object_id(ids_by_piece[pc], f"piece {pc}'s id", "ids_by_piece")
        self.decoding_weights(pieces)  # every partition among them, or NotDecodableError now
        return node.reduce(  # type: ignore[no-any-return]
            [ids_by_piece[pc] for pc in pieces],
            reduction_id=result_id,
            timeout=timeout,
            coding=np.array([self.piece_row(*pc) for pc in pieces]),
        )

    def reduce_detailed(
        self,
        node: Any,
        ids_by_piece: Mapping[tuple[int, int], ObjectID],
        timeout: float | None = None,
        result_id: ObjectID | None = None,
    ) -> PartialDecoded:
        """:meth:`reduce`, then wait until the pieces are chosen and report which were used
        (and with what weights)."""
        rid = self.reduce(node, ids_by_piece, timeout, result_id)
        piece_of = {oid: pc for pc, oid in ids_by_piece.items()}
        used = [piece_of[oid] for oid in node.reduced_objects(rid, timeout=timeout)]
        return PartialDecoded(rid, used, self.decoding_weights(used))

    def __repr__(self) -> str:
        return f"<PartialCode {self.name}>"

    def _partition(self, worker: Any, index: Any) -> int:
        order = self.code.partitions(worker)  # checks the worker
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < len(order):
            raise InvalidArgumentError(
                f"worker {worker} has pieces 0..{len(order) - 1}; got index {index!r}", argument="index"
            )
        return order[int(index)]

    def _tracker(self, pieces: Sequence[tuple[int, int]]) -> DecodeTracker:
        tracker = DecodeTracker(self.n)
        seen: set[tuple[int, int]] = set()
        for pc in pieces:
            if not isinstance(pc, tuple) or len(pc) != 2:
                raise InvalidArgumentError(f"a piece is (worker, index); got {pc!r}", argument="pieces")
            key = (int(self._check_int(pc[0])), int(self._check_int(pc[1])))
            if key in seen:
                raise InvalidArgumentError(f"piece {key} is given twice", argument="pieces")
            seen.add(key)
            tracker.add(key, self.piece_row(*key))
        return tracker

    @staticmethod
    def _check_int(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise InvalidArgumentError(
                f"a piece's worker and index are ints; got {value!r}", argument="pieces"
            )
        return int(value)


@dataclass(frozen=True)
class PartialDecoded:
    """What :meth:`PartialCode.reduce_detailed` did.

    Attributes:
        object_id: Where the full gradient is.
        pieces: The ``(worker, index)`` pieces used, in arrival order (one per partition).
        weights: Their weights, in the same order (1.0 each).
    """

    object_id: ObjectID
    pieces: list[tuple[int, int]]
    weights: list[float]


# ---------------------------------------------------------------- helpers
def _weighted_sum(weights: list[float], messages: list[Any]) -> np.ndarray[Any, Any]:
    """``sum_i weights[i] * messages[i]`` in the messages' float dtype; messages of weight 0 (a
    fractional repetition group's other members, a partition's later pieces) are left out."""
    arrays = [np.asarray(m) for m in messages]
    _check_same_float(arrays, "messages")
    used = [(w, a) for w, a in zip(weights, arrays, strict=True) if w]
    out = np.empty_like(arrays[0])
    weighted_sum_chunk(used[0][1], [a for _, a in used[1:]], out, [w for w, _ in used])
    return out


def _check_object_id(value: Any, what: str, argument: str) -> None:
    if not isinstance(value, ObjectID):
        raise InvalidArgumentError(f"{what} is a {type(value).__name__}, not an ObjectID", argument=argument)


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
