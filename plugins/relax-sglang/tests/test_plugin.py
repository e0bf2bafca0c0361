"""relax-sglang is found through real entry-point discovery, as installed."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

from relax_core import PluginManager


def test_the_installed_distribution_registers_the_sglang_backend_and_both_routers() -> None:
    pm = PluginManager.create()
    backend = pm.registered("engine_backends")["sglang"]
    assert (backend.plugin, backend.distribution) == ("sglang", "relax-sglang")
    assert backend.record.multi_node and backend.record.devices == {"cuda"}
    routers = pm.registered("routers")
    assert {routers[n].distribution for n in ("smg", "sglang-router")} == {"relax-sglang"}
    smg, old = pm.router("smg"), pm.router("sglang-router")
    assert smg.default and not old.default
    assert smg.version == importlib.metadata.version("smg")
    assert old.version == importlib.metadata.version("sglang-router")
    assert "consistent_hashing" in smg.policies and "consistent_hashing" not in old.policies
    assert smg.keeps_unknown_fields and not old.keeps_unknown_fields


def test_relax_plugins_lists_the_routers_with_their_distribution() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "relax_core", "plugins", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rows = {(r["kind"], r["name"]): r["distribution"] for r in json.loads(done.stdout)["records"]}
    assert rows[("routers", "smg")] == rows[("engine_backends", "sglang")] == "relax-sglang"
    assert rows[("routers", "sglang-router")] == "relax-sglang"
