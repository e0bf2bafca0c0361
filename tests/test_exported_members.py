"""The public API is small and explicit: ``__all__`` is exactly what each package exports, every
exported class reports the package it is exported from, and plugins import only that API."""

from __future__ import annotations

import ast
import importlib
import pickle
from pathlib import Path
from types import ModuleType

import pytest

import relax_core

ROOT = Path(__file__).resolve().parents[1]

#: Private-looking names that are part of the API all the same.
INCLUDED_PRIVATE = {"__version__"}

PACKAGES = [
    "relax_core.client",
    "relax_core.coordination",
    "relax_core.discovery",
    "relax_core.engine",
    "relax_core.gateway",
    "relax_core.jobs",
    "relax_core.manager",
    "relax_core.placement",
    "relax_core.run",
    "relax_core.tracking",
]

#: What a plugin may import from the core.
ALLOWED_CORE_IMPORTS = {"relax_core", "relax_core.testing"}


def _public_names(module: ModuleType) -> list[str]:
    """What a package's namespace holds for its readers: every name not starting with ``_``
    (and :data:`INCLUDED_PRIVATE`), submodules aside, sorted."""
    return sorted(
        name
        for name, value in vars(module).items()
        if (not name.startswith("_") or name in INCLUDED_PRIVATE)
        and not isinstance(value, ModuleType)
    )


@pytest.mark.parametrize("package", ["relax_core", *PACKAGES])
def test_all_is_exactly_what_the_package_imports(package: str) -> None:
    # Derived, as httpx's own test does: the list is written once, in the package's __init__;
    # a name imported there and left out of __all__ (or listed and not imported) fails here.
    # (Its order is ruff's, RUF022: constants, classes, then functions.)
    module = importlib.import_module(package)
    assert sorted(module.__all__) == _public_names(module)


def test_the_public_api_holds_what_plugins_build_on() -> None:
    # Guards the test above against a package that exports nothing by accident.
    assert {"hookimpl", "RoleSpec", "Sample", "InferenceClient", "TrainerSpec"} <= set(
        relax_core.__all__
    )


@pytest.mark.parametrize("package", ["relax_core", *PACKAGES])
def test_exported_classes_report_the_package_they_are_exported_from(package: str) -> None:
    module = importlib.import_module(package)
    top = set(relax_core.__all__)
    wrong = {}
    for name in module.__all__:
        value = getattr(module, name)
        if not isinstance(value, type):
            continue
        # A class exported at the top level reports relax_core wherever else it is exported.
        expected = "relax_core" if name in top else package
        if value.__module__ != expected:
            wrong[name] = value.__module__
    assert wrong == {}


def test_exported_classes_pickle_by_their_public_name() -> None:
    error = relax_core.RoutingError(503, "no replica", retry_after=2.0)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is relax_core.RoutingError and back.retry_after == 2.0
    assert pickle.loads(pickle.dumps(relax_core.ModelState.READY)) is relax_core.ModelState.READY


def _plugin_sources() -> list[Path]:
    roots = [
        *ROOT.glob("plugins/*/"),
        *ROOT.glob("contrib/*/"),
        *ROOT.glob("tests/plugins/*/"),
    ]
    return sorted(p for root in roots for p in root.rglob("*.py"))


def _core_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "relax_core")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.level == 0
            and node.module.split(".")[0] == "relax_core"
        ):
            found.add(node.module)
    return found


def test_there_are_plugin_sources_to_check() -> None:
    # Guards the test below against passing vacuously.
    names = {p.parent.name for p in _plugin_sources()}
    assert {"relax_hf", "relax_genrm", "relax_testplugin"} <= names


def test_plugins_import_only_the_public_api_of_the_core() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(_core_imports(path) - ALLOWED_CORE_IMPORTS)
        for path in _plugin_sources()
    }
    assert {k: v for k, v in offenders.items() if v} == {}
