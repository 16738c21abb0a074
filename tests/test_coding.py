"""Gradient codes (issue 20): any decodable arrival set gives back the exact sum of every partition
gradient; sets that cannot decode are refused with a clear error. The partial-straggler protocol
(PartialCode): the first arrivals of pieces that cover every partition decode, whatever the order."""

from __future__ import annotations

import itertools
from functools import cache
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hoplite_gpu as hg
from hoplite_gpu.coding import DecodeTracker, GradientCode, PartialCode

pytestmark = pytest.mark.timeout(120)


@cache
def _code(kind: str, n: int, s: int) -> GradientCode:
    if kind == "fractional":
        return GradientCode.fractional_repetition(n, s)
    return GradientCode.cyclic(n, s)


@st.composite
def _codes(draw: st.DrawFn) -> GradientCode:
    kind = draw(st.sampled_from(["fractional", "cyclic"]))
    n = draw(st.integers(1, 10))
    if kind == "fractional":
        s = draw(st.sampled_from([d - 1 for d in range(1, n + 1) if n % d == 0]))
    else:
        s = draw(st.integers(0, n - 1))
    return _code(kind, n, s)


def _grads(n: int, dtype: Any, seed: int, size: int = 257) -> dict[int, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return {j: rng.standard_normal(size).astype(dtype) for j in range(n)}


def _messages(code: GradientCode, grads: dict[int, np.ndarray[Any, Any]]) -> dict[int, np.ndarray[Any, Any]]:
    return {w: code.encode(w, {j: grads[j] for j in code.partitions(w)}) for w in range(code.n)}


def _relative_error(got: np.ndarray[Any, Any], grads: dict[int, np.ndarray[Any, Any]]) -> float:
    full = sum(g.astype(np.float64) for g in grads.values())
    assert isinstance(full, np.ndarray)
    return float(np.abs(got.astype(np.float64) - full).max() / np.abs(full).max())


def _tolerance(code: GradientCode, arrived: list[int], dtype: Any) -> float:
    """The relative error a decode may have: each worker's message is rounded to ``dtype`` (an
    error of the order of its coefficients' sum), then weighted by the decoding weights, which an
    ill-conditioned arrival set makes large (CI once saw 1.3e-5 for float32, cyclic n=10 s=5)."""
    weights = np.abs(np.asarray(code.decoding_weights(arrived)))
    rows = np.abs(code.matrix[list(arrived)]).sum(axis=1)
    amplification = float(weights @ rows)
    return max(1e-5 if dtype == np.float32 else 1e-12, 4 * float(np.finfo(dtype).eps) * amplification)


@settings(max_examples=300, deadline=None)
@given(code=_codes(), data=st.data(), dtype=st.sampled_from([np.float32, np.float64]))
def test_any_n_minus_s_workers_decode_the_exact_full_gradient(
    code: GradientCode, data: Any, dtype: Any
) -> None:
    how_many = data.draw(st.integers(code.n - code.stragglers, code.n))
    arrived = data.draw(st.permutations(range(code.n)))[:how_many]
    grads = _grads(code.n, dtype, seed=data.draw(st.integers(0, 2**32 - 1)))
    messages = _messages(code, grads)
    got = code.decode({w: messages[w] for w in arrived})
    assert got.dtype == dtype
    tolerance = _tolerance(code, arrived, dtype)
    assert _relative_error(got, grads) <= tolerance
    # The weights are those of decoding_weights, in the order asked for.
    weights = code.decoding_weights(arrived)
    again = sum(np.float64(w) * messages[v].astype(np.float64) for v, w in zip(arrived, weights, strict=True))
    assert _relative_error(np.asarray(again), grads) <= tolerance


@pytest.mark.parametrize(
    ("kind", "n", "s"), [("cyclic", 8, 2), ("cyclic", 7, 3), ("fractional", 8, 1), ("fractional", 9, 2)]
)
def test_every_arrival_set_decodes_and_smaller_ones_need_a_full_cover(kind: str, n: int, s: int) -> None:
    code = _code(kind, n, s)
    grads = _grads(n, np.float32, seed=n * 10 + s)
    messages = _messages(code, grads)
    for arrived in itertools.combinations(range(n), n - s):  # every one of them
        assert _relative_error(code.decode({w: messages[w] for w in arrived}), grads) <= 1e-5
    for arrived in itertools.combinations(range(n), n - s - 1):
        # A cyclic code needs n - s; a fractional repetition code one worker of every group.
        groups = {w // (s + 1) for w in arrived}
        expected = kind == "fractional" and len(groups) == n // (s + 1)
        assert code.is_decodable(arrived) == expected, arrived
        if not expected:
            with pytest.raises(hg.NotDecodableError, match=f"any {n - s} distinct workers") as info:
                code.decoding_weights(arrived)
            assert info.value.needed == n - s and info.value.workers == sorted(arrived)


def test_each_worker_computes_s_plus_1_partitions_in_its_order() -> None:
    cyclic = GradientCode.cyclic(8, 2)
    assert [cyclic.partitions(w) for w in (0, 6, 7)] == [[0, 1, 2], [6, 7, 0], [7, 0, 1]]
    fr = GradientCode.fractional_repetition(6, 2)
    # Each member of a group starts at a different partition of the group (for PartialCode).
    assert [fr.partitions(w) for w in range(6)] == [
        [0, 1, 2],
        [1, 2, 0],
        [2, 0, 1],
        [3, 4, 5],
        [4, 5, 3],
        [5, 3, 4],
    ]
    # A fractional repetition message is the plain sum, and its weights are exact 0/1.
    assert fr.decoding_weights([0, 5]) == [1.0, 1.0]
    assert fr.decoding_weights([4, 1, 3, 2]) == [1.0, 1.0, 0.0, 0.0]  # the first of each group
    grads = {j: np.full(4, float(j), np.float32) for j in (0, 1, 2)}
    assert np.array_equal(fr.encode(1, grads), np.full(4, 3.0, np.float32))
    # The same seed gives the same code.
    assert np.array_equal(GradientCode.cyclic(8, 2, seed=3).matrix, GradientCode.cyclic(8, 2, seed=3).matrix)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: GradientCode.fractional_repetition(8, 2), "divide"),
        (lambda: GradientCode.cyclic(4, 4), "0 <= s < n"),
        (lambda: GradientCode.cyclic(0, 0), "n >= 1"),
        (lambda: GradientCode.cyclic(4.0, 1), "integer"),  # type: ignore[arg-type]
        (lambda: GradientCode(np.ones((2, 3)), 0), "n x n"),
        (lambda: GradientCode(np.eye(3), 1), "cannot decode"),
        (lambda: GradientCode.cyclic(6, 2).partitions(6), "not in 0..5"),
        (lambda: GradientCode.cyclic(6, 2).decoding_weights([0, 1, 1, 2]), "twice"),
        (lambda: GradientCode.cyclic(6, 2).encode(0, {0: np.zeros(2)}), "computes partitions"),
        (lambda: GradientCode.cyclic(6, 1).encode(0, {0: np.zeros(2), 1: np.zeros(3)}), "differ"),
        (lambda: GradientCode.cyclic(6, 1).encode(0, {0: np.zeros(2, int), 1: np.zeros(2, int)}), "float"),
    ],
)
def test_bad_arguments_raise_invalid_argument(call: Any, match: str) -> None:
    with pytest.raises(hg.InvalidArgumentError, match=match):
        call()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_reduce_decodes_in_the_tree_the_first_sets_to_arrive_with_workers_killed(owner: Any) -> None:
    """Six worker processes, a cyclic code tolerating two stragglers (any four decode): worker 0
    is SIGKILLed after its put (its only copy goes with it) and worker 1 never sends. With only
    workers 2 and 3 in, the reduction times out; once 4 and 5 are in (put after the reduce was
    asked for), the tree decodes the exact full gradient from 2, 3, 4 and 5."""
    from tests.procs import start_workers

    n, s = 6, 2
    code = GradientCode.cyclic(n, s)
    grads = _grads(n, np.float32, seed=11, size=300_000)  # 1.2 MB each: streamed, not inline
    messages = _messages(code, grads)
    ids = {w: hg.ObjectID.random() for w in range(n)}
    workers = start_workers(owner.directory_address, owner.token, n, shared_memory=False)
    try:
        workers[0].call("put_array", messages[0], ids[0].hex())
        workers[0].kill()  # its message dies with it
        for w in (2, 3):
            workers[w].call("put_array", messages[w], ids[w].hex())
        early = code.reduce(owner, ids, timeout=2.0)
        with pytest.raises(
            hg.HopliteTimeoutError, match=r"the 2 of its 6 inputs that became ready .* do not decode"
        ):
            owner.get(early, timeout=30)
        rid = code.reduce(owner, ids, timeout=60.0)  # before 4 and 5 are there
        for w in (4, 5):
            workers[w].call("put_array", messages[w], ids[w].hex())
        got = owner.get(rid, timeout=60)
        assert _relative_error(got, grads) <= 1e-5
        assert sorted(owner.reduced_objects(rid, timeout=10)) == sorted(ids[w] for w in (2, 3, 4, 5))
        # The same, saying which workers and weights the directory chose.
        done = code.reduce_detailed(owner, ids, timeout=60.0)
        assert sorted(done.workers) == [2, 3, 4, 5]
        assert done.weights == pytest.approx(code.decoding_weights(done.workers), abs=1e-9)
        assert _relative_error(owner.get(done.object_id, timeout=60), grads) <= 1e-5
    finally:
        for w in workers:
            w.stop()


