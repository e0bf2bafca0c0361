"""The reference trainer's two methods on a micro checkpoint: ``train`` waits for the commit,
takes one optimizer step over the batch and deletes its partition; ``push`` sends every weight,
in the checkpoint's dtype and names, to the generation model's manager in one update."""

from __future__ import annotations

import base64
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from relax_torch_trainer import GRPOOptions, PolicyTrainer

from relax_core import BatchFailedError, LifecycleError, Sample, TrainerContext


class _Coordinator:
    """Commits the batches it is told to; a failed batch raises as the real one does."""

    def __init__(self, failed: Sequence[int] = ()) -> None:
        self.failed = set(failed)
        self.waited: list[tuple[int, float]] = []

    async def wait_committed(self, batch_id: int, timeout: float) -> Any:
        self.waited.append((batch_id, timeout))
        if batch_id in self.failed:
            raise BatchFailedError(batch_id, "the reward stage failed")
        return SimpleNamespace(partition=f"train_{batch_id}")


class _Sink:
    def __init__(self, partitions: dict[str, list[Sample]]) -> None:
        self.partitions = partitions

    async def get(self, partition: str) -> list[Sample]:
        return list(self.partitions[partition])

    async def delete(self, partition: str) -> None:
        del self.partitions[partition]


def _samples(policy: Any) -> list[Sample]:
    """Two groups of two on-policy samples (their rollout log-probs are the policy's own)."""
    out = []
    for i, (group, reward) in enumerate([("a", 1.0), ("a", 0.0), ("b", 0.0), ("b", 1.0)]):
        prompt, response = [1, 2, 3 + i], [10 + i, 20 + i, 30 + i]
        ids = torch.tensor([[*prompt, *response]])
        with torch.no_grad():
            lp = torch.log_softmax(policy(ids)[0, len(prompt) - 1 : -1], -1)
        own = lp.gather(-1, torch.tensor(response)[:, None])[:, 0]
        out.append(
            Sample(
                f"s{i}",
                group,
                prompt,
                response,
                rollout_logprobs=own.tolist(),
                fields={"reward": reward},
            )
        )
    return out


def _trainer(tiny: Path, **context: Any) -> PolicyTrainer:
    fields: dict[str, Any] = {"coordinator": _Coordinator(), "sink": _Sink({}), "rollout": None}
    fields.update(context)
    return PolicyTrainer(TrainerContext(job="t", model_path=str(tiny), **fields))


