"""The reference trainer's bucketed weight push, on real hf engines behind a manager actor.

One manager actor of two hf replicas (the micro model, seed 0) serves the whole module; each
test starts the reference trainer (``grpo``) in its own Ray actor, as ``relax run`` does, on a
checkpoint of the same shape with other weights (seed 1), and pushes them. What the engines hold
afterwards is read back parameter by parameter (``/get_weights_by_name`` on each engine's own
port) and compared bit for bit with the trainer's checkpoint.

- a push over a gloo broadcast group (``push_format = "distributed"``) lands the same bytes
  whatever the bucket size, with a parameter larger than a bucket (it travels alone), and the
  version moves once; so does a push of safetensors buckets;
- a push that fails mid-way (a bucket that does not fit its parameter; a trainer that stops
  broadcasting after its first bucket) names each replica and the bucket that failed, and the
  published version and the engines' own stay the old one. Each failure test rebuilds the
  FAILED replicas on its way out, so the module's manager stays usable.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from relax_torch_weights import serialize_named_tensors

from relax_core.engine.buckets import plan_weight_buckets
from relax_core.manager import ModelLaunch, ReplicaPlacement
from relax_core.manager.actor import start_manager_actor
from relax_core.run.trainer import TrainerContext, start_trainer
from relax_core.testing import free_port, wait_for
from tests.support.manager import FAST, http, pid_alive, placement_group, plugins

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "policy"
ENGINES = [f"{MODEL}/replica-0", f"{MODEL}/replica-1"]

# Rank 0 of a two-bucket push that sends its first bucket and then exits: the engines are left
# waiting for the second.
QUITTER = textwrap.dedent(
    """
    import datetime, os, sys, torch, torch.distributed as dist
    port, world, nbytes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    dist.broadcast(torch.zeros(nbytes, dtype=torch.uint8), 0)
    print("first bucket sent", flush=True)
    os._exit(0)
    """
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The engines' checkpoint (seed 0) and the trainer's (seed 1): same shape, other bytes."""
    from relax_hf.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("bucketed-push")
    return {
        "engines": make_tiny_model(root / "engines", seed=0, size="micro"),
        "trainer": make_tiny_model(root / "trainer", seed=1, size="micro"),
    }


@pytest.fixture(scope="module")
def trained(checkpoints: dict[str, Path]) -> dict[str, Any]:
    """The trainer checkpoint's tensors, by name."""
    from safetensors.torch import load_file

    return dict(load_file(str(checkpoints["trainer"] / "model.safetensors")))


@pytest.fixture(scope="module")
def rollout(ray_local: Any, checkpoints: dict[str, Path]) -> Iterator[Any]:
    """A manager actor of two one-node hf replicas (ACTOR weights), started; shut down at the
    end with every engine process checked gone."""
    pm = plugins()
    group = placement_group(2)
    actor = start_manager_actor(
        MODEL,
        spec=_spec(pm),
        backend=pm.engine_backend("hf"),
        launch=ModelLaunch(model_path=str(checkpoints["engines"]), served_model_name=MODEL),
        placement=ReplicaPlacement(group, [[[0]], [[1]]], ray_gpu_fraction=1.0, owned=True),
        timeouts=FAST,
    )
    pids: set[int] = set()
    try:
        assert ray_local.get(actor.start.remote()).ok
        yield actor
    finally:
        pids.update(p for ps in ray_local.get(actor.engine_pids.remote()).values() for p in ps if p)
        ray_local.get(actor.shutdown.remote(), timeout=120)
        ray_local.kill(actor)
        wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=30, what="engines gone")


def _spec(pm: Any) -> Any:
    from relax_core.engine.spec import InferenceEngineSpec

    return InferenceEngineSpec(role="rollout", weight_source=pm.weight_source("ACTOR"))


def _engine_urls(ray: Any, rollout: Any) -> list[str]:
    """Each replica's engine port (the admission server in front of it refuses weight reads)."""
    urls = []
    for engine_id in ENGINES:
        head = ray.get(rollout.workers.remote(engine_id))[0]
        urls.append(ray.get(head.actor.__ray_call__.remote(lambda worker: worker.control.base_url)))
    return urls


