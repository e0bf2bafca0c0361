"""relax-rewards as the core sees it: ``relax rewards`` is registered through the real entry
point and has the options it had in the core."""

from __future__ import annotations

import argparse

from relax_rewards import REWARDS

from relax_core import PluginManager


def test_the_installed_plugin_registers_relax_rewards_through_its_entry_point(
    plugin_manager: PluginManager,
) -> None:
    table = plugin_manager.registered("commands")
    assert table["rewards"].record is REWARDS
    assert (table["rewards"].plugin, table["rewards"].distribution) == ("rewards", "relax-rewards")


def test_relax_rewards_try_parses_every_option() -> None:
    parser = argparse.ArgumentParser(prog="relax rewards")
    REWARDS.add_arguments(parser)
    args = parser.parse_args(
        [
            "try",
            "exact-match",
            "--prompt",
            "2 + 2?",
            "--response",
            "4",
            "--label",
            "4",
            "--metadata",
            '{"route_key": "math"}',
            "--role",
            "genrm=http://127.0.0.1:8100/genrm/",
            "--json",
        ]
    )
    assert (args.action, args.adapter) == ("try", "exact-match")
    assert (args.prompt, args.response, args.label) == ("2 + 2?", "4", "4")
    assert args.metadata == {"route_key": "math"}
    assert args.role == [("genrm", "http://127.0.0.1:8100/genrm")]
    assert args.json is True
