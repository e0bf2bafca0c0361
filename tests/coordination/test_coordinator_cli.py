"""``relax coordinator``: the reset refuses without the operator's confirmation, before touching
Ray; the status renders every lease, the blocked reason and the failure (text and JSON)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from relax_core.commands.coordinator import _render, _status_dict
from relax_core.coordination import LifecycleCoordinator
from relax_core.manager import LifecycleResult, Outcome, ReplicaResult


class Stuck:
    name = "genrm.judge"

    async def onload(self) -> LifecycleResult:
        replica = ReplicaResult("judge/replica-0", Outcome.FAILED, "FAILED", error="timed out")
        return LifecycleResult("onload", "judge", (replica,))

    async def offload(self) -> LifecycleResult:
        raise AssertionError("never called")


def test_reset_without_confirm_clean_refuses_before_connecting_to_ray() -> None:
    # Nothing listens at this address: connecting would fail differently.
    done = subprocess.run(
        [sys.executable, "-m", "relax_core", "coordinator", "reset", "--address", "127.0.0.1:9",
         "--job", "j", "--role", "genrm"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "refused: confirm first that the genrm engines hold no GPU memory" in done.stderr
    assert "--confirm-clean" in done.stderr


def test_status_shows_the_blocked_lease_its_reason_and_the_run_failure() -> None:
    coordinator = LifecycleCoordinator(
        slices={"rollout": "actor:0-7", "genrm": "actor:0-7"},
        managers={"genrm": [Stuck()]},
        generation_role="rollout",
    )

    async def go() -> None:
        await coordinator.begin_batch(3)
        await coordinator.acknowledge_rollout_offloaded(
            3,
            LifecycleResult("offload", "policy", (ReplicaResult("p/0", Outcome.DONE, "SLEEPING"),)),
        )
        try:
            await coordinator.activate("genrm", "op-1", batch_id=3)
        except Exception as exc:
            assert "BLOCKED" in str(exc)

    asyncio.run(go())
    status = coordinator.status()
    text = _render(status)
    assert "genrm      BLOCKED   slice actor:0-7  (genrm.judge: onload of model 'judge'" in text
    assert "current batch: 3 FAILED" in text and "run failed at batch 3: activate genrm" in text
    data = json.loads(json.dumps(_status_dict(status)))
    assert data["leases"] == {"rollout": "SLEEPING", "genrm": "BLOCKED"}
    assert data["failure"]["batch_id"] == 3 and data["deferred_roles"] == ["genrm"]
