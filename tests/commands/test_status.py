"""``relax status URL``: a role's schema-2 snapshot fetched from a real gateway and printed as a
table (or as JSON); clear messages and exit status 1 for a refused token or an unreachable URL.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from relax_core.cli import main
from relax_core.commands.status import render_snapshot
from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.schema import RoleSnapshot, RoutingSpec
from relax_core.gateway.handler import GatewayOptions
from relax_core.gateway.serving import gateway_app
from relax_core.plugins import PluginManager
from relax_core.testing import free_port, serve_app


def _publisher() -> RegistryPublisher:
    routing = RoutingSpec(
        default_model="judge", route_key_map={"math": "judge"}, aliases={"rm": "judge"}
    )
    pub = RegistryPublisher("genrm", routing)
    pub.set_model(
        "judge",
        state="READY",
        route_mode="DIRECT",
        weight_source="STATIC",
        served_model_name="judge-7b",
    )
    pub.set_engine("judge", "judge/replica-0", base_url="http://127.0.0.1:31000", state="READY")
    pub.set_engine("judge", "judge/replica-1", base_url="http://127.0.0.1:31001", state="FAILED")
    return pub


@pytest.fixture
def gateway() -> Iterator[tuple[str, RoleSnapshot]]:
    pub = _publisher()
    app = gateway_app(
        "genrm",
        pub.snapshot,
        plugin_manager=PluginManager.create(),
        options=GatewayOptions(token="s3cret"),
    )
    with serve_app(app) as url:
        yield url, pub.snapshot()


def test_status_prints_models_replicas_and_routing_of_a_role(
    gateway: tuple[str, RoleSnapshot], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = gateway
    assert main(["status", f"{url}/genrm", "--token", "s3cret"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^role genrm .*default model judge, policy round_robin\)$", out, re.M)
    assert re.search(
        r"^  judge\s+READY\s+DIRECT\s+STATIC .*served as judge-7b\s+1/2 READY$", out, re.M
    )
    assert re.search(r"judge/replica-0\s+READY\s+gen 1\s+http://127.0.0.1:31000$", out, re.M)
    # A FAILED replica is published without its URL and is never routable.
    assert re.search(r"judge/replica-1\s+FAILED\s+gen 1\s+-  \(not routable\)$", out, re.M)
    assert "route keys: math→judge" in out and "aliases: rm→judge" in out


def test_status_json_is_the_schema_2_snapshot(
    gateway: tuple[str, RoleSnapshot], capsys: pytest.CaptureFixture[str]
) -> None:
    url, snap = gateway
    assert main(["status", f"{url}/genrm/engines", "--token", "s3cret", "--json"]) == 0
    assert RoleSnapshot.from_json(json.loads(capsys.readouterr().out)) == snap


def test_status_without_the_token_says_what_the_gateway_answered(
    gateway: tuple[str, RoleSnapshot], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = gateway
    assert main(["status", f"{url}/genrm"]) == 1
    out = capsys.readouterr().out
    assert f"relax status: {url}/genrm answered 401" in out and "bearer token" in out


def test_status_of_nothing_listening_asks_whether_serve_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"http://127.0.0.1:{free_port()}/genrm"
    assert main(["status", url]) == 1
    out = capsys.readouterr().out
    assert f"relax status: cannot reach {url}" in out and "is `relax serve` running?" in out


def test_render_shows_engine_pids_when_given() -> None:
    table = render_snapshot(_publisher().snapshot(), pids={"judge/replica-0": [4242]})
    assert re.search(r"judge/replica-0 .*http://127.0.0.1:31000  pid 4242$", table, re.M)
    assert "pid" not in table.splitlines()[-2]  # replica-1: no pid known
