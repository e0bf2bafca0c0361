"""The core imports no plugin: checked statically (AST) and at run time (sys.modules)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.support import commands

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "relax_core"


def _plugin_packages() -> set[str]:
    """Top-level import packages of every plugin/contrib/test-plugin distribution in the repo."""
    names: set[str] = set()
    for pyproject in [
        *ROOT.glob("plugins/*/pyproject.toml"),
        *ROOT.glob("contrib/*/pyproject.toml"),
        *ROOT.glob("tests/plugins/*/pyproject.toml"),
    ]:
        for init in pyproject.parent.glob("*/__init__.py"):
            if init.parent.name not in {"tests"}:
                names.add(init.parent.name)
    return names


def _imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    tops: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            tops.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            tops.add(node.args[0].value.split(".")[0])
    return tops


def test_the_repository_has_plugin_packages_to_check_against() -> None:
    # Guards the two tests below against passing vacuously.
    assert "relax_testplugin" in _plugin_packages()


def test_no_core_module_imports_a_plugin_package() -> None:
    plugins = _plugin_packages()
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imported_top_levels(path) & plugins)
        for path in CORE.rglob("*.py")
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert offenders == {}, f"core modules import plugin packages: {offenders}"


def test_importing_every_core_module_loads_no_plugin_package() -> None:
    script = (
        "import importlib, json, pkgutil, sys\n"
        "import relax_core\n"
        "for m in pkgutil.walk_packages(relax_core.__path__, 'relax_core.'):\n"
        "    if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
        "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=300
    )
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "relax_core" in loaded
    assert loaded & _plugin_packages() == set()


def test_runtime_modules_do_not_need_test_dependencies() -> None:
    # `relax demo` and `relax serve` run where pytest and hypothesis are not installed.
    script = (
        "import importlib, pkgutil, sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'pytest', 'hypothesis', '_pytest'}:\n"
        "            raise ImportError(f'{name} is a test dependency')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import relax_core\n"
        "for m in pkgutil.walk_packages(relax_core.__path__, 'relax_core.'):\n"
        "    if m.name.endswith(('__main__', '.testing')):\n"
        "        continue\n"
        "    importlib.import_module(m.name)\n"
        "print('ok')\n"
    )
    out = commands.python(script, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
