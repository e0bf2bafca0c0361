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


def method(relative: str, cls: str, name: str) -> ast.FunctionDef:
    """Method ``name`` of class ``cls`` in a file of the installed ``sglang`` package."""
    for node in ast.walk(tree(relative)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == name:
                    return item  # type: ignore[return-value]
    raise AssertionError(f"SGLang's {relative} has no {cls}.{name}: was it renamed?")


def function(relative: str, cls: str, name: str, **globals_: Any) -> Any:
    """A pure method of SGLang's (one that needs nothing but its arguments and
    ``globals_``), compiled from its source as a plain function."""
    node = method(relative, cls, name)
    node.decorator_list = []
    module = ast.Module(body=[node], type_ignores=[])
    namespace: dict[str, Any] = {"Any": Any, "Optional": Any, **globals_}
    exec(compile(ast.fix_missing_locations(module), str(path(relative)), "exec"), namespace)
    return namespace[name]


def returned_keys(relative: str, cls: str, name: str) -> list[str]:
    """The string keys of the dict literal method ``name`` returns last."""
    node = method(relative, cls, name)
    returns = [
        n for n in ast.walk(node) if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict)
    ]
    assert returns, f"SGLang's {cls}.{name} returns no dict literal"
    keys = returns[-1].value.keys  # type: ignore[union-attr]
    return [k.value for k in keys if isinstance(k, ast.Constant)]
