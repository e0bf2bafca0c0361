"""A replica rebuilt from the model's files reports the weight version it holds, not the one last
pushed to the model, until weights are pushed to it; on real hf engines.

An ACTOR model of two replicas is pushed version ``7``; the engine of one is killed (SIGKILL)
and the replica rebuilt through the manager: its new engine loaded the model's files, so it and
its published head say the version the model's first engines reported, while the other replica
keeps ``7`` (a request asking for ``7`` is not sent to the rebuilt one). A push of ``8`` brings
both to ``8``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.schema import RoutingSpec
from relax_core.manager import Outcome
from tests.support import manager as support

pytestmark = pytest.mark.ray


@pytest.fixture
def run(ray_local: Any) -> Iterator[tuple[support.Run, RegistryPublisher]]:
    publisher = RegistryPublisher("rollout", RoutingSpec(default_model="policy"))
    manager = support.make_manager(
        model_id="policy", role="rollout", source="ACTOR", replicas=2, publisher=publisher
    )
    with support.managed(manager) as started:
        yield started, publisher


def _heads(publisher: RegistryPublisher) -> dict[str, str | None]:
    return {e.engine_id: e.weight_version for e in publisher.snapshot().models["policy"].engines}


def _engine_version(publisher: RegistryPublisher, engine_id: str) -> str:
    engine = next(
        e for e in publisher.snapshot().models["policy"].engines if e.engine_id == engine_id
    )
    assert engine.base_url is not None
    status, body, _ = support.http("GET", engine.base_url + "/model_info")
    assert status == 200
    return str(body["weight_version"])


def test_a_replica_rebuilt_from_the_files_reports_their_version_until_weights_are_pushed(
    run: tuple[support.Run, RegistryPublisher],
) -> None:
    started, publisher = run
    manager = started.manager
    files_version = _engine_version(publisher, "policy/replica-0")
    path = support.tiny_model()
    pushed = manager.update_weights_from_disk(path, weight_version="7")
    assert set(pushed.outcomes.values()) == {Outcome.DONE}
    assert _heads(publisher) == {"policy/replica-0": "7", "policy/replica-1": "7"}

    killed = manager.engine_pids()["policy/replica-1"][0]
    os.kill(killed, signal.SIGKILL)
    report = manager.health_check(recover=True)
    assert report.by_engine["policy/replica-1"].action == "rebuilt", report
    started.track()
    # The rebuilt engine loaded the model's files: it and its head say their version.
    assert files_version != "7"
    assert _engine_version(publisher, "policy/replica-1") == files_version
    assert _heads(publisher) == {"policy/replica-0": "7", "policy/replica-1": files_version}
    # The model's version is still the one last pushed to it (the other replica serves it).
    assert manager.weight_version == "7"

    pushed = manager.update_weights_from_disk(path, weight_version="8")
    assert set(pushed.outcomes.values()) == {Outcome.DONE}
    assert _heads(publisher) == {"policy/replica-0": "8", "policy/replica-1": "8"}
    assert _engine_version(publisher, "policy/replica-1") == "8"
