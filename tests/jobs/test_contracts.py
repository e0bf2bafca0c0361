"""One core, several clients: every implementation of a contract has the contract's methods,
with the contract's signatures.

A method added to the in-process class (``InferenceManager``, ``LifecycleCoordinator``) that
is neither in its ``Protocol`` nor on the Ray side (``ManagerActor``, ``RemoteCoordinator``)
fails here, naming it; so does a signature that drifted. mypy checks the same pairs
structurally (each module's ``TYPE_CHECKING`` block); this test adds what mypy cannot see:
nothing public is left out of a contract by accident, and the Ray actor's methods (called by
name through ``.remote``) match exactly.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
from relax_bench.measure import MeasuredCoordinator

from relax_core._proxy import contract
from relax_core.coordination.coordinator import Coordinator, LifecycleCoordinator
from relax_core.coordination.remote import CoordinatorActor, RemoteCoordinator
from relax_core.jobs.models import LocalModel, ModelHandle, RayModel
from relax_core.manager import InferenceManager
from relax_core.manager.actor import (
    HostedManager,
    InProcessManager,
    ManagerActor,
    ModelManager,
    RayManager,
)

#: What an InferenceManager offers only in its own process (not through its actor).
MANAGER_IN_PROCESS_ONLY = {"control_channel", "launch_specs", "replicas", "weight_version"}
#: The manager actor's own queries (the registry's ping, the router it runs, a property's value).
MANAGER_ACTOR_ONLY = {"ping", "router_pids", "router_url", "weight_version"}
#: What a client of the manager's core adds: the call by name, blocking and awaited.
MANAGER_CLIENT_ONLY = {"call", "acall"}
#: The core's own methods: the router started before the engines and stopped after them.
MANAGER_CORE_WRITTEN = {"start", "shutdown"}
#: The in-process coordinator's synchronous queries (its actor's caller uses ``describe``).
COORDINATOR_IN_PROCESS_ONLY = {
    "batch_state",
    "failure",
    "generation_role",
    "lease",
    "leases",
    "status",
}
#: The client's own: stopping the actor.
COORDINATOR_CLIENT_ONLY = {"stop"}


def members(protocol: type) -> set[str]:
    """The public members a Protocol declares."""
    return {name for name in vars(protocol) if not name.startswith("_")}


def public(cls: type) -> set[str]:
    """Every public attribute of a class (methods and properties, inherited too)."""
    return {name for name in dir(cls) if not name.startswith("_")}


#: The keyword Ray adds to every method of a class it makes an actor of (its tracing hook sets
#: each method's signature, on the class itself, once any test of the session made one).
RAY_TRACE_PARAMETER = "_ray_trace_ctx"


def signature(cls: type, name: str) -> str:
    """A member's signature as text (a property's: its getter's return annotation), without
    the parameter Ray's tracing adds."""
    value = inspect.getattr_static(cls, name)
    if isinstance(value, property):
        assert value.fget is not None
        return f"property -> {inspect.signature(value.fget).return_annotation}"
    sig = inspect.signature(value)
    kept = [p for p in sig.parameters.values() if p.name != RAY_TRACE_PARAMETER]
    return str(sig.replace(parameters=kept))


def drift(protocol: type, cls: type, names: set[str]) -> dict[str, tuple[str, str]]:
    """Members whose signature on ``cls`` differs from the protocol's: name -> (want, got)."""
    out = {}
    for name in sorted(names):
        want, got = signature(protocol, name), signature(cls, name)
        if want != got:
            out[name] = (want, got)
    return out


def unmet(protocol: type, cls: type) -> tuple[set[str], dict[str, tuple[str, str]]]:
    """What ``cls`` lacks of ``protocol``: the methods it does not have, and the :func:`drift`
    of those it has."""
    names = members(protocol)
    return names - public(cls), drift(protocol, cls, names)


# -- the model manager -------------------------------------------------------------------


def test_every_public_method_of_the_in_process_manager_is_in_the_manager_contract() -> None:
    left_out = public(InferenceManager) - members(ModelManager) - MANAGER_IN_PROCESS_ONLY
    assert left_out == set(), (
        f"InferenceManager has {sorted(left_out)} in neither ModelManager nor the in-process "
        "extras: add them to ModelManager and ManagerActor (relax_core/manager/actor.py)"
    )


