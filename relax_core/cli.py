"""The ``relax`` command line.

Sub-commands are the modules of :mod:`relax_core.commands` (each defines ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``, the exit status) and the commands plugins
register (:class:`~relax_core.records.CommandSpec`, ``relax_register_commands``)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from relax_core import commands
from relax_core.errors import PluginError, RelaxError


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every sub-command found in :mod:`relax_core.commands` and
    every command a plugin registers (the process-wide plugin manager's).

    :raises PluginError: a plugin's command has the name of one of the core's."""
    from relax_core.plugins import get_plugin_manager

    parser = argparse.ArgumentParser(
        prog="relax",
        description="Relax: the inference side of LLM RL post-training (rollout, genrm, teacher) "
        "on one core. Each command's --help says more; docs/ has the guides.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    core: set[str] = set()
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
        core.add(module.NAME)
    for name, found in sorted(get_plugin_manager().registered("commands").items()):
        if name in core:
            raise PluginError(
                f"the command {name!r} of plugin {found.plugin!r} has the name of one of "
                f"relax-core's commands; rename it, or disable the plugin: "
                f"RELAX_DISABLE_PLUGINS={found.plugin}"
            )
        spec = found.record
        p = sub.add_parser(name, help=spec.help, description=spec.help)
        spec.add_arguments(p)
        p.set_defaults(_run=spec.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``relax`` on ``argv`` (default: this process's command line) in this process and
    return its exit status: the console script's entry point, and how a plugin's command runs
    another (``main(["run", "job.toml"])``), as ``pytest.main`` does. A usage error exits
    (:class:`SystemExit`, status 2), as ``argparse`` does."""
    try:
        parser = build_parser()
    except RelaxError as exc:
        # The plugins load before the command line is parsed: name the command that was asked.
        words = list(sys.argv[1:] if argv is None else argv)
        command = next((w for w in words if not w.startswith("-")), None)
        print(f"relax{f' {command}' if command else ''}: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return int(args._run(args))
    except RelaxError as exc:
        print(f"relax {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
