"""A role gateway served by several worker processes sharing one port (SO_REUSEPORT).

Real processes throughout: an engine-protocol server process, a registry (a real uvicorn
gateway serving the role's ``/engines``), and spawned gateway workers; the parent-death test
SIGKILLs the process that started the workers.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from relax_core.gateway.serving import GatewayServer, registry_gateway_app
from relax_core.testing import wait_for
from tests.support import gateway as gs


@pytest.fixture(scope="module")
def registry_url() -> Iterator[str]:
    """A rollout gateway in this process, serving the snapshot the workers discover."""
    with gs.upstream("w") as engine:
        registry = gs.Registry(gs.snapshot("rollout", {"policy": {"urls": [engine.url]}}))
        with gs.gateway("rollout", registry) as url:
            yield f"{url}/rollout"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by init, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_share_one_port_and_each_serves_requests(registry_url: str) -> None:
    server = GatewayServer(
        app_factory=functools.partial(registry_gateway_app, "rollout", registry_url),
        workers=2,
    ).start()
    try:
        assert len(set(server.pids)) == 2 and os.getpid() not in server.pids
        prefixes = set()
        for _ in range(24):  # a new connection each time: the kernel spreads them
            status, headers, body = gs.post(f"{server.url}/rollout/generate", {"text": "x"})
            assert status == 200, body
            # Each worker's client numbers its request ids under a prefix of its own.
            prefixes.add(headers["x-request-id"].rsplit("-", 1)[0])
        assert len(prefixes) == 2
    finally:
        server.stop()
    wait_for(lambda: not any(alive(p) for p in server.pids), timeout=15, what="workers to exit")


def test_stopped_workers_free_the_port(registry_url: str) -> None:
    factory = functools.partial(registry_gateway_app, "rollout", registry_url)
    server = GatewayServer(app_factory=factory, workers=2).start()
    pids = server.pids
    server.stop()
    server.stop()  # idempotent
    assert not any(alive(p) for p in pids)
    again = GatewayServer(app_factory=factory, port=server.port).start()  # one worker, same port
    try:
        assert gs.post(f"{again.url}/rollout/generate", {"text": "x"})[0] == 200
    finally:
        again.stop()


def test_a_worker_that_cannot_build_its_app_is_reported(registry_url: str) -> None:
    factory = functools.partial(registry_gateway_app, "no-such-role", registry_url)
    with pytest.raises(RuntimeError, match=r"gateway worker \d of 2 .* exited with code"):
        GatewayServer(app_factory=factory, workers=2).start(timeout=60)


def test_workers_need_an_app_factory() -> None:
    with pytest.raises(ValueError, match="app_factory"):
        GatewayServer(object(), workers=2)
    with pytest.raises(ValueError, match="exactly one of app and app_factory"):
        GatewayServer()


_ORPHAN_SCRIPT = """
import functools, json, sys
from relax_core.gateway.serving import GatewayServer
from relax_core.gateway.serving import registry_gateway_app

server = GatewayServer(
    app_factory=functools.partial(registry_gateway_app, "rollout", sys.argv[1]), workers=2
).start()
print(json.dumps(server.pids), flush=True)
sys.stdin.read()
"""


def test_workers_exit_when_the_process_that_started_them_is_killed(registry_url: str) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT, registry_url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == 2 and all(alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        wait_for(
            lambda: not any(alive(p) for p in pids),
            timeout=20,
            what="the workers of a killed parent to exit",
        )
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
