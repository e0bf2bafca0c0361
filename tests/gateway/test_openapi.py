"""The committed OpenAPI documents match the generator and the gateway app's routes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.routing import Route

from relax_core.gateway.app import create_gateway_app
from relax_core.gateway.handler import InferenceGatewayHandler
from relax_core.gateway.openapi import ROLES, openapi_document

DOCS = Path(__file__).resolve().parents[2] / "docs" / "openapi"


@pytest.mark.parametrize("role", ROLES)
def test_committed_document_matches_the_generator(role: str) -> None:
    committed = json.loads((DOCS / f"{role}.json").read_text())
    assert committed == openapi_document(role), (
        f"docs/openapi/{role}.json is stale: regenerate it with "
        "`python -m relax_core.gateway.openapi docs/openapi`"
    )


@pytest.mark.parametrize("role", ROLES)
def test_every_app_route_is_documented_and_nothing_else(role: str) -> None:
    handler = InferenceGatewayHandler(role, snapshot_provider=lambda: {})
    app = create_gateway_app(handler)
    served = {
        (route.path, method.lower())
        for route in app.routes
        if isinstance(route, Route)
        for method in (route.methods or ())
        if method != "HEAD"
    }
    documented = {
        (path, method) for path, ops in openapi_document(role)["paths"].items() for method in ops
    }
    assert served == documented


@pytest.mark.parametrize("role", ROLES)
def test_forwarding_routes_document_every_error_the_gateway_maps(role: str) -> None:
    doc = openapi_document(role)
    for path in (f"/{role}/generate", f"/{role}/v1/chat/completions", f"/{role}/chat/completions"):
        statuses = set(doc["paths"][path]["post"]["responses"])
        assert statuses == {"200", "400", "401", "413", "502", "503", "504"}
        assert "Retry-After" in doc["paths"][path]["post"]["responses"]["503"]["headers"]


def test_only_genrm_generate_accepts_messages() -> None:
    def inputs(role: str) -> set[str]:
        schema = openapi_document(role)["components"]["schemas"]["GenerateRequest"]
        return {name for branch in schema["oneOf"] for name in branch["required"]}

    assert inputs("genrm") == {"text", "input_ids", "messages"}
    assert inputs("teacher") == inputs("rollout") == {"text", "input_ids"}
