"""Scale-out and scale-in on real Ray with hf engines; owned vs borrowed placement groups."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.schema import RoutingSpec
from relax_core.manager import ManagerTimeouts, Outcome
from tests.support import manager as support

pytestmark = pytest.mark.ray

QUICK = ManagerTimeouts(
    start=120.0, offload=2.0, onload=20.0, drain=1.0, update=30.0, health=5.0, shutdown=3.0,
    rpc_margin=1.0,
)  # fmt: skip


def heads(publisher: RegistryPublisher) -> dict[str, Any]:
    return {e.engine_id: e for e in publisher.snapshot().models["judge"].engines}


@pytest.fixture
def borrowed(ray_local: Any) -> Iterator[Any]:
    """A placement group owned by the test (a controller's, say), lent to the manager."""
    import ray

    group = support.placement_group(2)
    yield group
    ray.util.remove_placement_group(group)


def test_scale_out_and_in_with_a_borrowed_group_that_survives_shutdown(
    ray_local: Any, borrowed: Any
) -> None:
    import ray

    publisher = RegistryPublisher("genrm", RoutingSpec(default_model="judge"))
    manager = support.make_manager(replicas=1, publisher=publisher, timeouts=QUICK)
    with support.managed(manager) as run:
        out = manager.scale_out([[[0]]], placement_group=borrowed, owned=False)
        assert out.outcomes == {"judge/replica-1": Outcome.DONE}
        run.track()
        published = heads(publisher)
        assert list(published) == ["judge/replica-0", "judge/replica-1"]
        assert published["judge/replica-1"].direct_eligible
        assert support.generate(published["judge/replica-1"].base_url)[0] == 200

        with pytest.raises(ValueError, match="bundle 0 is already used by judge/replica-1"):
            manager.scale_out([[[0]]], placement_group=borrowed)
        with pytest.raises(ValueError, match="has 2 node group"):
            manager.scale_out([[[1], [0]]], placement_group=borrowed)
        with pytest.raises(ValueError, match="current URLs"):
            manager.scale_in(urls=["http://127.0.0.1:1"])

        pid = manager.engine_pids()["judge/replica-1"][0]
        gone = manager.scale_in(urls=[published["judge/replica-1"].base_url])
        assert gone.outcomes == {"judge/replica-1": Outcome.DONE}
        assert list(heads(publisher)) == ["judge/replica-0"]
        assert list(manager.states()) == ["judge/replica-0"]
        support.wait_for(lambda: not support.pid_alive(pid), timeout=10, what="engine stopped")

        # The bundle is free again: a new replica takes it.
        again = manager.scale_out([[[0]]], placement_group=borrowed, owned=False)
        assert again.outcomes == {"judge/replica-2": Outcome.DONE}
        run.track()
    # The manager's own group was removed by the managed() check; the borrowed one stays.
    assert support.group_state(borrowed) == "CREATED"
    assert ray.util.placement_group_table(borrowed)["state"] == "CREATED"


def test_partially_cleaned_replica_is_retried_by_its_current_url(ray_local: Any) -> None:
    import ray

    publisher = RegistryPublisher("genrm", RoutingSpec(default_model="judge"))
    manager = support.make_manager(replicas=2, publisher=publisher, timeouts=QUICK)
    with support.managed(manager):
        url = heads(publisher)["judge/replica-1"].base_url
        actor = manager.workers("judge/replica-1")[0].actor
        actor_pid = ray.get(actor.actor_pid.remote())
        os.kill(actor_pid, signal.SIGSTOP)
        try:
            first = manager.scale_in(count=1)  # the newest replica goes first
            assert first.outcomes == {"judge/replica-1": Outcome.FAILED}
            assert "retry scale_in" in (first.replicas[0].error or "")
            assert manager.states()["judge/replica-1"] == "STOPPING"
            assert not heads(publisher)["judge/replica-1"].direct_eligible
            # A pending replica is never rebuilt by recover(): scale-in owns it now.
            assert manager.recover().replicas == ()
        finally:
            os.kill(actor_pid, signal.SIGCONT)
        retry = manager.scale_in(urls=[url])
        assert retry.outcomes == {"judge/replica-1": Outcome.DONE}
        assert list(heads(publisher)) == ["judge/replica-0"]
