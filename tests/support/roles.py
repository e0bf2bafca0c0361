"""Plugin managers that know roles: the core learns every role from a registered ``RoleSpec``.

Core tests that plan or serve the built-in roles register the role plugins Relax ships
explicitly (no entry-point discovery), so they see exactly those records and nothing that
happens to be installed besides.
"""

from __future__ import annotations

import pytest

from relax_core.plugins import PluginManager

__all__ = ["builtin_roles", "roles_plugin_manager"]


def builtin_roles(*plugins: tuple[str, object]) -> PluginManager:
    """The core's built-ins, the rollout, genrm and teacher role plugins, then ``plugins``."""
    import relax_genrm
    import relax_rollout
    import relax_teacher

    shipped = [("rollout", relax_rollout), ("genrm", relax_genrm), ("teacher", relax_teacher)]
    return PluginManager.create(entry_points=False, plugins=[*shipped, *plugins])


@pytest.fixture
def roles_plugin_manager() -> PluginManager:
    """A fresh :func:`builtin_roles` manager (core built-ins and the three shipped roles)."""
    return builtin_roles()
