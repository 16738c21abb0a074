"""Weight sync for RL post-training: versions of named tensors from trainers to any number of
rollout engines, which may join, leave or die at any time.

On the trainer::

    from hoplite_gpu.weights import WeightPublisher, WeightSubscriber
    pub = WeightPublisher(node, "policy")
    pub.publish(model.state_dict(), version=7)

On each rollout engine::

    sub = WeightSubscriber(node, "policy")
    version = sub.latest(timeout=30)                 # the newest version (waits for the first)
    version, tensors = sub.receive(into=model.state_dict())   # the newest, filled in place

A version's tensors are packed into buckets (``bucket_bytes``, 64 MiB by default) put under ids
derived from (name, version, rank, bucket), after a manifest per publishing rank (names, dtypes,
shapes, offsets, each bucket's size) and before the buckets' digests. A receive pulls every
bucket at once through hoplite's receiver-driven trees, so engines that are still receiving a
bucket already serve it to later ones, and one that dies is routed around. A receive either
returns the whole version, checked against the digests, or raises a typed error naming the bucket
and its holder.

vLLM engines use it as the weight-transfer backend ``"hoplite"``
(:mod:`hoplite_gpu.weights.vllm`, registered by the ``vllm.general_plugins`` entry point).

Only the public node API is used, so this module runs wherever a node does. The head of a name
(its newest version) is a small object that rank 0 deletes and puts again for each version, and
each version's successor is linked from it, so ``latest(newer_than=v)`` waits without polling.
"""

from __future__ import annotations

from ..errors import VersionRetiredError, WeightSyncError
from .manifest import BucketEntry, Manifest, TensorEntry
from .publisher import BUCKET_BYTES, WeightPublisher
from .subscriber import WeightSubscriber

__all__ = [
    "BUCKET_BYTES",
    "BucketEntry",
    "Manifest",
    "TensorEntry",
    "VersionRetiredError",
    "WeightPublisher",
    "WeightSubscriber",
    "WeightSyncError",
]
