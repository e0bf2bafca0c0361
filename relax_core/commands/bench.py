"""``relax bench NAME [--json]``: run one benchmark of :mod:`relax_core.bench`."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil

from relax_core import bench
from relax_core.errors import ConfigError

NAME = "bench"
HELP = "Run a benchmark (client, placement, manager, gateway, …) and print its numbers."


#: Benchmark names that are not module names (``async`` is a Python keyword); the module's
#: own name is accepted too (``nox -s bench`` runs each module by its name).
_ALIASES = {"async": "async_steps"}


def _names() -> list[str]:
    modules = {m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_")}
    return sorted(modules | set(_ALIASES))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=_names(), help="which benchmark")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="shorter run (for smoke tests)")
    parser.add_argument(
        "--job",
        metavar="JOB",
        help="the job file to serve (benchmarks of a served job: wake; default: the demo job)",
    )


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"{bench.__name__}.{_ALIASES.get(args.name, args.name)}")
    if args.job is not None and "job" not in inspect.signature(module.run).parameters:
        raise ConfigError(
            "--job", f"relax bench {args.name} serves no job; only relax bench wake takes --job"
        )
    result = module.run(quick=args.quick, **({"job": args.job} if args.job else {}))
    if args.json:
        print(json.dumps(result))
    else:
        print(
            module.format_result(result)
            if hasattr(module, "format_result")
            else json.dumps(result, indent=2)
        )
    return 0
