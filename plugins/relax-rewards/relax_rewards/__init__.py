"""Relax's reward-adapter tool: ``relax rewards try ADAPTER``, one registered reward adapter
run on one sample in this process, as ``relax run``'s reward stage calls it, with nothing
started (:mod:`~relax_rewards.command`), registered through ``relax_register_commands``.
"""

from __future__ import annotations

from collections.abc import Callable

from relax_core import CommandSpec, hookimpl
from relax_rewards import command

__all__ = ["REWARDS", "relax_register_commands"]

REWARDS = CommandSpec(
    name=command.NAME,
    help=command.HELP,
    add_arguments=command.add_arguments,
    run=command.run,
)


@hookimpl
def relax_register_commands(register: Callable[[CommandSpec], None]) -> None:
    """Register ``relax rewards``."""
    register(REWARDS)
