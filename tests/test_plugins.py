"""The plugin system: entry-point discovery, allow/block lists, duplicates, broken plugins."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from relax_core import PluginError, PluginManager, RoutingPolicy, WeightSource, hookimpl
from relax_core.plugins import module_plugin


def test_installed_test_plugin_is_found_through_its_entry_point() -> None:
    # tests/plugins/relax-testplugin is pip-installed into the test environment by nox.
    pm = PluginManager.create()
    reg = pm.registered("reward_adapters")["test-exact-match"]
    assert reg.plugin == "testplugin"
    assert reg.distribution == "relax-testplugin"
    assert pm.reward_adapter("test-exact-match").fn("a ", "a") == 1.0
    assert pm.registered("routing_policies")["test-first"].distribution == "relax-testplugin"


def test_core_registers_its_builtin_weight_sources(core_plugin_manager: PluginManager) -> None:
    sources = core_plugin_manager.registered("weight_sources")
    assert {"STATIC", "ACTOR", "DCS"} <= set(sources)
    assert all(sources[n].distribution == "relax-core" for n in ("STATIC", "ACTOR", "DCS"))
    assert core_plugin_manager.weight_source("STATIC").update_paths == frozenset()
    assert "tensor" in core_plugin_manager.weight_source("ACTOR").update_paths


def test_disable_list_skips_a_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAX_DISABLE_PLUGINS", "testplugin")
    pm = PluginManager.create()
    assert "test-exact-match" not in pm.registered("reward_adapters")
    assert "testplugin" not in pm.plugin_names()


def test_allow_list_loads_only_what_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAX_LOAD_PLUGINS", "testplugin")
    pm = PluginManager.create()
    assert [n for n in pm.plugin_names() if n != "relax-core"] == ["testplugin"]


def test_allow_list_naming_an_uninstalled_plugin_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RELAX_LOAD_PLUGINS", "no-such-plugin")
    with pytest.raises(PluginError, match=r"RELAX_LOAD_PLUGINS.*no-such-plugin"):
        PluginManager.create()


def _broken_distribution(tmp_path: Path) -> Path:
    """A real distribution on sys.path whose entry point raises on import."""
    site = tmp_path / "site"
    pkg = site / "relax_broken_plugin"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('boom: missing native library')\n")
    dist = site / "relax_broken_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: relax-broken-plugin\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text("[relax]\nbroken = relax_broken_plugin\n")
    return site


def test_a_broken_plugin_is_reported_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(_broken_distribution(tmp_path)))
    with pytest.raises(PluginError) as info:
        PluginManager.create()
    message = str(info.value)
    assert "'broken'" in message
    assert "relax-broken-plugin" in message
    assert "boom: missing native library" in message
    assert "RELAX_DISABLE_PLUGINS=broken" in message


def test_a_broken_plugin_can_be_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(_broken_distribution(tmp_path)))
    monkeypatch.setenv("RELAX_DISABLE_PLUGINS", "broken")
    assert "broken" not in PluginManager.create().plugin_names()


def _source_plugin(name: str) -> object:
    def relax_register_weight_sources(register: Callable[[WeightSource], None]) -> None:
        register(WeightSource(name="S3CKPT", update_paths={"disk"}, publishes_version=True))

    return module_plugin(name, relax_register_weight_sources=relax_register_weight_sources)


def test_duplicate_record_names_name_both_plugins() -> None:
    pm = PluginManager.create(
        entry_points=False,
        plugins=[("alpha-plugin", _source_plugin("a")), ("beta-plugin", _source_plugin("b"))],
    )
    with pytest.raises(PluginError) as info:
        pm.registered("weight_sources")
    message = str(info.value)
    assert "weight source name 'S3CKPT' is registered twice" in message
    assert "alpha-plugin" in message
    assert "beta-plugin" in message
    # ... and how to get going again, as for a plugin that fails to import.
    assert "Rename the weight source in one of them" in message
    assert "RELAX_DISABLE_PLUGINS=alpha-plugin or RELAX_DISABLE_PLUGINS=beta-plugin" in message


def test_a_plugin_cannot_shadow_a_builtin_record() -> None:
    def relax_register_weight_sources(register: Callable[[WeightSource], None]) -> None:
        register(WeightSource(name="STATIC", update_paths={"disk"}, publishes_version=True))

    pm = PluginManager.create(
        entry_points=False,
        plugins=[
            (
                "shadow",
                module_plugin("s", relax_register_weight_sources=relax_register_weight_sources),
            )
        ],
    )
    with pytest.raises(PluginError, match=r"relax-core.*shadow") as info:
        pm.registered("weight_sources")
    # The core cannot be disabled: only the shadowing plugin is offered.
    assert str(info.value).endswith("by its entry-point name: RELAX_DISABLE_PLUGINS=shadow")


def test_registering_the_wrong_record_type_is_an_error() -> None:
    def relax_register_routing_policies(register: Callable[[object], None]) -> None:
        register(WeightSource(name="X", update_paths=(), publishes_version=False))

    pm = PluginManager.create(
        entry_points=False,
        plugins=[
            (
                "confused",
                module_plugin("c", relax_register_routing_policies=relax_register_routing_policies),
            )
        ],
    )
    with pytest.raises(PluginError, match=r"confused.*WeightSource.*RoutingPolicy"):
        pm.registered("routing_policies")


def test_an_unknown_hook_is_rejected_at_registration() -> None:
    class Typo:
        @hookimpl
        def relax_register_role(self, register: object) -> None:  # missing "s"
            raise AssertionError("never called")

    with pytest.raises(PluginError, match=r"typo-plugin.*relax_register_role"):
        PluginManager.create(entry_points=False, plugins=[("typo-plugin", Typo())])


def test_a_hook_that_raises_is_reported_with_the_plugin_name() -> None:
    def relax_register_routing_policies(register: Callable[[RoutingPolicy], None]) -> None:
        raise KeyError("config missing")

    pm = PluginManager.create(
        entry_points=False,
        plugins=[
            (
                "fragile",
                module_plugin("f", relax_register_routing_policies=relax_register_routing_policies),
            )
        ],
    )
    with pytest.raises(
        PluginError, match=r"fragile.*relax_register_routing_policies.*config missing"
    ):
        pm.registered("routing_policies")


def test_asking_for_an_unregistered_record_says_what_is_known(
    core_plugin_manager: PluginManager,
) -> None:
    with pytest.raises(PluginError, match=r"no weight source named 'NOPE'.*ACTOR.*DCS.*STATIC"):
        core_plugin_manager.weight_source("NOPE")


def test_relax_plugins_json_lists_records_with_their_distribution() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "relax_core", "plugins", "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    data = json.loads(out.stdout)
    rows = {(r["kind"], r["name"]): r["distribution"] for r in data["records"]}
    assert rows[("weight_sources", "STATIC")] == "relax-core"
    assert rows[("reward_adapters", "test-exact-match")] == "relax-testplugin"


def test_relax_plugins_table_is_human_readable() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "relax_core", "plugins"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["KIND", "NAME", "DISTRIBUTION"]
    assert any(line.split()[:3] == ["weight_sources", "DCS", "relax-core"] for line in lines)


def test_record_names_are_validated_where_they_are_built() -> None:
    with pytest.raises(ValueError, match=r"WeightSource.name='bad name'"):
        WeightSource(name="bad name", update_paths=(), publishes_version=False)
    with pytest.raises(ValueError, match=r"unknown update paths \['teleport'\]"):
        WeightSource(name="W", update_paths={"teleport"}, publishes_version=False)