def test_a_decoded_reduce_of_inputs_that_cannot_decode_fails_with_not_decodable(owner: Any) -> None:
    """Rows that cannot sum to all ones (two identity rows of three): the directory fails the
    reduction once both are chosen (``num_objects``) or once both arrived (decoding as they
    arrive), and a get says why."""
    a, b = (owner.put(np.full(8, float(i), np.float32)) for i in (1, 2))
    rows = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    rid = owner.reduce([a, b], num_objects=2, coding=rows, timeout=10)
    with pytest.raises(hg.NotDecodableError, match=r"first 2 inputs .* do not decode"):
        owner.get(rid, timeout=10)
    rid = owner.reduce([a, b], coding=rows, timeout=10)
    with pytest.raises(hg.NotDecodableError, match=r"all 2 inputs .* arrived .* span 2 of 3 dimensions"):
        owner.get(rid, timeout=10)
    with pytest.raises(hg.InvalidArgumentError, match="one row per object id"):
        owner.reduce([a, b], coding=[[1.0, 0.0]])
    with pytest.raises(hg.InvalidArgumentError, match="not both"):
        owner.reduce([a, b], coding=[[1.0], [1.0]], weights=[1.0, 1.0])
    with pytest.raises(hg.NotDecodableError, match="any 3 distinct"):
        GradientCode.cyclic(4, 1).reduce(owner, {0: a, 1: b})


