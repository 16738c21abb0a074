"""The decoding math of gradient coding, pure NumPy: whether encoding rows combine into the all-ones
row, and with which weights (:func:`solve_decoding`, :class:`DecodeTracker`).

The directory runs it for reductions that decode as their inputs arrive, so it imports nothing of
the node side: NumPy and :mod:`hoplite_gpu.errors` only. The codes built on it are in
:mod:`hoplite_gpu.coding.codes`.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, NotDecodableError

#: A decoding whose weights reproduce the all-ones row worse than this (relative) is refused.
DECODE_TOLERANCE = 1e-9
#: A row whose part outside the span of the rows before it is smaller than this (relative to its
#: norm) adds nothing to a :class:`DecodeTracker`.
_RANK_TOLERANCE = 1e-9


def solve_decoding(rows: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], float]:
    """Least-norm ``a`` with ``a @ rows ~= 1``, and how far ``a @ rows`` is from the all-ones row
    (the largest absolute difference)."""
    ones = np.ones(rows.shape[1])
    weights, *_ = np.linalg.lstsq(rows.T, ones, rcond=None)
    return weights, float(np.max(np.abs(weights @ rows - ones)))


class DecodeTracker:
    """Decodability of encoding rows checked as they arrive, one at a time (pure; the directory
    runs one per reduction that decodes as inputs arrive, :class:`PartialCode` one per check).

    The rows that add to the span of the rows before them are kept, in arrival order, with an
    orthonormal basis of that span; the arrivals decode once the all-ones row lies in it. A row
    that adds nothing (a second copy of a partition already covered, say) is not used: the
    solution is over the kept rows, which are independent, so their weights are unique and, for
    unit rows, exactly 1.

    Args:
        width: The length of every row (the number of partitions).
    """

    def __init__(self, width: int) -> None:
        if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 1:
            raise InvalidArgumentError(f"rows need a width >= 1; got {width!r}", argument="width")
        self.width = int(width)
        self._offered: set[Any] = set()
        self.keys: list[Any] = []  #: the kept rows' keys, in arrival order
        self._rows: list[np.ndarray[Any, Any]] = []
        self._basis = np.zeros((0, self.width))  # orthonormal rows spanning the kept rows
        self._residual = float(np.sqrt(self.width))  # distance of the all-ones row from that span

    def add(self, key: Any, row: Any) -> bool:
        """Offer the row that ``key`` (an input, a piece: hashable) arrived with; True once
        decodable. A key offered before is ignored.

        Raises:
            InvalidArgumentError: a row of another width, or not finite.
        """
        r = np.asarray(row, dtype=np.float64)
        if r.shape != (self.width,) or not np.all(np.isfinite(r)):
            raise InvalidArgumentError(
                f"a row of {self.width} finite numbers is needed; got shape {r.shape}", argument="row"
            )
        if key in self._offered:
            return self.decodable  # offered again (another copy of an input completed)
        self._offered.add(key)
        if self.decodable:
            return True
        q = self._basis
        rest = r - (r @ q.T) @ q
        rest -= (rest @ q.T) @ q  # twice: Gram-Schmidt keeps its orthogonality in float64
        norm = float(np.linalg.norm(rest))
        if norm <= _RANK_TOLERANCE * max(float(np.linalg.norm(r)), 1e-300):
            return False  # in the span already: adds nothing
        self._basis = np.vstack([q, rest / norm])
        self.keys.append(key)
        self._rows.append(r)
        ones = np.ones(self.width)
        self._residual = float(np.linalg.norm(ones - (ones @ self._basis.T) @ self._basis))
        return self.decodable

    @property
    def seen(self) -> int:
        """Distinct keys offered so far (their rows kept or not)."""
        return len(self._offered)

    @property
    def decodable(self) -> bool:
        """Whether the rows kept so far combine into the all-ones row."""
        return bool(self._residual <= DECODE_TOLERANCE * np.sqrt(self.width))  # not np.bool_

    def solution(self) -> tuple[list[Any], list[float]]:
        """The keys used and their weights (the kept rows with a weight that is not 0), in arrival
        order.

        Raises:
            NotDecodableError: not :attr:`decodable` yet.
        """
        if not self.decodable:
            raise NotDecodableError(
                f"the {self.seen} rows offered span {len(self.keys)} of the {self.width} dimensions "
                "and do not combine into the all-ones row",
                workers=[],
                needed=0,
            )
        weights, _ = solve_decoding(np.array(self._rows))
        scale = float(np.max(np.abs(weights)))
        used = [i for i, w in enumerate(weights) if abs(w) > 1e-12 * scale]
        return [self.keys[i] for i in used], [float(weights[i]) for i in used]


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
