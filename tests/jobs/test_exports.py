"""relax_core.jobs exports the one job runtime both commands drive (that ``__all__`` is exactly
its public names is checked for every package by ``tests/test_exported_members.py``)."""

from __future__ import annotations

import relax_core.jobs as jobs


def test_the_runtime_both_commands_drive_is_exported_under_the_package_name() -> None:
    for name in (
        "JobRuntime", "ModelHandle", "LocalModel", "RayModel", "RoleService", "ServedJob",
        "serve_job", "check_job", "start_order", "ray_session", "ShutdownSignals",
    ):  # fmt: skip
        assert name in jobs.__all__
    classes = [getattr(jobs, n) for n in jobs.__all__ if isinstance(getattr(jobs, n), type)]
    assert {c.__name__: c.__module__ for c in classes if c.__module__ != "relax_core.jobs"} == {}
