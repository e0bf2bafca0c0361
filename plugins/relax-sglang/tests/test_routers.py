"""The real sglang-router 0.3.2 and smg 1.13 as the router plugin runs them.

Command lines (parsed by each router's own argument parser), the field probe (smg keeps every
field the roles send; sglang-router 0.3.2 is refused naming what it drops), membership through
the ``/workers`` API, supervision, and no replay of a POST whose worker dies mid-request —
counted on the worker side by real counting workers (``counting_server.py``).
"""

from __future__ import annotations

import argparse
import http.client
import importlib
import json
import os
import signal
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from relax_sglang.fidelity import PROBES
from relax_sglang.router import SGLANG_ROUTER, SMG, RouterKind, RouterServer, router_argv

from relax_core import ConfigError, RouterLaunchSpec, SubprocessEngineProcess
from relax_core.testing import free_port, wait_for

COUNTING_SERVER = Path(__file__).with_name("counting_server.py")

#: What sglang-router 0.3.2 drops of the fields the roles send (its field probe finds them; the
#: refusal test checks this list is exactly what it reports).
DROPPED_BY_SGLANG_ROUTER_0_3_2 = (
    "return_routed_experts",
    "sampling_params.custom_params",
    "sampling_params.logit_bias",
    "sampling_params.spaces_between_special_tokens",
    "sampling_params.stop_regex",
    "sampling_params.stream_interval",
    "sampling_params.structural_tag",
)

KINDS: dict[str, RouterKind] = {"sglang-router": SGLANG_ROUTER, "smg": SMG}
#: The policy each router is sticky on X-SMG-Routing-Key with.
STICKY = {"sglang-router": "manual", "smg": "consistent_hashing"}

StartWorker = Callable[[str], SubprocessEngineProcess]
StartRouter = Callable[..., RouterServer]


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[StartWorker]:
    """Start counting workers for one test (all of one model, ``worker``, as a model's heads
    are); every one is killed when it ends."""
    started: list[SubprocessEngineProcess] = []

    def start(name: str) -> SubprocessEngineProcess:
        port = free_port()
        proc = SubprocessEngineProcess.start(
            [sys.executable, str(COUNTING_SERVER), str(port), "worker"],
            base_url=f"http://127.0.0.1:{port}",
            engine_id=name,
            log_path=str(tmp_path / f"{name}.log"),
        )
        started.append(proc)
        proc.wait_ready(30)
        return proc

    yield start
    for proc in started:
        proc.kill()


def router_spec(kind: str, tmp: Path, **fields: Any) -> RouterLaunchSpec:
    """The launch spec the role service would give: the sticky policy, 0.3.2's known drops
    allowed (so it starts at all)."""
    fields.setdefault("policy", STICKY[kind])
    # The counting workers report their name as their model: so does the probe.
    fields.setdefault("served_model_name", "worker")
    if kind == "sglang-router":
        fields.setdefault("allow_dropped_fields", DROPPED_BY_SGLANG_ROUTER_0_3_2)
    return RouterLaunchSpec(
        router_id=f"roles.rollout.models.{kind}", log_path=str(tmp / f"{kind}.log"), **fields
    )


@pytest.fixture
def start_router(tmp_path: Path) -> Iterator[StartRouter]:
    """Start routers (made ready) for one test; every one is stopped when it ends."""
    started: list[RouterServer] = []

    def start(kind: str, **fields: Any) -> RouterServer:
        router = RouterServer(KINDS[kind], router_spec(kind, tmp_path, **fields))
        started.append(router)
        router.wait_ready(60)
        return router

    yield start
    for router in started:
        router.terminate(2)


_PARSERS = {"sglang-router": "sglang_router.router_args", "smg": "smg.router_args"}


