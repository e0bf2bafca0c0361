"""The public API is small and explicit: ``__all__`` lists exactly what the package exports."""

from __future__ import annotations

import relax_core


def test_all_names_exist_and_are_unique() -> None:
    assert len(relax_core.__all__) == len(set(relax_core.__all__))
    missing = [name for name in relax_core.__all__ if not hasattr(relax_core, name)]
    assert missing == []


def test_every_public_attribute_is_in_all() -> None:
    public = {
        name
        for name, value in vars(relax_core).items()
        if not name.startswith("_") and not isinstance(value, type(relax_core))
    }
    assert public - set(relax_core.__all__) == set()


def test_core_exports_the_contracts_plugins_build_on() -> None:
    for name in (
        "PluginManager",
        "hookimpl",
        "RoleSpec",
        "EngineBackend",
        "WeightSource",
        "RewardSpec",
        "RoutingPolicy",
        "PlacementMode",
        "RouterBackend",
        "RouterProcess",
        "RelaxError",
        "RoutingError",
        "InferenceRecoveryRequired",
    ):
        assert name in relax_core.__all__
