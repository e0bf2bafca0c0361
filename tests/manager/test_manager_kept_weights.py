"""A STATIC model that keeps its weights while it sleeps (``offload_weights = false``), on a
real local Ray with a real hf engine (tiny model, CPU): its offload releases only the KV cache
and graphs and its onload brings back only those, the weights never leave and no CPU copy of
them is made; a release of its weights is refused (nothing could bring them back)."""

from __future__ import annotations

from typing import Any

import pytest

from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.schema import RoutingSpec
from tests.support import manager as support

pytestmark = pytest.mark.ray


def test_a_model_that_keeps_its_weights_sleeps_and_wakes_with_them(ray_local: Any) -> None:
    publisher = RegistryPublisher("genrm", RoutingSpec(default_model="judge"))
    manager = support.make_manager(publisher=publisher, offload_weights=False)
    with support.managed(manager):
        url = publisher.snapshot().models["judge"].engines[0].base_url
        status, before, _ = support.generate(url, tokens=6)
        assert status == 200
        info = support.http("GET", url + "/server_info")[1]
        assert info["memory"]["cpu_backup_bytes"] == 0  # STATIC, yet no CPU copy: none needed

        slept = manager.offload()
        assert [r.tags for r in slept.replicas] == [("kv_cache", "cuda_graph")]
        assert [r.resident for r in manager.replicas()] == [{"weights"}]
        assert support.generate(url)[0] == 503  # asleep: admission closed
        info = support.http("GET", url + "/server_info")[1]
        assert info["resident"] == {"weights": True, "kv_cache": False, "cuda_graph": False}

        with pytest.raises(ValueError, match=r"no CPU backup.*leave 'weights' out"):
            manager.offload(["weights"])
        assert [r.resident for r in manager.replicas()] == [{"weights"}]  # nothing changed

        woken = manager.onload()
        assert [r.tags for r in woken.replicas] == [("kv_cache", "cuda_graph")]
        assert manager.states() == {"judge/replica-0": "READY"}
        status, after, _ = support.generate(url, tokens=6)
        assert status == 200 and after["output_ids"] == before["output_ids"]