def test_train_waits_for_the_commit_steps_once_and_deletes_the_partition(tiny: Path) -> None:
    trainer = _trainer(tiny, options=GRPOOptions(learning_rate=1e-3), micro_batch=3)
    samples = _samples(trainer.policy)
    trainer.context.sink.partitions["train_0"] = samples
    before = {n: t.clone() for n, t in trainer.policy.named_weights()}
    out = trainer.train(0)
    assert trainer.context.coordinator.waited == [(0, trainer.context.commit_timeout)]
    assert trainer.context.sink.partitions == {}
    assert out["partition"] == "train_0" and out["samples"] == 4 and out["tokens"] == 12
    assert out["sample_ids"] == ["s0", "s1", "s2", "s3"] and out["optimizer_steps"] == 1
    # On-policy, over two micro-batches: the ratio is 1 and nothing is clipped.
    assert out["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and out["clip_fraction"] == 0.0
    assert out["teacher_kl"] is None and out["grad_norm"] > 0
    after = dict(trainer.policy.named_weights())
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert trainer.describe()["steps"] == 1


def test_a_failed_batch_is_raised_and_nothing_is_trained_on(tiny: Path) -> None:
    trainer = _trainer(tiny, coordinator=_Coordinator(failed=[3]))
    with pytest.raises(BatchFailedError, match="batch 3 FAILED: the reward stage failed"):
        trainer.train(3)
    assert trainer.steps == 0


class _Rollout:
    """The generation model's manager actor, as far as a push sees it."""

    def __init__(self, ok: bool = True) -> None:
        self.ok = ok
        self.version: str | None = None
        self.payloads: list[tuple[list[str], str | None]] = []

    def update_weights_from_tensor(
        self,
        payloads: list[str],
        *,
        load_format: str | None,
        weight_version: str,
        buckets: Sequence[Sequence[str]] = (),
    ) -> Any:
        self.payloads.extend((list(p), load_format) for p in [payloads, *buckets] if p)
        if not self.ok:
            failed = [SimpleNamespace(engine_id="rollout-0", error="refused")]
            return SimpleNamespace(ok=False, failed=failed)
        self.version = weight_version
        return SimpleNamespace(ok=True, failed=[])

    def weight_version(self) -> str | None:
        return self.version

    def pushed(self) -> list[tuple[list[str], str | None]]:
        return self.payloads


@pytest.mark.ray
def test_push_sends_every_weight_in_one_update_and_returns_the_published_version(
    tiny: Path, ray_local: Any
) -> None:
    from ray import cloudpickle
    from safetensors.torch import load

    # The actor class is this file's, which Ray's workers cannot import by name.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    rollout = ray_local.remote(_Rollout).remote()
    trainer = _trainer(tiny, rollout=rollout)
    out = trainer.push("7")
    assert out["weight_version"] == "7" and out["format"] == "safetensors"
    assert out["buckets"] == 1  # the micro model is far below the default bucket size
    ((payloads, load_format),) = ray_local.get(rollout.pushed.remote())
    assert load_format == "safetensors" and len(payloads) == 1
    sent = load(base64.b64decode(payloads[0]))
    ours = dict(trainer.policy.named_weights())
    assert set(sent) == set(ours) and all(torch.equal(sent[n], ours[n]) for n in ours)
    assert out["bytes"] == sum(t.numel() * t.element_size() for t in ours.values())


@pytest.mark.ray
def test_a_push_in_small_buckets_is_one_manager_call_of_one_file_per_bucket(
    tiny: Path, ray_local: Any
) -> None:
    from ray import cloudpickle
    from safetensors.torch import load

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    rollout = ray_local.remote(_Rollout).remote()
    ours = dict(_trainer(tiny).policy.named_weights())
    largest = max(t.numel() * t.element_size() for t in ours.values())
    trainer = _trainer(tiny, rollout=rollout, push_bucket_bytes=largest // 2)
    out = trainer.push("8")
    pushed = ray_local.get(rollout.pushed.remote())
    assert out["buckets"] == len(pushed) > 1 and out["weight_version"] == "8"
    files = [load(base64.b64decode(payloads[0])) for payloads, _ in pushed]
    # Every weight once; the largest alone in its bucket.
    names = [n for f in files for n in f]
    assert sorted(names) == sorted(ours) and len(names) == len(ours)
    assert any(len(f) == 1 and next(iter(f.values())).nbytes == largest for f in files)
    assert all(torch.equal(f[n], ours[n]) for f in files for n in f)


@pytest.mark.ray
def test_a_push_some_replica_refused_is_an_error_quoting_it(tiny: Path, ray_local: Any) -> None:
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = _trainer(tiny, rollout=ray_local.remote(_Rollout).remote(ok=False))
    with pytest.raises(
        LifecycleError, match=r"2, 1 bucket\(s\)\) was not taken: rollout-0: refused"
    ):
        trainer.push("2")


def test_measure_copy_reports_the_median_of_the_repeats_of_each_size_both_ways(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A clock that makes each copy take a known time: the first copy of each way is the
    # warm-up (1000 s) and must not count; the repeats take 3, 1, 2 s (h2d) and 30, 10, 20 s
    # (d2h), so the medians are 2 and 20 for every size.
    import relax_torch_trainer.trainer as trainer_module

    durations = iter([1000.0, 1000.0, 3.0, 30.0, 1.0, 10.0, 2.0, 20.0] * 2)

    class Clock:
        now = 0.0
        started = False

        def perf_counter(self) -> float:
            if self.started:
                self.now += next(durations)
            self.started = not self.started
            return self.now

    trainer = _trainer(tiny)
    monkeypatch.setattr(trainer_module, "time", Clock())
    copies = trainer.measure_copy([4096, 0, 4096, 1024], repeats=3)
    assert copies == {1024: {"h2d": 2.0, "d2h": 20.0}, 4096: {"h2d": 2.0, "d2h": 20.0}}


def test_save_then_load_into_a_fresh_trainer_continues_the_optimizer_and_the_weights(
    tiny: Path, tmp_path: Path
) -> None:
    trainer = _trainer(tiny, options=GRPOOptions(learning_rate=1e-3))
    samples = _samples(trainer.policy)
    trainer.context.sink.partitions["train_0"] = list(samples)
    trainer.train(0)
    saved = trainer.save(str(tmp_path))
    assert saved["optimizer_steps"] == 1
    # The next step, taken by the trainer that saved and by a fresh one that loaded: the same.
    trainer.context.sink.partitions["train_1"] = list(samples)
    expected = trainer.train(1)
    fresh = _trainer(tiny, options=GRPOOptions(learning_rate=1e-3))
    assert fresh.load(str(tmp_path)) == {"optimizer_steps": 1}
    fresh.context.sink.partitions["train_1"] = list(samples)
    got = fresh.train(1)
    assert got["optimizer_steps"] == expected["optimizer_steps"] == 2
    mine = dict(fresh.policy.named_weights())
    for name, tensor in trainer.policy.named_weights():
        assert torch.equal(mine[name], tensor), name


def test_load_of_a_directory_without_a_saved_state_says_where_it_looked(
    tiny: Path, tmp_path: Path
) -> None:
    trainer = _trainer(tiny)
    with pytest.raises(LifecycleError, match=r"trainer\.pt cannot be loaded"):
        trainer.load(str(tmp_path))