@pytest.mark.parametrize("cls", [InferenceManager, ManagerActor], ids=lambda c: c.__name__)
def test_each_manager_has_every_contract_method_with_its_signature(cls: type) -> None:
    assert unmet(ModelManager, cls) == (set(), {})


def test_the_manager_actor_adds_only_its_own_queries_to_the_contract() -> None:
    assert public(ManagerActor) - members(ModelManager) == MANAGER_ACTOR_ONLY


def test_the_hosted_contract_is_the_manager_contract_and_the_actor_queries() -> None:
    assert set(contract(HostedManager)) == members(ModelManager) | MANAGER_ACTOR_ONLY
    assert drift(HostedManager, ManagerActor, MANAGER_ACTOR_ONLY) == {}


def test_the_core_forwards_every_contract_method_it_does_not_write_generated_from_it() -> None:
    declared = contract(ModelManager)
    written = {
        name for name in declared if getattr(vars(ManagerActor)[name], "__wrapped__", None) is None
    }
    assert written == MANAGER_CORE_WRITTEN
    for name in declared.keys() - MANAGER_CORE_WRITTEN:
        assert vars(ManagerActor)[name].__wrapped__ is declared[name], name


@pytest.mark.parametrize("cls", [InProcessManager, RayManager], ids=lambda c: c.__name__)
def test_each_manager_client_has_the_hosted_contract_generated_from_it(cls: type) -> None:
    declared = contract(HostedManager)
    assert public(cls) - set(declared) == MANAGER_CLIENT_ONLY
    assert drift(HostedManager, cls, set(declared)) == {}
    assert all(vars(cls)[name].__wrapped__ is declared[name] for name in declared)


def test_the_in_process_client_calls_the_core_by_the_contract_method_name() -> None:
    class Core:
        def states(self) -> dict[str, str]:
            return {"m/0": "READY"}

        def ping(self) -> str:
            return "m"

    client: Any = InProcessManager(Core())  # type: ignore[abstract, arg-type]
    assert client.name == "m"
    assert client.states() == {"m/0": "READY"}
    assert asyncio.run(client.acall("states")) == {"m/0": "READY"}


# -- the coordinator ---------------------------------------------------------------------


def test_every_public_method_of_the_in_process_coordinator_is_in_the_coordinator_contract() -> None:
    left_out = public(LifecycleCoordinator) - members(Coordinator) - COORDINATOR_IN_PROCESS_ONLY
    assert left_out == set(), (
        f"LifecycleCoordinator has {sorted(left_out)} in neither Coordinator nor the "
        "in-process queries: add them to Coordinator and RemoteCoordinator"
    )


@pytest.mark.parametrize("cls", [LifecycleCoordinator, RemoteCoordinator], ids=lambda c: c.__name__)
def test_each_coordinator_has_every_contract_method_with_its_signature(cls: type) -> None:
    assert unmet(Coordinator, cls) == (set(), {})
    contract = members(Coordinator)
    assert all(inspect.iscoroutinefunction(getattr(cls, name)) for name in contract)


def test_the_coordinator_client_adds_only_stopping_its_actor() -> None:
    assert public(RemoteCoordinator) - members(Coordinator) == COORDINATOR_CLIENT_ONLY


def test_the_coordinator_actor_is_the_in_process_coordinator_not_a_copy_of_it() -> None:
    # Its methods are inherited, never written out again: only the constructor is its own.
    assert issubclass(CoordinatorActor, LifecycleCoordinator)
    own = {name for name in vars(CoordinatorActor) if not name.startswith("__")}
    assert own == set()


def test_the_measured_coordinator_measures_two_switches_and_forwards_the_rest() -> None:
    own = {name for name in vars(MeasuredCoordinator) if not name.startswith("_")}
    assert own == {"activate", "deactivate"}
    assert drift(Coordinator, MeasuredCoordinator, own) == {}
    assert "__getattr__" in vars(MeasuredCoordinator)


def test_the_measured_coordinator_forwards_a_call_it_does_not_measure() -> None:
    class Inner:
        async def describe(self) -> str:
            return "described"

    measured: Any = MeasuredCoordinator(Inner(), probe=None)  # type: ignore[arg-type]
    assert asyncio.run(measured.describe()) == "described"


# -- the job runtime's model handle ------------------------------------------------------


@pytest.mark.parametrize("cls", [LocalModel, RayModel], ids=lambda c: c.__name__)
def test_each_model_handle_has_every_contract_method_with_its_signature(cls: type) -> None:
    assert unmet(ModelHandle, cls) == (set(), {})
