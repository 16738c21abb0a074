"""The ``vllm.general_plugins`` entry point: registers the ``"hoplite"`` weight-transfer backend
(:mod:`hoplite_gpu.weights.vllm`) with vLLM's factories, lazily, so vLLM imports it only when a
``WeightTransferConfig(backend="hoplite")`` asks for it. vLLM calls it in each of its processes;
a trainer process that builds no vLLM engine calls it itself (importing
:mod:`hoplite_gpu.weights.vllm` does too)."""

from __future__ import annotations

MODULE = "hoplite_gpu.weights.vllm"


def register() -> None:
    """Register the backend with both of vLLM's weight-transfer factories (idempotent)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in (
        (WeightTransferEngineFactory, "HopliteWeightTransferEngine"),
        (WeightTransferTrainerFactory, "HopliteTrainerWeightTransferEngine"),
    ):
        if "hoplite" not in factory._registry:
            factory.register_engine("hoplite", MODULE, cls)
