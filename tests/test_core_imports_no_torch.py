"""The core imports no torch: trainers and engines that need it are plugins. Checked statically
(AST: no module imports torch, safetensors' torch API or a torch-built framework, but for the
allow-listed function-level imports below) and at run time (importing every core module leaves
``torch`` out of ``sys.modules``)."""

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

#: ``(module, function)`` allowed to import torch inside the function. Each runs only in a
#: caller that already holds tensors, so torch is the caller's.
ALLOWED = {
    # Encodes a trainer's (name, tensor) pairs for /update_weights_from_tensor: safetensors'
    # torch API, or torch.multiprocessing's reductions for SGLang's own format.
    ("relax_core/engine/control.py", "serialize_named_tensors"),
    # A weight bucket's flat buffer, filled from the trainer's tensors, and its SGLang
    # flattened_bucket payload (torch.multiprocessing's reductions).
    ("relax_core/engine/buckets.py", "flatten"),
    ("relax_core/engine/buckets.py", "serialize"),
}


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


def test_no_core_module_imports_torch_outside_the_allow_list() -> None:
    offenders: dict[str, list[str]] = {}
    allowed_seen: set[tuple[str, str]] = set()
    for path in sorted(CORE.rglob("*.py")):
        where = str(path.relative_to(ROOT))
        for function, module in torch_imports(path):
            if function is not None and (where, function) in ALLOWED:
                allowed_seen.add((where, function))
                continue
            offenders.setdefault(where, []).append(f"{module} (in {function or 'the module'})")
    assert offenders == {}, f"the core imports torch; move the code to a plugin: {offenders}"
    # An entry whose import is gone must leave the list, so the list stays the truth.
    assert allowed_seen == ALLOWED


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