def _http(method: str, url: str, body: Any = None, timeout: float = 30) -> tuple[int, Any]:
    req = urllib.request.Request(
        url,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status = resp.status
            try:
                raw = resp.read()
            except http.client.IncompleteRead as cut:  # a stream cut mid-way: what came
                raw = cut.partial
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    except (urllib.error.URLError, ConnectionError) as exc:
        return 0, str(exc)
    text = raw.decode("utf-8", "replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def _routable(router: RouterServer) -> set[str]:
    """URLs the router would route to now (listed, healthy, not draining)."""
    _, answer = _http("GET", router.url + "/workers")
    return {
        w["url"]
        for w in answer["workers"]
        if w.get("is_healthy") and w.get("status", "ready") != "draining"
    }


def _counts(worker: Any) -> dict[str, int]:
    return dict(_http("GET", worker.base_url + "/_counts")[1])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_command_line_parses_with_the_routers_own_parser_with_retries_and_breaker_off(
    kind: str,
) -> None:
    spec = RouterLaunchSpec(
        router_id="roles.rollout.models.policy",
        policy="round_robin",
        pd=True,
        extra_args=("--log-dir", "/tmp/x"),
    )
    argv = router_argv(KINDS[kind], spec, 31000, 31001)
    router_args = importlib.import_module(_PARSERS[kind]).RouterArgs
    parser = argparse.ArgumentParser()
    router_args.add_cli_args(parser)
    skip = 1 + len(KINDS[kind].command)  # the interpreter and its module arguments
    args = router_args.from_cli_args(parser.parse_args(argv[skip:]))
    assert (args.port, args.prometheus_port, args.policy) == (31000, 31001, "round_robin")
    assert args.disable_retries and args.disable_circuit_breaker
    assert args.pd_disaggregation and args.log_dir == "/tmp/x"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_policies_listed_are_the_ones_the_routers_cli_offers(kind: str) -> None:
    parser = argparse.ArgumentParser()
    importlib.import_module(_PARSERS[kind]).RouterArgs.add_cli_args(parser)
    policy = next(a for a in parser._actions if "--policy" in a.option_strings)
    assert set(policy.choices or ()) == KINDS[kind].policies


@pytest.mark.parametrize(
    "flag", ["--retry-max-retries", "--cb-failure-threshold", "--port", "--policy"]
)
def test_router_args_may_not_turn_retries_back_on_or_move_what_the_plugin_owns(flag: str) -> None:
    spec = RouterLaunchSpec(
        router_id="roles.rollout.models.p", policy="round_robin", extra_args=(flag, "3")
    )
    with pytest.raises(ConfigError, match=rf"roles.rollout.models.p.router_args: {flag} is set"):
        router_argv(SGLANG_ROUTER, spec, 1, 2)


def test_sglang_router_0_3_2_is_refused_at_start_naming_the_fields_it_drops_and_its_version(
    start_router: StartRouter,
) -> None:
    with pytest.raises(ConfigError) as refused:
        start_router("sglang-router", allow_dropped_fields=())
    message = str(refused.value)
    assert message.startswith(
        "roles.rollout.models.sglang-router.router: router sglang-router 0.3.2"
    )
    named = {p for p in DROPPED_BY_SGLANG_ROUTER_0_3_2 if f"{p} (dropped)" in message}
    assert named == set(DROPPED_BY_SGLANG_ROUTER_0_3_2), message
    assert "router_allow_dropped_fields" in message
    # Allowing only some of them is not enough.
    with pytest.raises(ConfigError, match=r"return_routed_experts \(dropped\)"):
        start_router("sglang-router", allow_dropped_fields=DROPPED_BY_SGLANG_ROUTER_0_3_2[1:])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_field_the_roles_send_reaches_the_worker_unchanged_through_the_router(
    kind: str, start_router: StartRouter, start_worker: StartWorker
) -> None:
    router = start_router(kind)
    worker = start_worker("fields")
    router.sync({"fields/replica-0": worker.base_url or ""})
    allowed = set(router.spec.allow_dropped_fields)
    for sent in PROBES:
        status, _ = _http("POST", router.url + "/generate", sent)
        assert status == 200
        got = _http("GET", worker.base_url + "/_bodies")[1][sent["rid"]]
        for key, value in sent.items():
            if key == "sampling_params":
                continue
            assert key in allowed or got.get(key) == value, (kind, key, got.get(key))
        for key, value in sent["sampling_params"].items():
            path = f"sampling_params.{key}"
            assert path in allowed or got["sampling_params"].get(key) == value, (kind, path)
    if kind == "smg":
        assert not allowed  # smg needs no allowance: it keeps every field


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_membership_registers_heads_healthy_and_removes_gone_ones_before_returning(
    kind: str, start_router: StartRouter, start_worker: StartWorker
) -> None:
    router = start_router(kind)
    a, b = start_worker("a"), start_worker("b")
    router.sync({"m/replica-0": a.base_url or ""})
    assert _routable(router) == {a.base_url}
    router.sync({"m/replica-0": a.base_url or "", "m/replica-1": b.base_url or ""})
    assert _routable(router) == {a.base_url, b.base_url}
    router.sync({"m/replica-1": b.base_url or ""})
    assert _routable(router) == {b.base_url}
    assert set(router.workers()) == {"m/replica-1"} and router.check() == []
    router.sync({})
    assert _routable(router) == set() and router.workers() == {}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("fault", ["die", "die-mid-stream"])
def test_a_post_whose_worker_dies_mid_request_is_never_replayed_on_another_worker(
    kind: str, fault: str, start_router: StartRouter, start_worker: StartWorker
) -> None:
    router = start_router(kind, policy="round_robin")
    workers = [start_worker("w0"), start_worker("w1")]
    router.sync({f"m/replica-{i}": w.base_url or "" for i, w in enumerate(workers)})
    rid = f"{fault}:once"
    status, answer = _http(
        "POST", router.url + "/generate", {"text": "x", "rid": rid, "stream": fault != "die"}
    )
    # Its sockets close a moment before the killed process can be reaped.
    wait_for(lambda: any(w.poll() is not None for w in workers), timeout=10, what="a worker dead")
    died = [w for w in workers if w.poll() is not None]
    assert len(died) == 1, (status, answer)
    survivor = next(w for w in workers if w not in died)
    # The worker that got it died of it; the other never received it: no replay.
    assert _counts(survivor).get(rid, 0) == 0
    if fault == "die":
        assert status != 200, answer
    else:
        # The routers may close the cut stream or end it with their own "data: [DONE]": either
        # way the client got the dying worker's one event, nothing from another worker.
        assert str(answer).count('"text"') == 1, answer


def test_a_router_that_exits_is_restarted_on_its_port_with_its_heads_registered_again(
    start_router: StartRouter, start_worker: StartWorker
) -> None:
    router = start_router("smg")
    worker = start_worker("a")
    router.sync({"m/replica-0": worker.base_url or ""})
    [pid] = router.pids()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not router.pids(), timeout=10, what="the router gone")
    problems = router.check()
    assert (
        len(problems) == 1 and "exited with code -9" in problems[0] and "restarted" in problems[0]
    )
    assert router.pids() and router.pids() != [pid]
    assert _routable(router) == {worker.base_url} and router.check() == []


def test_a_head_the_router_cannot_take_is_reported_by_check_not_raised(
    start_router: StartRouter,
) -> None:
    router = start_router("smg")
    router.register_timeout = 2.0
    router.sync({"m/replica-0": "http://127.0.0.1:9"})  # nothing listens there
    problems = router.check()
    assert problems and problems[0].startswith("m/replica-0: router smg 1.13.0"), problems
    router.sync({})
    assert router.check() == []
