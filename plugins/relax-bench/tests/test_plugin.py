"""relax-bench as the core sees it: every benchmark name ``relax bench`` took before it left the
core is registered through the real entry point, listed by ``relax bench``, and run by
``relax bench NAME`` with the benchmark's own options."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from relax_bench.plugin import BENCHMARKS, spec

from relax_core import BenchmarkSpec, PluginError, PluginManager, hookimpl, module_plugin

NAMES = {"async", "async_steps", "client", "defer", "gateway", "manager", "placement", "wake"}


def test_the_installed_plugin_registers_every_benchmark_through_its_entry_point(
    plugin_manager: PluginManager,
) -> None:
    table = plugin_manager.registered("benchmarks")
    assert set(table) == NAMES == set(BENCHMARKS)
    assert {(r.plugin, r.distribution) for r in table.values()} == {("bench", "relax-bench")}


def test_only_wake_takes_a_job() -> None:
    parser = argparse.ArgumentParser()
    wake = spec("wake")
    assert wake.add_arguments is not None
    wake.add_arguments(parser)
    assert parser.parse_args(["--job", "j.toml"]).job == "j.toml"
    assert all(spec(n).add_arguments is None for n in NAMES - {"wake"})


def test_a_benchmark_name_taken_twice_names_both_plugins(plugin_manager: PluginManager) -> None:
    @hookimpl
    def relax_register_benchmarks(register):  # type: ignore[no-untyped-def]
        register(BenchmarkSpec(name="client", run=lambda **_: {}))

    plugin_manager.register(
        module_plugin("other", relax_register_benchmarks=relax_register_benchmarks),
        name="other",
    )
    with pytest.raises(PluginError, match=r"'bench'.*'other'"):
        plugin_manager.benchmark("client")


def test_relax_bench_alone_lists_the_benchmarks_with_their_distribution() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "relax_core", "bench"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rows = {line.split()[0]: line for line in out.splitlines()}
    assert set(rows) == NAMES
    assert "(relax-bench)" in rows["placement"]


def test_relax_bench_placement_quick_prints_its_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "relax_core", "bench", "placement", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert {"plan_ms", "within_budget"} <= set(result)


def test_an_unknown_benchmark_is_refused_naming_the_known_ones() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "relax_core", "bench", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "no benchmark named 'nope'" in out.stderr and "'placement'" in out.stderr
