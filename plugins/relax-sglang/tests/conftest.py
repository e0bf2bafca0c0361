"""Fixtures of the relax-sglang tests: counting workers, routers as the plugin runs them."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from relax_sglang.router import SGLANG_ROUTER, SMG, RouterKind, RouterServer

from relax_core import RouterLaunchSpec, SubprocessEngineProcess
from relax_core.testing import free_port

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
