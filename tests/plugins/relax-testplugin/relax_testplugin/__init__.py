"""A test plugin: one reward adapter and one routing policy, found through the entry point."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relax_core import RewardSpec, RoutingPolicy, hookimpl


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
