"""relax_core.coordination exports the contracts a trainer, a producer and a stage build on
(that ``__all__`` is exactly its public names: ``tests/test_exported_members.py``)."""

from __future__ import annotations

import relax_core.coordination as coordination


def test_the_contracts_a_trainer_and_a_producer_build_on_are_exported() -> None:
    for name in (
        "LifecycleCoordinator", "RemoteCoordinator", "start_coordinator", "connect_coordinator",
        "DeferredBatch", "DeferredCollector", "abort_generation", "Sample", "BatchSink",
        "RayBatchSink", "SinkReceipt", "RewardStage", "Stage", "SampleField", "BatchControl",
        "StageContext", "Timeline", "DeferredWorkload", "validate_deferred_workload",
    ):  # fmt: skip
        assert name in coordination.__all__
