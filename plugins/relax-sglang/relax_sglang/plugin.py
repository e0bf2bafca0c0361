"""The ``relax`` entry point of relax-sglang: engine backend ``sglang`` and the routers
``sglang-router`` and ``smg``."""

from __future__ import annotations

from collections.abc import Callable

from relax_core import ControlClient, EngineBackend, RouterBackend, hookimpl
from relax_sglang.engine import launch
from relax_sglang.router import SGLANG_ROUTER, SMG, router_backend

__all__ = [
    "SGLANG_BACKEND",
    "relax_register_engine_backends",
    "relax_register_routers",
]

SGLANG_BACKEND = EngineBackend(
    name="sglang",
    launch=launch,
    control_client=ControlClient,
    devices={"cuda"},
    multi_node=True,
    description=(
        "Real SGLang servers (python -m sglang.launch_server): tensor/pipeline/data parallel, "
        "multi-node replicas, prefill/decode disaggregation."
    ),
)


@hookimpl
def relax_register_engine_backends(register: Callable[[EngineBackend], None]) -> None:
    """Register the ``sglang`` engine backend."""
    register(SGLANG_BACKEND)


@hookimpl
def relax_register_routers(register: Callable[[RouterBackend], None]) -> None:
    """Register ``smg`` (the default router) and ``sglang-router``."""
    register(router_backend(SMG, default=True))
    register(router_backend(SGLANG_ROUTER))
