"""The manager's private control channel: a token-protected HTTP endpoint on its own port.

The endpoint here is a real aiohttp server on loopback, on an event loop of its own (as it runs
on an engine worker's loop), with handlers that record what they were asked; the manager tests
drive it through real engine workers.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3

from relax_core.errors import CapabilityError, ChannelError, LifecycleError, UpstreamError
from relax_core.manager.channel import (
    CONTROL_PREFIX,
    TOKEN_HEADER,
    ControlAddress,
    ControlChannelServer,
    call_many,
)
from relax_core.testing import free_port


class Worker:
    """Handlers standing in for an engine worker's methods; records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.slow_done = threading.Event()

    async def offload(self, tags: list[str], strict: bool) -> float:
        self.calls.append(("offload", {"tags": tags, "strict": strict}))
        return 0.25

    async def refuse(self, kind: str) -> None:
        self.calls.append(("refuse", {"kind": kind}))
        if kind == "lifecycle":
            raise LifecycleError("engine judge/replica-0 refused the release")
        if kind == "capability":
            raise CapabilityError("STATIC engines never update weights")
        if kind == "upstream":
            raise UpstreamError(504, "no answer within 1.0s")
        raise TimeoutError("the worker's own deadline passed")

    async def slow(self, seconds: float) -> str:
        self.calls.append(("slow", {"seconds": seconds}))
        await asyncio.sleep(seconds)
        self.slow_done.set()
        return "done"


class Served:
    def __init__(self, worker: Worker, server: ControlChannelServer, address: ControlAddress):
        self.worker, self.server, self.address = worker, server, address


@pytest.fixture
def served() -> Iterator[Served]:
    """A control endpoint on its own event loop thread (as on a worker's loop)."""
    worker = Worker()
    server = ControlChannelServer(
        {"offload": worker.offload, "refuse": worker.refuse, "slow": worker.slow},
        engine_id="judge/replica-0",
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        address = asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
        yield Served(worker, server, address)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_missing_or_wrong_token_is_refused_and_runs_nothing(
    served: Served, http: urllib3.PoolManager
) -> None:
    url = served.address.url + CONTROL_PREFIX + "offload"
    body = {"tags": ["weights"], "strict": True}
    anonymous = http.request("POST", url, json=body)
    wrong = http.request("POST", url, json=body, headers={TOKEN_HEADER: "guessed"})
    almost = http.request("POST", url, json=body, headers={TOKEN_HEADER: served.address.token[:-1]})
    for response in (anonymous, wrong, almost):
        assert response.status == 401
        assert TOKEN_HEADER in response.json()["message"]
        assert response.json()["engine_id"] == "judge/replica-0"
    assert served.worker.calls == []
    outcome = call_many({0: (ControlAddress(served.address.url, "guessed"), "offload", body)}, 10)
    assert isinstance(outcome[0].error, ChannelError) and "401" in str(outcome[0].error)
    assert served.worker.calls == []


def test_the_token_is_random_per_endpoint_and_never_in_its_repr(served: Served) -> None:
    other = ControlChannelServer({}, engine_id="judge/replica-1")
    assert other.address.token != served.address.token
    assert len(served.address.token) >= 32
    assert served.address.token not in repr(served.address)


def test_the_right_token_runs_the_named_method_with_its_arguments(served: Served) -> None:
    calls = {
        i: (served.address, "offload", {"tags": ["weights", "kv_cache"], "strict": i == 0})
        for i in range(3)
    }
    outcomes = call_many(calls, 10)
    assert [o.value for o in outcomes.values()] == [0.25, 0.25, 0.25]
    assert all(o.ok for o in outcomes.values())
    assert sorted(c[1]["strict"] for c in served.worker.calls) == [False, False, True]
    assert {tuple(c[1]["tags"]) for c in served.worker.calls} == {("weights", "kv_cache")}


def test_unknown_methods_and_other_verbs_are_404(served: Served, http: urllib3.PoolManager) -> None:
    headers = {TOKEN_HEADER: served.address.token}
    get = http.request("GET", served.address.url + CONTROL_PREFIX + "offload", headers=headers)
    other = http.request("POST", served.address.url + "/generate", headers=headers)
    assert get.status == 404 and other.status == 404
    assert "offload" in get.json()["message"]
    outcome = call_many({0: (served.address, "shutdown", {})}, 10)[0]
    assert isinstance(outcome.error, ChannelError) and "404" in str(outcome.error)
    assert served.worker.calls == []


def test_a_workers_error_comes_back_as_its_own_class_and_message(served: Served) -> None:
    kinds = ("lifecycle", "capability", "upstream", "timeout")
    outs = call_many({k: (served.address, "refuse", {"kind": k}) for k in kinds}, 10)
    assert isinstance(outs["lifecycle"].error, LifecycleError)
    assert not isinstance(outs["lifecycle"].error, ChannelError)
    assert "refused the release" in str(outs["lifecycle"].error)
    assert isinstance(outs["capability"].error, CapabilityError)
    upstream = outs["upstream"].error
    assert isinstance(upstream, UpstreamError) and upstream.status == 504
    assert isinstance(outs["timeout"].error, TimeoutError)
    assert outs["timeout"].describe() == "TimeoutError: the worker's own deadline passed"
    assert not any(o.ok or o.timed_out for o in outs.values())


def test_a_silent_endpoint_times_out_and_its_call_still_finishes_there(served: Served) -> None:
    outcome = call_many({0: (served.address, "slow", {"seconds": 1.0})}, 0.2)[0]
    assert outcome.timed_out and not outcome.ok
    # The caller's deadline does not cancel the worker's call (as a Ray call is not cancelled).
    assert served.worker.slow_done.wait(10)


def test_an_unreachable_endpoint_is_a_channel_error_not_a_result() -> None:
    address = ControlAddress(f"http://127.0.0.1:{free_port()}", "token")
    outcome = call_many({0: (address, "offload", {})}, 5)[0]
    assert isinstance(outcome.error, ChannelError) and not outcome.ok
    assert "control_channel=False" in str(outcome.error)
