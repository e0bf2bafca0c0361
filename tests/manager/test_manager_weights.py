"""Weight sources through the InferenceManager: ACTOR updates (tensor, distributed, disk) move
the published version behind a fence; DCS loads new checkpoint versions; on real hf engines.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from relax_torch_weights import serialize_named_tensors

from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.schema import RoutingSpec
from relax_core.errors import CapabilityError, LifecycleError
from relax_core.manager import CheckpointDirectory, Outcome, ReplicaState
from relax_core.testing import free_port
from tests.support import manager as support

pytestmark = pytest.mark.ray

S = ReplicaState
VOCAB, HIDDEN = 512, 64  # the micro model's lm_head shape

# Rank 0 of the trainer's broadcast group, in its own process (torch.distributed keeps one
# default group per process).
TRAINER = textwrap.dedent(
    """
    import sys, datetime, torch, torch.distributed as dist
    port, world = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    dist.broadcast(torch.zeros(512, 64), 0)
    dist.destroy_process_group()
    print("broadcast done", flush=True)
    """
)


def version_of(publisher: RegistryPublisher, model: str) -> str | None:
    return publisher.snapshot().models[model].weight_version


def engine_versions(publisher: RegistryPublisher, model: str) -> list[str]:
    out = []
    for engine in publisher.snapshot().models[model].engines:
        status, body, _ = support.http("GET", engine.base_url + "/model_info")
        assert status == 200
        out.append(body["weight_version"])
    return out


@pytest.fixture(scope="module")
def publisher() -> RegistryPublisher:
    return RegistryPublisher("rollout", RoutingSpec(default_model="policy"))


@pytest.fixture(scope="module")
def actor(ray_local: Any, publisher: RegistryPublisher) -> Iterator[Any]:
    manager = support.make_manager(
        model_id="policy", role="rollout", source="ACTOR", replicas=2, publisher=publisher
    )
    with support.managed(manager) as run:
        yield run.manager


def test_actor_model_publishes_the_engines_initial_version(
    actor: Any, publisher: RegistryPublisher
) -> None:
    assert publisher.snapshot().models["policy"].weight_source == "ACTOR"
    assert version_of(publisher, "policy") == engine_versions(publisher, "policy")[0]


def test_before_the_first_push_a_minimum_version_is_not_met_by_the_initial_weights(
    actor: Any, publisher: RegistryPublisher
) -> None:
    """The engines start on version "default"; a stale-weights guard of 12 must wait for a
    push of 12 (the initial version once sorted above every number)."""
    from relax_core import PluginManager
    from tests.support import gateway as gs

    assert version_of(publisher, "policy") == "default"
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
    with gs.gateway("rollout", publisher.snapshot, plugin_manager=PluginManager.create()) as url:
        status, headers, raw = gs.post(
            f"{url}/rollout/generate", body, {"X-Relax-Min-Weight-Version": "12"}
        )
        message = json.loads(raw)["error"]["message"]
        assert status == 503 and headers["retry-after"] == "1", raw
        assert "Nothing sent" in message and "policy/replica-0 on default" in message
        status, _, raw = gs.post(f"{url}/rollout/generate", {**body, "min_weight_version": "12"})
        assert status == 503 and "Nothing sent" in raw.decode()

        assert actor.update_weights_from_disk(support.tiny_model(), weight_version="12").ok
        status, _, raw = gs.post(
            f"{url}/rollout/generate", body, {"X-Relax-Min-Weight-Version": "12"}
        )
        assert status == 200 and json.loads(raw)["meta_info"]["weight_version"] == "12"
        status, _, raw = gs.post(f"{url}/rollout/generate", {**body, "min_weight_version": "12"})
        assert status == 200 and json.loads(raw)["meta_info"]["weight_version"] == "12"


def test_tensor_update_moves_the_published_version(
    actor: Any, publisher: RegistryPublisher
) -> None:
    import torch

    payload = serialize_named_tensors(
        [("lm_head.weight", torch.zeros(VOCAB, HIDDEN))], load_format="safetensors"
    )
    result = actor.update_weights_from_tensor(
        [payload], load_format="safetensors", weight_version="tensor-1"
    )
    assert result.outcomes == {"policy/replica-0": Outcome.DONE, "policy/replica-1": Outcome.DONE}
    assert version_of(publisher, "policy") == "tensor-1"
    assert engine_versions(publisher, "policy") == ["tensor-1", "tensor-1"]
    assert set(actor.states().values()) == {"READY"}
    assert all(e.direct_eligible for e in publisher.snapshot().models["policy"].engines)


def test_disk_update_is_fenced_behind_in_flight_requests(
    actor: Any, publisher: RegistryPublisher
) -> None:
    url = publisher.snapshot().models["policy"].engines[0].base_url
    before = version_of(publisher, "policy")
    answer: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: answer.update(r=support.generate(url, tokens=400)))
    thread.start()
    support.wait_for(
        lambda: support.admission_inflight(actor, "policy/replica-0") == 1,
        timeout=20,
        what="a generation in flight",
    )
    result = actor.update_weights_from_disk(support.tiny_model(), weight_version="disk-7")
    thread.join(60)
    status, body, _ = answer["r"]
    # The update waited for the generation: it finished whole, on the old weights.
    assert status == 200 and body["meta_info"]["weight_version"] == before
    assert result.ok and version_of(publisher, "policy") == "disk-7"
    status, body, _ = support.generate(url)
    assert status == 200 and body["meta_info"]["weight_version"] == "disk-7"
    for rep in actor.replicas():
        assert rep.history[-2:] == [(S.READY, S.DRAINING), (S.DRAINING, S.READY)]


def _streamed(url: str, *, tokens: int, decoding: threading.Event) -> dict[str, Any]:
    """A streamed greedy ``/generate`` of ``tokens`` tokens; ``decoding`` is set once a chunk
    carries a generated token. Returns the last chunk (its ``meta_info`` is the answer's)."""
    sampling = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    body = json.dumps({"text": "hello", "sampling_params": sampling, "stream": True}).encode()
    req = urllib.request.Request(url + "/generate", data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    last: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            last = json.loads(line.removeprefix("data:"))
            if last["meta_info"]["completion_tokens"] > 0:
                decoding.set()
    return last


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_paused_push_keeps_the_request_in_flight_and_records_both_versions(
    actor: Any, publisher: RegistryPublisher, mode: str
) -> None:
    """``update_weights_from_tensor(..., pause=mode)`` (async steps' push): no fence — the
    replica stays READY, its generation in flight is paused, updated and continued, and its
    answer spans the old and the new version."""
    import torch

    url = publisher.snapshot().models["policy"].engines[0].base_url
    before = version_of(publisher, "policy")
    history = [len(rep.history) for rep in actor.replicas()]
    answer: dict[str, Any] = {}
    decoding = threading.Event()
    thread = threading.Thread(
        target=lambda: answer.update(r=_streamed(url, tokens=1500, decoding=decoding))
    )
    thread.start()
    # Admitted is not enough: under load the update could land before the first decode step,
    # and the whole answer would be the new version's. Wait for tokens of the old weights.
    assert decoding.wait(30), "no token of the generation within 30 s"
    payload = serialize_named_tensors(
        [("lm_head.weight", torch.zeros(VOCAB, HIDDEN))], load_format="safetensors"
    )
    result = actor.update_weights_from_tensor(
        [payload], load_format="safetensors", weight_version=f"paused-{mode}", pause=mode
    )
    thread.join(60)
    body = answer["r"]
    assert result.ok and version_of(publisher, "policy") == f"paused-{mode}"
    assert body["meta_info"]["finish_reason"]["type"] == "length"
    spans = body["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == [before, f"paused-{mode}"], spans
    assert 0 < spans[1]["start"] < spans[1]["end"] == 1500
    # Never fenced: no DRAINING in any replica's history.
    for rep, n in zip(actor.replicas(), history, strict=True):
        assert all(S.DRAINING not in step for step in rep.history[n:]), rep.history[n:]
    with pytest.raises(ValueError, match="pause"):
        actor.update_weights_from_tensor([payload], load_format="safetensors", pause="stop")


def test_an_abort_push_ends_the_samples_in_flight_and_the_shape_sends_them_on(
    actor: Any, publisher: RegistryPublisher
) -> None:
    """``push_pause = "abort"``: the push ends the single-turn shape's request in flight (both
    samples, finish ``abort``); the shape sends each on from its tokens with the new weights:
    every sample is whole (its ``max_new_tokens``), its ids and log-probs are the two answers'
    joined, and it carries both versions. The new weights are a zero ``lm_head`` — every token
    equally likely — so the log-probs show which weights made each token. Greedy: the micro
    checkpoint's greedy text never reaches its EOS in the tokens asked for (and a zero head's
    argmax is token 0, not its EOS), so only the push ends a request early."""
    import asyncio
    import math

    import torch

    from relax_core.client.client import InferenceClient
    from relax_core.run.config import RunConfig
    from relax_core.run.data import Prompt
    from relax_core.run.generate import PromptTokenizer, SingleTurn
    from relax_core.run.rollout import GroupRequest

    tokens = 3000
    run = RunConfig(max_new_tokens=tokens, push_pause="abort", request_timeout=120.0)
    tokenizer = PromptTokenizer(support.tiny_model(), where="policy")
    shape = SingleTurn("policy", run, tokenizer=tokenizer)
    answers: list[dict[str, Any]] = []

    class Kept:  # the real client; each answer kept as the engine sent it
        def __init__(self, client: InferenceClient) -> None:
            self.client = client

        async def generate(self, body: dict[str, Any], **kw: Any) -> Any:
            answer = await self.client.generate(body, **kw)
            answers.extend(answer if isinstance(answer, list) else [answer])
            return answer

    async def main() -> list[Any]:
        async with InferenceClient(snapshot_provider=publisher.snapshot) as client:
            request = GroupRequest(0, 0, "b0-p0", Prompt("hello there"), 2, 0.0, 7)
            return await shape.group(request, Kept(client))  # type: ignore[arg-type]

    def push_while_in_flight() -> list[Any]:
        # A real checkpoint's weights first (an earlier test, or attempt, zeroed lm_head).
        assert actor.update_weights_from_disk(support.tiny_model(), weight_version="ckpt-a").ok
        answers.clear()
        out: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: out.update(samples=asyncio.run(main())))
        thread.start()
        support.wait_for(
            lambda: (
                sum(support.admission_inflight(actor, f"policy/replica-{i}") for i in range(2)) == 1
            ),
            timeout=20,
            what="the group's request in flight",
        )
        payload = serialize_named_tensors(
            [("lm_head.weight", torch.zeros(VOCAB, HIDDEN))], load_format="safetensors"
        )
        result = actor.update_weights_from_tensor(
            [payload], load_format="safetensors", weight_version="aborted-1", pause="abort"
        )
        thread.join(120)
        assert result.ok and version_of(publisher, "policy") == "aborted-1"
        return list(out["samples"])

    # The push must reach the engines while the request runs; on a loaded machine it can come
    # after the request's last token (~2 s of decoding here), which leaves nothing to abort
    # and tests nothing: such an attempt (both answers whole, finish "length") is made again.
    for _ in range(3):
        samples = push_while_in_flight()
        first, more = answers[:2], answers[2:]
        finished = [a["meta_info"]["finish_reason"]["type"] for a in first]
        if finished != ["length", "length"]:
            break
    assert finished == ["abort", "abort"]
    assert len(more) == 2 and all(a["meta_info"]["weight_version"] == "aborted-1" for a in more)
    uniform = -math.log(VOCAB)
    for sample, cut in zip(samples, first, strict=True):
        k = len(cut["output_ids"])
        assert 0 < k < tokens and len(sample.response_ids) == tokens
        # the continuations ran at once: each sample's is the one that carries on its tokens
        rest = next(a for a in more if list(sample.response_ids[k:]) == a["output_ids"])
        assert list(sample.response_ids) == [*cut["output_ids"], *rest["output_ids"]]
        assert list(sample.rollout_logprobs) == [
            e[0]
            for e in cut["meta_info"]["output_token_logprobs"]
            + rest["meta_info"]["output_token_logprobs"]
        ]
        assert sample.weight_versions == ((0, "ckpt-a"), (k, "aborted-1"))
        assert all(abs(lp - uniform) < 1e-4 for lp in sample.rollout_logprobs[k:])
        assert not all(abs(lp - uniform) < 1e-4 for lp in sample.rollout_logprobs[:k])


def test_distributed_update_receives_a_broadcast_from_the_trainer(
    actor: Any, publisher: RegistryPublisher
) -> None:
    port = free_port()
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(port), "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        joined = actor.init_weights_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank_offsets=[1, 2],
            world_size=3,
            backend="gloo",
        )
        assert joined.ok, joined
        result = actor.update_weights_from_distributed(
            ["lm_head.weight"], ["float32"], [[VOCAB, HIDDEN]], weight_version="dist-1"
        )
        out, _ = trainer.communicate(timeout=60)
        assert trainer.returncode == 0 and "broadcast done" in out, out
        assert result.ok and version_of(publisher, "policy") == "dist-1"
        assert engine_versions(publisher, "policy") == ["dist-1", "dist-1"]
        assert actor.destroy_weights_update_group().ok
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)


