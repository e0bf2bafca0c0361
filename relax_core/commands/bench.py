"""``relax bench NAME [--json]``: run one benchmark of :mod:`relax_core.bench`."""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil

from relax_core import bench

NAME = "bench"
HELP = "Run a benchmark (client, placement, manager, gateway, …) and print its numbers."


def _names() -> list[str]:
    return sorted(
        m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_")
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=_names(), help="which benchmark")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="shorter run (for smoke tests)")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"{bench.__name__}.{args.name}")
    result = module.run(quick=args.quick)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            module.format_result(result)
            if hasattr(module, "format_result")
            else json.dumps(result, indent=2)
        )
    return 0
