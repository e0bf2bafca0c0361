"""The committed OpenAPI documents match the generator and the gateway app's routes.

A role's document follows its ``RoleSpec`` (``openapi`` notes, ``health_schema``): the shipped
roles' documents live in ``docs/openapi/``, a test plugin's next to its distribution
(``tests/plugins/relax-prm/openapi/prm.json``); each is checked the same way.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from starlette.routing import Route

from relax_core.gateway.app import create_gateway_app
from relax_core.gateway.handler import adapter_for_role, build_gateway_handler
from relax_core.gateway.openapi import openapi_document
from relax_core.gateway.serving import gateway_app
from relax_core.plugins import PluginManager
from relax_core.records import OpenAPINotes, RoleSpec

ROOT = Path(__file__).resolve().parents[2]
#: Every committed document.
DOCUMENTS = sorted(ROOT.glob("docs/openapi/*.json")) + sorted(
    ROOT.glob("tests/plugins/*/openapi/*.json")
)
#: The installed plugins (the shipped roles and the test plugins), read once for the ids.
PM = PluginManager.create()
ROLES = sorted(PM.registered("roles"))


def _document_dirs() -> dict[str, Path]:
    """Distribution name → where its roles' documents are committed, for this repository."""
    out = {}
    for pyproject in ROOT.glob("plugins/*/pyproject.toml"):
        out[tomllib.loads(pyproject.read_text())["project"]["name"]] = ROOT / "docs" / "openapi"
    for pyproject in ROOT.glob("tests/plugins/*/pyproject.toml"):
        out[tomllib.loads(pyproject.read_text())["project"]["name"]] = pyproject.parent / "openapi"
    return out


def _inputs(document: dict[str, object]) -> set[str]:
    schema = document["components"]["schemas"]["GenerateRequest"]  # type: ignore[index]
    return {name for branch in schema["oneOf"] for name in branch["required"]}


def test_the_repository_commits_documents_to_check() -> None:
    # Guards the parametrized tests below against passing vacuously.
    assert {p.stem for p in DOCUMENTS} >= {"rollout", "genrm", "teacher", "prm"}


@pytest.mark.parametrize("document", DOCUMENTS, ids=[p.stem for p in DOCUMENTS])
def test_committed_document_matches_the_generator(document: Path) -> None:
    committed = json.loads(document.read_text())
    assert committed == openapi_document(PM.role(document.stem)), (
        f"{document.relative_to(ROOT)} is stale: regenerate it with "
        f"`python -m relax_core.gateway.openapi {document.parent.relative_to(ROOT)}`"
    )


def test_every_role_a_distribution_of_this_repository_registers_has_a_committed_document() -> None:
    dirs = _document_dirs()
    expected = {
        dirs[reg.distribution] / f"{name}.json"
        for name, reg in PM.registered("roles").items()
        if reg.distribution in dirs
    }
    assert expected == set(DOCUMENTS)


@pytest.mark.parametrize("role", ROLES)
def test_every_app_route_is_documented_and_nothing_else(role: str) -> None:
    spec = PM.role(role)
    app = gateway_app(role, lambda: {}, plugin_manager=PM)
    served = {
        (route.path, method.lower())
        for route in app.routes
        if isinstance(route, Route)
        for method in (route.methods or ())
        if method != "HEAD"
    }
    documented = {
        (path, method) for path, ops in openapi_document(spec)["paths"].items() for method in ops
    }
    assert served == documented


@pytest.mark.parametrize("role", ROLES)
def test_forwarding_routes_document_every_error_the_gateway_maps(role: str) -> None:
    doc = openapi_document(PM.role(role))
    for path in (f"/{role}/generate", f"/{role}/v1/chat/completions", f"/{role}/chat/completions"):
        statuses = set(doc["paths"][path]["post"]["responses"])
        assert statuses == {"200", "400", "401", "413", "502", "503", "504"}
        assert "Retry-After" in doc["paths"][path]["post"]["responses"]["503"]["headers"]


@pytest.mark.parametrize("role", ROLES)
def test_each_document_lists_exactly_the_generate_inputs_its_adapter_accepts(role: str) -> None:
    adapter = adapter_for_role(PM, role)
    assert _inputs(openapi_document(PM.role(role))) == {
        "text",
        "input_ids",
        *adapter.generate_inputs,
    }


def test_only_genrm_generate_accepts_messages() -> None:
    def inputs(role: str) -> set[str]:
        return _inputs(openapi_document(PM.role(role)))

    assert inputs("genrm") == {"text", "input_ids", "messages"}
    assert inputs("teacher") == inputs("rollout") == {"text", "input_ids"}


@pytest.mark.parametrize("role", ROLES)
def test_the_documented_health_default_is_the_role_records(role: str) -> None:
    spec = PM.role(role)
    summary = openapi_document(spec)["paths"][f"/{role}/health"]["get"]["summary"]
    assert f"(default schema {spec.health_schema})" in summary


def test_a_role_without_a_record_gets_the_common_document() -> None:
    doc = openapi_document("critic")
    assert _inputs(doc) == {"text", "input_ids"}
    assert "(default schema 2)" in doc["paths"]["/critic/health"]["get"]["summary"]
    assert doc["info"]["title"] == "Relax critic gateway"


def test_notes_may_not_redefine_a_common_generate_field() -> None:
    spec = RoleSpec(
        name="critic",
        allowed_weight_sources={"STATIC"},
        default_route_mode="DIRECT",
        openapi=OpenAPINotes(generate_fields={"rid": {"type": "integer"}}),
    )
    with pytest.raises(ValueError, match="'rid' is already a common /generate field"):
        openapi_document(spec)


def test_the_writer_regenerates_the_documents_a_directory_holds(tmp_path: Path) -> None:
    shutil.copy(ROOT / "docs" / "openapi" / "genrm.json", tmp_path / "genrm.json")
    (tmp_path / "genrm.json").write_text("{}")  # stale
    done = subprocess.run(
        [sys.executable, "-m", "relax_core.gateway.openapi", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "genrm.json").read_text() == (ROOT / "docs/openapi/genrm.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["genrm.json"]


def test_the_writer_names_a_role_no_plugin_registers(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "relax_core.gateway.openapi", str(tmp_path), "critic"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "critic" in done.stderr and list(tmp_path.iterdir()) == []


def test_the_app_refuses_the_record_of_another_role() -> None:
    handler = build_gateway_handler("prm", lambda: {}, plugin_manager=PM)
    with pytest.raises(ValueError, match=r"spec is the record of role 'genrm'.*serves 'prm'"):
        create_gateway_app(handler, spec=PM.role("genrm"))
