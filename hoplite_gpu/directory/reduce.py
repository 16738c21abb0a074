"""Reduce trees: shape from a cost model, vertices placed in arrival order (pure, no I/O).

A reduction of ``k`` inputs (the first ``k`` of the listed ObjectIDs to become ready) runs as a
tree of ``k`` vertices. Vertex ``v`` sits on the node holding its input ``x_v`` and produces
``O_v = x_v (op) O_c1 (op) ... (op) O_cd`` over its children ``c``, chunk by chunk: it streams each
child's output as that child produces it (children's outputs are ordinary partial objects, pulled
through the broadcast machinery) and its own output is readable up to the bytes already reduced.
A leaf's output is its input, so leaves cost nothing: their parents stream the inputs directly.
The root's output is the reduction's result, so a ``get`` of it streams while the reduction runs
(allreduce = reduce pipelined into broadcast).

Shape. A complete ``d``-ary tree, vertices numbered breadth first (root 0, children of ``v`` are
``d*v+1 .. d*v+d``). Arrivals fill the vertices in in-order (first child's subtree, the vertex,
then the other children's subtrees), so the first inputs to arrive are leaves that start
reducing at once, and for ``d = 1`` the tree is a chain whose last arrival is the root.

Cost model (after the Hoplite paper, section 4.3). With per-hop latency ``L``, link bandwidth
``B``, object size ``S``, chunk size ``C`` and tree height ``h(d)`` (edges on the longest
root path), a vertex receives ``d`` streams through one link, so::

    T(d) = d * S / B  +  h(d) * (L + d * C / B)

The first term is the bandwidth bottleneck, the second the pipeline fill: each level adds a hop
latency and one chunk time per child. Large objects favour chains (``d = 1``, ``T ≈ S/B``), small
ones flat trees (``d = k-1``, ``T ≈ (k-1)S/B + L``). ``L`` and ``B`` are measured at run time by
the directory from completed transfers (:class:`LinkEstimate`), not fixed constants.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

#: Chunk size the cost model assumes when the caller passes none.
DEFAULT_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    """Measured per-hop latency (seconds) and bandwidth (bytes/second) of the cluster's links.

    Starts from a guess and moves towards each measurement (exponentially weighted).
    """

    latency: float = 500e-6
    bandwidth: float = 1e9
    samples: int = 0

    def with_transfer(self, nbytes: int, seconds: float, weight: float = 0.25) -> LinkEstimate:
        """Fold in one completed transfer of ``nbytes`` that took ``seconds`` end to end."""
        if nbytes <= 0 or seconds <= 0:
            return self
        if nbytes < (1 << 20):  # small transfers measure latency
            latency = self.latency + weight * (seconds - self.latency)
            return LinkEstimate(max(latency, 1e-6), self.bandwidth, self.samples + 1)
        rate = nbytes / max(seconds - self.latency, seconds / 2)
        bandwidth = self.bandwidth + weight * (rate - self.bandwidth)
        return LinkEstimate(self.latency, max(bandwidth, 1.0), self.samples + 1)


class TreeShape:
    """A complete ``degree``-ary tree of ``n`` vertices, numbered breadth first.

    Args:
        n: Number of vertices (>= 1).
        degree: Children per vertex (>= 1; 1 is a chain).
    """

    def __init__(self, n: int, degree: int) -> None:
        if n < 1 or degree < 1:
            raise ValueError("a tree needs n >= 1 and degree >= 1")
        self.n = n
        self.degree = degree
        # The in-order traversal, produced as far as it is read: a reduction places its inputs a
        # slice per event, and no event should pay for walking a tree of 10,000 vertices.
        self._order: list[int] = []
        self._walk = self._visit_inorder()

    @property
    def inorder(self) -> list[int]:
        """Every vertex, in in-order (the order inputs are placed in)."""
        self._extend(self.n)
        return self._order

    @property
    def rank(self) -> dict[int, int]:
        """Each vertex's position in :attr:`inorder`."""
        return {v: i for i, v in enumerate(self.inorder)}

    def inorder_at(self, i: int) -> int:
        """The ``i``-th vertex in in-order (walking the tree only that far)."""
        if i >= len(self._order):
            self._extend(i + 1)
            if i >= len(self._order):
                raise IndexError(f"a tree of {self.n} vertices has no in-order position {i}")
        return self._order[i]

    def _extend(self, count: int) -> None:
        order = self._order
        if len(order) >= count:
            return
        for v in self._walk:
            order.append(v)
            if len(order) >= count:
                return

    def parent(self, v: int) -> int | None:
        """Parent of ``v`` (None for the root)."""
        return None if v == 0 else (v - 1) // self.degree

    def children(self, v: int) -> list[int]:
        """Children of ``v``, in order."""
        first = self.degree * v + 1
        return list(range(first, min(first + self.degree, self.n)))

    def depth(self, v: int) -> int:
        """Edges from ``v`` up to the root."""
        return _depth(v, self.degree)

    @property
    def height(self) -> int:
        """Edges on the longest path from a leaf to the root."""
        return self.depth(self.n - 1)

    def _visit_inorder(self) -> Iterator[int]:
        # Iterative: chains of 10 000 vertices must not hit the recursion limit.
        stack: list[tuple[int, bool]] = [(0, False)]
        while stack:
            v, expanded = stack.pop()
            if expanded:
                yield v
                continue
            kids = self.children(v)
            for c in reversed(kids[1:]):
                stack.append((c, False))
            stack.append((v, True))
            if kids:
                stack.append((kids[0], False))


