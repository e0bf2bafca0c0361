"""Every hook a Relax plugin can implement.

A plugin is a module (found through the ``relax`` entry-point group) with functions marked
``@relax_core.hookimpl``. Registration hooks hand the plugin a ``register`` callback; the plugin
calls it with frozen records from :mod:`relax_core.records`. Two records of one kind with one
name are rejected with both plugins named.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from relax_core.records import (
    EngineBackend,
    PlacementMode,
    RewardSpec,
    RoleSpec,
    RouterBackend,
    RoutingPolicy,
    WeightSource,
)

__all__ = ["hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("relax")
hookimpl = pluggy.HookimplMarker("relax")


# -- roles -----------------------------------------------------------------------------------


@hookspec
def relax_register_roles(register: Callable[[RoleSpec], None]) -> None:
    """Register inference roles.

    :param register: call it once per :class:`~relax_core.records.RoleSpec`.

    Example::

        @hookimpl
        def relax_register_roles(register):
            register(RoleSpec(name="genrm", allowed_weight_sources={"STATIC"},
                              default_route_mode="DIRECT", deferrable=True))
    """


# -- engine backends -------------------------------------------------------------------------


@hookspec
def relax_register_engine_backends(register: Callable[[EngineBackend], None]) -> None:
    """Register engine backends.

    :param register: call it once per :class:`~relax_core.records.EngineBackend`.

    Example::

        @hookimpl
        def relax_register_engine_backends(register):
            register(EngineBackend(name="hf", launch=launch_hf, control_client=ControlClient,
                                   devices={"cpu", "cuda"}))
    """


# -- routers ---------------------------------------------------------------------------------


@hookspec
def relax_register_routers(register: Callable[[RouterBackend], None]) -> None:
    """Register routers that front a model's replica heads (``route_mode = "SGLANG_ROUTER"``).

    :param register: call it once per :class:`~relax_core.records.RouterBackend`.

    Example::

        @hookimpl
        def relax_register_routers(register):
            register(RouterBackend(name="smg", launch=launch_smg,
                                   policies={"round_robin", "consistent_hashing"},
                                   default_policy="consistent_hashing", version="1.13.0"))
    """


# -- weight sources --------------------------------------------------------------------------


@hookspec
def relax_register_weight_sources(register: Callable[[WeightSource], None]) -> None:
    """Register weight sources (the core registers ``STATIC``, ``ACTOR`` and ``DCS``).

    :param register: call it once per :class:`~relax_core.records.WeightSource`.

    Example::

        @hookimpl
        def relax_register_weight_sources(register):
            register(WeightSource(name="S3CKPT", update_paths={"disk"}, publishes_version=True))
    """


# -- reward adapters -------------------------------------------------------------------------


@hookspec
def relax_register_reward_adapters(register: Callable[[RewardSpec], None]) -> None:
    """Register reward adapters.

    :param register: call it once per :class:`~relax_core.records.RewardSpec`.

    An adapter is called ``fn(response, label)`` (plus ``metadata=`` with
    ``pass_metadata=True``; an ``async`` adapter also gets ``context=``, a
    :class:`~relax_core.coordination.RewardContext` with the sample and the loop's client of
    each role) and returns a number or a :class:`~relax_core.coordination.RewardResult`.
    ``sync`` adapters run in Ray workers; ``label_matcher(label) -> bool`` limits the samples
    an adapter scores; ``supports_deferred`` lets it score a staged batch in a deferred phase.

    Example::

        @hookimpl
        def relax_register_reward_adapters(register):
            register(RewardSpec(name="exact-match", fn=exact_match, mode="sync",
                                label_matcher=lambda label: label is not None,
                                supports_deferred=True))
    """


# -- routing policies ------------------------------------------------------------------------


@hookspec
def relax_register_routing_policies(register: Callable[[RoutingPolicy], None]) -> None:
    """Register DIRECT replica-selection policies.

    :param register: call it once per :class:`~relax_core.records.RoutingPolicy`.

    Example::

        @hookimpl
        def relax_register_routing_policies(register):
            register(RoutingPolicy(name="random", factory=RandomSelector))
    """


# -- placement modes -------------------------------------------------------------------------


@hookspec
def relax_register_placement_modes(register: Callable[[PlacementMode], None]) -> None:
    """Register placement modes (the core registers ``decoupled``, ``split`` and ``defer``).

    :param register: call it once per :class:`~relax_core.records.PlacementMode`.

    Example::

        @hookimpl
        def relax_register_placement_modes(register):
            register(PlacementMode(name="packed", assign=assign_packed))
    """