def test_update_of_a_sleeping_model_without_weights_is_refused_before_anything_moves(
    actor: Any, publisher: RegistryPublisher
) -> None:
    actor.offload()
    revision = publisher.snapshot().topology_revision
    try:
        with pytest.raises(LifecycleError, match=r"onload\(\['weights'\]\) first"):
            actor.update_weights_from_disk(support.tiny_model(), weight_version="never")
        assert publisher.snapshot().topology_revision == revision
        # With only the weights back, the update applies and the replicas stay asleep.
        actor.onload(["weights"])
        assert actor.update_weights_from_disk(support.tiny_model(), weight_version="w-2").ok
        assert set(actor.states().values()) == {"SLEEPING"}
        assert version_of(publisher, "policy") == "w-2"
    finally:
        actor.onload()
    assert engine_versions(publisher, "policy") == ["w-2", "w-2"]


def test_a_request_for_a_weight_version_not_yet_published_gets_503_and_succeeds_after_it(
    actor: Any, publisher: RegistryPublisher
) -> None:
    from relax_core import PluginManager
    from tests.support import gateway as gs

    assert actor.update_weights_from_disk(support.tiny_model(), weight_version="100").ok
    # Each head publishes the version it serves.
    heads = publisher.snapshot().models["policy"].engines
    assert [e.weight_version for e in heads] == ["100", "100"]
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
    with gs.gateway("rollout", publisher.snapshot, plugin_manager=PluginManager.create()) as url:
        wants_101 = {"X-Relax-Min-Weight-Version": "101"}
        status, headers, raw = gs.post(f"{url}/rollout/generate", body, wants_101)
        assert status == 503 and headers["retry-after"] == "1", raw
        message = json.loads(raw)["error"]["message"]
        assert 'weight version >= "101"' in message and "policy/replica-0 on 100" in message
        # The body field says the same; an older requirement is met at once.
        assert gs.post(f"{url}/rollout/generate", {**body, "min_weight_version": 101})[0] == 503
        assert gs.post(f"{url}/rollout/generate", {**body, "min_weight_version": "99"})[0] == 200

        assert actor.update_weights_from_disk(support.tiny_model(), weight_version="101").ok
        status, _, raw = gs.post(f"{url}/rollout/generate", body, wants_101)
        assert status == 200 and json.loads(raw)["meta_info"]["weight_version"] == "101"
        status, _, raw = gs.post(f"{url}/rollout/generate", {**body, "min_weight_version": "101"})
        assert status == 200


