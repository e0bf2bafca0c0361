"""The role gateway forwards through the client's data path and maps every failure it sees.

Real uvicorn gateways in front of real upstream server processes on loopback.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import gateway as gs
from tests.support.roles import builtin_roles


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Any, Any]]:
    with gs.upstream("math-0") as a, gs.upstream("code-0") as b:
        yield a, b


@pytest.fixture
def registry(engines: tuple[Any, Any]) -> Any:
    a, b = engines
    return gs.Registry(
        gs.snapshot(
            "teacher",
            {"math": {"urls": [a.url], "served": "Qwen/Math"}, "code": {"urls": [b.url]}},
            route_key_map={"code-data": "code"},
            aliases={"teacher-checkpoint": "math"},
        )
    )


@pytest.fixture
def gw(registry: Any) -> Iterator[str]:
    with gs.gateway("teacher", registry) as url:
        yield url


def error_of(body: bytes) -> dict[str, Any]:
    data = json.loads(body)
    assert set(data) == {"error"} and data["error"]["message"]
    return dict(data["error"])


def test_generate_drops_model_and_route_key_and_keeps_request_id_and_routing_key(
    gw: str, engines: tuple[Any, Any]
) -> None:
    status, headers, body = gs.post(
        f"{gw}/teacher/generate",
        {
            "input_ids": [1, 2, 3],
            "model": "teacher-checkpoint",
            "route_key": "x",
            "return_logprob": True,
        },
        {"X-Request-ID": "req-42", "X-SMG-Routing-Key": "group-7"},
    )
    assert status == 200, body
    assert json.loads(body)["text"].startswith("math-0:")
    assert headers["x-request-id"] == "req-42"
    last = engines[0].last()
    assert last["body"] == {"input_ids": [1, 2, 3], "return_logprob": True}
    sent = {k: v for k, v in last["headers"]}
    assert sent["x-request-id"] == "req-42" and sent["x-smg-routing-key"] == "group-7"


def test_hop_by_hop_headers_and_those_named_in_connection_are_dropped(
    gw: str, engines: tuple[Any, Any]
) -> None:
    # urllib sends "Connection: close" itself; the extra header is named by it via X-Hop.
    status, _, _ = gs.post(
        f"{gw}/teacher/generate",
        {"text": "hi"},
        {
            "Keep-Alive": "timeout=5",
            "Proxy-Authorization": "secret",
            "X-End-To-End": "kept",
            "TE": "trailers",
        },
    )
    assert status == 200
    sent = {k for k, _ in engines[0].last()["headers"]}
    assert "x-end-to-end" in sent
    assert not sent & {"keep-alive", "proxy-authorization", "te"}


def test_connection_named_headers_are_dropped(gw: str, engines: tuple[Any, Any]) -> None:
    import http.client

    host, port = gw.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request(
        "POST",
        "/teacher/generate",
        body=json.dumps({"text": "hi"}),
        headers={
            "Content-Type": "application/json",
            "Connection": "keep-alive, X-Private",
            "X-Private": "1",
        },
    )
    assert conn.getresponse().status == 200
    conn.close()
    sent = {k for k, _ in engines[0].last()["headers"]}
    assert "x-private" not in sent and "connection" not in sent


def test_route_key_selects_the_model(gw: str, engines: tuple[Any, Any]) -> None:
    status, _, body = gs.post(f"{gw}/teacher/generate", {"text": "x", "route_key": "code-data"})
    assert status == 200 and json.loads(body)["text"].startswith("code-0:")


def test_chat_rewrites_model_to_the_served_model_name(gw: str, engines: tuple[Any, Any]) -> None:
    for path in ("/teacher/v1/chat/completions", "/teacher/chat/completions"):
        status, _, body = gs.post(
            gw + path, {"model": "math", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 200, body
        assert json.loads(body)["choices"][0]["message"]["content"].startswith("math-0:")
        last = engines[0].last()
        assert last["path"] == "/v1/chat/completions" and last["body"]["model"] == "Qwen/Math"


def test_a_gateway_routes_with_the_policies_of_the_plugin_manager_it_was_built_with(
    engines: tuple[Any, Any],
) -> None:
    from relax_core.plugins import get_plugin_manager
    from relax_core.records import RoutingPolicy

    class LastHead:
        def select(self, *, candidates: tuple[Any, ...], **_: Any) -> Any:
            return candidates[-1]

    # Registered with the gateway's plugin manager only, not with the process-wide one.
    policy = RoutingPolicy(name="last-head", factory=LastHead)
    assert "last-head" not in get_plugin_manager().registered("routing_policies")
    pm = gs.role_plugin_manager("teacher", policies=[policy])
    a, b = engines
    registry = gs.Registry(
        gs.snapshot("teacher", {"math": {"urls": [a.url, b.url]}}, policy="last-head")
    )
    with gs.gateway("teacher", registry, plugin_manager=pm) as url:
        answers = [gs.post(f"{url}/teacher/generate", {"text": "x"}) for _ in range(4)]
    assert [status for status, _, _ in answers] == [200] * 4, answers
    assert {json.loads(body)["text"].split(":")[0] for _, _, body in answers} == {"code-0"}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "empty"),
        (b"[1, 2]", "JSON object"),
        ({"text": "a", "input_ids": [1]}, "exactly one input"),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": "lots"}},
            "sampling_params.max_new_tokens",
        ),
        ({"text": "a", "model": "nope"}, "nope"),
        ({"text": "a", "route_key": "unmapped"}, "unmapped"),
        ({"text": "a", "stream": "yes"}, "stream"),
    ],
)
def test_bad_requests_are_400_with_a_message(gw: str, body: Any, needle: str) -> None:
    status, _, raw = gs.post(f"{gw}/teacher/generate", body)
    assert status == 400
    err = error_of(raw)
    assert needle in err["message"] and err["code"] == 400


def test_sleeping_model_returns_503_with_retry_after_and_sends_nothing(
    registry: Any, engines: tuple[Any, Any]
) -> None:
    a, _b = engines
    registry.value = gs.snapshot("teacher", {"math": {"urls": [a.url], "state": "SLEEPING"}})
    before = a.stats()["requests"]
    with gs.gateway("teacher", registry) as url:
        status, headers, body = gs.post(f"{url}/teacher/generate", {"text": "x"})
    assert status == 503 and int(headers["retry-after"]) >= 1
    assert "SLEEPING" in error_of(body)["message"] or "offloaded" in error_of(body)["message"]
    assert a.stats()["requests"] == before


def test_registry_down_keeps_the_gateway_alive_but_not_ready(registry: Any, gw: str) -> None:
    registry.down = True
    status, headers, body = gs.post(f"{gw}/teacher/generate", {"text": "x"})
    assert status == 503 and "registry unavailable" in error_of(body)["message"]
    assert "retry-after" in headers
    status, _, body = gs.get(f"{gw}/teacher/health")
    assert status == 503 and json.loads(body)["ready"] is False
    assert gs.get(f"{gw}/teacher/engines")[0] == 503
    registry.down = False
    assert gs.post(f"{gw}/teacher/generate", {"text": "x"})[0] == 200
    assert json.loads(gs.get(f"{gw}/teacher/health")[2])["ready"] is True


def test_unreachable_engine_is_502(registry: Any) -> None:
    from relax_core.testing import free_port

    registry.value = gs.snapshot("teacher", {"math": {"urls": [f"http://127.0.0.1:{free_port()}"]}})
    with gs.gateway("teacher", registry) as url:
        status, _, body = gs.post(f"{url}/teacher/generate", {"text": "x"})
    assert status == 502 and "could not be reached" in error_of(body)["message"]


@pytest.mark.parametrize(
    ("mode", "status", "needle"),
    [
        ("badjson", 502, "not JSON"),
        ("status:500", 502, "failed with 500"),
        ("status:503", 503, "not accepting"),
        ("status:400", 400, "test upstream answered 400"),
    ],
)
def test_upstream_failures_are_mapped(gw: str, mode: str, status: int, needle: str) -> None:
    got, headers, body = gs.post(f"{gw}/teacher/generate", {"text": "x"}, {"X-Test-Mode": mode})
    assert got == status
    assert needle in body.decode()
    if status == 503:
        assert "retry-after" in headers


def test_deadline_is_504_and_names_the_timeout(gw: str) -> None:
    status, _, body = gs.post(
        f"{gw}/teacher/generate", {"text": "x"}, {"X-Test-Mode": "slow:5", "X-Relax-Timeout": "0.3"}
    )
    assert status == 504 and "deadline" in error_of(body)["message"]


def test_body_over_the_limit_is_413(registry: Any) -> None:
    with gs.gateway("teacher", registry, max_body_bytes=1000) as url:
        status, _, body = gs.post(f"{url}/teacher/generate", {"text": "x" * 2000})
    assert status == 413 and "limit of 1000 bytes" in error_of(body)["message"]


def test_bearer_token_is_required_and_not_forwarded(
    registry: Any, engines: tuple[Any, Any]
) -> None:
    with gs.gateway("teacher", registry, token="s3cret") as url:
        status, headers, _body = gs.post(f"{url}/teacher/generate", {"text": "x"})
        assert status == 401 and headers["www-authenticate"].startswith("Bearer")
        assert (
            gs.post(f"{url}/teacher/generate", {"text": "x"}, {"Authorization": "Bearer nope"})[0]
            == 401
        )
        assert gs.get(f"{url}/teacher/engines")[0] == 401
        ok = gs.post(f"{url}/teacher/generate", {"text": "x"}, {"Authorization": "Bearer s3cret"})
        assert ok[0] == 200
        assert gs.get(f"{url}/teacher/health")[0] == 200  # probes need no token
    assert "authorization" not in {k for k, _ in engines[0].last()["headers"]}


def test_discovery_routes(gw: str, engines: tuple[Any, Any]) -> None:
    status, _, body = gs.get(f"{gw}/teacher/engines")
    snap = json.loads(body)
    assert status == 200 and snap["schema_version"] == 2 and set(snap["models"]) == {"math", "code"}
    legacy = json.loads(gs.get(f"{gw}/teacher/engines?schema=1")[2])
    assert [e["url"] for e in legacy["engines"]] == [engines[0].url, engines[1].url]
    assert gs.get(f"{gw}/teacher/engines?schema=3")[0] == 400
    models = json.loads(gs.get(f"{gw}/teacher/v1/models")[2])
    assert {m["id"] for m in models["data"]} == {"math", "code"}
    health = json.loads(gs.get(f"{gw}/teacher/health")[2])
    assert health["ready"] is True and health["models"]["math"]["state"] == "READY"


def test_genrm_health_defaults_to_schema_1(registry: Any, engines: tuple[Any, Any]) -> None:
    # The default comes from the genrm role's record (health_schema = 1), not from its name.
    spec = builtin_roles().role("genrm")
    registry.value = gs.snapshot("genrm", {"judge": {"urls": [engines[0].url]}})
    with gs.gateway("genrm", registry, spec=spec) as url:
        legacy = json.loads(gs.get(f"{url}/genrm/health")[2])
        unified = json.loads(gs.get(f"{url}/genrm/health?schema=2")[2])
    assert legacy == {"status": "healthy", "healthy_engines": 1, "total_engines": 1}
    assert unified["role"] == "genrm" and unified["ready"] is True


def test_unknown_route_and_method_are_json_errors(gw: str) -> None:
    status, _, body = gs.get(f"{gw}/teacher/activate")
    assert status == 404 and "openapi.json" in error_of(body)["message"]
    status, _, body = gs.get(f"{gw}/teacher/generate")
    assert status == 405 and error_of(body)["code"] == 405


def test_metrics_count_requests_latency_and_upstream_errors(gw: str) -> None:
    gs.post(f"{gw}/teacher/generate", {"text": "x"})
    gs.post(f"{gw}/teacher/generate", {"text": "x"}, {"X-Test-Mode": "badjson"})
    text = gs.get(f"{gw}/metrics")[2].decode()
    assert 'relax_gateway_requests_total{role="teacher",route="generate",status="200"} 1.0' in text
    assert 'relax_gateway_requests_total{role="teacher",route="generate",status="502"} 1.0' in text
    assert 'relax_gateway_upstream_errors_total{error="bad_json",role="teacher"} 1.0' in text
    assert 'relax_gateway_request_seconds_count{role="teacher",route="generate"} 2.0' in text
    assert 'relax_gateway_inflight{role="teacher"} 0.0' in text


@pytest.mark.parametrize(
    ("option", "value", "needle"),
    [
        ("stream_coalesce", -0.001, "stream_coalesce=-0.001: give seconds between 0"),
        ("stream_coalesce", 1.0, "stream_coalesce=1.0: give seconds between 0"),
        ("stream_idle_timeout", 0, "stream_idle_timeout=0: give a positive number"),
        ("max_body_bytes", 0, "max_body_bytes=0: give a positive number of bytes"),
    ],
)
def test_bad_gateway_options_are_refused_by_name(option: str, value: Any, needle: str) -> None:
    from relax_core.gateway.handler import GatewayOptions

    with pytest.raises(ValueError, match=needle):
        GatewayOptions(**{option: value})
