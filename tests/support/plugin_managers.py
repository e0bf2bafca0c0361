"""Plugin managers of one test plugin that registers records (no entry-point discovery)."""

from __future__ import annotations

from collections.abc import Callable

from relax_core.plugins import PluginManager, module_plugin


def registering(name: str, hook: str, *records: object) -> PluginManager:
    """The core's built-ins and one plugin ``name`` whose registration hook ``hook`` (e.g.
    ``relax_register_roles``) registers ``records``, in order."""

    def register_all(register: Callable[[object], None]) -> None:
        for record in records:
            register(record)

    plugin = module_plugin(name, **{hook: register_all})
    return PluginManager.create(entry_points=False, plugins=[(name, plugin)])
