"""A real SGLang server under the InferenceManager, behind smg (needs a GPU machine).

Selected by the ``sglang_gpu`` marker; skipped, with the reason, wherever one of its needs is
missing: SGLang installed, a CUDA GPU, and ``RELAX_SGLANG_MODEL`` naming a local checkpoint
directory (a small chat model). plugins/relax-sglang/README.md has the exact command.

One replica on GPU ``RELAX_SGLANG_GPU`` (default 0): started (its head generated a token),
registered with smg, a generation and a teacher-style prefill with log-probs through the
router, an offload and an onload (SLEEPING, then READY and generating again), a weight update
from disk moving the published weight version, and a shutdown that leaves no engine process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import urllib.request
from typing import Any

import pytest

from relax_core import (
    EngineOptions,
    InferenceEngineSpec,
    InferenceManager,
    ManagerTimeouts,
    ModelLaunch,
    PluginManager,
    RegistryPublisher,
    ReplicaPlacement,
    RouterLaunchSpec,
    RoutingSpec,
)
from relax_core.testing import wait_for


def _missing() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed (pip install sglang==0.5.23 on a GPU machine)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    if not os.environ.get("RELAX_SGLANG_MODEL"):
        return "RELAX_SGLANG_MODEL is not set (a local checkpoint directory of a small model)"
    return None


MISSING = _missing()
GREEDY = {
    "text": "The capital of France is",
    "sampling_params": {"max_new_tokens": 8, "temperature": 0},
}
pytestmark = [
    pytest.mark.sglang_gpu,
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.skipif(MISSING is not None, reason=str(MISSING)),
]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.status == 200
        return dict(json.loads(resp.read()))


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def test_a_real_sglang_server_serves_offloads_onloads_and_updates_behind_smg(
    ray_local: Any, tmp_path: Any
) -> None:
    model = os.environ["RELAX_SGLANG_MODEL"]
    pm = PluginManager.create()
    router = pm.router("smg").launch(
        RouterLaunchSpec(
            router_id="roles.rollout.models.policy",
            policy="consistent_hashing",
            served_model_name="policy",
            model_path=model,
            log_path=str(tmp_path / "router.log"),
        )
    )
    publisher = RegistryPublisher(
        "rollout",
        RoutingSpec(default_model="policy"),
        weight_sources=pm.registered("weight_sources"),
    )
    manager = InferenceManager(
        "policy",
        spec=InferenceEngineSpec(
            role="rollout", weight_source=pm.weight_source("ACTOR"), weights_cpu_backup=True
        ),
        backend=pm.engine_backend("sglang"),
        launch=ModelLaunch(
            model_path=model,
            served_model_name="policy",
            device="cuda",
            seed=0,
            log_dir=str(tmp_path),
            options=EngineOptions(
                mem_fraction_static=0.5,
                # Outside a placement group Ray assigns no GPU: name the one to use.
                env={"CUDA_VISIBLE_DEVICES": os.environ.get("RELAX_SGLANG_GPU", "0")},
            ),
        ),
        placement=ReplicaPlacement.unplaced(1),
        publisher=publisher,
        route_mode="SGLANG_ROUTER",
        router_url=router.url,
        router=router,
        timeouts=ManagerTimeouts(start=900.0, onload=300.0, offload=300.0, update=600.0),
    )
    pids: list[int] = []
    try:
        router.wait_ready(60)
        manager.start().raise_for_failures()
        pids = [p for ps in manager.engine_pids().values() for p in ps if p]
        assert set(router.workers()) == {"policy/replica-0"}
        view = publisher.snapshot().models["policy"]
        assert view.state.value == "READY" and view.router_url == router.url

        answer = _post(f"{router.url}/generate", GREEDY)
        assert answer["meta_info"]["completion_tokens"] == 8
        prompt = answer["output_ids"][:4]
        prefill = _post(
            f"{router.url}/generate",
            {
                "input_ids": [*prompt, *answer["output_ids"][4:]],
                "sampling_params": {"temperature": 0, "max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": 3,
                "top_logprobs_num": 2,
            },
        )
        assert len(prefill["meta_info"]["input_token_logprobs"]) == len(answer["output_ids"]) - 3

        manager.offload().raise_for_failures()
        assert manager.states() == {"policy/replica-0": "SLEEPING"}
        manager.onload().raise_for_failures()
        assert manager.states() == {"policy/replica-0": "READY"}
        again = _post(f"{router.url}/generate", GREEDY)
        assert again["output_ids"] == answer["output_ids"]  # the CPU backup came back intact

        manager.update_weights_from_disk(model, weight_version="2").raise_for_failures()
        assert publisher.snapshot().models["policy"].weight_version == "2"
    finally:
        manager.shutdown()
        router.terminate(5)
    wait_for(lambda: not any(_pid_alive(p) for p in pids), timeout=60, what="engines gone")
