"""The core knows roles only from their records: no module of it names a shipped role.

Every role-name constant or branch (``role == "genrm"``, ``{"genrm", "teacher"}``, a title
table) is a string literal equal to a role's name; docstrings may mention roles.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.roles import builtin_roles

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "relax_core"


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def role_literals(path: Path, roles: set[str]) -> list[str]:
    """``line: 'name'`` of every string literal in ``path`` (docstrings aside) that is a role."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstrings(tree)
    return [
        f"{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docs
        and node.value in roles
    ]


def test_no_core_module_names_a_shipped_or_test_role() -> None:
    roles = set(builtin_roles().registered("roles")) | {"prm"}
    assert {"rollout", "genrm", "teacher"} <= roles  # the check below is not vacuous
    found = {
        str(path.relative_to(ROOT)): hits
        for path in sorted(CORE.rglob("*.py"))
        if (hits := role_literals(path, roles))
    }
    assert found == {}, "the core names roles; take the fact from the role's RoleSpec instead"


def test_the_check_finds_a_branch_on_a_role_name(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        '"""Mentions genrm in a docstring, which is fine."""\n\n\n'
        "def health_default(role):\n"
        '    return 1 if role == "genrm" else 2\n'
    )
    assert role_literals(probe, {"genrm"}) == ["5: 'genrm'"]
