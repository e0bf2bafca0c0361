"""relax_core.coordination exports exactly its public names."""

from __future__ import annotations

import relax_core.coordination as coordination


def test_all_names_exist_are_unique_and_cover_every_public_attribute() -> None:
    names = coordination.__all__
    assert len(names) == len(set(names))
    assert [n for n in names if not hasattr(coordination, n)] == []
    public = {
        n for n, v in vars(coordination).items()
        if not n.startswith("_") and not isinstance(v, type(coordination))
    }  # fmt: skip
    assert public - set(names) == set()


def test_the_contracts_a_trainer_and_a_producer_build_on_are_exported() -> None:
    for name in (
        "LifecycleCoordinator", "RemoteCoordinator", "start_coordinator", "connect_coordinator",
        "DeferredBatch", "DeferredCollector", "abort_generation", "Sample", "BatchSink",
        "RayBatchSink", "SinkReceipt", "RewardStage", "DistillationStage", "Timeline",
        "DeferredWorkload", "validate_deferred_workload",
    ):  # fmt: skip
        assert name in coordination.__all__