def test_actor_model_refuses_a_checkpoint_load_it_has_no_directory_for(actor: Any) -> None:
    with pytest.raises(LifecycleError, match="checkpoint_dir"):
        actor.load_checkpoint()


# -- DCS --------------------------------------------------------------------------------------


def test_dcs_model_starts_on_the_newest_version_and_picks_up_a_new_one(
    ray_local: Any, tmp_path: Path
) -> None:
    checkpoints = CheckpointDirectory(tmp_path / "ckpt")
    checkpoints.publish_copy(1, support.tiny_model())
    publisher = RegistryPublisher("rollout", RoutingSpec(default_model="policy"))
    manager = support.make_manager(
        model_id="policy",
        role="rollout",
        source="DCS",
        publisher=publisher,
        checkpoint_dir=str(checkpoints.root),
    )
    with support.managed(manager):
        assert version_of(publisher, "policy") == "1"
        assert engine_versions(publisher, "policy") == ["1"]
        assert manager.load_checkpoint().outcomes == {"policy/replica-0": Outcome.NOOP}

        checkpoints.publish_copy(2, support.tiny_model())
        result = manager.load_checkpoint()
        assert result.outcomes == {"policy/replica-0": Outcome.DONE}
        assert version_of(publisher, "policy") == "2"
        assert engine_versions(publisher, "policy") == ["2"]
        with pytest.raises(CapabilityError, match="DCS"):
            manager.update_weights_from_tensor(["x"])


def test_checkpoint_directory_lists_only_complete_versions(tmp_path: Path) -> None:
    checkpoints = CheckpointDirectory(tmp_path)
    assert checkpoints.latest() is None
    (tmp_path / ".version-3.tmp-abc").mkdir()
    (tmp_path / "version-x").mkdir()
    checkpoints.publish(1, lambda d: Path(d, "config.json").write_text("{}"))
    checkpoints.publish(10, lambda d: Path(d, "config.json").write_text("{}"))
    assert checkpoints.versions() == [1, 10] and checkpoints.latest() == 10
    with pytest.raises(FileExistsError, match="immutable"):
        checkpoints.publish(10, lambda d: None)

    def broken(directory: str) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        checkpoints.publish(11, broken)
    assert checkpoints.versions() == [1, 10]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".version-11")] == []
