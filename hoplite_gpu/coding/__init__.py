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

:class:`PartialCode` runs the partial-straggler protocol of Ramamoorthy, Meng and Girimaji
(NeurIPS 2024) on a code's assignment: a piece per finished partition, decoded as soon as every
partition arrived, so the partitions slow workers finished count too. :class:`DecodeTracker` is
the decodability check both use as results arrive (the directory runs one per reduction that
decodes as its inputs arrive).

The package: :mod:`.codes` holds the codes, :mod:`.decoding` the pure decoding math (NumPy only,
run by the directory too); every public name is importable from ``hoplite_gpu.coding``.
"""

from __future__ import annotations

from .codes import EXHAUSTIVE_CHECK_MAX_N, Decoded, GradientCode, PartialCode, PartialDecoded
from .decoding import DECODE_TOLERANCE, DecodeTracker, solve_decoding

__all__ = [
    "DECODE_TOLERANCE",
    "EXHAUSTIVE_CHECK_MAX_N",
    "DecodeTracker",
    "Decoded",
    "GradientCode",
    "PartialCode",
    "PartialDecoded",
    "solve_decoding",
]
