"""The public API is small and explicit: ``__all__`` is exactly what each package exports, every
exported class reports the package it is exported from, and plugins import only that API."""

from __future__ import annotations

import ast
import importlib
import pickle
from pathlib import Path

import pytest

import relax_core

ROOT = Path(__file__).resolve().parents[1]

#: The public API of ``relax_core``. A change here is a change of the API: make it on purpose.
PUBLIC = [
    "AdaptContext",
    "Adapted",
    "AdmissionServer",
    "BatchFailedError",
    "BatchSink",
    "BreakerSettings",
    "CapabilityError",
    "ChannelError",
    "ConfigError",
    "ConfigValidationError",
    "ControlClient",
    "CoordinationError",
    "DeferredBatch",
    "DeferredCollector",
    "DeferredWorkload",
    "DistillationStage",
    "EngineBackend",
    "EngineLaunchSpec",
    "EngineProcess",
    "EngineView",
    "GatewayError",
    "GatewayOptions",
    "InferenceClient",
    "InferenceEngineSpec",
    "InferenceGatewayHandler",
    "InferenceManager",
    "InferencePlacementPlan",
    "InferenceRecoveryRequired",
    "InvalidRequestError",
    "JobConfig",
    "LeaseBlockedError",
    "LifecycleCoordinator",
    "LifecycleError",
    "LifecycleResult",
    "ManagerTimeouts",
    "ModelLaunch",
    "ModelPlacement",
    "ModelState",
    "ModelView",
    "NotApplicable",
    "OpenAPINotes",
    "PlacementError",
    "PlacementMode",
    "PluginError",
    "PluginManager",
    "PrefillResult",
    "RegistryPublisher",
    "RelaxError",
    "ReplicaPlacement",
    "ReplicaState",
    "RequestNotReplayedError",
    "ResidentTag",
    "RewardContext",
    "RewardResult",
    "RewardSpec",
    "RewardStage",
    "RoleAdapter",
    "RoleClients",
    "RoleSnapshot",
    "RoleSpec",
    "RouteMode",
    "RouteResolver",
    "RouteTarget",
    "RouterBackend",
    "RouterLaunchSpec",
    "RouterMembership",
    "RouterProcess",
    "RoutingError",
    "RoutingPolicy",
    "RoutingSpec",
    "RunConfig",
    "Sample",
    "ScoringError",
    "SinkError",
    "SinkReceipt",
    "SnapshotError",
    "StageContext",
    "StreamStalledError",
    "SubprocessEngineProcess",
    "TrainerContext",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamUnreachableError",
    "WeightSource",
    "__version__",
    "check_chat_payload",
    "check_generate_payload",
    "check_messages",
    "close_clients",
    "connect_coordinator",
    "engine_launch_specs",
    "free_port",
    "get_client",
    "get_plugin_manager",
    "hookimpl",
    "load_config",
    "loads_config",
    "parse_prefill",
    "plan_inference_placement",
    "prefill_payload",
    "serialize_named_tensors",
    "start_coordinator",
    "validate_bound_placement",
]

PACKAGES = [
    "relax_core.client",
    "relax_core.coordination",
    "relax_core.discovery",
    "relax_core.engine",
    "relax_core.gateway",
    "relax_core.manager",
    "relax_core.placement",
    "relax_core.run",
]

#: What a plugin may import from the core.
ALLOWED_CORE_IMPORTS = {"relax_core", "relax_core.testing"}


def test_all_is_exactly_the_public_api() -> None:
    assert relax_core.__all__ == PUBLIC


def test_every_public_attribute_is_in_all() -> None:
    public = {
        name
        for name, value in vars(relax_core).items()
        if not name.startswith("_") and not isinstance(value, type(relax_core))
    }
    assert public - set(relax_core.__all__) == set()


@pytest.mark.parametrize("package", ["relax_core", *PACKAGES])
def test_exported_classes_report_the_package_they_are_exported_from(package: str) -> None:
    module = importlib.import_module(package)
    top = set(relax_core.__all__)
    wrong = {}
    for name in module.__all__:
        value = getattr(module, name)
        if not isinstance(value, type):
            continue
        # A class exported at the top level reports relax_core wherever else it is exported.
        expected = "relax_core" if name in top else package
        if value.__module__ != expected:
            wrong[name] = value.__module__
    assert wrong == {}


def test_exported_classes_pickle_by_their_public_name() -> None:
    error = relax_core.RoutingError(503, "no replica", retry_after=2.0)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is relax_core.RoutingError and back.retry_after == 2.0
    assert pickle.loads(pickle.dumps(relax_core.ModelState.READY)) is relax_core.ModelState.READY


def _plugin_sources() -> list[Path]:
    roots = [
        *ROOT.glob("plugins/*/"),
        *ROOT.glob("contrib/*/"),
        *ROOT.glob("tests/plugins/*/"),
    ]
    return sorted(p for root in roots for p in root.rglob("*.py"))


def _core_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "relax_core")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.level == 0
            and node.module.split(".")[0] == "relax_core"
        ):
            found.add(node.module)
    return found


def test_there_are_plugin_sources_to_check() -> None:
    # Guards the test below against passing vacuously.
    names = {p.parent.name for p in _plugin_sources()}
    assert {"relax_hf", "relax_genrm", "relax_testplugin"} <= names


def test_plugins_import_only_the_public_api_of_the_core() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(_core_imports(path) - ALLOWED_CORE_IMPORTS)
        for path in _plugin_sources()
    }
    assert {k: v for k, v in offenders.items() if v} == {}
