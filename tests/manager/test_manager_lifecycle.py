"""InferenceManager lifecycle on a real local Ray with real hf engines (tiny model, CPU).

One two-replica STATIC manager is shared by the module (starting engines is the slow part);
every test leaves it READY again, and the module's finalizer checks that no engine process,
worker actor or placement group is left behind.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.schema import RoutingSpec
from relax_core.engine.spec import UPDATE_ENDPOINTS
from relax_core.errors import CapabilityError
from relax_core.manager import ALL_TAGS, Outcome, ReplicaState
from tests.support import manager as support

pytestmark = pytest.mark.ray

S = ReplicaState


@pytest.fixture(scope="module")
def publisher() -> RegistryPublisher:
    return RegistryPublisher("genrm", RoutingSpec(default_model="judge"))


@pytest.fixture(scope="module")
def run(ray_local: Any, publisher: RegistryPublisher) -> Iterator[Any]:
    manager = support.make_manager(replicas=2, publisher=publisher)
    with support.managed(manager) as started:
        yield started


@pytest.fixture
def manager(run: Any) -> Iterator[Any]:
    """The shared manager, READY at the start and at the end of each test."""
    run.manager.onload()
    assert set(run.manager.states().values()) == {"READY"}
    yield run.manager
    run.manager.onload()
    run.track()


def heads(publisher: RegistryPublisher) -> list[Any]:
    return list(publisher.snapshot().models["judge"].engines)


def test_start_publishes_ready_heads_behind_admission_servers(
    manager: Any, publisher: RegistryPublisher
) -> None:
    model = publisher.snapshot().models["judge"]
    assert model.state == "READY" and model.weight_source == "STATIC"
    assert model.weight_version is None
    assert [e.engine_id for e in model.engines] == ["judge/replica-0", "judge/replica-1"]
    for engine in model.engines:
        assert engine.direct_eligible and engine.generation == 1
        status, body, _ = support.generate(engine.base_url)
        assert status == 200 and body["meta_info"]["completion_tokens"] == 4
        workers = manager.workers(engine.engine_id)
        assert len(workers) == 1 and workers[0].engine_pid
    # The published URL is the admission port, never the engine's raw port.
    status, body, _ = support.http("POST", model.engines[0].base_url + "/release_memory_occupation")
    assert status == 403


def test_replica_states_follow_the_reference_state_machine(manager: Any) -> None:
    before = {r.engine_id: len(r.history) for r in manager.replicas()}
    manager.offload()
    manager.onload()
    for rep in manager.replicas():
        assert rep.history[before[rep.engine_id] :] == [
            (S.READY, S.DRAINING),
            (S.DRAINING, S.SLEEPING),
            (S.SLEEPING, S.ONLOADING),
            (S.ONLOADING, S.READY),
        ]
        assert rep.history[0] == (S.STARTING, S.READY)


def test_offload_sleeps_every_replica_and_closes_its_door(
    manager: Any, publisher: RegistryPublisher
) -> None:
    urls = [e.base_url for e in heads(publisher)]
    result = manager.offload()
    assert result.ok
    assert result.outcomes == {e: Outcome.DONE for e in manager.states()}
    assert set(manager.states().values()) == {"SLEEPING"}
    model = publisher.snapshot().models["judge"]
    assert model.state == "SLEEPING"
    assert not any(e.direct_eligible for e in model.engines)
    for url in urls:
        status, _, headers = support.generate(url)
        assert status == 503 and int(headers["Retry-After"]) >= 1
        assert support.http("GET", url + "/health_generate")[0] == 503
    assert all(r.resident == frozenset() for r in manager.replicas())


def test_repeated_offload_and_onload_are_no_ops(manager: Any) -> None:
    assert manager.onload().outcomes == {e: Outcome.NOOP for e in manager.states()}
    manager.offload()
    again = manager.offload()
    assert again.outcomes == {e: Outcome.NOOP for e in manager.states()}
    manager.onload()
    assert manager.onload().outcomes == {e: Outcome.NOOP for e in manager.states()}


def test_onload_restores_only_the_missing_tags(manager: Any, publisher: RegistryPublisher) -> None:
    manager.offload(["kv_cache"])
    assert all(r.resident == {"weights", "cuda_graph"} for r in manager.replicas())
    assert set(manager.states().values()) == {"SLEEPING"}
    result = manager.onload()
    assert [r.tags for r in result.replicas] == [("kv_cache",), ("kv_cache",)]
    assert all(r.resident == ALL_TAGS and r.is_ready for r in manager.replicas())
    for engine in heads(publisher):
        assert support.generate(engine.base_url)[0] == 200


def test_onload_of_weights_only_keeps_the_replica_sleeping_and_closed(
    manager: Any, publisher: RegistryPublisher
) -> None:
    manager.offload()
    result = manager.onload(["weights"])
    assert [r.tags for r in result.replicas] == [("weights",), ("weights",)]
    assert set(manager.states().values()) == {"SLEEPING"}
    assert support.generate(heads(publisher)[0].base_url)[0] == 503


def test_offload_and_onload_of_one_replica_leave_the_other_ready(
    manager: Any, publisher: RegistryPublisher
) -> None:
    result = manager.offload(engine_ids=["judge/replica-1"])
    assert [r.engine_id for r in result.replicas] == ["judge/replica-1"]
    assert manager.states() == {"judge/replica-0": "READY", "judge/replica-1": "SLEEPING"}
    model = publisher.snapshot().models["judge"]
    assert model.state == "READY"
    assert [e.direct_eligible for e in model.engines] == [True, False]


def test_strict_offload_waits_for_an_in_flight_generation(
    manager: Any, publisher: RegistryPublisher
) -> None:
    url = heads(publisher)[0].base_url
    answer: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: answer.update(result=support.generate(url, tokens=400))
    )
    thread.start()
    support.wait_for(
        lambda: support.admission_inflight(manager, "judge/replica-0") == 1,
        timeout=20,
        what="the generation to be in flight",
    )
    result = manager.offload(engine_ids=["judge/replica-0"])
    thread.join(60)
    status, body, _ = answer["result"]
    assert status == 200, body
    assert body["meta_info"]["finish_reason"]["type"] == "length"
    assert result.ok and manager.states()["judge/replica-0"] == "SLEEPING"


def test_static_replica_refuses_every_update_path_at_the_manager_and_the_door(
    manager: Any, publisher: RegistryPublisher
) -> None:
    calls = {
        "tensor": lambda: manager.update_weights_from_tensor(["x"]),
        "disk": lambda: manager.update_weights_from_disk("/nonexistent"),
        "distributed": lambda: manager.update_weights_from_distributed(["w"], ["float32"], [[1]]),
        "init group": lambda: manager.init_weights_update_group(
            master_address="127.0.0.1", master_port=1, rank_offsets=[1, 2], world_size=3
        ),
        "lora": lambda: manager.load_lora_adapter("a", "/nonexistent"),
        "dcs": lambda: manager.load_checkpoint(),
    }
    for name, call in calls.items():
        with pytest.raises(CapabilityError, match="STATIC") as info:
            call()
        assert "judge" in str(info.value), name
    for engine in heads(publisher):
        for paths in UPDATE_ENDPOINTS.values():
            for path in paths:
                status, body, _ = support.http("POST", engine.base_url + path, {})
                assert status == 403 and "STATIC" in body["error"], path
    assert set(manager.states().values()) == {"READY"}


def test_health_check_of_healthy_replicas_changes_nothing(
    manager: Any, publisher: RegistryPublisher
) -> None:
    revision = publisher.snapshot().topology_revision
    report = manager.health_check()
    assert report.healthy
    assert {r.action for r in report.replicas} == {"none"}
    assert publisher.snapshot().topology_revision == revision


def test_onload_and_offload_go_over_a_private_channel_that_refuses_strangers(
    manager: Any, publisher: RegistryPublisher
) -> None:
    engine = heads(publisher)[0]
    # The manager's record of the head's endpoint (it came back in the worker's Ray start()),
    # kept on the head's worker slot next to the actor it belongs to.
    head = manager.workers(engine.engine_id)[0]
    address = head.control
    assert address is not None and head.actor is not None
    assert address.url.rsplit(":", 1)[1] != engine.base_url.rsplit(":", 1)[1]
    snapshot = json.dumps(publisher.snapshot().to_json())
    assert address.token not in snapshot and address.url not in snapshot
    url = address.url + "/_relax/control/offload"
    body = {"tags": ["kv_cache"], "strict": False, "drain_timeout": 1.0, "timeout": 5.0}
    for headers in ({}, {"X-Relax-Control-Token": "guessed"}):
        req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 401
    # The public port refuses the private paths even with the right token.
    public = urllib.request.Request(
        engine.base_url + "/_relax/control/offload",
        json.dumps(body).encode(),
        {"X-Relax-Control-Token": address.token},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(public, timeout=10)
    assert info.value.code == 403
    assert manager.states()[engine.engine_id] == "READY"
    assert support.generate(engine.base_url)[0] == 200
    assert manager.admission_states() == {
        e: {"open": True, "inflight": 0} for e in manager.states()
    }
    # The same lifecycle as Ray actor calls (control_channel=False) ends in the same states.
    manager.control_channel = False
    try:
        assert manager.offload().ok and set(manager.states().values()) == {"SLEEPING"}
        assert manager.admission_states() == {
            e: {"open": False, "inflight": 0} for e in manager.states()
        }
        assert manager.onload().ok and set(manager.states().values()) == {"READY"}
    finally:
        manager.control_channel = True
