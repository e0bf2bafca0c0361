"""The core imports no torch: trainers and engines that need it are plugins. Checked statically
(AST: no module imports torch, safetensors' torch API or a torch-built framework, at the top or
inside any function body, with no exception) and at run time (importing every core module
leaves ``torch`` out of ``sys.modules``)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "relax_core"

#: Modules that pull torch in when imported.
TORCH_MODULES = ("torch", "safetensors.torch", "transformers", "accelerate", "deepspeed")


def _is_torch(module: str) -> bool:
    return any(module == t or module.startswith(f"{t}.") for t in TORCH_MODULES)


def torch_imports(path: Path) -> list[tuple[str | None, str]]:
    """``(enclosing function or None, imported module)`` of every torch import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str | None, str]] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, child.name if function is None else function)
                continue
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
            elif (
                isinstance(child, ast.Call)
                and getattr(child.func, "attr", getattr(child.func, "id", None)) == "import_module"
                and child.args
                and isinstance(child.args[0], ast.Constant)
                and isinstance(child.args[0].value, str)
            ):
                names = [child.args[0].value]
            found.extend((function, n) for n in names if _is_torch(n))
            visit(child, function)

    visit(tree, None)
    return found


def test_no_core_module_imports_torch_anywhere() -> None:
    # Tensor code belongs to whoever holds the tensors (the trainer, the engine, a torch-side
    # helper library they depend on): no function of the core imports torch either.
    offenders: dict[str, list[str]] = {}
    for path in sorted(CORE.rglob("*.py")):
        for function, module in torch_imports(path):
            where = str(path.relative_to(ROOT))
            offenders.setdefault(where, []).append(f"{module} (in {function or 'the module'})")
    assert offenders == {}, f"the core imports torch; move the code to a plugin: {offenders}"


def test_the_check_finds_module_level_and_function_level_torch_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        '"""Mentions torch in a docstring, which is fine."""\n'
        "import json\n"
        "from torch import nn\n"
        "def save(pairs):\n"
        "    from safetensors.torch import save\n"
        "    import importlib\n"
        "    return importlib.import_module('torch.multiprocessing')\n"
    )
    assert torch_imports(probe) == [
        (None, "torch"),
        (None, "torch.nn"),
        ("save", "safetensors.torch"),
        ("save", "safetensors.torch.save"),
        ("save", "torch.multiprocessing"),
    ]


def test_importing_every_core_module_imports_no_torch() -> None:
    script = (
        "import importlib, json, pkgutil, sys\n"
        "import relax_core\n"
        "names = []\n"
        "for m in pkgutil.walk_packages(relax_core.__path__, 'relax_core.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "        names.append(m.name)\n"
        "loaded = sorted(n for n in sys.modules if n.split('.')[0] in {'torch', 'transformers'})\n"
        "print(json.dumps({'modules': len(names), 'torch': loaded}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["modules"] > 50  # every module was imported, not none
    assert result["torch"] == []