def _depth(v: int, degree: int) -> int:
    """Edges from vertex ``v`` up to the root of a breadth-first numbered ``degree``-ary tree."""
    if degree == 1:
        return v
    d = 0
    while v:
        v = (v - 1) // degree
        d += 1
    return d


def tree_height(n: int, degree: int) -> int:
    """Height of the complete ``degree``-ary tree of ``n`` vertices (breadth-first numbering):
    the depth of its last vertex."""
    return _depth(n - 1, degree)


def estimated_time(
    n: int, degree: int, size: int, link: LinkEstimate, chunk: int = DEFAULT_CHUNK_BYTES
) -> float:
    """Modelled seconds for a ``degree``-ary reduce tree of ``n`` inputs of ``size`` bytes."""
    if n <= 1:
        return 0.0
    chunk = max(1, min(chunk, size))
    per_byte = 1.0 / link.bandwidth
    return degree * size * per_byte + tree_height(n, degree) * (link.latency + degree * chunk * per_byte)


def choose_degree(n: int, size: int, link: LinkEstimate, chunk: int = DEFAULT_CHUNK_BYTES) -> tuple[int, str]:
    """The degree minimising :func:`estimated_time`, and a human-readable reason.

    Ties go to the smaller degree (fewer streams into one link).
    """
    if n <= 2:
        return 1, f"{n} input(s): a chain is the only shape"
    best, best_t = 1, math.inf
    for d in _band_starts(n):
        t = estimated_time(n, d, size, link, chunk)
        if t < best_t - 1e-12:
            best, best_t = d, t
    return best, (
        f"degree {best} minimises T(d) = d*S/B + h(d)*(L + d*C/B) for n={n}, S={size} B, "
        f"L={link.latency * 1e6:.0f} us, B={link.bandwidth / 1e9:.2f} GB/s: {best_t * 1e3:.2f} ms"
    )


def _band_starts(n: int) -> list[int]:
    """The smallest degree of each tree height for ``n`` vertices, in ascending order.

    The height is non-increasing in the degree, and for a fixed height :func:`estimated_time` grows
    with the degree, so the minimum over all degrees 1..n-1 is at one of these (O(log^2 n) of them
    to find instead of n-1 evaluations: a reduce of 10,000 inputs chose its degree in 16 ms)."""
    starts, d = [], 1
    while d < n:
        starts.append(d)
        h = tree_height(n, d)
        lo, hi = d + 1, n  # the first degree in (d, n) with a lower height, or n if none
        while lo < hi:
            mid = (lo + hi) // 2
            if tree_height(n, mid) < h:
                hi = mid
            else:
                lo = mid + 1
        d = lo
    return starts


def vertex_object_id(reduction_id: bytes, vertex: int, epoch: int = 0) -> bytes:
    """ObjectID of a vertex's output: the reduction's own id for the root, else derived from it
    (and from the tree's ``epoch``: a tree rebuilt after a failure gets fresh intermediate ids)."""
    if vertex == 0:
        return reduction_id
    suffix = f"{vertex}" if epoch == 0 else f"{vertex}@{epoch}"
    return hashlib.blake2b(reduction_id + b"/vertex/" + suffix.encode(), digest_size=20).digest()


