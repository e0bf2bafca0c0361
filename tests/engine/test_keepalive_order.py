"""The keep-alive table of docs/reliability.md, pair by pair: on every pair whose two limits
Relax sets, the client reuses an idle connection for less time than the server keeps it (the
server never closes a connection the client may pick)."""

from __future__ import annotations

import inspect

import pytest

from relax_core._http.transport import Transport
from relax_core.engine import admission, control
from relax_core.manager import channel

#: SGLang's uvicorn keep-alive (its server's default, not set by Relax).
SGLANG_KEEPALIVE = 5.0
#: The data path's client (the caller's InferenceClient, the gateway).
_TRANSPORT = inspect.signature(Transport).parameters["keepalive_timeout"].default


def _hf_keepalive() -> float:
    cli = pytest.importorskip("relax_hf.cli")
    return float(cli.SERVER_KEEPALIVE)


@pytest.mark.parametrize(
    ("pair", "client", "server"),
    [
        ("admission server -> SGLang", admission.ENGINE_KEEPALIVE, SGLANG_KEEPALIVE),
        ("ControlClient -> SGLang", control.KEEPALIVE_SECONDS, SGLANG_KEEPALIVE),
        ("manager -> worker control channel", channel._CLIENT_KEEPALIVE, channel._SERVER_KEEPALIVE),
        ("InferenceClient -> admission server", _TRANSPORT, admission.SERVER_KEEPALIVE),
    ],
)
def test_the_client_lets_an_idle_connection_go_before_the_server(
    pair: str, client: float, server: float
) -> None:
    assert client < server, f"{pair}: the client keeps {client}s, the server {server}s"


def test_the_hf_engines_clients_let_an_idle_connection_go_before_its_uvicorn() -> None:
    # (The manager's control channel, 60 s, ends at the engine worker's aiohttp server, 120 s,
    # never at the engine: its pair is above.)
    server = _hf_keepalive()
    for pair, client in (
        ("admission server -> hf engine", admission.ENGINE_KEEPALIVE),
        ("ControlClient -> hf engine", control.KEEPALIVE_SECONDS),
    ):
        assert client < server, f"{pair}: the client keeps {client}s, the engine {server}s"
