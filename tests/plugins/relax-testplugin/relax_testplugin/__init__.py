"""A test plugin: one reward adapter, one routing policy and one engine backend (``test-sim``),
found through the entry point."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from relax_core import (
    ControlClient,
    EngineBackend,
    EngineLaunchSpec,
    RewardSpec,
    RoutingPolicy,
    SubprocessEngineProcess,
    hookimpl,
)


def exact_match(response: str, label: str) -> float:
    return 1.0 if response.strip() == label.strip() else 0.0


class FirstSelector:
    """Always picks the first candidate (deterministic; only for tests)."""

    def select(self, *, candidates: tuple[Any, ...], **_: Any) -> Any:
        return candidates[0]


@hookimpl
def relax_register_reward_adapters(register: Callable[[RewardSpec], None]) -> None:
    register(RewardSpec(name="test-exact-match", fn=exact_match, description="test plugin"))


@hookimpl
def relax_register_routing_policies(register: Callable[[RoutingPolicy], None]) -> None:
    register(RoutingPolicy(name="test-first", factory=FirstSelector, description="test plugin"))


def _launch_sim(spec: EngineLaunchSpec) -> SubprocessEngineProcess:
    """The core's lightweight SGLang-protocol engine (no model) as a real engine process."""
    argv = [sys.executable, "-m", "relax_core.bench._sim_engine", "--host", spec.host]
    argv += ["--port", str(spec.port), "--engine-id", spec.engine_id]
    argv += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank)]
    if spec.dist_init_addr:
        argv += ["--dist-init-addr", spec.dist_init_addr]
    return SubprocessEngineProcess.start(
        [*argv, *spec.options.extra_args],
        base_url=f"http://{spec.host}:{spec.port}" if spec.node_rank == 0 else None,
        engine_id=spec.engine_id,
        log_path=spec.log_path,
    )


@hookimpl
def relax_register_engine_backends(register: Callable[[EngineBackend], None]) -> None:
    # Declared for cuda too (it touches no device), so a test can place it on Ray's fake GPUs
    # and exercise placement groups under `relax serve` without a GPU or a model.
    register(
        EngineBackend(
            name="test-sim",
            launch=_launch_sim,
            control_client=ControlClient,
            devices={"cpu", "cuda"},
            multi_node=True,
            description="test plugin: the core's simulated SGLang-protocol engine, no model",
            loads_model_dir=False,
        )
    )