@dataclass(frozen=True, slots=True)
class Placement:
    """An input placed at a tree vertex.

    A leaf's output is its input itself (its parent streams the input directly, so a leaf costs
    its node nothing); any other vertex, and the root always, runs a task on ``node_id`` that
    writes ``output_id``.
    """

    vertex: int
    object_id: bytes
    node_id: str
    output_id: bytes  # the object the parent streams: ``object_id`` for a leaf
    parent: int | None  # parent vertex (None: the root)
    children: tuple[int, ...]  # child vertices, in order

    @property
    def runs_task(self) -> bool:
        """Whether the vertex computes an output (every vertex but a non-root leaf)."""
        return bool(self.children) or self.parent is None


class MismatchError(Exception):
    """An input's dtype or shape differs from the reduction's; carries the offending id."""

    def __init__(self, object_id: bytes, message: str) -> None:
        super().__init__(message)
        self.object_id = object_id


@dataclass(slots=True)
class ReducePlan:
    """One reduction's tree: which inputs were placed where, in arrival order.

    Args:
        reduction_id: Id of the result object (the root's output).
        inputs: The candidate inputs, in the caller's order (distinct).
        num_objects: How many of them to reduce (the first to become ready).
        epoch: How many times the tree was rebuilt after a failure (part of intermediate ids),
            counted from :func:`~.reduce_request.rejoined_epoch` for a reduction re-sent
            after the directory restarted.
        fan_in: The tree's degree asked for by the requester (0: :func:`choose_degree` picks it
            when the first input fixes the size; capped at ``num_objects - 1``).
        ordered: Input ``i`` of ``inputs`` goes to the ``i``-th vertex in in-order, whenever it
            arrives (every input is reduced): with degree 1 (the degree when none is asked for),
            a chain from the first input to the last, whose holder computes the result. A ring
            allreduce reduces each shard along the ring this way
            (:mod:`hoplite_gpu.collective.operations`). Without a requested degree on one host
            the tree is that host's star, placed in arrival order (see :meth:`place`).
    """

    reduction_id: bytes
    inputs: tuple[bytes, ...]
    num_objects: int
    epoch: int = 0
    fan_in: int = 0
    ordered: bool = False
    degree: int = 0
    reason: str = ""
    dtype: str = ""
    shape: tuple[int, ...] = ()
    size: int = -1
    placed: list[Placement] = field(default_factory=list)
    by_vertex: dict[int, Placement] = field(default_factory=dict)
    _tree: TreeShape | None = None
    # Set views of ``inputs`` and of the placed inputs: :meth:`wants` is asked once per input, and
    # scanning the tuple and the list made a reduce over n present inputs O(n^2) (8,000 inputs
    # took 6.1 s of the directory's time).
    _input_set: frozenset[bytes] = frozenset()
    _placed_ids: set[bytes] = field(default_factory=set)
    _cursor: int = 0  # vertices before this index of the tree's in-order list are all placed
    _position: dict[bytes, int] = field(default_factory=dict)  # an ordered plan's input -> index

    def __post_init__(self) -> None:
        self._input_set = frozenset(self.inputs)
        self._placed_ids = {pl.object_id for pl in self.placed}
        if len(self._input_set) != len(self.inputs):
            raise ValueError("a reduction's inputs must be distinct")
        if not 1 <= self.num_objects <= len(self.inputs):
            raise ValueError(f"num_objects must be in 1..{len(self.inputs)}")
        if self.fan_in < 0:
            raise ValueError("a reduce tree's degree must be >= 1 (or 0 to let the directory choose)")
        if self.ordered:
            if self.num_objects != len(self.inputs):
                raise ValueError("inputs placed in the listed order must all be reduced (num_objects)")
            self._position = {oid: i for i, oid in enumerate(self.inputs)}

    @property
    def full(self) -> bool:
        """Whether all ``num_objects`` vertices are placed."""
        return len(self.placed) >= self.num_objects

    @property
    def tree(self) -> TreeShape | None:
        """The tree, once the first input fixed its size and degree."""
        return self._tree

    def reduced_objects(self) -> list[bytes]:
        """The inputs placed so far, in arrival order (all of them once :attr:`full`)."""
        return [pl.object_id for pl in self.placed]

    def wants(self, object_id: bytes) -> bool:
        """Whether ``object_id`` is an input not placed yet and there is a free vertex."""
        return not self.full and object_id in self._input_set and object_id not in self._placed_ids

    def check(self, object_id: bytes, size: int, dtype: str, shape: tuple[int, ...]) -> None:
        """Raise :class:`MismatchError` if the input does not match inputs placed before."""
        if self.size >= 0 and (dtype != self.dtype or tuple(shape) != self.shape or size != self.size):
            raise MismatchError(
                object_id,
                f"input {object_id.hex()} has dtype {dtype} and shape {list(shape)}, but the "
                f"reduction's inputs have dtype {self.dtype} and shape {list(self.shape)}",
            )

    def place(
        self,
        object_id: bytes,
        node_id: str,
        size: int,
        dtype: str,
        shape: tuple[int, ...],
        link: LinkEstimate,
        chunk: int = DEFAULT_CHUNK_BYTES,
        at_root: bool = False,
        one_host: bool = False,
        root_ok: bool = True,
    ) -> Placement:
        """Place the next arriving input at the next free vertex in in-order, or at the root (vertex
        0) if ``at_root`` and it is free: the node that reads the result then computes it, and its
        link carries the result's last hop only once. An :attr:`ordered` plan places it at its
        own position instead (``at_root`` and ``root_ok`` do not apply).

        ``one_host``: every node shares one host's shared memory. The first placement then makes
        the tree a star (unless the requester asked for a degree; an ordered plan is then placed
        in arrival order): the root maps every input from its holder's segment and reduces them
        in one pass, where a chain would move each partial result between processes
        (bench/pages/collectives.md, "Ring allreduce": one host).

        ``root_ok`` False: not at the root while another vertex is free (the input's node may
        hold a complete result of the tree a repair replaced; see :mod:`.repair`).

        Raises:
            MismatchError: dtype or shape differs from the inputs placed before.
            ValueError: not a wanted input (see :meth:`wants`).
        """
        if not self.wants(object_id):
            raise ValueError(f"{object_id.hex()} is not a pending input of this reduction")
        self.check(object_id, size, dtype, shape)
        if self._tree is None:
            self.size, self.dtype, self.shape = size, dtype, tuple(shape)
            if self.fan_in:
                self.degree = min(self.fan_in, max(1, self.num_objects - 1))
                self.reason = f"degree {self.fan_in} requested"
            elif one_host:
                self.degree = max(1, self.num_objects - 1)
                self.reason = "every node on one host: the root maps each input from shared memory"
                self.ordered = False  # the requester's input computes the root, as in any star
            elif self.ordered:
                self.degree, self.reason = 1, "inputs in the listed order: a chain"
            else:
                self.degree, self.reason = choose_degree(self.num_objects, size, link, chunk)
            self._tree = TreeShape(self.num_objects, self.degree)
        tree = self._tree
        if self.ordered:
            vertex = tree.inorder_at(self._position[object_id])
        elif at_root and 0 not in self.by_vertex:
            vertex = 0
        else:  # the first free vertex in order; vertices are only ever added, so never look back
            while tree.inorder_at(self._cursor) in self.by_vertex:
                self._cursor += 1
            vertex = tree.inorder_at(self._cursor)
            if vertex == 0 and not root_ok:  # the next free vertex after the root, if any
                later = self._cursor + 1
                while later < tree.n and tree.inorder_at(later) in self.by_vertex:
                    later += 1
                if later < tree.n:
                    vertex = tree.inorder_at(later)
        parent = tree.parent(vertex)
        children = tuple(tree.children(vertex))
        leaf = not children and parent is not None
        pl = Placement(
            vertex=vertex,
            object_id=object_id,
            node_id=node_id,
            output_id=object_id if leaf else vertex_object_id(self.reduction_id, vertex, self.epoch),
            parent=parent,
            children=children,
        )
        self.placed.append(pl)
        self._placed_ids.add(object_id)
        self.by_vertex[vertex] = pl
        return pl

    def child_sources(self, vertex: int) -> list[bytes]:
        """The objects ``vertex`` reduces, one per child in order (``b""`` for a child not placed)."""
        pl = self.by_vertex[vertex]
        return [self.by_vertex[c].output_id if c in self.by_vertex else b"" for c in pl.children]

    def intermediates(self) -> list[Placement]:
        """Placed vertices whose output is a temporary object (not an input, not the result)."""
        return [pl for pl in self.placed if pl.runs_task and pl.parent is not None]