def _engine_weights(url: str, names: list[str]) -> dict[str, Any]:
    """Every named parameter as the engine holds it (``/get_weights_by_name``, whole)."""
    import torch

    out = {}
    for name in names:
        status, body, _ = http(
            "POST", url + "/get_weights_by_name", {"name": name, "truncate_size": 1 << 30}
        )
        assert status == 200, body
        out[name] = torch.tensor(body, dtype=torch.float64)
    return out


def _engine_versions(ray: Any, rollout: Any) -> list[str]:
    versions = []
    for url in _engine_urls(ray, rollout):
        status, body, _ = http("GET", url + "/model_info")
        assert status == 200
        versions.append(body["weight_version"])
    return versions


def _same_bytes(held: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """Names whose values differ (the engines' float64 readout against the checkpoint's)."""
    import torch

    return [n for n, t in wanted.items() if not torch.equal(held[n], t.to(torch.float64))]


def _reset(ray: Any, rollout: Any, checkpoints: dict[str, Path]) -> None:
    """The engines back on their own checkpoint, so a push must change every byte it sends."""
    done = ray.get(
        rollout.update_weights_from_disk.remote(str(checkpoints["engines"]), weight_version="ckpt")
    )
    assert done.ok, done


def _push(ray: Any, rollout: Any, path: Path, version: str, **context: Any) -> dict[str, Any]:
    trainer = start_trainer(
        TrainerContext(
            job="bucketed-push",
            model_path=str(path),
            coordinator=None,
            sink=None,
            rollout=rollout,
            **context,
        ),
        trainer="grpo",
    )
    try:
        out: dict[str, Any] = ray.get(trainer.push.remote(version), timeout=240)
        return out
    finally:
        ray.kill(trainer)


@pytest.mark.parametrize("bucket_bytes", [None, 40_000, 1 << 20], ids=["tiny", "40k", "1MiB"])
def test_a_distributed_push_lands_the_same_bytes_whatever_the_bucket_size(
    ray_local: Any,
    rollout: Any,
    checkpoints: dict[str, Path],
    trained: dict[str, Any],
    bucket_bytes: int | None,
) -> None:
    sizes = {n: t.numel() * t.element_size() for n, t in trained.items()}
    # None: a bucket smaller than the largest parameter, which then travels alone.
    size = bucket_bytes or max(sizes.values()) // 3
    planned = plan_weight_buckets(trained.items(), size)
    _reset(ray_local, rollout, checkpoints)
    urls = _engine_urls(ray_local, rollout)
    assert _same_bytes(_engine_weights(urls[0], list(trained)), trained) != []
    out = _push(
        ray_local,
        rollout,
        checkpoints["trainer"],
        f"dist-{size}",
        push_format="distributed",
        push_bucket_bytes=size,
    )
    assert out["weight_version"] == f"dist-{size}" and out["format"] == "distributed"
    # The trainer's order of parameters is its own: the count is bounded, not fixed.
    assert len(planned) // 2 <= out["buckets"] <= 2 * len(planned)
    assert out["bytes"] == sum(sizes.values())
    if bucket_bytes is None:
        largest = max(sizes, key=sizes.__getitem__)
        assert (largest,) in [b.names for b in planned] and len(planned) > 2
    for url in urls:
        assert _same_bytes(_engine_weights(url, list(trained)), trained) == []
    assert _engine_versions(ray_local, rollout) == [f"dist-{size}"] * 2
    assert ray_local.get(rollout.weight_version.remote()) == f"dist-{size}"
    assert set(ray_local.get(rollout.states.remote()).values()) == {"READY"}


def test_a_push_of_safetensors_buckets_lands_the_bytes_of_a_push_in_one_piece(
    ray_local: Any, rollout: Any, checkpoints: dict[str, Path], trained: dict[str, Any]
) -> None:
    urls = _engine_urls(ray_local, rollout)
    held = []
    for size in (1 << 30, 30_000):
        _reset(ray_local, rollout, checkpoints)
        out = _push(
            ray_local, rollout, checkpoints["trainer"], f"st-{size}", push_bucket_bytes=size
        )
        assert out["weight_version"] == f"st-{size}"
        held.append(_engine_weights(urls[1], list(trained)))
    assert _same_bytes(held[0], trained) == [] and _same_bytes(held[1], trained) == []
    assert _engine_versions(ray_local, rollout) == ["st-30000"] * 2


def _recover(ray: Any, rollout: Any) -> None:
    """Rebuild the FAILED replicas (a failed push leaves them so), then wait for READY."""
    rebuilt = ray.get(rollout.recover.remote(), timeout=240)
    assert rebuilt.ok, rebuilt  # a rebuild that failed says why here, not as a timeout below
    wait_for(
        lambda: set(ray.get(rollout.states.remote()).values()) == {"READY"},
        timeout=240,
        what="both replicas READY again",
    )


def test_a_bucket_that_does_not_fit_its_parameter_fails_the_push_and_keeps_the_old_version(
    ray_local: Any, rollout: Any, checkpoints: dict[str, Path], trained: dict[str, Any]
) -> None:
    _reset(ray_local, rollout, checkpoints)
    names = list(trained)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    wrong = next(n for n in reversed(second) if trained[n].dim() > 1)
    bad = dict(trained)
    bad[wrong] = trained[wrong].reshape(-1)  # the right bytes, the wrong shape
    payloads = [
        [serialize_named_tensors([(n, bad[n]) for n in part], load_format="safetensors")]
        for part in (first, second)
    ]
    try:
        result = ray_local.get(
            rollout.update_weights_from_tensor.remote(
                [], buckets=payloads, load_format="safetensors", weight_version="never"
            )
        )
        assert not result.ok and sorted(r.engine_id for r in result.failed) == ENGINES
        for failed in result.failed:
            assert "bucket 2 of 2 failed (buckets 1-1 of the new weights are loaded" in failed.error
            assert failed.engine_id in failed.error and wrong in failed.error
        assert ray_local.get(rollout.weight_version.remote()) == "ckpt"
        assert _engine_versions(ray_local, rollout) == ["ckpt", "ckpt"]
        assert set(ray_local.get(rollout.states.remote()).values()) == {"FAILED"}
    finally:
        _recover(ray_local, rollout)


def test_a_trainer_that_stops_broadcasting_fails_the_push_and_keeps_the_old_version(
    ray_local: Any, rollout: Any, checkpoints: dict[str, Path], trained: dict[str, Any]
) -> None:
    _reset(ray_local, rollout, checkpoints)
    buckets = plan_weight_buckets(trained.items(), sum(t.nbytes for t in trained.values()) // 2)
    assert len(buckets) >= 2
    port = free_port()
    quitter = subprocess.Popen(
        [sys.executable, "-c", QUITTER, str(port), "3", str(buckets[0].nbytes)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        joined = ray_local.get(
            rollout.init_weights_update_group.remote(
                master_address="127.0.0.1",
                master_port=port,
                rank_offsets=[1, 2],
                world_size=3,
                group_name="quitter",
                backend="gloo",
            )
        )
        assert joined.ok, joined
        result = ray_local.get(
            rollout.update_weights_from_distributed.remote(
                [],
                [],
                [],
                group_name="quitter",
                weight_version="never",
                load_format="flattened_bucket",
                buckets=buckets,
            ),
            timeout=240,
        )
        out, _ = quitter.communicate(timeout=60)
        assert "first bucket sent" in out, out
        assert not result.ok and sorted(r.engine_id for r in result.failed) == ENGINES
        for failed in result.failed:
            assert f"bucket 2 of {len(buckets)} failed" in failed.error, failed.error
            assert failed.engine_id in failed.error
            # Noticed when the trainer's connections closed: the engine answered the bucket
            # with its error; the control call's deadline did not end it.
            assert "no answer within" not in failed.error, failed.error
        assert ray_local.get(rollout.weight_version.remote()) == "ckpt"
        assert _engine_versions(ray_local, rollout) == ["ckpt", "ckpt"]
    finally:
        if quitter.poll() is None:
            quitter.kill()
            quitter.wait(10)
        _recover(ray_local, rollout)
