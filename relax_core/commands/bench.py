"""``relax bench [NAME [--json] [--quick] [options]]``: run one registered benchmark, or list
them (benchmarks are plugins' :class:`~relax_core.records.BenchmarkSpec` records)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from relax_core.errors import ConfigError
from relax_core.plugins import Registered, get_plugin_manager
from relax_core.records import BenchmarkSpec

NAME = "bench"
HELP = "Run a registered benchmark (client, placement, manager, gateway, …) or list them."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="which benchmark (none: list them)")
    _common(parser, argparse.SUPPRESS)
    parser.add_argument("options", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def _common(parser: argparse.ArgumentParser, default: Any) -> None:
    # Accepted before and after NAME; after it they are parsed by the benchmark's own parser.
    parser.add_argument(
        "--json", action="store_true", default=default, help="print one JSON object"
    )
    parser.add_argument(
        "--quick", action="store_true", default=default, help="shorter run (for smoke tests)"
    )


def _listing(table: Mapping[str, Registered[BenchmarkSpec]]) -> str:
    if not table:
        return "no benchmark is registered: install a plugin that registers one"
    width = max(map(len, table))
    return "\n".join(
        f"{name:<{width}}  {r.record.description or '-'}  ({r.distribution})"
        for name, r in sorted(table.items())
    )


def _parse(spec: BenchmarkSpec, args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    """``(json, keyword arguments of spec.run)`` from the words after NAME."""
    parser = argparse.ArgumentParser(
        prog=f"relax bench {spec.name}", description=spec.description or None, add_help=True
    )
    _common(parser, False)
    if spec.add_arguments is not None:
        spec.add_arguments(parser)
    own, unknown = parser.parse_known_args(args.options)
    if unknown:
        raise ConfigError(
            "",
            f"relax bench {spec.name} takes no {unknown[0]}; its options: relax bench "
            f"{spec.name} --help",
        )
    values = vars(own)
    as_json = bool(values.pop("json") or getattr(args, "json", False))
    values["quick"] = bool(values["quick"] or getattr(args, "quick", False))
    return as_json, values


def run(args: argparse.Namespace) -> int:
    table = get_plugin_manager().registered("benchmarks")
    if args.name is None:
        print(_listing(table))
        return 0
    if args.name not in table:
        raise ConfigError(
            "",
            f"no benchmark named {args.name!r} is registered; known: {sorted(table)} "
            "(relax bench lists them with their plugins)",
        )
    spec = table[args.name].record
    as_json, options = _parse(spec, args)
    result = spec.run(**options)
    if as_json:
        print(json.dumps(result))
    elif spec.format_result is not None:
        print(spec.format_result(result))
    else:
        print(json.dumps(result, indent=2))
    return 0
