"""The installed SGLang's source, read without importing it.

Importing ``sglang`` runs its package ``__init__``, which pulls the GPU runtime (triton, CUDA
kernels) that the CPU-only test session does not install (it installs SGLang with
``--no-deps``); tests that hold the engine to SGLang's behaviour read its source instead.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any


def path(relative: str) -> Path:
    """A file of the installed ``sglang`` package (``srt/entrypoints/openai/protocol.py``)."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, (
        "sglang is not installed: the test session installs it with --no-deps (see noxfile.py)"
    )
    return Path(next(iter(spec.submodule_search_locations))) / relative


def tree(relative: str) -> ast.Module:
    """The parsed source of a file of the installed ``sglang`` package."""
    return ast.parse(path(relative).read_text())


def definition(relative: str, name: str, cls: str | None = None) -> ast.FunctionDef:
    """Function ``name`` (a method of class ``cls``) in a file of the installed ``sglang``."""
    body = tree(relative).body
    if cls is not None:
        found = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == cls), None)
        assert found is not None, f"SGLang's {relative} has no class {cls}: was it renamed?"
        body = found.body
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"SGLang's {relative} has no {cls or 'module'}.{name}: was it renamed?")


def constant(relative: str, name: str) -> Any:
    """The literal value of module-level constant ``name`` in a file of the installed
    ``sglang`` package (``GRAPH_MEMORY_USAGE_KEYS``)."""
    for node in tree(relative).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"SGLang's {relative} has no constant {name}: was it renamed?")


def function(relative: str, name: str, cls: str | None = None, **globals_: Any) -> Any:
    """A pure function or method of SGLang's (one that needs nothing but its arguments and
    ``globals_``), compiled from its source as a plain function."""
    node = definition(relative, name, cls)
    node.decorator_list = []
    module = ast.Module(body=[node], type_ignores=[])
    namespace: dict[str, Any] = {"Any": Any, "Optional": Any, **globals_}
    exec(compile(ast.fix_missing_locations(module), str(path(relative)), "exec"), namespace)
    return namespace[name]


def returned_keys(relative: str, name: str, cls: str | None = None) -> list[str]:
    """The string keys of the dict literal function ``name`` returns last."""
    node = definition(relative, name, cls)
    returns = [
        n for n in ast.walk(node) if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict)
    ]
    assert returns, f"SGLang's {name} returns no dict literal"
    keys = returns[-1].value.keys  # type: ignore[union-attr]
    return [k.value for k in keys if isinstance(k, ast.Constant)]