def test_reduce_refuses_ids_that_are_not_object_ids(owner: Any) -> None:
    code = GradientCode.cyclic(4, 1)
    with pytest.raises(hg.InvalidArgumentError, match="not an ObjectID"):
        code.reduce(owner, {0: "abc"})  # type: ignore[dict-item]
    with pytest.raises(hg.InvalidArgumentError, match=r"not in 0\.\.3"):
        code.reduce(owner, {7: hg.ObjectID.random()})


# ---------------------------------------------------------------- partial stragglers
@settings(max_examples=300, deadline=None)
@given(code=_codes(), data=st.data(), dtype=st.sampled_from([np.float32, np.float64]))
def test_pieces_decode_exactly_as_soon_as_every_partition_arrived(
    code: GradientCode, data: Any, dtype: Any
) -> None:
    """Any arrival order of every piece: the prefixes decode exactly when they cover every
    partition (the paper's condition), the shortest such prefix decodes to the full sum, and it
    uses the first piece of each partition with weight 1 (exact in any float type)."""
    partial = PartialCode(code)
    order = data.draw(st.permutations(partial.pieces()))
    grads = _grads(code.n, dtype, seed=data.draw(st.integers(0, 2**16)))
    covered: set[int] = set()
    for end in range(1, len(order) + 1):
        covered.add(partial.partitions(order[end - 1][0])[order[end - 1][1]])
        assert partial.is_decodable(order[:end]) == (len(covered) == code.n)
        if len(covered) == code.n:
            break
    prefix = order[:end]
    messages = {pc: partial.encode_piece(*pc, grads[partial.partitions(pc[0])[pc[1]]]) for pc in prefix}
    weights = partial.decoding_weights(prefix)
    first = {}
    for pc in prefix:
        first.setdefault(partial.partitions(pc[0])[pc[1]], pc)
    assert weights == [1.0 if first[partial.partitions(pc[0])[pc[1]]] == pc else 0.0 for pc in prefix]
    assert _relative_error(partial.decode(messages), grads) <= (1e-5 if dtype == np.float32 else 1e-12)


def test_with_no_straggler_the_first_piece_of_every_worker_decodes() -> None:
    """The processing orders start every worker at a different partition (cyclic: its own;
    fractional repetition: each member of a group at another of the group's)."""
    for code in (GradientCode.cyclic(8, 2), GradientCode.fractional_repetition(6, 2)):
        partial = PartialCode(code)
        firsts = [(w, 0) for w in range(code.n)]
        assert partial.is_decodable(firsts) and not partial.is_decodable(firsts[1:])


