"""Shared helpers of the gateway tests.

- :func:`upstream`: a real engine-protocol server process (``tests/upstream_server.py``);
- :func:`snapshot`: a schema-2 role snapshot with DIRECT heads;
- :class:`Registry`: a mutable snapshot source the tests can change or take down;
- :func:`gateway`: a real uvicorn gateway for a role in front of a :class:`Registry`;
- :func:`role_plugin_manager`: a plugin manager registering one role with a given adapter;
- :func:`leave_a_stream`: start a streamed request and hang up after its first event.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from relax_core.discovery.schema import RoleSnapshot
from relax_core.gateway.adapters import RoleAdapter
from relax_core.gateway.handler import GatewayOptions
from relax_core.gateway.serving import gateway_app
from relax_core.plugins import PluginManager, module_plugin
from relax_core.records import RoleSpec, RoutingPolicy
from relax_core.testing import free_port, serve_app

UPSTREAM_SCRIPT = Path(__file__).with_name("upstream_server.py")


@attrs.define
class Upstream:
    """A running upstream server process."""

    proc: subprocess.Popen[bytes]
    url: str
    name: str

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as resp:
            return json.loads(resp.read() or b"null")

    def stats(self) -> dict[str, int]:
        return dict(self.get("/_stats"))

    def last(self) -> dict[str, Any]:
        return dict(self.get("/_last"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


@contextlib.contextmanager
def upstream(name: str = "engine", port: int | None = None) -> Iterator[Upstream]:
    """Start ``tests/upstream_server.py`` on ``port`` (default: a free one); kill it when the
    block ends."""
    port = port or free_port()
    proc = subprocess.Popen(
        [sys.executable, str(UPSTREAM_SCRIPT), "--port", str(port), "--name", name],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # READY, or EOF when it died
        if b"READY" not in line:
            raise RuntimeError(f"upstream {name} did not start (exit code {proc.poll()})")
        yield Upstream(proc, f"http://127.0.0.1:{port}", name)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def snapshot(
    role: str,
    models: Mapping[str, Mapping[str, Any]],
    *,
    default_model: str | None = None,
    route_key_map: Mapping[str, str] | None = None,
    aliases: Mapping[str, str] | None = None,
    revision: int = 1,
    policy: str = "round_robin",
) -> RoleSnapshot:
    """A schema-2 snapshot: ``models[id]`` has ``urls`` (DIRECT heads), optional ``state``,
    ``served`` (served model name) and ``weight_source``; DIRECT requests use ``policy``."""
    out: dict[str, Any] = {}
    for model_id, spec in models.items():
        state = spec.get("state", "READY")
        engines = [
            {
                "engine_id": f"{model_id}/replica-{i}",
                "base_url": url,
                "state": spec.get("engine_state", state),
                "direct_eligible": spec.get("engine_state", state) == "READY",
                "generation": 1,
            }
            for i, url in enumerate(spec.get("urls", ()))
        ]
        source = spec.get("weight_source", "ACTOR" if role == "rollout" else "STATIC")
        out[model_id] = {
            "state": state,
            "route_mode": "DIRECT",
            "router_url": None,
            "weight_source": source,
            "weight_version": "1" if source == "ACTOR" else None,
            "served_model_name": spec.get("served", f"served-{model_id}"),
            "engines": engines,
        }
    return RoleSnapshot.from_json(
        {
            "schema_version": 2,
            "role": role,
            "registry_epoch": "test-epoch",
            "topology_revision": revision,
            "routing": {
                "default_model": default_model or next(iter(models)),
                "route_key_map": dict(route_key_map or {}),
                "aliases": dict(aliases or {}),
                "policy": policy,
                "policy_revision": 0,
            },
            "models": out,
        }
    )


class Registry:
    """A snapshot source a test controls: ``value`` is served; ``down`` makes it fail."""

    def __init__(self, value: RoleSnapshot) -> None:
        self.value = value
        self.down = False
        self.calls = 0

    def __call__(self) -> RoleSnapshot:
        self.calls += 1
        if self.down:
            raise ConnectionError("registry process is not answering")
        return self.value


@contextlib.contextmanager
def gateway(
    role: str,
    registry: Registry,
    *,
    adapter: RoleAdapter | None = None,
    spec: RoleSpec | None = None,
    plugin_manager: PluginManager | None = None,
    **options: Any,
) -> Iterator[str]:
    """A real uvicorn server running ``role``'s gateway app; yields its base URL.

    Built as every gateway is (``gateway_app``) over ``plugin_manager`` (e.g. the installed
    plugins', for a role plugin's adapter and record), by default :func:`role_plugin_manager`
    with ``adapter`` and ``spec`` (the role's record: health default, OpenAPI notes; none: the
    common defaults); ``options`` are :class:`GatewayOptions` fields (``snapshot_ttl`` defaults
    to 0 here).
    """
    options.setdefault("snapshot_ttl", 0.0)
    if plugin_manager is None:
        plugin_manager = role_plugin_manager(role, adapter, spec=spec)
    elif adapter is not None or spec is not None:
        raise ValueError("give adapter= and spec=, or plugin_manager=, not both")
    app = gateway_app(
        role, registry, plugin_manager=plugin_manager, options=GatewayOptions(**options)
    )
    with serve_app(app) as url:
        yield url


def role_plugin_manager(
    role: str,
    adapter: RoleAdapter | None = None,
    *,
    spec: RoleSpec | None = None,
    policies: Sequence[RoutingPolicy] = (),
) -> PluginManager:
    """The core's built-ins plus one plugin registering ``role`` and the routing ``policies``,
    so a gateway test exercises the core's gateway, not a role plugin's: the role's record is
    ``spec`` (default: a plain record with the pass-through adapter), with ``adapter`` as its
    adapter when given."""
    if spec is None:
        spec = RoleSpec(
            name=role,
            allowed_weight_sources={"STATIC", "ACTOR", "DCS"},
            default_route_mode="DIRECT",
        )
    record = spec if adapter is None else attrs.evolve(spec, gateway_adapter=lambda: adapter)

    def relax_register_roles(register: Any) -> None:
        register(record)

    def relax_register_routing_policies(register: Any) -> None:
        for policy in policies:
            register(policy)

    name = f"test-role-{role}"
    plugin = module_plugin(
        name,
        relax_register_roles=relax_register_roles,
        relax_register_routing_policies=relax_register_routing_policies,
    )
    return PluginManager.create(entry_points=False, plugins=[(name, plugin)])


def post(
    url: str, body: Any, headers: Mapping[str, str] | None = None, timeout: float = 30
) -> tuple[int, dict[str, str], bytes]:
    """POST JSON (or raw bytes); return ``(status, headers, body)`` without raising on errors."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def leave_a_stream(url: str, body: Any, headers: Mapping[str, str] | None = None) -> None:
    """POST a streamed request to ``url`` over a raw socket, read up to its first event (the
    answer must be a 200), then close the connection: a caller that goes away mid-stream."""
    scheme, _, rest = url.partition("://")
    assert scheme == "http", url
    where, _, path = rest.partition("/")
    host, _, port = where.partition(":")
    payload = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST /{path} HTTP/1.1\r\nHost: {where}\r\nContent-Type: application/json\r\n"
            f"{extra}Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        received = b""
        while b"data: " not in received:
            chunk = sock.recv(4096)
            assert chunk, f"the gateway closed the stream early: {received!r}"
            received += chunk
        assert received.startswith(b"HTTP/1.1 200"), received[:200]


def get(url: str, headers: Mapping[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """GET; return ``(status, headers, body)`` without raising on errors."""
    req = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(directory: Path) -> Path:
    """A tiny byte-level BPE tokenizer with a chat template, trained locally (no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the judge says yes", "score: 1 correct"] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return directory
