"""The ``relax`` command line.

Sub-commands are modules of :mod:`relax_core.commands`; each defines ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int`` (the exit status).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from relax_core import commands
from relax_core.errors import RelaxError


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every sub-command found in :mod:`relax_core.commands`."""
    parser = argparse.ArgumentParser(
        prog="relax",
        description="Relax: the inference side of LLM RL post-training (rollout, genrm, teacher) "
        "on one core. Each command's --help says more; docs/ has the guides.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``relax`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except RelaxError as exc:
        print(f"relax {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