@pytest.mark.parametrize("kind,n,s", [("cyclic", 7, 3), ("fractional", 8, 3), ("cyclic", 5, 1)])
def test_a_decode_tracker_agrees_with_the_codes_own_check_on_every_prefix(kind: str, n: int, s: int) -> None:
    """Workers' coded messages arriving in a random order: the tracker says decodable for
    exactly the prefixes the code decodes, and its weights reproduce the all-ones row."""
    code = _code(kind, n, s)
    rng = np.random.default_rng(7)
    for _ in range(20):
        order = [int(w) for w in rng.permutation(n)]
        tracker = DecodeTracker(n)
        for end, w in enumerate(order, 1):
            assert tracker.add(w, code.matrix[w]) == code.is_decodable(order[:end])
        used, weights = tracker.solution()
        assert np.allclose(np.array(weights) @ code.matrix[used], 1.0, atol=1e-9)
    # A key offered again (another copy of the same input) is not counted twice.
    tracker = DecodeTracker(n)
    tracker.add("a", code.matrix[0])
    tracker.add("a", code.matrix[0])
    assert tracker.seen == 1 and tracker.keys == ["a"]


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: PartialCode("cyclic"), "a GradientCode is needed"),  # type: ignore[arg-type]
        (lambda: PartialCode(GradientCode.cyclic(4, 1)).piece_row(0, 2), r"pieces 0\.\.1"),
        (lambda: PartialCode(GradientCode.cyclic(4, 1)).piece_row(4, 0), r"not in 0\.\.3"),
        (lambda: PartialCode(GradientCode.cyclic(4, 1)).decoding_weights([(0, 0), (0, 0)]), "twice"),
        (
            lambda: PartialCode(GradientCode.cyclic(4, 1)).decoding_weights([(0, 0), (1, 0)]),
            r"partitions \[2, 3\]",
        ),
        (lambda: PartialCode(GradientCode.cyclic(4, 1)).encode_piece(0, 0, np.arange(3)), "float arrays"),
        (lambda: PartialCode(GradientCode.cyclic(4, 1)).is_decodable([(0, True)]), "ints"),
        (lambda: DecodeTracker(0), "width >= 1"),
        (lambda: DecodeTracker(2).add("a", [1.0, float("nan")]), "finite"),
        (lambda: DecodeTracker(2).solution(), "do not combine"),
    ],
)
def test_partial_code_bad_arguments_raise_invalid_argument(call: Any, match: str) -> None:
    with pytest.raises(hg.InvalidArgumentError, match=match):
        call()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_partial_pieces_decode_in_the_tree_with_a_straggler_killed_and_one_half_done(owner: Any) -> None:
    """Six worker processes on a cyclic code tolerating two stragglers, pieces put after the
    reduction was asked for. Worker 0 puts its first piece and is SIGKILLed (the piece dies
    with it); worker 3 is a partial straggler that only finishes its first partition; the
    others finish theirs in order until every partition is covered. The tree decodes the exact
    full gradient, uses one piece per partition, and says which."""
    from tests.procs import start_workers

    n, s = 6, 2
    partial = PartialCode(GradientCode.cyclic(n, s))
    grads = _grads(n, np.float32, seed=5, size=300_000)  # 1.2 MB each: streamed, not inline
    ids = {pc: hg.ObjectID.random() for pc in partial.pieces()}
    workers = start_workers(owner.directory_address, owner.token, n, shared_memory=False)

    def send(w: int, index: int) -> None:
        piece = partial.encode_piece(w, index, grads[partial.partitions(w)[index]])
        workers[w].call("put_array", piece, ids[(w, index)].hex())

    try:
        rid = partial.reduce(owner, ids, timeout=60.0)
        send(0, 0)  # partition 0
        workers[0].kill()
        send(3, 0)  # partition 3; worker 3 then stalls
        for w in (1, 2, 4, 5):
            send(w, 0)  # partitions 1, 2, 4, 5: everything but 0 (its piece died)
        send(5, 1)  # partition 0 again, from worker 5's second partition
        got = owner.get(rid, timeout=60)
        assert _relative_error(got, grads) <= 1e-5
        used = [
            next(pc for pc, o in ids.items() if o == oid) for oid in owner.reduced_objects(rid, timeout=10)
        ]
        assert sorted(partial.partitions(w)[i] for w, i in used) == list(range(n))
        assert (5, 1) in used and (3, 0) in used and (0, 0) not in used
        # reduce_detailed reports the same pieces (all present now, so the first of each partition).
        fresh = {pc: oid for pc, oid in ids.items() if pc[0] != 0}
        done = partial.reduce_detailed(owner, fresh, timeout=60.0)
        assert sorted(partial.partitions(w)[i] for w, i in done.pieces) == list(range(n))
        assert done.weights == [1.0] * n
        assert _relative_error(owner.get(done.object_id, timeout=60), grads) <= 1e-5
    finally:
        for w in workers:
            w.stop()
