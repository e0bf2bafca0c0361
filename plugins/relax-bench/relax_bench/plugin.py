"""The benchmarks' registration (``relax_register_benchmarks``), and ``relax run --measure``'s
switch report (``relax_register_run_probes``: the run probe ``switching``).

Each benchmark's module is imported when it runs, not when the plugin loads: plugins load in
every ``relax`` command, and a benchmark pulls in aiohttp, Ray or the gateway's server.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from relax_bench.measure import SwitchProbe
from relax_core import BenchmarkSpec, RunProbeSpec, hookimpl

#: name -> (module of this package, one line of what it measures)
BENCHMARKS: Mapping[str, tuple[str, str]] = {
    "async": ("async_steps", "synchronous vs asynchronous steps of one simulated job"),
    # The module's own name, accepted as before (`relax bench async_steps`).
    "async_steps": ("async_steps", "alias of async (its module's name)"),
    "client": ("client", "route resolution, and InferenceClient against bare aiohttp"),
    "defer": ("defer", "the coordinator's and the deferred batch's own time per batch"),
    "gateway": ("gateway", "the role gateway against the upstream direct and sglang-router"),
    "manager": ("manager", "the InferenceManager's parallel fan-out and own overhead"),
    "placement": ("placement", "preflight planning of a 512-node x 8-GPU job"),
    "wake": ("wake", "on-demand wake under relax serve, as a client sees it"),
}


def _module(name: str) -> Any:
    return importlib.import_module(f"{__package__}.{name}")


def _run(module: str) -> Callable[..., Mapping[str, Any]]:
    def run(**options: Any) -> Mapping[str, Any]:
        result: Mapping[str, Any] = _module(module).run(**options)
        return result

    return run


def _format(module: str) -> Callable[[Mapping[str, Any]], str]:
    def format_result(result: Mapping[str, Any]) -> str:
        text: str = _module(module).format_result(result)
        return text

    return format_result


def _wake_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--job",
        metavar="JOB",
        help="the job file to serve (a defer layout; default: the demo job)",
    )


def spec(name: str) -> BenchmarkSpec:
    """The record of the benchmark ``name`` (a key of :data:`BENCHMARKS`)."""
    module, description = BENCHMARKS[name]
    return BenchmarkSpec(
        name=name,
        run=_run(module),
        description=description,
        add_arguments=_wake_arguments if module == "wake" else None,
        format_result=_format(module),
    )


@hookimpl
def relax_register_benchmarks(register: Callable[[BenchmarkSpec], None]) -> None:
    """Register every benchmark of :data:`BENCHMARKS`."""
    for name in BENCHMARKS:
        register(spec(name))


@hookimpl
def relax_register_run_probes(register: Callable[[RunProbeSpec], None]) -> None:
    """Register ``switching``: every phase switch of a ``relax run --measure`` against a copy of
    the bytes it moves."""
    register(
        RunProbeSpec(
            name="switching",
            start=SwitchProbe,
            description="each phase switch against a pinned copy of the bytes it moves",
        )
    )
