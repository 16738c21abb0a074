"""Pure tests of reduce trees (shape, cost model, arrival-order placement, first-k) and of the host
reduction operators, including a chunk-by-chunk simulation of a whole tree against NumPy."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hoplite_gpu.directory.reduce import (
    LinkEstimate,
    MismatchError,
    ReducePlan,
    TreeShape,
    choose_degree,
    estimated_time,
    tree_height,
    vertex_object_id,
)
from hoplite_gpu.errors import InvalidArgumentError
from hoplite_gpu.reduce_ops import SUPPORTED_DTYPES, ReduceOp, as_op, check_dtype, reduce_chunk

pytestmark = pytest.mark.timeout(120)

RID = b"r" * 20
LAN = LinkEstimate(latency=200e-6, bandwidth=100e6)  # the emulated cluster: 100 MB/s links


def oid(i: int) -> bytes:
    return i.to_bytes(20, "big")


def subtree(tree: TreeShape, v: int) -> list[int]:
    out, stack = [], [v]
    while stack:
        x = stack.pop()
        out.append(x)
        stack.extend(tree.children(x))
    return out


# ---------------------------------------------------------------- shapes
@pytest.mark.parametrize("n", range(1, 65))
def test_shapes_are_trees_whose_inorder_is_a_permutation(n: int) -> None:
    for degree in sorted({1, 2, 3, 4, max(1, n - 1)}):
        tree = TreeShape(n, degree)
        assert sorted(tree.inorder) == list(range(n))
        assert tree.parent(0) is None
        for v in range(1, n):
            p = tree.parent(v)
            assert p is not None and v in tree.children(p)
            assert tree.depth(v) == tree.depth(p) + 1
        assert tree.height == tree_height(n, degree) == max(tree.depth(v) for v in range(n))
        for v in range(n):
            kids = tree.children(v)
            assert len(kids) <= degree
            if kids:  # in-order: first child's subtree, then v, then the other subtrees
                assert max(tree.rank[x] for x in subtree(tree, kids[0])) < tree.rank[v]
                for c in kids[1:]:
                    assert min(tree.rank[x] for x in subtree(tree, c)) > tree.rank[v]


def test_a_chain_of_ten_thousand_needs_no_recursion() -> None:
    tree = TreeShape(10_000, 1)
    assert tree.inorder[0] == 9_999 and tree.inorder[-1] == 0 and tree.height == 9_999


@pytest.mark.parametrize("n", [3, 4, 8, 16, 64])
def test_large_objects_use_chains_and_tiny_ones_flat_trees(n: int) -> None:
    assert choose_degree(n, 256 << 20, LAN)[0] == 1
    degree, reason = choose_degree(n, 1024, LinkEstimate(latency=1e-3, bandwidth=1e9))
    assert degree == n - 1 and f"n={n}" in reason


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(3, 64),
    small=st.integers(1, 1 << 20),
    factor=st.integers(2, 1 << 10),
    latency=st.floats(1e-6, 1e-2),
    bandwidth=st.floats(1e7, 1e11),
)
def test_degree_never_grows_with_size_and_is_optimal(
    n: int, small: int, factor: int, latency: float, bandwidth: float
) -> None:
    link = LinkEstimate(latency, bandwidth)
    d_small, _ = choose_degree(n, small, link)
    d_large, _ = choose_degree(n, small * factor, link)
    assert d_large <= d_small
    best = estimated_time(n, d_small, small, link)
    assert all(best <= estimated_time(n, d, small, link) + 1e-12 for d in range(1, n))


def test_link_estimate_moves_towards_measurements() -> None:
    est = LinkEstimate(latency=1e-3, bandwidth=1e9)
    for _ in range(40):
        est = est.with_transfer(64 << 20, 64e6 / 100e6 + 1e-3)  # 100 MB/s links
        est = est.with_transfer(1024, 200e-6)
    assert abs(est.bandwidth - 100e6) / 100e6 < 0.05
    assert abs(est.latency - 200e-6) < 20e-6
    assert est.with_transfer(0, 1.0) is est


# ---------------------------------------------------------------- placement
def test_arrivals_fill_the_tree_in_order_and_the_root_output_is_the_result() -> None:
    plan = ReducePlan(RID, tuple(oid(i) for i in range(7)), 7)
    order = [5, 2, 6, 0, 1, 3, 4]  # arrival order of the inputs
    placed = [plan.place(oid(i), f"node{i}", 4096, "<f4", (1024,), LAN) for i in order]
    tree = plan.tree
    assert tree is not None and plan.full
    assert [pl.vertex for pl in placed] == tree.inorder
    assert plan.reduced_objects() == [oid(i) for i in order]
    for pl in placed:
        leaf = not tree.children(pl.vertex) and pl.vertex != 0
        assert pl.runs_task is not leaf
        assert pl.output_id == (pl.object_id if leaf else vertex_object_id(RID, pl.vertex))
        assert pl.children == tuple(tree.children(pl.vertex)) and pl.parent == tree.parent(pl.vertex)
        assert plan.child_sources(pl.vertex) == [plan.by_vertex[c].output_id for c in pl.children]
    root = next(pl for pl in placed if pl.vertex == 0)
    assert root.output_id == RID and root.parent is None
    assert len({pl.output_id for pl in placed}) == 7
    assert {pl.vertex for pl in plan.intermediates()} == {v for v in range(1, 7) if tree.children(v)}


def test_children_not_placed_yet_have_no_source() -> None:
    plan = ReducePlan(RID, tuple(oid(i) for i in range(7)), 7)
    for i in range(3):  # in-order: leaf 3, vertex 1, leaf 4 (binary tree of 7 at 4 KiB)
        plan.place(oid(i), "n", 4096, "<f4", (1024,), LAN)
    assert plan.degree == 2 and [pl.vertex for pl in plan.placed] == [3, 1, 4]
    assert plan.child_sources(1) == [oid(0), oid(2)]
    plan.place(oid(3), "n", 4096, "<f4", (1024,), LAN)
    assert plan.child_sources(0) == [vertex_object_id(RID, 1), b""]


def test_chain_places_first_arrival_at_the_tail_and_last_at_the_root() -> None:
    plan = ReducePlan(RID, tuple(oid(i) for i in range(4)), 4)
    placed = [plan.place(oid(i), "n", 256 << 20, "<f4", (64 << 20,), LAN) for i in range(4)]
    assert plan.degree == 1
    assert [pl.vertex for pl in placed] == [3, 2, 1, 0]


def test_an_input_kept_off_the_root_takes_the_next_free_vertex_unless_none_is_left() -> None:
    plan = ReducePlan(RID, tuple(oid(i) for i in range(3)), 3, fan_in=2)  # in-order: 1, 0, 2

    def place(i: int, root_ok: bool) -> int:
        return plan.place(oid(i), "n", 1 << 20, "<f4", (1 << 18,), LAN, root_ok=root_ok).vertex

    assert place(0, root_ok=False) == 1
    assert place(1, root_ok=False) == 2  # the root was next in order
    assert place(2, root_ok=False) == 0  # no other vertex is left
    assert plan.full and plan.reduced_objects() == [oid(0), oid(1), oid(2)]


def test_first_k_takes_the_first_arrivals_and_ignores_stragglers() -> None:
    plan = ReducePlan(RID, tuple(oid(i) for i in range(8)), 6)
    arrivals = [7, 3, 0, 5, 1, 6]
    for i in arrivals:
        assert plan.wants(oid(i))
        plan.place(oid(i), "n", 1 << 20, "<f4", (1 << 18,), LAN)
    assert plan.full and plan.tree is not None and plan.tree.n == 6
    assert not plan.wants(oid(2)) and not plan.wants(oid(4))
    assert plan.reduced_objects() == [oid(i) for i in arrivals]
    with pytest.raises(ValueError):
        plan.place(oid(2), "n", 1 << 20, "<f4", (1 << 18,), LAN)


def test_a_mismatched_input_names_itself_and_is_not_placed() -> None:
    plan = ReducePlan(RID, tuple(oid(i) for i in range(3)), 3)
    plan.place(oid(0), "n", 4096, "<f4", (1024,), LAN)
    for size, dtype, shape in [(8192, "<f8", (1024,)), (4096, "<f4", (32, 32)), (4096, "<i4", (1024,))]:
        with pytest.raises(MismatchError) as info:
            plan.place(oid(1), "n", size, dtype, shape, LAN)
        assert info.value.object_id == oid(1) and oid(1).hex() in str(info.value)
    assert plan.reduced_objects() == [oid(0)]


@pytest.mark.parametrize(("inputs", "k"), [((oid(1), oid(1)), 1), ((oid(1),), 0), ((oid(1),), 2)])
def test_invalid_plans_are_refused(inputs: tuple[bytes, ...], k: int) -> None:
    with pytest.raises(ValueError):
        ReducePlan(RID, inputs, k)


# ---------------------------------------------------------------- operators
def test_ops_and_dtypes_are_validated() -> None:
    assert (
        as_op("sum") is ReduceOp.SUM and as_op("AVG") is ReduceOp.AVG and as_op(ReduceOp.MIN) is ReduceOp.MIN
    )
    with pytest.raises(InvalidArgumentError):
        as_op("median")
    for name in SUPPORTED_DTYPES:
        check_dtype(np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name))
    for bad in ("complex64", "bool", "int8"):
        with pytest.raises(InvalidArgumentError):
            check_dtype(np.dtype(bad))


def _dtype(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _inputs(dtype: np.dtype[Any], n: int, size: int, seed: int, op: ReduceOp) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):  # sums and products may wrap around, as in NumPy
        return [rng.integers(0 if dtype.kind == "u" else -100, 100, size).astype(dtype) for _ in range(n)]
    if op is ReduceOp.PROD:  # magnitudes in [0.5, 1.5]: products of 12 stay normal in float16
        return [(rng.uniform(0.5, 1.5, size) * rng.choice([-1, 1], size)).astype(dtype) for _ in range(n)]
    return [rng.uniform(-2, 2, size).astype(dtype) for _ in range(n)]


def _expected(op: ReduceOp, xs: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    if np.issubdtype(xs[0].dtype, np.integer):  # modular arithmetic in the dtype, as NumPy does
        stacked = np.stack(xs)
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            total = np.add.reduce(stacked, axis=0, dtype=stacked.dtype).astype(np.float64)
            return np.trunc(total / len(xs)) if op is ReduceOp.AVG else total
        if op is ReduceOp.PROD:
            return np.multiply.reduce(stacked, axis=0, dtype=stacked.dtype).astype(np.float64)
        return (stacked.min(0) if op is ReduceOp.MIN else stacked.max(0)).astype(np.float64)
    wide = np.stack([x.astype(np.float64) for x in xs])
    if op is ReduceOp.SUM:
        return wide.sum(0)
    if op is ReduceOp.AVG:
        return wide.sum(0) / len(xs)
    if op is ReduceOp.PROD:
        return wide.prod(0)
    return wide.min(0) if op is ReduceOp.MIN else wide.max(0)


def _simulate(plan: ReducePlan, arrays: dict[bytes, np.ndarray[Any, Any]], op: ReduceOp, chunk: int) -> Any:
    """Run the plan's tree chunk by chunk, as nodes do: each vertex reduces its children's output
    chunks into a copy of its input; the root applies the final step per chunk."""
    tree = plan.tree
    assert tree is not None
    objects = dict(arrays)
    size = next(iter(arrays.values())).size
    # Children before parents: deepest vertices first.
    for v in sorted(range(tree.n), key=tree.depth, reverse=True):
        pl = plan.by_vertex[v]
        if not pl.runs_task:
            assert pl.output_id == pl.object_id
            continue
        out = np.empty_like(arrays[pl.object_id])
        sources = [objects[s] for s in plan.child_sources(v)]
        for lo in range(0, size, chunk):
            hi = min(lo + chunk, size)
            reduce_chunk(
                op,
                arrays[pl.object_id][lo:hi],
                [s[lo:hi] for s in sources],
                out[lo:hi],
                tree.n if v == 0 else 0,
            )
        objects[pl.output_id] = out
    return objects[RID]


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(1, 12),
    drop=st.integers(0, 4),
    size=st.integers(1, 3000),
    chunk=st.sampled_from([1, 7, 64, 1000, 4096]),
    dtype=st.sampled_from(SUPPORTED_DTYPES),
    op=st.sampled_from(list(ReduceOp)),
    seed=st.integers(0, 2**31),
    latency=st.sampled_from([1e-6, 1e-3]),
)
def test_tree_result_equals_numpy(
    n: int, drop: int, size: int, chunk: int, dtype: str, op: ReduceOp, seed: int, latency: float
) -> None:
    k = max(1, n - drop)
    dt = _dtype(dtype)
    xs = _inputs(dt, n, size, seed, op)
    ids = tuple(oid(i) for i in range(n))
    plan = ReducePlan(RID, ids, k)
    arrival = np.random.default_rng(seed).permutation(n)
    for i in arrival[:k]:
        plan.place(
            ids[i], "n", xs[i].nbytes, dt.str, (size,), LinkEstimate(latency, 1e9), chunk=chunk * dt.itemsize
        )
    used = [xs[ids.index(o)] for o in plan.reduced_objects()]
    got = _simulate(plan, dict(zip(ids, xs, strict=True)), op, chunk)
    want = _expected(op, used)
    if np.issubdtype(dt, np.integer):
        assert np.array_equal(got.astype(np.float64), want)
    else:
        # Rounding: each of the k-1 steps errs by at most eps times the magnitude it handles.
        eps = float(ml_dtypes.finfo(dt).eps)
        scale = np.stack([np.abs(x.astype(np.float64)) for x in used])
        bound = scale.prod(0) if op is ReduceOp.PROD else scale.sum(0) / (k if op is ReduceOp.AVG else 1)
        assert np.all(np.abs(got.astype(np.float64) - want) <= 2 * k * eps * bound + 1e-30)


def test_choosing_the_degree_among_height_bands_matches_trying_every_degree() -> None:
    """choose_degree evaluates only the smallest degree of each tree height; the cost model grows
    with the degree at a fixed height, so that is where the minimum over 1..n-1 lies."""
    import math
    import random

    from hoplite_gpu.directory.reduce import LinkEstimate, choose_degree, estimated_time

    rnd = random.Random(7)
    for _ in range(400):
        n = rnd.randint(3, 300)
        size = rnd.choice([1, 100, 4096, 65536, 1 << 20, 1 << 26])
        latency, bandwidth = rnd.choice([1e-6, 5e-5, 1e-3, 1e-2]), rnd.choice([1e7, 1e9, 1e10])
        link = LinkEstimate(latency=latency, bandwidth=bandwidth)
        best, best_t = 1, math.inf
        for d in range(1, n):  # the exhaustive search it replaces (ties to the smaller degree)
            t = estimated_time(n, d, size, link)
            if t < best_t - 1e-12:
                best, best_t = d, t
        assert choose_degree(n, size, link)[0] == best, (n, size, link)
